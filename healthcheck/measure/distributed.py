"""A worker's ``torch.distributed`` plumbing: rank discovery, device/backend choice, init, teardown
and the collectives the monitor and the audits use.

Nothing else in the package reads ``RANK``/``WORLD_SIZE`` or calls ``torch.distributed`` collectives
directly; the launcher side (forking workers, signals, failure text) is :mod:`healthcheck.run.launcher`.
torch is imported inside functions so that ``healthcheck config show`` and friends stay fast.

Under an external launcher every process is one worker::

    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        -m healthcheck probe --config probe.yaml
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import socket
from typing import Any, Callable, Iterator

from healthcheck.errors import InvalidInput

BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
#: Address of single-node launches; numeric so that forked workers never call the resolver.
LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0  #: torchrun's GROUP_RANK: which agent (node) started this worker
    node: str = dataclasses.field(default_factory=socket.gethostname)


def launched_externally() -> bool:
    """True under torchrun/SLURM-with-torchrun, where the launcher already set ``RANK``/``WORLD_SIZE``."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def get_dist_info() -> DistInfo:
    """Read the launcher's environment (the only place the package does)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
        node_rank=int(os.environ.get("GROUP_RANK", "0")),
    )


# --------------------------------------------------------------------------- devices


#: The start of both NPU errors: the launcher's (torch_npu not installed) and a worker's (its import failed).
_NPU_NEEDS = "distributed.device: 'npu' needs torch_npu (install with: pip install 'healthcheck[npu]')"


def _import_torch_npu() -> None:
    # Ascend support is isolated here: torch_npu registers the "npu" device and the hccl backend
    # on import, and it is only ever imported when the user asked for an NPU.
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise InvalidInput(
            f"{_NPU_NEEDS}; import failed: {exc}"
        ) from None


def npu_missing_error(requested: str) -> str | None:
    """The one-line error when ``requested`` is "npu" and torch_npu is not installed, else None.

    Found without importing torch_npu (its import registers a device), so the launcher can refuse the
    config before any worker starts; a worker that fails to import it still says why (:func:`resolve_device`).

    >>> npu_missing_error("cpu") is None
    True
    """
    import importlib.util
    import sys

    # A module already imported may carry no spec (find_spec then raises): being there is enough.
    if requested != "npu" or "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None:
        return None
    return f"{_NPU_NEEDS}; it is not installed"


def resolve_device(requested: str, local_world_size: int = 1) -> str:
    """Map ``auto``/``cpu``/``cuda``/``npu`` to a concrete device type, or fail clearly.

    ``auto`` picks cuda when there is one GPU per local worker (NCCL refuses two ranks on one
    GPU), else cpu. NPUs are never picked implicitly: importing torch_npu has side effects.

    >>> resolve_device("cpu")
    'cpu'
    """
    import torch

    if requested == "cpu":
        return "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise InvalidInput("distributed.device: 'cuda' requested but torch.cuda.is_available() is False")
        if torch.cuda.device_count() < local_world_size:
            raise InvalidInput(
                f"distributed.device: 'cuda' needs one GPU per local worker; have {torch.cuda.device_count()}, nproc is {local_world_size}"
            )
        return "cuda"
    if requested == "npu":
        _import_torch_npu()
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise InvalidInput("distributed.device: 'npu' requested but torch.npu.is_available() is False")
        return "npu"
    if requested == "auto":
        if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
            return "cuda"
        return "cpu"
    raise InvalidInput(f"distributed.device: expected auto, cpu, cuda or npu, got {requested!r}")


def device_reason(requested: str, resolved: str, local_world_size: int = 1) -> str:
    """Why ``requested`` became ``resolved``, for result.json (a choice records its reason).

    >>> device_reason("auto", "cpu", 8)
    'device=auto: no CUDA device is visible, so the workers run on the CPU'
    """
    if requested != "auto":
        return f"device={requested} was requested"
    if resolved == "cuda":
        return f"device=auto: {local_world_size} local workers and at least as many GPUs, so one GPU per worker"
    import torch

    if not torch.cuda.is_available():
        return "device=auto: no CUDA device is visible, so the workers run on the CPU"
    return (
        f"device=auto: {torch.cuda.device_count()} GPU(s) for {local_world_size} local workers; NCCL needs one GPU "
        f"per worker, so the workers run on the CPU"
    )


def resolve_backend(requested: str, device_type: str) -> str:
    """``auto`` maps cpu→gloo, cuda→nccl, npu→hccl; an explicit backend is kept.

    >>> resolve_backend("auto", "cuda")
    'nccl'
    >>> resolve_backend("gloo", "cuda")
    'gloo'
    """
    if requested == "auto":
        return BACKEND_FOR_DEVICE[device_type]
    return requested


def torch_device(device_type: str, local_rank: int):
    """The ``torch.device`` this worker computes on."""
    import torch

    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, local_rank)


# --------------------------------------------------------------------------- process group


def init_distributed(device_type: str, backend: str, timeout_s: float) -> DistInfo:
    """Create the default process group once (idempotent) and return this worker's place in it."""
    import torch
    import torch.distributed as dist

    info = get_dist_info()
    if dist.is_initialized():
        return info
    kwargs: dict[str, Any] = {}
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
        kwargs["device_id"] = torch.device("cuda", info.local_rank)
    elif device_type == "npu":
        torch.npu.set_device(info.local_rank)  # type: ignore[attr-defined]
    with terminable_while_joining():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return info


@contextlib.contextmanager
def terminable_while_joining() -> Iterator[None]:
    """SIGTERM ends this worker at once while it joins the process group (on the main thread; elsewhere, nothing).

    Why: a rank that fails before it joins (a broken config on its node, a missing file) leaves the others waiting
    in ``init_process_group``'s rendezvous, inside C++, where the Python handler of the SIGTERM the elastic agent
    sends them never runs; torch's process context then waits 30 s before its SIGKILL, and a probe whose rank 1
    raised at its first line took 32 s to exit 3. Nothing is measured before the group exists, so nothing is lost.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        # None: the handler was not installed from Python, and cannot be put back from it.
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def destroy_distributed() -> None:
    """Tear the default process group down if this process created one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size(group=None) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def rank(group=None) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def all_gather_rows(tensor, group=None):
    """Gather a tensor from every rank into an ``[N, numel]`` tensor, in rank order.

    The output buffer is flat because ProcessGroupGloo rejects a 2-D one ("invalid tensor size
    at index 0"); ``all_gather_single`` replaces the deprecated ``all_gather_into_tensor``.
    """
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    flat = tensor.reshape(-1).contiguous()
    out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=group)
    return out.view(n, flat.numel())


def all_gather_rows_async(tensor, group=None):
    """Start :func:`all_gather_rows` without waiting: ``(work, rows)``; read ``rows`` after ``work.wait()``.

    The caller keeps ``tensor`` alive (and unchanged) until then: the collective reads it in the background.
    """
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    flat = tensor.reshape(-1).contiguous()
    out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(out, flat, group=group, async_op=True)
    return work, out.view(n, flat.numel())


def all_reduce_async(tensor, group=None):
    """Start an in-place SUM all-reduce and return its ``torch.futures.Future``.

    The process group's own ``allreduce``, which ``dist.all_reduce`` ends in: the DDP hook starts one per bucket and
    step, and the wrapper's Python (argument checks, a coalescing lookup, new options) cost ~20 µs a call on an idle
    core, more among 8 ranks on 2 cores. For a plain real tensor on a process group this rank belongs to (a gradient
    bucket on the model's group), none of what it checks applies. Anything else (no group, a tensor subclass with
    ``__torch_function__``, a complex tensor, inside a coalescing block) goes through the wrapper.
    """
    import torch
    import torch.distributed as dist

    coalescing = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_coalesce_state", None)
    direct = isinstance(group, dist.ProcessGroup) and type(tensor) is torch.Tensor and not tensor.is_complex()
    if not direct or coalescing:
        return dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return group.allreduce([tensor], _sum_options()).get_future()


def mean_all_reduce_async(tensor, world: int, group=None):
    """Divide ``tensor`` by ``world`` in place and all-reduce it, as torch's default DDP ``allreduce_hook`` does; a
    future of the averaged tensor (what a DDP comm hook returns)."""
    tensor.div_(world)
    return all_reduce_async(tensor, group).then(first_value)


def first_value(future):
    """An all-reduce future's tensor: what a DDP comm hook's future must hold (``Future.then`` callback)."""
    return future.value()[0]


@functools.lru_cache(maxsize=1)
def _sum_options() -> Any:
    """One ``AllreduceOptions`` for every asynchronous SUM (the backends only read it)."""
    import torch.distributed as dist

    options = dist.AllreduceOptions()
    options.reduceOp, options.asyncOp = dist.ReduceOp(dist.ReduceOp.SUM), True
    return options


def all_to_all_single(output, tensor, group=None) -> None:
    """Row r of ``tensor`` goes to rank r; row j of ``output`` comes from rank j (both ``[world, n]``)."""
    import torch.distributed as dist

    dist.all_to_all_single(output, tensor, group=group)


def group_ranks(group=None) -> list[int]:
    """The global ranks in ``group``, in group-rank order."""
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))


def all_gather_objects(obj: Any, group=None) -> list[Any]:
    """Gather one picklable object per rank (small control data only, never tensors of size)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Rank ``src``'s object, on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def broadcast(tensor, src: int, group=None) -> None:
    """Rank ``src``'s ``tensor`` into ``tensor`` on every rank, in place (same shape and dtype everywhere)."""
    import torch.distributed as dist

    dist.broadcast(tensor, src=src, group=group)


def timeout_s(group=None) -> float:
    """The group's collective timeout in seconds, for a wait that is not a collective (the shared rows); torch's
    default where the backend's options cannot be read (private names: torch keeps no public accessor)."""
    import torch
    import torch.distributed as dist

    try:
        backend = (group if group is not None else dist.group.WORLD)._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return float(dist.default_pg_timeout.total_seconds())


def wait_until(done: Callable[[], bool], timeout_s: float, max_pause_s: float) -> bool:
    """Poll ``done`` until it is true or ``timeout_s`` passed; whether it became true. The pause doubles from 50 µs
    up to ``max_pause_s``: what is polled here (a peer's row, an asynchronous collective) is usually in already,
    and a peer may be gone for good, so a wait that blocks would never return."""
    import time

    deadline, pause = time.monotonic() + timeout_s, 5e-5
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, max_pause_s)
    return True


def barrier(group=None) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)


def set_worker_threads(local_world_size: int) -> None:
    """Share the host's cores between the local workers instead of oversubscribing them."""
    import torch

    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, local_world_size)))

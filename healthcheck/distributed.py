"""All ``torch.distributed`` plumbing: rank discovery, device/backend choice, init, teardown,
collectives, rank-0 printing and the local launcher.

Nothing else in the package reads ``RANK``/``WORLD_SIZE`` or calls ``torch.distributed`` directly.
torch is imported inside functions so that ``healthcheck config show`` and friends stay fast.

Run a probe under an external launcher (this module then joins as one worker)::

    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        -m healthcheck probe --config probe.yaml
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable

from healthcheck.errors import InvalidInput, ProbeFailed

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


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only."""
    if get_dist_info().rank == 0:
        print(*args, **kwargs)


# --------------------------------------------------------------------------- devices


def _import_torch_npu() -> None:
    # Ascend support is isolated here: torch_npu registers the "npu" device and the hccl backend
    # on import, and it is only ever imported when the user asked for an NPU.
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise InvalidInput(
            "distributed.device: 'npu' needs torch_npu (install with: pip install 'healthcheck[npu]'); "
            f"import failed: {exc}"
        ) from None


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
                f"distributed.device: 'cuda' needs one GPU per local worker; have {torch.cuda.device_count()}, "
                f"nproc is {local_world_size}"
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
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return info


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


def all_reduce_async(tensor, group=None):
    """Start an in-place SUM all-reduce and return its ``torch.futures.Future``."""
    import torch.distributed as dist

    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


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


def barrier(group=None) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)


# --------------------------------------------------------------------------- launcher


def quiet_elastic_logs() -> None:
    """Keep the launcher's own logging out of the CI log.

    The elastic agent logs every rendezvous at INFO and a failed worker's whole traceback at
    ERROR; healthcheck reports failures itself in one line (rank, step, reason) and keeps the
    traceback in ``RUN_DIR/errors/``.
    """
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)


def launch_local(
    entrypoint: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    run_id: str = "healthcheck",
    start_method: str = "fork",
    monitor_interval_s: float = 0.1,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` local workers through torch's elastic launcher.

    This is the code path torchrun takes. The rendezvous listens on ``127.0.0.1:0`` so the OS
    picks a free port and two probes on one machine never collide. Workers are forked from this
    process: torch and transformers are imported once here instead of once per worker, which is
    what lets 8 ranks start on 2 cores in under a second.

    Returns ``{rank: return value}``; raises :class:`ProbeFailed` naming the failed rank(s).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    quiet_elastic_logs()
    _protect_forked_workers()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend="c10d",
        # Numeric loopback, never a host name: the workers are forked from a process whose threads
        # (the agent's store and keep-alive) may hold glibc's resolver lock at fork time, and a
        # child that then resolves "localhost" waits on that lock forever. A numeric address skips
        # the resolver, and MASTER_ADDR comes from local_addr instead of a getfqdn() lookup.
        rdzv_endpoint=f"{LOOPBACK}:0",
        local_addr=LOOPBACK,
        max_restarts=0,
        monitor_interval=monitor_interval_s,
        start_method=start_method,
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        failed = ProbeFailed(describe_child_failure(exc))
        failed.signals = {rank: -f.exitcode for rank, f in exc.failures.items() if f.exitcode is not None and f.exitcode < 0}
        raise failed from None


_fork_hook_installed = False


def _protect_forked_workers() -> None:
    """Keep a forked worker from running destructors of the launcher's garbage.

    A long-lived launcher (``baseline record``, the scenario sweeps, a test session) holds the
    dead objects of earlier launches: agents, TCPStore servers, process groups. A forked worker
    inherits them, and when its garbage collector frees them their C++ destructors act on threads
    and sockets that do not exist in the child: a segfault or a deadlock before the worker joins
    the process group. Collecting in the launcher first, and freezing everything a worker
    inherits (Python's documented fork recipe, ``gc.freeze``), means only the worker's own objects
    are ever collected in the worker.
    """
    global _fork_hook_installed
    gc.collect()
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=gc.freeze)
        _fork_hook_installed = True


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interrupts_as_keyboard_interrupt():
    """Treat SIGTERM like Ctrl-C while a probe runs, so both end in the same clean 'interrupted' path.

    While workers run, the elastic agent installs its own SIGTERM/SIGINT handlers, shuts the
    workers down and raises ``SignalException``; that too becomes ``KeyboardInterrupt`` here.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    if on_main_thread:
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        yield
    except SignalException as exc:
        raise KeyboardInterrupt(str(exc)) from None
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def describe_child_failure(exc) -> str:
    """One line naming each failed rank and why, from a ``ChildFailedError``."""
    parts = []
    for rank_id, failure in sorted(exc.failures.items()):
        message = failure.message
        if isinstance(message, dict):  # newer torch wraps the error file's message in a dict
            message = message.get("message", "")
        message = message if isinstance(message, str) else ""
        if not message or message.startswith("To enable traceback"):
            message = f"exit code {failure.exitcode}"
            if failure.exitcode is not None and failure.exitcode < 0:
                message = f"killed by signal {-failure.exitcode}"
        parts.append(f"rank {rank_id}: {message.strip().splitlines()[-1] if message.strip() else message}")
    return "worker failure: " + "; ".join(parts)


def set_worker_threads(local_world_size: int) -> None:
    """Share the host's cores between the local workers instead of oversubscribing them."""
    import torch

    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, local_world_size)))


def is_interactive() -> bool:
    return sys.stdout.isatty()


ENV_PREFIXES = ("NCCL_", "HCCL_", "TORCH_", "CUDA_VISIBLE_DEVICES", "ASCEND_")


def rank_environment() -> dict[str, str]:
    """The communication/runtime variables that must agree across ranks (for the environment audit)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def device_name(device) -> str:
    """Human name of a device: the GPU model, or the CPU's."""
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    return platform.processor() or platform.machine() or "cpu"


def prepare_fork() -> None:
    """Settings the launcher needs before it forks workers.

    The tokenizers library runs a Rust thread pool; after a fork its workers would deadlock, so
    the launcher disables it before it tokenizes anything.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


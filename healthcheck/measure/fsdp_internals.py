"""Everything healthcheck touches of FSDP2's (``fully_shard``) private API, in one place (torch 2.13).

FSDP2 calls a parameter group's reduce-scatter comm once per synchronising backward with this rank's
flat, zero-padded, *unsharded* local gradient of the group (viewed ``(W, S)``: row r is what rank r
will own), possibly pre-divided, before the reduce-scatter. The public hook is
``FSDPModule.set_custom_reduce_scatter(comm)``; the comm protocol (``ReduceScatter``: ``allocate`` and
``__call__(output_tensor, input_tensor, group, op, async_op)``), the parameter groups and the divide
factors are private. The capture test (``tests/multiprocess/test_fsdp_monitor.py``) pins them.

Facts this module relies on (torch/distributed/fsdp/_fully_shard/):

* ``set_custom_reduce_scatter`` sets only that module's groups (not recursive) and refuses modules with
  several parameter groups; those get the group's private ``_reduce_scatter_comm`` instead.
* Padding elements of the input are exact zeros, so norms, dot products and a linear sketch over the
  padded buffer are exact.
* For fp32/bf16 reductions the op is AVG and nothing is pre-divided; other reduce dtypes (fp16, fp64) are
  pre-divided by a power of two before the comm (``_get_gradient_divide_factors``).
* World size 1 never calls the comm.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator


def is_fsdp_module(model: Any) -> bool:
    """Whether ``model`` is a module sharded with ``fully_shard`` (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def param_groups(root: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(module, state, param group)`` for every FSDP parameter group under ``root``, in ``root.modules()``
    order (the same on every rank). A state shared by a grouped ``fully_shard([a, b])`` is visited once."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        for group in state._fsdp_param_groups:
            yield module, state, group


def group_settings(root: Any) -> dict[str, str]:
    """Each sharding setting over the model's parameter groups, its distinct values joined: the mixed precision
    policy (whole, and its all-gather and reduce-scatter dtypes), the offload policy, and whether the group
    re-gathers in the backward (reshard after forward). A model without groups gives ``{}``."""
    facts: dict[str, set[str]] = {}
    for _, _, group in param_groups(root):
        policy = group.mp_policy
        for name, value in (
            ("fsdp.mp_policy", str(policy)),
            ("fsdp.param_dtype", str(policy.param_dtype)),
            ("fsdp.reduce_dtype", str(policy.reduce_dtype)),
            ("fsdp.offload_policy", type(group.offload_policy).__name__),
            ("fsdp.reshard_after_forward", str(group.post_forward_mesh_info is not None)),
            ("fsdp.mesh", mesh_layout(group)),
        ):
            facts.setdefault(name, set()).add(value)
    return {name: " | ".join(sorted(values)) for name, values in facts.items()}


def gradient_sync(root: Any) -> str:
    """Whether the next backward reduce-scatters the gradients (``set_requires_gradient_sync``): "on", "off", or
    "on for N of M groups" (a model without groups: "on", FSDP2's default)."""
    flags = sync_flags(root)
    if all(flags):
        return "on"
    return "off" if not any(flags) else f"on for {sum(flags)} of {len(flags)} groups"


def sync_flags(root: Any) -> list[bool]:
    """Each parameter group's gradient-sync switch, to put back with :func:`set_sync_flags` (a replay turns it on)."""
    return [bool(group.reduce_grads) for _, _, group in param_groups(root)]


def set_sync_flags(root: Any, flags: list[bool]) -> None:
    for (_, _, group), flag in zip(param_groups(root), flags, strict=True):
        group.reduce_grads = flag


def mesh_layout(param_group: Any) -> str:
    """``shard 4``, or ``replicate 2 x shard 4`` under HSDP: how a parameter group spreads over the ranks."""
    shard = f"shard {param_group.mesh_info.shard_mesh_size}"
    replicate = getattr(param_group.mesh_info, "replicate_mesh_size", None)
    return f"replicate {replicate} x {shard}" if replicate_group(param_group) is not None and replicate else shard


def root_facts(root: Any) -> dict[str, str]:
    """The sharding settings every rank must share, for the environment audit: each distinct mixed
    precision policy, offload policy and reshard-after-forward choice over the model's parameter groups."""
    settings = group_settings(root)
    return {name: settings.get(name, "?") for name in ("fsdp.mp_policy", "fsdp.offload_policy", "fsdp.reshard_after_forward", "fsdp.mesh")}


def reduce_scatter_group(param_group: Any) -> Any:
    """The process group a parameter group reduce-scatters over."""
    return param_group._reduce_scatter_process_group


def replicate_group(param_group: Any) -> Any:
    """HSDP: the process group a parameter group all-reduces its reduce-scattered shard over (its replicas); None
    for a mesh of one dimension."""
    return getattr(param_group.mesh_info, "replicate_process_group", None)


def time_replica_all_reduce(span: Callable[[], Any]) -> Callable[[], None]:
    """HSDP: FSDP2 all-reduces each reduce-scattered shard over the replicas with a plain ``dist.all_reduce`` in its
    ``_fsdp_collectives`` module, which no comm slot reaches. Route that module's calls through ``span`` (the
    monitor's wait clock: a rank waiting there for a straggler in another replica is waiting, not working).
    Returns the undo."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives.dist

    class TimedDist:
        def __getattr__(self, name: str) -> Any:
            return getattr(original, name)

        def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
            with span():
                return original.all_reduce(*args, **kwargs)

    _fsdp_collectives.dist = TimedDist()  # type: ignore[assignment]  # a stand-in for the module, by attribute

    def restore() -> None:
        _fsdp_collectives.dist = original

    return restore


def mesh_groups(param_group: Any) -> tuple[list[list[int]], list[list[int]]]:
    """The global ranks of every shard group and every replica group of a parameter group's mesh (HSDP: rows and
    columns of its (replicas, shards) grid); on a one-dimensional mesh, one shard group and no replica group."""
    grid = param_group.mesh_info.mesh.mesh
    if grid.ndim < 2:
        return [[int(r) for r in grid.tolist()]], []
    rows = [[int(r) for r in row] for row in grid.tolist()]
    return rows, [list(column) for column in zip(*rows, strict=True)]


def install(module: Any, state: Any, param_group: Any, comm: Any) -> Any:
    """Install ``comm`` on ``param_group``; return the comm it replaces (to delegate to and to restore)."""
    inner = param_group._reduce_scatter_comm
    if len(state._fsdp_param_groups) == 1:
        module.set_custom_reduce_scatter(comm)
    else:  # the public setter refuses several groups per module (a per-parameter mesh)
        param_group._reduce_scatter_comm = comm
    return inner


def restore(param_group: Any, inner: Any) -> None:
    param_group._reduce_scatter_comm = inner


def true_gradient_scale(param_group: Any, group: Any, input_tensor: Any, op: Any) -> tuple[float, float]:
    """``(pre, sum_scale)``: the comm input times ``pre`` is this rank's true local gradient, and the
    reduce-scatter output times ``sum_scale`` is the sum of every rank's local gradient on this shard (of the
    shard group's ranks, under HSDP: the replicas' all-reduce comes after).

    Recomputed with FSDP's own function from the group's settings, and checked against the op FSDP
    passed: if they disagree, FSDP changed under us and the scale cannot be trusted.
    """
    from torch.distributed.distributed_c10d import ReduceOp
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    pre, _, expected, _ = _get_gradient_divide_factors(
        group,
        replicate_group(param_group),  # HSDP divides by every replica's ranks too
        input_tensor.dtype,
        input_tensor.device.type,
        param_group.gradient_divide_factor,
        param_group.force_sum_reduction_for_comms,
    )
    pre = float(pre) if pre is not None else 1.0
    kind, factor = _op_kind(op)
    if kind != _op_kind(expected)[0]:
        raise RuntimeError(
            f"FSDP2 reduce-scatter op {kind} differs from the recomputed {expected}: this torch's "
            "gradient scaling is not the one healthcheck knows (torch 2.13)"
        )
    world = group.size()
    kinds: Any = ReduceOp.RedOpType  # the pybind enum's members are invisible to type checkers
    if kind == kinds.AVG:
        return pre, pre * world
    if kind == kinds.SUM:
        return pre, pre
    if kind == kinds.PREMUL_SUM and factor:
        return pre, pre / factor
    raise RuntimeError(f"unexpected FSDP2 reduce-scatter op {op}")


def _op_kind(op: Any) -> tuple[Any, Any]:
    from torch.distributed.distributed_c10d import ReduceOp

    kinds: Any = ReduceOp.RedOpType
    if isinstance(op, kinds):
        return op, None
    kind = op.op
    return kind, (op.factor if kind == kinds.PREMUL_SUM else None)


@functools.lru_cache(maxsize=None)
def comm_class() -> type:
    """The ``ReduceScatter`` subclass that forwards every call to a callback (built on first use: the base
    class is private and importing it imports torch)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class MonitoredReduceScatter(ReduceScatter):
        """One parameter group's comm: buffers from the comm it wraps, every call to ``on_call``."""

        def __init__(self, index: int, param_group: Any, on_call: Callable[..., Any]):
            self.index, self.param_group, self.on_call = index, param_group, on_call
            self.inner: Any = None

        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
            if async_op:  # FSDP 2.13 never asks: it relies on the call having finished (or been enqueued)
                raise NotImplementedError("healthcheck's FSDP2 reduce-scatter supports async_op=False only")
            return self.on_call(self, output_tensor, input_tensor, group, op)

    return MonitoredReduceScatter


def install_all_gather(param_group: Any, comm: Any) -> Any:
    """Put ``comm`` in ``param_group``'s all-gather slot; return the comm it replaces (to delegate to and to restore)."""
    inner = param_group._all_gather_comm
    param_group._all_gather_comm = comm
    return inner


def restore_all_gather(param_group: Any, inner: Any) -> None:
    param_group._all_gather_comm = inner


@functools.lru_cache(maxsize=None)
def timed_all_gather_class() -> type:
    """The ``AllGather`` subclass that times every call of the comm it wraps (see :func:`comm_class`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class TimedAllGather(AllGather):
        """One parameter group's all-gather, passed through inside ``span()`` (the monitor's timer of a wait)."""

        def __init__(self, inner: Any, span: Callable[[], Any]):
            self.inner, self.span = inner, span

        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return self.inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
            with self.span():
                return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)

    return TimedAllGather


def keep_for_default_stream(tensor: Any) -> Any:
    """A tensor made inside the comm (FSDP's reduce-scatter stream) and read later on the default stream:
    tell the CUDA caching allocator, so its memory is not reused before that read. No-op on CPU."""
    if tensor.device.type == "cuda":
        import torch

        tensor.record_stream(torch.cuda.default_stream(tensor.device))
    return tensor

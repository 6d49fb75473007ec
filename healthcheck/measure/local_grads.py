"""Sketch mode on DDP without a comm hook: the local gradients read from ``.grad`` once per backward.

Why: on a GPU the step is launch-bound, and the comm hook runs on the autograd thread, so its Python per bucket is
what the monitor costs. A hook that only averages already cost +1.4% to +18% of a 0.95B Llama step on one H200,
so no design with a Python hook per bucket reaches the 1% target of issue 13 (docs/measurements.md, "GPU"). Here
DDP keeps its own C++ all-reduce, and the monitor adds two autograd callbacks a step:

* Without ``gradient_as_bucket_view`` (DDP's default) DDP copies each gradient into its bucket and leaves ``.grad``
  local until its finalize copies the average back. DDP queues that finalize as an autograd callback when its last
  bucket is ready, and the engine runs callbacks in the order queued. A gradient hook on the forward's output, the
  first thing the backward computes, queues :meth:`LocalGradientPass._local`, so it runs before the finalize and
  reads every local gradient: the sketch and ‖g_i‖² in one launch (:class:`.grad_table.GradTable`).
* It queues :meth:`LocalGradientPass._mean`, which runs after the finalize: this rank's share of ‖ḡ‖² off the
  averaged ``.grad``, one more launch.
* On a reduction-check step (``reduction_every``) the first callback also keeps a flat copy of the local gradients
  and the second one of the averaged ``.grad`` (a copy: a loop may clip ``.grad`` before ``end_step``), the pair
  the monitor's chunked check compares, as the hook keeps each bucket's.

Each parameter is a bucket of the folded sketch with its index as bucket id, so the model's sketch is another draw
of the same sketch as the comm hook's (the same error bound), and the same on every rank: every rank must take the
same path, which the ranks agree on when the monitor is made (:func:`gradient_source`). ``"auto"`` takes it on CUDA in
sketch mode with the kernel, without ``exchange="carry"`` (it rides on a bucket). On the host the same pass runs
through the torch sketch (``local_from="grads"``: how the tests drive it on gloo); ``"auto"`` keeps the host's C
pass in the hook.
"""

from __future__ import annotations

import time
from typing import Any

from healthcheck.measure.eager import eager, eager_partial
from healthcheck.measure.output_tensors import differentiable_tensors

#: ``WorkerConsistencyMonitor(local_from=...)``: where sketch mode reads the local gradient.
LOCAL_FROM = ("auto", "buckets", "grads")


def gradient_source(model: Any, local_from: str, *, direction: str, exchange: str, group: Any = None) -> str:
    """Where the monitor reads the local gradient, the same on every rank of ``group``: "grads" (``.grad`` once a
    step) or "comm_hook" (DDP's buckets).

    The two paths' sketches are different draws (module docstring), so a rank on one and a rank on the other would
    compare unrelated sketches: cosines near 0 and nothing to say why. A node without Triton, or one rank's model on
    another dtype, would do that under ``"auto"``, so the ranks agree with one gather of flags at construction (a
    collective, unless ``local_from="buckets"`` or the monitor's own arguments, the same everywhere, rule it out).
    Under ``"auto"`` one rank that cannot read ``.grad`` puts every rank on the comm hook, with a warning. A model
    that already has a comm hook of its own (a script's ``fp16_compress_hook``; DDP holds one) leaves the monitor
    only ``.grad``: on any rank, it puts every rank there, as ``"grads"`` would.

    Raises:
        ValueError: ``local_from`` is unknown, or ``"grads"`` (or a model's own comm hook) where some rank cannot
            run the pass (here: why), or ``"buckets"`` (or exact mode, ``exchange="carry"``) with a model's own hook.
    """
    wants, why_not = choose(model, local_from, direction=direction, exchange=exchange)
    taken = registered_comm_hook(model)
    ruled_out = "local_from='buckets'" if local_from == "buckets" else _ruled_out(direction, exchange)
    if ruled_out:
        if local_from == "grads":
            raise ValueError(f"local_from='grads' cannot run here: {why_not}")
        if taken:
            raise ValueError(
                f"the model already has a DDP comm hook ({taken}) and DDP holds one; the monitor needs that slot with "
                f"{ruled_out} (use sketch mode, local_from='auto' or 'grads', to read .grad instead)"
            )
        return "comm_hook"
    import torch

    from healthcheck.measure import distributed

    blocker = _blocker(model, direction, exchange)
    device = next(p for p in model.parameters() if p.requires_grad).device
    flags = torch.tensor([float(wants), float(not blocker), float(bool(taken))], device=device)
    rows = distributed.all_gather_rows(flags, group).tolist()
    ranks = distributed.group_ranks(group)
    hooked = [ranks[i] for i, row in enumerate(rows) if row[2]]
    if hooked:  # .grad is the only way left: every rank reads it, or none can run
        blocked = [ranks[i] for i, row in enumerate(rows) if not row[1]]
        if not blocked:
            return "grads"
        where = f"here: {blocker}" if blocker else f"on rank(s) {', '.join(map(str, blocked))} (each says why)"
        raise ValueError(
            f"rank(s) {', '.join(map(str, hooked))} registered a DDP comm hook of their own (DDP holds one), so the "
            f"monitor must read .grad, which cannot run {where}"
        )
    refusing = [ranks[i] for i, row in enumerate(rows) if not row[0]]
    if not refusing:
        return "grads"
    where = f"here: {why_not}" if why_not else f"on rank(s) {', '.join(map(str, refusing))} (each says why)"
    if local_from == "grads":
        raise ValueError(f"local_from='grads' cannot run {where}")
    if len(refusing) < len(rows):
        import warnings

        warnings.warn(
            f"local_from='auto': .grad cannot be read {where}, so every rank's monitor uses the comm hook "
            "(the ranks' sketches must be the same map)",
            stacklevel=3,
        )
    return "comm_hook"


def registered_comm_hook(model: Any) -> str | None:
    """The comm hook already registered on a DDP ``model``, as DDP's logging names it; "" without one (the monitor's
    own counts as none), None where the logging data cannot be read (private, as in every torch with DDP's logger)."""
    try:
        name = model._get_ddp_logging_data().get("comm_hook")
    except (AttributeError, RuntimeError):
        return None
    return "" if name in (None, "", "_consistency_hook") else str(name)


def choose(model: Any, local_from: str, *, direction: str, exchange: str) -> tuple[bool, str]:
    """This rank's own answer: whether it would read ``.grad``, and if not, why ("" under ``"buckets"``).

    Raises:
        ValueError: ``local_from`` is unknown.
    """
    if local_from not in LOCAL_FROM:
        raise ValueError(f"local_from: expected one of {LOCAL_FROM}, got {local_from!r}")
    if local_from == "buckets":
        return False, ""
    blocker = _blocker(model, direction, exchange)
    if blocker or local_from == "grads":
        return not blocker, blocker
    from healthcheck.measure.sketch import _kernel_for

    # "auto": CUDA parameters that the Triton kernel takes (installed, not switched off); _blocker saw one.
    first = next(p for p in model.parameters() if p.requires_grad)
    if not first.is_cuda:
        return False, "the parameters are not on a CUDA device (the host keeps the comm hook's C pass)"
    if _kernel_for(first.detach()) is None:
        return False, "no Triton sketch kernel for them (Triton missing, HEALTHCHECK_SKETCH_KERNEL=torch, or a failed kernel)"
    return True, ""


def _ruled_out(direction: str, exchange: str) -> str:
    """Why the monitor's own arguments, the same on every rank, rule the pass out ("" where they do not)."""
    if direction != "sketch":
        return "exact mode keeps each bucket's local copy in the comm hook"
    if exchange == "carry":
        return "exchange='carry' rides on the last bucket's all-reduce"
    return ""


def _blocker(model: Any, direction: str, exchange: str) -> str:
    ruled_out = _ruled_out(direction, exchange)
    if ruled_out:
        return ruled_out
    params = [p for p in model.parameters() if p.requires_grad]
    if getattr(model, "gradient_as_bucket_view", False):
        return "with gradient_as_bucket_view, .grad is the bucket DDP is averaging"
    if not params or any(p.dtype != params[0].dtype or p.device != params[0].device for p in params):
        return "the trained parameters must share one dtype and one device"
    return ""


class LocalGradientPass:
    """The two callbacks a sampled step adds (module docstring), writing the monitor's partials under index 0.

    Args:
        monitor: The :class:`~healthcheck.measure.monitor.WorkerConsistencyMonitor` (its ``_sketch``, ``_sqnorm``,
            ``_mean_sqnorm``, arrival and release clocks).
        model: Its DDP model.
        k, seed: The sketch's.
    """

    def __init__(self, monitor: Any, model: Any, *, k: int, seed: int):
        self._monitor, self._k, self._seed = monitor, k, seed
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._table = make_table(self._params, k=k, seed=seed, rank=monitor._rank, world=monitor._world)
        self._armed: list[Any] = []  # the handles of the hooks on the last armed forward's outputs
        self._handle = model.register_forward_hook(eager(self._forward))

    def _forward(self, module: Any, inputs: Any, output: Any) -> None:
        import torch

        self._disarm()  # a forward whose backward never came
        if not (torch.is_grad_enabled() and module.require_backward_grad_sync and self._monitor._sampling()):
            return  # no backward, a no_sync micro-step, or a step the monitor does not sample
        self._armed = [tensor.register_hook(eager_partial(self._start)) for tensor in differentiable_tensors(output)]

    def _start(self, grad: Any) -> None:
        from torch.autograd import Variable

        if self._armed:  # the first of the outputs' gradients: the backward has started
            self._disarm()
            Variable._execution_engine.queue_callback(eager_partial(self._local))

    def _disarm(self) -> None:
        # A hook left on an output keeps that tensor alive as long as its graph is, through the next step's forward:
        # measured on an H200, the 0.95B Llama's step started with 0.85 GiB more held (the logits and the loss).
        for handle in self._armed:
            handle.remove()
        self._armed = []

    def _local(self) -> None:
        from torch.autograd import Variable

        monitor = self._monitor
        monitor._arrived, monitor._waited_at_arrival = time.perf_counter(), monitor._wait_clock.total
        if not self._params[0].is_cuda:
            monitor._queue_release()
            monitor._read_host_clock()
        grads = [p.grad for p in self._params]
        if monitor._checking_reduction():  # the check's local side: .grad becomes the average at the finalize
            monitor._local_copy[0] = self._flat(grads)
        try:
            monitor._sketch[0], monitor._sqnorm[0] = self._table.local(grads)
        except Exception as error:  # noqa: BLE001 - a kernel Triton cannot build here: the torch sketch, as the hook does
            from healthcheck.measure.sketch import kernel_failed

            kernel_failed(error)
            self._table = HostTable(k=self._k, seed=self._seed, rank=monitor._rank, world=monitor._world)
            monitor._sketch[0], monitor._sqnorm[0] = self._table.local(grads)
        Variable._execution_engine.queue_callback(eager_partial(self._mean))  # queued while callbacks run: after DDP's finalize

    def _mean(self) -> None:
        grads = [p.grad for p in self._params]
        self._monitor._mean_sqnorm[0] = self._table.mean_squares(grads)
        if self._monitor._checking_reduction():  # the check's reduced side, a copy: a loop may clip .grad before end_step
            self._monitor._reduced[0] = self._flat(grads)

    def _flat(self, grads: list[Any]) -> Any:
        """The gradients as one flat tensor in the parameters' order (the same on every rank); None as zeros."""
        import torch

        return torch.cat([(p.new_zeros(p.shape) if g is None else g).reshape(-1) for g, p in zip(grads, self._params, strict=True)])

    def close(self) -> None:
        self._disarm()
        self._handle.remove()


def make_table(params: list[Any], *, k: int, seed: int, rank: int, world: int) -> Any:
    """The kernel's :class:`.grad_table.GradTable` for CUDA parameters, else :class:`HostTable`."""
    first = params[0]
    if not first.is_cuda:
        return HostTable(k=k, seed=seed, rank=rank, world=world)
    from healthcheck.measure.grad_table import GradTable

    return GradTable([p.numel() for p in params], first.dtype, first.device, k=k, seed=seed, rank=rank, world=world)


class HostTable:
    """:class:`.grad_table.GradTable`'s results without Triton, tensor by tensor: the torch sketch of each, and the
    share of ‖ḡ‖² by tensors (index ``rank`` mod ``world``) instead of rows. Float64 sums on the host."""

    def __init__(self, *, k: int, seed: int, rank: int, world: int):
        self.k, self.seed, self.rank, self.world = k, seed, rank, world

    def local(self, tensors: list[Any]) -> tuple[Any, float]:
        import torch

        from healthcheck.measure.sketch import sketch_bucket

        present = [(i, t) for i, t in enumerate(tensors) if t is not None]
        # No gradient at all reads as zeros, as in the kernel's table.
        sketches = [sketch_bucket(t, k=self.k, seed=self.seed, bucket_id=i) for i, t in present or [(0, torch.zeros(0))]]
        return torch.stack(sketches).sum(0), float(sum(float(t.double().square().sum()) for _, t in present))

    def mean_squares(self, tensors: list[Any]) -> float:
        return float(sum(float(t.double().square().sum()) for t in tensors[self.rank :: self.world] if t is not None))

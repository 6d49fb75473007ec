"""Per-step worker-consistency measurement inside DDP's gradient all-reduce.

:class:`WorkerConsistencyMonitor` registers a DDP communication hook. For every gradient
bucket, before the all-reduce, the hook still sees this rank's own (undivided, accumulated over
``no_sync`` micro-steps) gradient, so it records on the device, without a host sync:

* the fp32 squared norm ‖g_i‖² of the bucket;
* in ``direction="sketch"`` a count sketch of the bucket (k floats); in ``"exact"`` a copy of it;
* after the all-reduce, in a ``.then()`` callback: ⟨g_i, ḡ⟩ and ‖ḡ‖² against the reduced mean,
  which is the tensor DDP copies into ``.grad``. So cosine-to-mean is exact in both modes
  without keeping a full-size copy of the gradient.

``end_step`` then packs everything into one vector and does ONE ``all_gather_rows`` per sampled
step (exact mode adds the chunked gather of the local gradients for the N×N Gram in float64),
converts to Python floats once and hands the numbers to
:func:`healthcheck.measure.metrics.compute_step_metrics`.

The sketch is :class:`healthcheck.measure.sketch.FoldedSketch` (its module states the error bound:
std of |Δcos| <= sqrt(2/p), p the sketch's prime width, e.g. 4093 for sketch_dim 4096); the exact
Gram and the reduction check are one chunked pass,
:func:`healthcheck.measure.exact_pass.stream_local_gradients`. With ``reduction_every=k`` (a
multiple of ``every``) every k-th step also keeps each bucket's local gradient and its all-reduced
result for that pass, and adds two per-rank extras to the step: ``reduction_rel_error`` and
``reduction_bound_ratio``.

Memory: sketch mode keeps no per-parameter state (an 8 MB sign table whatever the model); exact mode
holds a copy of the local gradient between the hook and ``end_step`` plus N × ``exact_chunk_numel``
elements per gather.

Usage (every rank runs the same code)::

    monitor = WorkerConsistencyMonitor(ddp_model, direction="sketch", sketch_dim=4096)
    loss.backward()
    metrics = monitor.end_step(loss, tokens=n_response_tokens)  # collective, before optimizer.step()
    monitor.close()
"""

from __future__ import annotations

import functools
import time
from typing import Any, Mapping

from healthcheck.measure import distributed, step_gather
from healthcheck.measure.exact_pass import stream_local_gradients
from healthcheck.measure.metrics import StepMetrics
from healthcheck.measure.precision import dot_fp32
from healthcheck.measure.sketch import FoldedSketch
from healthcheck.measure.step_gather import CLOSE_WAIT_S, InFlight

DIRECTIONS = ("exact", "sketch")


class WorkerConsistencyMonitor:
    """Measures how consistent the data-parallel workers' gradients and losses are, per step.

    Args:
        ddp_model: A ``torch.nn.parallel.DistributedDataParallel`` model; its comm hook is taken.
        direction: "sketch" (folded count-sketch pairwise cosines, ~k floats per rank per step) or
            "exact" (float64 Gram from the full local gradients, gathered in chunks).
        sketch_dim: k, the requested sketch width (a prime <= k is used); |Δcos| std <= sqrt(2/k).
        every: Measure every k-th step. ``end_step`` must still be called on every step; on the
            others the hook does only the plain averaging all-reduce and ``end_step`` returns None.
        seed: Sketch seed; must be the same on every rank.
        exact_chunk_numel: Elements per all-gather when ``direction="exact"`` (and for reduction checks).
        reduction_every: Check the reduction numerics every k-th step (0: never); a multiple of ``every``.
        process_group: Group to reduce and gather over; defaults to the model's.
        overlap: Gather each step's numbers asynchronously and read them one step later (see
            :meth:`end_step` and :mod:`healthcheck.measure.step_gather`); False: at once.

    Raises:
        TypeError: ``ddp_model`` is not DistributedDataParallel.
        ValueError: An argument is out of range (the message names it).
    """

    def __init__(
        self,
        ddp_model: Any,
        *,
        direction: str = "sketch",
        sketch_dim: int = 4096,
        every: int = 1,
        seed: int = 0,
        exact_chunk_numel: int = 2**22,
        reduction_every: int = 0,
        process_group: Any = None,
        overlap: bool = True,
    ):
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp_model, DistributedDataParallel):
            kind = type(ddp_model)
            raise TypeError(
                "WorkerConsistencyMonitor needs a torch.nn.parallel.DistributedDataParallel model, "
                f"got {kind.__module__}.{kind.__qualname__}"
            )
        if direction not in DIRECTIONS:
            raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
        for name, value in (("sketch_dim", sketch_dim), ("every", every), ("exact_chunk_numel", exact_chunk_numel)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(reduction_every, int) or reduction_every < 0 or reduction_every % every:
            raise ValueError(f"reduction_every: expected 0 or a multiple of every={every}, got {reduction_every!r}")
        self.direction = direction
        self.sketch_dim = sketch_dim
        self.every = every
        self.seed = seed
        self.exact_chunk_numel = exact_chunk_numel
        self.reduction_every = reduction_every
        self._group = process_group if process_group is not None else ddp_model.process_group
        self._world = distributed.world_size(self._group)
        self._rank = distributed.rank(self._group)
        self._step = 0
        self._closed = False
        self.overlap = overlap
        self._inflight: InFlight | None = None
        #: When this rank's latest gradient bucket was ready, and when the previous step's reduction ended.
        self._arrived: float | None = None
        self._released: float | None = None
        # Per-bucket partial results of the current step, keyed by bucket.index(). Each key is
        # written by exactly one hook call or callback (possibly on a comm thread), so no
        # shared tensor is ever accumulated into concurrently.
        self._sqnorm: dict[int, Any] = {}
        self._dot: dict[int, Any] = {}
        self._mean_sqnorm: dict[int, Any] = {}
        self._sketch: dict[int, Any] = {}
        self._local_copy: dict[int, Any] = {}
        self._reduced: dict[int, Any] = {}  # this rank's all-reduced buckets, on reduction-check steps
        # The prime the sketch folds onto divides no tensor dimension of this model (same on every rank).
        self._sketcher = (FoldedSketch(sketch_dim, seed, dims=[d for p in ddp_model.parameters() for d in p.shape])
                          if direction == "sketch" else None)
        ddp_model.register_comm_hook(state=self, hook=_consistency_hook)

    # ----------------------------------------------------------------------- hook side

    def _sampling(self) -> bool:
        return not self._closed and self._step % self.every == 0

    def _checking_reduction(self, step: int | None = None) -> bool:
        step = self._step if step is None else step
        return not self._closed and self.reduction_every > 0 and step % self.reduction_every == 0

    def _reduce_bucket(self, bucket: Any) -> Any:
        self._arrived = time.perf_counter()  # the last bucket of a step marks the end of its backward compute
        buffer = bucket.buffer()
        if not self._sampling():
            return _plain_average(buffer, self._world, self._group)
        index = bucket.index()
        # Out of place: `buffer` must stay the local gradient until the callback below has
        # taken its dot product with the mean.
        reduced = buffer / self._world
        future = distributed.all_reduce_async(reduced, self._group)
        # The local work below overlaps with the all-reduce already in flight.
        self._sqnorm[index] = dot_fp32(buffer, buffer)
        if self.direction == "exact" or self._checking_reduction():
            # The bucket becomes the averaged gradient once DDP copies the result back, so the
            # local gradient is kept as a copy (sketch mode pays this on reduction-check steps only).
            self._local_copy[index] = buffer.clone()
        if self.direction == "exact":
            return future.then(functools.partial(self._keep_reduced, index))
        assert self._sketcher is not None
        self._sketch[index] = self._sketcher(index, buffer)
        return future.then(functools.partial(self._after_reduce, index, buffer))

    def _after_reduce(self, index: int, local: Any, future: Any) -> Any:
        reduced = self._keep_reduced(index, future)
        self._dot[index] = dot_fp32(local, reduced)
        # ‖ḡ‖² is the same on every rank: each computes its 1/N slice, and the gather sums them.
        width = -(-reduced.numel() // self._world)
        own = reduced[self._rank * width : (self._rank + 1) * width]
        self._mean_sqnorm[index] = dot_fp32(own, own)
        return reduced  # DDP copies the returned tensor into the gradients

    def _keep_reduced(self, index: int, future: Any) -> Any:
        reduced = future.value()[0]
        if self._checking_reduction():
            self._reduced[index] = reduced
        return reduced

    # ----------------------------------------------------------------------- step side

    def end_step(self, loss: Any, tokens: Any = None, extras: Mapping[str, Any] | None = None) -> StepMetrics | None:
        """Start gathering this step's measurements from every rank; return the previous sampled step's metrics.

        A collective: every rank calls it once per optimizer step, after the synchronising
        backward and before ``optimizer.step()``. With ``overlap`` (the default) the gather runs
        while the next step computes, so this returns the metrics of the previous sampled step
        (``StepMetrics.step`` says which), None at the first; :meth:`flush` returns the last one.
        Without ``overlap`` it returns this step's metrics.

        Args:
            loss: This rank's loss (0-d tensor or float), e.g. the response-token-weighted mean; None when
                it is not known (the loss metrics are then not measured; the gradient metrics still are).
            tokens: This rank's token count for the step (int or 0-d tensor), or None; the
                noise scale is in tokens when every rank gives one, else in batches.
            extras: Per-rank scalars to gather in the same collective (same keys on every rank).

        Raises:
            RuntimeError: The monitor is closed, or no bucket went through the hook this step.
        """
        if self._closed:
            raise RuntimeError("WorkerConsistencyMonitor.end_step called after close()")
        released, previous_release = time.perf_counter(), self._released
        self._released = released
        step = self._step
        self._step += 1
        if step % self.every != 0:
            self._clear_partials()
            return None
        if not self._sqnorm:
            raise RuntimeError(
                "WorkerConsistencyMonitor.end_step: no gradient bucket went through the hook this step; "
                "call it after the synchronising backward (outside no_sync) and before the next forward"
            )
        extras = dict(extras or {})
        if previous_release is not None and self._arrived is not None:
            # From the end of the previous all-reduce (a moment every rank shares) to this rank's last
            # gradient bucket: the rank's own work, without the waiting at the collectives.
            extras.setdefault("busy_ms", (self._arrived - previous_release) * 1000)
        try:
            inflight = self._launch(step, loss, tokens, extras)
        finally:
            self._clear_partials()
        if not self.overlap:
            return step_gather.complete(inflight)
        previous, self._inflight = self._inflight, inflight
        return step_gather.complete(previous) if previous is not None else None

    def flush(self, timeout_s: float | None = None) -> StepMetrics | None:
        """The last sampled step's metrics, still in flight with ``overlap``; None when there is none.

        Every rank calls it once after the last ``end_step`` (it only waits: no new collective). On a
        failure path pass ``timeout_s``: a gather that has not finished by then (a peer died before
        contributing) is dropped and None returned, instead of waiting for the process group's timeout.
        """
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        if timeout_s is not None and not step_gather.finished_within(inflight, timeout_s):
            return None
        return step_gather.complete(inflight)

    def _launch(self, step: int, loss: Any, tokens: Any, extras: dict[str, Any]) -> InFlight:
        """This rank's pieces of the step, gathered (asynchronously with ``overlap``)."""
        import torch

        indices = sorted(self._sqnorm)
        device = self._sqnorm[indices[0]].device
        checking = self._checking_reduction(step)
        sqnorm = _sum_partials(self._sqnorm, indices)
        if self.direction == "sketch":
            if checking:
                _, reduction = self._stream(indices, gram=False, reduction=True)
                extras.update(reduction)
            return step_gather.launch(
                step=step, direction=self.direction, group=self._group, world=self._world, loss=loss, tokens=tokens,
                sqnorm=sqnorm, dot=_sum_partials(self._dot, indices), mean_sqnorm=_sum_partials(self._mean_sqnorm, indices),
                extras=extras, sketch=_sum_sketches(self._sketch, indices), buckets=len(indices),
                overlap=self.overlap,
            )
        # Exact mode gathers every rank's local gradient in chunks: synchronous by design, so memory
        # stays bounded (N x exact_chunk_numel), and the step's header rides on the last chunk.
        zero = torch.zeros((), dtype=torch.float64, device=device)
        if checking:  # the reduction extras exist only after the pass, so the header takes its own gather
            gram, reduction = self._stream(indices, gram=True, reduction=True)
            extras.update(reduction)
            return step_gather.launch(
                step=step, direction=self.direction, group=self._group, world=self._world, loss=loss, tokens=tokens,
                sqnorm=sqnorm, dot=zero, mean_sqnorm=zero, extras=extras, gram=gram, buckets=len(indices),
                overlap=self.overlap,
            )
        header, names = step_gather.pack(loss=loss, tokens=tokens, sqnorm=sqnorm, dot=zero, mean_sqnorm=zero,
                                         extras=extras)
        gram, fused = self._stream(indices, gram=True, reduction=False, header=header)
        return step_gather.gathered(step=step, direction=self.direction, world=self._world, rows=fused["header_rows"],
                                    names=names, gram=gram, buckets=len(indices))

    def _stream(self, indices: list[int], *, gram: bool, reduction: bool, header: Any = None) -> tuple[Any, dict]:
        """The chunked exact pass over this step's kept local gradients (and reduced results)."""
        pieces = []
        for index in indices:
            reduced = self._reduced.get(index) if reduction else None
            if reduction and reduced is None:
                raise RuntimeError(f"WorkerConsistencyMonitor: bucket {index} kept no reduced result this step")
            pieces.append((self._local_copy[index], reduced))
        return stream_local_gradients(pieces, group=self._group, world=self._world, chunk_numel=self.exact_chunk_numel,
                                      gram=gram, reduction=reduction, header=header)

    def _clear_partials(self) -> None:
        for partials in (self._sqnorm, self._dot, self._mean_sqnorm, self._sketch, self._local_copy, self._reduced):
            partials.clear()

    def close(self) -> None:
        """Stop measuring; gradients are then averaged exactly as by DDP's default all-reduce.

        A step still in flight is dropped: call :meth:`flush` first to keep its metrics. Its collective
        is waited for (at most ``CLOSE_WAIT_S``: on a failure path a peer may never contribute).

        DDP has no public way to unregister a communication hook (a second
        ``register_comm_hook`` raises), so the hook stays registered and, once closed, does only
        the divide-then-sum all-reduce that DDP's built-in ``allreduce_hook`` does.
        """
        if self._inflight is not None:
            # Let a healthy collective finish writing; the work object keeps its buffers alive otherwise.
            step_gather.finished_within(self._inflight, CLOSE_WAIT_S)
        self._inflight = None
        self._closed = True
        self._clear_partials()
        if self._sketcher is not None:
            self._sketcher.clear()

    def __enter__(self) -> WorkerConsistencyMonitor:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- hook helpers


def _consistency_hook(state, bucket):  # noqa: ANN001, ANN202
    """The function DDP calls per bucket; ``state`` is the monitor.

    Left unannotated on purpose: DDP inspects the signature and rejects any annotation other
    than the real ``dist.GradBucket`` / ``Future[Tensor]`` objects, which the postponed
    (string) annotations of this module are not.
    """
    return state._reduce_bucket(bucket)


def _plain_average(buffer: Any, world: int, group: Any) -> Any:
    # Same as torch's default allreduce_hook: divide in place, then sum.
    buffer.div_(world)
    return distributed.all_reduce_async(buffer, group).then(_first_value)


def _first_value(future: Any) -> Any:
    return future.value()[0]


def _sum_partials(partials: dict[int, Any], indices: list[int]) -> Any:
    import torch

    missing = [i for i in indices if i not in partials]
    if missing:
        raise RuntimeError(f"WorkerConsistencyMonitor: buckets {missing} produced no result this step")
    # Summed in float64: the per-bucket values are fp32 but there is no reason to lose more.
    return torch.stack([partials[i] for i in indices]).to(torch.float64).sum()


def _sum_sketches(sketches: dict[int, Any], indices: list[int]) -> Any:
    """The model's sketch: the buckets' sketches add up (the sketch is linear)."""
    total = sketches[indices[0]].clone()
    for index in indices[1:]:
        total += sketches[index]
    return total

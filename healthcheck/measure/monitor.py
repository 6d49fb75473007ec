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

The sketch is :class:`healthcheck.measure.count_sketch.CountSketch` (its module states the error
bound); the exact Gram and the reduction check are one chunked pass,
:func:`healthcheck.measure.exact_pass.stream_local_gradients`. With ``reduction_every=k`` (a
multiple of ``every``) every k-th step also keeps each bucket's local gradient and its all-reduced
result for that pass, and adds two per-rank extras to the step: ``reduction_rel_error`` and
``reduction_bound_ratio``.

Memory: sketch mode caches an int32 bin index per gradient element; exact mode holds a copy of the
local gradient between the hook and ``end_step`` plus N × ``exact_chunk_numel`` elements per gather.

Usage (every rank runs the same code)::

    monitor = WorkerConsistencyMonitor(ddp_model, direction="sketch", sketch_dim=4096)
    loss.backward()
    metrics = monitor.end_step(loss, tokens=n_response_tokens)  # collective, before optimizer.step()
    monitor.close()
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

from healthcheck.measure import distributed
from healthcheck.measure.count_sketch import CountSketch
from healthcheck.measure.exact_pass import stream_local_gradients
from healthcheck.measure.metrics import StepMetrics, compute_step_metrics, fsum, gram_statistics
from healthcheck.measure.precision import dot_fp32

DIRECTIONS = ("exact", "sketch")
# Layout of the per-rank vector gathered by end_step, before the extras and the sketch.
_LOSS, _TOKENS, _SQNORM, _DOT, _MEAN_SQNORM, _NONFINITE, _LOSS_MEASURED = range(7)
_HEADER = 7


class WorkerConsistencyMonitor:
    """Measures how consistent the data-parallel workers' gradients and losses are, per step.

    Args:
        ddp_model: A ``torch.nn.parallel.DistributedDataParallel`` model; its comm hook is taken.
        direction: "sketch" (count-sketch pairwise cosines, k floats per rank per step) or
            "exact" (float64 Gram from the full local gradients, gathered in chunks).
        sketch_dim: k, the sketch width; |Δcos| std ≲ sqrt(2/k).
        every: Measure every k-th step. ``end_step`` must still be called on every step; on the
            others the hook does only the plain averaging all-reduce and ``end_step`` returns None.
        seed: Sketch seed; must be the same on every rank.
        exact_chunk_numel: Elements per all-gather when ``direction="exact"`` (and for reduction checks).
        reduction_every: Check the reduction numerics every k-th step (0: never); a multiple of ``every``.
        process_group: Group to reduce and gather over; defaults to the model's.

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
        self._step = 0
        self._closed = False
        # Per-bucket partial results of the current step, keyed by bucket.index(). Each key is
        # written by exactly one hook call or callback (possibly on a comm thread), so no
        # shared tensor is ever accumulated into concurrently.
        self._sqnorm: dict[int, Any] = {}
        self._dot: dict[int, Any] = {}
        self._mean_sqnorm: dict[int, Any] = {}
        self._sketch: dict[int, Any] = {}
        self._local_copy: dict[int, Any] = {}
        self._reduced: dict[int, Any] = {}  # this rank's all-reduced buckets, on reduction-check steps
        self._count_sketch = CountSketch(sketch_dim, seed)
        ddp_model.register_comm_hook(state=self, hook=_consistency_hook)

    # ----------------------------------------------------------------------- hook side

    def _sampling(self) -> bool:
        return not self._closed and self._step % self.every == 0

    def _checking_reduction(self, step: int | None = None) -> bool:
        step = self._step if step is None else step
        return not self._closed and self.reduction_every > 0 and step % self.reduction_every == 0

    def _reduce_bucket(self, bucket: Any) -> Any:
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
        self._sketch[index] = self._count_sketch(index, buffer)
        return future.then(functools.partial(self._after_reduce, index, buffer))

    def _after_reduce(self, index: int, local: Any, future: Any) -> Any:
        reduced = self._keep_reduced(index, future)
        self._dot[index] = dot_fp32(local, reduced)
        self._mean_sqnorm[index] = dot_fp32(reduced, reduced)
        return reduced  # DDP copies the returned tensor into the gradients

    def _keep_reduced(self, index: int, future: Any) -> Any:
        reduced = future.value()[0]
        if self._checking_reduction():
            self._reduced[index] = reduced
        return reduced

    # ----------------------------------------------------------------------- step side

    def end_step(self, loss: Any, tokens: Any = None, extras: Mapping[str, Any] | None = None) -> StepMetrics | None:
        """Gather this step's measurements from every rank and compute the metrics.

        A collective: every rank calls it once per optimizer step, after the synchronising
        backward and before ``optimizer.step()``.

        Args:
            loss: This rank's loss (0-d tensor or float), e.g. the response-token-weighted mean; None when
                it is not known (the loss metrics are then not measured; the gradient metrics still are).
            tokens: This rank's token count for the step (int or 0-d tensor), or None; the
                noise scale is in tokens when every rank gives one, else in batches.
            extras: Per-rank scalars to gather in the same collective (same keys on every rank).

        Returns:
            The step's :class:`StepMetrics`, or None on a step that is not sampled.

        Raises:
            RuntimeError: The monitor is closed, or no bucket went through the hook this step.
        """
        if self._closed:
            raise RuntimeError("WorkerConsistencyMonitor.end_step called after close()")
        step = self._step
        self._step += 1
        if step % self.every != 0:
            return None
        if not self._sqnorm:
            raise RuntimeError(
                "WorkerConsistencyMonitor.end_step: no gradient bucket went through the hook this step; "
                "call it after the synchronising backward (outside no_sync) and before the next forward"
            )
        try:
            return self._measure(step, loss, tokens, dict(extras or {}))
        finally:
            self._clear_partials()

    def _measure(self, step: int, loss: Any, tokens: Any, extras: dict[str, Any]) -> StepMetrics:
        import torch

        indices = sorted(self._sqnorm)
        device = self._sqnorm[indices[0]].device
        checking = self._checking_reduction(step)
        exact = self.direction == "exact"
        exact_gram = None
        if checking:
            # The reduction extras only exist after the pass over the gradients, so the header
            # waits for them and takes its own gather on these (sampled-of-sampled) steps.
            exact_gram, reduction = self._stream(indices, gram=exact, reduction=True)
            extras.update(reduction)
        names = sorted(extras)

        def scalar(value: Any) -> Any:
            value = float("nan") if value is None else value
            return torch.as_tensor(value).detach().reshape(()).to(device=device, dtype=torch.float64)

        loss_value = scalar(loss)
        sqnorm = _sum_partials(self._sqnorm, indices)
        if self.direction == "sketch":
            dot, mean_sqnorm = _sum_partials(self._dot, indices), _sum_partials(self._mean_sqnorm, indices)
        else:  # read off the float64 Gram below instead
            dot = mean_sqnorm = torch.zeros((), dtype=torch.float64, device=device)
        loss_measured = scalar(0.0 if loss is None else 1.0)
        # A loss that was not measured is not a non-finite loss: only a measured NaN/Inf is an event.
        nonfinite = ((loss_measured > 0) & ~torch.isfinite(loss_value) | ~torch.isfinite(sqnorm)).to(torch.float64)
        header = [loss_value, scalar(tokens), sqnorm, dot, mean_sqnorm, nonfinite, loss_measured]
        parts = [torch.stack(header + [scalar(extras[name]) for name in names])]
        if exact and not checking:
            exact_gram, fused = self._stream(indices, gram=True, reduction=False, header=parts[0])
            rows = fused["header_rows"]
        else:
            if self.direction == "sketch":
                parts.append(torch.stack([self._sketch[i] for i in indices]).sum(0).to(torch.float64))
            rows = distributed.all_gather_rows(torch.cat(parts), self._group)
        width = _HEADER + len(names)
        if self.direction == "sketch":
            sketches = rows[:, width:]
            gram = sketches @ sketches.T
        else:
            gram = exact_gram
        # The one host sync of the step.
        values = rows[:, :width].cpu().tolist()
        gram_rows = gram.cpu().tolist()
        column = lambda j: [row[j] for row in values]  # noqa: E731
        if self.direction == "exact":
            sqnorms, dots, mean_sq = gram_statistics(gram_rows)
        else:
            sqnorms, dots = column(_SQNORM), column(_DOT)
            # Identical on every rank (it is the all-reduced mean); averaging guards nothing but rounding.
            mean_sq = fsum(column(_MEAN_SQNORM)) / self._world
        tokens_column = column(_TOKENS)
        return compute_step_metrics(
            step=step,
            direction=self.direction,
            per_rank_loss=column(_LOSS),
            per_rank_sqnorm=sqnorms,
            dots_with_mean=dots,
            mean_sqnorm=mean_sq,
            gram=gram_rows,
            per_rank_tokens=None if any(math.isnan(t) for t in tokens_column) else tokens_column,
            nonfinite_flags=[flag != 0 for flag in column(_NONFINITE)],
            loss_measured=[flag != 0 for flag in column(_LOSS_MEASURED)],
            per_rank_extras={name: column(_HEADER + j) for j, name in enumerate(names)},
            buckets=len(indices),
        )

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

        DDP has no public way to unregister a communication hook (a second
        ``register_comm_hook`` raises), so the hook stays registered and, once closed, does only
        the divide-then-sum all-reduce that DDP's built-in ``allreduce_hook`` does.
        """
        self._closed = True
        self._clear_partials()
        self._count_sketch.clear()

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
    return torch.stack([partials[i].to(torch.float64) for i in indices]).sum()

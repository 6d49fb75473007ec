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
converts to Python floats once and hands the numbers to :func:`healthcheck.metrics.compute_step_metrics`.

Sketch accuracy. Each element goes to one of k bins with a random sign (seeded identically on
all ranks from ``seed`` and the bucket index), so the sketch is a random linear map S with
E⟨Sx, Sy⟩ = ⟨x, y⟩ and Var⟨Sx, Sy⟩ ≤ (‖x‖²‖y‖² + ⟨x, y⟩²)/k. For the cosine, normalised by the
sketch's own norms, that gives |Δcos| with std ≲ sqrt(2/k) (0.044 at k=1024, 0.022 at 4096,
0.011 at 16384). Measured on tiny GPT-2 gradients (2 layers, n_embd 64, vocab 2048, random
tokens, 8 gloo ranks, 5 steps = 280 ordered rank pairs per k) with
``python benchmarks/sketch_error.py --nproc 8 --steps 5``:

    k       sqrt(2/k)   mean |Δcos|   max |Δcos|
    1024    0.0442      0.0221        0.1145
    4096    0.0221      0.0103        0.0415
    16384   0.0110      0.0064        0.0248

Reduction numerics. With ``reduction_every=k`` (a multiple of ``every``), every k-th step also
keeps each bucket's local gradient and its all-reduced result, gathers the local gradients in
chunks (as exact mode does, in the same pass when both run), and compares the reduced tensor with a
float64 mean. It adds two per-rank extras to that step: ``reduction_rel_error`` =
‖reduced − mean₆₄‖ / ‖mean₆₄‖, and ``reduction_bound_ratio`` = that error over the worst case a
correct reduction can round to: the hook computes fl(Σ fl(g_i / N)) in the bucket dtype, whose
element error is at most γ_N · Σ|g_i| / N with γ_N = N·u / (1 − N·u) (u the unit roundoff), so
a ratio above 1 is not rounding (a lossy compression hook, a reduction in a lower precision, or
corruption). The gathered float64 mean adds its own γ_N(2⁻⁵³) to the bound.

Memory: sketch mode caches an int32 bin index per gradient element (4 bytes per parameter,
built once per bucket layout); exact mode holds a copy of the local gradient between the hook
and ``end_step`` plus N × ``exact_chunk_numel`` elements per gather, upcast to float64 in
slices of 2**18 elements (2 MiB).

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

from healthcheck import distributed
from healthcheck.metrics import StepMetrics, compute_step_metrics, fsum, gram_statistics

#: Elements (across all ranks) upcast to float64 at a time when accumulating the exact Gram.
_UPCAST_SLICE_NUMEL = 1 << 18

DIRECTIONS = ("exact", "sketch")
# Elements per fp32 upcast when a bucket is bf16/fp16: bounds the temporary to 4 MiB.
_UPCAST_CHUNK_NUMEL = 2**20
# Layout of the per-rank vector gathered by end_step, before the extras and the sketch.
_LOSS, _TOKENS, _SQNORM, _DOT, _MEAN_SQNORM, _NONFINITE = range(6)
_HEADER = 6


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
        # bucket index -> (numel, device, int32 bins in [0, 2k)); numel is checked because DDP
        # rebuilds its buckets after the first iteration and reuses the indices.
        self._bins: dict[int, tuple[int, Any, Any]] = {}
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
        self._sqnorm[index] = _dot_fp32(buffer, buffer)
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
        self._dot[index] = _dot_fp32(local, reduced)
        self._mean_sqnorm[index] = _dot_fp32(reduced, reduced)
        return reduced  # DDP copies the returned tensor into the gradients

    def _keep_reduced(self, index: int, future: Any) -> Any:
        reduced = future.value()[0]
        if self._checking_reduction():
            self._reduced[index] = reduced
        return reduced

    def _count_sketch(self, index: int, buffer: Any) -> Any:
        import torch

        bins = self._bins_for(index, buffer.numel(), buffer.device)
        k = self.sketch_dim
        acc_dtype = _accumulation_dtype(buffer)
        counts = torch.zeros(2 * k, dtype=acc_dtype, device=buffer.device)
        for start in range(0, buffer.numel(), _UPCAST_CHUNK_NUMEL):
            stop = start + _UPCAST_CHUNK_NUMEL
            counts.index_add_(0, bins[start:stop], buffer[start:stop].to(acc_dtype))
        # Bins [k, 2k) carry the negative sign: one random draw gives position and sign.
        return counts[:k] - counts[k:]

    def _bins_for(self, index: int, numel: int, device: Any) -> Any:
        import torch

        cached = self._bins.get(index)
        if cached is not None and cached[0] == numel and cached[1] == device:
            return cached[2]
        # A CPU generator gives the same draw on every rank whatever the device; buckets are
        # identical across ranks, so (seed, index) names the same random map everywhere.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        bins = torch.randint(0, 2 * self.sketch_dim, (numel,), generator=generator, dtype=torch.int32)
        bins = bins.to(device)
        self._bins[index] = (numel, device, bins)
        return bins

    # ----------------------------------------------------------------------- step side

    def end_step(self, loss: Any, tokens: Any = None, extras: Mapping[str, Any] | None = None) -> StepMetrics | None:
        """Gather this step's measurements from every rank and compute the metrics.

        A collective: every rank calls it once per optimizer step, after the synchronising
        backward and before ``optimizer.step()``.

        Args:
            loss: This rank's loss (0-d tensor or float), e.g. the response-token-weighted mean.
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
            exact_gram, reduction = self._stream_local_gradients(indices, device, exact, True)
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
        nonfinite = (~torch.isfinite(loss_value) | ~torch.isfinite(sqnorm)).to(torch.float64)
        header = [loss_value, scalar(tokens), sqnorm, dot, mean_sqnorm, nonfinite]
        parts = [torch.stack(header + [scalar(extras[name]) for name in names])]
        if exact and not checking:
            exact_gram, fused = self._stream_local_gradients(indices, device, True, False, header=parts[0])
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
            per_rank_extras={name: column(_HEADER + j) for j, name in enumerate(names)},
            buckets=len(indices),
        )

    def _stream_local_gradients(
        self, indices: list[int], device: Any, gram: bool, reduction: bool, header: Any = None
    ) -> tuple[Any, dict]:
        """One chunked pass over every rank's local gradients (``exact_chunk_numel`` elements per gather).

        Returns the N×N float64 Gram (when ``gram``) and, when ``reduction``, this rank's
        ``reduction_rel_error`` and ``reduction_bound_ratio`` (see the module docstring). A float64
        ``header`` is appended, bit-cast, to the last gather, and every rank's copy comes back
        under the key ``"header_rows"``: one collective per step instead of two, which is most of
        exact mode's cost on small models (each gloo collective costs ~15 ms at 8 ranks).
        """
        import torch

        gram_out = torch.zeros((self._world, self._world), dtype=torch.float64, device=device) if gram else None
        # ‖reduced − mean‖², ‖mean‖², ‖mean of |g_i|‖², accumulated in float64 on the device.
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        pending: list[tuple[Any, Any]] = []
        pending_numel = 0
        unit_roundoff = 0.0

        header_rows: list[Any] = []

        def flush(last: bool = False) -> None:
            nonlocal pending, pending_numel
            if not pending and last and header is not None:
                # The gradients ended exactly on a chunk boundary, so the header travels alone.
                header_rows.append(distributed.all_gather_rows(header, self._group))
            if pending:
                locals_ = [local for local, _ in pending]
                chunk = locals_[0] if len(locals_) == 1 else torch.cat(locals_)
                numel = chunk.numel()
                if last and header is not None:
                    chunk = torch.cat([chunk, header.view(chunk.dtype)])
                rows = distributed.all_gather_rows(chunk, self._group)
                if last and header is not None:
                    header_rows.append(rows[:, numel:].contiguous().view(torch.float64))
                    rows = rows[:, :numel]
                reduced_all = torch.cat([r for _, r in pending]) if reduction else None
                # Upcast column slices, not the whole N x chunk block: the float64 temporary stays
                # ~2 MB instead of N * exact_chunk_numel * 8 bytes, and the work stays in cache.
                width = max(1, _UPCAST_SLICE_NUMEL // self._world)
                for first in range(0, rows.shape[1], width):
                    block = rows[:, first:first + width].to(torch.float64)
                    if gram_out is not None:
                        gram_out.addmm_(block, block.T)
                    if reduction:
                        mean = block.sum(0) / self._world
                        abs_mean = block.abs().sum(0) / self._world
                        diff = reduced_all[first:first + width].to(torch.float64) - mean
                        sums.add_(torch.stack([diff @ diff, mean @ mean, abs_mean @ abs_mean]))
            pending, pending_numel = [], 0

        # Small buckets are packed together so the number of collectives depends on the model
        # size, not the bucket count; the bucket layout (hence the loop) is the same on all ranks.
        for index in indices:
            local = self._local_copy[index]
            reduced = self._reduced.get(index) if reduction else None
            if reduction and reduced is None:
                raise RuntimeError(f"WorkerConsistencyMonitor: bucket {index} kept no reduced result this step")
            unit_roundoff = max(unit_roundoff, _unit_roundoff(local.dtype))
            if pending and pending[0][0].dtype != local.dtype:
                flush()
            start = 0
            while start < local.numel():
                take = min(self.exact_chunk_numel - pending_numel, local.numel() - start)
                stop = start + take
                pending.append((local[start:stop], reduced[start:stop] if reduced is not None else local[:0]))
                pending_numel += take
                start = stop
                if pending_numel == self.exact_chunk_numel:
                    flush()
        flush(last=True)
        if not reduction:
            return gram_out, {"header_rows": header_rows[0]} if header_rows else {}
        error_sq, mean_sq, abs_mean_sq = sums.cpu().tolist()
        bound = (_gamma(self._world, unit_roundoff) + _gamma(self._world, 2.0**-53)) * math.sqrt(abs_mean_sq)
        error = math.sqrt(error_sq)
        return gram_out, {
            "reduction_rel_error": error / math.sqrt(mean_sq) if mean_sq > 0 else (0.0 if error == 0 else math.inf),
            "reduction_bound_ratio": error / bound if bound > 0 else (0.0 if error == 0 else math.inf),
        }

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
        self._bins.clear()

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


def _unit_roundoff(dtype: Any) -> float:
    """Half the machine epsilon of a floating dtype (the largest relative rounding error)."""
    import torch

    return torch.finfo(dtype).eps / 2


def _gamma(n: int, unit_roundoff: float) -> float:
    """γ_n = n·u / (1 − n·u): the relative error bound of n chained roundings (Higham, ch. 3)."""
    return n * unit_roundoff / (1 - n * unit_roundoff) if n * unit_roundoff < 1 else math.inf


def _accumulation_dtype(tensor: Any) -> Any:
    import torch

    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _dot_fp32(a: Any, b: Any) -> Any:
    """⟨a, b⟩ of two 1-D tensors, accumulated in fp32 (fp64 for fp64), as a 0-d device tensor."""
    import torch

    acc_dtype = _accumulation_dtype(a)
    if a.dtype == acc_dtype and b.dtype == acc_dtype:
        return torch.dot(a, b)
    # bf16/fp16: products of two bf16 values are exact in fp32, so upcast in bounded chunks
    # instead of materialising full fp32 copies of the bucket.
    step = _UPCAST_CHUNK_NUMEL
    partials = [
        torch.dot(a[start : start + step].to(acc_dtype), b[start : start + step].to(acc_dtype))
        for start in range(0, a.numel(), step)
    ]
    return partials[0] if len(partials) == 1 else torch.stack(partials).sum()


def _sum_partials(partials: dict[int, Any], indices: list[int]) -> Any:
    import torch

    missing = [i for i in indices if i not in partials]
    if missing:
        raise RuntimeError(f"WorkerConsistencyMonitor: buckets {missing} produced no result this step")
    # Summed in float64: the per-bucket values are fp32 but there is no reason to lose more.
    return torch.stack([partials[i].to(torch.float64) for i in indices]).sum()

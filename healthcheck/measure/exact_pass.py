"""One chunked pass over every rank's local gradients: the float64 Gram matrix and the reduction check.

Exact mode gathers every rank's local gradient in chunks of ``chunk_numel`` elements and
accumulates the N×N Gram ⟨g_i, g_j⟩ in float64. The same pass can check the reduction numerics:
the all-reduced gradient against a float64 mean of the gathered local gradients, as
``reduction_rel_error`` = ‖reduced − mean₆₄‖ / ‖mean₆₄‖ and ``reduction_bound_ratio`` = that error
over the worst case a correct reduction can round to. The hook computes fl(Σ fl(g_i / N)) in the
bucket dtype, whose element error is at most γ_N · Σ|g_i| / N with γ_N = N·u / (1 − N·u) (u the
unit roundoff), so a ratio above 1 is not rounding (a lossy compression hook, a reduction in a
lower precision, or corruption). The gathered float64 mean adds its own γ_N(2⁻⁵³) to the bound. The pass also
counts, per element, the ranks whose value an fp16 wire would round into its subnormal range, for the absolute
floor a script's fp16 compression hook adds (``reduction_fp16_floor``).

Memory: N × ``chunk_numel`` elements per gather, upcast to float64 in column slices of
``GRAM_SLICE_NUMEL`` elements across all ranks (2 MiB on the host, 128 MiB on a GPU).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from healthcheck.measure import distributed
from healthcheck.measure.precision import FP16_SMALLEST_NORMAL, fp16_underflow_floor, gamma, unit_roundoff

#: Elements (across all ranks) upcast to float64 at a time when accumulating the exact Gram, (accelerator,
#: host). The host's slices stay in cache; a GPU's are large because each slice costs kernel launches on the
#: host (at 2^18, one rank of a 1B-parameter model made ~3,600 slices a step: ``benchmarks/hook_cost.py --profile``).
GRAM_SLICE_NUMEL = (1 << 24, 1 << 18)


def stream_local_gradients(
    pieces: Sequence[tuple[Any, Optional[Any]]],
    *,
    group: Any,
    world: int,
    chunk_numel: int,
    gram: bool,
    reduction: bool,
    header: Any = None,
) -> tuple[Any, dict]:
    """Gather ``pieces`` (this rank's ``(local, reduced)`` flat tensors, same layout on every rank) in chunks.

    Returns the N×N float64 Gram (when ``gram``, else None) and a dict: with ``reduction``, this
    rank's ``reduction_rel_error`` and ``reduction_bound_ratio``; with a float64 ``header``, every
    rank's copy of it under ``"header_rows"``. The header rides, bit-cast, on the last gather: one
    collective per step instead of two, which is most of exact mode's cost on small models.
    """
    import torch

    device = pieces[0][0].device if pieces else (header.device if header is not None else torch.device("cpu"))
    gram_out = torch.zeros((world, world), dtype=torch.float64, device=device) if gram else None
    # ‖reduced − mean‖², ‖mean‖², ‖mean of |g_i|‖², Σ_e k_e² (k_e: the ranks whose value could go subnormal on an fp16
    # wire, for fp16_underflow_floor), accumulated in float64 on the device.
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    subnormal_below = world * FP16_SMALLEST_NORMAL
    pending: list[tuple[Any, Any]] = []
    pending_numel = 0
    worst_roundoff = 0.0
    fp16_buckets = False  # DDP's own division by N then rounds in fp16: the floor joins this pass's bound
    header_rows: list[Any] = []

    def flush(last: bool = False) -> None:
        nonlocal pending, pending_numel
        if not pending and last and header is not None:
            # The gradients ended exactly on a chunk boundary, so the header travels alone.
            header_rows.append(distributed.all_gather_rows(header, group))
        if pending:
            local_parts = [local for local, _ in pending]
            chunk = local_parts[0] if len(local_parts) == 1 else torch.cat(local_parts)
            numel = chunk.numel()
            if last and header is not None:
                chunk = torch.cat([chunk, header.view(chunk.dtype)])
            rows = distributed.all_gather_rows(chunk, group)
            if last and header is not None:
                header_rows.append(rows[:, numel:].contiguous().view(torch.float64))
                rows = rows[:, :numel]
            reduced_all = torch.cat([r for _, r in pending]) if reduction else None
            # Upcast column slices, not the whole N x chunk block: the float64 temporary stays
            # GRAM_SLICE_NUMEL * 8 bytes instead of N * chunk_numel * 8, and on the host the work stays in cache.
            width = max(1, GRAM_SLICE_NUMEL[rows.device.type == "cpu"] // world)
            for first in range(0, rows.shape[1], width):
                block = rows[:, first : first + width].to(torch.float64)
                if gram_out is not None:
                    gram_out.addmm_(block, block.T)
                if reduced_all is not None:
                    mean = block.sum(0) / world
                    magnitude = block.abs()
                    abs_mean = magnitude.sum(0) / world
                    at_risk = ((magnitude < subnormal_below) & (magnitude > 0)).sum(0, dtype=torch.float64)
                    diff = reduced_all[first : first + width].to(torch.float64) - mean
                    sums.add_(torch.stack([diff @ diff, mean @ mean, abs_mean @ abs_mean, at_risk @ at_risk]))
        pending, pending_numel = [], 0

    # Small buckets are packed together so the number of collectives depends on the model
    # size, not the bucket count; the layout (hence the loop) is the same on all ranks.
    for local, reduced in pieces:
        if reduction and reduced is None:
            raise RuntimeError("stream_local_gradients: a piece has no reduced result to check")
        worst_roundoff = max(worst_roundoff, unit_roundoff(local.dtype))
        fp16_buckets = fp16_buckets or local.dtype == torch.float16
        if pending and pending[0][0].dtype != local.dtype:
            flush()
        start = 0
        while start < local.numel():
            take = min(chunk_numel - pending_numel, local.numel() - start)
            stop = start + take
            pending.append((local[start:stop], reduced[start:stop] if reduced is not None else local[:0]))
            pending_numel += take
            start = stop
            if pending_numel == chunk_numel:
                flush()
    flush(last=True)
    out: dict[str, Any] = {"header_rows": header_rows[0]} if header_rows else {}
    if reduction:
        out.update(reduction_error(sums.cpu().tolist(), world, worst_roundoff, fp16_buckets=fp16_buckets))
    return gram_out, out


def reduction_error(sums: Sequence[float], world: int, worst_roundoff: float, *, fp16_buckets: bool = False) -> dict[str, float]:
    """``reduction_rel_error`` and ``reduction_bound_ratio`` from ‖reduced − mean‖², ‖mean‖², ‖mean |g|‖².

    A fourth sum, Σ_e k_e² of the ranks whose value could round into fp16's subnormal range, gives the floor fp16's
    underflow adds (:func:`~healthcheck.measure.precision.fp16_underflow_floor`). With ``fp16_buckets`` (DDP divides
    fp16 buckets by N in fp16) it joins this bound; otherwise it is returned as ``reduction_fp16_floor``, in units of
    the bound, for the judge to add where the script's comm hook compresses to fp16.

    >>> reduction_error([0.0, 4.0, 4.0], 8, 2.0**-24)
    {'reduction_rel_error': 0.0, 'reduction_bound_ratio': 0.0}
    >>> reduction_error([0.0, 4.0, 4.0, 0.0], 8, 2.0**-24)["reduction_fp16_floor"]
    0.0
    >>> sorted(reduction_error([1e-6, 4.0, 4.0, 1e6], 8, 2.0**-11, fp16_buckets=True))  # in the bound already
    ['reduction_bound_ratio', 'reduction_rel_error']
    """
    error_sq, mean_sq, abs_mean_sq = sums[:3]
    bound = (gamma(world, worst_roundoff) + gamma(world, 2.0**-53)) * math.sqrt(abs_mean_sq)
    floor = fp16_underflow_floor(world, sums[3]) if len(sums) > 3 else 0.0
    if fp16_buckets:
        bound, floor = bound + floor, 0.0
    error = math.sqrt(error_sq)
    out = {
        "reduction_rel_error": error / math.sqrt(mean_sq) if mean_sq > 0 else (0.0 if error == 0 else math.inf),
        "reduction_bound_ratio": error / bound if bound > 0 else (0.0 if error == 0 else math.inf),
    }
    if len(sums) > 3 and not fp16_buckets:
        out["reduction_fp16_floor"] = floor / bound if bound > 0 else (0.0 if floor == 0 else math.inf)
    return out

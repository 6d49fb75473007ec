"""Worker-consistency metrics: pure math on per-rank numbers gathered once per step.

Nothing here talks to a process group or a model; :mod:`healthcheck.measure.monitor` gathers the inputs
(per-rank losses, squared gradient norms, dot products with the mean gradient, a Gram matrix)
and :func:`compute_step_metrics` turns them into one :class:`StepMetrics`. Inputs are plain
sequences of numbers or anything with ``.tolist()`` (tensors), or float64 numpy arrays, which the N×N pieces
take as they are. This module imports no torch, and numpy only inside the per-step functions, so the CLI can use
:func:`window_summary` before either is loaded.

Non-finite inputs are never averaged away: a rank whose loss or local gradient is NaN/Inf is
listed in ``nonfinite_ranks``; dispersion and cosine summaries are taken over the finite values,
and quantities that depend on the mean gradient (which the all-reduce has then poisoned) are NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

from healthcheck.finite import finite_values, json_safe

NAN = float("nan")


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """Consistency of the data-parallel workers at one optimizer step.

    Lists are in rank order. Norms are L2 norms of each rank's local gradient before the
    all-reduce; "mean gradient" is the all-reduced average ḡ = (1/N) Σ g_i.
    """

    step: int  #: the monitor's own 0-based step counter (counts every ``end_step`` call)
    direction: str  #: "exact" or "sketch": how ``pairwise_cosine`` was obtained
    world_size: int
    buckets: int  #: DDP gradient buckets that contributed this step
    per_rank_loss: list[float]  #: NaN where a rank's loss was not measured
    per_rank_tokens: list[int] | None  #: None when any rank passed no token count
    per_rank_grad_norm: list[float]
    cosine_to_mean: list[float]  #: cos(g_i, ḡ): the sketches' estimate in sketch mode, exact in exact mode
    pairwise_cosine: list[list[float]]  #: N×N, diagonal 1
    loss_std: float  #: population std (ddof=0) over finite losses
    loss_range: float
    grad_norm_std: float
    grad_norm_cv: float  #: std / mean of the gradient norms
    cosine_mean: float  #: mean of the off-diagonal pairwise cosines
    cosine_min: float
    mean_grad_norm: float  #: ‖ḡ‖
    gradient_diversity: float  #: Σ‖g_i‖² / ‖Σ g_i‖², 1/N for identical gradients
    grad_sqnorm_est: float  #: unbiased |G|² estimate (McCandlish et al. 2018, app. A)
    trace_sigma_est: float  #: unbiased tr(Σ) estimate
    noise_scale: float  #: B_simple = trace_sigma_est / grad_sqnorm_est, in ``noise_scale_unit``
    noise_scale_unit: str  #: "tokens" or "batches"
    nonfinite_ranks: list[int]
    loss_measured: bool  #: every rank's loss was known; else the loss dispersions are NaN (not measured)
    per_rank_extras: dict[str, list[float]]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe copy: NaN and ±Inf become None."""
        return json_safe(dataclasses.asdict(self))


# --------------------------------------------------------------------------- small helpers


def as_floats(values: Any) -> list[float]:
    """A flat list of floats from a sequence or a 1-D tensor; None becomes NaN.

    >>> as_floats([1, None, 2.5])
    [1.0, nan, 2.5]
    """
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [NAN if value is None else float(value) for value in values]


def fsum(values: Iterable[float]) -> float:
    """Exactly rounded sum (``math.fsum``) that returns NaN/Inf where ``fsum`` would raise.

    >>> fsum([0.1] * 10), fsum([float("inf"), float("-inf")])
    (1.0, nan)
    """
    values = list(values)
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # opposite infinities or overflow: plain IEEE sum instead
        return sum(values)


def _safe_div(numerator: float, denominator: float) -> float:
    # 0/0 and x/0 are reported as NaN rather than raising: a metric, not a crash.
    if denominator == 0 or not math.isfinite(denominator):
        return NAN
    return numerator / denominator


# --------------------------------------------------------------------------- dispersion


def dispersion(values: Sequence[float] | Any) -> tuple[float, float, float]:
    """Population std (ddof=0), range (max − min) and coefficient of variation (std/mean).

    Taken over the finite values only; NaN where there are none, and cv is NaN when the
    mean is 0.

    >>> dispersion([1.0, 3.0])
    (1.0, 2.0, 0.5)
    >>> dispersion([2.0, float("nan"), 2.0])
    (0.0, 0.0, 0.0)
    """
    kept = finite_values(as_floats(values))
    if not kept:
        return NAN, NAN, NAN
    low, high = min(kept), max(kept)
    mean = fsum(kept) / len(kept)
    # Identical values (every rank read the same data) must give exactly 0, which fsum-then-divide
    # need not; otherwise a two-pass fsum is as accurate as statistics.pstdev at a fraction of its cost
    # (pstdev sums in exact fractions: ~0.1 ms per call, every step, on every rank). A product, not ``** 2``:
    # a float power raises OverflowError past 1.8e308 where a product becomes inf.
    std = 0.0 if low == high else math.sqrt(fsum((value - mean) * (value - mean) for value in kept) / len(kept))
    return std, high - low, _safe_div(std, mean)


# --------------------------------------------------------------------------- direction


def as_matrix(matrix: Any) -> list[list[float]]:
    """A square nested list of floats from a nested sequence, a 2-D tensor or a numpy array."""
    if _is_float64_array(matrix):
        return _square_array(matrix).tolist()  # floats already: no per-value conversion (N² of them)
    if hasattr(matrix, "tolist"):
        matrix = matrix.tolist()
    rows = [as_floats(row) for row in matrix]
    if any(len(row) != len(rows) for row in rows):
        raise ValueError(f"expected a square matrix, got row lengths {[len(row) for row in rows]}")
    return rows


def _is_float64_array(value: Any) -> bool:
    import numpy as np  # here, not at the top: window_summary serves the CLI before numpy is loaded

    return isinstance(value, np.ndarray) and value.dtype == np.float64


def _square_array(matrix: Any) -> Any:
    """:func:`as_matrix` as a float64 numpy array; a float64 array passes as it is (the monitors' Gram)."""
    import numpy as np

    if _is_float64_array(matrix):
        if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"expected a square matrix, got shape {list(matrix.shape)}")
        return matrix
    rows = as_matrix(matrix)
    return np.array(rows, dtype=np.float64).reshape(len(rows), len(rows))


def _cosine_array(gram: Any) -> Any:
    """:func:`gram_to_cosine` as a numpy array. Vectorised because every rank computes it every step and the
    matrix grows as N²: with the Python loop it replaced, a step's metrics on 256 ranks took 50-80 ms of each
    rank's host time (README, Measured figures). Each entry takes the same IEEE operations as
    ``G_ij / (‖g_i‖ ‖g_j‖)`` written out for one entry, so the bits are the loop's."""
    import numpy as np

    g = _square_array(gram)
    diagonal = g.diagonal()
    norms = np.sqrt(np.where((diagonal > 0) & np.isfinite(diagonal), diagonal, np.nan))
    with np.errstate(all="ignore"):  # inf/inf and overflow give NaN and Inf, as the scalar division did
        cosine = g / np.multiply.outer(norms, norms)
    # The diagonal is 1 by definition; computing it would give 1 ± 1 ulp.
    defined = np.flatnonzero(~np.isnan(norms))
    cosine[defined, defined] = 1.0
    # Rounding can push a cosine a hair past ±1; clip keeps NaN.
    return np.clip(cosine, -1.0, 1.0, out=cosine)


def gram_to_cosine(gram: Any) -> list[list[float]]:
    """Cosine matrix from a Gram matrix G_ij = ⟨g_i, g_j⟩, normalised by its own diagonal.

    Normalising by the Gram's own diagonal (rather than by separately measured norms) keeps
    every entry in [−1, 1] even when the Gram is an approximation such as a sketch Gram.
    Rows of a zero or non-finite vector are NaN.

    >>> gram_to_cosine([[4.0, 2.0], [2.0, 1.0]])
    [[1.0, 1.0], [1.0, 1.0]]
    >>> gram_to_cosine([[1.0, 0.0], [0.0, 0.0]])[0]
    [1.0, nan]
    """
    return _cosine_array(gram).tolist()


def _off_diagonal_array(square: Any) -> Any:
    """The entries with i ≠ j, row by row."""
    import numpy as np

    return square[~np.eye(len(square), dtype=bool)]


def cosine_summary(pairwise: Any) -> tuple[float, float]:
    """Mean and minimum of the finite off-diagonal pairwise cosines (NaN if there are none).

    >>> cosine_summary([[1.0, 0.5, -0.5], [0.5, 1.0, 1.0], [-0.5, 1.0, 1.0]])
    (0.3333333333333333, -0.5)
    """
    import numpy as np

    off = _off_diagonal_array(_square_array(pairwise))
    kept = off[np.isfinite(off)]
    if not kept.size:
        return NAN, NAN
    low = float(kept.min())
    # Python's min keeps the first of 0.0 and -0.0, numpy's need not: the exact zero takes the slow path.
    return fsum(kept.tolist()) / kept.size, low if low != 0 else min(kept.tolist())


def cosine_to_mean(dots: Sequence[float] | Any, sqnorms: Sequence[float] | Any, mean_sqnorm: float) -> list[float]:
    """cos(g_i, ḡ) = ⟨g_i, ḡ⟩ / (‖g_i‖ ‖ḡ‖), clamped to [−1, 1]; NaN for a zero or non-finite norm.

    >>> cosine_to_mean([2.0, 0.0], [4.0, 1.0], 1.0)
    [1.0, 0.0]
    """
    mean_norm = math.sqrt(mean_sqnorm) if mean_sqnorm >= 0 else NAN
    out = []
    for dot, sqnorm in zip(as_floats(dots), as_floats(sqnorms), strict=True):
        ratio = _safe_div(dot, math.sqrt(sqnorm) * mean_norm if sqnorm >= 0 else NAN)
        out.append(ratio if math.isnan(ratio) else min(1.0, max(-1.0, ratio)))
    return out


def gram_statistics(gram: Any) -> tuple[list[float], list[float], float]:
    """Squared norms, dot products with the mean and ‖ḡ‖², all read off an exact Gram matrix.

    ‖g_i‖² = G_ii, ⟨g_i, ḡ⟩ = (1/N) Σ_j G_ij and ‖ḡ‖² = (1/N²) Σ_ij G_ij.

    >>> gram_statistics([[1.0, 0.0], [0.0, 1.0]])
    ([1.0, 1.0], [0.5, 0.5], 0.5)
    """
    rows = as_matrix(gram)
    n = len(rows)
    sqnorms = [row[i] for i, row in enumerate(rows)]
    dots = [fsum(row) / n for row in rows]
    return sqnorms, dots, fsum(dots) / n


# --------------------------------------------------------------------------- diversity and noise


def gradient_diversity(sqnorms: Sequence[float] | Any, mean_sqnorm: float) -> float:
    """Σ‖g_i‖² / ‖Σ g_i‖² (Yin et al. 2018), using ‖Σ g_i‖² = N² ‖ḡ‖².

    1/N when all gradients are identical, 1 when they are mutually orthogonal.

    >>> gradient_diversity([2.0, 2.0], 2.0)
    0.5
    """
    values = as_floats(sqnorms)
    return _safe_div(fsum(values), len(values) ** 2 * mean_sqnorm)


def batch_sizes(per_rank_tokens: Sequence[float] | None, world_size: int) -> tuple[float, float, str]:
    """(B_small, B_big, unit) for the noise scale: tokens when every rank gave a count, else batches.

    >>> batch_sizes([10, 30], 2)
    (20.0, 40.0, 'tokens')
    >>> batch_sizes(None, 4)
    (1.0, 4.0, 'batches')
    """
    tokens = as_floats(per_rank_tokens) if per_rank_tokens is not None else []
    if tokens and len(finite_values(tokens)) == len(tokens):
        return fsum(tokens) / len(tokens), fsum(tokens), "tokens"
    return 1.0, float(world_size), "batches"


def noise_scale_estimators(small_sqnorm: float, big_sqnorm: float, b_small: float, b_big: float) -> tuple[float, float, float]:
    """Unbiased |G|² and tr(Σ) estimates and B_simple (McCandlish et al. 2018, appendix A).

    ``small_sqnorm`` is |G_small|² = mean_i ‖g_i‖² (per-rank gradients, batch ``b_small``) and
    ``big_sqnorm`` is |G_big|² = ‖ḡ‖² (the all-reduced gradient, batch ``b_big``)::

        |G|²_est = (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
        S_est    = (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)
        B_simple = S_est / |G|²_est

    Both estimators are unbiased but noisy and |G|²_est can be ≤ 0 on one step, so summarise
    B_simple over a window as mean(S_est) / mean(|G|²_est), never as the mean of per-step ratios.
    NaN when B_small == B_big (one rank).

    >>> noise_scale_estimators(small_sqnorm=3.0, big_sqnorm=1.5, b_small=1.0, b_big=4.0)
    (1.0, 2.0, 2.0)
    """
    if b_big == b_small:
        return NAN, NAN, NAN
    grad_sqnorm = (b_big * big_sqnorm - b_small * small_sqnorm) / (b_big - b_small)
    trace_sigma = (small_sqnorm - big_sqnorm) / (1.0 / b_small - 1.0 / b_big)
    return grad_sqnorm, trace_sigma, _safe_div(trace_sigma, grad_sqnorm)


# --------------------------------------------------------------------------- one step


def compute_step_metrics(
    *,
    step: int,
    direction: str,
    per_rank_loss: Sequence[float] | Any,
    per_rank_sqnorm: Sequence[float] | Any,
    dots_with_mean: Sequence[float] | Any,
    mean_sqnorm: float,
    gram: Any,
    per_rank_tokens: Sequence[float] | None = None,
    nonfinite_flags: Sequence[bool] | None = None,
    loss_measured: Sequence[bool] | None = None,
    per_rank_extras: Mapping[str, Sequence[float]] | None = None,
    buckets: int = 0,
) -> StepMetrics:
    """Every metric of one step from the gathered per-rank numbers.

    Args:
        step: The monitor's step counter.
        direction: "exact" or "sketch", recorded as is.
        per_rank_loss: Each rank's local loss.
        per_rank_sqnorm: Each rank's ‖g_i‖² (local gradient, before the all-reduce).
        dots_with_mean: Each rank's ⟨g_i, ḡ⟩.
        mean_sqnorm: ‖ḡ‖².
        gram: N×N Gram matrix (exact or sketched) giving the pairwise cosines.
        per_rank_tokens: Token counts per rank; noise-scale units are tokens when all are given.
        nonfinite_flags: Extra per-rank non-finite flags (OR-ed with the loss/norm checks).
        loss_measured: Per rank, whether its loss is known (default: all); an unknown loss is NaN but
            not a non-finite event, and makes the step's loss dispersions NaN.
        per_rank_extras: Caller scalars per rank, passed through.
        buckets: Number of gradient buckets that contributed, passed through.

    Example:
        >>> m = compute_step_metrics(step=0, direction="exact", per_rank_loss=[1.0, 1.0],
        ...     per_rank_sqnorm=[1.0, 1.0], dots_with_mean=[1.0, 1.0], mean_sqnorm=1.0,
        ...     gram=[[1.0, 1.0], [1.0, 1.0]])
        >>> m.cosine_min, m.gradient_diversity, m.loss_std
        (1.0, 0.5, 0.0)
    """
    losses = as_floats(per_rank_loss)
    sqnorms = as_floats(per_rank_sqnorm)
    world = len(losses)
    norms = [math.sqrt(value) if value >= 0 else NAN for value in sqnorms]
    flags = list(nonfinite_flags) if nonfinite_flags is not None else [False] * world
    measured = list(loss_measured) if loss_measured is not None else [True] * world
    losses = [loss if measured[rank] else NAN for rank, loss in enumerate(losses)]
    nonfinite = [
        rank
        for rank in range(world)
        if flags[rank] or (measured[rank] and not math.isfinite(losses[rank])) or not math.isfinite(sqnorms[rank])
    ]
    cosine = _cosine_array(gram)
    # A dispersion over the ranks that happened to be measured would be a different quantity: all or nothing.
    loss_std, loss_range, _ = dispersion(losses) if all(measured) else (NAN, NAN, NAN)
    grad_norm_std, _, grad_norm_cv = dispersion(norms)
    cosine_mean, cosine_min = cosine_summary(cosine)
    tokens = as_floats(per_rank_tokens) if per_rank_tokens is not None else None
    if tokens is not None and len(finite_values(tokens)) != len(tokens):
        tokens = None
    b_small, b_big, unit = batch_sizes(tokens, world)
    grad_sqnorm, trace_sigma, noise = noise_scale_estimators(fsum(sqnorms) / world, mean_sqnorm, b_small, b_big)
    return StepMetrics(
        step=step,
        direction=direction,
        world_size=world,
        buckets=buckets,
        per_rank_loss=losses,
        per_rank_tokens=[int(value) for value in tokens] if tokens is not None else None,
        per_rank_grad_norm=norms,
        cosine_to_mean=cosine_to_mean(dots_with_mean, sqnorms, mean_sqnorm),
        pairwise_cosine=cosine.tolist(),
        loss_std=loss_std,
        loss_range=loss_range,
        grad_norm_std=grad_norm_std,
        grad_norm_cv=grad_norm_cv,
        cosine_mean=cosine_mean,
        cosine_min=cosine_min,
        mean_grad_norm=math.sqrt(mean_sqnorm) if mean_sqnorm >= 0 else NAN,
        gradient_diversity=gradient_diversity(sqnorms, mean_sqnorm),
        grad_sqnorm_est=grad_sqnorm,
        trace_sigma_est=trace_sigma,
        noise_scale=noise,
        noise_scale_unit=unit,
        nonfinite_ranks=nonfinite,
        loss_measured=all(measured),
        per_rank_extras={key: as_floats(values) for key, values in (per_rank_extras or {}).items()},
    )


# --------------------------------------------------------------------------- windows


def window_summary(values: Iterable[float | None]) -> dict[str, float | None]:
    """Median, 95th percentile, min and max of a window, ignoring None and NaN.

    Percentiles interpolate linearly between order statistics (numpy's default). All four are
    None for a window with no values.

    >>> window_summary([10.0, None, 0.0, float("nan")])
    {'median': 5.0, 'p95': 9.5, 'min': 0.0, 'max': 10.0}
    """
    kept = sorted(value for value in (NAN if v is None else float(v) for v in values) if not math.isnan(value))
    if not kept:
        return {"median": None, "p95": None, "min": None, "max": None}
    return {"median": _quantile(kept, 0.5), "p95": _quantile(kept, 0.95), "min": kept[0], "max": kept[-1]}


def _quantile(ordered: Sequence[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    if low == position or low + 1 >= len(ordered):
        return ordered[low]  # also keeps an infinite order statistic from turning into NaN
    return ordered[low] + (ordered[low + 1] - ordered[low]) * (position - low)

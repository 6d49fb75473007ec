"""Envelopes: which metrics are gated, on which window statistic, and how bounds are fitted from K runs.

:data:`METRICS` is the one table of the per-step aggregates a run summarises: what each measures,
whether it is gated, on which window statistic and scale. Pure numbers in, bounds out;
:mod:`healthcheck.judge.baseline` applies this to probe results and files.

How the bounds are derived
--------------------------
For each gated metric ``m`` (:data:`METRICS`) take its window statistic ``S`` (the median or p95
over the post-warmup steps) from each of the K runs, and map it to the fitting scale: ``y = log S`` for
dispersions (positive, varying multiplicatively, and a collapse to 0 then lies at -inf, outside any
envelope), ``y = S`` for cosines. Then::

    c      = median(y)                                        robust to one odd run
    sigma  = max(1.4826 * MAD(y), sd(y), floor_m)
    floor_m = rel_floor_m                    on the log scale (log units ~ a fraction of the value)
            = max(abs_floor_m, rel_floor_m * |c|)  on the linear scale
    k      = t_{K-1}(1 - alpha / (2 M)) * sqrt(1 + pi / (2 K))
    lower, upper = inverse_scale(c - k * sigma), inverse_scale(c + k * sigma)

False alarms. For exchangeable normal ``y``, ``(y_new - mean) / (sd * sqrt(1 + 1/K))`` is Student-t with
K-1 degrees of freedom, so the t prediction interval misses a fresh clean run with probability exactly
alpha/M. The median centre has variance ~ pi sigma^2 / (2K) rather than sigma^2 / K, hence the pi/2.
Taking sigma >= sd(y) keeps that calibration; MAD and the floor only widen. (Monte Carlo, K=5, M=7:
realised per-metric rate 0.97e-3 against the 1.43e-3 target; with 0.5 sd in place of sd it is 3.6x
the target, so no fraction below 1 is used.) The floor exists because with K=3..5 the MAD, and even the
sd, can be ~0 by chance or by quantised metrics. Checking M metrics at alpha/M each, the union bound
(Bonferroni) gives P(any envelope fails on an unchanged config) <= alpha = 1% by default, whatever
the metrics' correlation. Assumptions: the runs differ only in ``train.seed`` on the same hardware
and software, and the statistics vary across seeds roughly normally on the chosen scale.
"""

from __future__ import annotations

import math
import statistics
from typing import Literal, Optional, Sequence

from pydantic import Field, model_validator

from healthcheck.typed import FiniteRecord

DEFAULT_FALSE_ALARM_RATE = 0.01
#: 1 / Phi^-1(3/4): makes the MAD a consistent estimate of a normal sd.
MAD_TO_SD = 1.4826

Statistic = Literal["median", "p95", "min", "max"]


class MetricSpec(FiniteRecord):
    """How one metric is fitted and whether it gates the verdict."""

    gated: bool = Field(description="Whether fit_baseline gives it an envelope (and so whether it can fail a run).")
    statistic: Statistic = Field(description="Window statistic taken from RunResult.summary[metric].")
    scale: Literal["linear", "log"] = Field(description="Scale the spread is fitted on; log for positive dispersions.")
    # Floors on sigma, so K identical-looking runs still get a usable width: at K=5, M=7 the half-width
    # is ~9 sigma, i.e. at least +-9% for dispersions and +-0.045 for cosines.
    abs_floor: float = Field(1e-6, gt=0, description="Minimum sigma in metric units (linear scale).")
    rel_floor: float = Field(0.01, gt=0, description="Minimum sigma as a fraction of the value (log units on the log scale).")
    rank_z: Optional[str] = Field(None, description="RankSummary z-score field that attributes a failure to ranks.")
    required: bool = Field(
        True, description="False: fit_baseline skips the metric when no fitting run measured it (an optional check was off)."
    )
    title: str = Field(description="Short human name.")
    description: str = Field(description="What the per-step value measures (OpenMetrics HELP text, docs).")
    per_step: bool = Field(True, description="False: one value computed from the whole window, not a per-step statistic.")
    why: str = Field(description="Why it is (not) gated with this statistic.")


#: The one metric table: every aggregate a run summarises, and which gate, by which window statistic,
#: on which scale. Medians track the level of a metric; p95 tracks intermittent spikes (one rank now
#: and then far off).
METRICS: dict[str, MetricSpec] = {
    "loss_std": MetricSpec(
        gated=True,
        statistic="median",
        scale="log",
        rank_z="z_loss",
        description="std of the ranks' local losses",
        title="Cross-rank loss spread",
        why="Level of disagreement between ranks' losses; 0 when every rank reads the same batch.",
    ),
    "loss_range": MetricSpec(
        gated=True,
        statistic="p95",
        scale="log",
        rank_z="z_loss",
        description="max - min of the ranks' local losses",
        title="Cross-rank loss range (spikes)",
        why="Catches a rank that is intermittently far off, which the median spread hides.",
    ),
    "grad_norm_std": MetricSpec(
        gated=True,
        statistic="p95",
        scale="log",
        rank_z="z_grad_norm",
        description="std of the ranks' local gradient norms before the all-reduce",
        title="Cross-rank gradient-norm spread (spikes)",
        why="Spikes in gradient-norm disagreement (a bad batch or a loss-scale glitch on one rank).",
    ),
    "grad_norm_cv": MetricSpec(
        gated=True,
        statistic="median",
        scale="log",
        rank_z="z_grad_norm",
        description="coefficient of variation of the local gradient norms",
        title="Gradient-norm coefficient of variation",
        why="Scale-free level of gradient-norm disagreement; a loss-scale mismatch multiplies it.",
    ),
    "cosine_mean": MetricSpec(
        gated=True,
        statistic="median",
        scale="linear",
        abs_floor=0.005,
        rank_z="z_cosine_to_mean",
        description="mean pairwise cosine between the ranks' local gradients",
        title="Mean pairwise gradient cosine",
        why="Goes to 1.0 when ranks compute the same gradient (collapsed effective batch), down when they diverge.",
    ),
    "cosine_min": MetricSpec(
        gated=False,
        statistic="median",
        scale="linear",
        abs_floor=0.005,
        rank_z="z_cosine_to_mean",
        description="lowest pairwise cosine between local gradients",
        title="Lowest pairwise gradient cosine",
        why="Not gated: the same signal as cosine_to_mean_min, but a min over n(n-1)/2 pairs (noisier) that names a "
        "pair rather than a rank; gating it would also widen every envelope through the Bonferroni count.",
    ),
    "cosine_to_mean_min": MetricSpec(
        gated=True,
        statistic="median",
        scale="linear",
        abs_floor=0.005,
        rank_z="z_cosine_to_mean",
        description="lowest cosine of a rank's local gradient to the averaged gradient",
        title="Lowest rank cosine to the mean gradient",
        why="One rank drifting from the consensus (different seed, data or loss scale).",
    ),
    "gradient_diversity": MetricSpec(
        gated=True,
        statistic="median",
        scale="log",
        rank_z="z_cosine_to_mean",
        description="sum of squared local norms over squared norm of the sum (Yin et al.)",
        title="Gradient diversity",
        why="Falls to 1/N when all local gradients are equal.",
    ),
    "reduction_rel_error": MetricSpec(
        gated=True,
        statistic="p95",
        scale="log",
        required=False,
        description="relative L2 error of the all-reduced mean gradient against a float64 mean of the gathered local "
        "gradients, worst rank (reduction-check steps only)",
        title="All-reduce error vs a float64 mean",
        why="Rounding of the gradient all-reduce; a bf16/compressed reduction, another algorithm or world size "
        "moves it by orders of magnitude. Only measured when metrics.reduction_check_every > 0.",
    ),
    "noise_scale": MetricSpec(
        gated=False,
        statistic="median",
        scale="linear",
        description="simple gradient noise scale B_simple (McCandlish et al.), per step",
        title="Gradient noise scale",
        why="Not gated: a ratio of two noisy estimates that goes negative or explodes when |G|^2 is small, and a "
        "function of the gradient dispersion the gated metrics already cover.",
    ),
    "loss_mean": MetricSpec(
        gated=False,
        statistic="median",
        scale="log",
        rank_z="z_loss",
        description="mean of the ranks' local losses (the curve a dashboard shows)",
        title="Mean loss",
        why="Not gated: it measures training progress, not consistency; it moves with legitimate model or data "
        "changes and barely moves when every rank reads the same data.",
    ),
    "noise_scale_pooled": MetricSpec(
        gated=False,
        statistic="median",
        scale="linear",
        per_step=False,
        title="Pooled gradient noise scale",
        description="B_simple as mean(tr Σ estimate) / mean(|G|² estimate) over the window, the stable form "
        "McCandlish et al. recommend (per-step ratios are noisy and can go negative)",
        why="Not gated: one number per window, and a function of the gradient dispersion the gated metrics cover.",
    ),
}


class Envelope(FiniteRecord):
    """The approved range of one metric's window statistic."""

    statistic: Statistic = Field(description="Window statistic judged: median, p95, min or max.")
    scale: Literal["linear", "log"] = Field("linear", description="Scale the bounds were fitted on.")
    center: float = Field(description="Median of the fitting runs' values (metric units).")
    lower: float = Field(description="Lowest accepted value (metric units).")
    upper: float = Field(description="Highest accepted value (metric units).")
    sigma: Optional[float] = Field(None, ge=0, description="Fitted spread, in fitting-scale units.")
    k: Optional[float] = Field(None, ge=0, description="Half-width in sigmas: t-quantile x sqrt(1 + pi/(2K)).")
    values: list[float] = Field(default_factory=list, description="The statistic in each fitting run, by seed.")

    @model_validator(mode="after")
    def _ordered(self) -> "Envelope":
        if self.lower > self.upper:
            raise ValueError(f"lower {self.lower:g} is above upper {self.upper:g}")
        if not self.lower <= self.center <= self.upper:
            raise ValueError(f"center {self.center:g} is outside [lower {self.lower:g}, upper {self.upper:g}]")
        return self


# --------------------------------------------------------------------------- pure math


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer ``df``, by the exact finite series (A&S 26.7.3-4).

    >>> round(student_t_cdf(2.776445, 4), 6)
    0.975
    """
    theta = math.atan2(t, math.sqrt(df))
    cos2, sin = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:
        term = total = math.cos(theta) if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= 2 * j / (2 * j + 1) * cos2
            total += term
        two_sided = 2 / math.pi * (theta + sin * total)
    else:
        term = total = 1.0
        for j in range(1, df // 2):
            term *= (2 * j - 1) / (2 * j) * cos2
            total += term
        two_sided = sin * total
    return 0.5 + two_sided / 2


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with integer ``df`` >= 1 (bisection on the exact cdf).

    >>> round(t_quantile(0.975, 4), 3)
    2.776
    """
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"need 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    if df > 1000:  # the series has df/2 terms; Cornish-Fisher is within ~1e-7 out here
        z = statistics.NormalDist().inv_cdf(p)
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        low, high = high, high * 2
    for _ in range(200):
        mid = (low + high) / 2
        if student_t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def envelope_multiplier(n_runs: int, n_gated: int, false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE) -> float:
    """Half-width in sigmas: ``t_{K-1}(1 - alpha/(2M)) * sqrt(1 + pi/(2K))`` (see module docstring).

    >>> round(envelope_multiplier(5, 7), 2)
    8.99
    """
    quantile = t_quantile(1 - false_alarm_rate / (2 * n_gated), n_runs - 1)
    return quantile * math.sqrt(1 + math.pi / (2 * n_runs))


def robust_sigma(values: Sequence[float]) -> float:
    """``1.4826 * MAD``: a normal sd estimate that one wild value cannot inflate.

    >>> robust_sigma([1.0, 2.0, 3.0, 4.0, 100.0])
    1.4826
    """
    center = statistics.median(values)
    return MAD_TO_SD * statistics.median(abs(v - center) for v in values)


def fit_envelope(values: Sequence[float], spec: MetricSpec, multiplier: float) -> Envelope:
    """Fit one metric's two-sided envelope from its per-run values (module docstring has the formula).

    A log-scale metric falls back to the linear scale when a run's value is not positive or the log
    bounds overflow, so every finite input gets a finite two-sided envelope.
    """
    if len(values) < 2:
        raise ValueError("need at least two values")
    use_log = spec.scale == "log" and all(v > 0 for v in values)
    fitted = [math.log(v) for v in values] if use_log else list(values)
    center = statistics.median(fitted)
    floor = spec.rel_floor if use_log else max(spec.abs_floor, spec.rel_floor * abs(center))
    sigma = max(robust_sigma(fitted), statistics.stdev(fitted), floor)
    half = multiplier * sigma
    if use_log:
        # exp(log(x)) can round past x; pin the centre between the middle raw values it came from.
        mid = min(max(math.exp(center), statistics.median_low(values)), statistics.median_high(values))
        try:
            lower, upper = math.exp(center - half), math.exp(center + half)
        except OverflowError:
            return fit_envelope(values, spec.model_copy(update={"scale": "linear"}), multiplier)
        if lower < mid < upper and math.isfinite(upper):
            return Envelope(
                statistic=spec.statistic, scale="log", center=mid, lower=lower, upper=upper, sigma=sigma, k=multiplier, values=list(values)
            )
        return fit_envelope(values, spec.model_copy(update={"scale": "linear"}), multiplier)
    if not math.isfinite(center + half) or not math.isfinite(center - half):
        raise ValueError(f"values too large to fit: {list(values)}")
    return Envelope(
        statistic=spec.statistic,
        scale="linear",
        center=center,
        lower=center - half,
        upper=center + half,
        sigma=sigma,
        k=multiplier,
        values=list(values),
    )

"""From the per-step rows to the window summary in ``result.json``: per metric, and per rank.

The window is every sampled step at or after ``metrics.warmup_steps``: the first steps of a
fine-tune are dominated by the learning-rate warmup and the random head, not by the config.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Iterable

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE, MetricSummary, NonFiniteEvent, RankSummary, read_jsonl
from healthcheck.metrics import window_summary

#: Per-step aggregate → what it measures. These names are what baselines put envelopes on.
METRICS: dict[str, str] = {
    "loss_mean": "mean of the ranks' local losses (the curve a dashboard shows)",
    "loss_std": "std of the ranks' local losses",
    "loss_range": "max - min of the ranks' local losses",
    "grad_norm_std": "std of the ranks' local gradient norms before the all-reduce",
    "grad_norm_cv": "coefficient of variation of the local gradient norms",
    "cosine_mean": "mean pairwise cosine between the ranks' local gradients",
    "cosine_min": "lowest pairwise cosine between local gradients",
    "cosine_to_mean_min": "lowest cosine of a rank's local gradient to the averaged gradient",
    "gradient_diversity": "sum of squared local norms over squared norm of the sum (Yin et al.)",
    "noise_scale": "simple gradient noise scale B_simple (McCandlish et al.), per step",
    "reduction_rel_error": "relative L2 error of the all-reduced mean gradient against a float64 mean of the "
    "gathered local gradients, worst rank (reduction-check steps only)",
}

#: Window-level metrics that are not per-step statistics.
POOLED_METRICS = {
    "noise_scale_pooled": "B_simple as mean(tr Σ estimate) / mean(|G|² estimate) over the window, "
    "the stable form McCandlish et al. recommend (per-step ratios are noisy and can go negative)",
}

#: Per-rank columns of steps.jsonl that the attribution table averages and z-scores.
RANK_FIELDS = ("loss", "grad_norm", "cosine_to_mean", "compute_ms")


def _finite(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _mean(values: Iterable[Any]) -> float | None:
    finite = _finite(values)
    return sum(finite) / len(finite) if finite else None


def leave_one_out_z(values: list[float | None]) -> list[float | None]:
    """Each value's z-score against the *other* ranks, so one outlier cannot hide in its own spread.

    >>> z = leave_one_out_z([1.0, 1.1, 0.9, 1.0, 5.0])
    >>> round(z[-1]), abs(z[0]) < 1
    (49, True)
    """
    out: list[float | None] = []
    for index, value in enumerate(values):
        others = _finite(v for i, v in enumerate(values) if i != index)
        if value is None or not math.isfinite(value) or len(others) < 2:
            out.append(None)
            continue
        centre = statistics.fmean(others)
        # A floor keeps identical other ranks (e.g. replicated data) from turning rounding into z=1e9.
        spread = max(statistics.pstdev(others), 1e-3 * abs(centre), 1e-12)
        out.append((value - centre) / spread)
    return out


def summarize_metrics(aggregates: list[dict[str, Any]], window_start: int) -> tuple[dict[str, MetricSummary], int]:
    window = [row for row in aggregates if row["step"] >= window_start]
    summary = {name: MetricSummary(**window_summary(row.get(name) for row in window), n=len(_finite(row.get(name) for row in window)))
               for name in METRICS}
    summary["noise_scale_pooled"] = pooled_noise_scale(window)
    return summary, len(window)


def pooled_noise_scale(window: list[dict[str, Any]]) -> MetricSummary:
    """Ratio of the window means of the two unbiased estimators; one number, so every statistic is it."""
    trace = _mean(row.get("trace_sigma_est") for row in window)
    grad_sq = _mean(row.get("grad_sqnorm_est") for row in window)
    if trace is None or grad_sq is None or grad_sq == 0:
        return MetricSummary()
    value = trace / grad_sq
    return MetricSummary(median=value, p95=value, min=value, max=value, n=len(window))


def summarize_ranks(rows: list[dict[str, Any]], window_start: int) -> list[RankSummary]:
    window = [row for row in rows if row["step"] >= window_start]
    ranks = sorted({row["rank"] for row in window})
    means = {field: [_mean(r[field] for r in window if r["rank"] == rank) for rank in ranks] for field in RANK_FIELDS}
    z_scores = {field: leave_one_out_z(means[field]) for field in RANK_FIELDS}
    out = []
    for index, rank in enumerate(ranks):
        out.append(RankSummary(
            rank=rank,
            tokens=_mean(r["tokens"] for r in window if r["rank"] == rank),
            **{field: means[field][index] for field in RANK_FIELDS},
            **{f"z_{field}": z_scores[field][index] for field in RANK_FIELDS},
        ))
    return out


def first_nonfinite(aggregates: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[NonFiniteEvent]:
    """The first step at which each rank's loss or local gradient went NaN/Inf."""
    events: dict[int, NonFiniteEvent] = {}
    by_step = {(r["step"], r["rank"]): r for r in rows}
    for row in aggregates:
        for rank in row.get("nonfinite_ranks") or []:
            if rank in events:
                continue
            rank_row = by_step.get((row["step"], rank), {})
            what = "loss" if rank_row.get("loss") is None else "gradient"
            events[rank] = NonFiniteEvent(rank=rank, step=row["step"], what=what)
    return sorted(events.values(), key=lambda e: (e.step, e.rank))


def summarize_run(run_dir: Path, window_start: int) -> dict[str, Any]:
    """Everything ``result.json`` needs from the step files (works on a crashed run's partial files too)."""
    aggregates = list(read_jsonl(run_dir / AGGREGATES_FILE))
    rows = list(read_jsonl(run_dir / STEPS_FILE))
    from healthcheck.attribution import find_standouts  # it builds on this module's z-scores

    summary, window_steps = summarize_metrics(aggregates, window_start)
    per_rank = summarize_ranks(rows, window_start)
    return {
        "summary": summary,
        "window_steps": window_steps,
        "per_rank": per_rank,
        "standouts": find_standouts(per_rank, rows, window_start),
        "nonfinite": first_nonfinite(aggregates, rows),
        "last_step": max((row["step"] for row in aggregates), default=-1),
    }

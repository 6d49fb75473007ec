"""From the per-step rows to the window summary in ``result.json``.

The window is every sampled step at or after ``metrics.warmup_steps``: the first steps of a
fine-tune are dominated by the learning-rate warmup and the random head, not by the config.
Per metric here (the names of :data:`healthcheck.judge.envelope.METRICS`); per rank in
:mod:`healthcheck.judge.attribution`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE, MetricSummary, NonFiniteEvent
from healthcheck.files import read_jsonl
from healthcheck.finite import finite_values
from healthcheck.judge.attribution import find_standouts, summarize_ranks
from healthcheck.judge.envelope import METRICS
from healthcheck.measure.metrics import window_summary


def _mean(values: Iterable[Any]) -> float | None:
    finite = finite_values(values)
    return sum(finite) / len(finite) if finite else None


def summarize_metrics(aggregates: list[dict[str, Any]], window_start: int) -> tuple[dict[str, MetricSummary], int]:
    window = [row for row in aggregates if row["step"] >= window_start]
    summary = {
        name: MetricSummary(**window_summary(row.get(name) for row in window), n=len(finite_values(row.get(name) for row in window)))
        for name, spec in METRICS.items()
        if spec.per_step
    }
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

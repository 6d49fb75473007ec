"""The per-step series every chart of a run draws, computed once from the run's records.

The PNGs (:mod:`.plots`), the HTML page's SVG charts (:mod:`.charts`) and the Mermaid charts of the
CI summary (:mod:`.mermaid`) all take their data from here, so they can never show different numbers:
each rank's loss per step, the global mean, the dispersion panels with their envelope findings, the
window-mean pairwise cosine matrix, and which ranks stand out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Mapping, Optional, Sequence

from healthcheck.artifacts import RunResult
from healthcheck.finite import is_finite_number
from healthcheck.judge.attribution import find_standouts, rank_summaries
from healthcheck.judge.findings import Finding, Verdict

#: (aggregates key, label) of the dispersion panels, top to bottom: the gated consistency signals
#: that move first when ranks disagree.
DISPERSION_PANELS = (
    ("loss_std", "loss std across ranks (nats/token)"),
    ("grad_norm_cv", "grad-norm CV across ranks (std / mean)"),
    ("cosine_mean", "mean pairwise gradient cosine"),
)
#: The cosine heatmap's colour scale spans the off-diagonal values, but never less than this.
MIN_COSINE_SPAN = 0.2


def standout_ranks(result: RunResult, steps: Optional[Sequence[Mapping[str, Any]]]) -> list[int]:
    """The ranks the attribution names (:func:`healthcheck.judge.attribution.find_standouts`), sorted."""
    per_rank = rank_summaries(result, steps)
    return sorted({s.rank for s in find_standouts(per_rank, steps, result.window_start_step)})


def loss_by_rank(steps: Sequence[Mapping[str, Any]]) -> dict[int, dict[int, float]]:
    """``{rank: {step: loss}}`` from the ``steps.jsonl`` rows, finite losses only.

    >>> loss_by_rank([{"rank": 1, "step": 0, "loss": 2.5}, {"rank": 1, "step": 1, "loss": None},
    ...               {"rank": 0, "step": 0, "loss": float("nan")}])
    {1: {0: 2.5}}
    """
    per_rank: dict[int, dict[int, float]] = defaultdict(dict)
    for row in steps:
        if is_finite_number(row.get("loss")) and row.get("rank") is not None:
            per_rank[int(row["rank"])][int(row["step"])] = float(row["loss"])
    return dict(sorted(per_rank.items()))


def mean_loss(per_rank: Mapping[int, Mapping[int, float]], aggregates: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """The global mean loss per step: ``aggregates.jsonl``'s ``loss_mean``, else the mean of the finite ranks.

    >>> mean_loss({0: {0: 2.0, 1: 1.0}, 1: {0: 4.0}}, [{"step": 1, "loss_mean": 1.5}])
    {0: 3.0, 1: 1.5}
    """
    by_step: dict[int, list[float]] = defaultdict(list)
    for values in per_rank.values():
        for step, loss in values.items():
            by_step[step].append(loss)
    recorded = {int(a["step"]): float(a["loss_mean"]) for a in aggregates if is_finite_number(a.get("loss_mean"))}
    return {step: recorded.get(step, sum(by_step[step]) / len(by_step[step])) for step in sorted(by_step)}


def panel_points(aggregates: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, Optional[float]]]:
    """``(step, value)`` of one aggregates column, in step order; None where the value is missing or not finite.

    >>> panel_points([{"step": 2, "loss_std": 0.5}, {"step": 1, "loss_std": None}], "loss_std")
    [(1, None), (2, 0.5)]
    """
    points = [(int(a["step"]), float(a[key]) if is_finite_number(a.get(key)) else None) for a in aggregates]
    return sorted(points, key=lambda p: p[0])


def findings_for(verdict: Optional[Verdict], metric: str) -> list[Finding]:
    """The verdict's envelope findings on ``metric`` that carry an observed window statistic."""
    return [f for f in (verdict.findings if verdict else []) if f.metric == metric and f.observed is not None]


def mean_pairwise_cosine(aggregates: Sequence[Mapping[str, Any]], start_step: int) -> Optional[list[list[float]]]:
    """Element-wise mean of the window's pairwise-cosine matrices, ignoring nulls (NaN where none).

    >>> mean_pairwise_cosine([{"step": 5, "pairwise_cosine": [[1, 0.2], [0.2, 1]]},
    ...                       {"step": 6, "pairwise_cosine": [[1, None], [0.4, 1]]}], start_step=5)
    [[1.0, 0.2], [0.30000000000000004, 1.0]]
    """
    sums: Optional[list[list[float]]] = None
    counts: Optional[list[list[int]]] = None
    for row in aggregates:
        matrix = row.get("pairwise_cosine")
        if row.get("step", -1) < start_step or not matrix:
            continue
        n = len(matrix)
        if sums is None or len(sums) != n:  # the first matrix, or a new world size: keep the latest shape
            sums, counts = [[0.0] * n for _ in range(n)], [[0] * n for _ in range(n)]
        for i, line in enumerate(matrix[:n]):
            for j, value in enumerate(line[:n]):
                if is_finite_number(value):
                    sums[i][j] += float(value)
                    counts[i][j] += 1  # type: ignore[index]
    if sums is None or counts is None:
        return None
    return [[s / c if c else math.nan for s, c in zip(srow, crow, strict=True)] for srow, crow in zip(sums, counts, strict=True)]


def cosine_scale(matrix: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Colour-scale limits for the cosine heatmap: the off-diagonal range, widened to :data:`MIN_COSINE_SPAN`.

    A healthy run's noise then does not fill the whole colour scale.

    >>> cosine_scale([[1.0, 0.5], [0.45, 1.0]])
    (0.375, 0.575)
    >>> cosine_scale([[1.0, -0.5], [0.9, 1.0]])
    (-0.5, 0.9)
    """
    values = [v for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j and math.isfinite(v)]
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    if high - low < MIN_COSINE_SPAN:
        middle = (low + high) / 2
        low, high = middle - MIN_COSINE_SPAN / 2, middle + MIN_COSINE_SPAN / 2
    return low, high

"""Which rank stands out: each rank's window means, their leave-one-out z-scores, and the one rule
that names a persistently-off worker.

The report's attribution table, the plots and the verdict's envelope messages all name ranks
through :func:`find_standouts`, so they can never disagree about who is off.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any, Iterable, Mapping, Optional, Sequence

from healthcheck.artifacts import RankSummary, RunResult, Standout
from healthcheck.finite import finite_values, is_finite_number
from healthcheck.judge.stats import sign_test_p

#: Per-rank columns of steps.jsonl that the attribution averages, z-scores and compares.
RANK_FIELDS = ("loss", "grad_norm", "cosine_to_mean", "compute_ms")
#: A rank stands out when its leave-one-out z (:func:`leave_one_out_z`) reaches this *and* it is
#: persistently off: on the same side of the other ranks' mean in enough window steps that a
#: one-sided sign test reaches PERSISTENCE_P. Why both: with 8 ranks the spread of the other 7 is
#: itself noisy, so |z| >= 3 alone names some rank in ~32% of healthy runs per metric (~80% over the
#: four metrics; simulated, 8 ranks x 50 steps of iid noise). A rank that is really off is off in
#: almost every step, a chance z is not: with the sign test, ~1.7% of healthy runs name a rank.
STANDOUT_Z = 3.0
PERSISTENCE_P = 1e-3


def _window_rows(steps: Iterable[Mapping[str, Any]], start_step: int) -> list[Mapping[str, Any]]:
    return [row for row in steps if row.get("step", -1) >= start_step and row.get("rank") is not None]


def _mean(values: Iterable[Any]) -> float | None:
    finite = finite_values(values)
    return sum(finite) / len(finite) if finite else None


def leave_one_out_z(values: list[float | None]) -> list[float | None]:
    """Each value's z-score against the *other* ranks, so one outlier cannot hide in its own spread.

    >>> z = leave_one_out_z([1.0, 1.1, 0.9, 1.0, 5.0])
    >>> round(z[-1]), abs(z[0]) < 1
    (57, True)
    """
    out: list[float | None] = []
    for index, value in enumerate(values):
        others = finite_values(v for i, v in enumerate(values) if i != index)
        if value is None or not math.isfinite(value) or len(others) < 2:
            out.append(None)
            continue
        centre = statistics.fmean(others)
        # A floor keeps identical other ranks (e.g. replicated data) from turning rounding into z=1e9.
        spread = max(statistics.pstdev(others), 1e-3 * abs(centre), 1e-12)
        out.append((value - centre) / spread)
    return out


def summarize_ranks(rows: list[dict[str, Any]], window_start: int) -> list[RankSummary]:
    """Each rank's window means of :data:`RANK_FIELDS` (and tokens), with leave-one-out z-scores."""
    window = [row for row in rows if row["step"] >= window_start]
    ranks = sorted({row["rank"] for row in window})
    means = {field: [_mean(r[field] for r in window if r["rank"] == rank) for rank in ranks] for field in RANK_FIELDS}
    z_scores = {field: leave_one_out_z(means[field]) for field in RANK_FIELDS}
    out = []
    for index, rank in enumerate(ranks):
        out.append(
            RankSummary(
                rank=rank,
                tokens=_mean(r["tokens"] for r in window if r["rank"] == rank),
                **{field: means[field][index] for field in RANK_FIELDS},
                **{f"z_{field}": z_scores[field][index] for field in RANK_FIELDS},
            )
        )
    return out


def rank_summaries(result: RunResult, steps: Optional[Sequence[Mapping[str, Any]]] = None) -> list[RankSummary]:
    """``result.per_rank``; or, when the probe died before writing it, the same computed from the step rows."""
    if result.per_rank or not steps:
        return sorted(result.per_rank, key=lambda s: s.rank)
    return summarize_ranks([dict(row) for row in steps], result.window_start_step)


def find_standouts(
    per_rank: Sequence[RankSummary],
    steps: Optional[Iterable[Mapping[str, Any]]] = None,
    start_step: int = 0,
    *,
    z_threshold: float = STANDOUT_Z,
    p_threshold: float = PERSISTENCE_P,
) -> list[Standout]:
    """Ranks with |z| >= ``z_threshold`` that are off the same way in enough window steps (see PERSISTENCE_P).

    Without step rows, |z| alone decides. Ordered by rank, then by |z| (largest first).
    """
    rows = _window_rows(steps or (), start_step)
    found = []
    for metric in RANK_FIELDS:
        by_step: dict[int, dict[int, float]] = defaultdict(dict)
        for row in rows:
            if is_finite_number(row.get(metric)):
                by_step[int(row["step"])][int(row["rank"])] = float(row[metric])
        for summary in per_rank:
            z = getattr(summary, f"z_{metric}")
            if z is None or not math.isfinite(z) or abs(z) < z_threshold:
                continue
            same, total = _same_side_steps(by_step, summary.rank, above=z > 0)
            if total and sign_test_p(same, total) > p_threshold:
                continue
            found.append(Standout(rank=summary.rank, metric=metric, z=z, same_side_steps=same, window_steps=total))
    return sorted(found, key=lambda s: (s.rank, -abs(s.z)))


def _same_side_steps(by_step: Mapping[int, Mapping[int, float]], rank: int, *, above: bool) -> tuple[int, int]:
    same = total = 0
    for values in by_step.values():
        others = [v for r, v in values.items() if r != rank]
        if rank not in values or len(others) < 2:
            continue
        total += 1
        diff = values[rank] - sum(others) / len(others)
        same += (diff > 0) if above else (diff < 0)
    return same, total


def standout_sentences(standouts: Sequence[Standout]) -> list[str]:
    """One sentence per rank, e.g. ``rank 0 stands out: cosine_to_mean z=-4.1 (lower in 50/50 steps)``."""
    by_rank: dict[int, list[Standout]] = defaultdict(list)
    for s in standouts:
        by_rank[s.rank].append(s)
    return [f"rank {rank} stands out: " + ", ".join(s.phrase() for s in items) for rank, items in by_rank.items()]

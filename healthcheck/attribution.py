"""Which rank stands out: the one rule that names a persistently-off worker.

The report's attribution table, the plots and the verdict's envelope messages all name ranks
through :func:`find_standouts`, so they can never disagree about who is off.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Mapping, Optional, Sequence

from healthcheck.artifacts import RankSummary, RunResult, Standout
from healthcheck.summary import RANK_FIELDS

#: Per-rank quantities the attribution compares, as named in ``steps.jsonl`` and ``RankSummary``.
ATTRIBUTION_METRICS = RANK_FIELDS
#: A rank stands out when its leave-one-out z (``healthcheck.summary``) reaches this *and* it is
#: persistently off: on the same side of the other ranks' mean in enough window steps that a
#: one-sided sign test reaches PERSISTENCE_P. Why both: with 8 ranks the spread of the other 7 is
#: itself noisy, so |z| >= 3 alone names some rank in ~32% of healthy runs per metric (~80% over the
#: four metrics; simulated, 8 ranks x 50 steps of iid noise). A rank that is really off is off in
#: almost every step, a chance z is not: with the sign test, ~1.7% of healthy runs name a rank.
STANDOUT_Z = 3.0
PERSISTENCE_P = 1e-3


def _window_rows(steps: Iterable[Mapping[str, Any]], start_step: int) -> list[Mapping[str, Any]]:
    return [row for row in steps if row.get("step", -1) >= start_step and row.get("rank") is not None]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def rank_summaries(result: RunResult, steps: Optional[Sequence[Mapping[str, Any]]] = None) -> list[RankSummary]:
    """``result.per_rank``; or, when the probe died before writing it, the same computed from the step rows."""
    if result.per_rank or not steps:
        return sorted(result.per_rank, key=lambda s: s.rank)
    from healthcheck.summary import summarize_ranks  # the one definition of the per-rank z-scores

    return summarize_ranks([dict(row) for row in steps], result.window_start_step)


def _sign_test_p(successes: int, trials: int) -> float:
    """P(at least ``successes`` of ``trials`` fair coin flips land the same way).

    >>> round(_sign_test_p(10, 10), 5)
    0.00098
    """
    return sum(math.comb(trials, k) for k in range(successes, trials + 1)) / 2**trials


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
    for metric in ATTRIBUTION_METRICS:
        by_step: dict[int, dict[int, float]] = defaultdict(dict)
        for row in rows:
            if _finite(row.get(metric)):
                by_step[int(row["step"])][int(row["rank"])] = float(row[metric])
        for summary in per_rank:
            z = getattr(summary, f"z_{metric}")
            if z is None or not math.isfinite(z) or abs(z) < z_threshold:
                continue
            same, total = _same_side_steps(by_step, summary.rank, above=z > 0)
            if total and _sign_test_p(same, total) > p_threshold:
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

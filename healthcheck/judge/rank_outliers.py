"""Ranks persistently apart from the others: in step time (stragglers) or in what they compute (rank_outliers).

Unlike the exact audits in :mod:`healthcheck.judge.exact_audits`, these two are statistical. Both lean on the
same fact: ranks that run the same code on shards of one shuffled dataset are exchangeable, so no rank
should be on one side of the others in far more steps than chance allows. Both use persistence (a
binomial tail over the steps), never a single step, because 8 ranks on 2 shared cores are noisy::

    >>> from healthcheck.judge.stats import sign_test_p
    >>> sign_test_p(44, 58) < 1e-4 < sign_test_p(43, 58)
    True
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from healthcheck.finite import is_finite_number
from healthcheck.judge.audit_outcome import AuditOutcome, rank_span
from healthcheck.judge.stats import binomial_tail, sign_test_p

# --------------------------------------------------------------------------- stragglers


def straggler_audit(
    compute_ms: Mapping[int, Sequence[float | None]],
    factor: float,
    max_p: float,
    skip_steps: int = 2,
    unclocked: Sequence[int] = (),
) -> AuditOutcome:
    """Flag a rank persistently slower than ``factor`` times the others: a sign test, never a single step.

    Per step, each rank's step time is divided by the median of the *other* ranks' (so one slow
    rank cannot shift its own reference). A rank is a straggler when it was more than ``factor`` times
    slower in so many steps that a rank whose typical ratio is ``factor`` or less would be that often
    with probability <= ``max_p`` (one-sided sign test against ``factor``, not against 1). That is the
    false-alarm rate the rule can state: per rank, at most ``max_p`` for any rank within the tolerance,
    when steps are independent (the default probe's per-rank ratios: lag-1 to lag-10 autocorrelation
    within +-0.11). Testing against 1 instead, with the median >= ``factor`` as a second condition, named
    ranks that are only a little slower for the whole run: on 8 ranks sharing 2 cores a clean rank can sit
    4-10% off (the core it runs on), be slower than the others' median in 39 of 58 steps, and single steps
    vary by +-20%. The test also refuses to judge a probe too short to show persistence (at max_p 1e-3,
    fewer than 10 timed steps can never fail).

    Args:
        compute_ms: ``step -> per-rank step time`` (None where missing): the monitor's ``busy_ms``, else
            ``compute_ms``.
        factor: Median slowdown that counts, e.g. 1.03 for 3% slower.
        max_p: Sign-test tail probability a straggler's count of slower steps must reach.
        skip_steps: First steps ignored (lazy initialisation, DDP's bucket rebuild).
        unclocked: Ranks whose host ran more ranks than cores and gave no run-queue clock
            (:mod:`healthcheck.measure.runqueue`). Their step time still holds the waits for a core, in
            which a sleeping rank's delay mostly disappears, so the audit does not judge rather than pass.

    >>> straggler_audit({s: [100.0] * 4 for s in range(20)}, 1.035, 1e-4, unclocked=[0, 1, 2, 3]).message[:40]
    'not measured: ranks 0-3 share their host'
    """
    if unclocked:
        return AuditOutcome(
            True,
            f"not measured: {_who_shares(unclocked)} their host's cores with other ranks, and the host gives no "
            "per-thread run-queue time (/proc/thread-self/schedstat), so a slow rank cannot be told from one waiting for "
            "a core; run at most one rank per core to judge stragglers",
            "unclocked",
            (),
            {"unclocked_ranks": sorted(unclocked)},
            measured=False,
        )
    ratios = straggler_ratios(compute_ms, skip_steps)
    if not ratios or sum(len(v) for v in ratios.values()) == 0:
        return AuditOutcome(True, "not measured: too few timed steps to judge stragglers", "insufficient", (), measured=False)
    median_ratio = {r: statistics.median(v) for r, v in ratios.items() if v}
    slower = {r: sum(1 for x in v if x > 1) for r, v in ratios.items()}
    above = {r: sum(1 for x in v if x > factor) for r, v in ratios.items()}
    counts = {r: len(v) for r, v in ratios.items()}
    p_values = {r: sign_test_p(above[r], counts[r]) for r in counts}
    details = {
        "median_ratio": {str(r): round(median_ratio[r], 4) for r in sorted(median_ratio)},
        "slower_steps": {str(r): slower[r] for r in sorted(slower)},
        "steps_above_factor": {str(r): above[r] for r in sorted(above)},
        "steps": max(counts.values()),
        "factor": factor,
        "max_p": max_p,
    }
    # For any max_p below 1/2 the test alone implies a median above factor; the median condition only keeps
    # a lenient max_p (near 1) from naming a rank that is above factor in a minority of its steps.
    flagged = [r for r in sorted(median_ratio) if p_values[r] <= max_p and median_ratio[r] >= factor]
    rule = f"threshold: above {factor:g}x in more steps than a rank at {factor:g}x would be, sign-test p <= {max_p:g}"
    if not flagged:
        slowest = max(median_ratio, key=lambda r: (median_ratio[r], -r))
        return AuditOutcome(
            True,
            f"no persistent straggler: the slowest rank ({slowest}) runs at "
            f"{median_ratio[slowest]:.3f}x the other ranks' median step time, above {factor:g}x in "
            f"{above[slowest]}/{counts[slowest]} steps ({rule})",
            "none",
            (),
            details,
        )
    parts = [
        f"rank {r} is persistently slower: its step time is {median_ratio[r]:.3f}x the other ranks' median "
        f"(above {factor:g}x in {above[r]}/{counts[r]} steps, p = {p_values[r]:.1g})"
        for r in flagged
    ]
    return AuditOutcome(False, "; ".join(parts) + f"; {rule}", f"slow {rank_span(flagged)}", tuple(flagged), details)


def _who_shares(ranks: Sequence[int]) -> str:
    """The sentence's subject and verb.

    >>> _who_shares([3]), _who_shares([0, 1, 2])
    ('rank 3 shares', 'ranks 0-2 share')
    """
    return f"rank {rank_span(ranks)} shares" if len(set(ranks)) == 1 else f"ranks {rank_span(ranks)} share"


def straggler_ratios(compute_ms: Mapping[int, Sequence[float | None]], skip_steps: int = 2) -> dict[int, list[float]]:
    """Per rank, its compute time over the median of the other ranks', one value per usable step.

    >>> straggler_ratios({0: [9, 1, 1, 1], 2: [2.0, 1.0, 1.0, 1.0]}, skip_steps=1)
    {0: [2.0], 1: [1.0], 2: [1.0], 3: [1.0]}
    """
    out: dict[int, list[float]] = {}
    for step in sorted(compute_ms):
        if step < skip_steps:
            continue
        row = compute_ms[step]
        for rank, value in enumerate(row):
            others = [float(v) for j, v in enumerate(row) if j != rank and v is not None and _positive(v)]
            if value is None or not _positive(value) or not others:
                continue
            out.setdefault(rank, []).append(float(value) / statistics.median(others))
    return out


def _positive(value: Any) -> bool:
    return is_finite_number(value) and value > 0


# --------------------------------------------------------------------------- data-driven outliers

#: Per-rank columns of steps.jsonl that depend only on a rank's data and code, never on its timing.
OUTLIER_METRICS = ("loss", "grad_norm", "cosine_to_mean", "tokens")


def rank_outlier_audit(per_step: Mapping[int, Mapping[str, Sequence[float | None]]], max_p: float) -> AuditOutcome:
    """Is some rank at the same extreme of a per-rank metric far more often than chance allows?

    Ranks that run the same code on disjoint shards of one shuffled dataset are exchangeable: at each
    step every rank is equally likely to have the highest (or lowest) loss, gradient norm, cosine to
    the mean or token count, with probability 1/N. A rank that holds the same extreme in k of n steps
    is tested against Binomial(n, 1/N): distribution-free, so heavy tails and the size of the effect do
    not matter, only its persistence. This catches a rank whose *own* computation differs (a label-mask
    bug, a loss scale) even when the window aggregates stay inside wide envelopes. Ties count for nobody,
    and values within 1e-6 (relative) of the extreme are ties: ranks computing the same thing (replicated
    data) differ by rounding in a persistent order, which says nothing about their data or code.

    Args:
        per_step: ``step -> {metric: per-rank values}`` for the metrics in :data:`OUTLIER_METRICS`.
        max_p: Tail probability per (rank, metric, side) below which a rank is named; with 4 metrics,
            2 sides and N ranks the family-wise false-alarm bound is 8·N·max_p.
    """
    hits: dict[tuple[str, str], list[int]] = {}
    counted: dict[str, int] = {}
    world = 0
    for step in sorted(per_step):
        for metric in OUTLIER_METRICS:
            raw = per_step[step].get(metric)
            if not raw or any(not is_finite_number(v) for v in raw) or len(raw) < 3:
                continue
            values = [float(v) for v in raw if v is not None]
            world = len(values)
            counted[metric] = counted.get(metric, 0) + 1
            for side, extreme in (("highest", max(values)), ("lowest", min(values))):
                tolerance = 1e-6 * max(abs(v) for v in values)
                holders = [r for r, v in enumerate(values) if abs(v - extreme) <= tolerance]
                counts = hits.setdefault((metric, side), [0] * world)
                if len(holders) == 1:
                    counts[holders[0]] += 1
    if not counted:
        return AuditOutcome(True, "not measured: too few sampled steps to compare the ranks", "insufficient", (), measured=False)
    findings = []
    for (metric, side), counts in hits.items():
        n = counted[metric]
        for rank, k in enumerate(counts):
            p = binomial_tail(k, n, 1 / len(counts))
            if p <= max_p:
                findings.append((rank, metric, side, k, n, p))
    details: dict[str, Any] = {"steps": max(counted.values()), "max_p": max_p}
    if not findings:
        return AuditOutcome(
            True,
            f"no rank stands out: each of the {world} ranks held a metric's extreme about as often as chance (1/{world} of steps) allows",
            "exchangeable",
            (),
            details,
        )
    findings.sort(key=lambda f: (f[5], f[0]))
    ranks = sorted({f[0] for f in findings})
    parts = [
        f"rank {r} had the {side} {metric.replace('_', ' ')} in {k}/{n} steps (p = {p:.1g})" for r, metric, side, k, n, p in findings[:4]
    ]
    more = f" and {len(findings) - 4} more" if len(findings) > 4 else ""
    details["findings"] = [{"rank": r, "metric": m, "side": sd, "steps": k, "of": n, "p": p} for r, m, sd, k, n, p in findings]
    signature = "; ".join(sorted({f"{m} {sd} {r}" for r, m, sd, _, _, _ in findings}))
    return AuditOutcome(
        False,
        "; ".join(parts) + more + f"; expected about 1/{world} of steps for ranks reading shards of one dataset with the same code",
        signature,
        tuple(ranks),
        details,
    )

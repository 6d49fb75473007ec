"""The stale-gradients audit: does every rank clear its gradients between steps alike?

Each rank's reading per step (:mod:`healthcheck.integrations.script.grad_start`) says whether the step's first
backward found the previous step's gradient still in place. Exact, not statistical: a cleared gradient is None
or zero, one that was not is the last update's gradient. A rank that carries it while others clear theirs
(a ``zero_grad`` inside a branch one rank takes) feeds last step's gradient into every update: the averaged
gradient of DDP hides it, and the parameters stay equal on every rank. Ranks that all carry, or all clear,
agree: that is the script's choice, not an inconsistency between ranks, and the message says which.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from healthcheck.judge.audit_outcome import AuditOutcome, group_ranks, not_measured, partition_signature, ranks_phrase


def stale_gradients_audit(readings: Mapping[int, Sequence[Optional[float]]]) -> AuditOutcome:
    """Judge ``step -> per-rank reading`` (1.0 carried, 0.0 cleared, None not read).

    >>> print(stale_gradients_audit({s: [0.0] * 4 for s in range(6)}).message)
    every rank started each step's backward with cleared gradients (6 steps)
    >>> print(stale_gradients_audit({0: [0.0] * 2, 1: [1.0] * 2, 2: [1.0] * 2}).message)
    every rank carried the previous step's gradients into the backward of 2 of 3 steps (no zero_grad between them): the same on every rank
    >>> outcome = stale_gradients_audit({0: [0.0] * 4, **{s: [1.0, 0.0, 1.0, 1.0] for s in range(1, 6)}})
    >>> print(outcome.message)  # doctest: +NORMALIZE_WHITESPACE
    ranks 0, 2-3 started the backward of step 1 with the previous step's gradients still in place (no zero_grad
    between steps), rank 1 with cleared ones; in 5 of 6 steps: the carried gradients add into every update
    >>> outcome.ranks, outcome.signature
    ((0, 2, 3), '0,2-3|1')
    """
    if not readings:  # a probe stopped before its first step's readings arrived: no reason of the script's
        return not_measured("no step was measured")
    judged = sorted(s for s, row in readings.items() if row and all(v is not None for v in row))
    if not judged:
        return not_measured("no step in which every rank's backward reached the trained model's output")
    differ = [s for s in judged if len(set(readings[s])) > 1]
    details = {"steps_judged": len(judged), "steps_differing": differ}
    if not differ:
        carried_steps = [s for s in judged if readings[s][0]]
        if carried_steps:
            message = (
                f"every rank carried the previous step's gradients into the backward of {len(carried_steps)} of "
                f"{len(judged)} steps (no zero_grad between them): the same on every rank"
            )
        else:
            message = f"every rank started each step's backward with cleared gradients ({len(judged)} steps)"
        return AuditOutcome(True, message, "equal", (), details)
    first = readings[differ[0]]
    levels = group_ranks([bool(v) for v in first])
    carried = sorted({r for s in differ for r, v in enumerate(readings[s]) if v})
    cleared = [r for r in range(len(first)) if not first[r]]
    message = (
        f"{ranks_phrase(carried)} started the backward of step {differ[0]} with the previous step's gradients still in "
        f"place (no zero_grad between steps), {ranks_phrase(cleared)} with cleared ones; in {len(differ)} of "
        f"{len(judged)} steps: the carried gradients add into every update"
    )
    return AuditOutcome(False, message, partition_signature(levels), tuple(carried), details)

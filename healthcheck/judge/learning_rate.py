"""The learning-rate audit: does every rank step with the same learning rate at every step?

Script mode records the learning rate of the first parameter group of the optimizer that began each update, as each
rank stepped (``lr``, :mod:`healthcheck.integrations.script.step_facts`), and a digest of every group's (``lr_groups``):
a rank whose first group agrees but whose no-decay group runs its own schedule is named from the digests, without
the rates, which the environment audit gives for the first step (``optimizer[1].lr``). A per-node schedule (another warmup length,
a resumed scheduler one step off) leaves the first step's settings equal, since a warmup starts every rank at 0, so the
environment audit, judged at the first step, cannot see it. Under DDP the parameters then part and ``param_equality``
names the rank at its next check; under FSDP2 no rank holds another's shard, and under torch's
``ZeroRedundancyOptimizer`` each rank steps its own partition and broadcasts it, so every replica stays bit-identical
while the model trains with the wrong rate. Exact: every rank computes its rate with the same arithmetic, so a
correct run's rates are equal to the bit.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from healthcheck.judge.audit_outcome import AuditOutcome, group_ranks, not_measured, odd_ones_out, partition_signature, ranks_phrase


def learning_rate_audit(
    rates: Mapping[int, Sequence[Optional[float]]], digests: Optional[Mapping[int, Sequence[Optional[float]]]] = None
) -> AuditOutcome:
    """Judge ``step -> each rank's learning rate`` (None where a rank's was not read) and, where the first groups'
    agree, ``digests``: ``step -> each rank's digest of every group's rate``.

    >>> print(learning_rate_audit({s: [s / 4] * 3 for s in range(5)}).message)
    ranks 0-2 stepped with the same learning rate at every one of 5 steps (0 to 1)
    >>> outcome = learning_rate_audit({s: [s / 4, s / 8, s / 4] for s in range(5)})
    >>> print(outcome.message)
    rank 1 stepped with another learning rate from step 1: ranks 0, 2 0.25; rank 1 0.125 (in 4 of 5 steps)
    >>> outcome.ranks, outcome.signature
    ((1,), '0,2|1')
    >>> digests = {s: [7.0, 7.0, 7.0 if s < 2 else 9.0] for s in range(5)}
    >>> print(learning_rate_audit({s: [s / 4] * 3 for s in range(5)}, digests).message)
    rank 2 stepped with another learning rate in a later parameter group from step 2 (in 3 of 5 steps; the first group's agreed)
    """
    if not rates:  # a probe stopped before its first step's rates arrived: no reason of the optimizer's
        return not_measured("no step was measured")
    judged = sorted(s for s, row in rates.items() if row and all(v is not None for v in row))
    if not judged:
        return not_measured("no step read a learning rate on every rank (an optimizer without param_groups' lr)")
    differ = [s for s in judged if len(set(rates[s])) > 1]
    details = {"steps_judged": len(judged), "steps_differing": differ}
    world = len(rates[judged[0]])
    if not differ and digests and (split := first_split(digests)) is not None:
        step, parts, _ = split
        both = [s for s in judged if s in digests and None not in digests[s]]
        other = [s for s in both if len(set(digests[s])) > 1]
        odd = odd_ones_out(parts)
        return AuditOutcome(
            False,
            f"{ranks_phrase(odd)} stepped with another learning rate in a later parameter group from step "
            f"{step} (in {len(other)} of {len(both)} steps; the first group's agreed)",
            partition_signature(parts),
            tuple(odd),
            {**details, "steps_differing": other, "groups_differ": True},
        )
    if not differ:
        values = [float(rates[s][0] or 0.0) for s in judged]  # judged: every value is a number
        span = f"{min(values):.6g}" if min(values) == max(values) else f"{min(values):.6g} to {max(values):.6g}"
        return AuditOutcome(
            True, f"{ranks_phrase(range(world))} stepped with the same learning rate at every one of {len(judged)} steps ({span})",
            "equal", (), details,
        )
    split = first_split(rates)
    assert split is not None  # differ holds such a step
    step, groups, text = split
    odd = odd_ones_out(groups)
    return AuditOutcome(
        False,
        f"{ranks_phrase(odd)} stepped with another learning rate from step {step}: {text} "
        f"(in {len(differ)} of {len(judged)} steps)",
        partition_signature(groups),
        tuple(odd),
        details,
    )


def first_split(rates: Mapping[int, Sequence[Optional[float]]]) -> Optional[tuple[int, list[list[int]], str]]:
    """The first step whose rates, read on every rank, differ: the step, the ranks grouped by rate (largest group
    first) and the groups as text; None where every such step agrees (also :func:`.assemble.explained_by_learning_rate`).

    >>> first_split({0: [0.0, 0.0, 0.0], 1: [0.5, None, 0.25], 2: [1.0, 1.0, 0.5]})
    (2, [[0, 1], [2]], 'ranks 0-1 1; rank 2 0.5')
    """
    for step in sorted(rates):
        row = rates[step]
        if row and None not in row and len(set(row)) > 1:
            groups = group_ranks(list(row))
            return step, groups, "; ".join(f"{ranks_phrase(g)} {row[g[0]]:.6g}" for g in groups)
    return None

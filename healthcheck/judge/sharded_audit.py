"""The ``sharded_state`` audit: under FSDP2, do all ranks agree on what they must share?

Parameters are sharded (one owner per shard), so there are no replicas to compare; the evidence
(:mod:`healthcheck.measure.sharded_state`) is each rank's sharding-plan digest, the bit hashes of the
all-gathered parameters after sharding and after the last step, and the optimizer's settings and step
count on every check step, and the bit hashes of the weights each rank held before ``fully_shard`` sliced them
(FSDP2 does not broadcast them, unlike DDP), and under HSDP the bit hashes of each rank's own slices after the last
step, compared between the replicas of each shard. The first disagreement is the one reported, in that order but
with the optimizer before the replicas and the all-gathered parameters after the last step: a rank's own optimizer
is the cause they show the effects of::

    >>> facts = [{"param_groups": [{"lr": 0.001}], "step": 1}] * 3 + [{"param_groups": [{"lr": 0.01}], "step": 1}]
    >>> outcome = sharded_state_audit(["p"] * 4, 7, [[1, 2]] * 4, [[3, 4]] * 4, [(0, facts)], ["a", "b"])
    >>> outcome.passed, outcome.ranks, outcome.message
    (False, (3,), "rank 3's optimizer differs at step 0: param_groups.0.lr 0.01 (ranks 0-2: 0.001)")
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from healthcheck.judge.audit_outcome import AuditOutcome, group_ranks, odd_ones_out, partition_signature, ranks_phrase


def sharded_state_audit(
    plans: Sequence[str],
    plan_tensors: int,
    start_hashes: Sequence[Sequence[int]],
    end_hashes: Sequence[Sequence[int]],
    optimizer_checks: Sequence[tuple[int, Sequence[Any]]],
    names: Sequence[str],
    pre_shard_hashes: Sequence[Sequence[int]] = (),
    pre_shard_names: Sequence[str] = (),
    shard_index: Sequence[int] = (),
    end_local_hashes: Sequence[Sequence[int]] = (),
) -> AuditOutcome:
    """Sharding plan, all-gathered parameters and optimizer: the same on every rank?"""
    world = len(plans)
    details: dict[str, Any] = {"plan_tensors": plan_tensors, "check_steps": [step for step, _ in optimizer_checks]}
    groups = group_ranks(list(plans))
    if len(groups) > 1:
        odd = odd_ones_out(groups)
        return AuditOutcome(
            False,
            f"the sharding plan (parameter names, shapes, dtypes, placements) differs on "
            f"{ranks_phrase(odd)} from {ranks_phrase(groups[0])}",
            f"plan {partition_signature(groups)}",
            tuple(odd),
            details,
        )
    if pre_shard_hashes and (split := _hash_split(pre_shard_hashes, pre_shard_names)) is not None:
        groups, odd, tensor = split
        return AuditOutcome(
            False,
            f"the weights {ranks_phrase(odd)} built before fully_shard differ from {ranks_phrase(groups[0])}'s (first "
            f"differing tensor: {tensor}); FSDP2 keeps each rank's own slice, so the model trained is a mix of them",
            f"weights before sharding {partition_signature(groups)}",
            tuple(odd),
            details,
        )
    # The cause before its effects: a rank's own optimizer moves its shard otherwise, which then parts its replicas
    # (HSDP) and the all-gathered parameters after the last step.
    if (split := _hash_split(start_hashes, names)) is not None:
        return _params_differ("after sharding", split, details)
    for step, facts in optimizer_checks:
        groups = group_ranks([json.dumps(f, sort_keys=True) for f in facts])
        if len(groups) > 1:
            odd = odd_ones_out(groups)
            # Against the largest group; with no majority (two ranks, one each) the first other group is the odd one.
            path, theirs, ours = first_difference(facts[groups[1][0]], facts[groups[0][0]])
            who = ranks_phrase(groups[1]) if len(odd) == len(facts) else ranks_phrase(odd)
            return AuditOutcome(
                False,
                f"{who}'s optimizer differs at step {step}: {path} {theirs} ({ranks_phrase(groups[0])}: {ours})",
                f"optimizer {partition_signature(groups)}",
                tuple(odd),
                details,
            )
    if shard_index and (diverged := _replicas_diverged(shard_index, end_local_hashes, names, details)) is not None:
        return diverged
    if (split := _hash_split(end_hashes, names)) is not None:
        return _params_differ("after the last step", split, details)
    checks = len(optimizer_checks)
    return AuditOutcome(
        True,
        f"{ranks_phrase(range(world))} agree on the sharding plan ({plan_tensors} tensors), "
        f"{'the weights before sharding, ' if pre_shard_hashes else ''}the "
        f"all-gathered parameters after sharding and after the last step, "
        f"{'the replicas of each shard (HSDP), ' if shard_index else ''}and the optimizer at {checks} check{'s' if checks != 1 else ''}",
        "agreed",
        (),
        details,
    )


def _params_differ(when: str, split: tuple[list[list[int]], list[int], str], details: dict[str, Any]) -> AuditOutcome:
    groups, odd, tensor = split
    return AuditOutcome(
        False,
        f"the all-gathered parameters differ {when} on {ranks_phrase(odd)} (first "
        f"differing tensor: {tensor}); every rank must see the same full parameters",
        f"params {when.split()[0]} {partition_signature(groups)}",
        tuple(odd),
        details,
    )


def _replicas_diverged(
    shard_index: Sequence[int], local_hashes: Sequence[Sequence[int]], names: Sequence[str], details: dict[str, Any]
) -> Optional[AuditOutcome]:
    """HSDP: the first shard whose replicas' slices differ after the last step, naming the ranks that hold it.

    >>> outcome = _replicas_diverged([0, 1, 0, 1, 0, 1], [[5, 6], [7, 8], [5, 6], [7, 8], [5, 6], [7, 9]], ["a", "b"], {})
    >>> outcome.ranks, outcome.message.split(";")[0]
    ((5,), "rank 5's slice of b differs from its replicas' (ranks 1, 3, the same shard 1) after the last step")
    >>> _replicas_diverged([0, 1, 0, 1], [[5, 6], [7, 8], [5, 6], [7, 9]], ["a", "b"], {}).message.split(";")[0]
    'ranks 1, 3 hold the same shard (1) but their slices of b differ after the last step'
    """
    for shard in sorted(set(shard_index)):
        holders = [rank for rank, index in enumerate(shard_index) if index == shard]
        split = _hash_split([local_hashes[rank] for rank in holders], names)
        if split is None:
            continue
        groups, odd, tensor = split
        groups, odd = [[holders[i] for i in group] for group in groups], [holders[i] for i in odd]
        if len(odd) < len(holders):
            what = (f"{ranks_phrase(odd)}'s slice of {tensor} differs from its replicas' "
                    f"({ranks_phrase(groups[0])}, the same shard {shard}) after the last step")
        else:
            what = f"{ranks_phrase(holders)} hold the same shard ({shard}) but their slices of {tensor} differ after the last step"
        return AuditOutcome(
            False,
            f"{what}; HSDP replicas must stay bit-identical (a rank that computed or wrote an update wrong, or stepped "
            "its replica otherwise)" + ("" if len(odd) < len(holders) else ": with no majority, either may be the odd one"),
            f"replicas of shard {shard} {partition_signature(groups)}",
            tuple(odd),
            details,
        )
    return None


def _hash_split(table: Sequence[Sequence[int]], names: Sequence[str]) -> Optional[tuple[list[list[int]], list[int], str]]:
    """Ranks grouped by their hash rows, the odd ones out and the first tensor where they differ; None when all agree."""
    groups = group_ranks([tuple(row) for row in table])
    if len(groups) < 2:
        return None
    odd = odd_ones_out(groups)
    reference = table[groups[0][0]]
    column = min(t for r in odd for t in range(len(reference)) if t >= len(table[r]) or table[r][t] != reference[t])
    return groups, odd, names[column] if column < len(names) else f"#{column}"


def first_difference(value: Any, reference: Any, path: str = "") -> tuple[str, Any, Any]:
    """The first dotted path where two JSON-like values differ, with both values there.

    >>> first_difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]})
    ('a.1.b', 2, 3)
    """
    if isinstance(value, dict) and isinstance(reference, dict):
        for key in sorted(set(value) | set(reference), key=str):
            if value.get(key) != reference.get(key):
                return first_difference(value.get(key), reference.get(key), f"{path}.{key}" if path else str(key))
    if isinstance(value, list) and isinstance(reference, list) and len(value) == len(reference):
        for index, (a, b) in enumerate(zip(value, reference, strict=True)):
            if a != b:
                return first_difference(a, b, f"{path}.{index}" if path else str(index))
    return path, value, reference

"""The ``replay`` audit: did every rank compute the same gradient of the same micro-batch from the same parameters?

Pure judgement of :class:`~healthcheck.artifacts.ReplayEvidence` (the workers' replays:
:mod:`healthcheck.measure.replay`, rounds run by :mod:`healthcheck.run.replay_rounds`). Ranks are compared
within their device group (same device name): bit for bit in ``bitwise`` mode, within a relative L2
tolerance measured from repeat replays in ``tolerance`` mode. A rank outside its group's strict majority is
named with how far off it was, and whether a second replay on it reproduced the difference::

    >>> split = split_replays(["a", "a", "b", "a"], [[0, 1, 2, 3]])
    >>> split.groups, split.references, split.no_majority
    ([[0, 1, 3], [2]], {2: 0}, [])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional, Sequence

from healthcheck.artifacts import ReplayDifference, ReplayEvidence, ReplayRound
from healthcheck.judge.audit_outcome import AuditOutcome, group_ranks, not_measured, partition_signature, rank_span, ranks_phrase

#: Tolerance mode: the bound is this multiple of the largest spread between two replays on one rank ...
TOLERANCE_FACTOR = 4.0
#: ... and never below this relative L2 (the sketch's fp32 rounding of equal gradients is far below it).
TOLERANCE_FLOOR = 1e-6
#: What to do about a rank whose device computes differently from its peers.
ADVICE = "drain the node and rerun `healthcheck probe` on the rest"


def replay_tolerance(repeat_spread: Sequence[float]) -> float:
    """The tolerance mode's relative L2 bound from each rank's spread between two replays of one batch.

    Two ranks running the same non-deterministic kernels differ as much as two runs on one rank, so the
    bound is a margin over the largest spread seen, with a floor for kernels that happened to agree.

    >>> replay_tolerance([0.0, 0.0]), replay_tolerance([2e-6, 5e-6])
    (1e-06, 2e-05)
    """
    return max(TOLERANCE_FLOOR, TOLERANCE_FACTOR * max(repeat_spread, default=0.0))


def tolerance_labels(distances: Sequence[Sequence[float]], tolerance: float, device_groups: Sequence[Sequence[int]]) -> list[int]:
    """Tolerance mode: a cluster label per rank; ranks within ``tolerance`` of a cluster's centre share it.

    Within each device group, the rank with the most peers within tolerance (lowest rank on a tie) is a
    centre, its peers join it, and the rest are clustered the same way.

    >>> d = [[0, 1e-7, 1e-3], [1e-7, 0, 1e-3], [1e-3, 1e-3, 0]]
    >>> tolerance_labels(d, 1e-6, [[0, 1, 2]])
    [0, 0, 1]
    """
    labels = [-1] * len(distances)
    next_label = 0
    for members in device_groups:
        remaining = sorted(members)
        while remaining:

            def near(i: int, pool: list[int]) -> list[int]:
                return [j for j in pool if max(distances[i][j], distances[j][i]) <= tolerance]

            centre = max(remaining, key=lambda i: (len(near(i, remaining)), -i))
            for rank in near(centre, remaining) or [centre]:
                labels[rank] = next_label
            next_label += 1
            remaining = [r for r in remaining if labels[r] < 0]
    return labels


@dataclasses.dataclass(frozen=True)
class ReplaySplit:
    """How one replay's ranks split: agreement groups, each odd rank's reference, groups with no majority."""

    groups: list[list[int]]
    references: dict[int, int]  #: odd rank -> the majority rank it is measured against
    no_majority: list[list[int]]  #: device groups that split with no strict majority

    @property
    def odd(self) -> list[int]:
        return sorted(self.references)


def split_replays(labels: Sequence[Hashable], device_groups: Sequence[Sequence[int]]) -> ReplaySplit:
    """Group ranks by replay result within each device group; name the ranks outside a strict majority.

    Without a strict majority every rank of the group is odd, measured against the lowest rank of the
    largest subgroup. A rank alone on its device model has nobody to be compared with.

    >>> split_replays(["x", "y", "x", "y"], [[0, 1], [2, 3]]).no_majority
    [[0, 1], [2, 3]]
    >>> split_replays(["x", "y", "x", "x"], [[0, 2, 3], [1]]).references
    {}
    """
    groups: list[list[int]] = []
    references: dict[int, int] = {}
    no_majority: list[list[int]] = []
    for members in device_groups:
        members = sorted(members)
        sub = [[members[i] for i in g] for g in group_ranks([labels[r] for r in members])]
        groups += sub
        if len(sub) < 2:
            continue
        majority = len(sub[0]) > len(sub[1])
        if not majority:
            no_majority.append(members)
        reference = sub[0][0]
        for rank in members:
            if rank not in sub[0] or not majority and rank != reference:
                references[rank] = reference
    groups.sort(key=lambda g: (-len(g), g[0]))
    return ReplaySplit(groups, references, no_majority)


def replay_audit(
    evidence: ReplayEvidence, settings_differ: Sequence[int] = (), hooks_differ: Optional[AuditOutcome] = None
) -> AuditOutcome:
    """Every replay round judged: the first round where a rank disagreed decides, later ones are listed.

    ``settings_differ``: the ranks the environment audit named. A rank that runs another config, precision or
    kernel setting computes another gradient on a sound device, so where those explain every odd rank the
    advice is to fix the settings, not to drain the node. ``hooks_differ``: the ranks whose modules carry other
    hooks (:mod:`healthcheck.measure.module_hooks`) and what differs; where they explain every odd rank, the
    advice is to check those hooks.
    """
    rounds = evidence.rounds
    if not rounds:
        return not_measured("the probe stopped before its first replay")
    peers = [g for g in evidence.device_groups if len(g) > 1]
    if not peers:
        return not_measured("every rank is alone on its device model, so no replay has a peer to be compared with")
    mode = "bitwise" if evidence.mode == "bitwise" else f"tolerance: relative L2 ≤ {evidence.tolerance:.1e}"
    details: dict[str, Any] = {
        "mode": evidence.mode,
        "mode_reason": evidence.mode_reason,
        "tolerance": evidence.tolerance,
        "replay_steps": [r.step for r in rounds],
        "device_groups": evidence.device_groups,
        "rounds": [r.model_dump() for r in rounds],
    }
    failing = [r for r in rounds if r.params_agree and (r.differences or r.no_majority)]
    if failing:
        first = failing[0]
        later = [r.step for r in failing[1:]]
        also = f" (again at step{'s' if len(later) > 1 else ''} {', '.join(map(str, later))})" if later else ""
        named = tuple(sorted(d.rank for d in first.differences))
        if first.no_majority:
            named = tuple(sorted({r for m in first.no_majority for r in m} | set(named)))
            split = "|".join(partition_signature([g for g in first.groups if set(g) <= set(m)]) for m in first.no_majority)
            message = (
                f"{_disagreement(first)}{also}, with no majority on the device model to tell which is right "
                f"[{mode}]; rerun `healthcheck probe` on each node separately to find the faulty device"
            )
            return AuditOutcome(False, message, f"no-majority {split}", named, details)
        advice = ADVICE
        runs = "runs" if len(named) == 1 else "run"
        if set(named) <= set(settings_differ):
            advice = (
                f"{ranks_phrase(named)} also {runs} with other settings "
                f"(audit.environment), which explains a different gradient: fix them before suspecting the device"
            )
        elif hooks_differ is not None and set(named) <= set(hooks_differ.ranks):
            advice = (
                f"{ranks_phrase(named)} also {runs} other hooks on the model's modules ({hooks_differ.message}), which "
                "can change what it computes (transformers' NEFTune adds noise to the embeddings through one): "
                "check them before suspecting the device"
            )
        message = f"{_disagreement(first)}{also} [{mode}]: {advice}"
        return AuditOutcome(False, message, f"differs {rank_span(named)}", named, details)
    steps = ", ".join(str(r.step) for r in rounds)
    agreed = "bit-identical gradients" if evidence.mode == "bitwise" else "gradients within the tolerance"
    message = (
        f"{ranks_phrase(sorted(r for g in peers for r in g))} computed {agreed} of the same micro-batch in "
        f"{len(rounds)} replay{'s' * (len(rounds) > 1)} (step{'s' * (len(rounds) > 1)} {steps}) [{mode}]"
    )
    skipped = [r.step for r in rounds if not r.params_agree]
    if skipped:
        message += (
            f"; at step{'s' * (len(skipped) > 1)} {', '.join(map(str, skipped))} the parameters already differed "
            "across ranks, so a difference there says nothing about a device (param_equality names the rank)"
        )
    alone = [g[0] for g in evidence.device_groups if len(g) == 1]
    if alone:
        message += f"; {ranks_phrase(alone)} had no peer on the same device model and {'was' if len(alone) == 1 else 'were'} not compared"
    return AuditOutcome(True, message, "agreed", (), details)


def _disagreement(round_: ReplayRound) -> str:
    """``rank 5 computed a different gradient at step 15: every rank replayed ..., and rank 5's ...``."""
    parts = "; ".join(_difference_phrase(d) for d in round_.differences)
    odd = sorted({d.rank for d in round_.differences} | {r for m in round_.no_majority for r in m})
    return (
        f"{ranks_phrase(odd)} computed a different gradient at step {round_.step}: every rank replayed "
        f"rank {round_.source_rank}'s micro-batch from the same parameters, and {parts}"
    )


def _difference_phrase(difference: ReplayDifference) -> str:
    """One odd rank: how far off, against whom, and whether the second replay reproduced it.

    >>> d = ReplayDifference(rank=5, reference_rank=0, max_abs=3e-5, rel_l2=1.1e-3, first_tensor="wte.weight",
    ...                      reproduced=True, repeat_rel_l2=1.1e-3)
    >>> for part in _difference_phrase(d).split("; "):
    ...     print(part)
    rank 5's gradient differs from rank 0's by max |Δ| 3.0e-05, relative L2 1.1e-03 (first in wte.weight)
    reproduced on a second replay (persistent)

    Under FSDP2 no rank keeps its replay gradient, so the difference is measured on a replay after the first: where
    the first alone differed, nothing was left to measure.

    >>> print(_difference_phrase(d.model_copy(update={"max_abs": 0.0, "rel_l2": 0.0, "reproduced": False})))
    rank 5's gradient differed from rank 0's in the first replay only, not in two more (transient)
    """
    if difference.max_abs == 0 and not difference.reproduced:
        return (f"rank {difference.rank}'s gradient differed from rank {difference.reference_rank}'s in the first replay "
                "only, not in two more (transient)")
    where = f" (first in {difference.first_tensor})" if difference.first_tensor else ""
    again = (
        "reproduced on a second replay (persistent)"
        if difference.reproduced
        else f"not reproduced on a second replay (transient: relative L2 {difference.repeat_rel_l2:.1e} then)"
    )
    return (
        f"rank {difference.rank}'s gradient differs from rank {difference.reference_rank}'s by max |Δ| "
        f"{difference.max_abs:.1e}, relative L2 {difference.rel_l2:.1e}{where}; {again}"
    )

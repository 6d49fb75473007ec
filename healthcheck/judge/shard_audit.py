"""The data-shard audit: did the ranks read disjoint shards in the planned order, epoch after epoch?

Pure analysis of what each rank consumed against the plan (torch's own DistributedSampler with the
shared seed, ``set_epoch`` each epoch); :mod:`healthcheck.judge.assemble` builds both.

    >>> data_shard_audit([[(0, [1, 2])], [(0, [1, 2])]], {(0, 0): [1, 2], (1, 0): [3, 4]}).signature
    'identical'
"""

from __future__ import annotations

from collections import Counter
from typing import Collection, Mapping, NamedTuple, Optional, Sequence

from healthcheck.judge.audit_outcome import AuditOutcome, group_ranks, odd_ones_out, partition_signature, rank_span, ranks_phrase
from healthcheck.judge.exact_audits import differences_phrase, differing_fields


def flatten_epochs(batches: Sequence[tuple[int, Sequence[int]]]) -> dict[int, list[int]]:
    """One rank's consumed micro-batches ``[(epoch, sample_ids), ...]`` as ``{epoch: ids in order}``.

    >>> flatten_epochs([(0, [3, 1]), (0, [2]), (1, [1])])
    {0: [3, 1, 2], 1: [1]}
    """
    out: dict[int, list[int]] = {}
    for epoch, ids in batches:
        out.setdefault(int(epoch), []).extend(int(i) for i in ids)
    return out


def first_departure(consumed: Sequence[int], planned: Sequence[int]) -> int | None:
    """Index of the first sample that differs from the plan (or runs past it); None when it follows it.

    >>> first_departure([5, 2, 9], [5, 2, 7, 1]), first_departure([5, 2], [5, 2, 7])
    (2, None)
    """
    for index, sample in enumerate(consumed):
        if index >= len(planned) or planned[index] != sample:
            return index
    return None


class SampleGroups(NamedTuple):
    """How a sampler reads each sample it draws, by design: ``size`` times in a row (a group), the group ``rounds``
    times an epoch (``data.sample_group``, ``data.group_rounds``: TRL's GRPO groups of generations per prompt, dealt out
    over the ranks). Once, for any other sampler."""

    size: int = 1
    rounds: int = 1

    @property
    def reads(self) -> int:
        return self.size * self.rounds


#: Any sampler but a group sampler's: each sample drawn is read once.
READ_ONCE = SampleGroups()


def shard_overlap(
    per_rank: Sequence[Mapping[int, Sequence[int]]], padded: Collection[int] = (), groups: SampleGroups = READ_ONCE
) -> list[int]:
    """Per rank, how many of its samples some other rank also consumed in the same epoch, but in the ``padded``
    epochs (:func:`padded_repeats`), whose repeats are shared by design. Where the sampler reads each sample several
    times an epoch by design (``groups``), how many of its samples the ranks together read more often than that.

    >>> shard_overlap([{0: [1, 2]}, {0: [2, 3]}, {0: [4, 5]}])
    [1, 1, 0]
    >>> shard_overlap([{0: [0, 1]}, {0: [2, 0]}], padded={0})  # 3 samples on 2 ranks: sample 0 pads rank 1
    [0, 0]
    >>> shard_overlap([{0: [7, 7]}, {0: [7, 7]}], groups=SampleGroups(4)), shard_overlap([{0: [7, 7]}, {0: [7, 7]}], groups=SampleGroups(2))
    ([0, 0], [1, 1])
    """
    shared = [0] * len(per_rank)
    epochs = {e for rank in per_rank for e in rank} - set(padded)
    for epoch in epochs:
        if groups.reads > 1:  # every read counts: a group's reads on one rank are as much the design as on two
            counts = Counter(i for rank in per_rank for i in rank.get(epoch, ()))
        else:
            counts = Counter(i for rank in per_rank for i in set(rank.get(epoch, ())))
        for r, rank in enumerate(per_rank):
            shared[r] += sum(1 for i in set(rank.get(epoch, ())) if counts[i] > groups.reads)
    return shared


def split_groups(per_rank: Sequence[Mapping[int, Sequence[int]]], groups: SampleGroups) -> list[int]:
    """Per rank, how many of its samples the ranks together read in an epoch a number of times that is no whole group.

    Each step's batches over the ranks hold whole groups (TRL requires it), so every group is read whole by the ranks
    that share it. A rank whose sampler drew other samples (its own seed) reads half a group of its own beside the
    others' halves: each rank's advantages are then normalised over completions of two prompts, and no index repeats.

    >>> split_groups([{0: [3, 3, 5, 5]}, {0: [3, 3, 5, 5]}], SampleGroups(4)), split_groups([{0: [3, 3]}, {0: [9, 9]}], SampleGroups(4))
    ([0, 0], [1, 1])
    """
    split = [0] * len(per_rank)
    if groups.size <= 1:
        return split
    for epoch in {e for rank in per_rank for e in rank}:
        counts = Counter(i for rank in per_rank for i in rank.get(epoch, ()))
        for r, rank in enumerate(per_rank):
            split[r] += sum(1 for i in set(rank.get(epoch, ())) if counts[i] % groups.size)
    return split


def padded_repeats(per_rank: Sequence[Mapping[int, Sequence[int]]], epoch: int, dataset_size: Optional[int], batch: int) -> Optional[int]:
    """How many reads of ``epoch`` repeat a sample where it read all ``dataset_size`` samples with fewer than a round
    of ``batch``-sized batches more; None where it is no such epoch.

    Such an epoch is a sampler padding its end so that every rank gets as many: torch's DistributedSampler repeats up
    to world - 1 samples, accelerate's ``even_batches`` up to a round of batches. A rank reading another order cannot
    cover the dataset with the others: what it reads in place of its own part is left unread.

    >>> padded_repeats([{0: [0, 1]}, {0: [2, 0]}], 0, 3, 1), padded_repeats([{0: [0, 1]}, {0: [1, 0]}], 0, 3, 1)
    (1, None)
    """
    reads = [i for rank in per_rank for i in rank.get(epoch, ())]
    repeats = len(reads) - len(set(reads))
    if not dataset_size or len(set(reads)) != dataset_size or repeats >= len(per_rank) * batch:
        return None
    return repeats


def plan_coverage(per_rank: Sequence[Mapping[int, Sequence[int]]], plan: Mapping[tuple[int, int], Sequence[int]]) -> float:
    """Fraction of the planned (epoch, sample) pairs, up to how far each rank got, that some rank consumed.

    >>> plan_coverage([{0: [1, 1]}, {0: [1, 1]}], {(0, 0): [1, 2], (1, 0): [3, 4]})
    0.25
    """
    planned: set[tuple[int, int]] = set()
    seen: set[tuple[int, int]] = set()
    for r, rank in enumerate(per_rank):
        for epoch, ids in rank.items():
            planned.update((epoch, i) for i in plan.get((r, epoch), ())[: len(ids)])
            seen.update((epoch, i) for i in ids)
    return len(planned & seen) / len(planned) if planned else 1.0


def data_shard_audit(
    consumed: Sequence[Sequence[tuple[int, Sequence[int]]]],
    plan: Optional[Mapping[tuple[int, int], Sequence[int]]],
    dataset_size: Optional[int] = None,
    groups: SampleGroups = READ_ONCE,
) -> AuditOutcome:
    """Did the ranks read disjoint shards in the planned order, epoch after epoch?

    Args:
        consumed: Per rank, the micro-batches it trained on, in order, as ``(epoch, sample_ids)``.
        plan: ``(rank, epoch) -> sample ids`` of the shared-seed DistributedSampler with ``set_epoch``;
            None when the data was sharded by something else (accelerate's batch shards), so only
            identical and overlapping shards can be judged, not the order.
        dataset_size: How many samples the indices name, where known: an epoch that read them all may repeat a few
            where the sampler padded its end (:func:`shard_overlap`).
        groups: How the sampler reads each sample by design (:class:`SampleGroups`); judged without a plan only.
    """
    per_rank = [flatten_epochs(batches) for batches in consumed]
    world = len(per_rank)
    totals = [sum(len(ids) for ids in rank.values()) for rank in per_rank]
    batch = max((len(ids) for batches in consumed for _, ids in batches), default=1)
    epochs_read = {e for rank in per_rank for e in rank}
    padded = {e: n for e in epochs_read if (n := padded_repeats(per_rank, e, dataset_size, batch)) is not None}
    shared = shard_overlap(per_rank, padded, groups if plan is None else READ_ONCE)
    # Said where it happened: "disjoint" with a sample read twice would read as a contradiction.
    read_twice = sum(padded.values())
    padding = f"; {read_twice} read twice where the sampler padded an epoch's end" if read_twice else ""
    if plan is None:
        return _without_plan(per_rank, totals, shared, padding, groups)
    coverage = plan_coverage(per_rank, plan)
    departures = {r: dep for r in range(world) if (dep := _rank_departure(per_rank[r], r, plan)) is not None}
    repeats = {r: eps for r in range(world) if (eps := _epochs_repeating_epoch0(per_rank[r], r, plan))}
    epochs = sorted({e for rank in per_rank for e in rank})
    details = {
        "samples_per_rank": totals,
        "shared_per_rank": shared,
        "coverage": round(coverage, 6),
        "epochs": len(epochs),
        "departures": {str(r): list(d) for r, d in departures.items()},
    }
    everyone = list(range(world))
    worst = max(everyone, key=lambda r: (shared[r], -r))
    overlap_text = f"{ranks_phrase([worst])} shares {shared[worst]} of its {totals[worst]} samples with other ranks; expected 0"
    if world > 1 and all(per_rank[r] == per_rank[0] for r in everyone):
        return AuditOutcome(
            False,
            f"every rank read the same samples: {ranks_phrase(everyone)} consumed identical "
            f"sequences ({overlap_text}; the effective batch collapsed to one rank's)",
            "identical",
            tuple(everyone),
            details,
        )
    if repeats:
        repeated = sorted({e for eps in repeats.values() for e in eps})
        label = f"epoch {repeated[0]}" if len(repeated) == 1 else f"epochs {rank_span(repeated)}"
        verb = "repeats" if len(repeated) == 1 else "repeat"
        return AuditOutcome(
            False,
            f"missing set_epoch: {label} {verb} epoch 0's order on {ranks_phrase(repeats)} "
            f"(the sampler was never told the epoch); coverage of the planned order "
            f"{coverage:.0%}",
            f"repeats-epoch-0 {rank_span(repeats)}",
            tuple(sorted(repeats)),
            details,
        )
    if departures:
        first = min(departures)
        epoch, index = departures[first]
        where = "from its first sample" if (epoch, index) == (0, 0) else f"at epoch {epoch}, sample {index}"
        who = ranks_phrase(departures)
        verb = "departs" if len(departures) == 1 else "depart"
        message = (
            f"{who} sampler order {verb} from the plan (the shared-seed DistributedSampler order) "
            f"{where}: a rank-specific sampler seed or shard; {overlap_text}; coverage of the planned order "
            f"{coverage:.0%}"
        )
        if len(departures) == 1:
            message = message.replace(f"{who} sampler", f"{who}'s sampler", 1)
        if borrowed := {r: q for r in departures if (q := _planned_for_another(per_rank[r], r, plan, world)) is not None}:
            # The shard another rank's plan holds: a sampler given the wrong rank, LOCAL_RANK on a second node the
            # classic one. Said before the rest, which reads as a seed.
            read = "; ".join(f"rank {r} read the shard planned for rank {q}" for r, q in sorted(borrowed.items()))
            message = f"{read} (a sampler given another rank: LOCAL_RANK where RANK is meant, on a node after the first?); {message}"
        return AuditOutcome(False, message, f"departs {rank_span(departures)}", tuple(sorted(departures)), details)
    if any(shared):
        overlapping = [r for r in everyone if shared[r]]
        return AuditOutcome(
            False,
            # Every rank that shares is named: an overlap cannot tell the rank whose order moved from the ones it hit.
            f"{ranks_phrase(overlapping)} read overlapping samples: {overlap_text}; coverage of the planned order {coverage:.0%}",
            f"overlap {rank_span(overlapping)}",
            tuple(overlapping),
            details,
        )
    if coverage < 1:
        return AuditOutcome(
            False, f"the ranks covered {coverage:.1%} of the planned samples; expected 100%", "partial-coverage", (), details
        )
    return AuditOutcome(
        True,
        f"{ranks_phrase(everyone)} read disjoint shards in the planned order "
        f"({sum(totals)} samples over {len(epochs)} epoch{'s' if len(epochs) != 1 else ''}, "
        f"100% coverage{padding})",
        "disjoint",
        (),
        details,
    )


def batch_audit(per_rank: Sequence[Mapping[str, str]]) -> Optional[AuditOutcome]:
    """Do the ranks' DataLoaders make the same batch of the same samples? None where some rank could not tell
    (no facts), or when they agree. Each mapping is a rank's field -> ``dtype[shape] hash`` of the batch its
    ``collate_fn`` makes of the dataset's first, middle and last samples (``loaders.batch_facts``).

    >>> same = {"input_ids": "int64[3,9] 1a2b3c4d", "labels": "int64[3,9] 5e6f7a8b"}
    >>> short = {"input_ids": "int64[3,8] 0badc0de", "labels": "int64[3,8] 0ddba11a"}
    >>> outcome = batch_audit([same, same, short, same])
    >>> outcome.ranks, outcome.message.split(": ", 1)[1].split("; labels")[0]
    ((2,), 'input_ids differs: ranks 0-1, 3 int64[3,9] 1a2b3c4d; rank 2 int64[3,8] 0badc0de')
    >>> batch_audit([same, same, {}, short]) is None  # rank 2 could not make its batch twice alike
    True
    """
    if len(per_rank) < 2 or not all(per_rank):
        return None
    whole = group_ranks([tuple(sorted(facts.items())) for facts in per_rank])
    if len(whole) == 1:
        return None
    return AuditOutcome(
        False,
        "the ranks' DataLoaders make different batches of the same samples: " + differences_phrase(differing_fields(per_rank)),
        f"batches {partition_signature(whole)}",
        tuple(odd_ones_out(whole)),
    )


def _without_plan(
    per_rank: Sequence[Mapping[int, Sequence[int]]], totals: Sequence[int], shared: Sequence[int], padding: str = "",
    groups: SampleGroups = READ_ONCE,
) -> AuditOutcome:
    """Identical or overlapping shards, judged without a sampler plan to compare the order with.

    A sampler that reads each sample several times by design (``groups``) may deal one sample's reads to several
    ranks: ranks of TRL's GRPO read the same prompts where a group is larger than a rank's batch, and generate
    different completions of them. More reads than that are an overlap, and reads that are no whole group a split.

    >>> group = [[(0, [3, 3, 3, 3])], [(0, [3, 3, 3, 3])]]  # a group of 8 completions of prompt 3 on 2 ranks of 4
    >>> data_shard_audit(group, None, groups=SampleGroups(8)).message.split(" (")[0]
    'ranks 0-1 read each sample in whole groups of 8 reads, as their sampler deals them out'
    >>> data_shard_audit(group, None, groups=SampleGroups(4)).signature  # groups of 4: each rank should have its own
    'identical'
    >>> data_shard_audit([[(0, [3, 3, 3, 3])], [(0, [5, 5, 5, 5])]], None, groups=SampleGroups(8)).signature
    'split-groups 0-1'
    """
    world = len(per_rank)
    everyone = list(range(world))
    epochs = sorted({e for rank in per_rank for e in rank})
    details = {"samples_per_rank": list(totals), "shared_per_rank": list(shared), "epochs": len(epochs), "plan": None}
    if groups.reads > 1:
        details["sample_groups"] = list(groups)
    if world > 1 and all(per_rank[r] == per_rank[0] for r in everyone) and (groups.reads == 1 or any(shared)):
        return AuditOutcome(
            False,
            f"every rank read the same samples: {ranks_phrase(everyone)} consumed identical "
            "sequences (the effective batch collapsed to one rank's)",
            "identical",
            tuple(everyone),
            details,
        )
    if any(shared):
        overlapping = [r for r in everyone if shared[r]]
        worst = max(everyone, key=lambda r: (shared[r], -r))
        more = f" more often than the {groups.reads} reads its sampler makes of each" if groups.reads > 1 else ""
        return AuditOutcome(
            False,
            # Every rank that shares is named: an overlap cannot tell the rank whose order moved from the ones it hit.
            f"{ranks_phrase(overlapping)} read overlapping samples within an epoch: {ranks_phrase([worst])} shares "
            f"{shared[worst]} of its {totals[worst]} samples with other ranks{more}; expected 0",
            f"overlap {rank_span(overlapping)}",
            tuple(overlapping),
            details,
        )
    if any(split := split_groups(per_rank, groups)):
        splitting = [r for r in everyone if split[r]]
        worst = max(everyone, key=lambda r: (split[r], -r))
        return AuditOutcome(
            False,
            f"{ranks_phrase(splitting)} split their sampler's groups: {ranks_phrase([worst])} read {split[worst]} of its "
            f"samples a number of times over the ranks that is no whole group of {groups.size} (the sampler reads each "
            f"{groups.size} times in a row, one group of generations dealt out over the ranks): a rank's sampler out of "
            "step with the others' (its own seed or shuffle?)",
            f"split-groups {rank_span(splitting)}",
            tuple(splitting),
            details,
        )
    what = "disjoint shards"
    if groups.reads > 1:
        what = (f"each sample in whole groups of {groups.size} reads, as their sampler deals them out "
                f"(TRL's RepeatSampler: a group of generations per prompt, at most {groups.reads} reads an epoch)")
    return AuditOutcome(
        True,
        f"{ranks_phrase(everyone)} read {what} ({sum(totals)} samples over "
        f"{len(epochs)} epoch{'s' if len(epochs) != 1 else ''}{padding}); the order was not checked: no "
        "DistributedSampler to rebuild it from",
        "disjoint",
        (),
        details,
    )


def _rank_departure(epochs: Mapping[int, Sequence[int]], rank: int, plan) -> tuple[int, int] | None:
    for epoch in sorted(epochs):
        index = first_departure(epochs[epoch], plan.get((rank, epoch), ()))
        if index is not None:
            return epoch, index
    return None


def _planned_for_another(epochs: Mapping[int, Sequence[int]], rank: int, plan, world: int) -> Optional[int]:
    """The other rank whose planned shard ``rank`` read, every epoch, sample for sample; None if none.

    >>> _planned_for_another({0: [1, 2]}, 2, {(0, 0): [1, 2, 5], (1, 0): [3, 4, 6], (2, 0): [7, 8, 9]}, 3)
    0
    """
    return next((other for other in range(world) if other != rank and epochs and _rank_departure(epochs, other, plan) is None), None)


def _epochs_repeating_epoch0(epochs: Mapping[int, Sequence[int]], rank: int, plan) -> list[int]:
    """Epochs > 0 whose order is epoch 0's planned order where the plan differs (set_epoch never called)."""
    first = plan.get((rank, 0), ())
    out = []
    for epoch, ids in sorted(epochs.items()):
        planned = plan.get((rank, epoch), ())
        if epoch > 0 and ids and list(ids) == list(first[: len(ids)]) and list(planned[: len(ids)]) != list(ids):
            out.append(epoch)
    return out

"""The shard audit by content: did the ranks train on different samples, where no index names a sample?

An ``IterableDataset`` yields without indices, and a per-rank split of the data indexes each rank's own part; the
ranks then compare the hash of every sample they trained on (:mod:`healthcheck.integrations.script.sample_hashes`),
epoch by epoch, up to where both got.

* Ranks whose samples are the same, in the same order, read one shard: a stream no rank filtered by its rank, or a
  rank that took another's part. Every other rank's hashes differ, so this fails on nothing but the fault.
* A rank more than half of whose samples other ranks also read in the same epoch overlaps them, in any order (each
  rank shuffling the whole stream with its own seed). Disjoint shards share a sample only where the data repeats
  one: a real dataset repeats a few rows, not half of them, so a clean run does not reach it. Fewer shared samples
  pass, and are counted in the message: shards that overlap at their edges look like repeated rows from here, and
  only indices tell them apart.
* A rank whose batches repeat the one before, again and again (a third of them at least), reads an IterableDataset
  through several DataLoader workers that each yield all of it (torch's documented pitfall: the dataset must split
  its data by ``get_worker_info()``). Every rank does so alike, so no statistic shows it.

Neither order nor coverage is checked: without a sampler there is no plan to hold them to. Where fewer than half of
a rank's samples hash apart from each other (every sample truncated to a prompt template they share, one synthetic
batch repeated, a short stream that starts over within the epoch), content tells no shard from another: *not
measured*.

A script that reads no DataLoader at all (nanoGPT's ``get_batch``: random offsets from torch's generator) is judged
on the inputs of each step's first training forward, one "epoch" per step. Only the first rule applies there: with
replacement, ranks drawing from a small dataset share samples by chance, while ranks drawing the same batch at every
step share a generator (nanoGPT with its per-rank ``seed_offset`` left out).

    >>> a, b, c = [(0, [11, 12]), (0, [13, 14])], [(0, [21, 22]), (0, [23, 24])], [(0, [31, 32]), (0, [33, 34])]
    >>> content_shard_audit([a, b, c]).signature
    'disjoint'
    >>> outcome = content_shard_audit([a, b, a])
    >>> outcome.signature, outcome.ranks, outcome.message.split(":")[0]
    ('same-samples 0,2|1', (0, 2), 'ranks 0, 2 trained on the same samples in the same order')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from healthcheck.judge.audit_outcome import AuditOutcome, group_ranks, not_measured, partition_signature, ranks_phrase
from healthcheck.judge.shard_audit import flatten_epochs, shard_overlap
from healthcheck.ranks import rank_span

#: A rank fails as overlapping when more than this fraction of its samples were read by other ranks (see above).
OVERLAP_LIMIT = 0.5


def content_shard_audit(contents: Sequence[Sequence[tuple[int, Sequence[int]]]], by_forward: bool = False) -> AuditOutcome:
    """Judge the ranks' ``(epoch, sample hashes)`` batches; see the module's docstring. ``by_forward``: the hashes
    are of each step's first training forward's inputs, ``(step, hashes)``."""
    per_rank = [flatten_epochs(batches) for batches in contents]
    world = len(per_rank)
    totals = [sum(len(ids) for ids in rank.values()) for rank in per_rank]
    shared = shard_overlap(per_rank)
    epochs = len({e for rank in per_rank for e in rank})
    details = {"samples_per_rank": totals, "shared_per_rank": shared, "epochs": epochs, "plan": None,
               "by": "forward inputs" if by_forward else "content"}
    # A rank whose samples hash alike within its batches (each truncated to a prompt template they share, a synthetic
    # batch) or within its epochs (a short stream that starts over) leaves content nothing to tell shards apart by.
    in_batches = [sum(len(set(hashes)) for _, hashes in batches) for batches in contents]
    in_epochs = [sum(len(set(ids)) for ids in rank.values()) for rank in per_rank]
    repeats = [adjacent_repeats(batches) for batches in contents]
    doubled = [r for r in range(world) if not by_forward and repeats[r] >= 2 and 3 * repeats[r] >= len(contents[r]) - 1]
    alike = [r for r in range(world) if 2 * in_batches[r] < totals[r] or (2 * in_epochs[r] < totals[r] and r not in doubled)]
    if alike:
        worst = alike[0]
        return not_measured(
            f"the samples of {ranks_phrase(alike)} are not told apart by their tokens ({ranks_phrase([worst])}: "
            f"{in_epochs[worst]} distinct of {totals[worst]}: truncated to a prefix they share, or one batch repeated), "
            "so which rank read which samples cannot be judged by content"
        )
    if doubled:
        worst = max(doubled, key=lambda r: (repeats[r], -r))
        return AuditOutcome(
            False,
            f"{ranks_phrase(doubled)} trained on the same batch twice in a row, again and again ({ranks_phrase([worst])}: "
            f"{repeats[worst]} of its {len(contents[worst])} batches repeat the one before): an IterableDataset read by "
            "several DataLoader workers that does not split its data by get_worker_info(), so each worker yields all of it",
            f"repeated-batches {rank_span(doubled)}",
            tuple(doubled),
            details,
        )
    groups = group_ranks(per_rank, same=same_prefix)
    repeated = [g for g in groups if len(g) > 1]
    if world > 1 and len(groups) == 1:
        everyone = tuple(range(world))
        why = ("drew the same batch at every step (their generators are seeded alike" if by_forward
               else "read one stream, in the same order (no rank kept its own part of the data")
        return AuditOutcome(
            False,
            f"every rank trained on the same samples: {ranks_phrase(everyone)} {why}: the effective batch collapsed "
            "to one rank's)",
            "identical",
            everyone,
            details,
        )
    if repeated:
        named = tuple(sorted(r for g in repeated for r in g))
        pairs = "; ".join(f"{ranks_phrase(g)} trained on the same samples in the same order" for g in repeated)
        why = ("they drew the same batch at every step (one of them seeded its generator as the other did: a rank "
               "that computed its seed offset from the wrong rank)" if by_forward else "they read one part of the data "
               "and another part went unread (one of them took the other's part: a rank that computed its part from "
               "the wrong rank or world size)")
        return AuditOutcome(
            False,
            f"{pairs}: {why}",
            f"same-samples {partition_signature(groups)}",
            named,
            details,
        )
    if by_forward:
        return AuditOutcome(
            True,
            f"{ranks_phrase(range(world))} trained on different batches ({sum(totals)} samples over {epochs} "
            f"step{'s' if epochs != 1 else ''}, told apart by the inputs of each step's first training forward: the "
            "script reads no DataLoader, so neither overlap nor order was checked)",
            "distinct-batches",
            (),
            details,
        )
    over = [r for r in range(world) if totals[r] and shared[r] > OVERLAP_LIMIT * totals[r]]
    if over:
        worst = max(over, key=lambda r: (shared[r] / totals[r], -r))
        return AuditOutcome(
            False,
            f"{ranks_phrase(over)} overlap other ranks' data: {ranks_phrase([worst])} shares {shared[worst]} of its "
            f"{totals[worst]} samples with other ranks within an epoch (more than half: beyond what repeated rows explain)",
            f"overlap {rank_span(over)}",
            tuple(over),
            details,
        )
    common = f"; {sum(shared)} samples were read by more than one rank (rows the data repeats, or shards overlapping at their edges)"
    return AuditOutcome(
        True,
        f"{ranks_phrase(range(world))} trained on different samples ({sum(totals)} samples over {epochs} "
        f"epoch{'s' if epochs != 1 else ''}, told apart by content: no index names them, so neither order nor "
        f"coverage was checked){common if any(shared) else ''}",
        "disjoint",
        (),
        details,
    )


def adjacent_repeats(batches: Sequence[tuple[int, Sequence[int]]]) -> int:
    """How many batches are, sample for sample, the batch fetched just before them in the same epoch. A DataLoader
    delivers its workers' batches in turn, so ``k`` workers that each yield the whole stream repeat every batch
    ``k - 1`` times in a row; a healthy stream never does, and one that starts over repeats a batch only a pass later.

    >>> adjacent_repeats([(0, [1, 2]), (0, [1, 2]), (0, [3, 4]), (0, [3, 4]), (1, [3, 4])])
    2
    """
    pairs = zip(batches[:-1], batches[1:], strict=True)
    return sum(1 for before, batch in pairs if before[0] == batch[0] and list(before[1]) == list(batch[1]))


def same_prefix(mine: Mapping[int, Sequence[int]], theirs: Mapping[int, Sequence[int]]) -> bool:
    """Two ranks' samples per epoch agree: every epoch both read, up to the shorter (the ranks stop at the same step,
    not at the same fetch), with at least one sample compared.

    >>> same_prefix({0: [1, 2, 3]}, {0: [1, 2]}), same_prefix({0: [1, 2]}, {0: [1, 3]}), same_prefix({0: []}, {0: []})
    (True, False, False)
    """
    compared = 0
    for epoch in mine.keys() & theirs.keys():
        n = min(len(mine[epoch]), len(theirs[epoch]))
        if list(mine[epoch][:n]) != list(theirs[epoch][:n]):
            return False
        compared += n
    return compared > 0

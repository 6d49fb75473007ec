"""The shard audit by content (IterableDataset, per-rank splits): each fault it names, and what it lets pass."""

from __future__ import annotations

import random

from healthcheck.judge.content_shards import content_shard_audit


def _stream(rows, world, batch=4, steps=5, epochs=1):
    """Each rank's batches of a stream split into ``world`` parts, as (epoch, sample hashes)."""
    return [[(e, rows[r::world][s * batch: (s + 1) * batch]) for e in range(epochs) for s in range(steps)] for r in range(world)]


ROWS = random.Random(5).sample(range(1, 2**63), 400)


def test_disjoint_parts_pass_and_every_epoch_counts():
    outcome = content_shard_audit(_stream(ROWS, 8, epochs=2))
    assert outcome.passed and outcome.measured and outcome.signature == "disjoint"
    assert "320 samples over 2 epochs" in outcome.message and "read by more than one rank" not in outcome.message


def test_an_unsharded_stream_is_every_rank_reading_the_same_samples():
    outcome = content_shard_audit(_stream(ROWS, 1) * 4)
    assert not outcome.passed and outcome.signature == "identical" and outcome.ranks == (0, 1, 2, 3)


def test_a_rank_that_took_another_ranks_part_is_named_with_it():
    for faulty in (0, 5, 7):
        ranks = _stream(ROWS, 8)
        source = (faulty + 1) % 8
        ranks[faulty] = ranks[source]
        outcome = content_shard_audit(ranks)
        assert not outcome.passed and outcome.ranks == tuple(sorted((faulty, source))), faulty
        assert "trained on the same samples in the same order" in outcome.message


def test_the_same_part_read_up_to_another_fetch_is_still_the_same():
    ranks = _stream(ROWS, 4)
    ranks[2] = ranks[1] + [(0, [7, 8, 9, 10])]  # one more batch fetched before the probe ended
    assert content_shard_audit(ranks).ranks == (1, 2)


def test_each_rank_shuffling_the_whole_stream_overlaps_in_any_order():
    ranks = [[(0, random.Random(r).sample(ROWS[:40], 40))] for r in range(4)]
    outcome = content_shard_audit(ranks)
    assert not outcome.passed and outcome.signature == "overlap 0-3" and "shares 40 of its 40" in outcome.message


def test_repeated_rows_in_the_data_pass_and_are_counted():
    rows = ROWS[:200] + ROWS[:20]  # a tenth of the rows repeated, at random places
    random.Random(1).shuffle(rows)
    outcome = content_shard_audit(_stream(rows, 4, steps=10))
    assert outcome.passed and "samples were read by more than one rank" in outcome.message


def test_half_of_a_ranks_samples_shared_is_not_yet_an_overlap():
    ranks = [[(0, ROWS[0:8])], [(0, ROWS[4:12])], [(0, ROWS[20:28])]]  # rank 1 shares 4 of 8: exactly half
    assert content_shard_audit(ranks).passed
    ranks[1] = [(0, ROWS[3:11])]  # 5 of 8
    assert content_shard_audit(ranks).ranks == (0, 1)


def test_a_script_without_a_dataloader_is_judged_on_its_forwards_inputs_step_by_step():
    # nanoGPT's get_batch: random offsets with replacement. On a small dataset ranks share samples by chance, so
    # only ranks drawing the same batch at every step fail.
    small = ROWS[:12]
    draws = [[(step, random.Random(100 * r + step).choices(small, k=4)) for step in range(6)] for r in range(4)]
    outcome = content_shard_audit(draws, by_forward=True)
    assert outcome.passed and outcome.details["by"] == "forward inputs" and "over 6 steps" in outcome.message
    assert not content_shard_audit(draws).passed  # judged as a loader's epochs, the chance overlap would fail
    draws[3] = draws[0]  # rank 3 seeded its generator as rank 0 did
    outcome = content_shard_audit(draws, by_forward=True)
    assert outcome.ranks == (0, 3) and "drew the same batch at every step" in outcome.message
    assert content_shard_audit([draws[0]] * 4, by_forward=True).signature == "identical"


def test_samples_that_hash_alike_within_a_rank_are_not_judged():
    # Every sample truncated to the prompt template they share (or one synthetic batch): equal hashes everywhere
    # would read as every rank reading one stream.
    template = [(0, [ROWS[0]] * 4)] * 5
    outcome = content_shard_audit([template] * 4)
    assert outcome.passed and not outcome.measured and "the samples of ranks 0-3 are not told apart" in outcome.message


def test_a_stream_that_every_dataloader_worker_reads_whole_repeats_each_batch():
    # torch's documented pitfall: an IterableDataset under 2 workers that does not split by get_worker_info().
    ranks = _stream(ROWS, 4, steps=4)
    twice = [[batch for batch in batches for _ in range(2)] for batches in ranks]
    outcome = content_shard_audit(twice)
    assert not outcome.passed and outcome.signature == "repeated-batches 0-3", outcome.message
    assert "rank 0: 4 of its 8 batches repeat the one before" in outcome.message
    thrice = [[batch for batch in batches for _ in range(3)] for batches in ranks]  # 3 workers: a third distinct
    assert content_shard_audit(thrice).signature == "repeated-batches 0-3"
    # A short stream that starts over within an epoch repeats a batch a pass later, not in a row.
    cycling = [batches * 3 for batches in ranks]
    assert not content_shard_audit(cycling).measured
    # A forward's inputs come one batch a step: a batch trained on again is no worker pitfall there.
    assert content_shard_audit(twice, by_forward=True).signature != "repeated-batches 0-3"

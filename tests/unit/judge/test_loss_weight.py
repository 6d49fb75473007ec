"""The loss-weight audit on synthetic per-step weights: a constant per-rank scale fails, the data's doesn't."""

from __future__ import annotations

import random

import pytest

from healthcheck.judge.loss_weight import DECISIVE_STEPS, LossWeightWatch, loss_weight_audit


def _weights(world: int, steps: int, scaled: dict[int, float] | None = None, jitter: float = 1e-7, seed: int = 0):
    rng = random.Random(seed)
    scale = [1.0] * world
    for rank, factor in (scaled or {}).items():
        scale[rank] = factor
    # A GradScaler-like loss scale that moves from step to step, the same on every rank.
    return {s: [2.0 ** (s % 3) * scale[r] * (1 + rng.uniform(-jitter, jitter)) for r in range(world)] for s in range(steps)}


def test_equal_weights_pass_even_when_the_loss_scale_moves_between_steps():
    outcome = loss_weight_audit(_weights(8, 10))
    assert outcome.passed and outcome.measured and outcome.signature == "equal"
    assert "equal across ranks in 10 steps" in outcome.message


@pytest.mark.parametrize(("rank", "factor"), [(0, 1.5), (5, 0.5), (7, 1.01)])
def test_one_rank_scaled_on_its_own_is_named_with_its_factor(rank, factor):
    outcome = loss_weight_audit(_weights(8, 6, {rank: factor}, seed=rank))
    assert not outcome.passed and outcome.ranks == (rank,)
    assert f"rank {rank}'s loss enters its backward with {factor:.4g}x the weight of" in outcome.message


def test_two_ranks_that_disagree_are_both_named():
    outcome = loss_weight_audit(_weights(2, 4, {1: 2.0}))
    assert not outcome.passed and outcome.ranks == (0, 1)
    assert "different weights" in outcome.message


def _global_count(steps: int, scaled: dict[int, float], seed: int = 3):
    # w = c * N_rank / N_all: a token count over every rank, as TRL and the Trainer's num_items_in_batch use.
    rng = random.Random(seed)
    weights, tokens = {}, {}
    for s in range(steps):
        counts = [float(rng.randint(50, 90)) for _ in range(4)]
        tokens[s] = counts
        weights[s] = [4 * n / sum(counts) * scaled.get(r, 1.0) for r, n in enumerate(counts)]
    return weights, tokens


def test_a_count_over_every_rank_is_judged_per_token():
    weights, tokens = _global_count(10, {})
    outcome = loss_weight_audit(weights, tokens)
    assert outcome.passed and outcome.measured and "same weight per token" in outcome.message
    weights, tokens = _global_count(10, {1: 1.5})
    outcome = loss_weight_audit(weights, tokens)
    assert not outcome.passed and outcome.ranks == (1,)
    assert outcome.message.startswith("rank 1's loss enters its backward with 1.5x the weight per token of ranks 0, 2-3's")


def test_weights_that_follow_the_data_per_rank_and_per_token_are_not_judged():
    weights, tokens = _global_count(10, {})
    rng = random.Random(4)
    tokens = {s: [n * rng.uniform(0.8, 1.2) for n in row] for s, row in tokens.items()}  # another count than the script's
    outcome = loss_weight_audit(weights, tokens)
    assert outcome.passed and not outcome.measured and outcome.signature == "data-dependent"
    assert not loss_weight_audit(weights).measured  # no counts at all


def test_too_few_steps_with_every_rank_known_is_not_measured():
    weights = {0: [1.0, None, 1.0], 1: [1.0, 1.0, float("nan")], 2: [1.0, 1.0, 1.0]}
    outcome = loss_weight_audit(weights)
    assert outcome.passed and not outcome.measured and outcome.message.startswith("not measured: 1 step(s)")
    assert not loss_weight_audit({}).measured


@pytest.mark.parametrize("rank", [0, 2, 5])
def test_the_watch_stops_on_a_constant_scale_only_after_enough_judged_steps(rank):
    weights = _weights(6, 8, {rank: 0.5})
    watch = LossWeightWatch()
    decided = [watch.add(s, weights[s], None) for s in range(8)]
    assert decided[:DECISIVE_STEPS - 1] == [None] * (DECISIVE_STEPS - 1)
    outcome = decided[DECISIVE_STEPS - 1]
    assert outcome is not None and outcome.ranks == (rank,) and f"in each of {DECISIVE_STEPS} steps" in outcome.message
    # A step whose weights are not all known is not judged, so it does not count toward the decision.
    late = LossWeightWatch()
    assert late.add(0, [1.0, None, 2.0], None) is None
    assert [late.add(s, [1.0, 1.0, 2.0], None) is None for s in range(1, DECISIVE_STEPS + 1)] == [True] * (DECISIVE_STEPS - 1) + [False]


def test_the_watch_never_stops_clean_ranks_or_weights_that_follow_the_data():
    clean, watch = _weights(4, 12), LossWeightWatch()
    assert all(watch.add(s, clean[s], None) is None for s in range(12))
    weights, tokens = _global_count(12, {})
    rng = random.Random(4)
    tokens = {s: [n * rng.uniform(0.8, 1.2) for n in row] for s, row in tokens.items()}
    watch = LossWeightWatch()
    assert all(watch.add(s, weights[s], tokens[s]) is None for s in range(12))
    # A count over every rank, judged per token: a scaled rank stops the probe as a plain one does.
    weights, tokens = _global_count(12, {3: 2.0})
    watch = LossWeightWatch()
    decided = [watch.add(s, weights[s], tokens[s]) for s in range(12)]
    assert decided.index(next(d for d in decided if d is not None)) == DECISIVE_STEPS - 1
    assert decided[DECISIVE_STEPS - 1].ranks == (3,)


def test_a_rank_whose_loss_is_no_token_mean_is_named_against_ranks_that_agree_per_token():
    # TRL's SFTTrainer with loss_type="dft" on rank 1 alone (each token's loss times its probability), 4 ranks, read
    # off a real probe: TRL divides by a count over every rank, so ranks 0, 2-3 agree per token to float rounding and
    # rank 1 moves with its data. The audit said "not judged: the weights follow the data".
    weights = {0: [0.9981, 0.001976, 0.868904, 1.101963], 1: [0.930362, 0.001988, 1.103064, 1.002786],
               2: [0.928377, 0.002799, 0.866727, 0.93563], 3: [1.037879, 0.002629, 0.886364, 0.959596],
               4: [0.859279, 0.002122, 0.984364, 1.329708]}
    tokens = {0: [394, 407, 343, 435], 1: [334, 346, 396, 360], 2: [256, 350, 239, 258], 3: [411, 442, 351, 380],
              4: [316, 304, 362, 489]}
    outcome = loss_weight_audit(weights, tokens)
    assert not outcome.passed and outcome.ranks == (1,), outcome.message
    assert outcome.message.startswith("rank 1's loss enters its backward with another weight per token than ranks 0, 2-3's")
    # Every rank following its data (a per-sample mean everywhere) has no majority that agrees: still not judged.
    moving = {s: [w * (1 + 0.1 * ((s * 7 + r * 3) % 5)) for r, w in enumerate(row)] for s, row in weights.items()}
    assert not loss_weight_audit(moving, tokens).measured

"""The FSDP2 ``sharded_state`` audit and how parameter audits switch on sharded evidence."""

from __future__ import annotations

import pytest

from healthcheck.artifacts import ShardedEvidence
from healthcheck.judge.assemble import parameter_outcomes
from healthcheck.judge.sharded_audit import first_difference, sharded_state_audit

NAMES = ["wte.weight", "h.0.attn.weight", "lm_head.weight"]
OPT = {"param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], "weight_decay": 0.0}], "step": 1, "tensors_with_state": 3}


def _audit(world=4, plans=None, start=None, end=None, checks=None):
    plans = plans or ["plan-a"] * world
    start = start or [[11, 12, 13]] * world
    end = end or [[21, 22, 23]] * world
    checks = checks if checks is not None else [(0, [OPT] * world), (10, [dict(OPT, step=11)] * world)]
    return sharded_state_audit(plans, 3, start, end, checks, NAMES)


def test_agreement_passes_and_counts_the_checks():
    outcome = _audit()
    assert outcome.passed and outcome.ranks == ()
    assert "optimizer at 2 checks" in outcome.message and "(3 tensors)" in outcome.message


@pytest.mark.parametrize("odd", [1, 2, 5])
def test_a_rank_with_another_sharding_plan_is_named(odd):
    plans = ["plan-a"] * 6
    plans[odd] = "plan-b"
    outcome = _audit(world=6, plans=plans)
    assert not outcome.passed and outcome.ranks == (odd,)
    assert "sharding plan" in outcome.message


def test_differing_full_parameters_name_the_rank_and_the_first_tensor():
    end = [[21, 22, 23]] * 4
    end = [*end[:3], [21, 99, 98]]
    outcome = _audit(end=end)
    assert not outcome.passed and outcome.ranks == (3,)
    assert "after the last step" in outcome.message and "h.0.attn.weight" in outcome.message


def test_an_optimizer_that_stepped_a_different_number_of_times_is_named():
    facts = [OPT, OPT, dict(OPT, step=2), OPT]
    outcome = _audit(checks=[(0, facts)])
    assert not outcome.passed and outcome.ranks == (2,)
    assert outcome.message == "rank 2's optimizer differs at step 0: step 2 (ranks 0-1, 3: 1)"


def test_first_difference_walks_nested_lists_and_dicts():
    assert first_difference({"g": [{"lr": 1}, {"lr": 2}]}, {"g": [{"lr": 1}, {"lr": 3}]}) == ("g.1.lr", 2, 3)
    assert first_difference({"a": 1}, {"a": 1, "b": 2}) == ("b", None, 2)


def test_parameter_outcomes_replace_replica_equality_under_fsdp():
    evidence = ShardedEvidence(plans=["p"] * 2, plan_tensors=3, start_hashes=[[1, 2, 3]] * 2, end_hashes=[[4, 5, 6]] * 2,
                               optimizer_checks=[(0, [OPT, OPT])])
    outcomes = parameter_outcomes([], NAMES, [], evidence)
    assert set(outcomes) == {"param_equality", "sharded_state"}
    assert not outcomes["param_equality"].measured and "sharded" in outcomes["param_equality"].message
    assert outcomes["sharded_state"].passed
    assert set(parameter_outcomes([], NAMES, [], None)) == {"param_equality"}


def test_a_rank_that_built_other_weights_before_sharding_is_named_with_the_tensor():
    pre = [[7, 8, 9]] * 4
    pre = [pre[0], [7, 8, 1], pre[2], pre[3]]
    outcome = sharded_state_audit(["p"] * 4, 3, [[1, 2, 3]] * 4, [[4, 5, 6]] * 4, [], NAMES, pre, NAMES)
    assert not outcome.passed and outcome.ranks == (1,)
    assert "before fully_shard" in outcome.message and "lm_head.weight" in outcome.message
    assert sharded_state_audit(["p"] * 4, 3, [[1, 2, 3]] * 4, [[4, 5, 6]] * 4, [], NAMES, [[7, 8, 9]] * 4, NAMES).passed

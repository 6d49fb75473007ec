"""``benchmarks/replay_cost.py``: its arms differ by the replay audit alone, and every arm leads a round in turn."""

from __future__ import annotations

import doctest

from tests.benchmark_scripts import loaded_script


def test_the_arms_differ_by_the_replay_alone_and_each_round_turns_their_order():
    with loaded_script("replay_cost") as module:
        on, off = module.arm_sets("fsdp", True, ["train.steps=30"]), module.arm_sets("fsdp", False, ["train.steps=30"])
        assert set(on) < set(off) and set(off) - set(on) == {"metrics.replay_every=0"}
        arms = [(strategy, replay) for strategy in module.STRATEGIES for replay in (True, False)]
        orders = [module.rotation(arms, index) for index in range(len(arms))]
        assert all(sorted(order) == sorted(arms) for order in orders)
        assert [order[0] for order in orders] == arms  # each arm runs first in one round
        failures, tried = doctest.testmod(module)
    assert failures == 0 and tried >= 4

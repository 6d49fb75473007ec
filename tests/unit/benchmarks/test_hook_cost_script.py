"""``benchmarks/hook_cost.py``'s reading of its rounds, without a model: the arms' order alternates between rounds, and
each cost comes with a 90% interval from a bootstrap over whole rounds (the GPU target is judged on its upper end).

    python -m pytest tests/unit/benchmarks/test_hook_cost_script.py -q
"""

from __future__ import annotations

import argparse

from tests.benchmark_scripts import loaded_script


def test_the_arms_alternate_their_order_between_rounds():
    with loaded_script("hook_cost") as hook_cost:
        calls = []

        def run_arm(arm, base_state, args, device):
            calls.append(arm)
            return {"times": [0.1, 0.1], "peak_gib": 1.0, "resident_gib": 0.5, "in_step_gib": 0.5}

        hook_cost.run_arm = run_arm
        results = hook_cost.run_rounds(["plain", "sketch"], {}, argparse.Namespace(rounds=3), None)
    assert calls == ["plain", "sketch", "sketch", "plain", "plain", "sketch"]
    assert results["sketch"]["blocks"] == [[100.0, 100.0]] * 3 and results["sketch"]["step_ms"] == 100.0


def test_the_sketch_target_is_judged_on_the_intervals_upper_end():
    plain = {"blocks": [[100.0] * 4 for _ in range(6)]}
    with loaded_script("hook_cost") as hook_cost:
        # A cost of +0.5% in most rounds and +4% in two: the median says +0.5%, the interval does not rule out more.
        noisy = {"blocks": [[100.5] * 4, [104.0] * 4, [100.5] * 4, [100.5] * 4, [104.0] * 4, [100.5] * 4]}
        lines = hook_cost.cost_lines({"plain": plain, "sketch": noisy}, 6)
        assert lines[0].startswith("sketch: cost +0.50% (90% interval +0.50% to +4.00% over 6 rounds")
        assert lines[1] == "target sketch <= 1% of the plain step: not shown (the 90% interval ends at +4.00%)"
        steady = {"blocks": [[100.4] * 4, [100.6] * 4] * 3}
        assert hook_cost.cost_lines({"plain": plain, "sketch": steady}, 6)[1].startswith(
            "target sketch <= 1% of the plain step: met")
        # Two rounds give no interval and no verdict; without a plain arm there is nothing to compare.
        two = hook_cost.cost_lines({"plain": {"blocks": plain["blocks"][:2]}, "sketch": {"blocks": noisy["blocks"][:2]}}, 2)
        assert two == ["sketch: cost +2.25% (one or two rounds: no interval; per-round median +2.25%)"]
        assert hook_cost.cost_lines({"sketch": noisy}, 6) == []

"""The spikes audit on synthetic runs: a one-step spike is named with its rank and step, clean noise is not.

The clean series imitate the CPU probe's steps.jsonl: a loss falling from 5.5, a gradient norm near 2, a
cross-rank spread (on the log scale) of 0.045 and 0.15 that is three times wider in the first steps, and
Student-t noise with tails heavier than the clean probes show.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from healthcheck.judge.spikes import MIN_HISTORY, spike_audit, spike_bound, t3_two_sided_tail

STEPS, WORLD = 60, 8


def clean_run(rng: np.random.Generator, dof: float, steps: int = STEPS, world: int = WORLD) -> dict[int, dict[str, list]]:
    per_step = {}
    for step in range(steps):
        spread = 1.0 + 2.0 * math.exp(-step / 5)
        loss = np.exp(math.log(5.5) - 0.012 * step + 0.045 * spread * rng.standard_t(dof, world))
        grad_norm = np.exp(math.log(2.0) + 0.15 * spread * rng.standard_t(dof, world))
        per_step[step] = {"loss": loss.tolist(), "grad_norm": grad_norm.tolist()}
    return per_step


def test_t3_tail_matches_the_tables():
    # Two-sided critical values of Student's t with 3 degrees of freedom at 5%, 1% and 0.1%.
    for critical, tail in ((3.182446, 0.05), (5.840909, 0.01), (12.923979, 0.001)):
        assert t3_two_sided_tail(critical) == pytest.approx(tail, rel=1e-5)


@given(st.integers(1, 100_000), st.floats(1e-6, 0.5))
def test_the_bound_grows_with_the_tests_and_holds_the_tail(tests, max_p):
    bound = spike_bound(tests, max_p)
    assert spike_bound(tests * 2, max_p) > bound > spike_bound(tests, max_p * 2)
    assert t3_two_sided_tail(bound * 1.4826 * 0.764892) == pytest.approx(max_p / tests, rel=1e-6)


@pytest.mark.parametrize(("rank", "step"), [(1, MIN_HISTORY), (5, 25), (7, 59)])
def test_a_bitflip_spike_is_named_with_its_rank_step_and_size(rank, step):
    per_step = clean_run(np.random.default_rng(rank * 100 + step), dof=8)
    for metric in ("loss", "grad_norm"):  # what the bitflip fault does: x2^32 on both
        per_step[step][metric][rank] *= 2.0**32
    outcome = spike_audit(per_step, 0.01)
    assert not outcome.passed and outcome.ranks == (rank,) and outcome.signature == f"spike {rank}"
    size = r"\d\.\de\+(09|10) \(robust z \d+ vs the other ranks, \d+ vs its last 10 steps\)"
    assert re.match(f"rank {rank} at step {step}: loss {size}; grad norm {size} \\(bound: robust z ", outcome.message)
    assert {(s["rank"], s["step"], s["metric"]) for s in outcome.details["spikes"]} == {(rank, step, "loss"), (rank, step, "grad_norm")}
    # log(2^32) = 22.2 against cross-rank spreads of 0.045 (loss) and 0.15 (grad norm), 3x wider at step 3
    z = {s["metric"]: min(s["z_ranks"], s["z_history"]) for s in outcome.details["spikes"]}
    assert z["loss"] > 150 and z["grad_norm"] > outcome.details["bound_z"] > 50


def test_a_drop_is_a_spike_too_and_one_metric_is_enough():
    per_step = clean_run(np.random.default_rng(7), dof=8)
    per_step[30]["grad_norm"][4] /= 2.0**32
    outcome = spike_audit(per_step, 0.01)
    assert outcome.ranks == (4,) and re.match(r"rank 4 at step 30: grad norm \de-10 \(robust z -\d+ vs the other ranks", outcome.message)
    assert outcome.details["spikes"][0]["z_ranks"] < -100


def test_a_rank_that_is_off_every_step_is_not_a_spike():
    per_step = clean_run(np.random.default_rng(8), dof=8)
    for step in per_step:  # a loss scale of 8 on rank 3: far from the others, but not from its own past
        per_step[step]["loss"][3] *= 8
    outcome = spike_audit(per_step, 0.01)
    assert outcome.passed and outcome.signature == "none" and outcome.details["max_z_ranks"] > 30


def test_steps_before_the_history_are_not_tested():
    per_step = clean_run(np.random.default_rng(9), dof=8)
    per_step[MIN_HISTORY - 1]["loss"][2] *= 2.0**32
    outcome = spike_audit(per_step, 0.01)
    assert outcome.passed and outcome.details["tests"] == 2 * WORLD * (STEPS - MIN_HISTORY)


@pytest.mark.parametrize(("dof", "draws", "most"), [(4, 200, 0), (3, 200, 2)])
def test_clean_heavy_tailed_runs_stay_within_the_stated_false_alarm_rate(dof, draws, most):
    """Student t with 4 dof (infinite kurtosis; the clean probes show 3.5-4.6): measured 0 alarms in 400 runs.
    With 3 dof, the tail the bound is computed for: <= 1% by Bonferroni, measured 0.5% (2 in 400)."""
    rng = np.random.default_rng(dof)
    alarms = sum(not spike_audit(clean_run(rng, dof), 0.01).passed for _ in range(draws))
    assert alarms <= most


def test_ranks_equal_to_rounding_never_spike():
    values = [2.0 * (1 + 1e-7 * ((step * 3 + rank) % 4)) for step in range(20) for rank in range(4)]
    per_step = {step: {"loss": values[step * 4 : step * 4 + 4], "grad_norm": [1.0] * 4} for step in range(20)}
    per_step[12]["loss"][1] *= 1 + 5e-4  # 50x the rounding noise, still under the 0.1% scale floor
    assert spike_audit(per_step, 0.01).passed


def test_missing_and_non_finite_values_are_skipped():
    per_step = clean_run(np.random.default_rng(10), dof=8, steps=20)
    per_step[10]["loss"][2] = None
    per_step[11]["grad_norm"][2] = float("nan")  # the non-finite audit's case
    per_step[12]["grad_norm"][6] = float("inf")
    outcome = spike_audit(per_step, 0.01)
    assert outcome.passed and outcome.details["tests"] == 2 * WORLD * (20 - MIN_HISTORY) - 3


def test_too_few_steps_or_ranks_is_not_measured():
    short = clean_run(np.random.default_rng(11), dof=8, steps=MIN_HISTORY)
    two_ranks = clean_run(np.random.default_rng(12), dof=8, world=2)
    for per_step in (short, two_ranks, {}):
        outcome = spike_audit(per_step, 0.01)
        assert outcome.passed and not outcome.measured and outcome.message.startswith("not measured")

"""The stale-gradients audit on per-rank readings (1 carried, 0 cleared, None not read)."""

from healthcheck.judge.fail_fast import DECISIVE, StepAudits
from healthcheck.judge.learning_rate import learning_rate_audit
from healthcheck.judge.stale_gradients import stale_gradients_audit


def test_the_ranks_that_carry_are_named_also_when_they_are_the_majority():
    # zero_grad indented into rank 0's logging branch: every other rank carries.
    readings = {0: [0.0] * 4, **{s: [0.0, 1.0, 1.0, 1.0] for s in range(1, 8)}}
    outcome = stale_gradients_audit(readings)
    assert not outcome.passed and outcome.ranks == (1, 2, 3)
    assert outcome.message.startswith("ranks 1-3 started the backward of step 1 with the previous step's gradients")
    assert "rank 0 with cleared ones; in 7 of 8 steps" in outcome.message
    assert outcome.signature == "0|1-3" and outcome.details["steps_differing"] == list(range(1, 8))


def test_a_rank_that_carries_in_some_steps_only_is_named():
    readings = {s: [0.0, 0.0, 1.0 if s % 3 == 2 else 0.0] for s in range(9)}
    outcome = stale_gradients_audit(readings)
    assert not outcome.passed and outcome.ranks == (2,) and "step 2" in outcome.message and "3 of 9" in outcome.message


def test_steps_a_rank_was_not_read_in_are_left_out_and_none_read_is_not_measured():
    assert stale_gradients_audit({0: [0.0, None], 1: [0.0, 0.0]}).details["steps_judged"] == 1
    outcome = stale_gradients_audit({0: [None, 0.0], 1: [0.0, None]})
    assert outcome.passed and not outcome.measured and "backward reached" in outcome.message


def test_a_probe_stopped_before_any_reading_gives_no_reason_of_the_scripts():
    # Fail fast at step 0: no reading arrived, which says nothing of the script's backward or its optimizer.
    for outcome in (stale_gradients_audit({}), learning_rate_audit({})):
        assert not outcome.measured and outcome.message == "not measured: no step was measured"
    assert "param_groups' lr" in learning_rate_audit({0: [None, None]}).message


def test_fail_fast_stops_at_the_first_step_the_ranks_differ():
    assert "stale_gradients" in DECISIVE
    audits = StepAudits()
    assert audits.add(0, {"grads_carried": [0.0, 0.0, 0.0]}, None) == {}
    assert audits.add(1, {"grads_carried": [0.0, 1.0, 0.0]}, None)["stale_gradients"].ranks == (1,)

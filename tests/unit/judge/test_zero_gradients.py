"""The zero-gradients audit on hand-made norms (healthcheck/judge/zero_gradients.py)."""

from __future__ import annotations

import pytest

from healthcheck.judge.zero_gradients import MIN_STEPS_FOR_A_RANK, zero_gradients_audit

pytestmark = pytest.mark.unit


def test_a_rank_at_zero_in_some_steps_only_passes():
    # A fully masked batch now and then (a loss divided by a count over every rank) is not a fault.
    norms = {s: [0.4, 0.0 if s % 2 else 0.3, 0.5] for s in range(8)}
    outcome = zero_gradients_audit(norms)
    assert outcome.passed and outcome.measured and outcome.ranks == ()


def test_a_rank_at_zero_is_named_only_after_enough_steps():
    short = {s: [0.4, 0.0, 0.5] for s in range(MIN_STEPS_FOR_A_RANK - 1)}
    assert zero_gradients_audit(short).passed
    long = {s: [0.4, 0.0, 0.5] for s in range(MIN_STEPS_FOR_A_RANK)}
    outcome = zero_gradients_audit(long)
    assert not outcome.passed and outcome.ranks == (1,) and outcome.signature == "zero 1"


def test_several_zero_ranks_are_named_together():
    outcome = zero_gradients_audit({s: [0.0, 0.2, 0.0, 0.3] for s in range(5)})
    assert outcome.ranks == (0, 2)
    assert outcome.message.startswith("the local gradients were exactly zero on ranks 0, 2 in every one of 5 sampled steps, "
                                      "and not on ranks 1, 3: their loss"), outcome.message


def test_steps_a_rank_did_not_measure_do_not_count_for_or_against_it():
    norms = {0: [0.0, 0.0], 1: [0.0, None], 2: [None, 0.0]}
    outcome = zero_gradients_audit(norms)
    assert not outcome.passed and outcome.ranks == (0, 1) and outcome.signature == "zero all"
    # One nonzero step on any rank: something trained, and no rank stayed at zero long enough to be named.
    norms[2] = [None, 1e-12]
    assert zero_gradients_audit(norms).passed


def test_nothing_measured_is_not_measured():
    outcome = zero_gradients_audit({0: [None, None]})
    assert outcome.passed and not outcome.measured
    assert not zero_gradients_audit({}).measured

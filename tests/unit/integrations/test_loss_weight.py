"""The loss's weight in a rank's own backward, read by the loss capture from every source it knows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from healthcheck import record_loss
from healthcheck.integrations.loss_capture import LossCapture, StepLoss
from tests.unit.integrations.test_loss_capture import Tiny, batch


def _take(model: Tiny, batches, backward, **forward) -> StepLoss:
    """One step through ``model``; ``backward(outputs, labels)`` returns the root the script backpropagates."""
    with LossCapture() as capture:
        capture.watch(model)
        for x, labels in batches:
            out = model(x, labels=labels, **forward)
            backward(out, labels).backward()
        return capture.take()


def _step(model: Tiny, batches, backward, **forward) -> float:
    return _take(model, batches, backward, **forward).weight


def _mean_ce(out, labels):
    return F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1))


@pytest.mark.parametrize("scale", [1.0, 1.5, 0.25])
@pytest.mark.parametrize("masked", [0, 2])
def test_a_mean_cross_entropy_scaled_by_c_weighs_c(scale, masked):
    got = _step(Tiny(), [batch(0, masked)], lambda out, labels: scale * _mean_ce(out, labels))
    assert got == pytest.approx(scale, rel=1e-6)


def test_accumulation_divides_each_micro_batch_and_the_step_sums_to_one():
    # Micro-batches of different token counts: the weight is exact for each, not a token-weighted average.
    got = _step(Tiny(), [batch(1, 0), batch(2, 3), batch(3, 1)], lambda out, labels: _mean_ce(out, labels) / 3)
    assert got == pytest.approx(1.0, rel=1e-6)


def test_sum_and_per_token_reductions_normalised_by_the_local_count_weigh_one():
    def summed(out, labels):
        return F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1), reduction="sum") / (labels != -100).sum()

    def per_token(out, labels):
        return F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1), reduction="none").sum() / (labels != -100).sum() * 2

    assert _step(Tiny(), [batch(4, 2)], summed) == pytest.approx(1.0, rel=1e-6)
    assert _step(Tiny(), [batch(4, 2)], per_token) == pytest.approx(2.0, rel=1e-6)


def test_a_count_over_every_rank_gives_a_weight_that_follows_the_data():
    # The Trainer's num_items_in_batch: S / N_all, with N_all = 40 over "every rank"; this rank has N tokens.
    x, labels = batch(5, 2)
    n = int((labels[:, 1:] != -100).sum())
    got = _step(Tiny("hf"), [(x, labels)], lambda out, _: out["loss"], num_items_in_batch=torch.tensor(40))
    assert got == pytest.approx(n / 40, rel=1e-6)


def test_trl_log_probs_and_record_loss_weigh_what_the_script_backpropagates():
    def trl(out, labels):
        mask = out.label_mask
        return 1.5 * -(out.log_probs * mask).sum() / mask.sum()

    assert _step(Tiny("fused"), [batch(6, 2)], trl) == pytest.approx(1.5, rel=1e-6)

    def custom(out, labels):
        loss = (out.float() ** 2).mean()
        record_loss(loss, tokens=7)
        return 3 * loss

    assert _step(Tiny(), [batch(7)], custom) == pytest.approx(3.0, rel=1e-6)


def test_a_loss_that_never_reaches_a_backward_has_no_weight():
    def something_else(out, labels):
        _mean_ce(out, labels)  # computed, then the script backpropagates something else
        return out.pow(2).mean()

    got = _take(Tiny(), [batch(8)], something_else)
    assert got.loss is not None and math.isnan(got.weight)


def test_a_loss_recomputed_for_logging_does_not_hide_the_one_that_trains():
    def logged_then_trained(out, labels):
        with torch.no_grad():
            _mean_ce(out, labels)  # logging: no graph, never captured
        _mean_ce(out.detach(), labels)  # the same value again, outside the backward
        return 2 * _mean_ce(out, labels)

    assert _step(Tiny(), [batch(9)], logged_then_trained) == pytest.approx(2.0, rel=1e-6)

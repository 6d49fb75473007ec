"""param_equality points at the environment's settings that act after the all-reduce, and at nothing else."""

from __future__ import annotations

from healthcheck.judge.audit_outcome import AuditOutcome
from healthcheck.judge.param_causes import explained_by_settings

PARAMS = AuditOutcome(False, "ranks 1-2's parameters differ", "x", (1, 2))


def _environment(ranks, *differing):
    return AuditOutcome(False, "...", "y", ranks, {"differing": list(differing)})


def test_settings_before_the_reduction_or_other_ranks_explain_nothing():
    # A dropout rate changes a rank's gradient, which DDP averages away: the parameters cannot part by it.
    assert explained_by_settings(PARAMS, _environment((1, 2), "model.dropout", "loss.graph")) is PARAMS
    assert explained_by_settings(PARAMS, _environment((1,), "optimizer.lr")) is PARAMS  # rank 2 unexplained
    assert explained_by_settings(PARAMS, None) is PARAMS
    assert explained_by_settings(PARAMS, AuditOutcome(True, "agree", "uniform", ())) is PARAMS


def test_the_settings_after_it_are_named_for_the_ranks_they_cover():
    keys = ["clip", "model.parameters", "optimizer.lr", "optimizer.state", "trainer.max_grad_norm", "model.dropout"]
    message = explained_by_settings(PARAMS, _environment((0, 1, 2), *keys)).message
    assert message == ("ranks 1-2's parameters differ; ranks 1-2 also differ in clip, model.parameters, optimizer.lr, "
                       "optimizer.state and 1 more (audit.environment), which explains it")

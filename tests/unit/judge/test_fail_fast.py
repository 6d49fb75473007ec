"""Fail fast: which outcomes stop a probe, what a stopped probe's verdict says, and the CLI's policy."""

from __future__ import annotations

import argparse
import json

from healthcheck.artifacts import EarlyStop, FailFastPolicy
from healthcheck.judge.audit_outcome import AuditOutcome, not_measured
from healthcheck.judge.fail_fast import DECISIVE, FailFast
from healthcheck.judge.verdict import judge, judge_audits_only
from tests.synthetic_runs import fitted, make_result
from tests.unit.judge.test_verdict import typical

FAILED_SEEDS = AuditOutcome(False, "rank 5 has seed 7", "seed 0-4,6-7|5", (5,))


def test_the_first_decisive_failure_stops_and_is_kept():
    gate = FailFast(FailFastPolicy())
    assert not gate.judge(0, {"seeds": AuditOutcome(True, "shared", "shared")})
    assert gate.judge(3, {"seeds": FAILED_SEEDS})
    assert gate.judge(5, {"param_equality": AuditOutcome(False, "rank 1 differs", "0,2-7|1", (1,))})
    assert gate.stop == EarlyStop(step=3, check="seeds", message="rank 5 has seed 7", ranks=[5])


def test_statistical_and_unmeasured_outcomes_never_stop():
    gate = FailFast(FailFastPolicy())
    assert "stragglers" not in DECISIVE and "rank_outliers" not in DECISIVE
    assert not gate.judge(4, {"stragglers": AuditOutcome(False, "rank 3 is slow", "3", (3,)),
                              "rank_outliers": AuditOutcome(False, "rank 2 stands out", "2", (2,)),
                              "data_shards": not_measured("no DataLoader")})
    assert gate.stop is None


def test_an_approved_signature_does_not_stop_but_another_one_does():
    gate = FailFast(FailFastPolicy(approved={"seeds": "seed 0-4,6-7|5"}))
    assert not gate.judge(0, {"seeds": FAILED_SEEDS})
    assert gate.judge(0, {"seeds": AuditOutcome(False, "rank 6 has seed 8", "seed 0-5,7|6", (6,))})


def test_disabled_fail_fast_still_stops_on_a_non_finite_value():
    gate = FailFast(FailFastPolicy(enabled=False))
    assert not gate.judge(0, {"seeds": FAILED_SEEDS})
    assert not gate.nonfinite(2, [])
    assert gate.nonfinite(2, [1, 3])
    assert gate.stop.check == "nonfinite" and gate.stop.message == "non-finite loss or gradient on ranks 1, 3 at step 2"
    assert gate.stop.unavoidable
    assert FailFast().policy.enabled is False  # no policy: the Python API runs every step


def test_a_failure_the_ranks_cannot_train_past_stops_them_without_fail_fast_and_despite_approval():
    outcome = AuditOutcome(False, "fsdp.param_dtype differs: ranks 0-1 bf16; rank 2 fp32", "env 0-1|2", (2,))
    for policy in (FailFastPolicy(enabled=False), FailFastPolicy(approved={"environment": "env 0-1|2"})):
        gate = FailFast(policy)
        assert not gate.judge(0, {"environment": outcome})
        gate.cannot_continue(0, "environment", outcome.message)
        assert gate.stop.headline() == "stopped early at step 0: environment"
        assert gate.stop.message == outcome.message and gate.stop.unavoidable


SHARDS_FAILED = {"data_shards": {"passed": False, "message": "ranks 0-7 read the same samples", "ranks": [0, 1],
                                 "signature": "identical"}}


def _stopped(audits=SHARDS_FAILED):
    result = make_result(typical(), audits=audits)
    result.stopped_early = EarlyStop(step=0, check="data_shards", message="ranks 0-7 read the same samples")
    result.steps_completed = 0
    return result


def test_a_stopped_probe_is_judged_on_its_audits_only():
    verdict = judge(_stopped(), fitted())
    assert verdict.status == "fail" and verdict.exit_code == 1
    assert [f.check for f in verdict.findings] == ["audit.data_shards"]  # no envelope on a truncated window
    assert verdict.stopped_early == "stopped early at step 0: data_shards"
    assert any("not judged on a truncated window" in note and "0 of 60 steps ran" in note and
               note.endswith("rerun with --no-fail-fast to see them") for note in verdict.notes)


def test_a_stop_the_ranks_cannot_train_past_does_not_suggest_running_on():
    result = _stopped()
    result.stopped_early = result.stopped_early.model_copy(update={"unavoidable": True})
    notes = judge_audits_only(result).notes
    assert any(note.endswith("the ranks cannot train past it, with --no-fail-fast either") for note in notes), notes


def test_a_stopped_probe_never_passes_even_if_its_audits_do():
    passing = {"data_shards": {"passed": True, "message": "disjoint", "signature": "disjoint"}}
    for verdict in (judge(_stopped(passing), fitted()), judge_audits_only(_stopped(passing))):
        assert verdict.status == "fail"
        assert [f.check for f in verdict.failures] == ["fail_fast"]


def test_the_headline_names_the_stop():
    from healthcheck.outputs.text import verdict_headline

    label, sentence, _ = verdict_headline(judge_audits_only(_stopped()), "complete")
    assert label == "FAIL" and sentence.endswith("(stopped early at step 0: data_shards)")


def _args(**flags):
    defaults = {"no_fail_fast": False, "no_judge": False, "audits_only": False}
    return argparse.Namespace(**{**defaults, **flags})


def test_cli_policy_spares_what_the_baseline_approves(tmp_path):
    from healthcheck.cli import _fail_fast_policy
    from healthcheck.judge.baseline import save_baseline

    baseline = fitted().model_copy(update={"audits": {"seeds": "seed 0-4,6-7|5"}})
    path = tmp_path / "b.json"
    save_baseline(baseline, path)
    assert _fail_fast_policy(_args(), path) == FailFastPolicy(approved={"seeds": "seed 0-4,6-7|5"})
    # --audits-only judges against the ideal, so nothing is approved; no baseline approves nothing.
    assert _fail_fast_policy(_args(audits_only=True), path) == FailFastPolicy()
    assert _fail_fast_policy(_args(), tmp_path / "missing.json") == FailFastPolicy()
    (tmp_path / "bad.json").write_text(json.dumps({"schema_version": -1}))
    assert _fail_fast_policy(_args(), tmp_path / "bad.json") == FailFastPolicy()
    assert not _fail_fast_policy(_args(no_fail_fast=True), path).enabled
    assert not _fail_fast_policy(_args(no_judge=True), path).enabled

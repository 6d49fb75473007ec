"""Envelope and audit checks, config diffs and the verdict, on synthetic results (pure, no processes)."""

from __future__ import annotations

import random

import pytest

from healthcheck.artifacts import RankSummary, Standout
from healthcheck.config import ProbeConfig
from healthcheck.errors import BaselineError, ExitCode, InvalidInput, ProbeFailed
from healthcheck.judge.baseline import Baseline, fit_baseline
from healthcheck.judge.envelope import Envelope
from healthcheck.judge.verdict import (
    EnvelopeCheck,
    config_diff,
    envelope_margin,
    judge,
    load_verdict,
    write_verdict,
)

# ----------------------------------------------------------------------------- synthetic runs
from tests.synthetic_runs import CLEAN, COLLAPSED, draw, make_result  # noqa: E402


@pytest.fixture(scope="module")
def baseline() -> Baseline:
    rng = random.Random(0)
    return fit_baseline([make_result(draw(rng), seed=42 + i) for i in range(5)], reason="initial", approved_by="alice")


def typical() -> dict[str, float]:
    return {m: c for m, (c, _, _) in CLEAN.items()}


def by_check(verdict) -> dict:
    return {f.check: f for f in verdict.findings}


# ----------------------------------------------------------------------------- envelopes


def test_fresh_clean_runs_almost_never_fail(baseline):
    rng = random.Random(12345)
    failed = [judge(make_result(draw(rng)), baseline).status == "fail" for _ in range(200)]
    assert sum(failed) <= 2  # the stated target is <= 1% for the whole verdict


def test_typical_run_passes_every_envelope(baseline):
    verdict = judge(make_result(typical()), baseline)
    assert verdict.status == "pass" and verdict.exit_code == ExitCode.PASS
    assert len(verdict.findings) == len(baseline.envelopes)
    assert all(f.margin > 0 and "inside" in f.message for f in verdict.findings)


def test_collapsed_run_fails_cosine_above_and_dispersion_below(baseline):
    verdict = judge(make_result(COLLAPSED), baseline)
    assert verdict.status == "fail" and verdict.exit_code == ExitCode.INCONSISTENT
    findings = by_check(verdict)
    for metric in ("cosine_mean", "cosine_to_mean_min"):
        assert not findings[f"envelope.{metric}"].passed
        assert f"{metric} median 1 is above the envelope" in findings[f"envelope.{metric}"].message
    for metric in ("loss_std", "loss_range", "grad_norm_std", "grad_norm_cv", "gradient_diversity"):
        assert not findings[f"envelope.{metric}"].passed
        assert " is below the envelope " in findings[f"envelope.{metric}"].message
    assert all(f.margin < 0 for f in verdict.failures)


def test_tripled_grad_norm_cv_fails_alone(baseline):
    values = typical()
    values["grad_norm_cv"] *= 3
    verdict = judge(make_result(values), baseline)
    assert [f.check for f in verdict.failures] == ["envelope.grad_norm_cv"]
    assert "above the envelope" in verdict.failures[0].message


def test_failure_message_gives_distance_and_half_widths():
    envelope = Envelope(statistic="median", center=0.32, lower=0.21, upper=0.43)
    finding = EnvelopeCheck("cosine_mean", envelope).evaluate(make_result({"cosine_mean": 0.998}))
    assert finding.message == "cosine_mean median 0.998 is above the envelope [0.21, 0.43] by 0.568 (5.2 half-widths)"
    assert (finding.observed, finding.lower, finding.upper, finding.statistic) == (0.998, 0.21, 0.43, "median")
    assert finding.margin == pytest.approx(-0.568 / 0.11)


def test_margin_uses_each_sides_half_width():
    envelope = Envelope(statistic="median", scale="log", center=1.0, lower=0.5, upper=2.0)
    assert envelope_margin(1.5, envelope) == pytest.approx(0.5)
    assert envelope_margin(0.75, envelope) == pytest.approx(0.5)
    assert envelope_margin(0.0, envelope) == pytest.approx(-1.0)
    assert envelope_margin(1.0, Envelope(statistic="median", center=1.0, lower=1.0, upper=1.0)) is None


@pytest.mark.parametrize("value, words", [(None, "missing from the result"), (float("nan"), "not finite")])
def test_missing_or_nonfinite_observation_fails(baseline, value, words):
    values = typical()
    values["cosine_mean"] = value
    finding = by_check(judge(make_result(values), baseline))["envelope.cosine_mean"]
    assert not finding.passed and words in finding.message and finding.observed is None


def test_metric_absent_from_summary_fails(baseline):
    values = typical()
    del values["loss_std"]
    assert not by_check(judge(make_result(values), baseline))["envelope.loss_std"].passed


def test_failure_is_attributed_to_an_outlying_rank(baseline):
    values = typical()
    values["cosine_to_mean_min"] = 0.1
    standouts = [
        Standout(rank=3, metric="cosine_to_mean", z=-4.2, same_side_steps=48, window_steps=50),
        Standout(rank=6, metric="loss", z=5.0, same_side_steps=50, window_steps=50),
    ]
    # A large z that the persistence rule did not confirm is not a standout, so it is not named.
    per_rank = [RankSummary(rank=r, z_cosine_to_mean=-6.0 if r == 5 else 0.5) for r in range(8)]
    verdict = judge(make_result(values, per_rank=per_rank).model_copy(update={"standouts": standouts}), baseline)
    finding = by_check(verdict)["envelope.cosine_to_mean_min"]
    assert finding.ranks == [3]  # rank 6 is off in loss, not in cosine; rank 5 is not persistent
    assert "rank 3 (cosine_to_mean z=-4.2 (lower in 48/50 steps)) stands out" in finding.message
    assert all(f.ranks == [] for f in verdict.findings if f.passed)


# ----------------------------------------------------------------------------- judge


def test_world_size_mismatch_refuses_unless_forced(baseline):
    result = make_result(typical(), world_size=4)
    with pytest.raises(BaselineError) as excinfo:
        judge(result, baseline, baseline_path="baselines/default.json")
    message = excinfo.value.message
    assert message.startswith("baselines/default.json: ") and "world_size 8" in message and "world_size 4" in message
    assert "--force" in message and "\n" not in message
    verdict = judge(result, baseline, force=True)
    assert verdict.forced and verdict.status == "pass"
    assert any("forced comparison" in note and "world_size 4" in note for note in verdict.notes)
    assert not judge(make_result(typical()), baseline).forced


def test_a_baseline_of_another_training_program_refuses_unless_forced(baseline):
    # The built-in probe's baseline (baselines/default.json) met a script probe of the same layout: every envelope
    # judged another program's statistics, and a clean script failed 8 of 20 checks.
    script = make_result(typical(), config=ProbeConfig(script={"path": "jobs/train.py"}))
    with pytest.raises(BaselineError) as excinfo:
        judge(script, baseline, baseline_path="baselines/default.json")
    message = excinfo.value.message
    assert message.startswith("baselines/default.json: baseline was recorded for the built-in probe, this run probes "
                              "the script train.py") and "--force" in message and "\n" not in message
    verdict = judge(script, baseline, force=True)
    assert verdict.forced
    assert any(note.startswith("forced comparison: baseline was recorded for the built-in probe") for note in verdict.notes)
    recorded = baseline.model_copy(update={"config": {**baseline.config, "script": {"path": "/ci/checkout/jobs/train.py"}}})
    assert not judge(script, recorded).forced  # the same script, checked out elsewhere
    other = make_result(typical(), config=ProbeConfig(script={"path": "jobs/eval.py"}))
    with pytest.raises(BaselineError, match="recorded for the script train.py, this run probes the script eval.py"):
        judge(other, recorded)
    with pytest.raises(BaselineError, match="recorded for the script train.py, this run probes the built-in probe"):
        judge(make_result(typical()), recorded)


def test_a_script_probe_is_named_for_its_script_unless_named():
    assert ProbeConfig(script={"path": "jobs/train_sft.py"}).baseline_path().as_posix() == "baselines/train_sft.json"
    assert ProbeConfig(name="nightly", script={"path": "jobs/train_sft.py"}).name == "nightly"
    assert ProbeConfig().name == "default"


@pytest.mark.parametrize("status", ["incomplete", "interrupted", "running"])
def test_unfinished_run_is_never_judged(baseline, status):
    with pytest.raises(ProbeFailed) as excinfo:
        judge(make_result(typical(), status=status), baseline)
    assert excinfo.value.exit_code == ExitCode.PROBE_FAILED and status in excinfo.value.message


def test_audits_become_findings(baseline):
    audits = {
        "param_equality": {"passed": False, "message": "rank 2 parameters differ after step 1", "ranks": [2], "max_abs_diff": 0.1},
        "seed_consistency": {"passed": True, "message": "all ranks used their configured seeds"},
    }
    verdict = judge(make_result(typical(), audits=audits), baseline)
    findings = by_check(verdict)
    assert verdict.status == "fail" and [f.check for f in verdict.failures] == ["audit.param_equality"]
    assert findings["audit.param_equality"].ranks == [2] and findings["audit.param_equality"].details == {"max_abs_diff": 0.1}
    assert findings["audit.seed_consistency"].passed


def test_malformed_audit_names_the_field(baseline):
    with pytest.raises(InvalidInput) as excinfo:
        judge(make_result(typical(), audits={"param_equality": {"message": "x"}}), baseline)
    assert excinfo.value.message.startswith("result.json: audits.param_equality.passed: Field required")


def test_judge_reports_config_changes(baseline):
    config = ProbeConfig(train={"lr": 0.01}, rank_overrides={0: {"train": {"loss_scale": 2.0}}})
    verdict = judge(make_result(typical(), config=config), baseline)
    assert [(c.path, c.old, c.new) for c in verdict.config_diff] == [
        ("train.lr", 0.001, 0.01),
        ("rank_overrides.0", None, {"train": {"loss_scale": 2.0}}),
    ]


# ----------------------------------------------------------------------------- config diff


def test_config_diff_nested_lists_and_added_removed_keys():
    old = {"a": {"b": 1, "gone": 2, "list": [1, 2, 3]}, "same": "x"}
    new = {"a": {"b": 5, "list": [1, 9], "new": {"c": 3}}, "same": "x"}
    assert [(c.path, c.old, c.new) for c in config_diff(old, new)] == [
        ("a.b", 1, 5), ("a.gone", 2, None), ("a.list.1", 2, 9), ("a.list.2", 3, None), ("a.new", None, {"c": 3}),
    ]


def test_config_diff_rank_override_keys_match_across_int_and_str():
    old = {"rank_overrides": {0: {"train": {"seed": 1041}}, 1: {"faults": {"grad_noise_std": 0.1}}}}
    new = {"rank_overrides": {"0": {"train": {"seed": 7}}, "1": {"faults": {"grad_noise_std": 0.1}}}}
    assert [(c.path, c.old, c.new) for c in config_diff(old, new)] == [("rank_overrides.0.train.seed", 1041, 7)]
    assert config_diff(ProbeConfig().model_dump(mode="json"), ProbeConfig().model_dump()) == []


# ----------------------------------------------------------------------------- verdict.json


def test_verdict_round_trips_atomically(tmp_path, baseline):
    verdict = judge(make_result(COLLAPSED), baseline, baseline_path="baselines/default.json")
    path = write_verdict(tmp_path, verdict)
    assert path == tmp_path / "verdict.json"
    assert load_verdict(tmp_path) == verdict
    assert [p.name for p in tmp_path.iterdir()] == ["verdict.json"]


def test_load_verdict_errors_are_one_line(tmp_path):
    with pytest.raises(InvalidInput, match="not found"):
        load_verdict(tmp_path)
    (tmp_path / "verdict.json").write_text('{"status": "maybe"}')
    with pytest.raises(InvalidInput) as excinfo:
        load_verdict(tmp_path)
    assert "status" in excinfo.value.message and "\n" not in excinfo.value.message


def test_fields_added_since_the_snapshot_are_not_reported_as_changes(baseline):
    from healthcheck.judge.verdict import normalized_snapshot

    snapshot = ProbeConfig().model_dump(mode="json")
    del snapshot["faults"]["hang_at_step"]  # as if recorded by a healthcheck without that field
    assert config_diff(normalized_snapshot(snapshot), ProbeConfig().model_dump(mode="json")) == []
    assert config_diff(snapshot, ProbeConfig().model_dump(mode="json")) != []  # the raw diff would show it

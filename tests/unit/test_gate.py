"""The CI gate: which exit code each outcome gets, and that the report files exist on every path."""

from __future__ import annotations

import pytest

from healthcheck import gate
from healthcheck.artifacts import write_result
from healthcheck.errors import BaselineError, ExitCode, ProbeFailed
from healthcheck.judge.baseline import save_baseline
from healthcheck.outputs.report import JUNIT_FILE, REPORT_FILE
from tests.synthetic_runs import COLLAPSED, clean_runs, fitted, make_result


@pytest.fixture
def baseline_file(tmp_path):
    path = tmp_path / "baselines" / "default.json"
    save_baseline(fitted(), path)
    return path


def _run_dir(tmp_path, result):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_result(run_dir, result)
    return run_dir


def test_a_clean_run_passes_and_a_collapsed_one_fails(tmp_path, baseline_file):
    clean = clean_runs(6, rng_seed=9)[-1]
    assert gate.gate_run(clean, _run_dir(tmp_path, clean), baseline_file) == ExitCode.PASS
    collapsed = make_result(COLLAPSED, seed=99)
    other = tmp_path / "other"
    other.mkdir()
    assert gate.gate_run(collapsed, other, baseline_file) == ExitCode.INCONSISTENT
    assert (other / "verdict.json").exists() and (other / REPORT_FILE).exists() and (other / JUNIT_FILE).exists()


def test_no_judge_reports_and_passes_without_a_baseline(tmp_path):
    result = clean_runs(1)[0]
    run_dir = _run_dir(tmp_path, result)
    assert gate.gate_run(result, run_dir, tmp_path / "none.json", judge_against_baseline=False) == ExitCode.PASS
    assert (run_dir / REPORT_FILE).exists() and not (run_dir / "verdict.json").exists()


def test_a_missing_baseline_is_exit_2_after_the_report_is_written(tmp_path):
    result = clean_runs(1)[0]
    run_dir = _run_dir(tmp_path, result)
    with pytest.raises(BaselineError, match="no baseline found; record one with"):
        gate.gate_run(result, run_dir, tmp_path / "missing.json")
    assert (run_dir / REPORT_FILE).exists()


def test_an_unfinished_probe_is_exit_3_and_still_reported(tmp_path, baseline_file):
    result = make_result(clean_runs(1)[0].model_dump()["summary"] and {"loss_std": 0.3}, status="incomplete")
    result.failure = "rank 2 failed at step 5: RuntimeError: boom"
    run_dir = _run_dir(tmp_path, result)
    with pytest.raises(ProbeFailed, match="rank 2 failed at step 5"):
        gate.gate_run(result, run_dir, baseline_file)
    assert (run_dir / REPORT_FILE).exists()
    assert gate.exit_code_for(result, None) == ExitCode.PROBE_FAILED


def test_rerender_returns_the_judged_exit_code(tmp_path, baseline_file):
    collapsed = make_result(COLLAPSED, seed=99)
    run_dir = _run_dir(tmp_path, collapsed)
    assert gate.gate_run(collapsed, run_dir, baseline_file) == ExitCode.INCONSISTENT
    (run_dir / REPORT_FILE).unlink()
    assert gate.rerender(run_dir) == ExitCode.INCONSISTENT
    assert (run_dir / REPORT_FILE).exists()

"""Fail fast through the real CLI: a decisive failure stops every rank at the same step and exits 1.

Three 4-rank probes: replicated data stops before the first step; --no-fail-fast runs every step of the
same probe; a rank with its own learning rate stops at the first parameter check.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import read_rows, run_cli

pytestmark = pytest.mark.e2e

BASE = ["--audits-only", "--no-plots", "--set", "distributed.nproc=4", "--set", "metrics.warmup_steps=1"]


def probe(tmp_path, name, *extra):
    out = tmp_path / name
    done = run_cli("probe", "--out", out, *BASE, *extra)
    result = json.loads((out / "result.json").read_text())
    verdict = json.loads((out / "verdict.json").read_text())
    return done, out, result, verdict


def test_identical_data_stops_before_the_first_step(tmp_path):
    done, out, result, verdict = probe(tmp_path, "replicated", "--set", "data.sharding=replicated",
                                       "--set", "train.steps=40")
    assert done.returncode == 1, done.stderr[-2000:]
    assert result["status"] == "complete" and result["steps_completed"] == 0
    assert result["stopped_early"]["step"] == 0 and result["stopped_early"]["check"] == "data_shards"
    shards = result["audits"]["data_shards"]
    assert not shards["passed"] and shards["ranks"] == [0, 1, 2, 3] and shards["signature"] == "identical"
    assert verdict["stopped_early"] == "stopped early at step 0: data_shards"
    assert "stopped early at step 0: data_shards" in done.stdout
    # Nothing was measured, and the report says so rather than passing the statistical audits.
    assert not (out / "steps.jsonl").exists() or not read_rows(out / "steps.jsonl")
    for name in ("stragglers", "rank_outliers", "nonfinite", "param_equality"):
        assert result["audits"][name]["measured"] is False, name
    assert set(result["timing"]["phases"]) >= {"imports_and_caches", "spawn", "rendezvous", "build", "train"}


def test_no_fail_fast_runs_every_step(tmp_path):
    done, out, result, verdict = probe(tmp_path, "full", "--set", "data.sharding=replicated", "--set", "train.steps=3",
                                       "--no-fail-fast")
    assert done.returncode == 1, done.stderr[-2000:]
    assert result["steps_completed"] == 3 and result["stopped_early"] is None and verdict["stopped_early"] is None
    assert not result["audits"]["data_shards"]["passed"]
    assert len(read_rows(out / "steps.jsonl")) == 3 * 4


def test_a_parameter_mismatch_stops_at_its_check_step(tmp_path):
    # Rank 1 steps with another learning rate: its parameters differ after the first update, the check
    # after step 0 sees it, and every rank stops there.
    done, out, result, verdict = probe(tmp_path, "lr", "--set", "rank_overrides={1: {train: {lr: 0.01}}}",
                                       "--set", "train.steps=30", "--set", "metrics.param_check_every=4")
    assert done.returncode == 1, done.stderr[-2000:]
    assert result["stopped_early"]["check"] == "param_equality" and result["stopped_early"]["step"] == 0
    assert result["steps_completed"] == 1
    params = result["audits"]["param_equality"]
    assert not params["passed"] and params["ranks"] == [1] and params["check_steps"] == [0]
    assert sorted({row["step"] for row in read_rows(out / "steps.jsonl")}) == [0]

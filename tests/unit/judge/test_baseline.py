"""Baseline fitting, its false-alarm calibration, persistence and load errors (pure, no processes)."""

from __future__ import annotations

import json
import math
import random
import statistics
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthcheck.artifacts import write_result
from healthcheck.config import ProbeConfig
from healthcheck.errors import BaselineError, ExitCode
from healthcheck.judge import baseline as baseline_module
from healthcheck.judge.baseline import (
    Baseline,
    baseline_from_runs,
    default_approver,
    fit_baseline,
    history_path,
    load_baseline,
    record_command,
    save_baseline,
)
from healthcheck.judge.envelope import METRICS, envelope_multiplier, fit_envelope, t_quantile
from healthcheck.outputs.baseline_text import render_baseline_text

# ----------------------------------------------------------------------------- synthetic runs
from tests.synthetic_runs import CLEAN, clean_runs, draw, fitted, make_result  # noqa: E402

# Optional metrics (reduction_rel_error) are skipped when no run measured them; the synthetic runs never do.
GATED = {m for m, spec in METRICS.items() if spec.gated and spec.required}

# ----------------------------------------------------------------------------- pure math


@pytest.mark.parametrize(
    "p, df, expected",
    # Printed t tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2), and the normal limit for large df.
    [(0.975, 1, 12.706), (0.975, 4, 2.776), (0.975, 10, 2.228), (0.975, 30, 2.042), (0.995, 4, 4.604),
     (0.9995, 4, 8.610), (0.999, 7, 4.785), (0.025, 4, -2.776), (0.975, 5000, 1.9604)],
)
def test_t_quantile_matches_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-3)


def test_envelope_multiplier_meets_the_per_metric_false_alarm_target():
    """Monte Carlo over many fits: the average chance that a fresh clean draw falls outside must be at
    most alpha/M (expected ~0.97e-3 against 1.43e-3). It fails if the scale were MAD alone or half the sd
    (~5e-3). K=3 is left out: its misses are so heavy-tailed that a few thousand fits cannot pin the mean."""
    normal, rng = statistics.NormalDist(), random.Random(1)
    spec = METRICS["cosine_mean"].model_copy(update={"abs_floor": 1e-9, "rel_floor": 1e-9})
    for k in (5, 8):
        multiplier = envelope_multiplier(k, len(GATED))
        misses = []
        for _ in range(6000):
            env = fit_envelope([rng.gauss(0, 1) for _ in range(k)], spec, multiplier)
            misses.append(normal.cdf(env.lower) + 1 - normal.cdf(env.upper))
        assert statistics.fmean(misses) <= 0.01 / len(GATED), k


def test_identical_runs_still_get_a_two_sided_envelope_from_the_floor():
    spec, multiplier = METRICS["cosine_mean"], envelope_multiplier(5, 7)
    env = fit_envelope([0.3] * 5, spec, multiplier)
    assert env.lower < 0.3 < env.upper
    assert env.upper - 0.3 == pytest.approx(multiplier * spec.abs_floor)


def test_log_scale_dispersion_envelope_excludes_zero_and_falls_back_to_linear_for_zeros():
    spec, multiplier = METRICS["loss_std"], envelope_multiplier(3, 7)
    wide = fit_envelope([0.1, 0.3, 0.9], spec, multiplier)  # spread so wide a linear fit would go below 0
    assert wide.scale == "log" and 0 < wide.lower < wide.center < wide.upper
    assert fit_envelope([0.0, 0.3, 0.31], spec, multiplier).scale == "linear"


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@given(values=st.lists(finite, min_size=3, max_size=12), metric=st.sampled_from(sorted(METRICS)))
def test_envelope_is_ordered_and_two_sided_for_any_finite_values(values, metric):
    env = fit_envelope(values, METRICS[metric], envelope_multiplier(len(values), len(GATED)))
    assert env.lower < env.center < env.upper
    assert all(map(math.isfinite, (env.lower, env.center, env.upper)))
    assert min(values) <= env.center <= max(values)


@settings(max_examples=25, deadline=None)
@given(runs=st.lists(st.fixed_dictionaries({m: finite for m in CLEAN}), min_size=3, max_size=6))
def test_fit_baseline_envelopes_are_ordered_for_any_finite_runs(runs):
    baseline = fit_baseline([make_result(v, seed=i) for i, v in enumerate(runs)], reason="r", approved_by="a")
    assert set(baseline.envelopes) == GATED
    for env in baseline.envelopes.values():
        assert env.lower < env.center < env.upper


# ----------------------------------------------------------------------------- fitting from runs


def test_fit_records_provenance_and_gates_the_default_table():
    baseline = fitted()
    assert set(baseline.envelopes) == GATED
    assert {"loss_mean", "noise_scale"}.isdisjoint(baseline.envelopes)
    assert [r.seed for r in baseline.runs] == [42, 43, 44, 45, 46]
    assert baseline.config["train"]["seed"] == 42
    assert baseline.config_fingerprint == ProbeConfig().fingerprint()
    assert (baseline.world_size, baseline.device_type, baseline.torch_version) == (8, "cpu", "2.13.0")
    assert baseline.envelopes["loss_range"].statistic == "p95"
    assert (baseline.approved_by, baseline.reason, baseline.name) == ("alice", "initial", "default")


def test_fit_is_order_independent():
    runs = clean_runs()
    a = fit_baseline(runs, reason="r", approved_by="a")
    b = fit_baseline(list(reversed(runs)), reason="r", approved_by="a")
    assert a.envelopes == b.envelopes


def _one_line_baseline_error(excinfo) -> str:
    assert excinfo.value.exit_code == ExitCode.INVALID_INPUT
    assert "\n" not in excinfo.value.message
    return excinfo.value.message


def test_refuses_fewer_than_three_runs():
    with pytest.raises(BaselineError) as excinfo:
        fit_baseline(clean_runs(2), reason="r", approved_by="a")
    assert "at least 3" in _one_line_baseline_error(excinfo)


def test_refuses_an_unfinished_run():
    runs = clean_runs(3)
    runs[1] = make_result(draw(random.Random(5)), seed=43, status="incomplete")
    with pytest.raises(BaselineError) as excinfo:
        fit_baseline(runs, reason="r", approved_by="a")
    assert "incomplete" in _one_line_baseline_error(excinfo)


def test_refuses_configs_that_differ_beyond_the_seed():
    runs = clean_runs(3)
    runs[2] = make_result(draw(random.Random(5)), config=ProbeConfig(train={"seed": 44, "lr": 0.01}))
    with pytest.raises(BaselineError) as excinfo:
        fit_baseline(runs, reason="r", approved_by="a")
    assert "train.lr" in _one_line_baseline_error(excinfo)


def test_refuses_repeated_seeds_and_mixed_world_sizes():
    rng = random.Random(3)
    with pytest.raises(BaselineError, match="distinct seeds"):
        fit_baseline([make_result(draw(rng), seed=42) for _ in range(3)], reason="r", approved_by="a")
    runs = clean_runs(3)
    runs[0] = make_result(draw(rng), seed=42, world_size=4)
    with pytest.raises(BaselineError, match="world_size"):
        fit_baseline(runs, reason="r", approved_by="a")


def test_refuses_a_run_missing_a_gated_metric():
    runs = clean_runs(3)
    runs[0].summary.pop("cosine_mean")
    with pytest.raises(BaselineError, match=r"summary\.cosine_mean\.median"):
        fit_baseline(runs, reason="r", approved_by="a")


def test_baseline_from_runs_reads_result_json(tmp_path):
    dirs = []
    for i, result in enumerate(clean_runs(3)):
        run_dir = tmp_path / f"default-{i}"
        run_dir.mkdir()
        write_result(run_dir, result)
        dirs.append(run_dir)
    baseline = baseline_from_runs(dirs, reason="update", approved_by="bob")
    assert [r.run_id for r in baseline.runs] == ["default-0", "default-1", "default-2"]
    assert baseline.envelopes == fit_baseline(clean_runs(3), reason="x", approved_by="y").envelopes


def test_approver_defaults_to_user_when_git_has_none(monkeypatch):
    def no_git(*args, **kwargs):
        raise OSError("no git")

    monkeypatch.setattr(baseline_module.subprocess, "run", no_git)
    monkeypatch.setenv("USER", "carol")
    assert default_approver() == "carol"
    assert fit_baseline(clean_runs(3), reason="r", approved_by=None).approved_by == "carol"


def test_snapshot_baseline_path_follows_the_config():
    assert fitted().config_snapshot_baseline_path() == Path("baselines/default.json")
    runs = [make_result(draw(random.Random(i)), config=ProbeConfig(name="nightly", baseline="ci/b.json", train={"seed": i}))
            for i in range(3)]
    assert fit_baseline(runs, reason="r", approved_by="a").config_snapshot_baseline_path() == Path("ci/b.json")


# ----------------------------------------------------------------------------- persistence


def test_save_load_round_trip_and_history_keeps_previous_versions(tmp_path):
    path = tmp_path / "baselines" / "default.json"
    first = fitted()
    second = first.model_copy(update={"reason": "second"})
    third = first.model_copy(update={"reason": "third"})
    save_baseline(first, path)
    assert not history_path(path).exists()
    save_baseline(second, path)
    save_baseline(third, path)
    assert load_baseline(path) == third
    history = [Baseline.model_validate(json.loads(line)) for line in history_path(path).read_text().splitlines()]
    assert history == [first, second]
    assert sorted(p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")) == []


def test_concurrent_writers_lose_no_version(tmp_path):
    path = tmp_path / "default.json"
    base = fitted()
    versions = [base.model_copy(update={"reason": f"writer {i}"}) for i in range(8)]
    threads = [threading.Thread(target=save_baseline, args=(v, path)) for v in versions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept = [json.loads(line)["reason"] for line in history_path(path).read_text().splitlines()]
    kept.append(load_baseline(path).reason)
    assert sorted(kept) == sorted(v.reason for v in versions)


def test_corrupt_previous_file_is_kept_verbatim_in_history(tmp_path):
    path = tmp_path / "default.json"
    path.write_text("{not json")
    save_baseline(fitted(), path)
    assert json.loads(history_path(path).read_text()) == "{not json"


def _load_error(path: Path, **kwargs) -> str:
    with pytest.raises(BaselineError) as excinfo:
        load_baseline(path, **kwargs)
    return _one_line_baseline_error(excinfo)


def test_missing_baseline_names_the_record_command(tmp_path):
    path = tmp_path / "default.json"
    hint = record_command("probe.yaml", ["train.steps=20"])
    assert hint == "healthcheck baseline record --config probe.yaml --set train.steps=20 --repeats 5"
    assert _load_error(path, record_hint=hint).endswith(f"record one with: {hint}")
    # Without a hint, the command for the default probe: runnable as printed, no placeholder.
    assert _load_error(path) == f"{path}: no baseline found; record one with: healthcheck baseline record --repeats 5"


def _saved(tmp_path: Path) -> tuple[Path, dict]:
    path = tmp_path / "default.json"
    save_baseline(fitted(), path)
    return path, json.loads(path.read_text())


def test_corrupt_json_is_one_line_error(tmp_path):
    path, _ = _saved(tmp_path)
    path.write_text(path.read_text()[:-20])
    assert _load_error(path).startswith(f"{path}: not valid JSON (line")


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda d: d["envelopes"]["cosine_mean"].update(lower="abc"), "envelopes.cosine_mean.lower: Input should be a valid number"),
        (lambda d: d["envelopes"]["cosine_mean"].update(lower=0.9, upper=0.1), "envelopes.cosine_mean: lower 0.9 is above upper 0.1"),
        (lambda d: d["envelopes"]["loss_std"].update(upper=float("nan")), "envelopes.loss_std.upper: Input should be a finite number"),
        (lambda d: d.update(schema_version=99), "schema_version: unknown baseline schema version 99"),
        (lambda d: d.pop("approved_by"), "approved_by: Field required"),
        (lambda d: d.update(surprise=1), "surprise: unknown key"),
    ],
)
def test_hand_edited_field_is_named(tmp_path, edit, expected):
    path, data = _saved(tmp_path)
    edit(data)
    path.write_text(json.dumps(data))
    assert _load_error(path).startswith(f"{path}: {expected}")


def test_render_shows_provenance_and_every_envelope():
    baseline = fitted()
    text = render_baseline_text(baseline)
    assert "alice" in text and "initial" in text and "42, 43, 44, 45, 46" in text
    for metric, env in baseline.envelopes.items():
        assert metric in text and f"{env.upper:.4g}" in text

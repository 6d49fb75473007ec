"""From step rows to result.json's window summary: per metric, the pooled noise scale, non-finite events."""

from __future__ import annotations

import json

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE
from healthcheck.judge.envelope import METRICS
from healthcheck.judge.summary import first_nonfinite, pooled_noise_scale, summarize_metrics, summarize_run


def _aggregates(steps: int) -> list[dict]:
    return [{"step": s, "loss_std": s / 8, "cosine_mean": 0.5, "trace_sigma_est": 2.0 * (s + 1),
             "grad_sqnorm_est": 1.0 * (s + 1), "nonfinite_ranks": []} for s in range(steps)]


def test_the_window_starts_at_warmup_and_every_per_step_metric_is_summarised():
    summary, window = summarize_metrics(_aggregates(20), window_start=10)
    assert window == 10
    assert set(summary) == {name for name, spec in METRICS.items() if spec.per_step} | {"noise_scale_pooled"}
    # Steps 10..19 of s/8 (exact binary fractions): min 1.25, max 2.375, median 1.8125.
    assert (summary["loss_std"].min, summary["loss_std"].max, summary["loss_std"].n) == (1.25, 2.375, 10)
    assert summary["loss_std"].median == 1.8125
    assert summary["grad_norm_cv"].n == 0 and summary["grad_norm_cv"].median is None  # never measured


def test_pooled_noise_scale_is_a_ratio_of_window_means_not_a_mean_of_ratios():
    window = [{"trace_sigma_est": 1.0, "grad_sqnorm_est": 1.0}, {"trace_sigma_est": 9.0, "grad_sqnorm_est": -0.5}]
    # Per-step ratios are 1 and -18 (mean -8.5); the stable form is mean(trace)/mean(|G|^2) = 5 / 0.25 = 20.
    assert pooled_noise_scale(window).median == 20.0
    assert pooled_noise_scale([{"trace_sigma_est": 1.0, "grad_sqnorm_est": 0.0}]).median is None


def test_first_nonfinite_keeps_each_ranks_first_event_and_tells_loss_from_gradient():
    aggregates = [{"step": 3, "nonfinite_ranks": [2]}, {"step": 4, "nonfinite_ranks": [2, 5]}]
    rows = [{"step": 3, "rank": 2, "loss": None}, {"step": 4, "rank": 5, "loss": 1.0}]
    events = first_nonfinite(aggregates, rows)
    assert [(e.rank, e.step, e.what) for e in events] == [(2, 3, "loss"), (5, 4, "gradient")]


def test_summarize_run_reads_a_crashed_runs_partial_files(tmp_path):
    rows = [{"step": s, "rank": r, "loss": 1.0 + r * (s >= 2), "grad_norm": 1.0, "cosine_to_mean": 0.9,
             "compute_ms": 10.0, "tokens": 5} for s in range(4) for r in range(3)]
    (tmp_path / STEPS_FILE).write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    (tmp_path / AGGREGATES_FILE).write_text("\n".join(json.dumps(a) for a in _aggregates(4)))
    out = summarize_run(tmp_path, window_start=1)
    assert out["last_step"] == 3 and out["window_steps"] == 3
    assert [s.rank for s in out["per_rank"]] == [0, 1, 2]
    assert out["per_rank"][2].loss > out["per_rank"][0].loss


def test_summarize_run_of_an_empty_directory(tmp_path):
    out = summarize_run(tmp_path, window_start=0)
    assert out["last_step"] == -1 and out["window_steps"] == 0 and out["per_rank"] == [] and out["nonfinite"] == []

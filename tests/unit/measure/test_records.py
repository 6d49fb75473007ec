"""One StepMetrics becomes one steps.jsonl row per rank and one aggregates.jsonl row."""

from __future__ import annotations

import json

from healthcheck.measure.metrics import compute_step_metrics
from healthcheck.measure.records import aggregate_row, rank_rows


def _metrics(extras=None, loss=(1.0, 3.0)):
    return compute_step_metrics(
        step=7, direction="exact", per_rank_loss=list(loss), per_rank_sqnorm=[4.0, 1.0], dots_with_mean=[1.5, 0.75],
        mean_sqnorm=1.5625, gram=[[4.0, 1.0], [1.0, 1.0]], per_rank_tokens=[10, 30], per_rank_extras=extras or {},
    ).to_dict()


def test_rank_rows_carry_each_ranks_own_numbers():
    rows = rank_rows(7, _metrics({"compute_ms": [5.0, 6.0], "busy_ms": [7.0, 8.0]}))
    assert [r["rank"] for r in rows] == [0, 1] and {r["step"] for r in rows} == {7}
    assert [r["loss"] for r in rows] == [1.0, 3.0]
    assert [r["grad_norm"] for r in rows] == [2.0, 1.0]
    assert [r["tokens"] for r in rows] == [10, 30]
    assert [(r["compute_ms"], r["busy_ms"]) for r in rows] == [(5.0, 7.0), (6.0, 8.0)]


def test_rank_rows_without_timings_or_tokens():
    data = _metrics()
    data["per_rank_tokens"] = None
    rows = rank_rows(0, data)
    assert all(r["tokens"] is None and r["compute_ms"] is None and r["busy_ms"] is None for r in rows)


def test_rank_rows_carry_the_run_queue_wait_and_none_where_it_was_needed_but_unread():
    rows = rank_rows(7, _metrics({"busy_ms": [7.0, 8.0], "runq_ms": [12.5, float("nan")]}))
    assert [r["runq_ms"] for r in rows] == [12.5, None]
    assert "runq_ms" not in rank_rows(7, _metrics({"busy_ms": [7.0, 8.0]}))[0]  # a monitor that reads no clock


def test_aggregate_row_has_every_summarised_aggregate_and_stays_json_safe():
    row = aggregate_row(7, _metrics(loss=(1.0, float("nan"))), lr=1e-3)
    assert row["step"] == 7 and row["lr"] == 1e-3
    assert row["loss_mean"] == 1.0  # the NaN loss is left out of the mean, not averaged in
    assert row["tokens_total"] == 40
    assert row["cosine_to_mean_min"] == min(_metrics()["cosine_to_mean"])
    assert row["pairwise_cosine"][0][1] == 0.5
    assert "reduction_rel_error" not in row  # not a reduction-check step
    json.dumps(row, allow_nan=False)


def test_reduction_fields_name_the_worst_rank_by_bound_ratio():
    extras = {"reduction_rel_error": [1e-7, 5e-8], "reduction_bound_ratio": [0.1, 0.4]}
    row = aggregate_row(0, _metrics(extras))
    assert row["reduction_rel_error"] == 1e-7 and row["reduction_bound_ratio"] == 0.4 and row["reduction_worst_rank"] == 1
    assert "reduction_fp16_floor" not in row  # FSDP2's pass does not count it
    row = aggregate_row(0, _metrics({**extras, "reduction_fp16_floor": [3.0, 2.0]}))
    assert row["reduction_fp16_floor"] == 2.0  # the worst rank's, with its ratio
    # The script's hook in its exact phase only if on every rank; absent where any rank has no such phase.
    assert aggregate_row(0, _metrics({**extras, "comm_hook_exact": [1.0, 0.0]}))["comm_hook_exact"] == 0.0
    assert "comm_hook_exact" not in aggregate_row(0, _metrics({**extras, "comm_hook_exact": [1.0, None]}))


def test_a_nonfinite_reduction_check_is_left_to_the_nonfinite_audit():
    extras = {"reduction_rel_error": [1e-7, float("nan")], "reduction_bound_ratio": [0.1, float("nan")]}
    row = aggregate_row(0, _metrics(extras))
    assert row["reduction_rel_error"] is None and row["reduction_worst_rank"] is None

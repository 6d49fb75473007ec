"""The series the PNGs, the HTML charts and the Mermaid charts share."""

from __future__ import annotations

import math

import pytest

from healthcheck.artifacts import STEPS_FILE
from healthcheck.files import read_jsonl
from healthcheck.outputs import series
from tests.fixtures_runs import write_fake_run


def test_mean_pairwise_cosine_skips_warmup_and_nulls():
    rows = [
        {"step": 0, "pairwise_cosine": [[1, -1.0], [-1.0, 1]]},
        {"step": 5, "pairwise_cosine": [[1, 0.2], [None, 1]]},
        {"step": 6, "pairwise_cosine": [[1, 0.4], [None, 1]]},
        {"step": 7, "pairwise_cosine": None},
    ]
    matrix = series.mean_pairwise_cosine(rows, start_step=5)
    assert matrix[0][1] == pytest.approx(0.3)
    assert math.isnan(matrix[1][0])
    assert series.mean_pairwise_cosine(rows[:1], start_step=5) is None


def test_standout_ranks_and_envelope_findings_of_a_failing_run(tmp_path):
    result, verdict = write_fake_run(tmp_path, outlier_rank=3)
    assert series.standout_ranks(result, list(read_jsonl(tmp_path / STEPS_FILE))) == [3]
    assert [f.check for f in series.findings_for(verdict, "cosine_mean")] == ["envelope.cosine_mean"]
    assert series.findings_for(None, "cosine_mean") == []

"""``benchmarks/divergence_trend.py``: one rank's signals against the others' median, per step window."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import loaded_script


@pytest.fixture(scope="module")
def trend():
    with loaded_script("divergence_trend") as module:
        yield module


def rows(steps: int, drift: float) -> list[dict]:
    """Rank 2's gradient norm grows by ``drift`` per step and its cosine to the mean falls; ranks 0, 1 stay put."""
    out = []
    for step in range(steps):
        for rank in range(3):
            odd = rank == 2
            out.append({"step": step, "rank": rank, "loss": 2.0 + (0.5 if odd else 0.0),
                        "grad_norm": 1.0 + (drift * step if odd else 0.0),
                        "cosine_to_mean": 0.8 - (0.01 * step if odd else 0.0)})
    return out


def test_windows_show_a_growing_divergence(trend):
    data = rows(40, drift=0.1)
    early = trend.window_signals(data, 2, 0, 10)
    late = trend.window_signals(data, 2, 30, 40)
    assert early["norm_ratio"] == pytest.approx(1 + 0.1 * 4.5)
    assert late["norm_ratio"] == pytest.approx(1 + 0.1 * 34.5)
    assert late["cosine_gap"] == pytest.approx(-0.345) and early["cosine_gap"] == pytest.approx(-0.045)
    assert early["loss_gap"] == pytest.approx(0.5)
    assert trend.window_signals(data, 2, 50, 60) is None  # no steps there


def test_cli_prints_one_row_per_window(trend, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(20, drift=0.0)))
    assert trend.main([str(run), "--rank", "2", "--windows", "0:10", "10:20"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "–" in line]
    assert table == ["| 0–9 | 1.00 | -0.045 | +0.500 |", "| 10–19 | 1.00 | -0.145 | +0.500 |"]
    assert trend.main([str(tmp_path / "missing")]) == 2

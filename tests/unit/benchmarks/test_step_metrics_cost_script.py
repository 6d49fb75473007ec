"""``benchmarks/step_metrics_cost.py``: its loops are the cosines' reference, and its table has every column."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.benchmark_scripts import loaded_script


@pytest.fixture(scope="module")
def script():
    with loaded_script("step_metrics_cost") as module:
        yield module


def test_loops_and_numpy_agree_to_the_bit_with_nan_rows(script):
    nan = float("nan")
    gram = [[4.0, 2.0, nan, -1.0], [2.0, 1.0, 0.0, 3.0], [nan, 0.0, 0.0, 0.0], [-1.0, 3.0, 0.0, 9.0]]
    import numpy as np

    loops, vectorised = script.loop_pieces(gram), script.numpy_pieces(np.array(gram))
    assert json.dumps(loops) == json.dumps(vectorised)
    # Norms 2, 1, -, 3: rank 2's vector is zero, so its row is NaN and the summary leaves it out.
    assert all(math.isnan(value) for value in loops[0][2])
    assert loops[2] == -1.0 / (2.0 * 3.0) and loops[1] == math.fsum([1.0, -1 / 6, 1.0] * 2) / 6


def test_table_has_a_row_per_world(script, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["step_metrics_cost.py", "--worlds", "2", "5", "--k", "64", "--repeats", "1"])
    script.main()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [row[0] for row in rows] == ["2", "5"]
    # Every column a number. Not > 0: times print to the microsecond and the ratio to a tenth, and with one repeat a
    # 2-rank piece read 0.000 ms and a first numpy call made loops / numpy 0.0 (two fresh-clone runs, 2026-11-28).
    assert all(float(cell) >= 0 for row in rows for cell in row[1:]), rows

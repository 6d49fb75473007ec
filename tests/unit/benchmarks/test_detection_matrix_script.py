"""``benchmarks/detection_matrix.py`` turns scenario outcomes into the README's tables.

The sweep itself is a long benchmark (one real probe per scenario and seed); these tests check the
table arithmetic and that sweeps run in several pieces merge into one table.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from healthcheck.run.scenarios import Outcome
from tests.benchmark_scripts import loaded_script


@pytest.fixture(scope="module")
def matrix():
    with loaded_script("detection_matrix") as module:
        yield module


def outcome(scenario, seed, fired=(), named=(), detected=True, right_rank=True, status="complete", exit_code=1):
    return dataclasses.asdict(Outcome(scenario, seed, exit_code, status, tuple(fired), tuple(named), detected, right_rank))


def write_sweep(path: Path, outcomes) -> Path:
    path.write_text(json.dumps({"command": "detection_matrix.py", "baseline": "b.json", "outcomes": outcomes}))
    return path


def test_sweeps_in_pieces_merge_into_one_table(matrix, tmp_path, capsys):
    first = write_sweep(tmp_path / "a.json", [
        outcome("clean", 1, exit_code=0),
        outcome("clean", 2, fired=["envelope.loss_std"], detected=False, exit_code=1),
    ])
    second = write_sweep(tmp_path / "b.json", [
        outcome("loss-x2", 1, fired=["envelope.grad_norm_cv"], named=[3]),
        outcome("loss-x2", 2, fired=["envelope.grad_norm_cv", "audit.stragglers"], named=[0], right_rank=False),
        outcome("loss-x2", 3, detected=False, right_rank=False, status="failed", exit_code=3),
    ])
    assert matrix.main(["--from-json", str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert "| clean | nothing fires | false alarms 1/2 | - | 0/2 |" in out
    row = next(line for line in out.splitlines() if line.startswith("| loss-x2 |") and "/3 |" in line and "(" in line)
    assert row.split(" | ")[2:] == ["2/3", "1/3", "1/3 |"]
    firing = next(line for line in out.splitlines() if line.startswith("| loss-x2 | 3 |"))
    # audits first, then envelopes; "·" where a check never fired
    assert firing == "| loss-x2 | 3 | 1/3 | 2/3 | · |"  # stragglers, grad_norm_cv, loss_std

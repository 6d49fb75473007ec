"""Smoke test of ``benchmarks/overhead.py``: its core runs end to end and prints the promised columns.

The numbers themselves are not checked (2 steps on a shared CPU say nothing); the benchmark is a
script whose table goes into the README, not a timed test.

    python -m pytest tests/unit/test_overhead_script.py -q
"""

from __future__ import annotations

import math

import pytest

from tests.benchmark_scripts import loaded_script


@pytest.fixture(scope="module")
def overhead():
    with loaded_script("overhead") as module:
        yield module


def test_cli_defaults_cover_the_matrix(overhead):
    args = overhead.parse_args([])
    assert overhead.plan_matrix(args.models, args.nproc, args.scaling_nproc) == [
        ("tiny-gpt2", 2), ("tiny-gpt2", 4), ("tiny-gpt2", 8), ("small-gpt2", 8),
    ]
    assert set(args.modes) == {"sketch", "exact"}


@pytest.mark.multiprocess
def test_two_ranks_two_steps_print_every_column(overhead):
    setting = overhead.Setting(model="tiny-gpt2", modes=("sketch", "exact"), steps=2, warmup=1, block=1)
    rows = overhead.measure(setting, nproc=2)
    table = overhead.render_table(rows).splitlines()
    assert table[0].split() == list(overhead.COLUMNS)
    assert [line.split()[:3] for line in table[1:]] == [["tiny-gpt2", "2", "sketch"], ["tiny-gpt2", "2", "exact"]]
    for row in rows:
        assert row.plain_ms > 0 and row.monitored_ms > 0
        assert math.isclose(row.ratio, row.monitored_ms / row.plain_ms)
        assert 0 < row.ci90[0] <= row.ci90[1] and row.cpu_ratio > 0

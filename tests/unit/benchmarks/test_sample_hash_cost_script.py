"""``benchmarks/sample_hash_cost.py``: one line per batch shape, each with its cost and its share of a step."""

from __future__ import annotations

import sys

from tests.benchmark_scripts import loaded_script


def test_every_shape_gets_a_line_with_its_share_of_the_step(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sample_hash_cost.py", "--shapes", "2x16", "3x64", "--repeats", "3", "--step-ms", "50"])
    with loaded_script("sample_hash_cost") as module:
        module.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["batch", "ms/fetch", "us/sample"] and len(lines) == 3, lines
    for line, shape in zip(lines[1:], ("2x16", "3x64"), strict=True):
        fields = line.split()
        assert fields[0] == shape and float(fields[1]) > 0 and fields[3].endswith("%"), line

"""``benchmarks/hook_breakdown.py``: every piece it times exists, is charged its CPU, and is put back."""

from __future__ import annotations

import doctest
import time

import pytest
import torch

from tests.benchmark_scripts import loaded_script


@pytest.fixture(scope="module")
def breakdown():
    with loaded_script("hook_breakdown") as module:
        yield module


def test_its_doctests_pass(breakdown):
    assert doctest.testmod(breakdown).failed == 0


def test_instrument_charges_each_piece_and_restores_it(breakdown, monkeypatch):
    from healthcheck.measure import runqueue, sketch

    originals = {label: _target(owner, attribute, method) for owner, attribute, method, label in breakdown.PIECES}
    # A renamed piece fails here, not in a benchmark run.
    assert all(callable(target if not isinstance(target, tuple) else target[1]) for target in originals.values())

    def busy_read():
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    monkeypatch.setattr(runqueue, "read", busy_read)
    totals: dict[str, float] = {}
    restore = breakdown.instrument(totals)
    try:
        runqueue.read()
        sketch.FoldedSketch(64, seed=0)(0, torch.ones(1000))
    finally:
        restore()
    assert totals["  run-queue clock (hook and end_step)"] >= 20.0
    assert totals["  sketch"] > 0.0
    assert runqueue.read is busy_read
    assert {label: _target(o, a, m) for o, a, m, label in breakdown.PIECES if label != "  run-queue clock (hook and end_step)"} == {
        label: target for label, target in originals.items() if label != "  run-queue clock (hook and end_step)"
    }


def _target(module_name, attribute, method):
    import importlib

    owner = getattr(importlib.import_module(module_name), attribute)
    return owner if method is None else (vars(owner).get(method), getattr(owner, method))

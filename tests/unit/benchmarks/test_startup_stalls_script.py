"""``benchmarks/startup_stalls.py``: the stated bound on the stall rate, and bad input before any launch."""

from __future__ import annotations

import doctest

import pytest

from tests.benchmark_scripts import loaded_script


@pytest.fixture(scope="module")
def stalls():
    with loaded_script("startup_stalls") as module:
        yield module


def test_its_doctests_pass(stalls):
    failed, attempted = doctest.testmod(stalls)
    assert attempted >= 3 and failed == 0


def test_the_upper_bound_is_the_exact_binomial_one(stalls):
    # At the bound, seeing at most the observed stalls is exactly 5% likely.
    from math import comb

    for observed, launches in ((0, 300), (4, 76), (1, 20)):
        rate = stalls.upper_bound(observed, launches)
        tail = sum(comb(launches, k) * rate**k * (1 - rate) ** (launches - k) for k in range(observed + 1))
        assert tail == pytest.approx(0.05, abs=1e-6)
        assert observed / launches < rate < 1


def test_dump_without_py_spy_is_refused_before_any_launch(stalls, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(stalls.shutil, "which", lambda name: None)
    assert stalls.main(["--launches", "1", "--dump", str(tmp_path)]) == 2
    assert "py-spy" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())

"""The local launcher's fork gate, on real forked workers through torch's elastic agent.

A worker must not touch a socket before the agent has forked its last sibling: torch's TCPStore client
resolves its peer's address (``getnameinfo``), and a fork while a launcher thread holds glibc's resolver
lock leaves the child waiting on it forever (``healthcheck.run.launcher.ForkGate``).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from healthcheck.errors import ProbeFailed
from healthcheck.run import launcher

pytestmark = pytest.mark.multiprocess

WORLD = 4


def _times() -> tuple[float, int]:
    # CLOCK_MONOTONIC is one clock for every process of the host: the workers' readings compare.
    return time.monotonic(), os.getpid()


def test_no_worker_starts_before_its_last_sibling_was_forked(monkeypatch):
    real_entry = launcher._after_every_fork

    def timed_entry(gate, tempdir, entrypoint, *args):
        # Runs in the worker, before the gate: when this child came to life.
        at_fork = time.monotonic()
        passed, pid = real_entry(gate, tempdir, entrypoint, *args)
        return at_fork, passed, pid

    monkeypatch.setattr(launcher, "_after_every_fork", timed_entry)
    results = launcher.launch_local(_times, WORLD, run_id="test-fork-gate")
    assert sorted(results) == list(range(WORLD))
    forked = [at_fork for at_fork, _, _ in results.values()]
    passed = [after for _, after, _ in results.values()]
    assert len({pid for _, _, pid in results.values()}) == WORLD
    # Without the gate the first worker runs on while the agent still forks the others.
    assert max(forked) <= min(passed), (forked, passed)


def test_a_gate_whose_siblings_never_come_lets_the_worker_go_on():
    gate = launcher.ForkGate(2)
    started = time.monotonic()
    assert gate.wait(timeout_s=0.05) is False
    assert time.monotonic() - started < 5


def _temporary_folder() -> str:
    if os.environ["RANK"] == "1":
        raise RuntimeError("injected")
    return tempfile.gettempdir()


def test_a_launch_leaves_nothing_in_the_temporary_folder(monkeypatch, tmp_path):
    # torch's launcher alone leaves a torchelastic_* log tree per launch, and a pickled traceback per failed worker.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert launcher.launch_local(_temporary_folder, 1, run_id="test-scratch-1") == {0: str(tmp_path)}
    with pytest.raises(ProbeFailed, match="rank 1: RuntimeError: injected"):
        launcher.launch_local(_temporary_folder, 2, run_id="test-scratch-2")
    assert list(tmp_path.iterdir()) == []
    assert tempfile.tempdir == str(tmp_path)  # the launcher's own setting is back

"""The run-queue clock: read where the kernel keeps it, None where it does not (measure/runqueue.py)."""

from __future__ import annotations

import math
import threading

from healthcheck.measure import runqueue


def test_reads_the_second_field_in_seconds(tmp_path, monkeypatch):
    path = tmp_path / "schedstat"
    path.write_text("569657740 476522000 21\n")
    monkeypatch.setattr(runqueue, "_PATH", str(path))
    assert runqueue.read() == (threading.get_ident(), 0.476522)


def test_a_kernel_without_scheduler_statistics_reads_as_no_clock(tmp_path, monkeypatch):
    # Such a kernel prints "0 0 0" for every thread; a 0 wait would silently subtract nothing.
    path = tmp_path / "schedstat"
    path.write_text("0 0 0\n")
    monkeypatch.setattr(runqueue, "_PATH", str(path))
    assert runqueue.read() is None
    monkeypatch.setattr(runqueue, "_PATH", str(tmp_path / "missing"))
    assert runqueue.read() is None


def test_a_missing_clock_matters_only_where_ranks_share_cores():
    assert math.isnan(runqueue.wait_ms(runqueue.waited_between(None, None), cores_shared=True))
    assert math.isnan(runqueue.wait_ms(runqueue.waited_between((1, 2.0), (2, 2.004)), cores_shared=True))  # two threads
    assert runqueue.wait_ms(runqueue.waited_between(None, None), cores_shared=False) == 0.0
    assert abs(runqueue.wait_ms(runqueue.waited_between((1, 2.0), (1, 2.004)), cores_shared=True) - 4.0) < 1e-9


def test_cores_shared_compares_local_ranks_with_usable_cores(monkeypatch):
    monkeypatch.setattr(runqueue.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert not runqueue.cores_shared(2) and runqueue.cores_shared(3)

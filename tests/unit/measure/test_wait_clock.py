"""The wait clock: time spent waiting on the other ranks inside a step, left out of busy_ms (measure/wait_clock.py)."""

from __future__ import annotations

import threading
import time

import pytest

from healthcheck.measure import runqueue, wait_clock
from healthcheck.measure.wait_clock import WaitClock


class _FakeClocks:
    """perf_counter and the run-queue clock, advanced by hand."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.queued = 100.0, 5.0
        monkeypatch.setattr(wait_clock, "perf_counter", lambda: self.now)
        monkeypatch.setattr(runqueue, "read", lambda: (threading.get_ident(), self.queued))


def test_a_span_counts_its_time_less_its_run_queue_wait(monkeypatch):
    clocks = _FakeClocks(monkeypatch)
    clock = WaitClock()
    with clock.span():
        clocks.now += 0.050
        clocks.queued += 0.020  # runnable without a core: the monitor subtracts that for the whole step already
    assert abs(clock.total - 0.030) < 1e-12


def test_nested_spans_count_once(monkeypatch):
    # A collective inside end_step: both are spans, the time is waited once.
    clocks = _FakeClocks(monkeypatch)
    clock = WaitClock()
    with clock.span():
        clocks.now += 0.010
        with clock.span():
            clocks.now += 0.020
        clocks.now += 0.005
    assert abs(clock.total - 0.035) < 1e-12


def test_reset_inside_a_span_counts_only_what_follows(monkeypatch):
    # The release can come while a span is open: the new step counts from it.
    clocks = _FakeClocks(monkeypatch)
    clock = WaitClock()
    with clock.span():
        clocks.now += 0.040
        clock.reset()
        clocks.now += 0.015
    assert abs(clock.total - 0.015) < 1e-12
    clock.reset()
    assert clock.total == 0.0


def test_another_threads_span_is_not_this_steps_wait():
    clock = WaitClock()

    def elsewhere() -> None:
        with clock.span():
            time.sleep(0.02)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert clock.total == 0.0
    with clock.span():
        time.sleep(0.02)
    assert clock.total >= 0.015


def test_without_a_run_queue_clock_the_whole_span_counts(monkeypatch):
    clocks = _FakeClocks(monkeypatch)
    monkeypatch.setattr(runqueue, "read", lambda: None)
    clock = WaitClock()
    with clock.span():
        clocks.now += 0.025
    assert abs(clock.total - 0.025) < 1e-12


def test_on_wall_gets_each_outermost_spans_wall_time_and_any_thread_counts_elsewhere(monkeypatch):
    # The FSDP2 monitor's blame: a collective's wall time, its run-queue wait included, once per outermost span;
    # its own collectives may run on the autograd engine's thread and still count.
    clocks = _FakeClocks(monkeypatch)
    clock, walls = WaitClock(), []
    with clock.span(on_wall=walls.append):
        clocks.now += 0.010
        with clock.span(on_wall=walls.append):  # nested: neither counted nor reported again
            clocks.now += 0.020
        clocks.queued += 0.005
    assert walls == [pytest.approx(0.030)] and abs(clock.total - 0.025) < 1e-12

    def elsewhere() -> None:
        with clock.span(on_wall=walls.append, any_thread=True):
            clocks.now += 0.040

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert walls[1:] == [pytest.approx(0.040)] and abs(clock.total - 0.065) < 1e-12

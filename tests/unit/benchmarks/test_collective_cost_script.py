"""``benchmarks/collective_cost.py``: CPU time is charged to the thread that spent it."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tests.benchmark_scripts import loaded_script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


@pytest.fixture(scope="module")
def cost():
    with loaded_script("collective_cost") as module:
        yield module


def test_a_living_busy_thread_is_charged_at_least_its_cpu_time(cost):
    done = threading.Event()
    spent: list[float] = []

    def spin() -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write("hc_spinner")
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        spent.append(time.thread_time() * 1000)
        done.wait(10)

    worker = threading.Thread(target=spin)
    worker.start()
    while not spent:
        time.sleep(0.01)
    try:
        charged = cost.thread_cpu_ms().get("hc_spinner", 0.0)
    finally:
        done.set()
        worker.join()
    # Clock ticks are 10 ms on most kernels: the thread's 300+ ms show to within two ticks.
    assert charged >= spent[0] - 20
    assert charged <= spent[0] + 20

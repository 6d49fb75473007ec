"""How long the calling thread waited for a CPU: Linux's per-thread run-queue time.

On a host where more ranks than cores share the CPUs (8 CPU ranks on 2 cores in CI), a rank's wall time
between two moments is its own work, its voluntary sleeps and blocking, and the time it sat runnable
while another rank had the core. Only the last one is the host's doing. ``/proc/thread-self/schedstat``
holds three numbers for the calling thread: ns on a CPU, ns waiting on a run queue, time slices. A
6-process test on 2 cores: wall 1781 ms − run-queue 1150 ms = 631 ms = 580 ms of CPU + a 50 ms sleep.

Where it cannot be read (not Linux, a sandbox whose ``/proc`` lacks the file, or a kernel that keeps no
scheduler statistics and prints ``0 0 0``) :func:`read` returns None and nothing is subtracted. On a host
whose ranks share cores that leaves a sleeping rank's delay mostly hidden (the others use the cores it
frees), so :func:`wait_ms` reports the gap as NaN and the stragglers audit says it could not judge.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Optional

_PATH = "/proc/thread-self/schedstat"


def read() -> Optional[tuple[int, float]]:
    """``(thread id, seconds this thread has waited on a run queue)``, or None where not available.

    >>> sample = read()
    >>> sample is None or (sample[0] == threading.get_ident() and sample[1] >= 0)
    True
    """
    try:
        fields = os.pread(_handle(), 128, 0).split()
        on_cpu_ns, queued_ns, slices = int(fields[0]), int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None
    if on_cpu_ns == queued_ns == slices == 0:  # the kernel keeps no statistics: a running thread has had a slice
        return None
    return threading.get_ident(), queued_ns / 1e9


_OPEN = threading.local()


def _handle() -> int:
    """This thread's descriptor of the file, opened once: the monitor reads it per bucket and step, and an
    open and close each time cost ~0.1 ms a step on 8 ranks sharing 2 cores. ``/proc/thread-self`` names the
    thread that opens it, hence one per thread; a re-read from offset 0 gives fresh numbers."""
    closer = getattr(_OPEN, "closer", None)
    if closer is None or closer.path != _PATH:
        # Closed with the thread's locals (or on a new path), so a short-lived thread leaks no descriptor.
        closer = _OPEN.closer = _Closer(_PATH, os.open(_PATH, os.O_RDONLY | os.O_CLOEXEC))
    return closer.fd


class _Closer:
    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def waited_between(start: Optional[tuple[int, float]], end: Optional[tuple[int, float]]) -> Optional[float]:
    """Run-queue seconds from ``start`` to ``end``; None unless both were read, on the same thread.

    >>> waited_between((7, 1.5), (7, 1.75)), waited_between((7, 1.5), (8, 9.0)), waited_between(None, (7, 1.0))
    (0.25, None, None)
    """
    if start is None or end is None or start[0] != end[0]:
        return None
    return max(0.0, end[1] - start[1])


def wait_ms(waited_s: Optional[float], cores_shared: bool) -> float:
    """The run-queue wait subtracted from a rank's busy time, in ms: NaN where it was needed and not read.

    It is needed where the rank's host runs more ranks than it has cores (``cores_shared``); elsewhere a
    missing clock costs nothing and reads 0.

    >>> wait_ms(0.25, cores_shared=True), wait_ms(None, cores_shared=False), math.isnan(wait_ms(None, cores_shared=True))
    (250.0, 0.0, True)
    """
    if waited_s is not None:
        return waited_s * 1000
    return math.nan if cores_shared else 0.0


def cores_shared(local_ranks: int) -> bool:
    """Whether ``local_ranks`` ranks on this host outnumber the cores this process may run on.

    >>> cores_shared(1), cores_shared(10_000)
    (False, True)
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return local_ranks > cores

"""How long the calling thread waited for a CPU: Linux's per-thread run-queue time.

On a host where more ranks than cores share the CPUs (8 CPU ranks on 2 cores in CI), a rank's wall time
between two moments is its own work, its voluntary sleeps and blocking, and the time it sat runnable
while another rank had the core. Only the last one is the host's doing. ``/proc/thread-self/schedstat``
holds three numbers for the calling thread: ns on a CPU, ns waiting on a run queue, time slices. A
6-process test on 2 cores: wall 1781 ms − run-queue 1150 ms = 631 ms = 580 ms of CPU + a 50 ms sleep.

Where it cannot be read (not Linux, or a kernel without scheduler statistics) :func:`read` returns
None and nothing is subtracted.
"""

from __future__ import annotations

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
        with open(_PATH, "rb") as handle:
            fields = handle.read().split()
        return threading.get_ident(), int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def waited_between(start: Optional[tuple[int, float]], end: Optional[tuple[int, float]]) -> float:
    """Run-queue seconds from ``start`` to ``end``; 0 unless both come from the same thread.

    >>> waited_between((7, 1.5), (7, 1.75)), waited_between((7, 1.5), (8, 9.0)), waited_between(None, (7, 1.0))
    (0.25, 0.0, 0.0)
    """
    if start is None or end is None or start[0] != end[0]:
        return 0.0
    return max(0.0, end[1] - start[1])

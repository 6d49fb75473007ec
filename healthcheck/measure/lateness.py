"""Who the others waited for: per-rank lateness from the waits inside a step's blocking collectives.

Under FSDP2 the ranks run in lock-step: every block's all-gather and reduce-scatter blocks until the
last rank arrives. A rank's own work in a step is then split into a dozen short segments, and on a
shared host each segment's length carries its own scheduling noise. Subtracting a rank's summed waits
from its step time (what DDP's one synchronising reduction allows) sums that noise over every
segment: on 8 ranks sharing 2 cores a rank's waits vary by ±40 ms a step, as much as a 50 ms
straggler adds, and a straggler was slower in only 41 of 58 steps.

What stays sharp is *who arrived last*. All ranks leave a blocking collective together, so at
collective k rank i arrived ``wait[i][k]`` before the exit, and the rank with the shortest wait arrived
last. Its *blame* is the margin to the next-shortest wait: the time every other rank spent waiting for
it alone. A rank that does not arrive last gets nothing, so the noise of the ranks in the middle never
accumulates. A straggler is blamed at (nearly) every step; a healthy rank now and then, by a little.
"""

from __future__ import annotations

import statistics
from typing import Sequence


def blame_ms(waits_ms: Sequence[Sequence[float]]) -> list[float]:
    """Per rank, the milliseconds the others waited for it alone, summed over the step's collectives.

    Args:
        waits_ms: ``waits_ms[rank][k]``: the time rank spent inside the step's k-th blocking
            collective (the same collectives, in the same order, on every rank: they are collectives).

    >>> blame_ms([[50.0, 10.0], [12.0, 10.0], [48.0, 3.0]])  # rank 1 was last at the first, rank 2 at the second
    [0.0, 36.0, 7.0]
    >>> blame_ms([[5.0], [5.0]])  # a tie: both arrived together, nobody was waited for
    [0.0, 0.0]
    """
    ranks = len(waits_ms)
    blame = [0.0] * ranks
    if ranks < 2:
        return blame
    for column in zip(*waits_ms, strict=True):
        last = min(range(ranks), key=lambda r: column[r])
        runner_up = min(column[r] for r in range(ranks) if r != last)
        blame[last] += runner_up - column[last]
    return blame


def lockstep_busy_ms(busy_ms: Sequence[float], blame: Sequence[float]) -> list[float]:
    """The step time each rank would need on its own: the ranks' median own work plus its blame.

    The stragglers audit divides each rank's value by the other ranks' median, so a rank that made the
    others wait 40 ms in a step whose own work takes ~170 ms reads 1.24x, as DDP's busy_ms would. On a CPU
    host ``busy_ms`` leaves out the time each rank waited for a core, as under DDP: with it, the same 40 ms
    read 1.04x to 1.11x as the host's load moved the median own work between 370 and 720 ms.

    >>> lockstep_busy_ms([300.0, 320.0, 310.0], [0.0, 0.0, 31.0])
    [310.0, 310.0, 341.0]
    """
    base = statistics.median(busy_ms)
    return [base + b for b in blame]

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


def grouped_blame_ms(waits_ms: Sequence[Sequence[float]], groups: Sequence[Sequence[int]]) -> list[float]:
    """:func:`blame_ms` within each group of ranks a collective spans, summed per rank. Under HSDP an all-gather or
    a reduce-scatter spans one shard group and the replicas' all-reduce one replica group: who arrived last is
    decided among the ranks that waited for each other, not across groups that never met.

    >>> grouped_blame_ms([[50.0], [2.0], [9.0], [10.0]], [[0, 1], [2, 3]])  # rank 1 late in its group, rank 2 in its
    [0.0, 48.0, 1.0, 0.0]
    """
    blame = [0.0] * len(waits_ms)
    for group in groups:
        for rank, value in zip(group, blame_ms([waits_ms[r] for r in group]), strict=True):
            blame[rank] += value
    return blame


def replica_blame_ms(
    replica_waits_ms: Sequence[Sequence[float]], replica_groups: Sequence[Sequence[int]], shard_waits_ms: Sequence[Sequence[float]]
) -> list[float]:
    """HSDP: blame at the replicas' all-reduces, less what each rank had waited for its own shard group. A straggler
    holds up its shard group, which then reaches the all-reduce late as a whole: its group peers arrive late there
    because they waited for it, not for their own work. A shard group slow as a whole (a slow node) waited for
    nobody, so its ranks keep their blame.

    >>> # rank 1 (of shard group [0, 1]) slept 50 ms: rank 0 waited for it, then both were 50 ms late to ranks 2, 3
    >>> replica_blame_ms([[1.0], [0.0], [51.0], [50.0]], [[0, 2], [1, 3]], [[50.0], [0.0], [1.0], [1.0]])
    [0.0, 50.0, 0.0, 0.0]
    >>> replica_blame_ms([[1.0], [0.0], [51.0], [50.0]], [[0, 2], [1, 3]], [[0.5], [0.0], [1.0], [1.0]])  # a slow node
    [49.5, 50.0, 0.0, 0.0]
    """
    raw = grouped_blame_ms(replica_waits_ms, replica_groups)
    return [max(0.0, blame - sum(waited)) for blame, waited in zip(raw, shard_waits_ms, strict=True)]


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

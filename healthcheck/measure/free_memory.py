"""Room on each rank for a buffer the size of the unsharded gradient, asked for before training.

FSDP2's exact mode with a reduce-scatter every micro-batch (``metrics.exact_keep_microbatches``) keeps every rank's
slices of each micro-batch: one unsharded fp32 gradient per rank, 28 GiB for a 7B model. Where that cannot fit, the
first sampled step would end in an out-of-memory error, exit 3, after the job's start-up. The monitor asks every rank
first and refuses the setting (exit 2), naming the rank with the least room.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence


def free_bytes(device: Any) -> Optional[int]:
    """Bytes this rank can still allocate on ``device``: CUDA's free memory; on a CPU, the host's ``MemAvailable``
    shared by the ranks on it (``LOCAL_WORLD_SIZE``); None where it cannot tell (another device, no ``/proc``).

    >>> import torch
    >>> free = free_bytes(torch.device("cpu"))
    >>> free is None or free > 0
    True
    """
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as handle:
            available = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def least_room(needed: int, free: Sequence[Optional[int]]) -> Optional[tuple[int, int]]:
    """``(rank, free bytes)`` of the rank with the least room, where that is less than ``needed``; else None (a rank
    that cannot tell counts as having room).

    >>> least_room(10, [20, 5, None, 7])
    (1, 5)
    >>> least_room(10, [20, None]) is None
    True
    """
    known = [(room, rank) for rank, room in enumerate(free) if room is not None]
    if not known:
        return None
    room, rank = min(known)
    return (rank, room) if room < needed else None


def gib(size: float) -> str:
    """``size`` bytes in GiB, for messages.

    >>> gib(3 * 2**30), gib(2**20)
    ('3.0 GiB', '0.001 GiB')
    """
    value = size / 2**30
    return f"{value:.1f} GiB" if value >= 0.1 else f"{value:.3f} GiB"

"""How ranks are written in every message: ``rank 3``, ``ranks 0-2, 5``, ``0-2,5-7``.

One place, so the audits, the watchdog and the report name ranks the same way.
"""

from __future__ import annotations

from typing import Iterable


def rank_span(ranks: Iterable[int]) -> str:
    """Compact rank list: runs of consecutive ranks become ``a-b``.

    >>> rank_span([0, 1, 2, 5, 7, 6])
    '0-2,5-7'
    """
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = None
    for index, rank in enumerate(ordered):
        if start is None:
            start = rank
        if index + 1 == len(ordered) or ordered[index + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``.

    >>> ranks_phrase([3]), ranks_phrase([0, 1, 2, 5])
    ('rank 3', 'ranks 0-2, 5')
    """
    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {rank_span(ordered).replace(',', ', ')}"

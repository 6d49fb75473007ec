"""What every audit returns, and how audits group and name ranks.

An :class:`AuditOutcome` carries a ``signature``: a seed-independent description of the observed
state (a rank grouping such as ``"seed 0|1-7"``, or ``"disjoint"``). An audit passes when it meets
the ideal expectation, or when the baseline approved exactly that signature (``Baseline.audits``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

from healthcheck.ranks import rank_span, ranks_phrase

__all__ = [
    "AuditOutcome",
    "group_ranks",
    "grouping_text",
    "not_measured",
    "odd_ones_out",
    "partition_signature",
    "rank_span",
    "ranks_phrase",
]


@dataclasses.dataclass(frozen=True)
class AuditOutcome:
    """One audit's result: ideal or not, one sentence naming ranks, and a seed-independent signature."""

    passed: bool
    message: str
    signature: str
    ranks: tuple[int, ...] = ()
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: False when the run left no evidence for this audit (a script that samples its data its own
    #: way): then ``passed`` is True but nothing was checked, and the report says "not measured".
    measured: bool = True

    def to_entry(self) -> dict[str, Any]:
        """The ``result.audits[name]`` record (``details`` keys are flattened in beside the fixed ones)."""
        return {
            **self.details,
            "passed": self.passed,
            "message": self.message,
            "ranks": list(self.ranks),
            "signature": self.signature,
            "measured": self.measured,
        }


def not_measured(why: str) -> AuditOutcome:
    """An audit with no evidence: reported as not measured, never as a silent pass.

    >>> not_measured("no DataLoader batches were seen").message
    'not measured: no DataLoader batches were seen'
    """
    return AuditOutcome(True, f"not measured: {why}", "unmeasured", (), {}, measured=False)


# --------------------------------------------------------------------------- rank grouping


def group_ranks(values: Sequence[Any], same: Optional[Callable[[Any, Any], bool]] = None) -> list[list[int]]:
    """Ranks grouped by equal value: largest group first, ties broken by the lowest rank. ``same(a, b)``
    replaces equality (a tolerance); a rank then joins the first group whose first rank's value it matches.

    >>> group_ranks(["a", "b", "b", "a", "b"])
    [[1, 2, 4], [0, 3]]
    >>> group_ranks([1.0, 1.5, 1.0, 1.50001], same=lambda a, b: abs(a - b) <= 1e-4 * max(a, b))
    [[0, 2], [1, 3]]
    """
    groups: list[list[int]] = []
    if same is None:
        by_value: dict[Hashable, list[int]] = {}
        for rank, value in enumerate(values):
            by_value.setdefault(value, []).append(rank)
        groups = list(by_value.values())
    else:
        for rank, value in enumerate(values):
            match = next((g for g in groups if same(values[g[0]], value)), None)
            if match is None:
                groups.append([rank])
            else:
                match.append(rank)
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def partition_signature(groups: Sequence[Sequence[int]]) -> str:
    """Seed-independent name of a grouping: the groups' rank spans, ordered by lowest rank.

    >>> partition_signature([[1, 2, 3], [0]])
    '0|1-3'
    """
    return "|".join(rank_span(g) for g in sorted(groups, key=min))


def odd_ones_out(groups: Sequence[Sequence[int]]) -> list[int]:
    """Ranks outside a strict majority group; every rank when no group is strictly largest.

    >>> odd_ones_out([[1, 2, 3], [0]]), odd_ones_out([[0], [1]])
    ([0], [0, 1])
    """
    if len(groups) < 2:
        return []
    if len(groups[0]) > len(groups[1]):
        return sorted(r for g in groups[1:] for r in g)
    return sorted(r for g in groups for r in g)


def grouping_text(groups: Sequence[Sequence[int]], value_of, noun: str) -> str:
    """``ranks 1-7 share seed 42; rank 0 has 1041`` (or ``ranks 0-7 each have a different seed``)."""
    if all(len(g) == 1 for g in groups):
        values = ", ".join(str(value_of(g[0])) for g in sorted(groups, key=min))
        return f"ranks {rank_span(r for g in groups for r in g)} each have a different {noun} ({values})"
    parts = []
    for group in groups:
        value = value_of(group[0])
        if len(group) > 1:
            parts.append(f"{ranks_phrase(group)} share {noun} {value}")
        else:
            parts.append(f"{ranks_phrase(group)} has {value}")
    return "; ".join(parts)

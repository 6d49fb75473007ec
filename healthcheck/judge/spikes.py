"""Transient spikes: one rank's loss or gradient norm, at one step, far outside the other ranks and its own past.

A one-step fault (a flipped exponent bit in one rank's loss or gradient) moves one value by orders of
magnitude and is gone a step later, so medians and p95s over the window never see it, and the persistence
tests of :mod:`.rank_outliers` are built to ignore it. This audit looks at single values instead.

The statistic, per metric (``loss``, ``grad_norm``), rank r and sampled step s, on a log scale (both are
positive, and their spread is multiplicative):

* **vs the other ranks**: ``log x[s, r] - median_{j != r} log x[s, j]``. Leaving r out keeps a spike from
  moving its own reference.
* **vs its own recent history**: ``log x[s, r] - median log x[s-10 .. s-1, r]`` (at least 3 earlier
  sampled steps, so steps 0-2 are not tested). This is what tells a spike from a rank that is off all the
  time (a loss scale, a label-mask bug), which :mod:`.rank_outliers` names.

Each residual becomes a robust z: centred on the median, and scaled by 1.4826 x MAD, of the same residual
over every rank and the sampled steps within +-5 of s (about 88 values on 8 ranks, so the scale is stable
and still follows the faster change of the first steps). A value is a spike when both z have the same sign
and both reach the bound.

**The false-alarm bound.** The history test can only remove alarms, so a clean probe's family-wise false-alarm
rate is at most that of the cross-rank test alone: by Bonferroni over the n (metric, rank, step) tests, at most
``max_p`` when each test's two-sided tail is ``max_p / n``. The tail is taken from a Student t with 3 degrees
of freedom (infinite kurtosis; the clean CPU probes' residuals have kurtosis 3.5 to 4.6, about a t with 8),
heavy enough that the error of the estimated scale fits inside it too: on synthetic runs with t-distributed
residuals, 2 in 400 raised an alarm at 3 degrees of freedom, none in 400 at 4 or 5 (with a t4 reference, 6
in 400 did at 4: too close). At the default 60-step, 8-rank probe (n = 912) and ``max_p`` 0.01 the bound is
a robust z of 51.6, a factor of about 10 on the loss and 3000 on the gradient norm mid-run::

    >>> round(spike_bound(912, 0.01), 1)
    51.6

A scale below :data:`SCALE_FLOOR` (ranks that compute the same numbers to rounding) is raised to it, so
differences under 0.1% are never a spike.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Callable, Mapping, Optional, Sequence

from healthcheck.finite import is_finite_number
from healthcheck.judge.audit_outcome import AuditOutcome, rank_span

#: The per-rank columns of steps.jsonl this audit tests.
SPIKE_METRICS = ("loss", "grad_norm")
#: Earlier sampled steps of the same rank that make its "recent history".
HISTORY_STEPS = 10
#: The fewest earlier sampled steps a rank needs before its values are tested.
MIN_HISTORY = 3
#: Sampled steps on either side of s whose residuals set the robust scale at s.
SCALE_WINDOW = 5
#: Smallest robust scale on the log scale (0.1%): ranks equal to rounding do not make every difference a spike.
SCALE_FLOOR = 1e-3
#: 1.4826 x MAD estimates a Gaussian's sigma; for a Student t with 3 degrees of freedom it estimates this
#: many of its scale units (1.4826 x its median absolute value, 0.764892).
_T3_MAD_SCALE = 1.4826 * 0.764892


def t3_two_sided_tail(x: float) -> float:
    """P(|T| >= x) for T ~ Student t with 3 degrees of freedom, in closed form.

    With u = x / sqrt(3) the CDF is 1/2 + (u / (1 + u^2) + atan(u)) / pi, so the two-sided tail is
    (2 / pi) (atan(1/u) - u / (1 + u^2)).

    >>> t3_two_sided_tail(0.0), round(t3_two_sided_tail(0.764892), 4), f"{t3_two_sided_tail(12.924):.3e}"
    (1.0, 0.5, '1.000e-03')
    """
    u = abs(x) / math.sqrt(3)
    if u == 0:
        return 1.0
    return 2 / math.pi * (math.atan(1 / u) - u / (1 + u * u))


def spike_bound(tests: int, max_p: float) -> float:
    """The robust z a spike must reach so that ``tests`` clean two-sided tests raise an alarm with probability <= ``max_p``.

    Bonferroni: each test may have a tail of ``max_p / tests``; the tail is a Student t with 3 degrees of
    freedom in robust-z units (see the module docstring). Solved by bisection on the closed-form tail.

    >>> round(spike_bound(1, 0.05), 2), round(spike_bound(104, 0.01), 1)
    (2.81, 25.0)
    """
    target = max_p / max(tests, 1)
    low, high = 0.0, 1e9
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t3_two_sided_tail(middle) > target else (low, middle)
    return high / _T3_MAD_SCALE


@dataclasses.dataclass(frozen=True)
class Spike:
    """One flagged value: ``metric`` of ``rank`` at ``step`` and its robust z against both references."""

    metric: str
    step: int
    rank: int
    value: float
    z_ranks: float
    z_history: float

    def text(self) -> str:
        """``grad norm 8.6e+09 (robust z 143 vs the other ranks, 150 vs its last 10 steps)``."""
        return (
            f"{self.metric.replace('_', ' ')} {self.value:.2g} (robust z {self.z_ranks:.0f} vs the other ranks, "
            f"{self.z_history:.0f} vs its last {HISTORY_STEPS} steps)"
        )


@dataclasses.dataclass(frozen=True)
class SpikeScan:
    """Every value tested, reduced to what the audit reports: the spikes, the bound and the largest excursion."""

    spikes: tuple[Spike, ...]
    tests: int
    bound: float
    #: The tested value with the largest min(|z_ranks|, |z_history|): the closest a clean run came to an alarm.
    closest: Optional[Spike]
    #: The largest |z_ranks| of any tested value: the statistic the false-alarm bound is about.
    max_z_ranks: float = 0.0


def scan_for_spikes(per_step: Mapping[int, Mapping[str, Sequence[Any]]], max_p: float) -> SpikeScan:
    """Test every (metric, rank, sampled step) with enough history; flag those outside both references.

    >>> steps = {s: {"loss": [3.0 + 0.01 * ((s * 7 + r * 3) % 5) for r in range(4)]} for s in range(12)}
    >>> steps[8]["loss"][2] = 3.0 * 2**32
    >>> scan = scan_for_spikes(steps, 0.01)
    >>> [(s.metric, s.rank, s.step) for s in scan.spikes], scan.tests
    ([('loss', 2, 8)], 36)
    """
    steps = sorted(per_step)
    candidates: list[Spike] = []
    for metric in SPIKE_METRICS:
        logs = [_log_values(per_step[step].get(metric)) for step in steps]
        cross = [_cross_residuals(row) for row in logs]
        history = _history_residuals(logs)
        for index, step in enumerate(steps):
            window = range(max(0, index - SCALE_WINDOW), min(len(steps), index + SCALE_WINDOW + 1))
            tested = [
                (rank, c, h)
                for rank, (c, h) in enumerate(zip(cross[index], history[index], strict=True))
                if c is not None and h is not None
            ]
            if not tested:
                continue
            cross_units = _robust_units([v for i in window for v in cross[i] if v is not None])
            history_units = _robust_units([v for i in window for v in history[i] if v is not None])
            for rank, c, h in tested:
                value = math.exp(logs[index][rank])  # type: ignore[arg-type]
                candidates.append(Spike(metric, step, rank, value, cross_units(c), history_units(h)))
    bound = spike_bound(len(candidates), max_p)
    spikes = tuple(s for s in candidates if min(abs(s.z_ranks), abs(s.z_history)) >= bound and (s.z_ranks > 0) == (s.z_history > 0))
    closest = max(candidates, key=lambda s: min(abs(s.z_ranks), abs(s.z_history)), default=None)
    return SpikeScan(spikes, len(candidates), bound, closest, max((abs(s.z_ranks) for s in candidates), default=0.0))


def spike_audit(per_step: Mapping[int, Mapping[str, Sequence[Any]]], max_p: float) -> AuditOutcome:
    """The ``spikes`` audit: fails naming each rank and step whose loss or gradient norm spiked.

    Args:
        per_step: ``step -> {metric: per-rank values}`` (steps.jsonl's ``loss`` and ``grad_norm``; None or
            non-finite values are skipped: the non-finite audit owns those).
        max_p: Family-wise false-alarm rate of a clean probe (``metrics.spike_max_p``).
    """
    scan = scan_for_spikes(per_step, max_p)
    if scan.tests == 0:
        return AuditOutcome(
            True,
            f"not measured: no rank had {MIN_HISTORY} earlier sampled steps and 2 other ranks to compare with",
            "insufficient",
            (),
            measured=False,
        )
    rule = f"bound: robust z {scan.bound:.3g} for {scan.tests} tested rank-steps at family-wise p <= {max_p:g}"
    details: dict[str, Any] = {"tests": scan.tests, "bound_z": round(scan.bound, 3), "max_p": max_p, "max_z_ranks": scan.max_z_ranks}
    if scan.closest is not None:
        c = scan.closest
        details["closest"] = {"metric": c.metric, "step": c.step, "rank": c.rank, "z_ranks": c.z_ranks, "z_history": c.z_history}
    if not scan.spikes:
        closest = ""
        if scan.closest is not None:
            c = scan.closest
            closest = (
                f": the largest excursion was rank {c.rank}'s {c.metric.replace('_', ' ')} at step {c.step}, robust z "
                f"{c.z_ranks:.2g} vs the other ranks and {c.z_history:.2g} vs its own history"
            )
        return AuditOutcome(True, f"no transient spike{closest} ({rule})", "none", (), details)
    by_place: dict[tuple[int, int], list[Spike]] = {}
    for spike in scan.spikes:
        by_place.setdefault((spike.rank, spike.step), []).append(spike)
    places = sorted(by_place, key=lambda place: (place[1], place[0]))
    parts = [f"rank {rank} at step {step}: " + "; ".join(s.text() for s in by_place[(rank, step)]) for rank, step in places[:4]]
    more = f" and {len(places) - 4} more" if len(places) > 4 else ""
    ranks = sorted({rank for rank, _ in places})
    details["spikes"] = [
        {"metric": s.metric, "step": s.step, "rank": s.rank, "value": s.value, "z_ranks": s.z_ranks, "z_history": s.z_history}
        for s in scan.spikes
    ]
    message = "; ".join(parts) + more + f" ({rule}); a one-step fault on that device: drain it and rerun the probe on the rest"
    return AuditOutcome(False, message, f"spike {rank_span(ranks)}", tuple(ranks), details)


def _log_values(raw: Optional[Sequence[Any]]) -> list[Optional[float]]:
    """Each rank's value on a log scale; None where it is missing, non-finite or not positive."""
    return [math.log(float(v)) if is_finite_number(v) and v > 0 else None for v in raw or ()]


def _cross_residuals(row: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Each rank's distance from the median of the *other* ranks (None with fewer than 2 others).

    >>> _cross_residuals([0.0, 1.0, 2.0, None])
    [-1.5, 0.0, 1.5, None]
    """
    out: list[Optional[float]] = []
    for rank, value in enumerate(row):
        others = [v for j, v in enumerate(row) if j != rank and v is not None]
        out.append(value - statistics.median(others) if value is not None and len(others) >= 2 else None)
    return out


def _history_residuals(logs: Sequence[Sequence[Optional[float]]]) -> list[list[Optional[float]]]:
    """Each value's distance from the median of the same rank's last :data:`HISTORY_STEPS` sampled values.

    >>> _history_residuals([[1.0], [2.0], [3.0], [7.0]])
    [[None], [None], [None], [5.0]]
    """
    out: list[list[Optional[float]]] = []
    for index, row in enumerate(logs):
        residuals: list[Optional[float]] = []
        for rank, value in enumerate(row):
            past = [logs[i][rank] for i in range(max(0, index - HISTORY_STEPS), index) if rank < len(logs[i])]
            finite = [v for v in past if v is not None]
            residuals.append(value - statistics.median(finite) if value is not None and len(finite) >= MIN_HISTORY else None)
        out.append(residuals)
    return out


def _robust_units(pool: Sequence[float]) -> Callable[[float], float]:
    """The robust z of ``pool``: value -> (value - median) / max(1.4826 x MAD, SCALE_FLOOR).

    >>> round(_robust_units([0.0, 1.0, -1.0, 2.0, -2.0])(10.0), 3)
    6.745
    """
    centre = statistics.median(pool)
    scale = max(1.4826 * statistics.median(abs(v - centre) for v in pool), SCALE_FLOOR)
    return lambda value: (value - centre) / scale

"""Envelopes judged on a live run: a window statistic of the last steps' aggregates against [lower, upper].

Unlike :class:`healthcheck.judge.verdict.EnvelopeCheck`, which judges a finished probe's summary, a
:class:`WindowEnvelope` is evaluated step after step on a sliding window by the Trainer callback.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from healthcheck.finite import is_finite_number
from healthcheck.judge.baseline import Baseline, load_baseline
from healthcheck.judge.envelope import METRICS
from healthcheck.measure.metrics import window_summary
from healthcheck.measure.records import aggregate_row


@dataclasses.dataclass(frozen=True)
class WindowEnvelope:
    """One metric's approved range for a window statistic of the live run's per-step values."""

    metric: str
    statistic: str
    lower: float
    upper: float

    def fails(self, window: Sequence[float | None]) -> str | None:
        """A one-line message when the window's statistic is outside ``[lower, upper]``, else None.

        >>> WindowEnvelope("cosine_mean", "median", 0.1, 0.9).fails([0.95, 0.97, 0.99])
        'cosine_mean median 0.97 is above its envelope [0.1, 0.9] over 3 steps'
        >>> WindowEnvelope("cosine_mean", "median", 0.1, 0.9).fails([0.5]) is None
        True
        """
        value = window_summary(window)[self.statistic]
        if value is None:
            return None
        if self.lower <= value <= self.upper:
            return None
        side = "below" if value < self.lower else "above"
        envelope = f"[{self.lower:.4g}, {self.upper:.4g}]"
        return f"{self.metric} {self.statistic} {value:.4g} is {side} its envelope {envelope} over {len(window)} steps"


def window_envelopes(envelopes: Any) -> list[WindowEnvelope]:
    """Normalise the callback's ``envelopes`` argument to window envelopes.

    Accepts a baseline file path (read with :func:`healthcheck.judge.baseline.load_baseline`), a
    :class:`~healthcheck.judge.baseline.Baseline`, or a mapping ``{metric: (lower, upper)}`` judged on
    the median.

    >>> window_envelopes({"loss_std": (0.0, 0.5)})
    [WindowEnvelope(metric='loss_std', statistic='median', lower=0.0, upper=0.5)]
    """
    if envelopes is None:
        return []
    if isinstance(envelopes, (str, Path)):
        envelopes = load_baseline(envelopes)
    if isinstance(envelopes, Baseline):
        return [WindowEnvelope(m, e.statistic, e.lower, e.upper) for m, e in envelopes.envelopes.items()]
    checks = []
    for metric, bounds in envelopes.items():
        if metric not in METRICS or not METRICS[metric].per_step:
            raise ValueError(f"envelopes: unknown metric {metric!r} (known: {', '.join(METRICS)})")
        lower, upper = bounds
        if not lower <= upper:
            raise ValueError(f"envelopes.{metric}: lower {lower} is above upper {upper}")
        checks.append(WindowEnvelope(metric, "median", float(lower), float(upper)))
    return checks


def step_aggregates(metrics) -> dict[str, float]:
    """The per-step values of :data:`healthcheck.judge.envelope.METRICS` (the names baselines use), finite only."""
    row = aggregate_row(0, metrics.to_dict())
    wanted = set(METRICS) | {"mean_grad_norm", "tokens_total"}
    return {name: float(value) for name, value in row.items() if name in wanted and is_finite_number(value)}

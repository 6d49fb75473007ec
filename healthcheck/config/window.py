"""The statistical window a config gives: the sampled steps the envelopes are fitted and judged on.

An empty window fails every envelope as "not recorded", after the whole probe has run; the CLI refuses such a
config before any worker starts instead (exit 2).
"""

from __future__ import annotations

from typing import Any, Optional


def empty_window(config: Any) -> Optional[str]:
    """Why the statistical window holds no sampled step, so that no envelope can be fitted or judged; else None.

    The window is every sampled step (``step % metrics.every == 0``) from ``metrics.warmup_steps`` on.

    >>> from healthcheck.config import ProbeConfig
    >>> empty_window(ProbeConfig(train={"steps": 8}))
    'train.steps 8 ends before metrics.warmup_steps 10, where the statistical window starts'
    >>> empty_window(ProbeConfig(train={"steps": 12}, metrics={"every": 4, "reduction_check_every": 0}))
    'train.steps 12 ends before step 12, the first sampled step (metrics.every 4) of the statistical window'
    >>> empty_window(ProbeConfig(train={"steps": 11})) is None
    True
    """
    steps, start, every = config.train.steps, config.metrics.warmup_steps, config.metrics.every
    first = -(-start // every) * every  # the first sampled step at or after the window's start
    if first < steps:
        return None
    if steps <= start:
        return f"train.steps {steps} ends before metrics.warmup_steps {start}, where the statistical window starts"
    return f"train.steps {steps} ends before step {first}, the first sampled step (metrics.every {every}) of the statistical window"

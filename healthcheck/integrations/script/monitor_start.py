"""The monitor of a script's model, made from the probe's config (script mode's one place that builds it).

A DDP model's monitor is made at the model's first forward, not when DDP wraps it: a script may register its own
comm hook in between (accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` does, right after wrapping),
and DDP holds one. The monitor then reads ``.grad`` and leaves the slot to the script
(:func:`healthcheck.measure.local_grads.gradient_source`), on every rank alike.
"""

from __future__ import annotations

from typing import Any

from healthcheck.config import ProbeConfig
from healthcheck.config.monitor_settings import monitor_settings
from healthcheck.errors import InvalidInput


def make_monitor(config: ProbeConfig, model: Any) -> Any:
    """A :class:`~healthcheck.measure.monitor.WorkerConsistencyMonitor` of ``model`` (DDP or an FSDP2 root), built
    the same on every rank (a collective): the sketch map is seeded from the probe's config.

    Raises:
        InvalidInput: A metrics setting the script's model cannot take (``local_from="grads"`` with
            ``gradient_as_bucket_view``; ``"buckets"`` or exact mode where the script registered its own comm hook).
    """
    from healthcheck.measure.fsdp_internals import is_fsdp_module
    from healthcheck.measure.monitor import WorkerConsistencyMonitor

    try:
        return WorkerConsistencyMonitor(model, **monitor_settings(config, fsdp=is_fsdp_module(model)))
    except ValueError as error:
        raise InvalidInput(f"metrics: {error}") from None

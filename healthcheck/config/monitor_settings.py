"""The monitor's keyword arguments from a probe's config: one mapping for the built-in probe and script mode."""

from __future__ import annotations

from typing import Any

from healthcheck.config.schema import ProbeConfig


def monitor_settings(config: ProbeConfig, *, fsdp: bool) -> dict[str, Any]:
    """Keyword arguments for ``WorkerConsistencyMonitor`` of a DDP model or (``fsdp``) an FSDP2 root.

    The sketch is seeded from the probe's ``train.seed``, never a rank's own (a rank override may change that),
    because its map must be the same on every rank.

    >>> config = ProbeConfig(metrics={"direction": "exact", "exact_keep_microbatches": True})
    >>> monitor_settings(config, fsdp=True)["reduce_scatter_every_microbatch"]
    True
    >>> "reduce_scatter_every_microbatch" in monitor_settings(config, fsdp=False)
    False
    """
    metrics = config.metrics
    settings: dict[str, Any] = dict(
        direction=metrics.direction,
        sketch_dim=metrics.sketch_dim,
        every=metrics.every,
        seed=config.train.seed,
        reduction_every=metrics.reduction_check_every,
        local_from=metrics.local_from,
    )
    if fsdp:
        settings["reduce_scatter_every_microbatch"] = metrics.exact_keep_microbatches
    return settings

"""healthcheck: catch silent worker-level inconsistency in data-parallel fine-tuning before launch.

The library API is the monitor; importing the package does not import torch until it is used::

    from healthcheck import WorkerConsistencyMonitor
"""

from __future__ import annotations

from typing import Any

from healthcheck.version import __version__

__all__ = ["WorkerConsistencyMonitor", "StepMetrics", "record_loss", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `healthcheck config show` must not pay for importing torch.
    if name == "WorkerConsistencyMonitor":
        from healthcheck.measure.monitor import WorkerConsistencyMonitor

        return WorkerConsistencyMonitor
    if name == "record_loss":
        from healthcheck.integrations.loss_capture import record_loss

        return record_loss
    if name == "StepMetrics":
        from healthcheck.measure.metrics import StepMetrics

        return StepMetrics
    raise AttributeError(f"module 'healthcheck' has no attribute {name!r}")

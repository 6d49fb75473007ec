"""healthcheck: catch silent worker-level inconsistency in data-parallel fine-tuning before launch.

The library API is the monitor; importing the package does not import torch until it is used::

    from healthcheck import WorkerConsistencyMonitor
"""

__version__ = "0.1.0"

__all__ = ["WorkerConsistencyMonitor", "StepMetrics", "__version__"]


def __getattr__(name: str):
    # Lazy: `healthcheck config show` must not pay for importing torch.
    if name == "WorkerConsistencyMonitor":
        from healthcheck.monitor import WorkerConsistencyMonitor

        return WorkerConsistencyMonitor
    if name == "StepMetrics":
        from healthcheck.metrics import StepMetrics

        return StepMetrics
    raise AttributeError(f"module 'healthcheck' has no attribute {name!r}")

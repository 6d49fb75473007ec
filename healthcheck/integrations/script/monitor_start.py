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

#: Compiled autograd's DDP (``torch._dynamo.config.optimize_ddp = "python_reducer"``, set before the model is wrapped):
#: it all-reduces each parameter's gradient as soon as the backward accumulates it and hands a communication hook one
#: parameter at a time, with no bucket; no rank's own gradient is left to read. It crashed inside the monitor (exit 3).
PYTHON_REDUCER = (
    "the script reduces its gradients with DDP's Python reducer (torch._dynamo.config.optimize_ddp = \"python_reducer\", "
    "which compiled autograd needs): it all-reduces each parameter's gradient as the backward accumulates it, so no "
    "rank's own gradient is left to measure; probe the script with compiled autograd off and optimize_ddp at its "
    "default (DDP's C++ reducer), which trains the same model"
)


def make_monitor(config: ProbeConfig, model: Any) -> Any:
    """A :class:`~healthcheck.measure.monitor.WorkerConsistencyMonitor` of ``model`` (DDP or an FSDP2 root), built
    the same on every rank (a collective): the sketch map is seeded from the probe's config.

    Raises:
        InvalidInput: A metrics setting the script's model cannot take (``local_from="grads"`` with
            ``gradient_as_bucket_view``; ``"buckets"`` or exact mode where the script registered its own comm hook),
            or a DDP that reduces with torch's Python reducer (:data:`PYTHON_REDUCER`).
    """
    from healthcheck.measure.fsdp_internals import is_fsdp_module
    from healthcheck.measure.monitor import WorkerConsistencyMonitor

    if getattr(model, "_use_python_reducer", False):  # private DDP state; a torch without it has no such reducer
        raise InvalidInput(PYTHON_REDUCER)
    try:
        return WorkerConsistencyMonitor(model, **monitor_settings(config, fsdp=is_fsdp_module(model)))
    except ValueError as error:
        raise InvalidInput(f"metrics: {error}") from None

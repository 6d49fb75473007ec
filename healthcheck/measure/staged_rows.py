"""A step's gathered rows on an accelerator, copied to pinned host memory behind the gather on a side stream.

Why: with ``overlap`` a step's rows are read at the next ``end_step``. Read there with ``.cpu()``, the copy queues on
the current stream behind everything queued since, which by then is the next step's whole backward: the host waits
for the device to drain it, and the device then idles while the host computes the metrics and starts the optimizer.
Copied on a stream of its own, right after the all-gather, the rows are on the host long before they are read, and
reading them waits for nothing else (README, Measured figures).

The copy is ordered after the collective by the collective's own ``wait()``, called with the side stream current
(NCCL then makes that stream wait for it, not the compute stream). A collective that never finishes (a peer died)
leaves :meth:`Staged.ready` False, so a failure path's bounded wait (``step_gather.finished_within``) still returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_STREAMS: dict[Any, Any] = {}  # one side stream per device


@dataclasses.dataclass
class Staged:
    """The rows' host copy and the event that marks it done."""

    host: Any
    event: Any

    def ready(self) -> bool:
        return bool(self.event.query())

    def rows(self) -> Any:
        """The host rows, once the copy is done (waits for it, and only for it)."""
        self.event.synchronize()
        return self.host


def stage(work: Any, rows: Any) -> Staged | None:
    """Queue the copy of ``rows`` (an asynchronous gather's output, complete once ``work`` is) to pinned host memory;
    None where the rows are not on a CUDA device (the caller reads them as before)."""
    import torch

    if rows.device.type != "cuda":
        return None
    stream = _STREAMS.get(rows.device)
    if stream is None:
        stream = _STREAMS[rows.device] = torch.cuda.Stream(rows.device)
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    event = torch.cuda.Event()
    with torch.cuda.stream(stream):
        work.wait()  # this stream waits for the collective
        host.copy_(rows, non_blocking=True)
        event.record(stream)
    rows.record_stream(stream)  # the allocator must not hand the rows' memory out before the copy ran
    return Staged(host=host, event=event)

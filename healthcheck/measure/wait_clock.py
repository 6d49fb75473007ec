"""Time a rank spends waiting on the others inside a DDP step, so that busy_ms can leave it out.

busy_ms (the stragglers audit's step time) runs from the end of the previous reduction, a moment every rank
shares, to this rank's last gradient bucket. Inside that span a rank can still block on the others:
DDP's forward broadcasts the model's buffers from rank 0 (any model with a registered buffer, e.g. a rotary
embedding's ``inv_freq``), the training script may all-reduce a loss to log it, and the monitor's own
``end_step`` waits for the previous step's gather. A rank that is slow *after* its backward (clipping, logging,
saving) reaches those collectives late, and the time lands in the busy_ms of whichever rank waited for it. On
4 gloo ranks, a rank that slept 60 ms after backward got rank 1 named the straggler: gloo's broadcast made rank 1
alone wait for it in the next forward (1.59x, slower in 28/28 steps).

A :class:`WaitClock` adds up such spans; the monitor subtracts the total. A span's run-queue time (the thread
runnable but without a core, :mod:`healthcheck.measure.runqueue`) is not added: the monitor subtracts that for
the whole step already. Nested spans (a collective inside ``end_step``) count once, and only spans on the
thread that made the clock count: a collective another thread runs does not hold up this rank's step. The FSDP2
monitor uses the same clock; its own collectives count on any thread, and it reads each span's wall time for blame.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from time import perf_counter
from typing import Any, Callable, ContextManager, Iterator, Optional

from healthcheck.measure import runqueue


class WaitClock:
    """Seconds spent inside :meth:`span` since the last :meth:`reset`, run-queue waits excluded.

    >>> import time
    >>> clock = WaitClock()
    >>> with clock.span():
    ...     with clock.span():  # nested: counted once
    ...         time.sleep(0.02)
    >>> 0.015 < clock.total < 1.0
    True
    >>> clock.reset(); clock.total
    0.0
    """

    def __init__(self) -> None:
        self.total = 0.0
        self._owner = threading.get_ident()
        self._depth = 0
        self._started = 0.0
        self._queued: Optional[tuple[int, float]] = None

    @contextlib.contextmanager
    def span(self, on_wall: Optional[Callable[[float], None]] = None, any_thread: bool = False) -> Iterator[None]:
        """Count the enclosed time as waiting (on the clock's own thread; elsewhere it is not this step's).

        ``on_wall`` receives an outermost span's wall seconds, run-queue time included (the FSDP2 monitor's
        blame: who arrived last); ``any_thread`` counts a span on any thread (FSDP2's collectives, which the
        autograd engine's thread may run)."""
        if not any_thread and threading.get_ident() != self._owner:
            yield
            return
        outermost = self._depth == 0
        if outermost:
            self._started, self._queued = perf_counter(), runqueue.read()
        began = self._started
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if outermost:
                queued = runqueue.waited_between(self._queued, runqueue.read()) or 0.0
                now = perf_counter()
                self.total += max(0.0, now - self._started - queued)
                if on_wall is not None:
                    on_wall(now - began)

    def reset(self) -> None:
        """Start a new step's count (a span still open counts from now on)."""
        self.total = 0.0
        if self._depth:
            self._started, self._queued = perf_counter(), runqueue.read()


def counted_as_waiting(method: Callable[..., Any], span: Callable[[], ContextManager[None]]) -> Callable[..., Any]:
    """``method`` with every call inside ``span()``: a blocking collective (DDP's buffer broadcast, a script's
    ``torch.distributed`` call) whose time is waiting on the others.

    >>> import time
    >>> clock = WaitClock()
    >>> counted_as_waiting(time.sleep, clock.span)(0.02)
    >>> clock.total > 0.015
    True
    """
    @functools.wraps(method)
    def waited(*args: Any, **kwargs: Any) -> Any:
        with span():
            return method(*args, **kwargs)

    return waited

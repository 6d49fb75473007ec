"""This rank's share of ‖ḡ‖², the all-reduced gradient's squared norm, and the hook's way to run code after DDP's
reduction of a step ends.

‖ḡ‖² is the same on every rank, so each rank squares its 1/N slice of each all-reduced bucket (:func:`rank_slice`)
and the step's exchange adds the shares up. On the host that is one C call per bucket, right after its all-reduce
(:class:`~healthcheck.measure.bucket_plans.BucketPlans`). On a GPU a per-bucket callback cost the autograd thread a
slice, a norm and a square per bucket, and that thread's host time is what a launch-bound step pays (README, Measured
figures): :class:`DeferredSquares` keeps the buckets instead and squares them all at once after DDP's finalize, with
one ``_foreach_norm``.

Why after DDP's finalize and not in ``end_step``: until then the buckets hold ḡ, but a script may change the
gradients in between (a clip before ``optimizer.step()``, where script mode ends the step), and with
``gradient_as_bucket_view`` the gradients are the buckets.
"""

from __future__ import annotations

from typing import Any, Callable

from healthcheck.measure.eager import eager_partial


def rank_slice(numel: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[lo, hi)`` of a bucket of ``numel`` elements split ``world`` ways (the last may be short or
    empty).

    >>> [rank_slice(10, r, 4) for r in range(4)]
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    >>> rank_slice(2, 3, 4)
    (2, 2)
    """
    width = -(-numel // world)
    return min(rank * width, numel), min((rank + 1) * width, numel)


def after_ddp_finalize(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward's DDP reduction has ended, still inside the backward.

    DDP queues its finalize (which waits for every bucket's all-reduce, and on a GPU makes the current stream wait
    for them) as an autograd final callback when its last bucket is ready, and the engine runs final callbacks in
    order, also those queued while they run. So a callback queued from a comm hook runs before DDP's, and what it
    queues runs after it (also where DDP's first static-graph step runs the hooks from a callback of its own).

    Raises:
        RuntimeError: Not inside a backward (a hook called directly).
    """
    from torch.autograd import Variable

    engine = Variable._execution_engine

    def queue_next() -> None:
        try:
            engine.queue_callback(eager_partial(fn))
        except RuntimeError:  # pragma: no cover - the engine runs callbacks inside its backward
            fn()

    engine.queue_callback(eager_partial(queue_next))


class DeferredSquares:
    """A step's all-reduced buckets on an accelerator, squared together after DDP's finalize.

    :meth:`keep` takes a bucket whose all-reduce was just started (the tensor it reduces in place); :meth:`settle`
    (queued by the first ``keep`` of the step) writes each bucket's share of ‖ḡ‖², ‖slice‖² in fp32, into ``into``.

        >>> import torch
        >>> into = {}
        >>> squares = DeferredSquares(rank=1, world=2, into=into)
        >>> squares.keep(0, torch.arange(4.0))  # a host bucket: the caller squares its share at once
        False
        >>> squares._pending[0] = torch.arange(4.0); squares.settle(); into
        {0: tensor(13.)}
    """

    def __init__(self, *, rank: int, world: int, into: dict[int, Any]):
        self.rank, self.world, self.into = rank, world, into
        self._pending: dict[int, Any] = {}
        self._queued = False

    def keep(self, index: int, reduced: Any) -> bool:
        """Keep bucket ``index`` for :meth:`settle`; False for a host or fp64 bucket (the host squares its share at
        once, in C; fp64 keeps its fp64 norm) or where no callback can be queued: then nothing is kept."""
        if not self.takes(reduced):
            return False
        if not self._queued:
            try:
                after_ddp_finalize(self.settle)
            except RuntimeError:
                return False
            self._queued = True
        self._pending[index] = reduced
        return True

    @staticmethod
    def takes(reduced: Any) -> bool:
        """Whether a bucket is one to defer: on an accelerator, at most fp32 (fp64 keeps its fp64 norm)."""
        return not reduced.is_cpu and reduced.element_size() <= 4

    def settle(self) -> None:
        """Square this rank's slice of every kept bucket (a few launches, whatever the bucket count)."""
        import torch

        self._queued = False
        if not self._pending:
            return
        indices = sorted(self._pending)
        views = []
        for index in indices:
            reduced = self._pending[index]
            lo, hi = rank_slice(reduced.numel(), self.rank, self.world)
            views.append(reduced[lo:hi])
        self._pending.clear()
        norms = torch._foreach_norm(views, 2, dtype=torch.float32)
        self.into.update(zip(indices, torch._foreach_mul(norms, norms), strict=True))

    def clear(self) -> None:
        """Drop what a step kept (a backward that failed before its callbacks ran must not hold the next step's)."""
        self._pending.clear()
        self._queued = False

"""The DDP monitor's one-pass plan per gradient bucket: the host's C pass or the GPU's Triton kernel.

Each sampled step the comm hook reads every bucket once for its sketch and ‖g_i‖² and divides it by the world size
in place (:mod:`.host_pass` on the host, :mod:`.sketch_kernel` on CUDA). What that call needs besides the bucket
(the row table, the signs, the checks) is the same every step, and on both devices the per-call Python around it
was a large part of the hook's cost (README, Measured figures): so it is looked up once per bucket here and kept
while the bucket keeps its size, dtype and device. DDP's rebuild after the first step changes the buckets' sizes: a
plan that no longer takes its bucket is made again.

On a GPU each bucket's kernel adds into its own row of one table (:class:`StepTable`), zeroed once a step by
:meth:`BucketPlans.new_step`, so that a bucket costs the autograd thread one launch and no buffer or sum of its own.
"""

from __future__ import annotations

from typing import Any

from healthcheck.measure import sketch
from healthcheck.measure.host_pass import HostBucket


class BucketPlans:
    """The plan per bucket index, for a sketch of ``k`` and ``seed``.

    A host bucket gets a :class:`~healthcheck.measure.host_pass.HostBucket` where the C pass takes it, a CUDA bucket a
    :class:`~healthcheck.measure.sketch_kernel.DeviceBucket` where the kernel takes it (Triton installed, not switched
    off); any other bucket none, and the monitor's general path sketches it.

        >>> import torch
        >>> plans = BucketPlans(1021, seed=3)
        >>> plans.take(0, torch.zeros(4, device="meta")) is None  # neither a host nor a CUDA bucket
        True
    """

    def __init__(self, k: int, seed: int):
        self.k, self.seed = k, seed
        self._plans: dict[int, Any] = {}
        self._table = StepTable()

    def take(self, index: int, buffer: Any) -> Any:
        """Bucket ``index``'s plan for ``buffer`` (its ``divide_square_sketch(buffer, world)`` returns the sketch and
        ‖buffer‖², as a float on the host and as fp32 partial sums on a GPU), or None."""
        kept = self._plans.get(index)
        if kept is not None and kept.takes(buffer):
            return kept
        kept = self._plan(index, buffer)
        if kept is None:
            self._plans.pop(index, None)
        else:
            self._plans[index] = kept
        return kept

    def _plan(self, index: int, buffer: Any) -> Any:
        kernel = sketch._kernel_for(buffer)  # looks at the device first: a host bucket never imports Triton
        if kernel is not None and buffer.dim() == 1:
            planned = kernel.DeviceBucket(buffer.numel(), buffer.dtype, buffer.device, k=self.k, seed=self.seed, bucket_id=index)
            return _KernelPlan(planned, self._table, k=self.k, seed=self.seed, bucket_id=index)
        return HostBucket.of(buffer, k=self.k, seed=self.seed, bucket_id=index) if buffer.is_cpu else None

    def square_sum(self, index: int, buffer: Any, lo: int, hi: int) -> float | None:
        """:meth:`HostBucket.square_sum` where bucket ``index`` has a host plan that takes ``buffer`` (its all-reduced
        result, in place or carried), else None."""
        kept = self._plans.get(index)
        return kept.square_sum(buffer, lo, hi) if isinstance(kept, HostBucket) and kept.takes(buffer) else None

    def indices(self) -> list[int]:
        """The bucket indices that have a plan, in order."""
        return sorted(self._plans)

    def new_step(self) -> None:
        """The step's results have been taken (packed, in stream order on a GPU): zero the kernels' table."""
        self._table.new_step()

    def clear(self) -> None:
        self._plans.clear()
        self._table = StepTable()


class StepTable:
    """The GPU kernels' output vectors for one step: bucket ``index`` adds into row ``index`` of one fp32 table.

    Why: a vector of its own per bucket was a buffer to allocate and then a sum over it, two operations on the
    autograd thread per bucket (``sketch_kernel``'s docstring has their cost); one ``zero_`` of the table a step
    replaces both. The views handed out stay valid until :meth:`new_step`, and a table that grows leaves them
    pointing into the old one, which they keep alive.

        >>> import torch
        >>> table = StepTable()
        >>> row, sketched, squares = table.row(2, width=5, split=3, device="cpu")
        >>> _ = row.add_(1.0); table.row(2, width=5, split=3, device="cpu")[0].tolist()  # twice in a step: zeroed
        [0.0, 0.0, 0.0, 0.0, 0.0]
        >>> _ = row.add_(1.0); table.new_step(); sketched.tolist(), squares.tolist()
        ([0.0, 0.0, 0.0], [0.0, 0.0])
    """

    def __init__(self) -> None:
        self._table: Any = None
        self._views: dict[int, tuple[Any, Any, Any]] = {}
        self._written: set[int] = set()

    def row(self, index: int, *, width: int, split: int, device: Any) -> tuple[Any, Any, Any]:
        """Row ``index`` (``width`` fp32 on ``device``, zero), and its views ``[:split]`` and ``[split:]``."""
        views = self._views.get(index)
        if views is None or views[0].numel() != width:
            views = self._make(index, width, split, device)
        if index in self._written:
            # A second backward in one step without no_sync (accumulation): the last one counts, as on the host.
            views[0].zero_()
        else:
            self._written.add(index)
        return views

    def _make(self, index: int, width: int, split: int, device: Any) -> tuple[Any, Any, Any]:
        import torch

        table, padded = self._table, width + width % 2  # even: every row may be viewed as float64 (step_gather.pack)
        if table is None or index >= table.shape[0] or table.shape[1] != padded or table.device != torch.device(device):
            rows = max(index + 1, 2 * table.shape[0] if table is not None else 8)
            self._table = table = torch.zeros((rows, padded), dtype=torch.float32, device=device)
            self._views.clear()
        row = table[index, :width]
        views = self._views[index] = (row, row[:split], row[split:])
        return views

    def new_step(self) -> None:
        if self._written:
            self._table.zero_()
            self._written.clear()


class _KernelPlan:
    """A bucket's :class:`~healthcheck.measure.sketch_kernel.DeviceBucket`, and what happens when its kernel fails (a
    GPU or toolchain Triton cannot build for): the torch sketch, ‖x‖² and division, with one warning, as
    ``FoldedSketch.with_sqnorm`` does (:func:`~healthcheck.measure.sketch.kernel_failed`); from then on no plan takes
    a bucket, and the monitor's general path sketches."""

    def __init__(self, planned: Any, table: StepTable, *, k: int, seed: int, bucket_id: int):
        self.planned, self.table, self.k, self.seed, self.bucket_id = planned, table, k, seed, bucket_id

    def takes(self, buffer: Any) -> bool:
        return not sketch._KERNEL_OFF and self.planned.takes(buffer)

    def divide_square_sketch(self, buffer: Any, world: int) -> tuple[Any, Any]:
        planned = self.planned
        try:
            out, sketched, squares = self.table.row(self.bucket_id, width=planned.width, split=planned.p, device=buffer.device)
            planned.add_into(buffer, out, world)
            return sketched, squares
        except Exception as error:  # noqa: BLE001  (the same numbers the slow way)
            sketch.kernel_failed(error)
            sketched, sqnorm = sketch.torch_with_sqnorm(buffer, k=self.k, seed=self.seed, bucket_id=self.bucket_id, divide_by=world)
            return sketched, sqnorm.reshape(1)  # the plan's square sums are 1-D partials

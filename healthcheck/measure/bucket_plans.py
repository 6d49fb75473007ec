"""The DDP monitor's one-pass plan per gradient bucket: the host's C pass or the GPU's Triton kernel.

Each sampled step the comm hook reads every bucket once for its sketch and ‖g_i‖² and divides it by the world size
in place (:mod:`.host_pass` on the host, :mod:`.sketch_kernel` on CUDA). What that call needs besides the bucket
(the row table, the signs, the checks) is the same every step, and on both devices the per-call Python around it
was a large part of the hook's cost (README, Measured figures): so it is looked up once per bucket here and kept
while the bucket keeps its size, dtype and device. DDP's rebuild after the first step changes the buckets' sizes: a
plan that no longer takes its bucket is made again.
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
            return _KernelPlan(planned, k=self.k, seed=self.seed, bucket_id=index)
        return HostBucket.of(buffer, k=self.k, seed=self.seed, bucket_id=index) if buffer.is_cpu else None

    def square_sum(self, index: int, buffer: Any, lo: int, hi: int) -> float | None:
        """:meth:`HostBucket.square_sum` where bucket ``index`` has a host plan that takes ``buffer`` (its all-reduced
        result, in place or carried), else None."""
        kept = self._plans.get(index)
        return kept.square_sum(buffer, lo, hi) if isinstance(kept, HostBucket) and kept.takes(buffer) else None

    def indices(self) -> list[int]:
        """The bucket indices that have a plan, in order."""
        return sorted(self._plans)

    def clear(self) -> None:
        self._plans.clear()


class _KernelPlan:
    """A bucket's :class:`~healthcheck.measure.sketch_kernel.DeviceBucket`, and what happens when its kernel fails (a
    GPU or toolchain Triton cannot build for): the torch sketch, ‖x‖² and division, with one warning, as
    ``FoldedSketch.with_sqnorm`` does (:func:`~healthcheck.measure.sketch.kernel_failed`); from then on no plan takes
    a bucket, and the monitor's general path sketches."""

    def __init__(self, planned: Any, *, k: int, seed: int, bucket_id: int):
        self.planned, self.k, self.seed, self.bucket_id = planned, k, seed, bucket_id

    def takes(self, buffer: Any) -> bool:
        return not sketch._KERNEL_OFF and self.planned.takes(buffer)

    def divide_square_sketch(self, buffer: Any, world: int) -> tuple[Any, Any]:
        try:
            return self.planned.divide_square_sketch(buffer, world)
        except Exception as error:  # noqa: BLE001  (the same numbers the slow way)
            sketch.kernel_failed(error)
            sketched, sqnorm = sketch.torch_with_sqnorm(buffer, k=self.k, seed=self.seed, bucket_id=self.bucket_id, divide_by=world)
            return sketched, sqnorm.reshape(1)  # the plan's square sums are 1-D partials

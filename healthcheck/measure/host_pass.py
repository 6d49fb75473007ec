"""The DDP hook's reads of a host bucket in one pass: the sketch, ‖g_i‖² and the division by the world size.

Why one pass: on a host shared by more ranks than cores, a bucket meets the hook cold (the other ranks'
time slices and the step's activations have evicted it), and each separate read over it (the fold, then
``torch.dot`` for ‖g_i‖², then ``buffer / world``) paid for memory again. Here the bucket is cut into runs of
about :data:`RUN_ELEMENTS` elements, a few hundred KiB that stay in a core's L2, and each run is folded,
squared and divided before the next is read. On the 2-core development host the saving was within the
run-to-run noise (0.55-1.41 of the separate passes' time in four runs: README, Measured figures).

Two executors compute it. Where the package's C extension was built (``pip install`` compiles
``_host_fold.c``; :func:`compiled` says whether it did), one C call reads the bucket once, folds it row by row
from :func:`~healthcheck.measure.sketch_layout.row_table` (the Triton kernel's table), adds the squares in float64
and divides in place: on the development host a 263K-element bucket met cold cost ~560 µs by numpy and ~220 µs
this way, because each of the numpy pass's ~15 calls met the interpreter cold (README, Measured figures). Without
it, or with ``HEALTHCHECK_SKETCH_KERNEL=torch`` (:data:`healthcheck.measure.sketch.KERNEL_SWITCH`, which turns
every compiled sketch off), numpy runs: :func:`healthcheck.measure.sketch.sketch_bucket`'s own host executor with
shorter runs, which hands each run to the norm and the division right after folding it. Either way the division
is IEEE division, so it has ``torch.div(buffer, world)``'s bits, and it may go into ``buffer`` itself (the DDP
monitor divides in place, as DDP's own hook does); ‖g_i‖² adds fp32 squares (C) or fp32 dot products of the
runs (numpy) in float64. The two agree to fp32 rounding (``tests/unit/measure/test_host_pass.py``).

    >>> import torch
    >>> from healthcheck.measure.sketch import sketch_bucket
    >>> x = torch.randn(70_000)
    >>> expected_sketch, expected_target = sketch_bucket(x, k=1021, seed=3, bucket_id=1), x / 4
    >>> exact_sqnorm = float(x.double().square().sum())
    >>> sketch, sqnorm = divide_square_sketch(x, x, world=4, k=1021, seed=3, bucket_id=1)  # in place
    >>> torch.equal(x, expected_target), abs(sqnorm - exact_sqnorm) < 1e-3 * exact_sqnorm
    (True, True)
    >>> bool(torch.allclose(sketch, expected_sketch, rtol=1e-4, atol=1e-4))
    True
"""

from __future__ import annotations

import functools
from typing import Any

try:  # built by ``pip install`` where a C compiler is found (setup.py: optional)
    from healthcheck.measure import _host_fold
except ImportError:  # pragma: no cover - the numpy pass below runs instead
    _host_fold = None  # type: ignore[assignment]

#: Elements per run: a run of the bucket (0.5 MiB in fp32; with a separate target, ~1 MiB together) stays in a
#: core's L2 while it is folded, squared and divided. A run holds at least one whole sketch segment.
RUN_ELEMENTS = 1 << 17


def fuses(buffer: Any) -> bool:
    """Whether :func:`divide_square_sketch` takes ``buffer``: a contiguous fp32/fp64 host tensor (read and divided
    in place; a half-precision bucket keeps the separate passes, which upcast it piece by piece)."""
    import torch

    return buffer.device.type == "cpu" and buffer.dtype in (torch.float32, torch.float64) and buffer.is_contiguous()


def compiled() -> bool:
    """Whether :func:`divide_square_sketch` runs the C pass: the extension was built and not switched off."""
    from healthcheck.measure.sketch import compiled_allowed

    return _host_fold is not None and compiled_allowed()


@functools.lru_cache(maxsize=4096)
def _row_plan(n: int, k: int, seed: int, bucket_id: int) -> tuple[Any, ...]:
    """What the C pass needs besides the bucket, built once per bucket (a DDP bucket asks for it every step):
    the layout, the row table and signs, and the sign table, as numpy arrays."""
    import torch

    from healthcheck.measure.sketch_layout import get_layout, row_table, sign_table

    lay = get_layout(k)
    meta, eps = row_table(n, lay, seed, bucket_id)
    return lay, meta.reshape(-1), eps, sign_table(seed, lay.L, torch.device("cpu")).numpy()


def divide_square_sketch(buffer: Any, target: Any, *, world: int, k: int, seed: int, bucket_id: int) -> tuple[Any, float]:
    """Write ``buffer / world`` into ``target``; return (the bucket's sketch, ``[p]`` fp32; ‖buffer‖² as a float),
    both of ``buffer``'s values before the division.

    Args:
        buffer: The rank's flat bucket (fp32/fp64 on the host: :func:`fuses`).
        target: A tensor like ``buffer`` (same numel and dtype) to receive the division: ``buffer`` itself
            divides in place (each run is divided after it was folded and squared).
        world, k, seed, bucket_id: The divisor, and the sketch's arguments (as :func:`sketch_bucket`'s).
    """
    if compiled():
        return _divide_square_sketch_c(buffer, target, world=world, k=k, seed=seed, bucket_id=bucket_id)
    import numpy as np
    import torch

    from healthcheck.measure.sketch import _sketch_host
    from healthcheck.measure.sketch_layout import get_layout, plan

    lay = get_layout(int(k))
    out = target.reshape(-1).numpy()
    pieces = plan(buffer.numel(), 0, lay, int(seed), int(bucket_id), max(1, RUN_ELEMENTS // lay.L))
    sqnorm = [0.0]

    def square_and_divide(piece: Any, values: Any) -> None:
        sqnorm[0] += float(np.dot(values, values))
        np.divide(values, world, out=out[piece.lo : piece.hi])

    sketch = _sketch_host(buffer.reshape(-1), pieces, lay, seed, visit=square_and_divide)
    return torch.from_numpy(sketch), sqnorm[0]


class HostBucket:
    """One DDP bucket's C pass, planned once: what :func:`divide_square_sketch` looks up and checks on every call.

    Why: DDP hands the hook a bucket of the same size every step, and the per-call work around the C pass (a
    reshape, the plan's lookup, the checks of :func:`fuses`: ~12 µs on an idle core, several times that among 8
    ranks on 2 cores) was a quarter of the pass on the issue-13 harness. :meth:`takes` says whether a step's bucket
    is still one this plan is for; the plan holds no memory of the bucket's.

        >>> import torch
        >>> x = torch.randn(70_000)
        >>> bucket = HostBucket.of(x, k=1021, seed=3, bucket_id=1)
        >>> bucket is None or bucket.takes(x) and not bucket.takes(x[1:])
        True
    """

    def __init__(self, buffer: Any, *, k: int, seed: int, bucket_id: int):
        self.numel, self.dtype = buffer.numel(), buffer.dtype
        self.layout, self.meta, self.eps, self.tau = _row_plan(self.numel, int(k), int(seed), int(bucket_id))

    @classmethod
    def of(cls, buffer: Any, *, k: int, seed: int, bucket_id: int) -> "HostBucket | None":
        """The bucket's plan, or None where the C pass does not take it (not :func:`compiled`; not :func:`fuses`, or
        not one-dimensional, as DDP's buckets are)."""
        if not (compiled() and fuses(buffer) and buffer.dim() == 1):
            return None
        return cls(buffer, k=k, seed=seed, bucket_id=bucket_id)

    def takes(self, buffer: Any) -> bool:
        """Whether ``buffer`` is a bucket this plan is for (same size and dtype; a 1-D contiguous host tensor)."""
        return (
            buffer.numel() == self.numel and buffer.dtype == self.dtype and buffer.is_cpu and buffer.dim() == 1 and buffer.is_contiguous()
        )

    def divide_square_sketch(self, buffer: Any, world: int) -> tuple[Any, float]:
        """:func:`divide_square_sketch` of ``buffer`` in place."""
        import numpy as np
        import torch

        sketch = np.empty(self.layout.p, dtype=np.float32)
        sqnorm = _host_fold.fold(buffer.numpy(), self.tau, self.meta, self.eps, sketch, self.layout.m, float(world))
        return torch.from_numpy(sketch), sqnorm

    @staticmethod
    def square_sum(buffer: Any, lo: int, hi: int) -> float:
        """Σ x² over elements ``[lo, hi)`` of a 1-D contiguous fp32/fp64 host tensor, in float64 (an fp32 square is
        exact there): one C call, where a torch slice and dot cost several dispatches."""
        return _host_fold.square_sum(buffer.numpy(), lo, hi)


def _divide_square_sketch_c(buffer: Any, target: Any, *, world: int, k: int, seed: int, bucket_id: int) -> tuple[Any, float]:
    """:func:`divide_square_sketch` by one call of the C pass (it divides in place, so a separate target is first
    given the bucket's values: a copy only tests and benchmarks ask for)."""
    values = target.reshape(-1)
    if values.data_ptr() != buffer.data_ptr():
        values.copy_(buffer.reshape(-1))
    return HostBucket(values, k=k, seed=seed, bucket_id=bucket_id).divide_square_sketch(values, world)

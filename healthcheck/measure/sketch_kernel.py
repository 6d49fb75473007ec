"""The folded sketch of a bucket and its ‖x‖², then DDP's division of it, from one read, in one Triton kernel (CUDA).

Why: a comm hook runs on the autograd thread, and on a GPU every kernel it launches costs host time there, which
the backward's own launches then wait behind. The torch executor of the sketch
(:func:`healthcheck.measure.sketch._sketch_accelerator`), ``vector_norm`` and ``div_`` launched ~25 kernels a
bucket and read it four times (the fold's signed product is written, then summed). On an H200 with a 0.95B Llama
(one NCCL rank, micro-batch 4 x 1024) the sketch arm cost +32.2% of an 83 ms step that way, +18.5% with this
kernel's first form, and +4.4% to +16.7% with its second, which wrote a ``[rows, p]`` buffer per bucket and summed
it (docs/measurements.md, "GPU, 2026-11-27"). Now a planned bucket costs the launch alone: it adds into its row of a table that is
zeroed once a step (:class:`~healthcheck.measure.bucket_plans.BucketPlans`).

The kernel computes exactly :func:`healthcheck.measure.sketch.sketch_bucket`'s sketch. The plan's pieces are
flattened into rows, one per segment, full or partial (:func:`.sketch_layout.row_table`). Each row is described by
where its segment position 0 lies in the bucket, the positions ``[lo, hi)`` it holds, and its rotation ``r``, all in
int64, plus its sign ``eps``. One program folds ``BLOCK`` bins of one row: ``acc[j] = sum_q tau[q*p + j] *
x[base + q*p + j]``, all m blocks loaded as one ``[m, BLOCK]`` tile, with elements outside ``[lo, hi)`` read as
zero. A partial segment is therefore a masked full one, as on the torch path. It adds ``eps * acc`` to bins
``(j + r) mod p`` of the output vector with relaxed fp32 atomics, and the squares of the elements it reads to one of
the vector's ``NB`` tail slots (one per column of programs, so that no slot takes every program's add): a vector is
``p + NB`` floats, the sketch and ‖x‖²'s pieces. With a divisor, it writes each element back divided (IEEE
division, then round to nearest: the bits of ``div_``); every element belongs to one program, so nothing reads what
another wrote.

Atomics make the order of each bin's additions (one per segment row: ~200 for a 25 MiB bf16 bucket) vary from run to
run, so the sketch varies in its last fp32 bits, ~1e-7 relative: far below the sketch's own error (~2%), and the
replay audit, whose ranks must agree bit for bit, does not use this kernel. What it saves, measured on an H200
(``benchmarks/gpu_bucket_cost.py``, 2026-11-27): the per-bucket output buffer and the sum over its rows, 6 and 12 µs
of host time a bucket when idle, about three times that inside a step, and ~8 µs of GPU time a bucket.

The row table is cached per (bucket size, layout, seed, bucket): 36 bytes per segment of m*p elements (65,488 for
k = 4096), so ~0.55 KB per million parameters (39 MB at 70B), on the device. At most 4096 buckets' tables are kept.

Numerics: the same products (tau is +-1) summed in fp32 in another order than the torch path's, so the two agree
to fp32 rounding (``tests/unit/measure/test_sketch_kernel.py`` runs this kernel in Triton's interpreter on the host
against the host's sketch). ``‖x‖²`` is fp32 partial sums of fp32 squares, as ``vector_norm(dtype=float32)``.

``HEALTHCHECK_SKETCH_KERNEL=torch`` turns it off (:data:`healthcheck.measure.sketch.KERNEL_SWITCH`): the
``sketch-torch`` arm of ``benchmarks/hook_cost.py`` prices it that way.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from healthcheck.measure.sketch_layout import get_layout, row_table

#: Bins per program: a segment row of p = 4093 bins is 32 programs, each loading its m = 16 strided blocks of the row
#: as one [16, 128] tile. Measured on an H200 (``benchmarks/gpu_bucket_cost.py``, a 25 MiB bf16 bucket divided in
#: place): 55 µs a bucket, against 93 µs for 1024 bins read block after block (each block's load then waited for the
#: previous block's store) and 58-78 µs for other tile widths; torch's ``div_`` alone takes 10 µs.
BLOCK = 128
#: Warps per program.
NUM_WARPS = 4
#: The sign table's dtype on the device (fp32: int8 signs were no faster, 72 against 69 µs at 256 bins).
TAU_DTYPE = torch.float32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(x: Any) -> bool:
    """Whether the kernel takes ``x``: a contiguous CUDA tensor (it divides in place) of fp32, bf16 or fp16 (fp64
    keeps its fp64 norm)."""
    return x.is_cuda and x.dtype in _DTYPES and x.is_contiguous()


def _fold_rows(  # noqa: ANN201, N803
    x_ptr, tau_ptr, meta_ptr, eps_ptr, out_ptr, world, P, M: tl.constexpr, MP: tl.constexpr, BLOCK: tl.constexpr, DIVIDE: tl.constexpr  # noqa: ANN001
):
    row = tl.program_id(0)
    jb = tl.program_id(1)
    base = tl.load(meta_ptr + row * 4)  # bucket position of segment position 0 (negative for a head piece)
    lo = tl.load(meta_ptr + row * 4 + 1)
    hi = tl.load(meta_ptr + row * 4 + 2)
    r = tl.load(meta_ptr + row * 4 + 3)
    eps = tl.load(eps_ptr + row)
    j = jb * BLOCK + tl.arange(0, BLOCK)
    inside = j < P
    q = tl.arange(0, MP)  # MP: M rounded up to a power of two
    u = q[:, None] * P + j[None, :]
    ours = (q[:, None] < M) & inside[None, :]
    held = ours & (u >= lo) & (u < hi)
    v = tl.load(x_ptr + base + u, mask=held, other=0.0).to(tl.float32)
    t = tl.load(tau_ptr + u, mask=ours, other=0).to(tl.float32)
    if DIVIDE:  # in place, IEEE division then round to nearest: the bits of torch's buffer.div_(world)
        tl.store(x_ptr + base + u, tl.math.div_rn(v, world).to(x_ptr.dtype.element_ty), mask=held)
    # Relaxed: nothing reads the vector before the kernel ends, so the adds need no ordering among themselves.
    tl.atomic_add(out_ptr + (j + r) % P, tl.sum(v * t, axis=0) * eps, mask=inside, sem="relaxed")
    tl.atomic_add(out_ptr + P + jb, tl.sum(tl.sum(v * v, axis=1), axis=0), sem="relaxed")


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    """The kernel, compiled at its first call. With ``TRITON_INTERPRET=1`` set before Triton is first imported,
    Triton's interpreter runs it instead, on host tensors too: how the tests run it without a GPU."""
    return triton.jit(_fold_rows)


def rows(n: int, lay: Any, seed: int, bucket_id: int, device: str) -> tuple[Any, Any]:
    """:func:`~healthcheck.measure.sketch_layout.row_table` on ``device``."""
    meta, eps = row_table(n, lay, seed, bucket_id)
    return torch.from_numpy(meta).to(device), torch.from_numpy(eps).to(device)


class DeviceBucket:
    """Everything a bucket's kernel call needs besides the bucket, looked up once (a DDP bucket is sketched every
    sampled step, and on a GPU host the per-call Python is the cost: see the module docstring).

    ``divide_square_sketch`` then costs one host operation, the kernel, where the caller hands it a zeroed vector to
    add into (the monitor's table row, :class:`~healthcheck.measure.bucket_plans.BucketPlans`), and two otherwise.
    The plan holds no view of the bucket, so a bucket DDP rebuilds is freed as before.

    Args:
        n: The bucket's element count.
        dtype, device: The bucket's (``usable`` ones).
        k, seed, bucket_id, m, chunk: The sketch's (:func:`~healthcheck.measure.sketch.sketch_bucket`).
    """

    def __init__(
        self, n: int, dtype: Any, device: Any, *, k: int, seed: int, bucket_id: int, m: int | None = None, chunk: int | None = None
    ):
        from healthcheck.measure.sketch_layout import sign_table

        self.n, self.dtype, self.device = n, dtype, torch.device(device)
        self.lay = get_layout(int(k), m, chunk)
        self.meta, self.eps = rows(n, self.lay, int(seed), int(bucket_id), str(self.device))
        self.tau = sign_table(int(seed), self.lay.L, self.device).to(TAU_DTYPE)
        self.block, self.warps, self.mp = BLOCK, NUM_WARPS, triton.next_power_of_2(self.lay.m)
        self.p, self.blocks = self.lay.p, triton.cdiv(self.lay.p, self.block)
        self.width = self.p + self.blocks  #: the output vector: the sketch, then ‖x‖²'s pieces
        self.grid = (self.meta.shape[0], self.blocks)

    def takes(self, x: Any) -> bool:
        """Whether ``x`` is a bucket this plan was made for (size, dtype, device, and a layout the kernel takes)."""
        return x.numel() == self.n and x.dtype == self.dtype and x.device == self.device and x.is_contiguous()

    def add_into(self, x: Any, out: Any, divide_by: int = 1) -> None:
        """Add ``x``'s sketch and ‖x‖²'s pieces, as it was, into ``out`` (fp32, ``width`` elements, on ``x``'s
        device); then, with ``divide_by`` > 1, ``x /= divide_by`` in place. One launch."""
        if self.n == 0:  # no rows: a launch over an empty grid is an error, and nothing is added
            return
        _kernel()[self.grid](
            x, self.tau, self.meta, self.eps, out, float(divide_by), self.p,
            M=self.lay.m, MP=self.mp, BLOCK=self.block, DIVIDE=divide_by != 1, num_warps=self.warps,
        )

    def divide_square_sketch(self, x: Any, divide_by: int = 1) -> tuple[Any, Any]:
        """``(sketch, squares)`` of ``x`` as it was: the fp32 ``[p]`` sketch and ``[NB]`` fp32 partial sums of its
        squares (they add up to ‖x‖²: a caller summing many buckets' adds them in one go), views of one new vector;
        then, with ``divide_by`` > 1, ``x /= divide_by`` in place."""
        out = torch.zeros(self.width, dtype=torch.float32, device=x.device)
        self.add_into(x, out, divide_by)
        return out.split((self.p, self.blocks))


@functools.lru_cache(maxsize=4096)
def _plan(n: int, dtype: Any, device: str, k: int, seed: int, bucket_id: int, m: int | None, chunk: int | None) -> DeviceBucket:
    return DeviceBucket(n, dtype, device, k=k, seed=seed, bucket_id=bucket_id, m=m, chunk=chunk)


def sketch_and_sqnorm(
    x: Any, *, k: int, seed: int, bucket_id: int, divide_by: int = 1, m: int | None = None, chunk: int | None = None
) -> tuple[Any, Any]:
    """``(sketch_bucket(x, k=k, seed=seed, bucket_id=bucket_id, m=m, chunk=chunk), ‖x‖²)``, both fp32 on ``x``'s
    device, of ``x`` as it was; then, with ``divide_by`` > 1, ``x /= divide_by`` in place (DDP's averaging), all
    from one read of ``x``."""
    x = x.view(-1)
    plan = _plan(x.numel(), x.dtype, str(x.device), int(k), int(seed), int(bucket_id), m, chunk)
    sketched, squares = plan.divide_square_sketch(x, divide_by)
    return sketched, squares.sum()

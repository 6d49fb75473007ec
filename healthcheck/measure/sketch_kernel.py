"""The folded sketch of a bucket and its ‖x‖², then DDP's division of it, from one read, in one Triton kernel (CUDA).

Why: a comm hook runs on the autograd thread, and on a GPU every kernel it launches costs host time there, which
the backward's own launches then wait behind. The torch executor of the sketch
(:func:`healthcheck.measure.sketch._sketch_accelerator`), ``vector_norm`` and ``div_`` launched ~25 kernels a
bucket and read it four times (the fold's signed product is written, then summed). On an H200 with a 0.95B Llama
(one NCCL rank, micro-batch 4 x 1024) the sketch arm cost +32.2% of an 83 ms step that way and +18.5% with this
kernel, whose GPU time is a few ms (README, Measured figures). Here a bucket costs three launches: this kernel,
and two sums.

The kernel computes exactly :func:`healthcheck.measure.sketch.sketch_bucket`'s sketch. The plan's pieces are
flattened into rows, one per segment, full or partial (:func:`.sketch_layout.row_table`). Each row is described by where its
segment position 0 lies in the bucket, the positions ``[lo, hi)`` it holds, and its rotation ``r``, all in
int64, plus its sign ``eps``. One program folds ``BLOCK`` bins of one row: ``acc[j] = sum_q tau[q*p + j] *
x[base + q*p + j]``, with elements outside ``[lo, hi)`` read as zero. A partial segment is therefore a masked full
one, as on the torch path. It writes ``eps * acc`` to bins ``(j + r) mod p`` of its own row of a ``[rows, p]``
buffer, and the rows are summed afterwards. Each bin of a row is written once, so no atomics are needed and
the result is the same on every run. The squares of the elements it reads go to one partial per program. With a
divisor, it writes each element back divided (IEEE division, then round to nearest: the bits of ``div_``); every
element belongs to one program, so nothing reads what another wrote.

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

#: Bins per program. A segment row of p = 4093 bins is 4 programs, and each reads m = 16 strided blocks.
BLOCK = 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def usable(x: Any) -> bool:
    """Whether the kernel takes ``x``: a contiguous CUDA tensor (it divides in place) of fp32, bf16 or fp16 (fp64
    keeps its fp64 norm)."""
    return x.is_cuda and x.dtype in _DTYPES and x.is_contiguous()


def _fold_rows(  # noqa: ANN201, N803
    x_ptr, tau_ptr, meta_ptr, eps_ptr, out_ptr, sq_ptr, world, P, NB, M: tl.constexpr, BLOCK: tl.constexpr, DIVIDE: tl.constexpr  # noqa: ANN001
):
    row = tl.program_id(0)
    jb = tl.program_id(1)
    base = tl.load(meta_ptr + row * 4)  # the bucket position of segment position 0 (negative for a head piece)
    lo = tl.load(meta_ptr + row * 4 + 1)
    hi = tl.load(meta_ptr + row * 4 + 2)
    r = tl.load(meta_ptr + row * 4 + 3)
    eps = tl.load(eps_ptr + row)
    j = jb * BLOCK + tl.arange(0, BLOCK)
    inside = j < P
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(M):
        u = q * P + j
        held = inside & (u >= lo) & (u < hi)
        v = tl.load(x_ptr + base + u, mask=held, other=0.0).to(tl.float32)
        t = tl.load(tau_ptr + u, mask=inside, other=0.0)
        acc += v * t
        sq += v * v
        if DIVIDE:  # in place, IEEE division then round to nearest: the bits of torch's buffer.div_(world)
            tl.store(x_ptr + base + u, tl.math.div_rn(v, world).to(x_ptr.dtype.element_ty), mask=held)
    tl.store(out_ptr + row * P + (j + r) % P, acc * eps, mask=inside)
    tl.store(sq_ptr + row * NB + jb, tl.sum(sq, axis=0))


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    """The kernel, compiled at its first call. With ``TRITON_INTERPRET=1`` set before Triton is first imported,
    Triton's interpreter runs it instead, on host tensors too: how the tests run it without a GPU."""
    return triton.jit(_fold_rows)


def rows(n: int, lay: Any, seed: int, bucket_id: int, device: str) -> tuple[Any, Any]:
    """:func:`~healthcheck.measure.sketch_layout.row_table` on ``device``."""
    meta, eps = row_table(n, lay, seed, bucket_id)
    return torch.from_numpy(meta).to(device), torch.from_numpy(eps).to(device)


@functools.lru_cache(maxsize=4096)
def _launch_plan(n: int, k: int, seed: int, bucket_id: int, m: int | None, chunk: int | None, device: str) -> tuple[Any, ...]:
    """Everything a call needs besides the bucket, looked up once per bucket: on a GPU host the per-call Python is
    the cost (see the module docstring)."""
    from healthcheck.measure.sketch_layout import sign_table

    lay = get_layout(k, m, chunk)
    meta, eps = rows(n, lay, seed, bucket_id, device)
    return lay, meta, eps, sign_table(seed, lay.L, torch.device(device)), triton.cdiv(lay.p, BLOCK)


def sketch_and_sqnorm(
    x: Any, *, k: int, seed: int, bucket_id: int, divide_by: int = 1, m: int | None = None, chunk: int | None = None
) -> tuple[Any, Any]:
    """``(sketch_bucket(x, k=k, seed=seed, bucket_id=bucket_id, m=m, chunk=chunk), ‖x‖²)``, both fp32 on ``x``'s
    device, of ``x`` as it was; then, with ``divide_by`` > 1, ``x /= divide_by`` in place (DDP's averaging), all
    from one read of ``x``."""
    x = x.view(-1)
    lay, meta, eps, tau, blocks = _launch_plan(x.numel(), int(k), int(seed), int(bucket_id), m, chunk, str(x.device))
    if x.numel() == 0:  # no rows: a launch over an empty grid is an error
        return torch.zeros(lay.p, dtype=torch.float32, device=x.device), torch.zeros((), dtype=torch.float32, device=x.device)
    out = torch.empty((meta.shape[0], lay.p), dtype=torch.float32, device=x.device)
    partial = torch.empty((meta.shape[0], blocks), dtype=torch.float32, device=x.device)
    _kernel()[(meta.shape[0], blocks)](
        x, tau, meta, eps, out, partial, float(divide_by), lay.p, blocks, M=lay.m, BLOCK=BLOCK, DIVIDE=divide_by != 1
    )
    return out.sum(0), partial.sum()

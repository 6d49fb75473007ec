"""The folded sketch and ‖x‖² of a list of tensors (a model's local gradients) in one Triton launch (CUDA).

Why: on a GPU the comm hook's Python on the autograd thread is what the monitor costs a launch-bound step; a hook
that only averages already cost +1.4% to +18% of a 0.95B Llama step on one H200 (docs/measurements.md, "GPU").
:mod:`.local_grads` therefore reads the local gradients from ``.grad`` once per backward, and this module makes that
one launch: each row of the table is one segment of one tensor (:func:`~.sketch_layout.row_table` with the tensor's
index as its bucket id, so the model's sketch is the sum of its parameters' sketches, the same on every rank), and
names the tensor by its slot in a vector of addresses. The addresses are copied to the device only when they change
(``zero_grad(set_to_none=True)`` makes new gradients each step, often at new addresses), from pinned memory, so the
host never waits for the stream.

The fold is :mod:`.sketch_kernel`'s (same bins, signs and fp32 atomics; no division). A tensor whose address is 0
(a parameter without a gradient) reads as zeros. ‖x‖²'s pieces go to ``SPREAD * NB`` tail slots, the row's slot
group by its index, so a slot takes a few hundred adds even at 70B parameters. Without ``SKETCH`` the kernel adds
only the squares of the rows it is given: :meth:`GradTable.mean_squares` takes this rank's share of ‖ḡ‖² off the
averaged gradients, every row on exactly one rank.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from healthcheck.measure.sketch_kernel import BLOCK, NUM_WARPS, TAU_DTYPE
from healthcheck.measure.sketch_layout import get_layout, row_table, sign_table

#: Row groups for ‖x‖²'s pieces: a row's programs add into slot ``(row % SPREAD) * NB + column``.
SPREAD = 64
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _fold_table(  # noqa: ANN201, N803
    ptrs, tau_ptr, meta_ptr, eps_ptr, out_ptr, P, NB, M: tl.constexpr, MP: tl.constexpr, BLOCK: tl.constexpr,  # noqa: ANN001
    DTYPE: tl.constexpr, SKETCH: tl.constexpr, SPREAD: tl.constexpr,
):
    row = tl.program_id(0)
    jb = tl.program_id(1)
    base = tl.load(meta_ptr + row * 6)
    lo = tl.load(meta_ptr + row * 6 + 1)
    hi = tl.load(meta_ptr + row * 6 + 2)
    r = tl.load(meta_ptr + row * 6 + 3)
    address = tl.load(ptrs + tl.load(meta_ptr + row * 6 + 4))  # this row's tensor; 0: none this step
    slot = tl.load(meta_ptr + row * 6 + 5) % SPREAD
    x_ptr = address.to(tl.pointer_type(DTYPE))
    j = jb * BLOCK + tl.arange(0, BLOCK)
    inside = j < P
    q = tl.arange(0, MP)
    u = q[:, None] * P + j[None, :]
    ours = (q[:, None] < M) & inside[None, :]
    hi = lo + (hi - lo) * (address != 0).to(tl.int64)  # no tensor: the row holds nothing
    held = ours & (u >= lo) & (u < hi)
    v = tl.load(x_ptr + base + u, mask=held, other=0.0).to(tl.float32)
    if SKETCH:
        t = tl.load(tau_ptr + u, mask=ours, other=0).to(tl.float32)
        eps = tl.load(eps_ptr + row)
        tl.atomic_add(out_ptr + (j + r) % P, tl.sum(v * t, axis=0) * eps, mask=inside, sem="relaxed")
        tl.atomic_add(out_ptr + P + slot * NB + jb, tl.sum(tl.sum(v * v, axis=1), axis=0), sem="relaxed")
    else:
        tl.atomic_add(out_ptr + slot * NB + jb, tl.sum(tl.sum(v * v, axis=1), axis=0), sem="relaxed")


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    """Compiled at its first call; Triton's interpreter runs it where ``TRITON_INTERPRET=1`` was set first (tests)."""
    return triton.jit(_fold_table)


def table_rows(numels: list[int], k: int, seed: int) -> tuple[Any, Any]:
    """Every tensor's segment rows, tensor after tensor: int64 ``[rows, 6]`` of (base, lo, hi, r, tensor, row) and
    float32 ``[rows]`` signs, as :func:`~.sketch_layout.row_table` makes them for a bucket of that tensor's size with
    the tensor's index as bucket id.

    >>> meta, eps = table_rows([300, 3], 8, 0)  # p = 7, segments of 112: 3 rows for the first tensor, 1 for the second
    >>> meta[:, 4].tolist(), meta[:, 5].tolist(), len(eps)
    ([0, 0, 0, 1], [0, 1, 2, 3], 4)
    """
    lay = get_layout(int(k), None, None)
    metas, signs = [np.empty((0, 6), dtype=np.int64)], [np.empty(0, dtype=np.float32)]
    for index, n in enumerate(numels):
        meta, eps = row_table(int(n), lay, int(seed), index)
        metas.append(np.concatenate([meta, np.full((len(meta), 2), index, dtype=np.int64)], axis=1))
        signs.append(eps)
    meta = np.concatenate(metas)
    meta[:, 5] = np.arange(len(meta))
    return meta, np.concatenate(signs)


class GradTable:
    """The sketch and ‖x‖² of a fixed list of tensor sizes (a model's parameters, in order), one launch a call.

    Args:
        numels: Each tensor's element count.
        dtype, device: The tensors' (one dtype, a CUDA device; the tests run it on the host in the interpreter).
        k, seed: The sketch's (:func:`~healthcheck.measure.sketch.sketch_bucket`).
        rank, world: Which rows :meth:`mean_squares` reads: those whose index is ``rank`` modulo ``world``.
    """

    def __init__(self, numels: list[int], dtype: Any, device: Any, *, k: int, seed: int, rank: int = 0, world: int = 1):
        self.device, self.dtype = torch.device(device), dtype
        if self.device.type == "cuda" and self.device.index is None:  # as the tensors name it, for _point_at's check
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.lay = get_layout(int(k), None, None)
        self.p, self.blocks = self.lay.p, triton.cdiv(self.lay.p, BLOCK)
        meta, eps = table_rows(numels, k, seed)
        self.meta, self.eps = torch.from_numpy(meta).to(self.device), torch.from_numpy(eps).to(self.device)
        self.mine = torch.from_numpy(np.ascontiguousarray(meta[rank::world])).to(self.device)
        self.tau = sign_table(int(seed), self.lay.L, self.device).to(TAU_DTYPE)
        self.out = torch.zeros(self.p + SPREAD * self.blocks, dtype=torch.float32, device=self.device)
        self.mean_out = torch.zeros(SPREAD * self.blocks, dtype=torch.float32, device=self.device)
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(len(numels), dtype=torch.int64, pin_memory=cuda)
        self._ptrs = self._host.to(self.device) if cuda else self._host
        self._addresses: list[int] = []
        self._copied: Any = None  # the event after the last address copy: the pinned vector is free once it passed
        self.address_changes = 0  #: how often the addresses were copied anew

    def local(self, tensors: list[Any]) -> tuple[Any, Any]:
        """``(sketch, squares)`` of ``tensors`` (None: zeros): the fp32 ``[p]`` sketch and the pieces of ‖x‖², views
        of one kept vector that the next call zeroes in stream order (read them, or copy them, before)."""
        self.out.zero_()
        self._launch(tensors, self.meta, self.out, sketch=True)
        return self.out[: self.p], self.out[self.p :]

    def mean_squares(self, tensors: list[Any]) -> Any:
        """The pieces of this rank's share of ‖x‖² (rows ``rank`` mod ``world``), a kept vector as in :meth:`local`."""
        self.mean_out.zero_()
        self._launch(tensors, self.mine, self.mean_out, sketch=False)
        return self.mean_out

    def _launch(self, tensors: list[Any], meta: Any, out: Any, *, sketch: bool) -> None:
        self._point_at(tensors)
        if meta.shape[0]:
            _kernel()[(meta.shape[0], self.blocks)](
                self._ptrs, self.tau, meta, self.eps, out, self.p, self.blocks,
                M=self.lay.m, MP=triton.next_power_of_2(self.lay.m), BLOCK=BLOCK, DTYPE=_DTYPES[self.dtype],
                SKETCH=sketch, SPREAD=SPREAD, num_warps=NUM_WARPS,
            )

    def _point_at(self, tensors: list[Any]) -> None:
        addresses = [0 if t is None else t.data_ptr() for t in tensors]
        if addresses == self._addresses:
            return
        if any(t is not None and (t.dtype != self.dtype or t.device != self.device or not t.is_contiguous()) for t in tensors):
            raise ValueError(f"GradTable: every tensor must be contiguous {self.dtype} on {self.device}")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy (a step ago) has read the pinned vector: no wait in practice
        self._host.numpy()[:] = addresses
        if self.device.type == "cuda":
            self._ptrs.copy_(self._host, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._addresses = addresses
        self.address_changes += 1

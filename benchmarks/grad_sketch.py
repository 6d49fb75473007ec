"""A design probe for issue 13's GPU target: every local gradient sketched in one launch, with no comm hook.

Why: a Python comm hook that only averages already costs +1.4% to +4.0% of a 0.95B Llama step on one H200
(``hook-only`` in ``hook_cost.py``), so no design that keeps a Python hook per bucket can reach the target of 1%.
What is left (docs/measurements.md, "GPU code, 2026-11-27, late"): DDP keeps its C++ all-reduce, which without
``gradient_as_bucket_view`` writes ``grad / world`` into its buckets and leaves ``.grad`` local until its finalize
copies the average back. An autograd callback queued at the start of the backward runs before that finalize (the
engine runs callbacks in the order queued, and DDP queues its finalize when its last bucket is ready), so it sees
every local gradient, and one kernel over a table of their addresses folds them all: each parameter is a bucket of
the folded sketch (:func:`healthcheck.measure.sketch.sketch_bucket` with ``bucket_id`` its index), which the
ranks share. What this costs the step is the question ``hook_cost.py``'s ``grads-once`` arm answers, on a GPU.

Not the monitor's path (it has no exchange, no reduction check, no exact mode); nothing in ``healthcheck`` imports
it. The kernel is :mod:`healthcheck.measure.sketch_kernel`'s fold without the division, each row also naming its
tensor; ``tests/unit/benchmarks/test_grad_sketch.py`` runs it in Triton's interpreter against the host's sketch.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from healthcheck.measure.sketch_layout import get_layout, row_table, sign_table

BLOCK, NUM_WARPS = 128, 4  # sketch_kernel's, measured there


def _fold_tensors(  # noqa: ANN201, N803
    ptrs, tau_ptr, meta_ptr, eps_ptr, out_ptr, P, M: tl.constexpr, MP: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr  # noqa: ANN001
):
    row = tl.program_id(0)
    jb = tl.program_id(1)
    base = tl.load(meta_ptr + row * 5)
    lo = tl.load(meta_ptr + row * 5 + 1)
    hi = tl.load(meta_ptr + row * 5 + 2)
    r = tl.load(meta_ptr + row * 5 + 3)
    x_ptr = tl.load(ptrs + tl.load(meta_ptr + row * 5 + 4)).to(tl.pointer_type(DTYPE))  # this row's tensor
    eps = tl.load(eps_ptr + row)
    j = jb * BLOCK + tl.arange(0, BLOCK)
    inside = j < P
    q = tl.arange(0, MP)
    u = q[:, None] * P + j[None, :]
    ours = (q[:, None] < M) & inside[None, :]
    held = ours & (u >= lo) & (u < hi)
    v = tl.load(x_ptr + base + u, mask=held, other=0.0).to(tl.float32)
    t = tl.load(tau_ptr + u, mask=ours, other=0).to(tl.float32)
    tl.atomic_add(out_ptr + (j + r) % P, tl.sum(v * t, axis=0) * eps, mask=inside, sem="relaxed")
    tl.atomic_add(out_ptr + P + jb, tl.sum(tl.sum(v * v, axis=1), axis=0), sem="relaxed")


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    return triton.jit(_fold_tensors)


_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class GradSketch:
    """The sketch and ‖g‖² of a fixed list of tensors' shapes (a model's parameters, in order), one launch a call.

    The row table is made once. The tensors' addresses are copied to the device only when they change: with
    ``zero_grad(set_to_none=True)`` the gradients are new tensors every step, usually at the same addresses.
    ``kernel`` (default: on CUDA) picks the kernel; without it each tensor is sketched by the torch path, the same
    numbers, so that the arm also runs in a CPU smoke test (the tests run the kernel on the host in Triton's
    interpreter with ``kernel=True``).
    """

    def __init__(self, numels: list[int], dtype: Any, device: Any, *, k: int = 4096, seed: int = 0, kernel: bool | None = None):
        self.k, self.seed = int(k), int(seed)
        self.kernel = torch.device(device).type == "cuda" if kernel is None else kernel
        self.lay = get_layout(int(k), None, None)
        self.p, self.blocks = self.lay.p, triton.cdiv(self.lay.p, BLOCK)
        self.device, self.dtype = torch.device(device), dtype
        metas, signs = [], []
        for index, n in enumerate(numels):
            meta, eps = row_table(int(n), self.lay, int(seed), index)
            metas.append(np.concatenate([meta, np.full((len(meta), 1), index, dtype=np.int64)], axis=1))
            signs.append(eps)
        self.meta = torch.from_numpy(np.concatenate(metas) if metas else np.empty((0, 5), np.int64)).to(self.device)
        self.eps = torch.from_numpy(np.concatenate(signs) if signs else np.empty(0, np.float32)).to(self.device)
        self.tau = sign_table(int(seed), self.lay.L, self.device)
        self.out = torch.zeros(self.p + self.blocks, dtype=torch.float32, device=self.device)
        self._addresses: tuple[int, ...] = ()
        self._ptrs: Any = None
        self.address_changes = 0  #: how often the table was copied anew (a step that pays it pays a small copy)

    def __call__(self, tensors: list[Any]) -> tuple[Any, Any]:
        """``(sketch, squares)``: fp32 ``[p]`` and the ``[NB]`` pieces of ‖g‖², views of one kept vector that the
        next call overwrites."""
        if not self.kernel:
            from healthcheck.measure.sketch import sketch_bucket

            self.out[: self.p] = sum(sketch_bucket(t, k=self.k, seed=self.seed, bucket_id=i) for i, t in enumerate(tensors))
            self.out[self.p :] = 0.0
            self.out[self.p] = sum(float(t.double().square().sum()) for t in tensors)
            return self.out[: self.p], self.out[self.p :]
        addresses = tuple(t.data_ptr() for t in tensors)
        if addresses != self._addresses:
            host = torch.tensor(addresses, dtype=torch.int64)
            # From pinned memory, so that the copy does not make the host wait for the stream (the backward).
            self._ptrs = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
            self._addresses = addresses
            self.address_changes += 1
        self.out.zero_()
        if self.meta.shape[0]:
            _kernel()[(self.meta.shape[0], self.blocks)](
                self._ptrs, self.tau, self.meta, self.eps, self.out, self.p,
                M=self.lay.m, MP=triton.next_power_of_2(self.lay.m), BLOCK=BLOCK, DTYPE=_DTYPES[self.dtype], num_warps=NUM_WARPS,
            )
        return self.out[: self.p], self.out[self.p :]


class LocalGradients:
    """Sketches a DDP model's local gradients once per synchronising backward, before DDP's finalize averages them.

    Call :meth:`arm` with the step's output (the loss) after the forward: its gradient hook, the first thing the
    backward runs, queues the callback. Requires DDP without ``gradient_as_bucket_view`` (with it, ``.grad`` is the
    bucket that the all-reduce is averaging while the callback reads it).
    """

    def __init__(self, ddp: Any, *, k: int = 4096, seed: int = 0, kernel: bool | None = None):
        if getattr(ddp, "gradient_as_bucket_view", False):
            raise ValueError("LocalGradients needs DDP without gradient_as_bucket_view")
        self.ddp = ddp
        self.params = [p for p in ddp.parameters() if p.requires_grad]
        first = self.params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in self.params):
            raise ValueError("LocalGradients needs every parameter in one dtype on one device (one kernel's pointer type)")
        self.sketch = GradSketch([p.numel() for p in self.params], first.dtype, first.device, k=k, seed=seed, kernel=kernel)
        self.result: tuple[Any, Any] | None = None
        self.mean_sqnorm: Any = None

    def arm(self, output: Any) -> None:
        output.register_hook(self._queue)

    def _queue(self, grad: Any) -> None:
        from torch.autograd import Variable

        if self.ddp.require_backward_grad_sync:  # not a no_sync micro-step: DDP reduces this backward
            Variable._execution_engine.queue_callback(self._sketch_local)

    def _sketch_local(self) -> None:
        from torch.autograd import Variable

        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            self.result = None  # a parameter without a gradient this step: not this probe's case
            return
        self.result = self.sketch(grads)
        # Queued while callbacks run, so after DDP's finalize (queued when its last bucket was ready): the average.
        Variable._execution_engine.queue_callback(self._mean_norm)

    def _mean_norm(self) -> None:
        norms = torch._foreach_norm([p.grad for p in self.params], 2, dtype=torch.float32)
        self.mean_sqnorm = torch.stack(norms).square().sum()

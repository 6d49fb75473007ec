"""Accumulation precision and rounding bounds for the monitor's on-device arithmetic.

Gradients arrive in the bucket's dtype (fp32, or bf16/fp16 for low-precision models). Dot products
and squared norms are accumulated in fp32 (fp64 for fp64 buckets): products of two bf16 values are
exact in fp32, so upcasting in bounded chunks loses nothing and never materialises an fp32 copy of
a whole bucket. The DDP hook's fp32/fp64 host buckets skip these functions: its C pass (:mod:`.host_pass`) adds
‖g_i‖² by fp32 bins into float64, and this rank's slice of ‖ḡ‖² in float64.
"""

from __future__ import annotations

import functools
import math
from typing import Any

#: Elements per fp32 upcast when a bucket is bf16/fp16, (accelerator, host). On the host the 4 MiB
#: temporary stays in cache. On a GPU every chunk costs kernel launches, ~10 µs of host time each on the
#: autograd thread: at 2^20, a 1B-parameter bf16 model's three passes made ~2,800 chunks a step and cost
#: ~130 ms of host time on an H100 (``benchmarks/hook_cost.py --profile``), so a GPU upcasts 16M elements
#: (64 MiB) at a time, a whole 25 MiB DDP bucket in one.
FP32_UPCAST_CHUNK_NUMEL = (2**24, 2**20)


def upcast_chunk_numel(tensor: Any) -> int:
    """Elements upcast at a time for ``tensor``'s device (:data:`FP32_UPCAST_CHUNK_NUMEL`)."""
    return FP32_UPCAST_CHUNK_NUMEL[tensor.device.type == "cpu"]


def accumulation_dtype(tensor: Any) -> Any:
    """fp64 for fp64 tensors, else fp32."""
    import torch

    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def sqnorm_fp32(a: Any) -> Any:
    """‖a‖² of a 1-D tensor, accumulated in fp32 (fp64 for fp64), as a 0-d device tensor (no host sync).

    On the host, :func:`dot_fp32` (its chunks stay in cache). On an accelerator, one reduction that upcasts
    as it reads (``vector_norm`` with ``dtype=``), where upcasting a bf16 bucket to fp32 first writes twice
    its size and reads it back: a third of the memory traffic.

    >>> import torch
    >>> float(sqnorm_fp32(torch.tensor([3.0, 4.0]).bfloat16()))
    25.0
    """
    import torch

    if a.device.type == "cpu":
        return dot_fp32(a, a)
    return torch.linalg.vector_norm(a, dtype=accumulation_dtype(a)).square()


def dot_fp32(a: Any, b: Any) -> Any:
    """⟨a, b⟩ of two 1-D tensors, accumulated in fp32 (fp64 for fp64), as a 0-d device tensor (no host sync).

    bf16/fp16 on an accelerator whose torch has ``mm(..., out_dtype=)``: one GEMM that reads the half-precision
    values and keeps its fp32 accumulator (:func:`half_dot_in_one_gemm`). Elsewhere the values are upcast
    in chunks (:data:`FP32_UPCAST_CHUNK_NUMEL`): ``torch.dot`` of two bf16 tensors would round the result to bf16.

    >>> import torch
    >>> float(dot_fp32(torch.tensor([1.0, 2.0]).bfloat16(), torch.tensor([3.0, 4.0]).bfloat16()))
    11.0
    """
    import torch

    acc_dtype = accumulation_dtype(a)
    if a.dtype == acc_dtype and b.dtype == acc_dtype:
        return torch.dot(a, b)
    # Never on the host, even once torch has the kernel there: the host's numerics (and baselines) stay the chunks'.
    if a.dtype == b.dtype and a.device.type != "cpu" and half_dot_in_one_gemm(a.device.type, a.dtype):
        return torch.mm(a.reshape(1, -1), b.reshape(-1, 1), out_dtype=acc_dtype).reshape(())
    step = upcast_chunk_numel(a)
    partials = [
        torch.dot(a[start : start + step].to(acc_dtype), b[start : start + step].to(acc_dtype)) for start in range(0, a.numel(), step)
    ]
    if not partials:
        return torch.zeros((), dtype=acc_dtype, device=a.device)
    return partials[0] if len(partials) == 1 else torch.stack(partials).sum()


@functools.lru_cache(maxsize=None)
def half_dot_in_one_gemm(device_type: str, dtype: Any) -> bool:
    """Whether this torch computes ``mm(a, b, out_dtype=torch.float32)`` for ``dtype`` on ``device_type``.

    Why: the chunked upcast launches two copies and a dot per chunk and writes fp32 copies twice the bucket's
    size. On an H100, ⟨a, b⟩ of two 268M-element bf16 vectors took 0.85 ms as one such GEMM and 2.68 ms
    upcast in chunks; their relative errors against float64 were 4.7e-7 and 6e-9 (README, Measured figures →
    GPU), both far below what a cosine between ranks resolves. ``out_dtype`` arrived in torch 2.8 and has
    kernels on CUDA only (the CPU raises NotImplementedError), so a two-element product is tried once per
    device type and dtype, and anything it raises means no.

    >>> import torch
    >>> half_dot_in_one_gemm("cpu", torch.bfloat16)
    False
    """
    import torch

    try:
        probe = torch.ones(2, dtype=dtype, device=device_type)
        out = torch.mm(probe.reshape(1, -1), probe.reshape(-1, 1), out_dtype=torch.float32)
    except (TypeError, NotImplementedError, RuntimeError):
        return False
    return out.dtype == torch.float32 and out.shape == (1, 1)


def unit_roundoff(dtype: Any) -> float:
    """Half the machine epsilon of a floating dtype (the largest relative rounding error)."""
    import torch

    return torch.finfo(dtype).eps / 2


def gamma(n: int, u: float) -> float:
    """γ_n = n·u / (1 − n·u): the relative error bound of n chained roundings (Higham, ch. 3).

    >>> gamma(8, 2.0**-24) < 5e-7
    True
    """
    return n * u / (1 - n * u) if n * u < 1 else math.inf


#: fp16's smallest normal number. Below it a value keeps fewer significant bits (gradual underflow), so rounding it
#: is off by up to :data:`FP16_UNDERFLOW` whatever its size, not by a fraction of it.
FP16_SMALLEST_NORMAL = 2.0**-14
#: The most one rounding into fp16's subnormal range is off by: half the subnormal spacing 2⁻²⁴.
FP16_UNDERFLOW = 2.0**-25


def fp16_underflow_floor(world: int, at_risk_sq: float) -> float:
    """The most an fp16 wire's underflow adds to ‖reduced − mean‖₂, beyond its relative rounding.

    With gradual underflow a rounding is fl(x op y) = (x op y)(1 + δ) + η, |δ| ≤ u, |η| ≤ 2⁻²⁵, and an addition
    whose result is subnormal is exact (Higham, §2.1). An fp16 compression hook casts each rank's gradient, divides
    it by N and sums N values: where 0 < |g_i| < N·2⁻¹⁴ the cast adds up to η (then divided by N) and the division up
    to η, which the N − 1 additions carry with a factor up to 1 + γ_{N−1}. With k_e such ranks at element e
    (``at_risk_sq`` = Σ_e k_e²), the element's error gains at most c·k_e, c = (1 + 1/N)(1 + γ_{N−1})η, and the
    L2 norm at most c·sqrt(Σ_e k_e²). Zeros and values from N·2⁻¹⁴ up never round into the subnormal range.

    >>> fp16_underflow_floor(8, 0.0)
    0.0
    >>> round(fp16_underflow_floor(2, 4.0) / FP16_UNDERFLOW, 4)  # one element, both ranks at risk: 2 · 1.5
    3.0015
    """
    return (1 + 1 / world) * (1 + gamma(world - 1, 2.0**-11)) * FP16_UNDERFLOW * math.sqrt(at_risk_sq)

"""Accumulation precision and rounding bounds for the monitor's on-device arithmetic.

Gradients arrive in the bucket's dtype (fp32, or bf16/fp16 for low-precision models). Dot products
and squared norms are accumulated in fp32 (fp64 for fp64 buckets): products of two bf16 values are
exact in fp32, so upcasting in bounded chunks loses nothing and never materialises an fp32 copy of
a whole bucket.
"""

from __future__ import annotations

import math
from typing import Any

#: Elements per fp32 upcast when a bucket is bf16/fp16: bounds the temporary to 4 MiB.
FP32_UPCAST_CHUNK_NUMEL = 2**20


def accumulation_dtype(tensor: Any) -> Any:
    """fp64 for fp64 tensors, else fp32."""
    import torch

    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def dot_fp32(a: Any, b: Any) -> Any:
    """⟨a, b⟩ of two 1-D tensors, accumulated in fp32 (fp64 for fp64), as a 0-d device tensor (no host sync)."""
    import torch

    acc_dtype = accumulation_dtype(a)
    if a.dtype == acc_dtype and b.dtype == acc_dtype:
        return torch.dot(a, b)
    step = FP32_UPCAST_CHUNK_NUMEL
    partials = [
        torch.dot(a[start : start + step].to(acc_dtype), b[start : start + step].to(acc_dtype)) for start in range(0, a.numel(), step)
    ]
    if not partials:
        return torch.zeros((), dtype=acc_dtype, device=a.device)
    return partials[0] if len(partials) == 1 else torch.stack(partials).sum()


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

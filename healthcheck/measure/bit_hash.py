"""Bitwise fingerprints of tensors, computed on their device with no host copy.

Shared by the parameter-equality audit, the FSDP2 full-parameter hash and the replay audit: each needs
"are these bits identical on every rank?" without moving a model to the host.

>>> import torch
>>> x = torch.arange(6, dtype=torch.float32)
>>> int(tensor_bit_hash(x)) == int(tensor_bit_hash(x.clone()))
True
>>> y = x.clone(); y[3] = torch.nextafter(y[3], torch.tensor(10.0))
>>> int(tensor_bit_hash(y)) == int(tensor_bit_hash(x))
False
"""

from __future__ import annotations

from typing import Any, Sequence

#: Elements hashed at a time: bounds the int64 temporaries to a few tens of MiB per tensor.
_HASH_CHUNK_NUMEL = 1 << 22
# Odd multiplier of the golden-ratio hash (2^64 / phi), as a signed int64 so torch accepts it.
_WEIGHT_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)
_WEIGHT_OFFSET = 0x632BE59BD9B4E019


def tensor_bit_hash(tensor: Any) -> Any:
    """A 0-d int64 device tensor that changes with any change to ``tensor``'s bits, computed on its device.

    The bits are read as integers (fp32 as int32, bf16/fp16 as int16, fp64 as int64) and summed with
    odd position-dependent weights, modulo 2^64. Integer sums do not depend on the reduction order, so
    equal tensors give equal hashes on any device; a change in one element always changes the hash
    (an odd weight times a non-zero difference below 2^64 is never 0 mod 2^64).
    """
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        flat = flat.view(width)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _HASH_CHUNK_NUMEL):
        chunk = flat[start : start + _HASH_CHUNK_NUMEL].to(torch.int64)
        # int64 arithmetic wraps on CPU and GPU alike; that wrap-around is the intended modulo 2^64.
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device)
        weights = (weights * _WEIGHT_MULTIPLIER + _WEIGHT_OFFSET) | 1
        total += (chunk * weights).sum()
    return total


def parameter_hashes(parameters: Sequence[Any]) -> Any:
    """One :func:`tensor_bit_hash` per tensor, as a 1-D int64 tensor on the first one's device (an optimizer's state
    mixes devices: AdamW keeps its ``step`` counts on the host beside moments on the GPU)."""
    import torch

    if not parameters:
        return torch.zeros(0, dtype=torch.int64)
    device = parameters[0].device
    return torch.stack([tensor_bit_hash(p).to(device) for p in parameters])

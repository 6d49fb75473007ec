"""A step's vector on the host, by numpy: packing this rank's (:func:`pack`) and reading the gathered rows
(:func:`header_and_gram`), in :mod:`healthcheck.measure.step_gather`'s layout.

Why numpy: every rank packs and reads every step, a few small arrays each time, and on 8 ranks sharing 2
cores a torch op cost 5-10 µs of dispatch where a numpy call costs ~1 (reading 8 rows of a 4093-wide sketch:
355 µs with tensor ops, 173 µs this way, one quiet core). An accelerator's vectors stay tensors on their device.

    >>> import torch
    >>> flat = pack([1.0, 2.0, 3.0], torch.tensor([0.5, -1.0, 2.0]))
    >>> flat.dtype, flat.numel()  # 3 header floats, then 3 fp32 sketch values padded to 2 float64 slots
    (torch.float64, 5)
    >>> header, gram = header_and_gram(torch.stack([flat, flat]), 3, 3)
    >>> header, gram.tolist()
    ([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], [[5.25, 5.25], [5.25, 5.25]])
"""

from __future__ import annotations

from typing import Any


def pack(header: list[float], sketch: Any) -> Any:
    """The float64 vector: the header's floats, then the sketch's fp32 bits (zero-padded to a whole float64)."""
    import numpy as np
    import torch

    if sketch is None:
        return torch.tensor(header, dtype=torch.float64)
    if sketch.dtype != torch.float32:
        sketch = sketch.to(torch.float32)
    bits = sketch.detach().numpy().reshape(-1)  # numpy's reshape: a torch op costs several of its calls here
    flat = np.zeros(len(header) + (bits.size + 1) // 2, dtype=np.float64)
    flat[: len(header)] = header
    flat[len(header) :].view(np.float32)[: bits.size] = bits
    return torch.from_numpy(flat)


def header_and_gram(rows: Any, width: int, dim: int) -> tuple[list[list[float]], Any]:
    """From gathered ``[world, width + ceil(dim / 2)]`` rows: each rank's ``width`` header values, and the
    float64 Gram of the ranks' ``dim``-long sketches (a numpy array: the metrics take it as it is)."""
    import numpy as np

    host = rows.numpy()
    sketches = np.ascontiguousarray(host[:, width:]).view(np.float32)[:, :dim].astype(np.float64)
    return host[:, :width].tolist(), sketches @ sketches.T

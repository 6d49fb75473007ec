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

from healthcheck.measure.exact_pass import GRAM_SLICE_NUMEL  # the host's slice ([1]), as exact mode's chunked pass


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
    host = rows.numpy()
    return host[:, :width].tolist(), fp32_gram(host[:, width:], dim)


def fp32_gram(bits: Any, dim: int) -> Any:
    """The float64 Gram of the ``dim``-long fp32 vectors whose bits fill the rows of ``bits`` (a 2-D float64 numpy
    array, each row contiguous: a view into gathered or shared rows, never copied whole).

    >>> import numpy as np
    >>> rows = np.zeros((2, 2)); rows.view(np.float32)[:, :3] = [[1, 2, 3], [0, 1, 0]]
    >>> fp32_gram(rows, 3).tolist()
    [[14.0, 2.0], [2.0, 1.0]]
    """
    import numpy as np

    world = bits.shape[0]
    vectors = [bits[r].view(np.float32)[:dim] for r in range(world)]
    gram = np.zeros((world, world), dtype=np.float64)
    # Upcast column slices, not the whole block: an exact-mode row is a whole gradient (exact_rows.py), and a
    # slice stays in cache while its products add up. A sketch is one slice.
    columns = max(1, GRAM_SLICE_NUMEL[1] // world)
    block = np.empty((world, min(columns, dim)), dtype=np.float64)
    for first in range(0, dim, columns):
        part = block[:, : min(columns, dim - first)]
        for r, vector in enumerate(vectors):
            part[r] = vector[first : first + columns]
        gram += part @ part.T
    return gram

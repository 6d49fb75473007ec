"""The count sketch of a gradient bucket: k floats whose inner products estimate the gradients'.

Each element goes to one of k bins with a random sign (seeded identically on all ranks from the
seed and the bucket index), so the sketch is a random linear map S with E⟨Sx, Sy⟩ = ⟨x, y⟩ and
Var⟨Sx, Sy⟩ ≤ (‖x‖²‖y‖² + ⟨x, y⟩²)/k. Normalised by the sketch's own norms, the cosine error has
std ≲ sqrt(2/k). It caches an int32 bin index per gradient element (4 bytes per parameter), built
once per bucket layout.
"""

from __future__ import annotations

from typing import Any

from healthcheck.measure.precision import FP32_UPCAST_CHUNK_NUMEL, accumulation_dtype


class CountSketch:
    """Per-bucket count sketches of width ``k``, identical on every rank for the same ``seed``."""

    def __init__(self, k: int, seed: int):
        self.k = k
        self.seed = seed
        # bucket index -> (numel, device, int32 bins in [0, 2k)); numel is checked because DDP
        # rebuilds its buckets after the first iteration and reuses the indices.
        self._bins: dict[int, tuple[int, Any, Any]] = {}

    def __call__(self, index: int, buffer: Any) -> Any:
        """The k-float sketch of one flat bucket (accumulated in fp32, fp64 for fp64)."""
        import torch

        bins = self._bins_for(index, buffer.numel(), buffer.device)
        acc_dtype = accumulation_dtype(buffer)
        counts = torch.zeros(2 * self.k, dtype=acc_dtype, device=buffer.device)
        for start in range(0, buffer.numel(), FP32_UPCAST_CHUNK_NUMEL):
            stop = start + FP32_UPCAST_CHUNK_NUMEL
            counts.index_add_(0, bins[start:stop], buffer[start:stop].to(acc_dtype))
        # Bins [k, 2k) carry the negative sign: one random draw gives position and sign.
        return counts[: self.k] - counts[self.k :]

    def _bins_for(self, index: int, numel: int, device: Any) -> Any:
        import torch

        cached = self._bins.get(index)
        if cached is not None and cached[0] == numel and cached[1] == device:
            return cached[2]
        # A CPU generator gives the same draw on every rank whatever the device; buckets are
        # identical across ranks, so (seed, index) names the same random map everywhere.
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        bins = torch.randint(0, 2 * self.k, (numel,), generator=generator, dtype=torch.int32).to(device)
        self._bins[index] = (numel, device, bins)
        return bins

    def clear(self) -> None:
        self._bins.clear()

"""Cost of sketching one gradient bucket, in ns per element: the count sketch that was replaced vs the folded sketch.

``before`` is the count sketch healthcheck shipped until issue 13, copied here verbatim in
spirit: an int32 bin index per gradient element drawn once per bucket layout and cached
(4 bytes of state per parameter), then ``index_add_`` of every element into 2k bins.
``before-cold`` is the same sketch when its cache misses (DDP's bucket rebuild, or a model too
big to cache 4 bytes per parameter), i.e. drawing the bins again. ``after`` is
:class:`healthcheck.measure.sketch.FoldedSketch`: no per-element state, a multiply-add per fold
row with a one-segment sign table, and one add per segment.

Every figure is the median of ``--repeats`` timed calls after one warm-up, on one CPU thread
(``torch.set_num_threads(1)``, as a monitored rank on an oversubscribed host gets), fp32
buckets of the sizes given. ``cold`` columns write a 64 MiB buffer before each call, as a training
step's activations do between two hooks, so the caches hold neither the bucket nor any table: the
case a comm hook meets. Columns: ns per element, and the per-parameter state each keeps.

    python benchmarks/sketch_cost.py --sizes 1000000 6553600 --k 4096 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable


class CountSketchBefore:
    """The replaced sketch: cached int32 bins per element, index_add_ into 2k bins."""

    def __init__(self, k: int, seed: int):
        self.k, self.seed = k, seed
        self._bins: dict[int, Any] = {}

    def bins(self, index: int, numel: int) -> Any:
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, 2 * self.k, (numel,), generator=generator, dtype=torch.int32)

    def __call__(self, index: int, buffer: Any, cached: bool = True) -> Any:
        import torch

        bins = self._bins.get(index) if cached else None
        if bins is None or bins.numel() != buffer.numel():
            bins = self.bins(index, buffer.numel())
            if cached:
                self._bins[index] = bins
        counts = torch.zeros(2 * self.k, dtype=torch.float32)
        counts.index_add_(0, bins, buffer)
        return counts[: self.k] - counts[self.k :]


def _median_ns_per_element(fn: Callable[[], Any], numel: int, repeats: int, evict: Any = None) -> float:
    fn()  # warm-up: caches, sign table, allocator
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.add_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e9 / numel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 6_553_600])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from healthcheck.measure.sketch import FoldedSketch, get_layout

    torch.set_num_threads(args.threads)
    before = CountSketchBefore(args.k, seed=0)
    after = FoldedSketch(args.k, seed=0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), k={args.k} (folded sketch uses p={after.dim})")
    table_kib = 4 * get_layout(after.dim).L / 1024  # one segment of m*p entries
    evict = torch.zeros(16 << 20)  # 64 MiB, twice the largest last-level cache this runs on
    print("| bucket elements | before ns/elem | before, bins drawn again | before, cold caches | after ns/elem "
          "| after, cold caches | after/before (warm, cold) | state before | state after |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for numel in args.sizes:
        buffer = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        warm = _median_ns_per_element(lambda b=buffer: before(0, b), numel, args.repeats)
        drawn = _median_ns_per_element(lambda b=buffer: before(1, b, cached=False), numel, args.repeats)
        cold = _median_ns_per_element(lambda b=buffer: before(0, b), numel, args.repeats, evict)
        folded = _median_ns_per_element(lambda b=buffer: after(0, b), numel, args.repeats)
        folded_cold = _median_ns_per_element(lambda b=buffer: after(0, b), numel, args.repeats, evict)
        print(f"| {numel:,} | {warm:.2f} | {drawn:.2f} | {cold:.2f} | {folded:.2f} | {folded_cold:.2f} | "
              f"{folded / warm:.2f}, {folded_cold / cold:.2f} | {4 * numel / 2**20:.1f} MiB | "
              f"0 ({table_kib:.0f} KiB sign table, any model) |")


if __name__ == "__main__":
    main()

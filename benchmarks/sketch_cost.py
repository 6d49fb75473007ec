"""Cost of sketching one gradient bucket, in ns per element: the count sketch that was replaced vs the folded sketch.

``before`` is the count sketch healthcheck shipped until issue 13, copied here verbatim in
spirit: an int32 bin index per gradient element drawn once per bucket layout and cached
(4 bytes of state per parameter), then ``index_add_`` of every element into 2k bins.
``before-cold`` is the same sketch when its cache misses (DDP's bucket rebuild, or a model too
big to cache 4 bytes per parameter), i.e. drawing the bins again. ``after`` is
:class:`healthcheck.measure.sketch.FoldedSketch`: no per-element state, a multiply-add per fold
row with a one-segment sign table, and one add per segment.

Every figure is the median of ``--repeats`` timed calls after one warm-up, on one CPU thread
(``torch.set_num_threads(1)``, as a monitored rank on an oversubscribed host gets), buckets of the
sizes and ``--dtype`` given (fp32 by default). ``cold`` columns write a buffer twice the last-level
cache before each call (64 MiB on the host, 256 MiB on a GPU), as a training step's activations do
between two hooks, so the caches hold neither the bucket nor any table: the case a comm hook meets.
Columns: ns per element, and the per-parameter state each keeps.

With ``--device cuda`` both sketches run on the GPU (the device is synchronised around each call), and
a last line compares the GPU's folded sketch of each bucket with the host's: the sketch must not depend
on the device type, since ranks on different devices compare sketches.

On the host in fp32 a second table prices the DDP hook's three reads of a bucket (sketch mode): ``buffer / world``
into the all-reduce target, ‖g‖² and the sketch, as three passes (torch's division and dot, the sketch) and as
the one pass the hook makes (:func:`healthcheck.measure.host_pass.divide_square_sketch`), by numpy and by the
C extension (``_host_fold.c``, where it was built), in ns per element.

    python benchmarks/sketch_cost.py --sizes 1000000 6553600 --k 4096 --repeats 7
    python benchmarks/sketch_cost.py --device cuda --dtype bf16 --sizes 6553600 104857600 1073741824
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable


class CountSketchBefore:
    """The replaced sketch: cached int32 bins per element, index_add_ into 2k bins."""

    def __init__(self, k: int, seed: int, device: str = "cpu"):
        self.k, self.seed, self.device = k, seed, device
        self._bins: dict[int, Any] = {}

    def bins(self, index: int, numel: int) -> Any:
        import torch

        generator = torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, 2 * self.k, (numel,), generator=generator, dtype=torch.int32, device=self.device)

    def __call__(self, index: int, buffer: Any, cached: bool = True) -> Any:
        import torch

        bins = self._bins.get(index) if cached else None
        if bins is None or bins.numel() != buffer.numel():
            bins = self.bins(index, buffer.numel())
            if cached:
                self._bins[index] = bins
        counts = torch.zeros(2 * self.k, dtype=torch.float32, device=self.device)
        counts.index_add_(0, bins, buffer.float())  # index_add_ needs one dtype: bf16 is upcast first
        return counts[: self.k] - counts[self.k :]


def _median_ns_per_element(
    fn: Callable[[], Any], numel: int, repeats: int, evict: Any = None, sync: Callable[[], None] = lambda: None
) -> float:
    fn()  # warm-up: caches, sign table, allocator
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.add_(1.0)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e9 / numel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 6_553_600])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()

    import torch

    from healthcheck.measure.sketch import FoldedSketch, get_layout

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    before = CountSketchBefore(args.k, seed=0, device=args.device)
    after = FoldedSketch(args.k, seed=0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    where = torch.cuda.get_device_name() if cuda else f"{args.threads} CPU thread(s)"
    print(f"torch {torch.__version__}, {where}, {args.dtype}, k={args.k} (folded sketch uses p={after.dim})")
    table_kib = 4 * get_layout(after.dim).L / 1024  # one segment of m*p entries
    # Twice the largest last-level cache this runs on: 32 MiB on the hosts here, 50-60 MB of L2 on an H100/H200.
    evict = torch.zeros((64 if cuda else 16) << 20, device=args.device)
    agreement = []
    print("| bucket elements | before ns/elem | before, bins drawn again | before, cold caches | after ns/elem "
          "| after, cold caches | after/before (warm, cold) | state before | state after |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for numel in args.sizes:
        host = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
        buffer = host.to(args.device)
        warm = _median_ns_per_element(lambda b=buffer: before(0, b), numel, args.repeats, sync=sync)
        drawn = _median_ns_per_element(lambda b=buffer: before(1, b, cached=False), numel, args.repeats, sync=sync)
        cold = _median_ns_per_element(lambda b=buffer: before(0, b), numel, args.repeats, evict, sync)
        before._bins.clear()  # the cached bins are the "before" state the issue objects to: free them
        folded = _median_ns_per_element(lambda b=buffer: after(0, b), numel, args.repeats, sync=sync)
        folded_cold = _median_ns_per_element(lambda b=buffer: after(0, b), numel, args.repeats, evict, sync)
        if cuda:
            on_gpu, on_host = after(0, buffer).cpu(), after(0, host)
            agreement.append(f"{numel:,}: {float((on_gpu - on_host).abs().max() / on_host.norm()):.1e}")
        print(f"| {numel:,} | {warm:.2f} | {drawn:.2f} | {cold:.2f} | {folded:.2f} | {folded_cold:.2f} | "
              f"{folded / warm:.2f}, {folded_cold / cold:.2f} | {4 * numel / 2**20:.1f} MiB | "
              f"0 ({table_kib:.0f} KiB sign table, any model) |")
    if agreement:
        print("folded sketch on the GPU against the host's, max |difference| / host norm: " + "; ".join(agreement))
    if not cuda and dtype == torch.float32:
        _hook_reads(args.sizes, after, args.repeats, evict)
        _salted_rows(args.sizes, after.dim, args.repeats)
    if cuda:
        _kernel_reads(args.sizes, after, args.repeats, evict, dtype)


def _kernel_reads(sizes: list[int], sketch: Any, repeats: int, evict: Any, dtype: Any) -> None:
    """A GPU bucket's sketch and ‖g‖²: the torch executor and ``vector_norm`` (two calls, ~25 launches) against
    the Triton kernel's one read (:mod:`healthcheck.measure.sketch_kernel`), in ns per element and launches."""
    import torch

    from healthcheck.measure import sketch_kernel
    from healthcheck.measure.precision import sqnorm_fp32

    print("\n| bucket elements | sketch + ‖g‖², torch | the kernel | torch, cold | kernel, cold | kernel/torch (warm, cold) "
          "| kernel vs host sketch, max \\|Δ\\| / norm | ‖g‖² rel. error vs fp64 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for numel in sizes:
        host = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
        buffer = host.cuda()

        def torch_path(b: Any = buffer) -> Any:
            return sketch(0, b), sqnorm_fp32(b)

        def kernel(b: Any = buffer) -> Any:
            return sketch_kernel.sketch_and_sqnorm(b, k=sketch.dim, seed=sketch.seed, bucket_id=0)

        timed = [_median_ns_per_element(f, numel, repeats, e, torch.cuda.synchronize) for e in (None, evict) for f in (torch_path, kernel)]
        got, sqnorm = kernel()
        on_host = sketch(0, host)
        exact = float(host.double().square().sum())
        print(f"| {numel:,} | {timed[0]:.3f} | {timed[1]:.3f} | {timed[2]:.3f} | {timed[3]:.3f} | {timed[1] / timed[0]:.2f}, "
              f"{timed[3] / timed[2]:.2f} | {float((got.cpu() - on_host).abs().max() / on_host.norm()):.1e} | "
              f"{abs(float(sqnorm) - exact) / exact:.1e} |")


def _salted_rows(sizes: list[int], k: int, repeats: int) -> None:
    """The rows' rotations and signs of a whole gradient when nothing is cached: FSDP2 salts its sketch per step, so
    every step asks for new ones. ms per gradient, the Python row loop against :func:`row_moves_arrays` (which
    :func:`~healthcheck.measure.sketch_layout._row_moves` uses from 32 rows a call on)."""
    from healthcheck.measure.sketch_layout import get_layout, plan, row_moves_arrays, row_moves_loop

    lay = get_layout(k)
    print("\n| gradient elements | segments | rows in a Python loop, ms | numpy arrays, ms | arrays/loop |")
    print("|---:|---:|---:|---:|---:|")
    for numel in sizes:
        pieces = plan(numel, 0, lay, 0, 1, 256)
        times = {}
        # The loop is how every call hashed them until 2026-11-26 (now only calls of a few rows).
        for name, moves in (("loop", row_moves_loop), ("arrays", row_moves_arrays)):
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                for piece in pieces:
                    moves(piece.K, piece.a, piece.b, piece.g, max(piece.rows, 1), lay.p)
                runs.append(time.perf_counter() - start)
            times[name] = statistics.median(runs) * 1000
        loop, arrays = times["loop"], times["arrays"]
        print(f"| {numel:,} | {-(-numel // lay.L):,} | {loop:.2f} | {arrays:.3f} | {arrays / loop:.3f} |")


def _hook_reads(sizes: list[int], sketch: Any, repeats: int, evict: Any) -> None:
    """The hook's division, ‖g‖² and sketch of a host bucket: three passes against the one pass, by numpy and by
    the C extension where it was built (ns per element). The one pass divides in place, as the hook does: at most
    ``repeats + 1`` divisions by 8, so the values stay normal floats (a subnormal would slow every column)."""
    import os

    import torch

    from healthcheck.measure import host_pass
    from healthcheck.measure.sketch import KERNEL_SWITCH

    def one_pass(b: Any) -> None:
        host_pass.divide_square_sketch(b, b, world=8, k=sketch.dim, seed=sketch.seed, bucket_id=0)

    executors = {"numpy": "torch", **({"C": None} if host_pass._host_fold is not None else {})}
    names = list(executors)
    print(f"\n| bucket elements | three passes | {' | '.join(f'one pass, {n}' for n in names)} | (cold) three passes | "
          f"{' | '.join(f'(cold) one pass, {n}' for n in names)} | one/three (warm, cold) |")
    print("|---:|" + "---:|" * (2 * len(names) + 3))
    saved = os.environ.get(KERNEL_SWITCH)
    try:
        for numel in sizes:
            buffer = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
            target = torch.empty_like(buffer)

            def three(b: Any = buffer, t: Any = target) -> None:
                torch.div(b, 8, out=t)
                torch.dot(b, b)
                sketch(0, b)

            figures: dict[str, tuple[float, float]] = {}
            for name, switch in executors.items():
                if switch is None:
                    os.environ.pop(KERNEL_SWITCH, None)
                else:
                    os.environ[KERNEL_SWITCH] = switch
                assert host_pass.compiled() == (name == "C")
                values = buffer.clone()
                figures[name] = (
                    _median_ns_per_element(lambda v=values: one_pass(v), numel, repeats),
                    _median_ns_per_element(lambda v=values: one_pass(v), numel, repeats, evict),
                )
            warm3, cold3 = (_median_ns_per_element(three, numel, repeats), _median_ns_per_element(three, numel, repeats, evict))
            best = names[-1]
            print(f"| {numel:,} | {warm3:.2f} | {' | '.join(f'{figures[n][0]:.2f}' for n in names)} | {cold3:.2f} | "
                  f"{' | '.join(f'{figures[n][1]:.2f}' for n in names)} | "
                  f"{figures[best][0] / warm3:.2f}, {figures[best][1] / cold3:.2f} ({best}) |")
    finally:
        if saved is None:
            os.environ.pop(KERNEL_SWITCH, None)
        else:
            os.environ[KERNEL_SWITCH] = saved


if __name__ == "__main__":
    main()

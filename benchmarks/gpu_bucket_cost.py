"""What one DDP bucket costs the sketch hook on a GPU: host µs per operation, and the kernel's GPU time per bucket.

Issue 13's GPU step is launch-bound: the comm hook runs on the autograd thread, so each operation it issues costs
that thread host time, whatever the GPU does (README, Measured figures). This script prices the pieces one at a
time, without a model:

* **host µs per call** of each operation the hook issues for a bucket, on a small tensor so that the GPU keeps up
  (the mean over ``--calls`` calls, no synchronisation inside): the kernel's launch through Triton's JIT, the
  monitor's planned call (its row of :class:`healthcheck.measure.bucket_plans.StepTable`, then the launch), the
  unplanned call with a vector of its own (:class:`healthcheck.measure.sketch_kernel.DeviceBucket`), the table's
  ``zero_`` once a step, DDP's division, the all-reduce and its ``then``, a slice's norm, and one ``_foreach_norm``
  over a step's buckets;
* **GPU µs per bucket** of the kernel (sketch, ‖x‖² and the division) for kernel settings ``BLOCK x warps x sign
  dtype``, against torch's ``div_`` (what DDP's own hook does to the bucket) and a copy, by CUDA events over
  ``--repeats`` calls, with the bandwidth each reaches counting the bucket read once and written once. Every
  setting's sketch is checked against the first setting's, and its division against ``div_``. The default kernel's
  launch is also timed alone, with and without the division, and so is the table's ``zero_`` once a step.

    python benchmarks/gpu_bucket_cost.py                     # CUDA only: one NCCL rank
    python benchmarks/gpu_bucket_cost.py --numel 13107200 --settings 128x4xf32 256x8xf32
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Any, Callable


def host_us(fn: Callable[[], Any], calls: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def gpu_us(fn: Callable[[], Any], repeats: int) -> float:
    import torch

    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats * 1000


def host_table(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import triton

    from healthcheck.measure import distributed, sketch_kernel
    from healthcheck.measure.bucket_plans import BucketPlans

    x = torch.randn(args.small, device="cuda").bfloat16()
    plan = sketch_kernel.DeviceBucket(x.numel(), x.dtype, x.device, k=4096, seed=0, bucket_id=0)
    out = torch.zeros(plan.width, dtype=torch.float32, device="cuda")
    table = torch.zeros((args.buckets, plan.width), dtype=torch.float32, device="cuda")
    plans = BucketPlans(4096, seed=0)
    planned = plans.take(0, x)
    kernel = sketch_kernel._kernel()
    launch_args = (x, plan.tau, plan.meta, plan.eps, out, 1.0, plan.p)
    launch_kw = dict(M=plan.lay.m, MP=triton.next_power_of_2(plan.lay.m), BLOCK=plan.block, DIVIDE=False, num_warps=plan.warps)
    group = dist.group.WORLD
    slices = [torch.randn(args.small // 8, device="cuda").bfloat16() for _ in range(args.buckets)]
    rows = [
        ("the kernel's launch (Triton JIT)", lambda: kernel[plan.grid](*launch_args, **launch_kw)),
        # The set discard keeps the row from counting as a second backward in one step (which zeroes it first).
        ("the monitor's planned call (its table row, the launch)",
         lambda: (plans._table._written.discard(0), planned.divide_square_sketch(x, 1))),
        ("DeviceBucket.divide_square_sketch (a vector of its own, the launch)", lambda: plan.divide_square_sketch(x, 1)),
        (f"the table's zero_ ({args.buckets} rows, once a step)", lambda: table.zero_()),
        ("x.div_(world) (DDP's hook)", lambda: x.div_(1)),
        ("all-reduce, direct (distributed.all_reduce_async)", lambda: distributed.all_reduce_async(x, group)),
        ("all-reduce + then(first_value)", lambda: distributed.all_reduce_async(x, group).then(distributed.first_value)),
        ("dist.all_reduce(async_op=True).get_future()", lambda: dist.all_reduce(x, group=group, async_op=True).get_future()),
        ("vector_norm(slice, fp32).square() (the old callback)",
         lambda: torch.linalg.vector_norm(x[: args.small // 8], dtype=torch.float32).square()),
        (f"_foreach_norm over {args.buckets} slices, squared (once a step)",
         lambda: torch._foreach_mul(*(2 * [torch._foreach_norm(slices, 2, dtype=torch.float32)]))),
    ]
    print(f"host µs per call, {args.calls} calls each, a {args.small}-element bf16 bucket:")
    print("| operation | host µs |")
    print("|---|---:|")
    for name, fn in rows:
        print(f"| {name} | {host_us(fn, args.calls):.1f} |")


def kernel_table(args: argparse.Namespace) -> None:
    import torch

    from healthcheck.measure import sketch_kernel

    x = torch.randn(args.numel, device="cuda").bfloat16()
    nbytes = 2 * x.numel() * x.element_size()  # read once, written once
    print(f"\nGPU µs per bucket of {args.numel} bf16 elements ({args.repeats} calls each, CUDA events); GB/s count a read and a write:")
    print("| what | µs | GB/s |")
    print("|---|---:|---:|")
    y, halved = torch.empty_like(x), x.clone()
    for name, fn in (("div_(2) (DDP's division)", lambda: halved.div_(2)), ("y.copy_(x)", lambda: y.copy_(x))):
        us = gpu_us(fn, args.repeats)
        print(f"| {name} | {us:.1f} | {nbytes / us / 1e3:.0f} |")
    launch_alone(x, nbytes, args.repeats, args.buckets)
    defaults = (sketch_kernel.BLOCK, sketch_kernel.NUM_WARPS, sketch_kernel.TAU_DTYPE)
    reference = None
    try:
        for setting in args.settings:
            block, warps, tau = setting.split("x")
            sketch_kernel.BLOCK, sketch_kernel.NUM_WARPS = int(block), int(warps)
            sketch_kernel.TAU_DTYPE = {"f32": torch.float32, "i8": torch.int8, "bf16": torch.bfloat16}[tau]
            plan = sketch_kernel.DeviceBucket(x.numel(), x.dtype, x.device, k=4096, seed=0, bucket_id=0)
            fresh = x.clone()
            sketched, squares = plan.divide_square_sketch(fresh, 8)
            if reference is None:
                reference = sketched.clone()
            off = float((sketched - reference).abs().max() / reference.norm())
            divided = torch.equal(fresh, x.clone().div_(8))
            # The timed calls divide a copy again and again: 51 halvings keep bf16's randn values normal.
            work = x.clone()
            us = gpu_us(lambda plan=plan, work=work: plan.divide_square_sketch(work, 2), args.repeats)
            print(f"| kernel {setting} (sketch off the first by {off:.1e}; division exact: {divided}) "
                  f"| {us:.1f} | {nbytes / us / 1e3:.0f} |")
    finally:
        sketch_kernel.BLOCK, sketch_kernel.NUM_WARPS, sketch_kernel.TAU_DTYPE = defaults


def launch_alone(x: Any, nbytes: int, repeats: int, buckets: int) -> None:
    """The default kernel's launch into a fixed vector, with and without the division, and the table's ``zero_`` once
    a step: the pieces of the monitor's call apart (back to back, a small op is bound by the launch rate)."""
    import torch

    from healthcheck.measure import sketch_kernel

    plan = sketch_kernel.DeviceBucket(x.numel(), x.dtype, x.device, k=4096, seed=0, bucket_id=0)
    out = torch.zeros(plan.width, dtype=torch.float32, device=x.device)
    table = torch.zeros((buckets, plan.width), dtype=torch.float32, device=x.device)
    work, kernel = x.clone(), sketch_kernel._kernel()
    for divide in (False, True):
        def launch(divide: bool = divide) -> None:
            kernel[plan.grid](work, plan.tau, plan.meta, plan.eps, out, 2.0, plan.p, M=plan.lay.m, MP=plan.mp,
                              BLOCK=plan.block, DIVIDE=divide, num_warps=plan.warps)

        us = gpu_us(launch, repeats)
        print(f"| the default kernel's launch alone, division {'on' if divide else 'off'} | {us:.1f} | {nbytes / us / 1e3:.0f} |")
    print(f"| the table's zero_ ({buckets} x {plan.width}, once a step) | {gpu_us(table.zero_, repeats):.1f} | |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=13_107_200, help="the timed bucket (25 MiB of bf16: DDP's default)")
    parser.add_argument("--small", type=int, default=65_536, help="the bucket whose host costs are timed")
    parser.add_argument("--buckets", type=int, default=42, help="buckets in a step (the 0.95B Llama's)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--settings", nargs="+", help="kernel settings BLOCKxWARPSxSIGNS (sketch_kernel.BLOCK, NUM_WARPS, TAU_DTYPE)",
        default=["128x4xf32", "64x2xf32", "256x8xf32", "128x4xi8"],
    )
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(probe.getsockname()[1]))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        host_table(args)
        kernel_table(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

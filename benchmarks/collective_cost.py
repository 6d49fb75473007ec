"""CPU cost of one small gloo collective per rank, and which thread pays it.

Why the monitor's one gather per step costs more than its bytes on an oversubscribed host: every rank
runs ``--ops`` collectives of ``--numel`` float64 each, ``--gap-ms`` apart (a step's worth of other
work, here a sleep, so the collectives are the only CPU use), and reports per rank and collective:

* CPU ms, all threads of the process (``time.process_time``);
* the share of it spent in each thread, read from ``/proc/self/task/*/stat`` (Linux): gloo's TCP
  event loop (``gloo_tcp_loop``), its work threads (``pt_gloo_runloop``) and the Python main thread;
* wall ms beyond the gap.

    python benchmarks/collective_cost.py --nproc 8 --kinds all_gather gather broadcast all_reduce

The kinds are the ``torch.distributed`` collectives of the same names (``all_gather`` is
``all_gather_into_tensor``, which the monitor uses). Nothing here is healthcheck code: the figures
are the transport's, on this host.
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import time
from typing import Any

KINDS = ("all_gather", "gather", "broadcast", "all_reduce")


def thread_cpu_ms() -> dict[str, float]:
    """CPU ms so far per thread name of this process (Linux ``/proc``; empty elsewhere)."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for stat in glob.glob(f"/proc/{os.getpid()}/task/*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
            name = open(stat[: -len("stat")] + "comm").read().strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * 1000 / ticks_per_s
    return totals


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker(rank: int, world: int, port: int, kind: str, args: argparse.Namespace, out: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        src = torch.randn(args.numel, dtype=torch.float64)
        flat = torch.empty(world * args.numel, dtype=torch.float64)
        parts = [torch.empty(args.numel, dtype=torch.float64) for _ in range(world)]
        run = {
            "all_gather": lambda: dist.all_gather_into_tensor(flat, src),
            "gather": lambda: dist.gather(src, parts if rank == 0 else None, dst=0),
            "broadcast": lambda: dist.broadcast(src, 0),
            "all_reduce": lambda: dist.all_reduce(src),
        }[kind]
        for _ in range(5):
            run()
        dist.barrier()
        threads_before, cpu_before, wall_before = thread_cpu_ms(), time.process_time(), time.perf_counter()
        for _ in range(args.ops):
            run()
            time.sleep(args.gap_ms / 1000)
        cpu_ms = (time.process_time() - cpu_before) * 1000 / args.ops
        wall_ms = (time.perf_counter() - wall_before) * 1000 / args.ops - args.gap_ms
        threads_after = thread_cpu_ms()
        by_thread = {name: (ms - threads_before.get(name, 0.0)) / args.ops for name, ms in threads_after.items()}
        summary = torch.tensor([cpu_ms, wall_ms, by_thread.get("gloo_tcp_loop", 0.0), by_thread.get("pt_gloo_runloop", 0.0)])
        dist.all_reduce(summary)
        if rank == 0:
            out.put((kind, *(summary / world).tolist()))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--numel", type=int, default=2060, help="float64 elements per rank (2060: the monitor's step vector at k=4096)")
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=5.0, help="sleep between collectives")
    args = parser.parse_args()
    if args.nproc < 2 or args.numel < 1 or args.ops < 1 or args.gap_ms < 0:
        parser.error("--nproc >= 2, --numel and --ops >= 1, --gap-ms >= 0")

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    print(f"# {args.nproc} gloo ranks, {args.numel} float64 per rank, {args.ops} collectives {args.gap_ms:g} ms apart")
    print("# per rank and collective:")
    print(f"{'kind':>11} {'cpu_ms':>7} {'wall_ms':>8} {'tcp_loop_ms':>12} {'work_thread_ms':>15}")
    for kind in args.kinds:
        queue = context.SimpleQueue()
        port = free_port()
        mp.start_processes(worker, args=(args.nproc, port, kind, args, queue), nprocs=args.nproc, start_method="spawn")
        name, cpu_ms, wall_ms, loop_ms, work_ms = queue.get()
        print(f"{name:>11} {cpu_ms:7.2f} {wall_ms:8.2f} {loop_ms:12.2f} {work_ms:15.2f}")


if __name__ == "__main__":
    main()

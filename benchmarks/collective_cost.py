"""CPU cost of one small gloo collective per rank, and which thread pays it.

Why the monitor's one gather per step costs more than its bytes on an oversubscribed host: every rank
runs ``--ops`` collectives of ``--numel`` float64 each, ``--gap-ms`` apart (a step's worth of other
work, here a sleep, so the collectives are the only CPU use), and reports per rank and collective:

* CPU ms, all threads of the process (``time.process_time``);
* the share of it spent in each thread, read from ``/proc/self/task/*/stat`` (Linux): gloo's TCP
  event loop (``gloo_tcp_loop``), its work threads (``pt_gloo_runloop``) and the Python main thread;
* wall ms beyond the gap.

    python benchmarks/collective_cost.py --nproc 8 --kinds all_gather gather broadcast all_reduce

The kinds are the ``torch.distributed`` collectives of the same names; ``all_gather`` is the
monitor's own call (:func:`healthcheck.measure.distributed.all_gather_rows`). Nothing here is healthcheck code: the figures
are the transport's, on this host.
"""

from __future__ import annotations

import argparse
import glob
import os
import time

KINDS = ("all_gather", "gather", "broadcast", "all_reduce")
PG_TIMEOUT_S = 300.0


def thread_cpu_ms() -> dict[str, float]:
    """CPU ms so far per thread name of this process (Linux ``/proc``; empty elsewhere)."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for stat in glob.glob(f"/proc/{os.getpid()}/task/*/stat"):
        try:
            with open(stat) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            with open(stat[: -len("stat")] + "comm") as handle:
                name = handle.read().strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * 1000 / ticks_per_s
    return totals


def worker(kind: str, numel: int, ops: int, gap_ms: float) -> tuple[float, ...] | None:
    """Time ``ops`` collectives of one kind; rank 0 returns the per-rank means
    ``(cpu_ms, wall_ms, tcp_loop_ms, work_thread_ms)``, the other ranks None."""
    import torch
    import torch.distributed as dist

    from healthcheck.measure import distributed as hdist

    info = hdist.init_distributed("cpu", "gloo", PG_TIMEOUT_S)
    try:
        hdist.set_worker_threads(info.local_world_size)
        world = info.world_size
        src = torch.randn(numel, dtype=torch.float64)
        parts = [torch.empty(numel, dtype=torch.float64) for _ in range(world)]
        run = {
            "all_gather": lambda: hdist.all_gather_rows(src),
            "gather": lambda: dist.gather(src, parts if info.rank == 0 else None, dst=0),
            "broadcast": lambda: dist.broadcast(src, 0),
            "all_reduce": lambda: dist.all_reduce(src),
        }[kind]
        for _ in range(5):
            run()
        hdist.barrier()
        threads_before, cpu_before, wall_before = thread_cpu_ms(), time.process_time(), time.perf_counter()
        for _ in range(ops):
            run()
            time.sleep(gap_ms / 1000)
        cpu_ms = (time.process_time() - cpu_before) * 1000 / ops
        wall_ms = (time.perf_counter() - wall_before) * 1000 / ops - gap_ms
        threads_after = thread_cpu_ms()
        by_thread = {name: (ms - threads_before.get(name, 0.0)) / ops for name, ms in threads_after.items()}
        summary = torch.tensor([cpu_ms, wall_ms, by_thread.get("gloo_tcp_loop", 0.0), by_thread.get("pt_gloo_runloop", 0.0)])
        dist.all_reduce(summary)
        return tuple((summary / world).tolist()) if info.rank == 0 else None
    finally:
        hdist.destroy_distributed()


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

    from healthcheck.run import launcher

    print(f"# {args.nproc} gloo ranks, {args.numel} float64 per rank, {args.ops} collectives {args.gap_ms:g} ms apart")
    print("# per rank and collective:")
    print(f"{'kind':>11} {'cpu_ms':>7} {'wall_ms':>8} {'tcp_loop_ms':>12} {'work_thread_ms':>15}")
    for kind in args.kinds:
        out = launcher.launch_local(worker, args.nproc, args=(kind, args.numel, args.ops, args.gap_ms), run_id=f"collective-cost-{kind}")
        cpu_ms, wall_ms, loop_ms, work_ms = out[0]
        print(f"{kind:>11} {cpu_ms:7.2f} {wall_ms:8.2f} {loop_ms:12.2f} {work_ms:15.2f}")


if __name__ == "__main__":
    main()

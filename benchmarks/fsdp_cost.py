"""FSDP2 against DDP on the same model and world size: step time with and without the monitor, and the
monitor's extra memory per rank.

Arms (each its own launch of fresh CPU/gloo workers, so every process's memory belongs to one arm):
``ddp``, ``ddp+sketch``, ``fsdp``, ``fsdp+sketch``, ``fsdp+exact``. FSDP2 shards every GPT-2 block and
the root (:func:`healthcheck.run.sharding.wrap_model`, what ``distributed.strategy=fsdp`` runs). Every
arm trains the same random token batches (4 x 128, every position a target) with AdamW.

* ``step_ms``: rank 0's median wall time of a full optimizer step (forward, backward, ``end_step``,
  ``optimizer.step``) over ``--steps`` steps after ``--warmup``; ``vs plain``: that over the same strategy's
  plain arm; ``vs ddp``: over the plain DDP arm.
* ``peak_mib``: the largest per-rank peak resident memory during the measured steps (Linux ``VmHWM``,
  reset after the warm-up through ``/proc/self/clear_refs``), and ``extra_mib`` its excess over the same
  strategy's plain arm: the monitor's extra memory, including its transient buffers.
* ``grad_mib``: the gradient memory the model itself holds per rank (the full gradient under DDP, the
  local shard under FSDP2, 4 bytes a float32 element), the yardstick the issue asks for.

Each arm runs ``--rounds`` times in rotation; the table keeps the median step time and the smallest peak.

    python benchmarks/fsdp_cost.py --model small-gpt2 --nproc 4 --steps 16
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

ARMS = ("ddp", "ddp+sketch", "fsdp", "fsdp+sketch", "fsdp+exact")
BATCH, TOKENS = 4, 128


def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # "5": reset the peak RSS (Linux >= 4.0)
        handle.write("5")


def _rss_peak_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def arm_worker(arm: str, model_name: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from healthcheck.config import DistributedConfig, ModelConfig
    from healthcheck.measure import distributed as hdist
    from healthcheck.measure.monitor import WorkerConsistencyMonitor
    from healthcheck.run.modeling import build_model
    from healthcheck.run.sharding import wrap_model

    info = hdist.init_distributed("cpu", "gloo", 300.0)
    try:
        hdist.set_worker_threads(info.local_world_size)
        torch.manual_seed(0)
        vocab = 258
        model = build_model(ModelConfig(name=model_name), vocab, TOKENS)
        strategy, _, mode = arm.partition("+")
        wrapped = wrap_model(model, DistributedConfig(strategy=strategy), torch.device("cpu"), info.world_size)
        monitor = WorkerConsistencyMonitor(wrapped, direction=mode, seed=0) if mode else None
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(1000 + info.rank)
        batches = [torch.randint(0, vocab, (BATCH, TOKENS), generator=generator) for _ in range(4)]
        times = []
        for step in range(warmup + steps):
            if step == warmup:
                hdist.barrier()
                _rss_peak_reset()
            ids = batches[step % len(batches)]
            start = time.perf_counter()
            loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            if monitor is not None:
                monitor.end_step(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            if step >= warmup:
                times.append((time.perf_counter() - start) * 1000)
        if monitor is not None:
            monitor.flush()
        peak = _rss_peak_mib()
        # The model's own gradients on this rank: the local shard under FSDP2 (DTensor.to_local()).
        grad_bytes = sum(
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).numel() * 4 for p in wrapped.parameters() if p.grad is not None
        )
        if monitor is not None:
            monitor.close()
        peaks = hdist.all_gather_objects(peak)
        hdist.barrier()
        # Free DDP's reducer while the process group is still registered: a reducer that outlives
        # destroy_process_group runs the group's destructor itself, which joins gloo's thread while
        # holding the GIL that thread may need (a teardown deadlock seen once in the test suite).
        del wrapped, model, optimizer, monitor
        gc.collect()
        return {"step_ms": statistics.median(times), "peak_mib": max(peaks), "grad_mib": grad_bytes / 2**20}
    finally:
        hdist.destroy_distributed()


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small-gpt2", help="a healthcheck preset (default small-gpt2)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    args = parser.parse_args(argv)

    from healthcheck.run import launcher

    measured: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    for _ in range(args.rounds):
        for arm in args.arms:
            out = launcher.launch_local(arm_worker, args.nproc, args=(arm, args.model, args.steps, args.warmup), run_id=f"fsdp-cost-{arm}")
            measured[arm].append(out[0])
    table = {
        arm: {
            "step_ms": statistics.median(r["step_ms"] for r in runs),
            "peak_mib": min(r["peak_mib"] for r in runs),
            "grad_mib": runs[0]["grad_mib"],
        }
        for arm, runs in measured.items()
    }
    print(f"model {args.model}, {args.nproc} CPU ranks (gloo), {args.steps} steps x {args.rounds} rounds per arm")
    print(f"{'arm':<12} {'step_ms':>8} {'vs plain':>9} {'vs ddp':>7} {'peak_mib':>9} {'extra_mib':>10} {'grad_mib':>9}")
    for arm, row in table.items():
        plain = table.get(arm.split("+")[0])
        ddp = table.get("ddp")
        vs_plain = f"{row['step_ms'] / plain['step_ms']:.3f}" if plain else "-"
        vs_ddp = f"{row['step_ms'] / ddp['step_ms']:.3f}" if ddp else "-"
        extra = f"{row['peak_mib'] - plain['peak_mib']:+.1f}" if plain and plain is not row else "-"
        print(f"{arm:<12} {row['step_ms']:>8.1f} {vs_plain:>9} {vs_ddp:>7} {row['peak_mib']:>9.1f} {extra:>10} {row['grad_mib']:>9.2f}")
    return table


if __name__ == "__main__":
    main()

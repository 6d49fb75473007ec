"""Where the sketch monitor's CPU goes on each rank: the plain and monitored step, and the monitor's pieces.

The harness model of issue 13 on N gloo ranks, two DDP copies (plain, and monitored in
sketch mode with ``every=1``, by default; with ``--mode sketch-carry`` or ``sketch-gather``, ``exchange="carry"`` or
``"gather"``; with ``--mode exact``, exact mode) stepped alternately,
one step each in turn. Per step, each rank measures its process CPU time for the whole step and, with
``time.thread_time``, the CPU its thread spent inside the monitor's comm hook, its after-the-all-reduce
callback and ``end_step``, and inside the pieces those call (the norm, sketch and division, the squared norms, the packing,
the gather's launch or the carried row, the metrics, their publication and reading). Prints the median over
steps (``--statistic mean``: the mean, the right one for a piece that only some steps run, such as the metrics
that one rank computes for all), per rank, and the median over ranks, in ms.

A piece that the checkout under test lacks is left out, so that the script also times an older checkout for an
A/B (``PYTHONPATH=<checkout> python benchmarks/hook_breakdown.py``).

What the pieces do not show is the CPU of gloo's own threads: the step delta minus the monitor's pieces.

    python benchmarks/hook_breakdown.py --nproc 8 --steps 40 [--mode sketch-carry|exact] [--statistic mean]

The wrapping costs ~1 µs a call, a few dozen calls a step: noise against the figures.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead  # noqa: E402  (a sibling script: the arms and the harness model)

#: (module path, attribute, method or None, label), in the order printed; nested pieces after their callers.
PIECES: tuple[tuple[str, str, str | None, str], ...] = (
    ("healthcheck.measure.monitor", "WorkerConsistencyMonitor", "_reduce_bucket", "hook (all of it)"),
    ("healthcheck.measure.monitor", "WorkerConsistencyMonitor", "_measure_local", "  norm, sketch, division (exact: norm, copy)"),
    ("healthcheck.measure.monitor", "WorkerConsistencyMonitor", "_carry_target", "  carry: the bucket and the block (--mode sketch-carry)"),
    ("healthcheck.measure.sketch", "FoldedSketch", "__call__", "  sketch"),
    ("healthcheck.measure.monitor", "WorkerConsistencyMonitor", "_carry", "  carry: this rank's row (--mode sketch-carry)"),
    ("healthcheck.measure.runqueue", "read", None, "  run-queue clock (hook and end_step)"),
    ("healthcheck.measure.monitor", "WorkerConsistencyMonitor", "_after_reduce", "after the all-reduce (all of it)"),
    ("healthcheck.measure.monitor", "WorkerConsistencyMonitor", "_unload", "  the reduced bucket, carried rows taken out"),
    ("healthcheck.measure.monitor", "WorkerConsistencyMonitor", "_keep_reduced", "after the all-reduce (--mode exact)"),
    ("healthcheck.measure.monitor", "sqnorm_fp32", None, "squared norms (hook and callback)"),
    ("healthcheck.measure.monitor", "WorkerConsistencyMonitor", "end_step", "end_step (all of it)"),
    ("healthcheck.measure.exact_rows", "post_step", None, "  pack and post the local gradient (--mode exact)"),
    ("healthcheck.measure.step_gather", "pack", None, "  pack the step vector"),
    ("healthcheck.measure.distributed", "all_gather_rows_async", None, "  start the all-gather"),
    ("healthcheck.measure.shared_rows", "SharedRows", "post", "  post the row to shared memory"),
    ("healthcheck.measure.shared_rows", "SharedRows", "read", "  read the rows from shared memory"),
    ("healthcheck.measure.step_gather", "complete", None, "  compute a step's metrics (the claimant, or a fallback)"),
    ("healthcheck.measure.host_vectors", "header_and_gram", None, "    its Gram (--mode exact: of the local gradients)"),
    ("healthcheck.measure.step_gather", "compute_step_metrics", None, "    its metrics"),
    ("healthcheck.measure.shared_rows", "SharedRows", "publish", "  publish them (the claimant)"),
    ("healthcheck.measure.shared_rows", "SharedRows", "published", "  read the published metrics"),
)


def instrument(totals: dict[str, float]) -> Callable[[], None]:
    """Wrap every piece so that its thread CPU adds to ``totals[label]``; returns the undo."""
    import importlib

    undo = []
    for module_name, attribute, method, label in PIECES:
        owner: Any = importlib.import_module(module_name)
        if method is not None:
            owner, attribute = getattr(owner, attribute, None), method
        original = getattr(owner, attribute, None)
        if original is None:  # an older checkout timed for an A/B (tests/unit/benchmarks checks this one has all)
            continue

        def timed(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] = totals.get(_label, 0.0) + (time.thread_time() - start) * 1000

        # An inherited method (end_step) is wrapped on the subclass and deleted again, not copied onto it.
        undo.append((owner, attribute, original if attribute in vars(owner) else None))
        setattr(owner, attribute, functools.wraps(original)(timed))

    def restore() -> None:
        for owner, attribute, original in undo:
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)

    return restore


def medians(steps: list[dict[str, float]], statistic: str = "median") -> dict[str, float]:
    """Per-key median (or mean) over steps; a piece a step did not call counts 0 there.

    >>> medians([{"a": 1.0, "b": 4.0}, {"a": 3.0}, {"a": 2.0, "b": 2.0}])
    {'a': 2.0, 'b': 2.0}
    >>> medians([{"a": 1.0, "b": 3.0}, {"a": 3.0}], "mean")
    {'a': 2.0, 'b': 1.5}
    """
    keys = list(dict.fromkeys(key for step in steps for key in step))
    of = statistics.mean if statistic == "mean" else statistics.median
    return {key: of(step.get(key, 0.0) for step in steps) for key in keys}


def breakdown_worker(
    steps: int, warmup: int, sketch_dim: int, mode: str = "sketch", statistic: str = "median"
) -> list[dict[str, float]] | None:
    import torch

    from healthcheck.measure import distributed as hdist

    info = hdist.init_distributed("cpu", "gloo", overhead.PG_TIMEOUT_S)
    try:
        hdist.set_worker_threads(info.local_world_size)
        # The probe's training settings (optimizer, clipping) around the harness's model and batches.
        config = overhead.probe_config_for("tiny-gpt2")
        setting = overhead.Setting(model=overhead.HARNESS, modes=(mode,), steps=steps, warmup=warmup, sketch_dim=sketch_dim)
        base = overhead.harness_model()
        generator = torch.Generator().manual_seed(1000 + info.rank)
        batches = [([overhead.harness_batch(generator)], overhead.HARNESS_BATCH * overhead.HARNESS_TOKENS) for _ in range(4)]
        arms = {name: overhead.Arm(copy.deepcopy(base), name, setting, config) for name in (overhead.PLAIN, mode)}
        for _ in range(warmup):
            for arm in arms.values():
                arm.step(*batches[0])
        totals: dict[str, float] = {}
        undo = instrument(totals)
        rows: list[dict[str, float]] = []
        try:
            for index in range(steps):
                row: dict[str, float] = {}
                # Alternate which arm goes first, so that neither always follows the other's cache traffic.
                for name in (overhead.PLAIN, mode) if index % 2 else (mode, overhead.PLAIN):
                    hdist.barrier()
                    totals.clear()
                    start = time.process_time()
                    arms[name].step(*batches[index % len(batches)])
                    # The monitored arm is labelled "monitored" whatever its mode and exchange (render's rows).
                    row["step, plain" if name == overhead.PLAIN else "step, monitored"] = (time.process_time() - start) * 1000
                    if name == mode:
                        row.update(totals)
                rows.append(row)
        finally:
            undo()
        for arm in arms.values():
            arm.close()
        every_rank = hdist.all_gather_objects(medians(rows, statistic))
        return every_rank if info.rank == 0 else None
    finally:
        hdist.destroy_distributed()


def render(per_rank: list[dict[str, float]]) -> str:
    """The table: one line per quantity, the median over ranks and then each rank.

    >>> print(render([{"step, plain": 10.0, "step, monitored": 11.0}, {"step, plain": 12.0, "step, monitored": 12.5}]))
    | CPU ms per step | median over ranks | rank 0 | rank 1 |
    | --- | ---: | ---: | ---: |
    | step, plain | 11.00 | 10.00 | 12.00 |
    | step, monitored | 11.75 | 11.00 | 12.50 |
    | step delta (monitored − plain) | 0.75 | 1.00 | 0.50 |
    """
    keys = list(dict.fromkeys(key for rank in per_rank for key in rank))
    delta = [rank["step, monitored"] - rank["step, plain"] for rank in per_rank]
    lines = [
        "| CPU ms per step | median over ranks | " + " | ".join(f"rank {r}" for r in range(len(per_rank))) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in per_rank) + " |",
    ]
    ordered = [key for key in ("step, plain", "step, monitored") if key in keys]
    ordered += [label for *_, label in PIECES if label in keys]
    for key in ordered:
        values = [rank.get(key, 0.0) for rank in per_rank]
        lines.append(f"| {key} | {statistics.median(values):.2f} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
        if key == "step, monitored":
            lines.append(
                f"| step delta (monitored − plain) | {statistics.median(delta):.2f} | " + " | ".join(f"{v:.2f}" for v in delta) + " |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sketch-dim", type=int, default=overhead.SKETCH_DIM)
    parser.add_argument("--mode", choices=("sketch", overhead.SKETCH_CARRY, overhead.SKETCH_GATHER, "exact"), default="sketch",
                        help="the monitored arm: sketch mode as by default (shared memory on one host), with "
                             "exchange='carry', with exchange='gather', or exact mode")
    parser.add_argument("--statistic", choices=("median", "mean"), default="median",
                        help="over steps: the median (the default), or the mean (a piece that runs in some steps only)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from healthcheck.run import launcher

    results = launcher.launch_local(
        breakdown_worker, args.nproc, args=(args.steps, args.warmup, args.sketch_dim, args.mode, args.statistic), run_id="hook-breakdown"
    )
    import healthcheck

    print(f"# {overhead.HARNESS}, {args.nproc} ranks, {args.steps} steps per arm, {args.mode} k={args.sketch_dim}, every=1, "
          f"{args.statistic} over steps, healthcheck from {Path(healthcheck.__file__).parent.parent}")
    print(render(results[0]))


if __name__ == "__main__":
    main()

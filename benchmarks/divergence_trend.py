"""How one rank's divergence grows over a probe: its per-step signals against the other ranks', by window.

Reads ``steps.jsonl`` of finished runs (for example the lr-x10 runs of the detection matrix) and prints,
for each window of steps, the rank's mean gradient-norm ratio to the other ranks' median, its cosine to
the averaged gradient against the others' median, and its loss minus theirs, averaged over the runs.

    python benchmarks/divergence_trend.py runs/m20/lr-x10/*/ --rank 3 --windows 5:20 20:40 40:60
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def window_signals(rows: list[dict], rank: int, start: int, stop: int) -> dict[str, float] | None:
    """Mean over the steps in [start, stop) of the rank's signals relative to the other ranks' median."""
    by_step: dict[int, dict[int, dict]] = defaultdict(dict)
    for row in rows:
        if start <= row["step"] < stop:
            by_step[row["step"]][row["rank"]] = row
    norm_ratio, cosine_gap, loss_gap = [], [], []
    for ranks in by_step.values():
        mine, others = ranks.get(rank), [r for k, r in ranks.items() if k != rank]
        if mine is None or not others or mine.get("cosine_to_mean") is None:
            continue
        norm_ratio.append(mine["grad_norm"] / statistics.median(o["grad_norm"] for o in others))
        cosine_gap.append(mine["cosine_to_mean"] - statistics.median(o["cosine_to_mean"] for o in others))
        loss_gap.append(mine["loss"] - statistics.median(o["loss"] for o in others))
    if not norm_ratio:
        return None
    return {"norm_ratio": statistics.fmean(norm_ratio), "cosine_gap": statistics.fmean(cosine_gap),
            "loss_gap": statistics.fmean(loss_gap)}


def read_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "steps.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each with steps.jsonl)")
    parser.add_argument("--rank", type=int, default=3, help="the rank to follow (default 3, the scenarios' faulty rank)")
    parser.add_argument("--windows", nargs="+", default=["5:20", "20:40", "40:60"], help="step windows start:stop")
    args = parser.parse_args(argv)
    windows = [tuple(int(x) for x in w.split(":")) for w in args.windows]
    runs = [read_rows(d) for d in args.runs if (d / "steps.jsonl").exists()]
    if not runs:
        print("no steps.jsonl in the given directories", file=sys.stderr)
        return 2
    print(f"rank {args.rank} against the other ranks' median, mean over {len(runs)} runs")
    print("| steps | grad-norm ratio | cosine-to-mean gap | loss gap |")
    print("| --- | --- | --- | --- |")
    for start, stop in windows:
        per_run = [s for s in (window_signals(rows, args.rank, start, stop) for rows in runs) if s]
        if not per_run:
            continue
        mean = {k: statistics.fmean(s[k] for s in per_run) for k in per_run[0]}
        print(f"| {start}–{stop - 1} | {mean['norm_ratio']:.2f} | {mean['cosine_gap']:+.3f} | {mean['loss_gap']:+.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

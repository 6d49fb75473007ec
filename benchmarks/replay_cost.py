"""What the replay audit costs the built-in probe: its training loop with the audit on and off, DDP and FSDP2.

Each arm is one ``healthcheck probe --audits-only`` as a user runs it (a fresh process, the embedded default config:
8 CPU ranks, 60 steps, a replay round before the first step and every ``metrics.replay_every`` = 15 steps, 4 in
all). The ``off`` arm sets ``metrics.replay_every=0``. Under DDP each rank replays one micro-batch alone; under FSDP2
every rank replays together through the sharded model, its all-gathers and reduce-scatters included
(:mod:`healthcheck.measure.sharded_replay`).

The arms run in rotation, ``--rounds`` times (the order turns each round, so a drift in the host's load falls on every
arm), and the table keeps rank 0's training loop (``result.json`` ``timing.train_s``): the median per arm, and the
median of the rounds' paired ratios on/off. On a shared 2-core host one round's ratio moves by several percent; the
paired median is the figure to quote.

    python benchmarks/replay_cost.py --rounds 3
    python benchmarks/replay_cost.py --rounds 2 --strategies fsdp --set train.steps=30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STRATEGIES = ("ddp", "fsdp")


def arm_sets(strategy: str, replay: bool, extra: list[str]) -> list[str]:
    """The ``--set`` items of one arm.

    >>> arm_sets("fsdp", False, ["train.steps=30"])
    ['distributed.strategy=fsdp', 'metrics.replay_every=0', 'train.steps=30']
    >>> arm_sets("ddp", True, [])
    ['distributed.strategy=ddp']
    """
    return [f"distributed.strategy={strategy}", *([] if replay else ["metrics.replay_every=0"]), *extra]


def rotation(arms: list[Any], round_index: int) -> list[Any]:
    """The arms in this round's order: turned by one each round.

    >>> rotation(["a", "b", "c"], 0), rotation(["a", "b", "c"], 1), rotation(["a", "b", "c"], 4)
    (['a', 'b', 'c'], ['b', 'c', 'a'], ['b', 'c', 'a'])
    """
    turn = round_index % len(arms)
    return arms[turn:] + arms[:turn]


def one_probe(sets: list[str]) -> dict[str, Any]:
    """One probe's exit code, training loop (s) and replay rounds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "healthcheck", "probe", "--audits-only", "--no-plots", "--out", str(out)]
        for item in sets:
            command += ["--set", item]
        code = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        result = json.loads((out / "result.json").read_text())
    steps = result["audits"].get("replay", {}).get("replay_steps") or []
    return {"code": code, "train_s": result["timing"]["train_s"], "rounds": len(steps)}


def summary(runs: dict[tuple[str, bool], list[dict[str, Any]]], strategy: str) -> str:
    """One table row: the medians per arm and the median paired ratio.

    >>> runs = {("ddp", True): [{"code": 0, "train_s": 11.0, "rounds": 4}, {"code": 0, "train_s": 12.0, "rounds": 4}],
    ...         ("ddp", False): [{"code": 0, "train_s": 10.0, "rounds": 0}, {"code": 0, "train_s": 10.0, "rounds": 0}]}
    >>> summary(runs, "ddp")
    '| ddp | 2 | 4 | 11.50 | 10.00 | 1.150 | 1.100–1.200 | [0] |'
    """
    on, off = runs[(strategy, True)], runs[(strategy, False)]
    ratios = [a["train_s"] / b["train_s"] for a, b in zip(on, off, strict=True)]
    codes = sorted({run["code"] for run in on + off})
    rounds = max(run["rounds"] for run in on)
    return (f"| {strategy} | {len(on)} | {rounds} | {statistics.median(r['train_s'] for r in on):.2f} | "
            f"{statistics.median(r['train_s'] for r in off):.2f} | {statistics.median(ratios):.3f} | "
            f"{min(ratios):.3f}–{max(ratios):.3f} | {codes} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    arms = [(strategy, replay) for strategy in args.strategies for replay in (True, False)]
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {arm: [] for arm in arms}
    for index in range(args.rounds):
        for strategy, replay in rotation(arms, index):
            run = one_probe(arm_sets(strategy, replay, args.sets))
            runs[(strategy, replay)].append(run)
            print(f"round {index + 1}: {strategy} replay {'on' if replay else 'off'}: exit {run['code']}, "
                  f"train {run['train_s']:.2f} s, {run['rounds']} replay rounds", file=sys.stderr, flush=True)
    print(f"healthcheck probe --audits-only {' '.join('--set ' + s for s in args.sets)}".rstrip()
          + f": {args.rounds} rounds, arms in rotation")
    print("| strategy | rounds | replays | train s, replay on | train s, off | on/off (median of pairs) | range | exit |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for strategy in args.strategies:
        print(summary(runs, strategy))


if __name__ == "__main__":
    main()

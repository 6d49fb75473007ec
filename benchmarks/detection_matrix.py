"""Detection matrix: run every fault scenario and the clean probe over R seeds; which checks fire, how often.

Each run is the default probe plus one scenario's overrides (``healthcheck scenarios list``), judged
against a baseline exactly as ``healthcheck scenarios run`` does. The table gives, per scenario, the
fraction of runs in which each check fired, the detection rate (an expected check fired), whether it
named the right rank, and for the clean probe the false-alarm rate (any check fired).

    python benchmarks/detection_matrix.py --seeds 20                        # against baselines/default.json
    python benchmarks/detection_matrix.py --seeds 3 --steps 30 --fit 5      # shorter probes, own 5-run baseline
    python benchmarks/detection_matrix.py --from-json runs/matrix/outcomes.json   # re-print a finished sweep
    python benchmarks/detection_matrix.py --from-json runs/m1/outcomes.json runs/m2/outcomes.json  # merge sweeps

Targets: every scenario caught in >= 19/20 seeds with the right rank named, the clean probe 0/20.
The numbers it prints are copied into the README with the command that made them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds per scenario (default 20)")
    parser.add_argument("--first-seed", type=int, help="first train.seed (default: healthcheck.scenarios.FIRST_SEED)")
    parser.add_argument("--steps", type=int, help="train.steps for every run (default: the probe's 60)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra --set for every run")
    parser.add_argument("--baseline", type=Path, default=Path("baselines/default.json"))
    parser.add_argument("--fit", type=int, default=0, metavar="K",
                        help="fit a fresh baseline from K clean runs (seeds 42..) with the same settings instead")
    parser.add_argument("--scenarios", nargs="+", default=["clean", "all"], help="names (default: clean all)")
    parser.add_argument("--runs-root", type=Path, default=Path("runs/matrix"))
    parser.add_argument("--from-json", type=Path, nargs="+",
                        help="print the table of finished sweeps' outcomes.json files (several are merged in order)")
    return parser.parse_args(argv)


def _baseline(args, base_sets):
    from healthcheck.config import load_config
    from healthcheck.judge.baseline import fit_baseline, load_baseline, save_baseline
    from healthcheck.run.recording import run_repeats

    if not args.fit:
        return load_baseline(args.baseline), str(args.baseline)
    config = load_config(None, base_sets)
    print(f"fitting a baseline from {args.fit} clean runs (seeds 42..{41 + args.fit})", flush=True)
    results, dirs = run_repeats(config, args.fit, args.runs_root / "baseline")
    baseline = fit_baseline(results, reason="detection matrix", approved_by="benchmark", run_ids=[d.name for d in dirs])
    path = args.runs_root / "baseline.json"
    save_baseline(baseline, path)
    return baseline, str(path)


def run_sweep(args) -> list[dict]:
    from healthcheck.run import scenarios

    base_sets = [*args.sets, *([f"train.steps={args.steps}"] if args.steps else [])]
    baseline, baseline_path = _baseline(args, base_sets)
    outcomes = []
    started = time.time()
    first = scenarios.FIRST_SEED if args.first_seed is None else args.first_seed
    from healthcheck.config import load_config

    applicable, skipped = scenarios.for_strategy(scenarios.resolve(args.scenarios), load_config(None, base_sets).distributed.strategy)
    for line in skipped:
        print(line, flush=True)
    for scenario in applicable:
        for seed in range(first, first + args.seeds):
            outcome = scenarios.run_scenario(scenario, seed, baseline, baseline_path=baseline_path,
                                             runs_root=args.runs_root, base_sets=base_sets)
            print(f"[{time.time() - started:6.0f}s] {outcome.line()}", flush=True)
            outcomes.append(dataclasses.asdict(outcome))
            (args.runs_root / "outcomes.json").write_text(json.dumps(
                {"command": " ".join(sys.argv), "base_sets": base_sets, "baseline": baseline_path, "outcomes": outcomes},
                indent=1))
    return outcomes


def matrix_text(outcomes: list[dict], strategy: str = "ddp") -> str:
    """The Markdown tables: scenario x check firing fractions, then detection, right rank and false alarms
    (expected checks as judged under ``strategy``)."""
    from healthcheck.run.scenarios import SCENARIOS, SEEDED_RANK

    order = list(dict.fromkeys(o["scenario"] for o in outcomes))
    checks = sorted({c for o in outcomes for c in o["fired"]}, key=lambda c: (not c.startswith("audit."), c))
    lines = ["| scenario | runs | " + " | ".join(c.replace("envelope.", "env.") for c in checks) + " |",
             "|---|---|" + "---|" * len(checks)]
    summary = ["| scenario | expected check (rank) | detected | right rank named | probe did not finish |",
               "|---|---|---|---|---|"]
    for name in order:
        runs = [o for o in outcomes if o["scenario"] == name]
        n = len(runs)
        cells = []
        for check in checks:
            k = sum(check in o["fired"] for o in runs)
            cells.append(f"{k}/{n}" if k else "·")
        lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
        scenario = SCENARIOS[name].under(strategy) if name in SCENARIOS else None
        unfinished = sum(o["status"] != "complete" for o in runs)
        if name == "clean":
            alarms = sum(bool(o["fired"]) for o in runs)
            summary.append(f"| clean | nothing fires | false alarms {alarms}/{n} | - | {unfinished}/{n} |")
        else:
            expected = " or ".join(scenario.expected_checks) if scenario else "?"
            ranks = scenario.expected_ranks if scenario else "?"
            ranks = "seeded: 1-7 by seed" if ranks == SEEDED_RANK else ranks
            detected = sum(o["detected"] for o in runs)
            right = sum(o["right_rank"] for o in runs)
            summary.append(f"| {name} | {expected} ({ranks}) | {detected}/{n} | {right}/{n} | {unfinished}/{n} |")
    return "\n".join(lines) + "\n\n" + "\n".join(summary)


def _strategy(base_sets: list[str]) -> str:
    from healthcheck.config import load_config

    return load_config(None, list(base_sets)).distributed.strategy


def main(argv=None) -> int:
    args = _parse(argv)
    if args.from_json:
        outcomes, strategies = [], set()
        for path in args.from_json:
            data = json.loads(path.read_text())
            print(f"command: {data.get('command')}  ({len(data['outcomes'])} runs, baseline {data.get('baseline')})")
            outcomes += data["outcomes"]
            strategies.add(_strategy(data.get("base_sets", [])))
        print()
        print(matrix_text(outcomes, strategies.pop() if len(strategies) == 1 else "ddp"))
        return 0
    args.runs_root.mkdir(parents=True, exist_ok=True)
    outcomes = run_sweep(args)
    print()
    print(matrix_text(outcomes, _strategy(args.sets)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the default probe's wall time goes: start-up, steps and report, phase by phase.

Runs ``healthcheck probe`` as a user would (a fresh process, the embedded default config, 8 CPU
ranks) ``--repeats`` times and prints the median seconds of every phase:

* ``interpreter+cli``: Python start-up and ``import healthcheck.cli`` (timed in its own process);
* ``preflight``: config checks and claiming the run directory;
* ``imports_and_caches``: the launcher imports torch and transformers, loads the tokenizer, tokenizes the
  data and imports the model's module *before* forking, so the 8 workers inherit them;
* ``spawn``: the elastic launcher starting the workers;
* ``rendezvous``, ``build`` (data loader, model, DDP, monitor), ``start_checks`` (fail fast), ``train`` (the
  optimizer steps), ``finish`` (the audits' gather): rank 0's clock (``result.json`` ``timing.phases``);
* ``report``: what the command took besides rank 0's clock and ``interpreter+cli``: judging against the
  baseline, writing the terminal, Markdown, JUnit, HTML and plots, and leaving the process (without the
  interpreter's teardown since 2026-11-28: ``healthcheck.cli.run``).

``--set key=value`` is passed through, e.g. ``--set data.sharding=replicated`` times a probe that fails fast.

    python benchmarks/startup.py --repeats 3
    python benchmarks/startup.py --repeats 3 --set data.sharding=replicated
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ORDER = ("interpreter+cli", "preflight", "imports_and_caches", "spawn", "rendezvous", "build", "start_checks", "train",
         "finish", "report")


def timed(command: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    code = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - start, code


def one_probe(sets: list[str], cli_s: float) -> tuple[dict[str, float], float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "healthcheck", "probe", "--out", str(out)]
        for item in sets:
            command += ["--set", item]
        total, code = timed(command)
        result = json.loads((out / "result.json").read_text())
    timing = result["timing"]
    phases = {"interpreter+cli": cli_s, **timing.get("phases", {})}
    phases["report"] = max(0.0, total - cli_s - timing["wall_s"])
    return phases, total, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cli_s = statistics.median(timed([sys.executable, "-c", "import healthcheck.cli"])[0] for _ in range(3))
    runs = [one_probe(args.sets, cli_s) for _ in range(args.repeats)]
    totals = [total for _, total, _ in runs]
    codes = sorted({code for _, _, code in runs})
    names = [name for name in ORDER if any(name in phases for phases, _, _ in runs)]
    print(f"healthcheck probe {' '.join('--set ' + s for s in args.sets)}".strip()
          + f": {args.repeats} runs, exit code(s) {codes}, median wall {statistics.median(totals):.1f} s "
          f"(min {min(totals):.1f}, max {max(totals):.1f})")
    print("| phase | median s | share |")
    print("|---|---:|---:|")
    median_total = statistics.median(totals)
    for name in names:
        value = statistics.median(phases.get(name, 0.0) for phases, _, _ in runs)
        print(f"| {name} | {value:.2f} | {value / median_total:.0%} |")


if __name__ == "__main__":
    main()

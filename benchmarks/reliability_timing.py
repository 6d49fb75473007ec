"""Time from an injected worker fault to the probe's exit code 3, through the real CLI.

    python benchmarks/reliability_timing.py --repeats 3

The fault time is the faulty rank's last heartbeat (written just before the fault fires at the
start of its step); the end is the ``healthcheck probe`` process exiting. For a hang the figure
includes ``distributed.timeout_s`` by design: that is how long "no progress" must last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "crash (exception)": "{1: {faults: {crash_at_step: 5}}}",
    "crash (SIGKILL)": "{1: {faults: {crash_at_step: 5, crash_mode: sigkill}}}",
    "hang (timeout_s=10)": "{1: {faults: {hang_at_step: 5}}}",
}


def command() -> list[str]:
    exe = shutil.which("healthcheck")
    return [exe] if exe else [sys.executable, "-m", "healthcheck"]


def one_run(overrides: str, out: Path) -> tuple[int, float]:
    args = [*command(), "probe", "--no-judge", "--out", str(out), "--set", "distributed.nproc=4",
            "--set", "train.steps=40", "--set", "distributed.timeout_s=10", "--set", f"rank_overrides={overrides}"]
    done = subprocess.run(args, capture_output=True, text=True)
    ended = time.time()
    beat = json.loads((out / "heartbeat" / "rank-1.json").read_text())
    return done.returncode, ended - beat["time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'case':<22}{'exit codes':<14}{'fault -> exit (s), median [min, max]'}")
    for name, overrides in CASES.items():
        codes, seconds = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                code, elapsed = one_run(overrides, Path(tmp) / "run")
            codes.append(code)
            seconds.append(elapsed)
        print(f"{name:<22}{','.join(map(str, codes)):<14}{statistics.median(seconds):.1f} [{min(seconds):.1f}, {max(seconds):.1f}]")


if __name__ == "__main__":
    main()

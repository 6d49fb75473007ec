"""How often forked workers stall in start-up: many short probes launched from one process.

Each launch is the embedded default probe cut to one optimizer step (no replay audit), with a short
``distributed.startup_timeout_s``, run in this process with ``healthcheck.run.probe.run_probe``, as the scenario
sweeps and ``baseline record`` do. A launch whose workers did not all join the process group in time is
killed and relaunched by the probe (``timing.launch_attempts == 2``): that is a stall. Prints one line per
launch and the count, with a 95% upper bound on the stall rate (exact binomial).

``--no-gate`` launches without :class:`healthcheck.run.launcher.ForkGate` (workers run on while the agent still
forks their siblings), to see the stalls the gate removes. ``--dump DIR`` writes ``py-spy dump --native`` of
every worker of a stalled launch before it is killed (needs ``py-spy`` on the PATH)::

    python benchmarks/startup_stalls.py --launches 300
    python benchmarks/startup_stalls.py --launches 100 --no-gate --dump /tmp/stalls
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def upper_bound(stalls: int, launches: int, confidence: float = 0.95) -> float:
    """The exact (Clopper-Pearson) one-sided upper bound on the stall rate, by bisection.

    >>> round(upper_bound(0, 300), 4)  # the "rule of three": about 3/n
    0.0099
    >>> upper_bound(3, 3)
    1.0
    """
    from healthcheck.judge.stats import binomial_tail

    if stalls >= launches:
        return 1.0
    low, high = stalls / launches, 1.0
    for _ in range(60):  # P(X <= stalls | rate) = 1 - P(X >= stalls + 1) falls as the rate grows
        rate = (low + high) / 2
        at_most = 1 - binomial_tail(stalls + 1, launches, rate)
        low, high = (rate, high) if at_most > 1 - confidence else (low, rate)
    return high


def summary(stalls: int, launches: int, gated: bool) -> str:
    """The closing line.

    >>> summary(0, 300, gated=True)
    'fork gate on: 0 of 300 launches stalled in start-up (rate <= 1.0% at 95% confidence)'
    """
    gate = "on" if gated else "off"
    return (f"fork gate {gate}: {stalls} of {launches} launches stalled in start-up "
            f"(rate <= {100 * upper_bound(stalls, launches):.1f}% at 95% confidence)")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--startup-timeout", type=float, default=25.0, help="distributed.startup_timeout_s (s)")
    parser.add_argument("--no-gate", action="store_true", help="launch without the fork gate")
    parser.add_argument("--dump", type=Path, help="write py-spy stacks of a stalled launch's workers here")
    return parser.parse_args(argv)


def _dump_before_kill(directory: Path) -> None:
    """Have the watchdog write every worker's native and Python stack before it kills a stalled launch."""
    from healthcheck.run import watchdog

    kill = watchdog.Watchdog._kill
    directory.mkdir(parents=True, exist_ok=True)

    def dump_then_kill(beats: list) -> None:
        path = directory / f"stall-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        with path.open("w") as out:
            for pid in watchdog.child_pids(os.getpid()):
                done = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                      timeout=120)
                out.write(f"===== pid {pid}\n{done.stdout}{done.stderr}\n")
        print(f"  stacks of the stalled workers: {path}", flush=True)
        kill(beats)

    watchdog.Watchdog._kill = staticmethod(dump_then_kill)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from healthcheck.config import load_config
    from healthcheck.run import launcher, probe

    if args.dump is not None:
        if shutil.which("py-spy") is None:
            print("--dump needs py-spy on the PATH (pip install py-spy)", file=sys.stderr)
            return 2
        _dump_before_kill(args.dump)
    if args.no_gate:
        launcher.ForkGate.wait = lambda self, timeout_s=0.0: True  # type: ignore[method-assign]
    config = load_config(None, ["train.steps=1", "metrics.warmup_steps=0", "metrics.replay_every=0",
                                f"distributed.nproc={args.nproc}", f"distributed.startup_timeout_s={args.startup_timeout}"])
    stalls, started = 0, time.time()
    with tempfile.TemporaryDirectory(prefix="startup-stalls-") as tmp:
        for index in range(args.launches):
            run_dir = Path(tmp) / f"launch-{index}"
            result, _ = probe.run_probe(config, run_dir)
            attempts = result.timing.launch_attempts if result is not None else 0
            stalls += attempts > 1
            status = result.status if result is not None else "none"
            print(f"[{time.time() - started:6.0f}s] launch {index}: {status}, launch attempts {attempts}", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
    print(summary(stalls, args.launches, gated=not args.no_gate))
    return 0


if __name__ == "__main__":
    sys.exit(main())

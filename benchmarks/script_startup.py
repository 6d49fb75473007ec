"""What a small ``--script`` probe's wall time gains from the launcher's preload and from ``--no-plots``.

Runs ``healthcheck probe --script CLIENT`` as a user would, a fresh process each time, in three arms, alternated
round by round so that the host's drift falls on every arm alike:

* ``default``: as shipped; the launcher imports the Hugging Face libraries the script imports before it forks
  the workers (``healthcheck/run/script_preload.py``), and the report draws its PNG plots;
* ``no-preload``: the same, with the preload turned off, so every worker imports those libraries itself;
* ``no-plots``: the default with ``--no-plots``;
* ``teardown``: the default, leaving through ``sys.exit(main())`` as the console script did before 2026-11-28, so
  the interpreter frees every module before the process ends (``healthcheck.cli.run`` skips that).

It prints each arm's median seconds and its ratio to ``default``. The client is ``tests/clients/hf_trainer.py``
(``transformers.Trainer``) unless ``--client`` names another of ``tests/clients``; it trains a tiny Llama that
``tests/clients/make_model.py`` writes (``--model DIR``, made there when missing) on ``--data``.

    python benchmarks/script_startup.py --rounds 3
    python benchmarks/script_startup.py --rounds 3 --client ddp_tutorial --nproc 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLIENTS = REPO / "tests" / "clients"
ARMS = ("default", "no-preload", "no-plots", "teardown")
#: ``python -m healthcheck`` with the preload turned off: warm_parent_caches calls it through the module's name.
NO_PRELOAD = (
    "import sys, healthcheck.run.probe as probe; probe.preload_script_imports = lambda path: []; "
    "from healthcheck.cli import run; run(sys.argv[1:])"
)
#: ``python -m healthcheck`` leaving with the interpreter's teardown.
TEARDOWN = "import sys; from healthcheck.cli import main; sys.exit(main(sys.argv[1:]))"


def probe_command(arm: str, client: str, nproc: int, steps: int, model: Path, data: Path, out: Path) -> list[str]:
    python = {"no-preload": [sys.executable, "-c", NO_PRELOAD], "teardown": [sys.executable, "-c", TEARDOWN]}.get(
        arm, [sys.executable, "-m", "healthcheck"])
    return [
        *python, "probe", "--script", str(CLIENTS / f"{client}.py"), "--out", str(out), "--audits-only",
        *(["--no-plots"] if arm == "no-plots" else []),
        "--set", f"distributed.nproc={nproc}", "--set", f"train.steps={steps}", "--set", "metrics.warmup_steps=1",
        "--", "--model", str(model), "--data", str(data), "--steps", str(steps * 10), "--log", str(out.parent / "loss.jsonl"),
    ]


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"probe failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="probes per arm, alternated (default 3)")
    parser.add_argument("--client", default="hf_trainer", help="a script in tests/clients (default hf_trainer)")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "tiny-llama")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "gsm8k_alpaca.json")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        sys.path.insert(0, str(CLIENTS))
        from make_model import make_tiny_llama

        make_tiny_llama(str(args.model))
    times: dict[str, list[float]] = {arm: [] for arm in args.arms}
    for _ in range(args.rounds):
        for arm in args.arms:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "run"
                times[arm].append(timed(probe_command(arm, args.client, args.nproc, args.steps, args.model, args.data, out)))
    base = statistics.median(times[args.arms[0]])
    print(f"{'arm':<12} {'median s':>9} {'ratio':>6}  runs ({args.client}, {args.nproc} ranks, {args.steps} steps)")
    for arm in args.arms:
        median = statistics.median(times[arm])
        print(f"{arm:<12} {median:>9.2f} {median / base:>6.2f}  " + " ".join(f"{t:.2f}" for t in times[arm]))


if __name__ == "__main__":
    main()

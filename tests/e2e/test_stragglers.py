"""A straggler under DDP on a host with more ranks than cores (4 CPU ranks on 2 cores in CI).

A rank that sleeps while the others compute hands its share of the cores to them, so most of its sleep never
shows as lateness in wall time, and a rank's wall time varies by ±15% a step with the scheduling. busy_ms leaves
out the time the rank's thread waited for a core (healthcheck/measure/runqueue.py); this probe fails without
that (checked: the same fault went unnoticed in 13 of 20 seeded 60-step 8-rank probes; this 4-rank probe with
nothing subtracted passed, the faulted rank at 1.147x but not persistent; with the subtraction it read 1.30-1.38x,
slower in 27-28 of 28 steps, in 3 runs). Where the kernel or sandbox gives no run-queue clock, the audit
must say it could not judge instead of passing: which branch applies is read here, independently of the probe.
"""

from __future__ import annotations

import json
import statistics

from healthcheck.measure import runqueue
from tests.e2e.conftest import read_rows, run_cli

WORLD = 4


def test_a_sleeping_rank_is_named_under_ddp_on_a_shared_host(tmp_path):
    out = tmp_path / "run"
    done = run_cli("probe", "--out", str(out), "--audits-only", "--set", f"distributed.nproc={WORLD}", "--set", "train.steps=30",
                   "--set", "metrics.replay_every=0", "--set", "rank_overrides={2: {faults: {step_sleep_ms: 50}}}")
    assert (out / "verdict.json").exists(), f"exit {done.returncode}\n" + done.stdout[-2500:] + done.stderr[-1500:]
    rows = read_rows(out / "steps.jsonl")
    timed = [r for r in rows if r["step"] >= 2]

    # What the audit saw, for a failure message: per rank, median busy_ms and median run-queue wait left out.
    def medians(rank: int) -> tuple[float, float | None]:
        waits = [r["runq_ms"] for r in timed if r["rank"] == rank and r.get("runq_ms") is not None]
        return statistics.median(r["busy_ms"] for r in timed if r["rank"] == rank), statistics.median(waits) if waits else None

    seen = {rank: medians(rank) for rank in range(WORLD)}
    context = f"busy_ms, runq_ms medians per rank: {seen}\n" + done.stdout[-2500:] + done.stderr[-1500:]
    verdict = json.loads((out / "verdict.json").read_text())
    stragglers = next(f for f in verdict["findings"] if f["check"] == "audit.stragglers")
    if runqueue.read() is not None or not runqueue.cores_shared(WORLD):
        assert all(r.get("runq_ms") is not None for r in timed), context
        assert done.returncode == 1, context
        failed = {f["check"]: f["ranks"] for f in verdict["findings"] if not f["passed"]}
        assert failed == {"audit.stragglers": [2]}, context
    else:  # shared cores and no clock on this host: a pass would be a false all-clear
        assert all("runq_ms" in r and r["runq_ms"] is None for r in timed), context
        assert done.returncode == 0 and not stragglers["measured"], context
        assert stragglers["message"].startswith(f"not measured: ranks 0-{WORLD - 1} share their host's cores"), context

"""A straggler under DDP on a host with more ranks than cores (8 CPU ranks on 2 cores in CI).

A rank that sleeps while the others compute hands its share of the cores to them, so most of its sleep never
shows as lateness in wall time, and a rank's wall time varies by ±15% a step with the scheduling. busy_ms leaves
out the time the rank's thread waited for a core (healthcheck/measure/runqueue.py); this probe fails without
that (checked: the same fault on the same rank went unnoticed in 13 of 20 seeded 60-step probes).
"""

from __future__ import annotations

import json

from tests.e2e.conftest import run_cli


def test_a_sleeping_rank_is_named_under_ddp_on_a_shared_host(tmp_path):
    out = tmp_path / "run"
    done = run_cli("probe", "--out", str(out), "--audits-only", "--set", "train.steps=30", "--set", "metrics.replay_every=0",
                   "--set", "rank_overrides={5: {faults: {step_sleep_ms: 50}}}")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    verdict = json.loads((out / "verdict.json").read_text())
    failed = {f["check"]: f["ranks"] for f in verdict["findings"] if not f["passed"]}
    assert failed == {"audit.stragglers": [5]}, failed

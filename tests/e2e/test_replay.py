"""The real CLI with a bad device: a short 4-rank probe whose rank 1 computes its matmuls 1e-3 off from step 3.

The replay audit must fail, name rank 1 and the step, say how far off and that a second replay reproduced
it, stop the probe there (fail fast), and exit 1; the report must carry the same sentence and the advice.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import run_cli

pytestmark = pytest.mark.e2e

FAULTY = 1


def test_bad_device_is_named_by_the_replay_audit(tmp_path):
    out = tmp_path / "bad-device"
    done = run_cli(
        "probe", "--audits-only", "--out", out,
        "--set", "train.steps=12", "--set", "distributed.nproc=4", "--set", "metrics.warmup_steps=1",
        "--set", "metrics.replay_every=5",
        "--set", f"rank_overrides={{{FAULTY}: {{faults: {{matmul_error: 0.001, matmul_error_from_step: 3}}}}}}",
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    replay = result["audits"]["replay"]
    assert not replay["passed"] and replay["ranks"] == [FAULTY] and replay["signature"] == f"differs {FAULTY}"
    assert replay["mode"] == "bitwise" and replay["replay_steps"] == [0, 5]
    assert replay["message"].startswith(f"rank {FAULTY} computed a different gradient at step 5")
    assert "reproduced on a second replay (persistent)" in replay["message"]
    assert result["stopped_early"]["check"] == "replay" and result["stopped_early"]["step"] == 5
    # Nothing else may take the credit: the parameters stay equal (DDP averages the slightly wrong gradient).
    failed = {name for name, audit in result["audits"].items() if not audit["passed"]}
    assert failed == {"replay"}, failed
    report = (out / "report.md").read_text()
    assert "relative L2 1." in report and "drain the node and rerun `healthcheck probe` on the rest" in report

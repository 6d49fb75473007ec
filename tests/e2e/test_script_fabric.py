"""Lightning Fabric, the loop LitGPT's finetuning scripts are written on, probed unmodified
(``tests/clients/fabric_loop.py``): ``fabric.setup`` wraps DDP inside its ``_FabricModule``, accumulation runs under
``fabric.no_backward_sync`` and clipping through ``fabric.clip_gradients``; with ``--strategy fsdp2``, Fabric's
``ModelParallelStrategy`` shards the model with ``fully_shard`` in its ``parallelize_fn``.

Nothing in healthcheck knows Fabric: these show that what it hooks (DDP's communication hook, FSDP2's
reduce-scatters, the optimizer's step, ``clip_grad_norm_``) is what Fabric runs.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import failed_findings, failed_ranks, read_rows, run_cli
from tests.e2e.test_script_mode import DATA, probe_args, tiny_llama  # noqa: F401 (tiny_llama is a fixture)

pytest.importorskip("lightning")
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")


def test_a_fabric_loop_is_measured_and_a_rank_whose_loss_is_doubled_is_named(tiny_llama, tmp_path):  # noqa: F811
    # Every other audit passes: Fabric's accumulation under no_backward_sync and its clipping raise no false alarm.
    out, log = tmp_path / "run", tmp_path / "loss.jsonl"
    done = run_cli(*probe_args("fabric_loop", out, tiny_llama, log, steps=3, extra=("--no-fail-fast",),
                               script_args=("--bug", "loss-x2-rank=1")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.loss_weight": [1]}, failed_ranks(out)
    result = json.loads((out / "result.json").read_text())
    facts = result["audits"]["environment"]["facts"]
    assert facts["clip"] == "clip_grad_norm_ max_norm=1 norm_type=2", facts["clip"]
    assert result["audits"]["param_equality"]["passed"] and result["audits"]["replay"]["measured"]
    # The script logs the mean of its two micro-batches' losses, the probe their token-weighted mean: close, not equal.
    own = [row["loss"] for row in read_rows(log)]
    probed = [row["loss"] for row in read_rows(out / "steps.jsonl") if row["rank"] == 0]
    assert len(probed) == 3 and all(abs(p - o) < 0.05 * o for p, o in zip(probed, own)), (probed, own)


def test_fabrics_fsdp2_strategy_names_a_rank_with_its_own_clipping_before_it_steps(tiny_llama, tmp_path):  # noqa: F811
    # Under FSDP2 each rank clips its own shard with a norm reduced over every rank: a rank with another max_norm
    # scales only its shard, and no replica shows it.
    out = tmp_path / "run"
    done = run_cli(*probe_args("fabric_loop", out, tiny_llama, tmp_path / "loss.jsonl", steps=3,
                               script_args=("--strategy", "fsdp2", "--bug", "clip-rank=2")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = failed_findings(out)
    assert list(failed) == ["audit.environment"] and failed["audit.environment"]["ranks"] == [2], failed
    assert ("clip differs: ranks 0-1, 3 clip_grad_norm_ max_norm=1 norm_type=2; rank 2 clip_grad_norm_ max_norm=0.1"
            in failed["audit.environment"]["message"]), failed["audit.environment"]["message"]
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_early"] and result["steps_completed"] <= 1, (result["stopped_early"], result["steps_completed"])

"""PyTorch Lightning's ``Trainer(strategy="ddp")``, and its FSDP2 strategy, probed unmodified
(``tests/clients/lightning_ddp.py``).

Lightning runs each step's forward and backward inside ``optimizer.step(closure)`` and routes the DDP model's
forward to ``training_step``. Before, the probe refused it (exit 2, "stepped its optimizer before a forward through
its DistributedDataParallel model"), and once past that, its replay called the module's own ``forward``, which a
LightningModule need not define (exit 3).
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import failed_ranks, read_rows, run_cli
from tests.e2e.test_script_mode import DATA, probe_args, tiny_llama  # noqa: F401 (tiny_llama is a fixture)

pytest.importorskip("lightning")
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")


def test_a_lightning_trainer_is_measured_and_a_rank_whose_loss_is_doubled_is_named(tiny_llama, tmp_path):  # noqa: F811
    # Every other audit passes: Lightning's own training raises no false alarm.
    out, log = tmp_path / "run", tmp_path / "loss.jsonl"
    done = run_cli(*probe_args("lightning_ddp", out, tiny_llama, log, extra=("--no-fail-fast",), steps=5,
                               script_args=("--bug", "loss-x2-rank=1")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.loss_weight": [1]}, failed_ranks(out)
    result = json.loads((out / "result.json").read_text())
    assert result["audits"]["replay"]["measured"] is False and "training_step" in result["audits"]["replay"]["message"]
    # The probe's rank-0 loss of each step (rank 0's is not doubled) is the one the Trainer returned to the callback
    # after that step.
    own = {row["step"]: row["loss"] for row in read_rows(log)}
    probed = {row["step"]: row["loss"] for row in read_rows(out / "steps.jsonl") if row["rank"] == 0}
    assert len(own) >= 4 and all(probed[step - 1] == pytest.approx(loss, rel=1e-5) for step, loss in own.items()), (own, probed)


def test_lightnings_fsdp2_strategy_is_measured_and_a_rank_whose_loss_is_doubled_is_named(tiny_llama, tmp_path):  # noqa: F811
    # ModelParallelStrategy with fully_shard in configure_model: the reduce-scatters carry the gradients, and the
    # forward Lightning routes to training_step still gives each rank's loss and its weight in the backward.
    out, log = tmp_path / "run", tmp_path / "loss.jsonl"
    done = run_cli(*probe_args("lightning_ddp", out, tiny_llama, log, steps=4,
                               script_args=("--strategy", "fsdp2", "--bug", "loss-x2-rank=2")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.loss_weight": [2]}, failed_ranks(out)
    result = json.loads((out / "result.json").read_text())
    assert result["audits"]["sharded_state"]["passed"] and result["audits"]["param_equality"]["measured"] is False
    own = {row["step"]: row["loss"] for row in read_rows(log)}  # rank 0's loss, not doubled
    probed = {row["step"]: row["loss"] for row in read_rows(out / "steps.jsonl") if row["rank"] == 0}
    assert len(own) >= 3 and all(probed[step - 1] == pytest.approx(loss, rel=1e-5) for step, loss in own.items()), (own, probed)

"""TRL's DPOTrainer probed unmodified (``tests/clients/trl_dpo.py``): its objective is no token loss.

DPO computes per-token log-probs with the same fused head as TRL's SFTTrainer, which the loss capture reads as
a token loss. Before, each rank's "loss" was their mean NLL (6.23 on the tiny Llama, where DPO's loss was 0.693),
reported as measured. The backward tells them apart: it pushes the chosen tokens up and the rejected ones down.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import failed_ranks, read_rows, run_cli
from tests.e2e.test_script_mode import DATA, probe_args, tiny_llama  # noqa: F401 (tiny_llama is a fixture)

pytest.importorskip("trl")
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")


def test_a_dpo_trainers_loss_is_not_measured_and_says_why_while_its_gradients_are(tiny_llama, tmp_path):  # noqa: F811
    out, log = tmp_path / "run", tmp_path / "loss.jsonl"
    done = run_cli(*probe_args("trl_dpo", out, tiny_llama, log, steps=3, extra=("--set", "distributed.nproc=2")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert "a preference or RL objective, such as DPO's" in result["loss_note"], result["loss_note"]
    weight = result["audits"]["loss_weight"]["message"]  # for the loss's reason, not the weights'
    assert weight.startswith("not measured: the loss itself was not measured (step 0: micro-batch 0: the backward"), weight
    rows = read_rows(out / "steps.jsonl")
    assert len(rows) == 6 and all(row["loss"] is None and row["grad_norm"] > 0 for row in rows), rows
    assert result["audits"]["param_equality"]["passed"] and result["audits"]["data_shards"]["passed"]
    # The reference TRL copies from the model is compared too (healthcheck/integrations/script/other_models.py).
    assert result["audits"]["environment"]["facts"]["other_model.LlamaForCausalLM"].startswith("21 tensors, bits ")
    # The trainer's own loss, for the record: DPO's starts at log 2, far from any token NLL.
    assert [row["loss"] for row in read_rows(log)][0] == pytest.approx(0.6931, abs=1e-3)


def test_a_dpo_loss_reported_with_record_loss_is_the_trainers(tiny_llama, tmp_path):  # noqa: F811
    # The opt-in the loss note names: each rank's DPO loss over its pairs, from the trainer's compute_loss.
    out, log = tmp_path / "run", tmp_path / "loss.jsonl"
    done = run_cli(*probe_args("trl_dpo", out, tiny_llama, log, steps=3, extra=("--set", "distributed.nproc=2"),
                               script_args=("--record-loss",)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["loss_note"] is None and result["audits"]["loss_weight"]["passed"], result["audits"]["loss_weight"]
    rows, own = read_rows(out / "steps.jsonl"), {entry["step"]: entry["loss"] for entry in read_rows(log)}
    for step in range(2):  # the probe ends inside its last step, before the trainer logs it
        ranks = [r for r in rows if r["step"] == step]
        rebuilt = sum(r["loss"] * r["tokens"] for r in ranks) / sum(r["tokens"] for r in ranks)
        assert rebuilt == pytest.approx(own[step + 1], rel=1e-5), (step, rebuilt, own)


def test_a_rank_whose_reference_model_is_another_checkpoint_is_named(tiny_llama, tmp_path):  # noqa: F811
    # DPOTrainer(ref_model=...) from a folder, and rank 0's node holds another revision of it. DDP keeps the trained
    # weights equal and the replay re-runs the trained model only: every check passed, on a loss computed otherwise.
    from make_model import make_tiny_llama  # tests/clients, on the path since the tiny_llama fixture

    other = make_tiny_llama(str(tmp_path / "other-revision"), seed=1)
    out, log = tmp_path / "run", tmp_path / "loss.jsonl"
    done = run_cli(*probe_args("trl_dpo", out, tiny_llama, log, steps=3, extra=("--set", "distributed.nproc=3"),
                               script_args=("--ref-model", str(tiny_llama), "--ref-model-rank", f"0:{other}")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.environment": [0]}
    message = json.loads((out / "result.json").read_text())["audits"]["environment"]["message"]
    assert message.startswith("other_model.LlamaForCausalLM differs: ranks 1-2 21 tensors, bits "), message
    assert "; rank 0 21 tensors, bits " in message and message.count("differs") == 1, message

"""LoRA fine-tunes probed unmodified: peft's ``get_peft_model`` under ``transformers.Trainer``, and TRL's own
``SFTTrainer(peft_config=...)``.

The base model is frozen, so DDP reduces the adapters' gradients alone, and the Trainer wraps a ``PeftModel``
(no ``PreTrainedModel``) with ``find_unused_parameters=True``. The probe measures the adapters' local gradients
(equal to a float64 reference from per-parameter hooks) and checks every parameter, the frozen base included.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import failed_ranks, read_rows
from tests.e2e.test_script_mode import (
    probe_args,
    reference_metrics,
    run_with_reference,
    tiny_llama,  # noqa: F401 - a fixture
)

pytest.importorskip("peft")
STEPS, RANKS = 4, 3
#: The tiny Llama's 2 layers: 9 base tensors each, the embeddings, the final norm and the head; 2 LoRA factors on
#: each of 4 attention projections per layer.
BASE_TENSORS, LORA_TENSORS = 21, 16


def lora_probe(client, out, model, log, *script_args: str, reference=None):
    args = probe_args(client, out, model, log, steps=STEPS, script_args=("--lora", "4", *script_args),
                      extra=("--set", f"distributed.nproc={RANKS}", "--set", "metrics.direction=exact"))
    return run_with_reference(reference, args)


# TRL's model returns a loss it does not train on (it trains on fused log-probs), and DDP's find_unused_parameters
# routes that output through _DDPSink, whose backward hands it an undefined gradient: the loss-weight probe on it read
# None and every rank ended in AttributeError (exit 3) on a script that trains fine alone.
@pytest.mark.parametrize("client", ["hf_trainer", "trl_sft"])
def test_the_adapters_gradients_are_measured_and_every_parameter_checked(client, tiny_llama, tmp_path):  # noqa: F811
    out, dump, log = tmp_path / "run", tmp_path / "reference", tmp_path / "loss.jsonl"
    done = lora_probe(client, out, tiny_llama, log, reference=dump)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["steps_completed"] == STEPS and result["loss_note"] is None
    audits = result["audits"]
    assert all(entry["passed"] for entry in audits.values()), {k: v["message"] for k, v in audits.items()}
    # The frozen base is hashed with the adapters: a node that loaded another base checkpoint would show there.
    assert audits["param_equality"]["tensors"] == BASE_TENSORS + LORA_TENSORS, audits["param_equality"]
    assert "bit-identical" in audits["replay"]["message"], audits["replay"]
    assert {rank["gradient_source"] for rank in result["environment"]["ranks"]} == {"comm_hook"}
    rows = read_rows(out / "steps.jsonl")
    for step in range(STEPS):
        norms, to_mean, _ = reference_metrics(tmp_path / "reference", step, RANKS)
        by_rank = {r["rank"]: r for r in rows if r["step"] == step}
        for rank in range(RANKS):
            assert by_rank[rank]["grad_norm"] == pytest.approx(float(norms[rank]), rel=1e-5), (step, rank)
            assert by_rank[rank]["cosine_to_mean"] == pytest.approx(float(to_mean[rank]), abs=1e-5), (step, rank)
    own = {entry["step"]: entry["loss"] for entry in read_rows(log)}
    for step in range(STEPS - 1):  # the framework's logged loss, token-weighted from the ranks' rows
        ranks = [r for r in rows if r["step"] == step]
        rebuilt = sum(r["loss"] * r["tokens"] for r in ranks) / sum(r["tokens"] for r in ranks)
        assert rebuilt == pytest.approx(own[step + 1], rel=1e-4), (step, rebuilt, own)


def test_a_rank_whose_adapters_scale_otherwise_is_named_before_it_trains(tiny_llama, tmp_path):  # noqa: F811
    # Rank 1's lora_alpha is twice the others': the same parameters, another function. Only the replay audit saw it,
    # and it advised draining a sound node; the adapter's settings are now compared with the model's own.
    out = tmp_path / "run"
    done = lora_probe("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", "--lora-alpha-rank", "1",
                      reference=tmp_path / "reference")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.environment": [1]}
    result = json.loads((out / "result.json").read_text())
    message = result["audits"]["environment"]["message"]
    assert message == "model.adapter.default.lora_alpha differs: ranks 0, 2 8; rank 1 16", message
    assert result["stopped_early"]["step"] == 0 and result["steps_completed"] == 0

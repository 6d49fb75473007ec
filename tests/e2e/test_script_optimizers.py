"""A script that steps two optimizers per update, as nanochat does (Muon for the matrices, AdamW for the rest).

Each ``step()`` updates the model's parameters; the second one used to be taken for the next probe step, and the
monitor, asked for a step's gradients no backward had produced, ended every rank in exit 3.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import failed_findings, read_rows, run_cli
from tests.e2e.test_script_mode import (
    CLIENTS,
    probe_args,
    reference_metrics,
    run_with_reference,
    tiny_llama,  # noqa: F401 - a fixture
)

STEPS, RANKS = 4, 3


def muon_probe(out, model, log, reference, *script_args: str):
    args = probe_args("ddp_tutorial", out, model, log, steps=STEPS, script_args=("--muon", *script_args),
                      extra=("--set", f"distributed.nproc={RANKS}", "--set", "metrics.direction=exact"))
    return run_with_reference(reference, args)


def test_two_optimizers_make_one_probe_step(tiny_llama, tmp_path):  # noqa: F811
    out, dump = tmp_path / "run", tmp_path / "reference"
    done = muon_probe(out, tiny_llama, tmp_path / "loss.jsonl", dump)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["steps_completed"] == STEPS
    audits = result["audits"]
    assert all(entry["passed"] for entry in audits.values()), {k: v["message"] for k, v in audits.items()}
    rows = read_rows(out / "steps.jsonl")
    for step in range(STEPS):  # each probe step's gradients are that update's backward's (one per update)
        norms, to_mean, _ = reference_metrics(dump, step, RANKS)
        by_rank = {r["rank"]: r for r in rows if r["step"] == step}
        for rank in range(RANKS):
            assert by_rank[rank]["grad_norm"] == pytest.approx(float(norms[rank]), rel=1e-5), (step, rank)
            assert by_rank[rank]["cosine_to_mean"] == pytest.approx(float(to_mean[rank]), abs=1e-5), (step, rank)


def test_a_rank_whose_second_optimizer_differs_is_named(tiny_llama, tmp_path):  # noqa: F811
    # Rank 1's AdamW (the second optimizer) has ten times the others' learning rate. Its settings are read when it
    # joins the first update and judged with the environment at the end; the parameters then differ too.
    out = tmp_path / "run"
    done = muon_probe(out, tiny_llama, tmp_path / "loss.jsonl", tmp_path / "reference", "--bug", "adamw-lr-rank=1")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = failed_findings(out)
    assert failed["audit.environment"]["ranks"] == [1]
    assert failed["audit.environment"]["message"] == "optimizer#2.lr differs: ranks 0, 2 0.001; rank 1 0.01"
    assert failed["audit.param_equality"]["ranks"] == [1]


def zero_probe(out, mode: str, *options: str):
    return run_cli("probe", "--script", str(CLIENTS / "tiny_ddp.py"), "--out", str(out), "--audits-only", "--no-plots", *options, "--set",
                   f"distributed.nproc={RANKS}", "--set", "train.steps=6", "--set", "metrics.warmup_steps=1", "--",
                   "--mode", mode, "--steps", "20")


def test_zero_redundancy_optimizer_steps_are_probe_steps(tmp_path):
    # PyTorch's ZeRO tutorial: ZeroRedundancyOptimizer wraps SGD; each rank steps its own partition (an inner
    # optimizer's step inside the wrapper's) and broadcasts it. One probe step per update, replicas bit-identical.
    done = zero_probe(tmp_path / "run", "zero")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps_completed"] == 6 and all(a["passed"] for a in result["audits"].values()), result["audits"]
    assert result["audits"]["learning_rate"]["message"] == "ranks 0-2 stepped with the same learning rate at every one of 6 steps (0.1)"


@pytest.mark.parametrize("fail_fast", [True, False])
def test_a_rank_whose_second_parameter_group_warms_up_otherwise_is_named(tmp_path, fail_fast):
    # Weights and biases in two groups, the warmup on the biases' only, over 8 steps on rank 1 and over 4 on the
    # others: the first group's rate agrees everywhere, and ZeroRedundancyOptimizer keeps the replicas identical.
    # The probe passed while the rates read were the first group's; each step's digest of every group's names it.
    out = tmp_path / "run"
    done = zero_probe(out, "zero-bias-warmup=1", *([] if fail_fast else ["--no-fail-fast"]))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    audit = result["audits"]["learning_rate"]
    assert {k for k, a in result["audits"].items() if not a["passed"]} == {"learning_rate"}, result["audits"]
    assert audit["ranks"] == [1] and audit["message"].startswith(
        "rank 1 stepped with another learning rate in a later parameter group from step 1"), audit
    assert (result["stopped_early"] or {}).get("step") == (1 if fail_fast else None), result["stopped_early"]
    rows = read_rows(out / "steps.jsonl")
    assert {row["lr"] for row in rows} == {0.1} and len({row["lr_groups"] for row in rows if row["step"] == 1}) == 2


def test_a_rank_with_its_own_warmup_under_zero_is_named_at_the_first_step_it_differs(tmp_path):
    # Rank 2 warms up over 8 steps, the others over 4: every rank starts at lr 0 (the environment audit agrees), and
    # ZeroRedundancyOptimizer broadcasts each partition from its owner, so the parameters stay bit-identical while rank
    # 2's partition trains at half the rate. Before the learning-rate audit the probe passed.
    done = zero_probe(tmp_path / "run", "zero-warmup=2")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert {k for k, a in result["audits"].items() if not a["passed"]} == {"learning_rate"}, result["audits"]
    assert result["audits"]["learning_rate"]["ranks"] == [2] and result["audits"]["param_equality"]["measured"]
    assert result["stopped_early"]["check"] == "learning_rate" and result["stopped_early"]["step"] == 1
    assert result["audits"]["learning_rate"]["message"].startswith(
        "rank 2 stepped with another learning rate from step 1: ranks 0-1 0.025; rank 2 0.0125"), result["audits"]["learning_rate"]


def test_a_compiled_training_step_is_measured(tiny_llama, tmp_path):  # noqa: F811
    # The whole batch compiled as one function (forward, loss, backward, clip, step), as PyTorch's compiled-autograd
    # tutorial compiles its `train`; dynamo alone here (the "eager" backend), inductor by hand. Dynamo traced the probe's
    # global step hooks with the step (every rank crashed at step 0, exit 3, "UnsafeScriptObjectError ...
    # ProcessGroup"), compiled the DDP communication hook the backward runs from inside that function (the same
    # crash), and traced the clip's recording on fake tensors (`clip` read `none`). The compiled-optimizer recipe alone
    # (`--compile-step`) is tests/unit/integrations/test_closures.py's. Two ranks: the compile is most of the run.
    out = tmp_path / "run"
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=2,
                               extra=("--set", "distributed.nproc=2"),
                               script_args=("--compile-batch", "eager", "--clip", "1")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["steps_completed"] == 2 and result["audits"]["replay"]["passed"], result["audits"]["replay"]
    assert result["audits"]["environment"]["facts"]["clip"] == "clip_grad_norm_ max_norm=1 norm_type=2"
    # The loss is computed inside the compiled function: not measured, and said so; the gradients are measured.
    assert "inside a torch.compile'd region" in result["loss_note"], result["loss_note"]
    assert all(row["grad_norm"] > 0 for row in read_rows(out / "steps.jsonl")), "no gradient measured"

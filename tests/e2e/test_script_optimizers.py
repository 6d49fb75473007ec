"""A script that steps two optimizers per update, as nanochat does (Muon for the matrices, AdamW for the rest).

Each ``step()`` updates the model's parameters; the second one used to be taken for the next probe step, and the
monitor, asked for a step's gradients no backward had produced, ended every rank in exit 3.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import failed_findings, read_rows
from tests.e2e.test_script_mode import (
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

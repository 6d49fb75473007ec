"""fp16 mixed precision with a GradScaler, as PyTorch's AMP recipe writes it (tests/clients/amp_ddp.py, CPU autocast).

The scaler multiplies every gradient DDP reduces by its scale: the probe's norms are divided by it where every rank's
is the same, and the steps it skips (an inf gradient: no optimizer step) are not probe steps.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.conftest import read_rows, run_cli
from tests.e2e.test_script_mode import (
    CLIENTS,
    DATA,
    tiny_llama,  # noqa: F401 - a fixture
)

AMP = CLIENTS / "amp_ddp.py"
STEPS = 8


def probe(out, *script_args: str, nproc: int = 2):
    return run_cli("probe", "--script", str(AMP), "--out", str(out), "--audits-only", "--set", f"distributed.nproc={nproc}",
                   "--set", f"train.steps={STEPS}", "--set", "metrics.warmup_steps=1", "--", "--steps", "30", *script_args)


def rows_by_key(out):
    return {(r["step"], r["rank"]): r for r in read_rows(out / "steps.jsonl")}


@pytest.fixture(scope="module")
def unscaled_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("amp") / "no-scaler"
    done = probe(out, "--no-scaler")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def test_the_norms_are_the_unscaled_gradients(unscaled_run, tmp_path):
    # Scaling by a power of two is exact in fp16 short of overflow and underflow: with the scaler at 256 the
    # gradients are 256x the scaler-free run's, bit for bit but for underflow, and the probe reads them back.
    done = probe(tmp_path / "run", "--init-scale", "256")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    scaled, plain = rows_by_key(tmp_path / "run"), rows_by_key(unscaled_run)
    assert len(scaled) == len(plain) == 2 * STEPS
    for key, row in scaled.items():
        assert row["grad_scale"] == 256.0 and row["scaler_skips"] == 0.0, row
        assert row["grad_norm"] == pytest.approx(plain[key]["grad_norm"], rel=1e-4), key
        assert row["loss"] == pytest.approx(plain[key]["loss"], rel=1e-4), key
        assert plain[key]["grad_scale"] == 1.0  # GradScaler(enabled=False) reads 1: nothing to divide
    weight = json.loads((tmp_path / "run" / "result.json").read_text())["audits"]["loss_weight"]
    assert weight["passed"] and "(256 in each of 8 steps)" in weight["message"], weight


@pytest.mark.parametrize("fused", [False, True])
def test_steps_the_scaler_skips_are_not_probe_steps(fused, unscaled_run, tmp_path):
    # From 2**20 the first 5 steps overflow on every rank. The scaler then does not call optimizer.step(), or, for a
    # fused AdamW (which takes the scaling itself), calls it with found_inf set and the optimizer skips inside: before,
    # that counted as a probe step, its inf gradients failed `nonfinite` and the probe exited 1. The probe's step 0
    # is the script's step 5, with that step's own loss and weight (not the skipped steps' summed).
    done = probe(tmp_path / "run", "--init-scale", "1048576", *(["--fused"] if fused else []))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps_completed"] == STEPS and all(a["passed"] for a in result["audits"].values()), result["audits"]
    assert result["gradient_note"] is None, result["gradient_note"]  # the skipped backwards belong to no update
    rows, plain = rows_by_key(tmp_path / "run"), rows_by_key(unscaled_run)
    logged = dict(re.findall(r"step (\d+) loss (\S+) scale", (tmp_path / "run" / "logs" / "rank-0.log").read_text()))
    first = rows[(0, 0)]
    assert first["scaler_skips"] == 5.0 and first["grad_scale"] == 32768.0 and first["loss_weight"] == 32768.0, first
    assert first["loss"] == pytest.approx(float(logged["5"]), abs=1e-4), (first, logged)
    assert all(rows[(step, 0)]["scaler_skips"] == 0.0 for step in range(1, STEPS))
    for key, row in rows.items():  # other data and weights than the scaler-free run's, but the same units
        assert 0.5 < row["grad_norm"] / plain[key]["grad_norm"] < 2, (key, row["grad_norm"], plain[key]["grad_norm"])


@pytest.mark.parametrize("order, fused", [("first-layer-first", False), ("last-layer-first", True)])
def test_an_optimizer_the_scaler_skips_alone_leaves_the_step_unmeasured(order, fused, tmp_path):
    # One AdamW per Linear, both stepped through the scaler. From 2**20 the script's steps 0-2 overflow everywhere
    # (skipped whole) and steps 3-4 in the last layer alone: the scaler skips that layer's optimizer and the other
    # steps. Before, with the first layer's optimizer stepped first, the step's inf gradients failed `nonfinite`
    # (exit 1); in the other order the skip of the first optimizer discarded the step's gradients before the second
    # stepped on them, and every rank ended in exit 3 (unfused too: the fused one skips inside the optimizer's step,
    # the unfused one is not called, and both reach the same deferred skip). Now the two partly skipped updates are probe steps 0 and 1,
    # not measured, and said so; probe step 2 is the script's step 5.
    done = probe(tmp_path / "run", "--init-scale", "1048576", "--two-optimizers", order, *(["--fused"] if fused else []))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["steps_completed"] == STEPS and all(a["passed"] for a in result["audits"].values()), result["audits"]
    assert result["gradient_note"].startswith("steps 0, 1 not measured: the GradScaler found inf"), result["gradient_note"]
    log = (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    skipped = dict(re.findall(r"step (\d+) loss \S+ scale \d+ skipped (\[.*\])", log))
    last_layer = "[0]" if order == "last-layer-first" else "[1]"
    assert [skipped[str(s)] for s in range(6)] == ["[0, 1]"] * 3 + [last_layer] * 2 + ["[]"], skipped
    rows = rows_by_key(tmp_path / "run")
    assert sorted({step for step, _ in rows}) == list(range(2, STEPS)), sorted(rows)
    logged = dict(re.findall(r"step (\d+) loss (\S+) scale", log))
    assert rows[(2, 0)]["loss"] == pytest.approx(float(logged["5"]), abs=1e-4), (rows[(2, 0)], logged["5"])
    assert all(rows[key]["grad_scale"] == 32768.0 and rows[key]["scaler_skips"] == 0.0 for key in rows), rows


@pytest.mark.parametrize("odd", [0, 2])
def test_a_rank_with_another_scale_is_named(odd, tmp_path):
    # One rank's scaler starts at 512, the others' at 256: its gradient enters the all-reduce with twice the weight,
    # and each rank divides the mean by its own scale, so the parameters part at the first update.
    done = probe(tmp_path / "run", "--init-scale", "256", "--rank-scale", f"{odd}=512", nproc=3)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["audits"]["param_equality"]["ranks"] == [odd], result["audits"]["param_equality"]
    first = rows_by_key(tmp_path / "run")
    assert [first[(0, r)]["grad_scale"] for r in range(3)] == [512.0 if r == odd else 256.0 for r in range(3)]
    # The scales differ, so the norms stay as the reduction saw them: the odd rank's is about twice the others'.
    others = [first[(0, r)]["grad_norm"] for r in range(3) if r != odd]
    assert first[(0, odd)]["grad_norm"] > 1.5 * max(others), (first[(0, odd)]["grad_norm"], others)


def test_fsdp2_under_a_grad_scaler_reads_what_ddp_reads(tiny_llama, tmp_path):  # noqa: F811
    # FSDP2 takes every reduce-scatter of a step as a micro-batch and adds them: the skipped steps' inf gradients went
    # into the next step (exit 1, "non-finite gradient at step 0"). The session now discards a skipped step's numbers.
    # The same loop wrapped in DDP measures the same local gradients: the two agree step by step, rank by rank.
    rows = {}
    for wrap in ("fsdp", "ddp"):
        out = tmp_path / wrap
        done = run_cli("probe", "--script", str(CLIENTS / "fsdp2_tutorial.py"), "--out", str(out), "--audits-only",
                       "--set", "distributed.nproc=2", "--set", "train.steps=4", "--set", "metrics.warmup_steps=1", "--",
                       "--model", str(tiny_llama), "--data", str(DATA), "--steps", "40", "--log", str(tmp_path / f"{wrap}.jsonl"),
                       "--rows", "64", "--amp-scale", "1048576", "--wrap", wrap)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        rows[wrap] = rows_by_key(out)
    assert rows["fsdp"][(0, 0)]["scaler_skips"] == 5.0 and rows["fsdp"][(0, 0)]["grad_scale"] == 32768.0
    assert rows["fsdp"].keys() == rows["ddp"].keys() and len(rows["fsdp"]) == 8
    for key, row in rows["fsdp"].items():
        assert row["grad_norm"] == pytest.approx(rows["ddp"][key]["grad_norm"], rel=1e-3), key


def test_a_rank_whose_gradients_overflow_at_every_step_is_named(tmp_path):
    # Rank 1's loss is inf from the script's step 2 on: the all-reduce spreads the inf, every rank's scaler skips every
    # update, and the script ended short of the probe's steps: exit 3, "give it more data or steps", which would never
    # have helped. After 8 whole skips in a row the ranks compare whose own gradient overflowed, and stop there.
    out = tmp_path / "run"
    done = probe(out, "--init-scale", "1024", "--inf-rank", "1", nproc=3)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    stop = result["stopped_early"]
    assert (stop["step"], stop["check"], stop["unavoidable"]) == (2, "nonfinite", True), stop
    assert stop["message"].startswith("rank 1's own gradient was inf or NaN in each of the last 8 updates"), stop
    # The skipped updates wrote no rows, and the audit itself read "finite" beside the stop: it is the stop's now.
    nonfinite = result["audits"]["nonfinite"]
    assert not nonfinite["passed"] and nonfinite["ranks"] == [1] and nonfinite["message"] == stop["message"], nonfinite
    assert "Warning" not in done.stderr, done.stderr[-2000:]  # one step's plots: equal x limits warned on the terminal

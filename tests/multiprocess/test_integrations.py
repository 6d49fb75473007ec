"""HealthcheckCallback inside a real ``transformers.Trainer`` DDP run: 2 CPU/gloo ranks, tiny GPT-2.

Workers are module-level functions launched like torchrun through
``healthcheck.run.launcher.launch_local``; the Trainer builds its own process group (accelerate) and
DDP wrapper from the launcher's environment, exactly as under torchrun.

    python -m pytest tests/multiprocess/test_integrations.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from healthcheck.errors import BaselineError
from healthcheck.integrations.live_envelopes import WindowEnvelope, window_envelopes
from healthcheck.judge.baseline import Baseline, save_baseline
from healthcheck.judge.envelope import Envelope
from healthcheck.run import launcher

CLIENTS = Path(__file__).resolve().parents[1] / "clients"
SEQ_LEN = 24
BATCH = 2
GRAD_ACCUM = 2
MAX_STEPS = 6
LOSS_TOKENS_PER_STEP = BATCH * GRAD_ACCUM * (SEQ_LEN - 1)  # no padding: every shifted label counts


def _dataset(rank_count: int = 64):
    """Fixed-length causal-LM rows (labels = input_ids) from the built-in synthetic alpaca data."""
    from healthcheck.run.data import synthetic_rows
    from healthcheck.run.modeling import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    rows = []
    for row in synthetic_rows(rank_count, seed=1):
        text = f"{row['instruction']} {row['input']} {row['output']} " * 4
        ids = tokenizer(text)["input_ids"][:SEQ_LEN]
        rows.append({"input_ids": ids, "attention_mask": [1] * SEQ_LEN, "labels": list(ids)})
    return tokenizer, rows


def _collate(rows):
    import torch

    return {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}


def trainer_worker(output_dir: str, options: dict) -> dict:
    """Train MAX_STEPS steps with the callback; return what the test asserts on, from every rank."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from healthcheck.integrations import HealthcheckCallback
    from healthcheck.run.modeling import PRESETS

    tokenizer, rows = _dataset()
    options = dict(options)
    backend = options.pop("torch_compile_backend", None)
    init_scale = options.pop("fp16_init_scale", None)
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to=[], max_steps=MAX_STEPS,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=GRAD_ACCUM, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        torch_compile=backend is not None, torch_compile_backend=backend, fp16=init_scale is not None,
    )
    model = AutoModelForCausalLM.from_config(PRESETS["tiny-gpt2"][1](len(tokenizer), SEQ_LEN))
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=_collate)
    if init_scale is not None:
        # fp16 as accelerate runs it on a GPU (autocast fp16, a GradScaler in backward, unscale_ before clipping, the
        # step skipped on an overflow): on the host accelerate makes no scaler, so the test hands it a CPU one.
        import torch

        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        trainer.accelerator.native_amp = True
    callback = HealthcheckCallback.attach(trainer, **{"sketch_dim": 256, **options})
    trainer.train()
    return {
        "log_history": trainer.state.log_history,
        "global_step": trainer.state.global_step,
        "violations": callback.violations,
        "stopped_at_step": callback.stopped_at_step,
        "compute_loss_restored": "compute_loss" not in vars(trainer),
    }


def _healthcheck_rows(log_history):
    return [row for row in log_history if "healthcheck/loss_std" in row]


@pytest.mark.multiprocess
def test_callback_logs_consistency_metrics_through_the_trainer(tmp_path):
    out = launcher.launch_local(trainer_worker, 2, (str(tmp_path), {}), run_id="hc-callback-log")
    first, second = out[0], out[1]
    rows = _healthcheck_rows(first["log_history"])
    assert first["global_step"] == MAX_STEPS
    assert [row["step"] for row in rows] == list(range(1, MAX_STEPS + 1))
    for row in rows:
        # Untrained byte-level GPT-2 over a 258-token vocabulary: loss near ln(258) = 5.55.
        assert 4.0 < row["healthcheck/loss_mean"] < 7.0
        assert 0.0 < row["healthcheck/loss_std"] < 1.0
        assert row["healthcheck/loss_range"] == pytest.approx(2 * row["healthcheck/loss_std"], rel=1e-6)  # two ranks
        assert -1.0 <= row["healthcheck/cosine_mean"] < 1.0
        assert row["healthcheck/grad_norm_cv"] >= 0.0
        assert row["healthcheck/mean_grad_norm"] > 0.0
        # Both accumulated micro-batches of both ranks count: the metrics follow the last micro-step.
        assert row["healthcheck/tokens_total"] == 2 * LOSS_TOKENS_PER_STEP
    trainer_rows = [row for row in first["log_history"] if "grad_norm" in row]
    assert [row["step"] for row in trainer_rows] == [row["step"] for row in rows]  # its own log lines survive
    for ours, theirs in zip(rows, trainer_rows):
        # The Trainer's pre-clipping norm of the averaged gradient is the monitor's ||mean g||: measured
        # on the accumulated, all-reduced gradient of the same step.
        assert ours["healthcheck/mean_grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        # Its loss divides by labels incl. position 0 for GPT-2 (loss_type None), i.e. 24 per row
        # instead of the 23 the shifted loss uses; ours is the exact per-token mean.
        assert ours["healthcheck/loss_mean"] == pytest.approx(theirs["loss"], rel=0.06)
    assert _healthcheck_rows(second["log_history"]) == rows
    assert first["violations"] == [] and first["compute_loss_restored"]


@pytest.mark.multiprocess
def test_callback_measures_a_trainer_that_compiles_its_model(tmp_path):
    # TrainingArguments(torch_compile=True): accelerate wraps the DDP model in torch.compile, and the loss runs in
    # the compiled graph (aot_eager: dynamo's tracing without a C++ compile per rank). Both ways of reading the local
    # gradient: the comm hook (the host's default) and .grad (a GPU's, local_grads.py), whose forward hook on the DDP
    # model runs under dynamo: the same training, so the exact statistics agree and the sketched ones nearly.
    measured = {}
    for local_from in ("buckets", "grads"):
        out = launcher.launch_local(trainer_worker, 2, (str(tmp_path / local_from), {"torch_compile_backend": "aot_eager",
                                                                                      "local_from": local_from,
                                                                                      "sketch_dim": 4096}),
                                    run_id=f"hc-callback-compiled-{local_from}")
        rows = _healthcheck_rows(out[0]["log_history"])
        trainer_rows = [row for row in out[0]["log_history"] if "grad_norm" in row]
        assert out[0]["global_step"] == MAX_STEPS and [row["step"] for row in rows] == list(range(1, MAX_STEPS + 1))
        for ours, theirs in zip(rows, trainer_rows, strict=True):
            assert ours["healthcheck/tokens_total"] == 2 * LOSS_TOKENS_PER_STEP
            assert ours["healthcheck/mean_grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
            assert ours["healthcheck/loss_mean"] == pytest.approx(theirs["loss"], rel=0.06)
        assert _healthcheck_rows(out[1]["log_history"]) == rows
        measured[local_from] = rows
    for hook, grads in zip(measured["buckets"], measured["grads"], strict=True):
        for exact in ("loss_std", "grad_norm_std", "grad_norm_cv", "mean_grad_norm"):  # each rank's own ‖g_i‖, both ways
            assert grads[f"healthcheck/{exact}"] == pytest.approx(hook[f"healthcheck/{exact}"], rel=1e-4, abs=1e-7), exact
        # Two draws of the sketch (each tensor its own bucket on the .grad path), |Δcos| std <= sqrt(2/4093) each: 5 sigma
        # of the difference. A sketch of the averaged gradient would read 1.
        assert abs(grads["healthcheck/cosine_mean"] - hook["healthcheck/cosine_mean"]) < 0.15


@pytest.mark.multiprocess
def test_callback_under_fp16_reads_the_unscaled_gradient_and_drops_skipped_steps(tmp_path):
    # From 2**19 fp16 overflows: the GradScaler skips the first 2 steps (the Trainer still counts them, its grad_norm
    # inf or nan) and halves the scale until a step is finite. The reduced gradients carry the scale: the callback
    # divides it out, so its ||mean g|| is the Trainer's own pre-clipping norm (which accelerate unscales first).
    out = launcher.launch_local(trainer_worker, 2, (str(tmp_path), {"fp16_init_scale": 2.0**19}), run_id="hc-callback-fp16")
    rows = _healthcheck_rows(out[0]["log_history"])
    trainer_rows = [row for row in out[0]["log_history"] if "grad_norm" in row]
    finite = [row for row in trainer_rows if math.isfinite(row["grad_norm"])]
    assert out[0]["global_step"] == MAX_STEPS and len(finite) == MAX_STEPS - 2, trainer_rows
    assert [row["step"] for row in rows] == [row["step"] for row in finite]
    for ours, theirs in zip(rows, finite, strict=True):
        assert ours["healthcheck/mean_grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)
        assert ours["healthcheck/tokens_total"] == 2 * LOSS_TOKENS_PER_STEP
    assert _healthcheck_rows(out[1]["log_history"]) == rows


@pytest.mark.multiprocess
def test_stop_on_violation_stops_every_rank_early(tmp_path):
    # A mean pairwise cosine is at most 1, so an envelope above 1 must be violated.
    options = {
        "envelopes": {"cosine_mean": (1.5, 2.0)}, "stop_on_violation": True,
        "warmup_steps": 1, "window_steps": 3, "min_window_steps": 2,
    }
    out = launcher.launch_local(trainer_worker, 2, (str(tmp_path), options), run_id="hc-callback-stop")
    # Steps 0 (warmup) and 1, 2 fill the window; the check fails at the end of step index 2.
    for rank in (0, 1):
        assert out[rank]["global_step"] == 3 < MAX_STEPS
        assert out[rank]["stopped_at_step"] == 3
        assert "cosine_mean median" in out[rank]["violations"][0] and "below its envelope" in out[rank]["violations"][0]
    flagged = [row for row in out[0]["log_history"] if "healthcheck/violations" in row]
    assert [row["step"] for row in flagged] == [3]
    assert math.isfinite(flagged[0]["healthcheck/cosine_mean"])


def sft_worker(output_dir: str, model_dir: str, lora: bool = False) -> dict:
    """TRL's SFTTrainer (prompt/completion rows, completion_only_loss, accumulation 2) with the callback; with
    ``lora``, TRL's own LoRA path (``peft_config``)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from healthcheck.integrations import HealthcheckCallback
    from healthcheck.run.data import synthetic_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [{"prompt": f"### Instruction:\n{r['instruction']} {r['input']}\n\n### Response:\n", "completion": r["output"]}
            for r in synthetic_rows(128, seed=3)]
    args = SFTConfig(
        output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to=[], max_steps=MAX_STEPS,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=GRAD_ACCUM, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        completion_only_loss=True, max_length=128,
    )
    peft = {}
    if lora:
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, **peft)
    callback = HealthcheckCallback.attach(trainer, sketch_dim=256)
    trainer.train()
    return {"log_history": trainer.state.log_history, "loss_note": callback.loss_note}


@pytest.mark.multiprocess
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_callback_reports_the_real_per_rank_loss_under_trl(tmp_path, lora):
    # TRL computes its loss from the fused head's log-probs, divides by a global token count and
    # multiplies by the world size; the callback once reported world size x accumulation = 4x the
    # loss here. Now it must agree with TRL's own logged (token-weighted) loss. With LoRA, DDP's
    # find_unused_parameters hands the model's unused loss output an undefined gradient (loss_weight.py).
    import sys

    sys.path.insert(0, str(CLIENTS))
    try:
        from make_model import make_tiny_llama
    finally:
        sys.path.remove(str(CLIENTS))
    model_dir = make_tiny_llama(str(tmp_path / "model"))
    out = launcher.launch_local(sft_worker, 2, (str(tmp_path / "trainer"), model_dir, lora), run_id="hc-callback-trl")
    history = out[0]["log_history"]
    ours = _healthcheck_rows(history)
    theirs = [row for row in history if "loss" in row]
    assert out[0]["loss_note"] is None and len(ours) == MAX_STEPS
    assert [row["step"] for row in ours] == [row["step"] for row in theirs]
    for mine, trl in zip(ours, theirs):
        # healthcheck's mean of the two ranks' token-weighted losses against TRL's global token mean.
        assert mine["healthcheck/loss_mean"] == pytest.approx(trl["loss"], rel=0.01), (mine, trl)


# --------------------------------------------------------------------------- envelopes (no processes)


def _baseline() -> Baseline:
    return Baseline(
        name="job", created_at="2026-01-01T00:00:00Z", approved_by="ci", reason="test", healthcheck_version="0.1.0",
        torch_version="2", transformers_version="5", device_type="cpu", world_size=2, config={}, config_fingerprint="f",
        runs=[], envelopes={
            "loss_range": Envelope(statistic="p95", center=0.1, lower=0.05, upper=0.2),
            "cosine_mean": Envelope(statistic="median", center=0.8, lower=0.7, upper=0.9),
        },
    )


def test_envelopes_from_a_baseline_file_keep_each_statistic(tmp_path):
    save_baseline(_baseline(), tmp_path / "job.json")
    checks = window_envelopes(str(tmp_path / "job.json"))
    assert checks == [WindowEnvelope("loss_range", "p95", 0.05, 0.2), WindowEnvelope("cosine_mean", "median", 0.7, 0.9)]
    assert window_envelopes(_baseline()) == checks


def test_a_missing_baseline_file_is_a_baseline_error(tmp_path):
    with pytest.raises(BaselineError, match="no baseline found"):
        window_envelopes(tmp_path / "missing.json")


def test_plain_bounds_are_judged_on_the_median_and_validated():
    assert window_envelopes({"grad_norm_cv": (0.0, 0.3)}) == [WindowEnvelope("grad_norm_cv", "median", 0.0, 0.3)]
    with pytest.raises(ValueError, match="unknown metric 'grad_cv'"):
        window_envelopes({"grad_cv": (0.0, 0.3)})
    with pytest.raises(ValueError, match="lower 0.5 is above upper 0.1"):
        window_envelopes({"loss_std": (0.5, 0.1)})


def test_a_check_judges_its_statistic_over_the_window():
    spikes = [0.1] * 18 + [5.0] * 2  # one step in ten far off: the median hides it, the p95 does not
    assert WindowEnvelope("loss_range", "median", 0.0, 1.0).fails(spikes) is None
    assert "p95" in WindowEnvelope("loss_range", "p95", 0.0, 1.0).fails(spikes)
    assert WindowEnvelope("loss_range", "p95", 0.0, 1.0).fails([None, float("nan")]) is None

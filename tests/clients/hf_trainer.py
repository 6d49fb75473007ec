"""Causal-LM fine-tuning with transformers.Trainer (CPU, gloo), response-only labels.

torchrun --nproc_per_node 4 -- hf_trainer.py --model DIR --data JSON --steps 6 --log loss.jsonl

`--torch-compile-backend aot_eager` (or `inductor`) trains with `TrainingArguments(torch_compile=True)`;
`--gradient-checkpointing reentrant` with activation checkpointing as older scripts set it (`use_reentrant=True`);
`--label-smoothing 0.1` sets `label_smoothing_factor` (the Trainer then computes the loss with its `LabelSmoother`).
`--accum-rank R`: rank R accumulates 4 micro-batches per update where the others accumulate 2 (a per-node
`gradient_accumulation_steps` override; DDP's all-reduces still pair up, one per update).
`--sampling group_by_length` (or `sequential`) sets `train_sampling_strategy` (transformers 5's `group_by_length`).
`--lora R`: trains LoRA adapters of rank R on the attention projections (peft's `get_peft_model`), the base frozen;
the Trainer then wraps a `PeftModel`, which is no `PreTrainedModel`, so DDP gets `find_unused_parameters=True`.
`--bf16-rank R`: rank R trains with `bf16=True` (accelerate's bf16 autocast, entered inside the model's forward), as a
per-node launch config that switches it on would.
`--neftune-rank R`: rank R trains with `neftune_noise_alpha=5` (NEFTune: noise on the input embeddings, added by a
forward hook the Trainer registers), as a per-node launch config that switches it on would.
`--main-reports`: as many scripts do, the main process alone shows progress and logs at `info`
(`disable_tqdm=local_rank != 0`, `log_level="info" if local_rank == 0 else "warning"`), a clean habit.
`--override R:KEY=VALUE` (repeatable): rank R's `TrainingArguments.KEY` is VALUE, a per-node config (`1:max_grad_norm=0.5`).
`--output-dir DIR --save-steps N` keeps a checkpoint every N steps in DIR (`checkpoint-N`); `--resume DIR` sets
`resume_from_checkpoint`, which the script hands to `trainer.train` as transformers' example scripts do (a rank's
own copy: `--override R:resume_from_checkpoint=DIR`).
`--fsdp2`: `TrainingArguments(fsdp="full_shard auto_wrap", fsdp_config={"version": 2, ...})`, the Trainer's FSDP2 path
(accelerate's `fully_shard` per decoder layer, its DTensor gradient clipping and sharded optimizer), as on a GPU host:
see `cpu_fsdp.py`.
(`--` before the script: torchrun's own argparse would otherwise reject `--log` as an ambiguous abbreviation of
its `--log-dir` / `--logs-specs` options.) Knows nothing about healthcheck. Appends each logged per-step "loss"
(logging_steps=1) to --log as JSON lines on rank 0, as it is logged.
"""

import argparse
import json
import os
import tempfile

import torch
from cpu_fsdp import FSDP2_ARGS, FsdpOnCpu
from datasets import Dataset
from per_rank import apply_overrides
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments


class FsdpTrainer(FsdpOnCpu, Trainer):
    pass


def alpaca_prompt(row):
    if row.get("input"):
        return f"### Instruction:\n{row['instruction']}\n\n### Input:\n{row['input']}\n\n### Response:\n"
    return f"### Instruction:\n{row['instruction']}\n\n### Response:\n"


class LossFile(TrainerCallback):
    """Append each logged training loss to a JSON-lines file as it is logged (rank 0)."""

    def __init__(self, path):
        self.path = path
        if os.path.exists(path):
            os.remove(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


def main(output_dir: str):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    # variants used to verify the other loss-logging regimes (defaults = stock Trainer behaviour)
    ap.add_argument("--average-tokens-across-devices", choices=["true", "false"], default="true")
    ap.add_argument("--no-loss-kwargs", action="store_true",
                    help="set model.accepts_loss_kwargs=False: Trainer then passes no num_items_in_batch")
    ap.add_argument("--gradient-checkpointing", choices=["none", "reentrant", "non-reentrant"], default="none",
                    help="TrainingArguments(gradient_checkpointing=True) with gradient_checkpointing_kwargs={'use_reentrant': ...}")
    ap.add_argument("--torch-compile-backend", default=None,
                    help="TrainingArguments(torch_compile=True) with this backend (e.g. aot_eager, inductor)")
    ap.add_argument("--label-smoothing", type=float, default=0.0, help="TrainingArguments(label_smoothing_factor=...)")
    ap.add_argument("--accum-rank", type=int, default=-1, help="this rank accumulates 4 micro-batches instead of 2")
    ap.add_argument("--neftune-rank", type=int, default=-1, help="this rank trains with neftune_noise_alpha=5")
    ap.add_argument("--bf16-rank", type=int, default=-1, help="this rank trains with bf16=True")
    ap.add_argument("--sampling", default="random", help="train_sampling_strategy: random, sequential, group_by_length")
    ap.add_argument("--lora", type=int, default=0, help="train LoRA adapters of this rank (peft), the base frozen")
    ap.add_argument("--stream", choices=["no", "dispatch", "shard"], default="no",
                    help="datasets' to_iterable_dataset(): accelerate's default for it (rank 0 reads and dispatches every "
                         "rank's batch) or dispatch_batches=False (each rank skips to its own)")
    ap.add_argument("--main-reports", action="store_true", help="the main process alone shows progress and logs at info")
    ap.add_argument("--override", action="append", default=[], metavar="R:KEY=VALUE",
                    help="rank R's TrainingArguments KEY is VALUE (a Python literal, else the string): a per-node config")
    ap.add_argument("--fsdp2", action="store_true", help="the Trainer's FSDP2 path (fully_shard per decoder layer)")
    ap.add_argument("--lora-alpha-rank", type=int, default=-1, help="with --lora: this rank scales its adapters twice as much")
    ap.add_argument("--output-dir", default=None, help="keep the checkpoints here (a temporary folder otherwise)")
    ap.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (none by default)")
    ap.add_argument("--resume", default=None, help="TrainingArguments(resume_from_checkpoint=...)")
    args = ap.parse_args()
    output_dir = args.output_dir or output_dir

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    if args.no_loss_kwargs:
        model.accepts_loss_kwargs = False
    if args.lora:
        from peft import LoraConfig, get_peft_model

        alpha = (4 if int(os.environ.get("RANK", 0)) == args.lora_alpha_rank else 2) * args.lora
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=alpha, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"))
    with open(args.data) as f:
        rows = json.load(f)[: args.rows]

    def encode(row):
        p = tok(alpaca_prompt(row), add_special_tokens=False)["input_ids"]
        c = tok(row["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = (p + c)[: args.max_len]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ([-100] * len(p) + c)[: args.max_len]}

    ds = Dataset.from_list([encode(r) for r in rows])
    if args.stream != "no":
        ds = ds.to_iterable_dataset(num_shards=4)

    def collate(features):
        # accelerate's dispatch concatenates every rank's batch: they must share a shape, so pad to max_len there.
        n = args.max_len if args.stream == "dispatch" else max(len(x["input_ids"]) for x in features)
        out = {k: torch.full((len(features), n), v, dtype=torch.long)
               for k, v in (("input_ids", tok.pad_token_id), ("attention_mask", 0), ("labels", -100))}
        for i, x in enumerate(features):
            for k in out:
                out[k][i, : len(x[k])] = torch.tensor(x[k])
        return out

    main_process = int(os.environ.get("LOCAL_RANK", 0)) == 0
    targs = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=4 if int(os.environ.get("RANK", 0)) == args.accum_rank else 2,
        max_steps=args.steps,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        resume_from_checkpoint=args.resume,
        disable_tqdm=not (args.main_reports and main_process),
        log_level=("info" if main_process else "warning") if args.main_reports else "passive",
        seed=1234,
        dataloader_num_workers=0,
        average_tokens_across_devices=args.average_tokens_across_devices == "true",
        gradient_checkpointing=args.gradient_checkpointing != "none",
        gradient_checkpointing_kwargs={"use_reentrant": args.gradient_checkpointing == "reentrant"},
        torch_compile=args.torch_compile_backend is not None,
        torch_compile_backend=args.torch_compile_backend,
        label_smoothing_factor=args.label_smoothing,
        train_sampling_strategy=args.sampling,
        neftune_noise_alpha=5.0 if int(os.environ.get("RANK", 0)) == args.neftune_rank else None,
        bf16=int(os.environ.get("RANK", 0)) == args.bf16_rank,
        **({"accelerator_config": {"dispatch_batches": False}} if args.stream == "shard" else {}),
        **(FSDP2_ARGS if args.fsdp2 else {}),
    )
    apply_overrides(targs, args.override)
    trainer = (FsdpTrainer if args.fsdp2 else Trainer)(model=model, args=targs, train_dataset=ds, data_collator=collate)
    trainer.add_callback(LossFile(args.log))
    trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)


if __name__ == "__main__":
    # Without --output-dir nothing is kept there, and the folder goes however training ends.
    with tempfile.TemporaryDirectory(prefix="hf_trainer_") as scratch:
        main(scratch)

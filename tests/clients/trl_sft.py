"""Supervised fine-tuning with TRL's SFTTrainer on a prompt/completion dataset (CPU, gloo).

torchrun --nproc_per_node 4 -- trl_sft.py --model DIR --data JSON --steps 6 --log loss.jsonl

completion_only_loss=True: only completion tokens carry loss. Knows nothing about healthcheck. Appends each logged
per-step "loss" (logging_steps=1) to --log as JSON lines on rank 0, as it is logged.

``--packing``: ``SFTConfig(packing=True)`` (TRL packs the examples into sequences of ``max_length``).
``--lora R``: TRL's own LoRA path, ``SFTTrainer(peft_config=LoraConfig(r=R, ...))`` on the attention projections.
``--fsdp2``: ``SFTConfig(fsdp="full_shard auto_wrap", fsdp_config={"version": 2, ...})``, TRL on accelerate's FSDP2 as
on a GPU host (``cpu_fsdp.py``).

``--override R:KEY=VALUE`` (repeatable): rank R's ``SFTConfig.KEY`` is VALUE, a per-node config (``per_rank.py``).

``--loss-scale-rank R`` reproduces a per-node loss tweak for healthcheck's detection tests: rank R's trainer
multiplies TRL's loss by 1.5 in its ``compute_loss`` (TRL divides by a token count over every rank, so the
ranks' weights differ with their data even without it).
"""

import argparse
import json
import os
import tempfile

from cpu_fsdp import FSDP2_ARGS, FsdpOnCpu
from datasets import Dataset
from per_rank import apply_overrides
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer


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


class ScaledLossTrainer(SFTTrainer):
    """TRL's loss times 1.5: what a branch taken on one node only does."""

    def compute_loss(self, *args, **kwargs):
        out = super().compute_loss(*args, **kwargs)
        return (out[0] * 1.5, *out[1:]) if isinstance(out, tuple) else out * 1.5


def main(output_dir: str):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--loss-scale-rank", type=int, default=-1)
    ap.add_argument("--packing", action="store_true", help="SFTConfig(packing=True)")
    ap.add_argument("--lora", type=int, default=0, help="train LoRA adapters of this rank through SFTTrainer(peft_config=...)")
    ap.add_argument("--fsdp2", action="store_true", help="TRL on accelerate's FSDP2 (fully_shard per decoder layer)")
    ap.add_argument("--override", action="append", default=[], metavar="R:KEY=VALUE",
                    help="rank R's SFTConfig KEY is VALUE (a Python literal, else the string): a per-node config")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    with open(args.data) as f:
        rows = json.load(f)[: args.rows]
    ds = Dataset.from_list([{"prompt": alpaca_prompt(r), "completion": r["output"]} for r in rows])

    cfg = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        logging_steps=1,
        learning_rate=1e-3,
        max_length=args.max_len,
        completion_only_loss=True,
        packing=args.packing,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        disable_tqdm=True,
        seed=1234,
        dataloader_num_workers=0,
        **(FSDP2_ARGS if args.fsdp2 else {}),
    )
    apply_overrides(cfg, args.override)
    scaled = int(os.environ.get("RANK", "0")) == args.loss_scale_rank
    peft = {}
    if args.lora:
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    base = ScaledLossTrainer if scaled else SFTTrainer
    trainer_class = type(f"Fsdp{base.__name__}", (FsdpOnCpu, base), {}) if args.fsdp2 else base
    trainer = trainer_class(model=model, args=cfg, train_dataset=ds, processing_class=tok, **peft)
    trainer.add_callback(LossFile(args.log))
    trainer.train()


if __name__ == "__main__":
    # save_strategy="no": nothing is kept there, and the folder goes however training ends.
    with tempfile.TemporaryDirectory(prefix="trl_sft_") as scratch:
        main(scratch)

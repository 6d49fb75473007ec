"""Reinforcement learning with TRL's GRPOTrainer (CPU, gloo): each alpaca instruction is a prompt, the policy samples a
group of completions of it, and a reward for answers near 20 characters long ranks them within the group.

torchrun --nproc_per_node 2 -- trl_grpo.py --model DIR --data JSON --steps 3 --log loss.jsonl --generations 8

Knows nothing about healthcheck. TRL's sampler (``RepeatSampler``) yields each prompt ``--generations`` times in a
row and accelerate deals the reads out to the ranks: with more generations than ``--batch-size``, one prompt's group
spans ranks, and each rank samples its own completions of it (TRL seeds every rank apart for that). Appends each
logged per-step "loss" (logging_steps=1) to --log as JSON lines on rank 0, as it is logged.

``--override R:KEY=VALUE`` (repeatable): rank R's ``GRPOConfig.KEY`` is VALUE, a per-node config (``per_rank.py``):
``1:seed=7`` gives rank 1's sampler other prompts, so the ranks that share a group read halves of two.
"""

import argparse
import json
import tempfile

from datasets import Dataset
from per_rank import apply_overrides
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl_sft import LossFile, alpaca_prompt  # the same prompt and loss file as the SFT client (this folder is on sys.path)


def near_twenty_characters(completions, **kwargs):
    """A reward with a spread within every group: how close each completion's length is to 20 characters."""
    return [-abs(20 - len(completion)) / 20 for completion in completions]


def main(output_dir: str):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8, help="GRPOConfig(num_generations=...): completions per prompt")
    ap.add_argument("--completion-len", type=int, default=16)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--override", action="append", default=[], metavar="R:KEY=VALUE",
                    help="rank R's GRPOConfig KEY is VALUE (a Python literal, else the string): a per-node config")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    with open(args.data) as f:
        rows = json.load(f)[: args.rows]
    ds = Dataset.from_list([{"prompt": alpaca_prompt(r)} for r in rows])
    cfg = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.generations,
        max_completion_length=args.completion_len,
        max_steps=args.steps,
        logging_steps=1,
        learning_rate=1e-4,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        disable_tqdm=True,
        seed=1234,
        dataloader_num_workers=0,
    )
    apply_overrides(cfg, args.override)
    trainer = GRPOTrainer(model=model, reward_funcs=near_twenty_characters, args=cfg, train_dataset=ds, processing_class=tok)
    trainer.add_callback(LossFile(args.log))
    trainer.train()


if __name__ == "__main__":
    # save_strategy="no": nothing is kept there, and the folder goes however training ends.
    with tempfile.TemporaryDirectory(prefix="trl_grpo_") as scratch:
        main(scratch)

"""Preference fine-tuning with TRL's DPOTrainer (CPU, gloo): each alpaca row's own output is the chosen completion,
the next row's output the rejected one.

torchrun --nproc_per_node 2 -- trl_dpo.py --model DIR --data JSON --steps 3 --log loss.jsonl

Knows nothing about healthcheck, unless ``--record-loss`` (each rank's DPO loss over its pairs, reported with
``healthcheck.record_loss`` from the trainer's ``compute_loss``). TRL computes the policy's per-token log-probs with
the same fused head as its SFTTrainer, sums them per sequence, and trains ``-logsigmoid(beta * (chosen - rejected))``
against a frozen copy of the model (the reference, which TRL makes itself; ``--ref-model DIR`` loads it from DIR
instead, as a run whose reference is an earlier checkpoint does, and ``--ref-model-rank R:DIR`` gives rank R its own,
a node whose copy is another revision). Appends each logged per-step "loss" (logging_steps=1) to --log as JSON lines
on rank 0, as it is logged.
"""

import argparse
import json
import tempfile

from datasets import Dataset
from per_rank import this_rank
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
from trl_sft import LossFile, alpaca_prompt  # the same prompt and loss file as the SFT client (this folder is on sys.path)


class RecordedLoss(DPOTrainer):
    """``--record-loss``: the opt-in for a loss healthcheck cannot see, each rank's DPO loss over its pairs."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        import healthcheck

        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        healthcheck.record_loss(out[0] if isinstance(out, tuple) else out, inputs["input_ids"].shape[0] // 2)
        return out


def main(output_dir: str):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--record-loss", action="store_true", help="report each rank's DPO loss with healthcheck.record_loss")
    ap.add_argument("--ref-model", default=None, help="the reference model's folder (a copy of --model by default)")
    ap.add_argument("--ref-model-rank", default=None, metavar="R:DIR", help="rank R loads its reference from DIR")
    args = ap.parse_args()
    args.ref_model = this_rank(args.ref_model_rank) or args.ref_model

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    with open(args.data) as f:
        rows = json.load(f)[: args.rows]
    ds = Dataset.from_list([{"prompt": alpaca_prompt(r), "chosen": r["output"], "rejected": rows[(i + 1) % len(rows)]["output"]}
                            for i, r in enumerate(rows)])
    cfg = DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        logging_steps=1,
        learning_rate=1e-4,
        max_length=args.max_len,
        beta=args.beta,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        disable_tqdm=True,
        seed=1234,
        dataloader_num_workers=0,
    )
    reference = AutoModelForCausalLM.from_pretrained(args.ref_model) if args.ref_model else None
    trainer = (RecordedLoss if args.record_loss else DPOTrainer)(model=model, ref_model=reference, args=cfg, train_dataset=ds,
                                                                 processing_class=tok)
    trainer.add_callback(LossFile(args.log))
    trainer.train()


if __name__ == "__main__":
    # save_strategy="no": nothing is kept there, and the folder goes however training ends.
    with tempfile.TemporaryDirectory(prefix="trl_dpo_") as scratch:
        main(scratch)

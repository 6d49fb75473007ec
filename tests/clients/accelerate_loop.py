"""Causal-LM fine-tuning with a plain accelerate loop, gradient accumulation via accelerator.accumulate (CPU, gloo).

torchrun --nproc_per_node 4 -- accelerate_loop.py --model DIR --data JSON --steps 6 --log loss.jsonl [--comm-hook fp16]

--comm-hook: accelerate's DistributedDataParallelKwargs(comm_hook=...) (fp16: torch's fp16_compress_hook, registered
by accelerate right after it wraps the model); --comm-wrapper: its comm_wrapper (fp16: fp16_compress_wrapper around
the hook); --power-sgd-start N: comm_state_option={"start_powerSGD_iter": N} (PowerSGD all-reduces exactly until then).
--fsdp2: accelerate's FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2), fully_shard per decoder layer), as on a
GPU host: accelerate keeps an FSDP plugin only for accelerator device types, so on a CPU the two fields it would set
are set by the test shim ``cpu_fsdp.py``, and everything after (prepare, accumulate, backward, clipping) is accelerate's own FSDP2 code.
--clip N: accelerator.clip_grad_norm_(model.parameters(), N) before each update.
--accum-rank R: rank R accumulates 4 micro-batches per update where the others accumulate 2 (a per-node setting).
--save-every N --save-to DIR: accelerator.save_state(DIR/step_N) every N updates; --resume-from DIR/step_N:
accelerator.load_state there, then skip_first_batches past the updates it made, as accelerate's
complete_nlp_example.py resumes (--resume-rank R:DIR: rank R loads DIR instead, its node's own copy).

Knows nothing about healthcheck. Each micro-batch loss is the model's own `outputs.loss` (HF token mean over this
rank's micro-batch, labels -100 on prompt tokens). Logged per optimizer step (rank 0), the usual accelerate-example
definition:  loss = mean over the step's micro-batches of accelerator.gather(loss).mean(),
i.e. the plain mean of the (rank, micro-batch) token means -- NOT token-weighted.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DataLoaderConfiguration, DDPCommunicationHookType, DistributedDataParallelKwargs, set_seed
from cpu_fsdp import keep_fsdp_plugin
from per_rank import this_rank
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer


def alpaca_prompt(row):
    if row.get("input"):
        return f"### Instruction:\n{row['instruction']}\n\n### Input:\n{row['input']}\n\n### Response:\n"
    return f"### Instruction:\n{row['instruction']}\n\n### Response:\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--comm-hook", default="no", choices=[hook.value for hook in DDPCommunicationHookType])
    ap.add_argument("--comm-wrapper", default="no", choices=[hook.value for hook in DDPCommunicationHookType])
    ap.add_argument("--power-sgd-start", type=int, default=None)
    ap.add_argument("--fsdp2", action="store_true", help="accelerate's FSDP2 (fully_shard per decoder layer)")
    ap.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this before each update")
    ap.add_argument("--accum-rank", type=int, default=-1, help="this rank accumulates 4 micro-batches instead of 2")
    ap.add_argument("--stream", action="store_true",
                    help="the examples as an IterableDataset; dispatch_batches=False, so each rank keeps its slice of "
                         "every global batch (accelerate's IterableDatasetShard): dispatching needs equal-sized batches")
    ap.add_argument("--save-every", type=int, default=0, help="accelerator.save_state every N updates")
    ap.add_argument("--save-to", default=None, help="the folder of those states (step_N each)")
    ap.add_argument("--resume-from", default=None, help="accelerator.load_state from this step_N folder")
    ap.add_argument("--resume-rank", default=None, metavar="R:DIR", help="rank R resumes from DIR instead")
    args = ap.parse_args()
    args.resume_from = this_rank(args.resume_rank) or args.resume_from

    state = {} if args.power_sgd_start is None else {"start_powerSGD_iter": args.power_sgd_start}
    ddp_kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(args.comm_hook),
                                               comm_wrapper=DDPCommunicationHookType(args.comm_wrapper), comm_state_option=state)
    loading = DataLoaderConfiguration(dispatch_batches=False) if args.stream else DataLoaderConfiguration()
    accumulation = 4 if int(os.environ.get("RANK", 0)) == args.accum_rank else 2
    accelerator = Accelerator(gradient_accumulation_steps=accumulation, cpu=True, kwargs_handlers=[ddp_kwargs], dataloader_config=loading)
    if args.fsdp2:
        keep_fsdp_plugin(accelerator.state, FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"]))
    set_seed(1234)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    with open(args.data) as f:
        rows = json.load(f)[: args.rows]
    examples = []
    for r in rows:
        p = tok(alpaca_prompt(r), add_special_tokens=False)["input_ids"]
        c = tok(r["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append(((p + c)[: args.max_len], ([-100] * len(p) + c)[: args.max_len]))

    def collate(batch):
        n = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), n), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), n), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            attn[i, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attn, "labels": labels}

    if args.stream:
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(examples)

        loader = DataLoader(Stream(), batch_size=args.batch_size, collate_fn=collate)
    else:
        loader = DataLoader(examples, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    if accelerator.is_main_process and os.path.exists(args.log):
        os.remove(args.log)
    step, micro_losses = 0, []
    epoch_loader = loader
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        step = int(os.path.basename(os.path.normpath(args.resume_from)).removeprefix("step_"))
        epoch_loader = accelerator.skip_first_batches(loader, step * accumulation)
    model.train()
    while step < args.steps:
        for batch in epoch_loader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                if args.clip > 0 and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                optimizer.zero_grad()
            micro_losses.append(accelerator.gather(loss.detach()).mean().item())
            if accelerator.sync_gradients:
                step += 1
                logged = sum(micro_losses) / len(micro_losses)
                micro_losses = []
                if accelerator.is_main_process:
                    with open(args.log, "a") as f:
                        f.write(json.dumps({"step": step, "loss": logged}) + "\n")
                    accelerator.print(f"step {step} loss {logged:.5f}")
                if args.save_every and step % args.save_every == 0:
                    accelerator.save_state(os.path.join(args.save_to, f"step_{step}"))
                if step >= args.steps:
                    break
        epoch_loader = loader
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()

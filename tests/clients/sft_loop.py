"""Supervised fine-tuning in a plain DDP loop that lets the model compute its own loss (``labels=``), on CPU/gloo.

torchrun --nproc_per_node 4 sft_loop.py --model DIR --data JSON --steps 20 --log loss.jsonl

Knows nothing about healthcheck. The whole sequence is trained (every token a target but the padding), with a cosine
schedule and gradient clipping, the way many fine-tuning scripts are written. Rank 0 appends each step's loss to
``--log`` as a JSON line.

``--bug NAME=R`` puts one mistake in rank R's loop, between its DataLoader and its update, where its batches,
settings and replays still agree with everyone's:

* ``label-shift=R``: rank R shifts its labels before handing them to the model, which shifts them again (the
  labels of a collator that already shifts): it learns the token two ahead;
* ``mask-noise=R``: rank R replaces 15% of its input tokens with padding, an augmentation left on for one node (its
  labels keep the original tokens);
* ``z-loss=R``: rank R adds a z-loss, 1e-2 times the mean square of its logits' log-partition;
* ``no-mask=R``: rank R calls the model without its ``attention_mask``;
* ``grad-hook=R``: rank R doubles every parameter's gradient in a tensor hook (a debugging hook left in);
* ``checkpointing=R``: rank R trains with activation checkpointing: the same gradients, ~30% slower, a straggler;
* ``save-every=K``: no bug: rank 0 saves the model every K steps, as scripts do;
* ``sampler-local-rank`` (no rank): the ``DistributedSampler`` is given ``LOCAL_RANK`` for its rank, right on one
  node and wrong on every node after it, whose ranks read the first node's shards.
"""

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--log", default=None, help="rank 0 appends each step's loss here, as JSON lines")
    ap.add_argument("--bug", default="none", help="NAME=R: label-shift, mask-noise, z-loss, no-mask, grad-hook, "
                                                  "checkpointing or save-every=K")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bug, _, value = args.bug.partition("=")
    faulted = value != "" and rank == int(value)
    torch.manual_seed(0)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with open(args.data) as f:
        rows = json.load(f)[: args.rows]
    samples = [tokenizer(f"### Instruction:\n{row['instruction']}\n\n### Response:\n{row['output']}",
                         add_special_tokens=False)["input_ids"][:192] + [tokenizer.eos_token_id] for row in rows]

    def collate(batch):
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, sample in enumerate(batch):
            ids[i, : len(sample)], mask[i, : len(sample)] = torch.tensor(sample), 1
        return ids, mask, ids.masked_fill(mask == 0, -100)

    model = AutoModelForCausalLM.from_pretrained(args.model)
    model.train()
    if bug == "checkpointing" and faulted:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ddp = DDP(model)
    if bug == "grad-hook" and faulted:
        for param in ddp.parameters():
            param.register_hook(lambda grad: grad * 2)
    sampler_rank = int(os.environ["LOCAL_RANK"]) if bug == "sampler-local-rank" else rank
    sampler = DistributedSampler(samples, num_replicas=dist.get_world_size(), rank=sampler_rank, seed=0)
    loader = DataLoader(samples, batch_size=4, sampler=sampler, collate_fn=collate)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    schedule = get_cosine_schedule_with_warmup(optimizer, 2, args.steps)
    noise = torch.Generator().manual_seed(rank)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for ids, mask, labels in loader:
            if bug == "mask-noise" and faulted:
                ids = ids.masked_fill((torch.rand(ids.shape, generator=noise) < 0.15) & (mask == 1), tokenizer.pad_token_id)
            if bug == "label-shift" and faulted:
                labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
            inputs = {"input_ids": ids, "labels": labels}
            if not (bug == "no-mask" and faulted):
                inputs["attention_mask"] = mask
            out = ddp(**inputs)
            loss = out.loss
            if bug == "z-loss" and faulted:
                loss = loss + 1e-2 * torch.logsumexp(out.logits.float(), dim=-1).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            if bug == "save-every" and rank == 0 and step % int(value) == 0:
                with tempfile.TemporaryDirectory() as folder:
                    torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
            step += 1
            if rank == 0 and args.log:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            if step >= args.steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

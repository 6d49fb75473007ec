"""A training loop in the style of nanoGPT's train.py, on CPU/gloo: no DataLoader at all.

    python nanogpt_style.py --prepare --model DIR --data JSON --bin train.bin    # once: tokenize to uint16
    torchrun --nproc_per_node 4 nanogpt_style.py --model DIR --bin train.bin --steps 20

Knows nothing about healthcheck. As nanoGPT does it: the tokens sit in one flat ``np.memmap`` file, each rank
seeds torch with ``1337 + seed_offset`` (``seed_offset = ddp_rank``) so that ``get_batch`` draws its own random
offsets, the micro-steps of gradient accumulation set ``model.require_backward_grad_sync`` on the last one only
(instead of ``no_sync()``), the learning rate follows a cosine with linear warmup set into the param groups each
iteration, and gradients are clipped through a (disabled on CPU) ``GradScaler``.

``--fsdp2``: ``fully_shard`` on each decoder layer and the model instead of DDP, gradient sync switched off between
micro-steps with ``set_requires_gradient_sync`` (torchtitan's way).

``--bug``: ``same-seed`` (``seed_offset = 0`` on every rank: every rank draws the same offsets, so trains on the same
batches) and ``seed-offset-rank=R`` (rank R takes the offset of rank R+1, as a launcher that exports another
RANK to it would: two ranks train on the same batches).
"""

import argparse
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, AutoTokenizer


def prepare(model_dir, data_json, out_bin):
    """Tokenize every row (prompt, response, EOS) into one flat uint16 token file, as nanoGPT's prepare.py does."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = []
    for row in json.load(open(data_json)):
        text = f"### Instruction:\n{row['instruction']}\n\n### Response:\n{row['output']}"
        ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    np.array(ids, dtype=np.uint16).tofile(out_bin)


def get_lr(it, lr, warmup_iters, decay_iters, min_lr):
    if it < warmup_iters:
        return lr * (it + 1) / (warmup_iters + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--data", help="with --prepare: the alpaca JSON to tokenize")
    ap.add_argument("--prepare", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--compile", default=None, help="torch.compile the model before DDP with this backend (nanoGPT: inductor)")
    ap.add_argument("--fsdp2", action="store_true", help="fully_shard each decoder layer and the model instead of DDP")
    ap.add_argument("--bug", default="none")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.model, args.data, args.bin)
        return

    init_process_group(backend="gloo")
    ddp_rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    bug, _, value = args.bug.partition("=")
    seed_offset = ddp_rank
    if bug == "same-seed":
        seed_offset = 0
    elif bug == "seed-offset-rank" and ddp_rank == int(value):
        seed_offset = (ddp_rank + 1) % world
    torch.manual_seed(1337 + seed_offset)

    data = np.memmap(args.bin, dtype=np.uint16, mode="r")

    def get_batch():
        ix = torch.randint(len(data) - args.block_size - 1, (args.batch_size,))
        x = torch.stack([torch.from_numpy(data[i : i + args.block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + args.block_size].astype(np.int64)) for i in ix])
        return x, y

    model = AutoModelForCausalLM.from_pretrained(args.model)
    if args.compile:
        model = torch.compile(model, backend=args.compile)
    if args.fsdp2:  # torchtitan's way: each block, then the root; gradient sync switched off between micro-steps
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = DDP(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    X, Y = get_batch()
    for it in range(args.steps):
        lr = get_lr(it, 6e-4, 2, args.steps, 6e-5)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro_step in range(args.grad_accum):
            if args.fsdp2:
                model.set_requires_gradient_sync(micro_step == args.grad_accum - 1)
            else:
                model.require_backward_grad_sync = micro_step == args.grad_accum - 1
            logits = model(input_ids=X).logits
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1)) / args.grad_accum
            X, Y = get_batch()  # prefetch the next batch while the backward runs, as nanoGPT does
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if ddp_rank == 0:
            print(f"iter {it}: loss {loss.item() * args.grad_accum:.4f}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    main()

"""Causal-LM fine-tuning sharded with FSDP2, in the style of PyTorch's FSDP2 example (examples/distributed/FSDP2)
and torchtitan's data-parallel shard, on CPU/gloo.

torchrun --nproc_per_node 4 fsdp2_tutorial.py --model DIR --data JSON --steps 6 --log loss.jsonl [--accum 2]

Knows nothing about healthcheck. ``fully_shard`` on every decoder layer, then on the root; AdamW on the
sharded (DTensor) parameters. Gradient accumulation over ``--accum`` micro-batches: like torchtitan, the
gradient is reduce-scattered only on the last micro-batch (``set_requires_gradient_sync``); with
``--sync-every-microbatch``, FSDP2's default (a reduce-scatter per micro-batch). ``--wrap ddp`` trains the
same loop with DistributedDataParallel instead, for comparisons; ``--wrap fsdp1`` with the older
``FullyShardedDataParallel`` (FSDP1, PyTorch's "Getting Started with FSDP" tutorial: every decoder layer a unit);
``--wrap replicate`` with torch's composable DDP, ``replicate(model, device_mesh=...)``, as torchtitan's
data-parallel-only path applies it (accumulating with ``set_requires_gradient_sync``, as under FSDP2).
Logged per step (rank 0): the global token-weighted mean loss over the step's micro-batches.

``--reduce-dtype fp16|bf16``: ``MixedPrecisionPolicy(reduce_dtype=...)``, parameters in fp32: FSDP2 casts each
local gradient to that dtype and reduce-scatters it (fp16 pre-divided by a power of two, bf16 averaged).
``--loss-times S``: every rank's loss times S, so S=1e-5 puts the gradients under fp16's normal range, as most of a
large model's are.
``--clip N``: clip the gradient norm to N before each update (the default 0 does not clip). ``--amp-scale S``: fp16
autocast and a ``torch.amp.GradScaler`` starting at S (PyTorch's AMP recipe; unscaled before clipping).

``--stream``: the data as torchtitan reads it, a ``datasets`` IterableDataset (``to_iterable_dataset``) each rank
keeps its part of with ``datasets.distributed.split_dataset_by_node``; no sampler. Its bug ``stream-rank=R``: rank R
keeps the part of rank R+1 (a node whose rank was read from the wrong variable).

``--bug`` (comma-separated): ``loss-x2-rank=R``: rank R multiplies its loss by 2. ``stale-weights-rank=R``: rank R's
copy of the checkpoint differs in one tensor (a stale file on one node), which FSDP2 shards without complaint.
``bf16-except-rank=R``: FSDP2 computes in bf16 on every rank but R (fp32): FSDP2's first all-gather breaks.
``clip-rank=R``: rank R clips at a tenth of ``--clip`` (a per-node config): under FSDP2 it scales only its own shard.
``inf-rank=R``: rank R's loss is inf from step 2 on (with ``--amp-scale``, every scaler then skips every update).
``slow-rank=R``: rank R spends 50 ms after each update (a slow logger or checkpoint writer), so the others wait for
it in the logging ``all_reduce``, not in FSDP2's collectives. ``accum-rank=R``: rank R accumulates one micro-batch more
per update than ``--accum`` (a per-node ``gradient_accumulation_steps``): its extra forward all-gathers while the
others step, which no FSDP2 collective pairs with. ``no-zero-grad-rank=R``: rank R never clears its gradients, so
FSDP2 adds each step's reduce-scattered gradient to its shard's previous one. ``drift-rank=R``: after the 2nd update,
rank R's slice of ``lm_head.weight`` moves by 1e-3 (a device that wrote one update wrong); under plain FSDP2 it owns
that slice alone, under HSDP (``--hsdp R``: R replicas of a shard group, torchtitan's ``data_parallel_replicate_degree``)
a rank of another replica holds the same slice. ``warmup-rank=R``: rank R warms its learning rate up over twice
``--warmup`` steps (a per-node schedule config): every rank starts at 0, so the first step's settings agree.
``--weight-decay W``: AdamW in two groups, as nanoGPT's ``configure_optimizers`` builds them: the matrices decay by W,
the vectors (the norms) do not. Its bug ``decay-rule-rank=R``: rank R's no-decay rule matches the decoder layers'
norms by name and misses the final ``model.norm`` (another revision of that rule on one node), which it then decays.
"""

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def alpaca_prompt(row):
    if row.get("input"):
        return f"### Instruction:\n{row['instruction']}\n\n### Input:\n{row['input']}\n\n### Response:\n"
    return f"### Instruction:\n{row['instruction']}\n\n### Response:\n"


class AlpacaDataset(Dataset):
    def __init__(self, path, tokenizer, max_len, rows):
        with open(path) as f:
            data = json.load(f)[:rows]
        self.items = []
        for row in data:
            p = tokenizer(alpaca_prompt(row), add_special_tokens=False)["input_ids"]
            c = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            self.items.append(((p + c)[:max_len], ([-100] * len(p) + c)[:max_len]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate_with(pad_id):
    def collate(batch):
        n = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), -100, dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
        return input_ids, labels

    return collate


def shard(model, **kwargs):
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--sync-every-microbatch", action="store_true")
    ap.add_argument("--wrap", choices=("fsdp", "ddp", "fsdp1", "replicate"), default="fsdp")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--amp-scale", type=float, default=0.0)
    ap.add_argument("--loss-times", type=float, default=1.0, help="every rank's loss (so every gradient) times this")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's decay of the matrices, in a group of their own")
    ap.add_argument("--warmup", type=int, default=0, help="a linear learning-rate warmup from 0 over this many steps (LambdaLR)")
    ap.add_argument("--stream", action="store_true", help="a datasets IterableDataset split with split_dataset_by_node")
    ap.add_argument("--hsdp", type=int, default=0, metavar="R",
                    help="HSDP: a (R replicas x world/R shards) device mesh, as torchtitan's data_parallel_replicate_degree")
    ap.add_argument("--reduce-dtype", choices=("fp16", "bf16"), default=None,
                    help="MixedPrecisionPolicy(reduce_dtype=...): FSDP2 reduce-scatters the gradients in this dtype")
    ap.add_argument("--bug", default="none", help="none, or a comma-separated list of loss-x2-rank=R, stale-weights-rank=R, clip-rank=R, "
                    "slow-rank=R, accum-rank=R, no-zero-grad-rank=R, drift-rank=R, warmup-rank=R, decay-rule-rank=R")
    args = ap.parse_args()

    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    bugs = {bug: int(r) for bug, _, r in (item.partition("=") for item in args.bug.split(",")) if r}
    if bugs.get("stale-weights-rank") == rank:
        with torch.no_grad():
            model.lm_head.weight.mul_(1.001)
    if args.wrap == "fsdp":
        # A per-node precision config: bf16 parameters in compute everywhere but on this rank.
        mixed = bugs.get("bf16-except-rank") is not None
        fp32 = torch.float32 if bugs.get("bf16-except-rank") == rank else torch.bfloat16
        policy = {"param_dtype": fp32} if mixed else {}
        if args.reduce_dtype:
            policy["reduce_dtype"] = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.reduce_dtype]
        kwargs = {"mp_policy": MixedPrecisionPolicy(**policy)} if policy else {}
        if args.hsdp:
            world = dist.get_world_size()
            kwargs["mesh"] = init_device_mesh("cpu", (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard"))
        model = shard(model, **kwargs)
    elif args.wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer_class = type(model.model.layers[0])
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer_class}), device_id=torch.device("cpu"))
    elif args.wrap == "replicate":  # torchtitan's apply_ddp
        from torch.distributed._composable.replicate import replicate

        replicate(model, device_mesh=init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_replicate",)),
                  bucket_cap_mb=100)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    ds = AlpacaDataset(args.data, tok, args.max_len, args.rows)
    if args.stream:  # torchtitan's way: each rank keeps its part of one stream
        from datasets import Dataset as HFDataset
        from datasets.distributed import split_dataset_by_node

        world = dist.get_world_size()
        part = (rank + 1) % world if bugs.get("stream-rank") == rank else rank
        stream = HFDataset.from_list([{"ids": ids, "labels": lab} for ids, lab in ds.items]).to_iterable_dataset(num_shards=world)
        mine = split_dataset_by_node(stream, rank=part, world_size=world).map(lambda row: {"pair": (row["ids"], row["labels"])})
        collate = collate_with(tok.pad_token_id)
        loader = DataLoader(mine, batch_size=args.batch_size, collate_fn=lambda rows: collate([row["pair"] for row in rows]))
    else:
        sampler = DistributedSampler(ds, seed=args.seed)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, collate_fn=collate_with(tok.pad_token_id))
    if args.weight_decay:  # nanoGPT's groups: matrices decay, vectors (the norms) do not
        if bugs.get("decay-rule-rank") == rank:  # a rule by name that misses the final norm
            vector = [name.removeprefix("module.").startswith("model.layers.") and name.endswith("norm.weight")
                      for name, _ in model.named_parameters()]
        else:
            vector = [param.ndim < 2 for param in model.parameters()]
        params = list(model.parameters())
        optimizer = torch.optim.AdamW([{"params": [p for p, v in zip(params, vector) if not v], "weight_decay": args.weight_decay},
                                       {"params": [p for p, v in zip(params, vector) if v], "weight_decay": 0.0}], lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    warmup = args.warmup * (2 if bugs.get("warmup-rank") == rank else 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / warmup)) if warmup else None
    loss_scale = (2.0 if bugs.get("loss-x2-rank") == rank else 1.0) * args.loss_times
    # --amp-scale S: PyTorch's AMP recipe, fp16 autocast and a GradScaler starting at S (0: neither).
    scaler = torch.amp.GradScaler("cpu", init_scale=args.amp_scale) if args.amp_scale else None
    autocast = torch.autocast("cpu", dtype=torch.float16) if args.amp_scale else contextlib.nullcontext()
    clip = args.clip / 10 if bugs.get("clip-rank") == rank else args.clip
    if rank == 0 and os.path.exists(args.log):
        os.remove(args.log)

    step, epoch, micro = 0, 0, []
    while step < args.steps:
        if not args.stream:
            sampler.set_epoch(epoch)
        for input_ids, labels in loader:
            micro.append((input_ids, labels))
            if len(micro) < args.accum + (bugs.get("accum-rank") == rank):
                continue
            stats = torch.zeros(2)
            for index, (ids, lab) in enumerate(micro):
                last = index == len(micro) - 1
                if args.wrap in ("fsdp", "replicate") and not args.sync_every_microbatch:
                    model.set_requires_gradient_sync(last)
                # DDP skips its all-reduce only when the forward, too, runs inside no_sync().
                with model.no_sync() if args.wrap in ("ddp", "fsdp1") and not last else contextlib.nullcontext():
                    with autocast:
                        logits = model(input_ids=ids).logits
                    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1))
                    shift_labels = lab[:, 1:].reshape(-1)
                    loss_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
                    ntok = (shift_labels != -100).sum()
                    loss = loss_scale * loss_sum / ntok.clamp(min=1) / len(micro)
                    if bugs.get("inf-rank") == rank and step >= 2:  # a device that overflows in fp16 from step 2 on
                        loss = loss * float("inf")
                    (scaler.scale(loss) if scaler else loss).backward()
                stats += torch.stack([loss_sum.detach(), ntok.to(loss_sum.dtype)])
            micro = []
            if clip > 0:
                if scaler:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if scheduler:
                scheduler.step()
            if bugs.get("no-zero-grad-rank") != rank:
                optimizer.zero_grad()
            if bugs.get("drift-rank") == rank and step == 1:
                with torch.no_grad():  # this rank's slice of one weight, off after the 2nd update: a device that wrote it wrong
                    weight = model.lm_head.weight
                    (weight.to_local() if hasattr(weight, "to_local") else weight).add_(1e-3)
            if bugs.get("slow-rank") == rank:
                time.sleep(0.05)
            dist.all_reduce(stats)
            step += 1
            if rank == 0:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"step": step, "loss": (stats[0] / stats[1]).item()}) + "\n")
            if step >= args.steps:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

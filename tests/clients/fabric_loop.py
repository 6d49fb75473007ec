"""Causal-LM fine-tuning with Lightning Fabric, written the way LitGPT's finetuning loop writes it, on CPU/gloo.

torchrun --nproc_per_node 4 fabric_loop.py --model DIR --data JSON --steps 6 --devices 4 --log loss.jsonl

Knows nothing about healthcheck. ``Fabric(strategy="ddp")`` reads the elastic launcher's environment and starts no
processes of its own (``--devices`` must equal the launcher's ranks per node); ``fabric.setup`` wraps the model in
DDP inside its ``_FabricModule``, and ``fabric.setup_dataloaders`` puts a ``DistributedSampler`` under the loader.
Each update accumulates ``--accum`` micro-batches, all but the last under ``fabric.no_backward_sync``, backwards
``loss / accum`` with ``fabric.backward``, clips with ``fabric.clip_gradients`` and steps a warmup schedule, as LitGPT
does. Loss: token-level cross entropy on response tokens only; rank 0 appends each update's mean micro-batch loss to
``--log``.

``--strategy fsdp2`` shards the model with FSDP2 instead: Fabric's ``ModelParallelStrategy`` (data parallel over every
rank) with a ``parallelize_fn`` that calls ``fully_shard`` on each decoder layer, then on the model.

``--bug``: ``loss-x2-rank=R`` (rank R doubles its loss), ``accum-rank=R`` (rank R accumulates twice as many
micro-batches, a per-node config), ``clip-rank=R`` (rank R clips to a tenth of the others' norm).
"""

import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from fsdp2_tutorial import AlpacaDataset, collate_with  # the same data as the other clients (this folder is on sys.path)
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer


def shard(model, device_mesh):  # --strategy fsdp2: Fabric calls it with its device mesh
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def strategy(name, devices):
    if name == "fsdp2":
        from lightning.fabric.strategies import ModelParallelStrategy

        return ModelParallelStrategy(parallelize_fn=shard, data_parallel_size=devices, tensor_parallel_size=1)
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--devices", type=int, default=4, help="ranks per node: the launcher's nproc")
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=6, help="optimizer updates")
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    ap.add_argument("--bug", default="none", help="none, or loss-x2-rank=R, accum-rank=R, clip-rank=R")
    args = ap.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy(args.strategy, args.devices))
    fabric.launch()
    fabric.seed_everything(1337)
    bug, _, bug_rank = args.bug.partition("=")
    faulty = bug != "none" and int(bug_rank) == fabric.global_rank
    loss_scale = 2.0 if faulty and bug == "loss-x2-rank" else 1.0
    accum = 2 * args.accum if faulty and bug == "accum-rank" else args.accum
    max_norm = args.max_norm / 10 if faulty and bug == "clip-rank" else args.max_norm
    if fabric.global_rank == 0 and os.path.exists(args.log):
        os.remove(args.log)

    tok = AutoTokenizer.from_pretrained(args.model)
    with fabric.init_module():
        model = AutoModelForCausalLM.from_pretrained(args.model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    loader = DataLoader(AlpacaDataset(args.data, tok, args.max_len, args.rows), batch_size=args.batch_size,
                        shuffle=True, collate_fn=collate_with(tok.pad_token_id))
    loader = fabric.setup_dataloaders(loader)

    model.train()
    update, micro, running = 0, 0, 0.0
    epoch = 0
    while update < args.steps:
        loader.sampler.set_epoch(epoch)
        for input_ids, labels in loader:
            micro += 1
            is_accumulating = micro % accum != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                logits = model(input_ids=input_ids).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                       ignore_index=-100)
                fabric.backward(loss_scale * loss / accum)
            running += loss.item() / accum
            if is_accumulating:
                continue
            fabric.clip_gradients(model, optimizer, max_norm=max_norm)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            update += 1
            if fabric.global_rank == 0:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"step": update, "loss": running}) + "\n")
            running = 0.0
            if update >= args.steps:
                break
        epoch += 1


if __name__ == "__main__":
    main()

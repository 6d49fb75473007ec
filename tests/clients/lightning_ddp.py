"""Causal-LM fine-tuning with PyTorch Lightning, ``Trainer(strategy="ddp", accelerator="cpu")``, written the way
Lightning's docs write a LightningModule, launched the torchrun way (Lightning reads the elastic launcher's
environment and starts no processes of its own; ``--devices`` must equal the launcher's ranks per node).

torchrun --nproc_per_node 4 lightning_ddp.py --model DIR --data JSON --steps 6 --devices 4 --log loss.jsonl

Knows nothing about healthcheck. Lightning's automatic optimization runs every step's ``zero_grad``,
``training_step`` and ``backward`` inside the closure it passes to ``optimizer.step(closure)``, and routes the DDP
model's forward to ``training_step``. Loss: token-level cross entropy on response tokens only, logged with
``self.log``; rank 0 writes its own loss of each step to ``--log`` (a Callback), as the Trainer returned it.

``--strategy fsdp2`` shards the model with FSDP2 instead, as Lightning's docs write it: ``ModelParallelStrategy``
(``data_parallel_size`` the ranks, no tensor parallelism) and a ``configure_model`` that calls ``fully_shard`` on each
decoder layer, then on the model, over the strategy's data-parallel mesh. (Lightning's ``strategy="fsdp"`` is FSDP1,
and needs a GPU.)

``--bug loss-x2-rank=R``: rank R multiplies its loss by 2 (a loss bug on one node).
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


class CausalLM(L.LightningModule):
    def __init__(self, model_dir, lr, loss_scale):
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.lr, self.loss_scale = lr, loss_scale

    def training_step(self, batch, batch_idx):
        input_ids, labels = batch
        logits = self.model(input_ids=input_ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
        self.log("train_loss", loss, prog_bar=False)
        return loss * self.loss_scale

    def configure_model(self):  # --strategy fsdp2: Lightning calls it with its device mesh set
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LossLog(L.Callback):
    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")


def strategy(name, devices):
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--devices", type=int, default=4, help="ranks per node: the launcher's nproc")
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bug", default="none", help="none, or loss-x2-rank=R")
    ap.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    args = ap.parse_args()
    L.seed_everything(1234)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy(args.strategy, args.devices),
                        max_steps=args.steps, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[LossLog(args.log)])
    if trainer.global_rank == 0 and os.path.exists(args.log):
        os.remove(args.log)
    bug, _, rank = args.bug.partition("=")
    scale = 2.0 if bug == "loss-x2-rank" and int(rank) == trainer.global_rank else 1.0
    tok = AutoTokenizer.from_pretrained(args.model)
    ds = AlpacaDataset(args.data, tok, args.max_len, args.rows)
    # Lightning puts a DistributedSampler under this loader itself (use_distributed_sampler, on by default).
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate_with(tok.pad_token_id))
    trainer.fit(CausalLM(args.model, args.lr, scale), loader)


if __name__ == "__main__":
    main()

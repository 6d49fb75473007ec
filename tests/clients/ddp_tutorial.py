"""Causal-LM fine-tuning in the style of PyTorch's torchrun DDP tutorial (multigpu_torchrun.py), on CPU/gloo.

torchrun --nproc_per_node 4 ddp_tutorial.py --model DIR --data JSON --steps 6 --log loss.jsonl

Knows nothing about healthcheck. Loss: token-level cross entropy on response tokens only (prompt tokens -> -100).
Logged per step (rank 0): the global token-weighted mean loss = all_reduce(sum of token losses) / all_reduce(tokens).

``--bug`` reproduces mistakes real scripts make, for healthcheck's detection tests:
``sampler-seed-per-rank`` (DistributedSampler(seed=rank)), ``reseed-rank=R`` (rank R calls manual_seed again
after init_process_group), ``loss-x2-rank=R`` (rank R multiplies its loss by 2), ``eval-pass-rank=R`` (rank R
computes a validation loss before training and leaves the model in eval mode), ``dropout-rank=R`` (rank R
loads the model with attention dropout 0.1, as a per-node config override would), ``label-smoothing-rank=R``
(rank R's loss has label smoothing 0.1, the same kind of override), ``norm-eps-rank=R`` (rank R loads the model
with ``rms_norm_eps=1e-5``, as a node whose copy of config.json is another revision would), ``batch-size-rank=R``
(rank R's DataLoader takes 2 more samples per batch, as a per-node batch-size override would), ``stale-data-rank=R`` (rank R's copy of the
data file lacks its first row: same length, other samples at each index), ``no-eos-rank=R`` (rank R's collate
drops each sample's last token, the EOS, as a per-node tokenizer config without the EOS would),
``no-zero-grad-rank=R`` (rank R never calls ``optimizer.zero_grad()``, as a rank whose call sits in a branch it
never takes would; DDP still gives every rank the same update, so the parameters stay equal),
``nodecay-lr-rank=R`` (every rank splits AdamW into a decay and a no-decay group, as nanoGPT and the Trainer do, and
rank R's no-decay group has 10x the learning rate), ``matmul-medium-rank=R`` (rank R calls
``torch.set_float32_matmul_precision("medium")``, a speed-up some nodes' launch config adds: bf16 matmuls in oneDNN,
TF32 in cuBLAS), ``slow-rank=R``
(rank R spends 50 ms between its backward and the optimizer step, as a rank that saves or logs synchronously does),
and three bugs of the loop between the loader and the loss, as a node running another revision of the training
code would have them: ``loop-shift-rank=R`` (rank R's loss pairs each position with the label two tokens on, an
off-by-one in its shift), ``input-noise-rank=R`` (rank R replaces 15% of its input tokens with padding before the
forward, a token-masking augmentation left on: its labels keep the original tokens), ``no-mask-rank=R`` (rank R
calls the model without its ``attention_mask``) and ``z-loss-rank=R`` (rank R adds PaLM's z-loss, 1e-2 times the mean
square of its logits' log-partition, a term a per-node config switches on).
``attention-patch-rank=R``: rank R applies an attention patch at import time (``tests/clients/attention_patch.py``:
``LlamaAttention.forward`` replaced, as FastChat's and LongLoRA's patches replace it), as a launch path that applies
it on some nodes only would. ``rope-patch-rank=R``: rank R replaces transformers' module-level
``apply_rotary_pos_emb`` instead (``attention_patch.apply_rope``, as Liger's ``rope=True`` does).
``global-hook-rank=R``: rank R registers a forward hook for every module (``register_module_forward_hook``), as a node's
activation checker would, that hands on each embedding output rounded to bfloat16 instead of the original.
Several bugs are separated by commas: ``reseed-rank=1,dropout-rank=3``.

``--look-first-rank R`` is no bug, a habit the probe must pass: rank R takes the first batch of its training
loader and prints a sanity loss of the unwrapped model in eval mode, without ``no_grad``, before training, and
an example it picks with ``random.choice`` (python's generator, which ``--set-seed`` seeds on every rank). With
``--look-first-through-ddp`` the sanity loss is the DDP model's under ``no_grad``, as a script that logs a first
validation loss on rank 0 computes it: that forward broadcasts the model's buffers, and torch pairs the broadcast
with the others' first training forward's.

``--compile-step BACKEND`` compiles each optimizer's step as PyTorch's compiled-optimizer recipe writes it (a
function calling ``opt.step()`` under ``torch.compile(fullgraph=False)``; the recipe's backend is ``inductor``).
``--clip MAX_NORM`` clips the gradient norm before each step, inside that compiled function with ``--compile-step``.
``--compile-batch BACKEND`` compiles each batch's whole function (forward, loss, backward, clip and step) as PyTorch's
compiled-autograd tutorial compiles its ``train``: dynamo breaks its graph at the backward and runs DDP's
communication hook, and every other hook of the backward, from inside that compiled function.

``--set-seed`` seeds with ``transformers.set_seed`` (python, numpy and torch) instead of ``torch.manual_seed``.

``--stream`` reads the data as a stream instead: an ``IterableDataset`` that keeps every ``WORLD_SIZE``-th sample
from its rank on, as a streaming pipeline shards itself (no sampler, no indices). Its bugs: ``stream-unsharded``
(no rank keeps its own part: every rank reads the whole stream) and ``stream-shard-rank=R`` (rank R keeps the part
of rank R+1, as a node whose RANK is read from the wrong variable would) and ``stream-no-worker-split`` (the stream
ignores ``get_worker_info()``: with ``--workers 2`` each DataLoader worker yields the rank's whole part, torch's
documented pitfall).

``--val-every K`` computes a validation loss on the DDP model in eval mode after every K-th step, forgetting
``torch.no_grad()`` (no backward follows it).

``--dtype bfloat16`` loads and trains the model in bf16, without autocast: the loss is computed on bf16 logits.

``--loss-chunks K`` computes the loss as torchtune's ``CEWithChunkedOutputLoss`` does, to save memory: the
cross-entropy of K slices of the sequence, each with ``reduction="sum"``, added and divided by the token count.

``--muon`` trains as nanochat does, with two optimizers stepped one after the other: ``torch.optim.Muon`` for the
decoder's 2-D weight matrices and AdamW for the embeddings, the head and the norms. With it, the bug
``adamw-lr-rank=R`` gives rank R's AdamW ten times the learning rate (a per-node override of one optimizer's).
"""

import argparse
import contextlib
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def ddp_setup():
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    init_process_group(backend="gloo")


def alpaca_prompt(row):
    if row.get("input"):
        return f"### Instruction:\n{row['instruction']}\n\n### Input:\n{row['input']}\n\n### Response:\n"
    return f"### Instruction:\n{row['instruction']}\n\n### Response:\n"


class AlpacaDataset(Dataset):
    def __init__(self, path, tokenizer, max_len, rows, skip=0):
        with open(path) as f:
            data = json.load(f)[skip : skip + rows]
        self.items = []
        for row in data:
            p = tokenizer(alpaca_prompt(row), add_special_tokens=False)["input_ids"]
            c = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids = (p + c)[:max_len]
            labels = ([-100] * len(p) + c)[:max_len]
            self.items.append((ids, labels))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class AlpacaStream(IterableDataset):
    """The samples of an AlpacaDataset as a stream: every ``world``-th one from ``part`` on (each DataLoader worker
    keeps its own share of those)."""

    def __init__(self, dataset, part, world, split_workers=True):
        self.dataset, self.part, self.world, self.split_workers = dataset, part, world, split_workers

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info and self.split_workers else (1, 0)
        mine = range(self.part, len(self.dataset), self.world)
        return (self.dataset[i] for n, i in enumerate(mine) if n % workers == worker)


def make_collate(pad_id, drop_eos=False):
    def collate(batch):
        if drop_eos:
            batch = [(ids[:-1], lab[:-1]) for ids, lab in batch]
        n = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            attn[i, : len(ids)] = 1
        return input_ids, attn, labels

    return collate


class Trainer:
    def __init__(self, model, train_data, optimizer, max_steps, log_path, loss_scale=1.0, pause_s=0.0, smoothing=0.0,
                 zero_grad=True, loss_chunks=1, val_every=0, loop_bugs=()):
        self.loss_chunks, self.val_every, self.loop_bugs = loss_chunks, val_every, set(loop_bugs)
        self.noise = torch.Generator().manual_seed(0)  # its own generator: the others' draws stay as they were
        self.rank = int(os.environ["RANK"])
        self.zero_grad = zero_grad
        self.loss_scale = loss_scale
        self.smoothing = smoothing
        self.pause_s = pause_s
        self.model = DDP(model)  # CPU: no device_ids
        self.train_data = train_data
        self.optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
        self.steps = [optimizer.step for optimizer in self.optimizers]
        self.max_steps = max_steps
        self.log_path = log_path
        self.step = 0

    def _run_batch(self, input_ids, attn, labels):
        if self.zero_grad:
            for optimizer in self.optimizers:
                optimizer.zero_grad()
        if "input-noise" in self.loop_bugs:
            masked = (torch.rand(input_ids.shape, generator=self.noise) < 0.15) & (attn == 1)
            input_ids = input_ids.masked_fill(masked, 0)
        if "no-mask" in self.loop_bugs:
            logits = self.model(input_ids=input_ids).logits
        else:
            logits = self.model(input_ids=input_ids, attention_mask=attn).logits
        shift = 2 if "loop-shift" in self.loop_bugs else 1
        shift_logits = logits[:, :-shift].reshape(-1, logits.size(-1))
        shift_labels = labels[:, shift:].reshape(-1)
        if self.loss_chunks > 1:  # torchtune's CEWithChunkedOutputLoss: the sequence in slices, each one summed
            loss_sum = sum(F.cross_entropy(part.reshape(-1, part.size(-1)), target.reshape(-1), ignore_index=-100,
                                           reduction="sum", label_smoothing=self.smoothing)
                           for part, target in zip(logits[:, :-shift].chunk(self.loss_chunks, dim=1),
                                                   labels[:, shift:].chunk(self.loss_chunks, dim=1), strict=True))
        else:
            loss_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum",
                                       label_smoothing=self.smoothing)
        ntok = (shift_labels != -100).sum()
        loss = self.loss_scale * loss_sum / ntok.clamp(min=1)  # local token mean; DDP averages gradients over ranks
        if "z-loss" in self.loop_bugs:
            loss = loss + 1e-2 * torch.logsumexp(logits, dim=-1).pow(2).mean()
        loss.backward()
        if self.pause_s:
            time.sleep(self.pause_s)
        for step in self.steps:
            step()
        if self.val_every and (self.step + 1) % self.val_every == 0:
            self.validate(input_ids, attn, labels)
        # global token-weighted mean for logging
        stats = torch.stack([loss_sum.detach(), ntok.to(loss_sum.dtype)])
        dist.all_reduce(stats)
        return (stats[0] / stats[1]).item()

    def validate(self, input_ids, attn, labels):
        """A validation loss on the first half of the batch, in eval mode, forgetting ``torch.no_grad()``."""
        self.model.eval()
        half = input_ids.size(1) // 2
        logits = self.model(input_ids=input_ids[:, :half], attention_mask=attn[:, :half]).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:half].reshape(-1), ignore_index=-100)
        print(f"[GPU{self.rank}] validation loss {loss.item():.4f}", flush=True)
        self.model.train()

    def look_first(self, through_ddp=False):
        """A sanity loss on one batch before training (the iterator draws a seed from torch's generator), and a
        random example to eyeball (a draw from python's generator on this rank alone)."""
        self.model.module.eval()
        input_ids, attn, labels = next(iter(self.train_data))
        with torch.no_grad() if through_ddp else contextlib.nullcontext():
            model = self.model if through_ddp else self.model.module
            loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        print(f"[GPU{self.rank}] sanity loss before training {loss.item():.4f}", flush=True)
        example = random.choice(self.train_data.dataset.items)[0]
        print(f"[GPU{self.rank}] an example: {len(example)} tokens, starting {example[:8]}", flush=True)
        self.model.module.train()

    def train(self):
        epoch = 0
        while self.step < self.max_steps:
            if hasattr(self.train_data.sampler, "set_epoch"):
                self.train_data.sampler.set_epoch(epoch)
            for input_ids, attn, labels in self.train_data:
                gloss = self._run_batch(input_ids, attn, labels)
                self.step += 1
                if self.rank == 0:
                    with open(self.log_path, "a") as f:
                        f.write(json.dumps({"step": self.step, "loss": gloss}) + "\n")
                    print(f"[GPU{self.rank}] Epoch {epoch} | Step {self.step} | loss {gloss:.5f}", flush=True)
                if self.step >= self.max_steps:
                    break
            epoch += 1


def clipped_step(optimizer, max_norm, backend=None):
    """``optimizer.step``, after clipping its parameters' gradient norm to ``max_norm`` (when given), compiled with
    ``backend`` (when given) as PyTorch's compiled-optimizer recipe writes it: ``@torch.compile(fullgraph=False) def
    fn(): opt.step()``."""

    def fn():
        if max_norm:
            torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], max_norm)
        optimizer.step()

    return torch.compile(fn, fullgraph=False, backend=backend) if backend else fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--log", required=True)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--split-by-node", action="store_true",
                    help="datasets.distributed.split_dataset_by_node and a shuffled loader instead of a DistributedSampler")
    ap.add_argument("--bug", default="none",
                    help="none, sampler-seed-per-rank, reseed-rank=R, loss-x2-rank=R, eval-pass-rank=R, dropout-rank=R, "
                         "label-smoothing-rank=R, norm-eps-rank=R, batch-size-rank=R, stale-data-rank=R, no-eos-rank=R, "
                         "no-zero-grad-rank=R, stream-unsharded, stream-shard-rank=R, stream-no-worker-split, "
                         "matmul-medium-rank=R, slow-rank=R, loop-shift-rank=R, input-noise-rank=R, no-mask-rank=R, z-loss-rank=R "
                         "or global-hook-rank=R; "
                         "several separated by commas")
    ap.add_argument("--look-first-rank", type=int, default=-1, help="this rank prints a sanity loss before training")
    ap.add_argument("--look-first-through-ddp", action="store_true", help="that sanity loss on the DDP model, under no_grad")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes, kept across epochs")
    ap.add_argument("--set-seed", action="store_true", help="seed python, numpy and torch with transformers.set_seed")
    ap.add_argument("--stream", action="store_true", help="an IterableDataset that shards itself by rank")
    ap.add_argument("--val-every", type=int, default=0, help="a validation loss after every K-th step, without no_grad")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (bfloat16: pure bf16 training, no autocast)")
    ap.add_argument("--loss-chunks", type=int, default=1,
                    help="the cross-entropy over this many slices of the sequence, summed (torchtune's chunked loss)")
    ap.add_argument("--muon", action="store_true", help="Muon for the blocks' matrices and AdamW for the rest, as nanochat")
    ap.add_argument("--compile-step", default=None, metavar="BACKEND",
                    help="each optimizer's step compiled with this backend, as PyTorch's compiled-optimizer recipe")
    ap.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this before each step (in it)")
    ap.add_argument("--compile-batch", default=None, metavar="BACKEND",
                    help="each batch's forward, loss, backward and step compiled as one function with this backend")
    args = ap.parse_args()

    ddp_setup()
    if args.set_seed:
        from transformers import set_seed

        set_seed(args.seed)
    else:
        torch.manual_seed(args.seed)
    rank = int(os.environ["RANK"])
    bugs = dict(part.partition("=")[::2] for part in args.bug.split(","))

    def faulted(bug):  # this rank carries that per-rank bug
        return bugs.get(bug, "") != "" and rank == int(bugs[bug])

    if faulted("reseed-rank"):
        torch.manual_seed(args.seed + rank)
    if faulted("matmul-medium-rank"):
        torch.set_float32_matmul_precision("medium")
    if faulted("attention-patch-rank"):
        import attention_patch

        attention_patch.apply()
    if faulted("rope-patch-rank"):
        import attention_patch

        attention_patch.apply_rope()
    if faulted("global-hook-rank"):
        def check_bf16(module, inputs, output):  # what bf16 would keep of the embeddings, kept by mistake
            return output.to(torch.bfloat16).to(output.dtype) if isinstance(module, torch.nn.Embedding) else None

        torch.nn.modules.module.register_module_forward_hook(check_bf16)
    tok = AutoTokenizer.from_pretrained(args.model)
    overrides = {"attention_dropout": 0.1} if faulted("dropout-rank") else {}
    if faulted("norm-eps-rank"):
        overrides["rms_norm_eps"] = 1e-5
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), **overrides)
    model.train()  # from_pretrained returns the model in eval mode
    ds = AlpacaDataset(args.data, tok, args.max_len, args.rows, skip=1 if faulted("stale-data-rank") else 0)
    world = int(os.environ["WORLD_SIZE"])
    if args.stream:
        if "stream-unsharded" in bugs:
            part, parts = 0, 1
        else:
            part, parts = ((rank + 1) % world if faulted("stream-shard-rank") else rank), world
        ds, sampler = AlpacaStream(ds, part, parts, split_workers="stream-no-worker-split" not in bugs), None
    elif args.split_by_node:
        # Each rank keeps its own part of the data (datasets' documented way), then shuffles it like the others.
        from datasets import Dataset as HFDataset
        from datasets.distributed import split_dataset_by_node

        part = split_dataset_by_node(HFDataset.from_list([{"ids": ids, "labels": lab} for ids, lab in ds.items]), rank=rank,
                                     world_size=world)
        ds.items = [(row["ids"], row["labels"]) for row in part]
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(args.seed))
    elif "sampler-seed-per-rank" in bugs:
        sampler = DistributedSampler(ds, seed=rank)
    else:
        sampler = DistributedSampler(ds, seed=args.seed)
    batch_size = args.batch_size + 2 if faulted("batch-size-rank") else args.batch_size
    loader = DataLoader(ds, batch_size=batch_size, shuffle=False, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.workers > 0,
                        collate_fn=make_collate(tok.pad_token_id, drop_eos=faulted("no-eos-rank")))
    if faulted("eval-pass-rank"):
        model.eval()  # a validation loss before training, and no model.train() after it
        with torch.no_grad():
            input_ids, attn, _ = make_collate(tok.pad_token_id)([ds[i] for i in range(args.batch_size)])
            model(input_ids=input_ids, attention_mask=attn)
    if args.muon:  # nanochat's split: Muon for the blocks' matrices, AdamW for the rest, one step() each
        matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n]
        others = [p for n, p in model.named_parameters() if not (p.ndim == 2 and ".layers." in n)]
        adamw_lr = args.lr * (10 if faulted("adamw-lr-rank") else 1)
        opt = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=adamw_lr)]
    elif "nodecay-lr-rank" in bugs:  # decay and no-decay groups, as nanoGPT and the Trainer build them
        decay = [p for p in model.parameters() if p.ndim >= 2]
        nodecay = [p for p in model.parameters() if p.ndim < 2]
        nodecay_lr = args.lr * (10 if faulted("nodecay-lr-rank") else 1)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0, "lr": nodecay_lr}],
                                lr=args.lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if int(os.environ["RANK"]) == 0 and os.path.exists(args.log):
        os.remove(args.log)
    loss_scale = 2.0 if faulted("loss-x2-rank") else 1.0
    pause_s = 0.05 if faulted("slow-rank") else 0.0
    smoothing = 0.1 if faulted("label-smoothing-rank") else 0.0
    trainer = Trainer(model, loader, opt, args.steps, args.log, loss_scale, pause_s, smoothing,
                      zero_grad=not faulted("no-zero-grad-rank"), loss_chunks=args.loss_chunks, val_every=args.val_every,
                      loop_bugs=[bug for bug in ("loop-shift", "input-noise", "no-mask", "z-loss") if faulted(f"{bug}-rank")])
    if args.compile_step or args.clip:
        trainer.steps = [clipped_step(optimizer, args.clip, args.compile_step) for optimizer in trainer.optimizers]
    if args.compile_batch:  # the compiled-autograd tutorial's `@torch.compile def train(...)`, backward included
        trainer._run_batch = torch.compile(trainer._run_batch, backend=args.compile_batch)
    if rank == args.look_first_rank:
        trainer.look_first(args.look_first_through_ddp)
    trainer.train()
    destroy_process_group()


if __name__ == "__main__":
    main()

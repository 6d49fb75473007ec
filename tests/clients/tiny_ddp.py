"""A minimal torchrun-style DDP loop (a linear model on random data) that can misbehave on purpose.

    torchrun --nproc_per_node 2 tiny_ddp.py --mode ok --steps 10

--mode: ok; raise-at=S (rank 1 raises ValueError at step S); raise-before-init=R (rank R raises RuntimeError before
init_process_group, as a node with a broken config does, while the others wait in the rendezvous); return-after=S (every rank stops after S
steps); never-step (trains the model but never steps an optimizer); no-ddp (trains a plain model, averaging each
gradient with dist.all_reduce as PyTorch's "Writing Distributed Applications" tutorial does);
comm-hook (registers torch's allreduce_hook as its DDP communication hook; comm-hook=R: rank R only); fp16-hook
(torch's fp16_compress_hook on every rank; fp16-hook=S: the loss times S, so S=1e-5 puts the gradients under fp16's
normal range as a large model's are); half (an fp16 model and data under SGD, so DDP reduces fp16 buckets;
half=S: the loss times S); fp16-hook-off=R (the same hook, rank R's sums coming back 1% off: a device
that computes wrong); late-comm-hook (allreduce_hook, registered after the first step);
module-forward (calls the DDP model's .module, so DDP reduces nothing); compiled (torch.compile(DDP(model)), aot_eager:
the monitor is made by a pre-hook of the DDP module the compiled one calls);
python-reducer (compiled autograd on, and DDP built with torch's Python reducer, ``optimize_ddp="python_reducer"``, as
compiled autograd needs); accum-sync=K (K micro-batches a step, every backward all-reduced: no no_sync); accum-module=K (K micro-batches a
step, all but the last through the DDP model's ``.module``, which DDP never reduces: the accumulation some repositories
write instead of no_sync); zero-loss=R (every rank's loss times
its weight, 0 on rank R, as a per-node loss weight of 0 would: its gradient is zero, its loss is not);
bucket-view (DDP with gradient_as_bucket_view); spawn (starts its own workers with torch.multiprocessing.spawn);
zero (torch's ZeroRedundancyOptimizer around SGD, as PyTorch's ZeRO tutorial writes it: each rank steps its own
partition of the parameters and broadcasts it); zero-lr=R (the same, rank R's learning rate 10x: its partition moves
otherwise, and the broadcast still leaves every replica bit-identical); zero-warmup=R (the same with a linear warmup
from 0 over 4 steps, over 8 on rank R: a per-node schedule, equal at the first step); zero-bias-warmup=R (the same
with the weights and the biases in two parameter groups, nanoGPT's decay/no-decay split, and the warmup on the
biases' group only: the first group's rate agrees on every rank at every step); join=R (PyTorch's uneven-inputs
recipe: the loop inside ``Join([model])``, rank R with 2 batches fewer than the others, which it then shadows).
Knows nothing about healthcheck.
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(index):  # for --mode spawn
    pass


OFF = 1.0  # fp16-hook-off: this rank's factor on its reduced buckets


def fp16_compress_hook(state, bucket):  # torch's, under its own name (DDP logs the hook's qualname)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    reduced = default_hooks.fp16_compress_hook(state, bucket)
    return reduced if OFF == 1.0 else reduced.then(lambda done: done.value().mul_(OFF))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="ok")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    mode, _, value = args.mode.partition("=")
    if mode == "spawn":
        torch.multiprocessing.spawn(worker, nprocs=2)
    if mode == "raise-before-init" and int(os.environ["RANK"]) == int(value):
        raise RuntimeError("this node's config is broken")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    dtype = torch.float16 if mode == "half" else torch.float32
    model = model.to(dtype)
    if mode == "python-reducer":  # what a compiled-autograd setup sets before wrapping: DDP's Python reducer
        import torch._dynamo as dynamo

        dynamo.config.compiled_autograd = True
        dynamo.config.optimize_ddp = "python_reducer"
    if mode != "no-ddp":
        model = DDP(model, gradient_as_bucket_view=mode == "bucket-view")
    if mode == "compiled":
        model = torch.compile(model, backend="aot_eager")
    if mode == "comm-hook" and value in ("", str(rank)):  # comm-hook=R: rank R only
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if mode in ("fp16-hook", "fp16-hook-off"):
        global OFF
        OFF = 1.01 if mode == "fp16-hook-off" and rank == int(value) else 1.0
        model.register_comm_hook(None, fp16_compress_hook)
    scheduler = None
    if mode in ("zero", "zero-lr", "zero-warmup", "zero-bias-warmup"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        lr = 1.0 if mode == "zero-lr" and rank == int(value) else 0.1
        warmup = 8 if mode.endswith("warmup") and rank == int(value) else 4
        if mode == "zero-bias-warmup":
            weights = [p for p in model.parameters() if p.dim() > 1]
            biases = [p for p in model.parameters() if p.dim() <= 1]
            optimizer = ZeroRedundancyOptimizer(weights, optimizer_class=torch.optim.SGD, lr=lr)
            optimizer.add_param_group({"params": biases})
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1.0, lambda s: min(1.0, s / warmup)])
        else:
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=lr)
        if mode == "zero-warmup":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / warmup))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    if mode == "join":
        from torch.distributed.algorithms.join import Join
    steps = args.steps - 2 if mode == "join" and rank == int(value) else args.steps
    with Join([model]) if mode == "join" else contextlib.nullcontext():
        for step in range(steps):
            if mode == "return-after" and step == int(value):
                return
            if mode == "raise-at" and step == int(value) and rank == 1:
                raise ValueError(f"bad batch at step {step}")
            x, y = torch.randn(8, 16, generator=generator).to(dtype), torch.randn(8, 4, generator=generator).to(dtype)
            if mode == "late-comm-hook" and step == 1:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                model.register_comm_hook(None, default_hooks.allreduce_hook)
            forward = model.module if mode == "module-forward" else model
            if mode == "accum-module":  # accum-module=K: K micro-batches, all but the last through .module (no reduction)
                for _ in range(int(value) - 1):
                    torch.nn.functional.mse_loss(model.module(x), y).backward()
            if mode == "accum-sync":  # accum-sync=K: K micro-batches a step, each backward all-reduced (no no_sync)
                for _ in range(int(value) - 1):
                    torch.nn.functional.mse_loss(forward(x), y).backward()
                    x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
            loss = torch.nn.functional.mse_loss(forward(x), y)
            if mode in ("fp16-hook", "half") and value:  # fp16-hook=S, half=S: the loss (so every gradient) times S
                loss = loss * float(value)
            if mode == "zero-loss":  # every rank weighs its loss by its configured weight: 0 on rank R
                loss = loss * (0.0 if rank == int(value) else 1.0)
            loss.backward()
            if mode == "no-ddp":  # the tutorial's average_gradients
                for param in model.parameters():
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
                    param.grad /= dist.get_world_size()
            if mode != "never-step":
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

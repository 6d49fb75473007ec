"""fp16 mixed precision under DDP, as PyTorch's AMP recipe writes it: autocast(float16) and a GradScaler (CPU, gloo).

torchrun --nproc_per_node 2 amp_ddp.py --steps 8 [--init-scale 1048576] [--no-scaler] [--rank-scale R=S] [--fused]
                                         [--two-optimizers [first-layer-first|last-layer-first]]

The scaler starts at --init-scale (2**20 overflows in fp16 for the first steps on every rank here, and the scaler skips
them: optimizer.step() is not called, and the scale halves, as a GPU run starting at 2**16 often does). --no-scaler:
the same loop with GradScaler(enabled=False). --rank-scale R=S: rank R's scaler starts at S instead (a per-node
config). --fused: AdamW(fused=True), which takes the scaling itself (the scaler calls its step with found_inf set, and
it skips inside). --two-optimizers: one AdamW per Linear, stepped one after the other through the scaler (the AMP
recipe's several optimizers): an inf in one optimizer's gradients skips that one alone (from 2**20 the last layer's
overflow alone at the script's steps 3 and 4, so the optimizer stepped first is skipped in one order and steps in
the other). The loss is the token cross-entropy a language model's is. Knows nothing about healthcheck.
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--init-scale", type=float, default=2.0**20)
    ap.add_argument("--no-scaler", action="store_true")
    ap.add_argument("--rank-scale", default="")
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--inf-rank", type=int, default=-1,
                    help="this rank's loss is inf from the script's step 2 on (a device that overflows in fp16 where others do not)")
    ap.add_argument("--two-optimizers", nargs="?", const="first-layer-first", choices=["first-layer-first", "last-layer-first"])
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)))
    if args.two_optimizers:
        optimizers = [torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=args.fused or None) for layer in model.module[::2]]
        if args.two_optimizers == "last-layer-first":
            optimizers.reverse()
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3, fused=args.fused or None)]
    init_scale = args.init_scale
    if args.rank_scale and int(args.rank_scale.partition("=")[0]) == rank:
        init_scale = float(args.rank_scale.partition("=")[2])
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=not args.no_scaler)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=generator) * 10
        y = torch.randint(0, 64, (32,), generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if rank == args.inf_rank and step >= 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        for optimizer in optimizers:
            scaler.step(optimizer)
        # For the log only: which optimizers this step's inf skipped (the scaler's per-optimizer record).
        skipped = [i for i, o in enumerate(optimizers)
                   if scaler.is_enabled() and sum(v.item() for v in scaler._found_inf_per_device(o).values())]
        scaler.update()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():.0f} skipped {skipped}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

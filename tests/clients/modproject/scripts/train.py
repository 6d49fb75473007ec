"""Plain DDP training run as a module: ``torchrun --nproc_per_node 2 -m scripts.train [--steps N] [--lr-rank R=LR]``.

Needs ``python -m``: it imports the library from the working directory and its options relatively, and checks that
it runs as the module ``scripts.train`` with its own file as ``sys.argv[0]``. Knows nothing about healthcheck.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from toylib.model import build

from .options import parse


def main():
    assert __spec__ is not None and __spec__.name == "scripts.train", "run me with python -m scripts.train"
    assert os.path.samefile(sys.argv[0], __file__), sys.argv[0]
    args = parse()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(build())
    lr = float(args.lr_rank.partition("=")[2]) if args.lr_rank and int(args.lr_rank.partition("=")[0]) == rank else args.lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x, y = torch.randn(16, 32, generator=generator), torch.randint(0, 16, (16,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

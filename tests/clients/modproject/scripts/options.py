"""The training script's command line, in a module of its own (imported relatively by ``scripts.train``)."""

import argparse


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-rank", default="", help="R=LR: rank R trains with learning rate LR (a per-node override)")
    return ap.parse_args()

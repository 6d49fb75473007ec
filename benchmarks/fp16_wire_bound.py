"""How far a correct fp16 compression all-reduce reads against the reduction check's bound, with and without the
floor fp16's underflow adds (``healthcheck.measure.precision.fp16_underflow_floor``).

N simulated ranks each take one backward of a GPT-2 (random init, default size: 124M parameters) on their own random
tokens. Their local gradients, times each ``--scales`` factor (a fine-tuned model's gradient norm is far below this
init's ~8), go through torch's ``fp16_compress_hook`` arithmetic: cast to fp16, divide by N, sum in fp16. Against the
float64 mean, the error is printed over the relative bound γ_{N+1}(2⁻¹¹)·‖mean |g_i|‖ alone (what the check used
before the floor: above 1 is a false alarm) and over the bound with the floor, and the floor's share of that bound;
the last column reads a result 1% off (a device that computes wrong) against the bound with the floor.

    python benchmarks/fp16_wire_bound.py --ranks 8 --scales 1 0.1 0.03 0.01

One process, no collective: the arithmetic is the hook's, the order of the sum rank order (the bound holds for any).
"""

from __future__ import annotations

import argparse

CHUNK = 1 << 22  # elements of every rank upcast to float64 at a time
OFF = 1.01  # a reduction that comes back 1% off (a device that computes wrong): the last column


def local_gradients(ranks: int, layers: int, batch: int, seq: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers))
    rows = []
    for rank in range(ranks):
        model.zero_grad(set_to_none=True)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows)


def fp16_compressed_mean(local):
    """torch's fp16_compress_hook over the rows of ``local``: fl16(Σ fl16(fl16(g_i) / N)), back in ``local``'s dtype."""
    import torch

    parts = local.to(torch.float16).div_(local.shape[0])
    total = parts[0].clone()
    for part in parts[1:]:
        total = total + part
    return total.to(local.dtype)


def read(local, scale: float) -> dict[str, float]:
    from healthcheck.measure import precision

    world = local.shape[0]
    threshold = world * precision.FP16_SMALLEST_NORMAL
    error_sq = off_sq = abs_mean_sq = at_risk_sq = 0.0
    for first in range(0, local.shape[1], CHUNK):
        block = local[:, first : first + CHUNK] * scale
        exact = block.double()
        reduced = fp16_compressed_mean(block).double()
        diff = reduced - exact.mean(0)
        error_sq += float(diff @ diff)
        off = reduced * OFF - exact.mean(0)
        off_sq += float(off @ off)
        abs_mean = exact.abs().mean(0)
        abs_mean_sq += float(abs_mean @ abs_mean)
        at_risk = ((exact.abs() < threshold) & (exact != 0)).sum(0).double()
        at_risk_sq += float(at_risk @ at_risk)
    relative = (precision.gamma(world + 1, 2.0**-11) + precision.gamma(world, 2.0**-53)) * abs_mean_sq**0.5
    floor = precision.fp16_underflow_floor(world, at_risk_sq)
    error = error_sq**0.5
    return {"relative_only": error / relative, "with_floor": error / (relative + floor), "share": floor / (relative + floor),
            "off": off_sq**0.5 / (relative + floor)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12, help="GPT-2 blocks (12: the 124M model)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.1, 0.03, 0.01])
    args = ap.parse_args(argv)
    local = local_gradients(args.ranks, args.layers, args.batch, args.seq)
    norm = float(local.double().norm(dim=1).mean())
    print(f"{args.ranks} ranks, {local.shape[1]:,} gradient values, mean local norm {norm:.3g} at scale 1")
    print(f"{'scale':>6} {'norm':>7} {'relative bound alone':>21} {'with the floor':>15} {'floor share':>12} {'1% off':>7}")
    for scale in args.scales:
        r = read(local, scale)
        print(f"{scale:>6g} {norm * scale:>7.3g} {r['relative_only']:>21.3f} {r['with_floor']:>15.3f} {r['share']:>12.0%} {r['off']:>7.2f}")


if __name__ == "__main__":
    main()

"""Measure the folded count sketch's cosine errors against exact mode on real transformer gradients.

A tiny GPT-2 (2 layers, n_embd 64) is trained on random tokens on N gloo ranks. Each rank holds
one DDP copy monitored with ``direction="exact"`` and one per sketch width k, all with identical
weights and data, so every copy sees the same local gradients; the table compares the sketched
pairwise cosines with the exact ones over every off-diagonal pair of every step, and each rank's cosine to
the mean gradient (sketch mode reads it off the sketches too) with the exact one.

    python benchmarks/sketch_error.py --nproc 8 --steps 5

The sketch of width k uses p bins, the largest prime <= k that divides no tensor dimension of the
model (``healthcheck.measure.sketch.safe_sketch_size``); its stated bound is std(Δcos) <= sqrt(2/p).
The printed table is the "Sketch accuracy" table of docs/measurements.md (its figures of record: the README).
"""

from __future__ import annotations

import argparse
import math

SKETCH_DIMS = (1024, 4096, 16384)


def _gpt2(vocab_size: int, seq_len: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    # No dropout: every copy must see bit-identical local gradients, whatever its RNG draws.
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=vocab_size, n_positions=seq_len,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def _worker(nproc: int, steps: int, vocab_size: int, seq_len: int, batch: int) -> dict | None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from healthcheck.measure import distributed
    from healthcheck.measure.monitor import WorkerConsistencyMonitor

    distributed.set_worker_threads(nproc)
    distributed.init_distributed("cpu", "gloo", 300)
    try:
        rank = distributed.rank()
        directions = {"exact": None, **{f"k={k}": k for k in SKETCH_DIMS}}
        models, monitors = {}, {}
        for name, k in directions.items():
            models[name] = DistributedDataParallel(_gpt2(vocab_size, seq_len))
            monitors[name] = WorkerConsistencyMonitor(
                models[name], direction="exact" if k is None else "sketch", sketch_dim=k or 1, overlap=False
            )
        errors: dict[str, list[float]] = {name: [] for name in directions if name != "exact"}
        to_mean: dict[str, list[float]] = {name: [] for name in errors}
        for step in range(steps):
            generator = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
            results = {}
            for name, model in models.items():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                results[name] = monitors[name].end_step(loss)
            exact = results["exact"].pairwise_cosine
            for name in errors:
                sketch = results[name].pairwise_cosine
                errors[name] += [abs(sketch[i][j] - exact[i][j]) for i in range(nproc) for j in range(nproc) if i != j]
                pairs = zip(results[name].cosine_to_mean, results["exact"].cosine_to_mean, strict=True)
                to_mean[name] += [abs(a - b) for a, b in pairs]
            # One SGD step on the exact copy, mirrored onto the others so all stay identical.
            reference = models["exact"].module
            with torch.no_grad():
                for param in reference.parameters():
                    param -= 1e-2 * param.grad
            for model in models.values():
                if model.module is not reference:
                    model.module.load_state_dict(reference.state_dict())
                model.zero_grad(set_to_none=True)
        for monitor in monitors.values():
            monitor.close()
        widths = {name: monitors[name]._sketcher.dim for name in errors}
        return {"errors": errors, "to_mean": to_mean, "widths": widths} if rank == 0 else None
    finally:
        distributed.destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8, help="gloo ranks (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    args = parser.parse_args()


    from healthcheck.run import launcher

    results = launcher.launch_local(
        _worker, args.nproc, args=(args.nproc, args.steps, args.vocab_size, args.seq_len, args.batch),
        run_id="sketch-error",
    )
    errors, to_mean, widths = results[0]["errors"], results[0]["to_mean"], results[0]["widths"]
    pairs = len(next(iter(errors.values())))
    ranks = len(next(iter(to_mean.values())))
    print(f"tiny GPT-2, {args.nproc} gloo ranks, {args.steps} steps, {pairs} ordered rank pairs and {ranks} rank-steps per k")
    print("| k | p (bins) | bound sqrt(2/p) on std | rms Δcos | mean \\|Δcos\\| | max \\|Δcos\\| "
          "| cosine to the mean: rms Δ | max \\|Δ\\| |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in SKETCH_DIMS:
        values, near = errors[f"k={k}"], to_mean[f"k={k}"]
        p = widths[f"k={k}"]
        print(f"| {k} | {p} | {math.sqrt(2 / p):.4f} | {_rms(values):.4f} | {sum(values) / len(values):.4f} | {max(values):.4f} "
              f"| {_rms(near):.4f} | {max(near):.4f} |")


def _rms(values: list[float]) -> float:
    """Root mean square.

    >>> _rms([3.0, 4.0]) ** 2
    12.5
    """
    return math.sqrt(sum(v * v for v in values) / len(values))


if __name__ == "__main__":
    main()

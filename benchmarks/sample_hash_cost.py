"""Host time a ``--script`` probe adds to each DataLoader fetch: hashing every sample of the batch it yields.

:mod:`healthcheck.integrations.script.sample_hashes` hashes each row of ``input_ids`` (the positions its
``attention_mask`` keeps) so the shard audit can judge an ``IterableDataset`` or a per-rank split by content. It runs
on the script's main thread at every fetch, so it is measured against a fetch's budget: the ratio is its time over
``--step-ms`` (a training step's time; one fetch per micro-batch, accumulation makes it smaller still).

Median of ``--repeats`` calls after one warm-up, one thread; random token ids, half of each row padding.

    python benchmarks/sample_hash_cost.py --shapes 4x256 32x2048 8x8192 --step-ms 100 --repeats 51
"""

from __future__ import annotations

import argparse
import statistics
import time


def batch_of(rows: int, tokens: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32000, (rows, tokens), generator=generator)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    mask[:, tokens // 2 :] = 0  # right padding, as a collate pads to the longest sample
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def median_ms(batch: dict, repeats: int) -> float:
    from healthcheck.integrations.script.sample_hashes import sample_hashes

    sample_hashes(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample_hashes(batch)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4x256", "32x2048", "8x8192"], help="ROWSxTOKENS per batch")
    parser.add_argument("--step-ms", type=float, default=100.0, help="the training step the fetch belongs to")
    parser.add_argument("--repeats", type=int, default=51)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>10} {'ms/fetch':>9} {'us/sample':>10} {'of a ' + format(args.step_ms, 'g') + ' ms step':>16}")
    for shape in args.shapes:
        rows, tokens = (int(part) for part in shape.split("x"))
        ms = median_ms(batch_of(rows, tokens), args.repeats)
        print(f"{shape:>10} {ms:9.3f} {1000 * ms / rows:10.1f} {ms / args.step_ms:16.2%}")


if __name__ == "__main__":
    main()

"""Host time of one step's metrics on each rank, by world size: the N×N pieces by Python loops and by numpy.

Every rank turns the gathered rows into :class:`~healthcheck.measure.metrics.StepMetrics` every step, and three
pieces of that grow as N²: the pairwise cosines, their mean and minimum, and the Gram's row sums (the cosine to
the mean). ``loops`` computes them as healthcheck did until 2026-11-27, a Python float loop over nested lists
(kept here, in :func:`loop_pieces`, only to be timed); ``numpy`` as :mod:`healthcheck.measure.metrics` does now,
on the float64 Gram as it comes. Both give the same bits (``tests/unit/measure/test_metrics.py``; checked here too).
``complete`` is the whole of :func:`healthcheck.measure.step_gather.complete` for a host step in sketch mode
(rows as shared memory hands them: the header and the fp32 sketch; the Gram's matrix product included).

Median of ``--repeats`` calls after one warm-up, one thread, in ms; random sketches of ``--k`` values.

    python benchmarks/step_metrics_cost.py --worlds 8 64 256 --k 4096 --repeats 21
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable


def loop_pieces(gram: list[list[float]]) -> tuple[list[list[float]], float, float, list[float]]:
    """The N² pieces as Python loops (the code this module's ``numpy`` column replaced): cosines, their finite
    off-diagonal mean (exactly rounded) and minimum, and the Gram's row sums over N."""
    rows = [[float(value) for value in row] for row in gram]
    norms = [math.sqrt(row[i]) if row[i] > 0 and math.isfinite(row[i]) else math.nan for i, row in enumerate(rows)]
    cosine = []
    for i, row in enumerate(rows):
        out = []
        for j, value in enumerate(row):
            ratio = 1.0 if i == j and not math.isnan(norms[i]) else value / (norms[i] * norms[j])
            out.append(ratio if math.isnan(ratio) else min(1.0, max(-1.0, ratio)))
        cosine.append(out)
    kept = [float(v) for i, row in enumerate(cosine) for j, v in enumerate(row) if i != j and isinstance(v, float) and math.isfinite(v)]
    dots = [math.fsum(row) / len(rows) for row in [[float(value) for value in row] for row in gram]]
    return cosine, math.fsum(kept) / len(kept), min(kept), dots


def numpy_pieces(gram: Any) -> tuple[list[list[float]], float, float, list[float]]:
    """The same pieces as healthcheck computes them now."""
    from healthcheck.measure.metrics import _cosine_array, cosine_summary, gram_statistics

    cosine = _cosine_array(gram)
    mean, low = cosine_summary(cosine)
    return cosine.tolist(), mean, low, gram_statistics(gram)[1]


def host_rows(world: int, k: int, seed: int = 0) -> Any:
    """``[world, header + k/2]`` rows as a host step's exchange hands them (the fp32 sketch as float64 slots)."""
    import numpy as np
    import torch

    from healthcheck.measure import host_vectors

    rng = np.random.default_rng(seed)
    common = rng.standard_normal(k).astype(np.float32)
    rows = []
    for rank in range(world):
        sketch = torch.from_numpy((common + 0.5 * rng.standard_normal(k)).astype(np.float32))
        rows.append(host_vectors.pack([2.3 + 0.01 * rank, 512.0, 1.5 + 0.1 * rank, 0.0, 0.2, 0.0, 1.0, 3.0], sketch))
    return torch.stack(rows)


def median_ms(call: Callable[[], Any], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()

    import torch

    from healthcheck.measure.sketch_layout import get_layout

    torch.set_num_threads(1)
    dim = get_layout(args.k).p  # the sketch's length: a prime below k
    print(f"# one step's metrics on one rank: ms, median of {args.repeats}, sketch of {dim} values")
    print("| ranks | N² pieces, loops | N² pieces, numpy | loops / numpy | complete() |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for world in args.worlds:
        loops, vectorised, whole = time_world(world, dim, args.repeats)
        print(f"| {world} | {loops:.3f} | {vectorised:.3f} | {loops / vectorised:.1f} | {whole:.3f} |")


def time_world(world: int, dim: int, repeats: int) -> tuple[float, float, float]:
    """ms for the loops, for numpy, and for the whole ``complete()``, on ``world`` ranks' random rows."""
    import json

    from healthcheck.measure import host_vectors, step_gather

    rows = host_rows(world, dim)
    _, gram = host_vectors.header_and_gram(rows, 8, dim)
    if json.dumps(loop_pieces(gram.tolist())) != json.dumps(numpy_pieces(gram)):
        raise SystemExit(f"world {world}: the numpy pieces differ from the loops' bits")

    def complete() -> Any:
        inflight = step_gather.InFlight(
            step=0, direction="sketch", world=world, work=None, rows=rows, names=["busy_ms"], gram=None,
            buckets=1, sketch_dim=dim, from_gram="cosine",
        )
        return step_gather.complete(inflight)

    return (
        median_ms(lambda: loop_pieces(gram.tolist()), repeats),
        median_ms(lambda: numpy_pieces(gram), repeats),
        median_ms(complete, repeats),
    )

if __name__ == "__main__":
    main()

"""``benchmarks/grad_sketch.py``, the no-comm-hook design probe, without a GPU: its kernel in Triton's interpreter
against the host's sketch (``tests/multiprocess/test_grad_sketch_probe.py`` checks the DDP ordering it rests on).

Triton's interpreter must be switched on before Triton is first imported, so it runs in a fresh interpreter.

    python -m pytest tests/unit/benchmarks/test_grad_sketch.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.benchmark_scripts import BENCHMARKS

REPO = BENCHMARKS.parent

KERNEL = textwrap.dedent(
    f"""
    import sys, torch
    sys.path.insert(0, {str(BENCHMARKS)!r})
    from grad_sketch import GradSketch
    from healthcheck.measure.sketch import sketch_bucket

    sizes = [70_001, 3, 0, 65_488 * 2, 1_000]  # a partial segment, a tiny tensor, an empty one, full segments
    for dtype in (torch.float32, torch.bfloat16):
        sketch = GradSketch(sizes, dtype, "cpu", k=1021, seed=5, kernel=True)
        for step in range(2):  # new tensors at new addresses: the address table follows them
            grads = [torch.randn(n, generator=torch.Generator().manual_seed(10 * step + n)).to(dtype) for n in sizes]
            got, squares = sketch(grads)
            want = sum(sketch_bucket(g, k=1021, seed=5, bucket_id=i) for i, g in enumerate(grads))
            assert float((got - want).abs().max()) <= 1e-6 * float(want.norm()), (dtype, step)
            exact = sum(float(g.double().square().sum()) for g in grads)
            assert abs(float(squares.sum()) - exact) <= 1e-5 * exact, (dtype, step)
            got, squares = [v.clone() for v in (got, squares)]
            host, host_squares = GradSketch(sizes, dtype, "cpu", k=1021, seed=5, kernel=False)(grads)  # the CPU arm's path
            assert float((host - got).abs().max()) <= 1e-6 * float(want.norm())
            assert abs(float(host_squares.sum()) - float(squares.sum())) <= 1e-5 * exact
    print("ok")
    """
)

def run_interpreted(code: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_one_launch_sketches_every_tensor_as_the_host_does():
    pytest.importorskip("triton")
    run_interpreted(KERNEL)

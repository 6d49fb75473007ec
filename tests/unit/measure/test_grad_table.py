"""``healthcheck.measure.grad_table``: one launch over a table of tensors' addresses, run by Triton's interpreter on the
host (it must be switched on before Triton is first imported, so in a fresh interpreter), against the host's sketch
of each tensor as a bucket of its own, and :class:`~healthcheck.measure.local_grads.HostTable`, the path without it.

    python -m pytest tests/unit/measure/test_grad_table.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from healthcheck.measure.local_grads import HostTable, _blocker, choose, gradient_source
from healthcheck.measure.sketch import sketch_bucket

INTERPRETED = textwrap.dedent(
    """
    import torch
    from healthcheck.measure.grad_table import GradTable
    from healthcheck.measure.local_grads import gradient_source, HostTable
    from healthcheck.measure.sketch import sketch_bucket

    sizes = [70_001, 3, 0, 65_488 * 2, 1_000]  # a partial segment, a tiny tensor, an empty one, full segments
    for dtype in (torch.float32, torch.bfloat16):
        tables = [GradTable(sizes, dtype, "cpu", k=1021, seed=5, rank=r, world=3) for r in range(3)]
        for step in range(3):  # new tensors at new addresses each step: the address vector follows them
            grads = [torch.randn(n, generator=torch.Generator().manual_seed(10 * step + n)).to(dtype) for n in sizes]
            if step == 2:
                grads[0] = None  # a parameter without a gradient reads as zeros
            present = [(i, g) for i, g in enumerate(grads) if g is not None]
            got, squares = tables[0].local(grads)
            want = sum(sketch_bucket(g, k=1021, seed=5, bucket_id=i) for i, g in present)
            assert float((got - want).abs().max()) <= 1e-6 * float(want.norm()), (dtype, step)
            exact = sum(float(g.double().square().sum()) for _, g in present)
            assert abs(float(squares.double().sum()) - exact) <= 1e-5 * exact, (dtype, step)
            host, host_squares = HostTable(k=1021, seed=5, rank=0, world=1).local(grads)
            assert float((host - got).abs().max()) <= 1e-6 * float(want.norm()) and abs(host_squares - exact) <= 1e-9 * exact
            # Three ranks' shares of the squares: each row on exactly one rank, so they add up to the whole.
            shares = [float(t.mean_squares(grads).double().sum()) for t in tables]
            assert abs(sum(shares) - exact) <= 1e-5 * exact and all(0 < s < exact for s in shares), (shares, exact)
        assert tables[0].address_changes == 3
        tables[0].local(grads)
        assert tables[0].address_changes == 3  # the same tensors: no copy
    print("ok")
    """
)


def test_one_launch_sketches_every_tensor_and_the_ranks_shares_add_up():
    pytest.importorskip("triton")  # a test dependency ([test] extra)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_host_table_sketches_each_tensor_as_a_bucket_and_splits_the_squares_by_tensor():
    grads = [torch.randn(300), None, torch.randn(7), torch.randn(50)]
    sketch, squares = HostTable(k=61, seed=2, rank=0, world=1).local(grads)
    want = sketch_bucket(grads[0], k=61, seed=2, bucket_id=0) + sketch_bucket(grads[2], k=61, seed=2, bucket_id=2)
    want += sketch_bucket(grads[3], k=61, seed=2, bucket_id=3)
    assert torch.allclose(sketch, want, atol=1e-5)
    whole = sum(float(g.double().square().sum()) for g in grads if g is not None)
    assert abs(squares - whole) <= 1e-12 * whole
    shares = [HostTable(k=61, seed=2, rank=r, world=2).mean_squares(grads) for r in range(2)]
    assert abs(sum(shares) - whole) <= 1e-12 * whole and min(shares) > 0


def _ddp_like(**fields):
    params = fields.pop("params", [torch.nn.Parameter(torch.zeros(3))])
    return type("DDPLike", (), {"parameters": lambda self: iter(params), **fields})()


def test_the_pass_is_refused_where_it_cannot_read_the_local_gradient():
    cases = {"exact mode": dict(direction="exact", exchange="auto"), "carry": dict(direction="sketch", exchange="carry")}
    for reason, options in cases.items():
        assert reason.split()[0] in _blocker(_ddp_like(), **options).lower(), reason
        assert choose(_ddp_like(), "grads", **options) == (False, _blocker(_ddp_like(), **options))
        # The monitor's own arguments rule the pass out on every rank alike: no collective, and "grads" says why.
        with pytest.raises(ValueError, match="local_from='grads' cannot run here: .*" + reason.split()[0]):
            gradient_source(_ddp_like(), "grads", **options)
        assert gradient_source(_ddp_like(), "auto", **options) == "comm_hook"
    plain = dict(direction="sketch", exchange="auto")
    assert "gradient_as_bucket_view" in _blocker(_ddp_like(gradient_as_bucket_view=True), **plain)
    mixed = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    assert "one dtype" in _blocker(_ddp_like(params=mixed), **plain)
    assert choose(_ddp_like(), "grads", **plain) == (True, "")
    wants, why_not = choose(_ddp_like(), "auto", **plain)  # a host model keeps the hook's C pass
    assert not wants and "not on a CUDA device" in why_not
    assert choose(_ddp_like(), "buckets", **plain) == (False, "")
    assert gradient_source(_ddp_like(), "buckets", **plain) == "comm_hook"
    with pytest.raises(ValueError, match="local_from: expected one of"):
        choose(_ddp_like(), "both", **plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernel; CI runs it in the interpreter)")
def test_the_compiled_kernel_on_cuda_matches_the_host_sketch():
    from healthcheck.measure.grad_table import GradTable

    sizes = [5_000_001, 3, 0, 65_488 * 40, 1]
    for dtype in (torch.bfloat16, torch.float32):
        grads = [torch.randn(n, device="cuda").to(dtype) for n in sizes]
        grads[1] = None
        table = GradTable(sizes, dtype, "cuda", k=4096, seed=9, rank=1, world=2)
        got, squares = table.local(grads)
        want = sum(sketch_bucket(g, k=4096, seed=9, bucket_id=i) for i, g in enumerate(grads) if g is not None)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.norm()), dtype
        exact = sum(float(g.double().square().sum()) for g in grads if g is not None)
        assert abs(float(squares.double().sum()) - exact) <= 1e-5 * exact
        other = GradTable(sizes, dtype, "cuda", k=4096, seed=9, rank=0, world=2)
        shares = float(table.mean_squares(grads).double().sum()) + float(other.mean_squares(grads).double().sum())
        assert abs(shares - exact) <= 1e-5 * exact

"""The fused sketch kernel (healthcheck.measure.sketch_kernel): the same sketch and ‖x‖² as the torch executors.

Without a GPU the kernel runs in Triton's interpreter, which must be switched on before Triton is first imported,
so those checks run in a fresh interpreter process. A CUDA-only test compiles it for real (skipped in CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from healthcheck.measure import sketch

INTERPRETED = textwrap.dedent(
    """
    import torch
    from healthcheck.measure import sketch, sketch_kernel
    from healthcheck.measure.sketch import FoldedSketch, sketch_bucket

    cases = [  # (numel, k, dtype, m, chunk): a partial segment alone; full rows and a tail; bf16 and fp16;
        (100, 8, torch.float32, None, None),  # many chunks of a few rows each
        (300_001, 4096, torch.float32, None, None),
        (70_000, 1021, torch.bfloat16, None, None),
        (1_000, 4096, torch.float16, None, None),
        (5_000, 31, torch.float32, 2, 31 * 2 * 4),
        (0, 4096, torch.float32, None, None),
    ]
    for n, k, dtype, m, chunk in cases:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float32).to(dtype)
        got, sqnorm = sketch_kernel.sketch_and_sqnorm(x, k=k, seed=7, bucket_id=5, m=m, chunk=chunk)
        want = sketch_bucket(x, k=k, seed=7, bucket_id=5, m=m, chunk=chunk)
        exact = float(x.double().square().sum())
        assert got.dtype == torch.float32 and got.shape == want.shape, (n, got.shape, want.shape)
        assert float((got - want).abs().max()) <= 1e-6 * max(float(want.norm()), 1e-30), (n, k, dtype)
        assert abs(float(sqnorm) - exact) <= 1e-6 * max(exact, 1e-30), (n, float(sqnorm), exact)
        assert n or float(got.abs().sum()) == 0.0

    # The division in place is torch's div_, bit for bit, and the sketch and norm are of the values before it.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for world in (3, 8, 6):
            x = torch.randn(140_001, generator=torch.Generator().manual_seed(world), dtype=torch.float32).to(dtype)
            before = x.clone()
            got, sqnorm = sketch_kernel.sketch_and_sqnorm(x, k=4096, seed=1, bucket_id=0, divide_by=world)
            if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 (numpy has no bf16); a GPU rounds to
                assert float(((x.float() - (before / world).float()) / (before / world).float()).abs().max()) <= 2**-7
            else:  # nearest, which the CUDA test below checks bit for bit
                assert torch.equal(x, before / world), (dtype, world)
            assert float((got - sketch_bucket(before, k=4096, seed=1, bucket_id=0)).abs().max()) <= 1e-6 * float(got.norm())
            assert abs(float(sqnorm) - float(before.double().square().sum())) <= 1e-5 * float(sqnorm)

    # FoldedSketch.with_sqnorm takes the kernel where it is offered, in (sketch, sqnorm) order, and divides.
    sketch._kernel_for = lambda x: sketch_kernel
    folded = FoldedSketch(1024, seed=3)
    x = torch.randn(200_003, generator=torch.Generator().manual_seed(1))
    before = x.clone()
    got, sqnorm = folded.with_sqnorm(4, x, divide_by=4)
    assert float((got - folded(4, before)).abs().max()) <= 1e-6 * float(got.norm()) and torch.equal(x, before / 4)
    assert abs(float(sqnorm) - float(before.double().square().sum())) <= 1e-5 * float(sqnorm)

    # The monitor's planned path: each bucket adds into its row of one table, zeroed once a step. A bucket index past
    # the table grows it (the step's earlier views stay valid), a bucket run twice in a step counts its last run, and
    # a new step starts from zero.
    from healthcheck.measure.bucket_plans import BucketPlans

    plans = BucketPlans(1021, seed=3)

    def bucket(seed, n):
        return torch.randn(n, generator=torch.Generator().manual_seed(seed)).bfloat16()

    for step in range(2):
        if step == 1:  # a first backward whose bucket 0 the step's second backward replaces
            first = bucket(99, 90_001)
            plans.take(0, first).divide_square_sketch(first, 2)
        results = {}
        for index in (0, 1, 9):  # 9: past the table's first 8 rows
            x = bucket(10 * step + index, 90_001)
            before = x.clone()
            planned = plans.take(index, x)
            assert planned is not None and planned.takes(x)
            results[index] = (before, *planned.divide_square_sketch(x, 2))
        for index, (before, got, squares) in results.items():
            want = sketch_bucket(before, k=1021, seed=3, bucket_id=index)
            assert float((got - want).abs().max()) <= 1e-6 * float(want.norm()), (step, index)
            assert abs(float(squares.sum()) - float(before.double().square().sum())) <= 1e-5 * float(squares.sum())
        plans.new_step()
    assert all(float(got.abs().sum()) + float(squares.abs().sum()) == 0.0 for _, got, squares in results.values())
    print("ok")
    """
)


def test_the_kernel_in_triton_interpreter_is_the_sketch_and_the_squared_norm():
    pytest.importorskip("triton")  # a test dependency ([test] extra); absent only outside the project's installs
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def _cuda_like(dtype: torch.dtype = torch.bfloat16, contiguous: bool = True) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cuda", 0), is_cuda=True, dtype=dtype, is_contiguous=lambda: contiguous)


def test_the_kernel_is_offered_for_cuda_buckets_unless_switched_off(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(sketch, "_KERNEL_OFF", [])
    monkeypatch.delenv(sketch.KERNEL_SWITCH, raising=False)
    assert sketch._kernel_for(_cuda_like()) is not None
    assert sketch._kernel_for(_cuda_like(torch.float64)) is None  # fp64 keeps its fp64 norm
    assert sketch._kernel_for(_cuda_like(contiguous=False)) is None  # it divides in place
    assert sketch._kernel_for(torch.zeros(3)) is None  # the host has its own one-pass executor
    monkeypatch.setenv(sketch.KERNEL_SWITCH, "torch")
    assert sketch._kernel_for(_cuda_like()) is None


def test_a_kernel_that_fails_warns_once_and_the_torch_sketch_takes_over(monkeypatch):
    class Broken:
        calls = 0

        def sketch_and_sqnorm(self, *args, **kwargs):
            Broken.calls += 1
            raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(sketch, "_KERNEL_OFF", [])
    monkeypatch.setattr(sketch, "_kernel_for", lambda x: None if sketch._KERNEL_OFF else Broken())
    folded = sketch.FoldedSketch(64, seed=1)
    x = torch.randn(1000)
    with pytest.warns(UserWarning, match="no compiler for this GPU"):
        got, sqnorm = folded.with_sqnorm(0, x)
    assert torch.equal(got, folded(0, x)) and float(sqnorm) == pytest.approx(float(x.double().square().sum()), rel=1e-6)
    folded.with_sqnorm(0, x)
    assert Broken.calls == 1


def test_a_planned_bucket_whose_kernel_fails_warns_once_and_the_torch_sketch_takes_over(monkeypatch):
    pytest.importorskip("triton")
    from healthcheck.measure import sketch_kernel
    from healthcheck.measure.bucket_plans import BucketPlans

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no compiler for this GPU")

            return launch

    monkeypatch.setattr(sketch, "_KERNEL_OFF", [])
    monkeypatch.setattr(sketch, "_kernel_for", lambda x: None if sketch._KERNEL_OFF else sketch_kernel)  # as on CUDA
    monkeypatch.setattr(sketch_kernel, "_kernel", lambda: Broken())
    # The host's C pass takes no bf16; on a GPU machine the bucket is where the kernel would have run.
    x = torch.randn(70_000, generator=torch.Generator().manual_seed(0)).bfloat16().to("cuda" if torch.cuda.is_available() else "cpu")
    before = x.clone()
    plans = BucketPlans(1021, seed=3)
    planned = plans.take(2, x)
    assert planned is not None and planned.takes(x)
    with pytest.warns(UserWarning, match="no compiler for this GPU"):
        got, squares = planned.divide_square_sketch(x, 4)
    assert torch.equal(got, sketch.sketch_bucket(before, k=1021, seed=3, bucket_id=2)) and torch.equal(x, before / 4)
    assert float(squares.sum()) == pytest.approx(float(before.double().square().sum()), rel=1e-5)
    # No plan takes a bucket again, this one included: the monitor's general path sketches them (one warning in all).
    assert not planned.takes(x) and plans.take(2, x) is None and plans.take(3, x) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernel)")
def test_the_compiled_kernel_on_cuda_is_the_host_sketch():
    pytest.importorskip("triton")
    from healthcheck.measure import sketch_kernel

    for n in (1, 65_488 * 3 + 17, 12_582_912):
        host = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16()
        on_gpu = host.cuda()
        got, sqnorm = sketch_kernel.sketch_and_sqnorm(on_gpu, k=4093, seed=0, bucket_id=2, divide_by=6)
        want = sketch.sketch_bucket(host, k=4093, seed=0, bucket_id=2)
        assert float((got.cpu() - want).abs().max()) <= 1e-6 * float(want.norm())
        assert float(sqnorm) == pytest.approx(float(host.double().square().sum()), rel=1e-5)
        assert torch.equal(on_gpu, host.cuda().div_(6))  # DDP's own division, bit for bit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled kernel)")
def test_a_planned_cuda_bucket_is_the_host_sketch_and_its_plan_is_kept():
    # The monitor's path on a GPU: BucketPlans -> _KernelPlan -> DeviceBucket, its square sums 1-D partials.
    pytest.importorskip("triton")
    from healthcheck.measure.bucket_plans import BucketPlans

    host = torch.randn(65_488 * 5 + 3, generator=torch.Generator().manual_seed(1)).bfloat16()
    on_gpu = host.cuda()
    plans = BucketPlans(4093, seed=0)
    planned = plans.take(4, on_gpu)
    got, squares = planned.divide_square_sketch(on_gpu, 8)
    want = sketch.sketch_bucket(host, k=4093, seed=0, bucket_id=4)
    assert float((got.cpu() - want).abs().max()) <= 1e-6 * float(want.norm())
    assert squares.dim() == 1 and float(squares.sum()) == pytest.approx(float(host.double().square().sum()), rel=1e-5)
    assert torch.equal(on_gpu, host.cuda().div_(8))
    assert plans.take(4, on_gpu) is planned and plans.take(4, on_gpu.float()) is not planned  # a new dtype, a new plan


def test_a_planned_bucket_costs_the_launch_alone_and_a_step_one_zero(monkeypatch):
    # What the table is for: on a GPU each torch op the hook issues is host time on the autograd thread. Counted
    # here with the kernel's launch stubbed (any device: the ops are the same), by torch's dispatcher.
    pytest.importorskip("triton")
    from torch.utils._python_dispatch import TorchDispatchMode

    from healthcheck.measure import sketch_kernel
    from healthcheck.measure.bucket_plans import BucketPlans

    launched = []

    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(grid)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(sketch, "_KERNEL_OFF", [])
    monkeypatch.setattr(sketch, "_kernel_for", lambda x: sketch_kernel)  # as for a CUDA bucket
    monkeypatch.setattr(sketch_kernel, "_kernel", lambda: Stub())
    buckets = [torch.randn(70_000 + i) for i in range(3)]
    plans = BucketPlans(1021, seed=3)
    for step in range(3):
        with Ops() as ops:
            planned = [plans.take(i, x) for i, x in enumerate(buckets)]  # made at step 0, with the table and its views
        assert step == 0 or ops.names == [], ops.names
        with Ops() as ops:
            for i, x in enumerate(buckets):
                planned[i].divide_square_sketch(x, 8)
        # From the second step on: no output buffer, no sum, only the launch, which issues no torch op.
        assert step == 0 or ops.names == [], ops.names
        with Ops() as ops:
            plans.new_step()
        assert [name.split(".")[0] for name in ops.names] == ["zero_"], ops.names
    assert len(launched) == 9

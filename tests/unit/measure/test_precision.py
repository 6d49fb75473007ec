"""The monitor's fp32 accumulation: chunked upcasts on the host, one GEMM for half precision on an accelerator."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from healthcheck.measure import precision


class _Ops(TorchDispatchMode):
    """Counts the aten ops a call dispatches (on ``meta`` they run no kernel, but they are the launches)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _fresh_probe():
    precision.half_dot_in_one_gemm.cache_clear()
    yield
    precision.half_dot_in_one_gemm.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_host_upcasts_half_precision_in_chunks_and_keeps_fp32_accuracy(monkeypatch, dtype):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(10_007, generator=g).to(dtype), torch.randn(10_007, generator=g).to(dtype)
    exact = float(a.double() @ b.double())
    monkeypatch.setattr(precision, "FP32_UPCAST_CHUNK_NUMEL", (2**24, 1000))  # 11 chunks, the last one short
    with _Ops() as ops:
        got = precision.dot_fp32(a, b)
    assert got.dtype == torch.float32 and got.shape == ()
    assert ops.seen["aten.dot.default"] == 11
    # Products of two half-precision values are exact in fp32: only the fp32 sums round.
    assert abs(float(got) - exact) <= precision.gamma(a.numel(), precision.unit_roundoff(torch.float32)) * float(
        a.double().abs() @ b.double().abs()
    )


def test_an_accelerator_takes_one_gemm_for_a_half_precision_dot():
    # ``meta`` is not the host, and has the op's shape function: the path is the one a GPU takes.
    a = torch.empty(3 * 2**24, dtype=torch.bfloat16, device="meta")
    assert precision.half_dot_in_one_gemm("meta", torch.bfloat16)  # probed once, outside the count
    with _Ops() as ops:
        got = precision.dot_fp32(a, a)
    assert got.dtype == torch.float32 and got.shape == () and got.device.type == "meta"
    assert ops.seen["aten.mm.dtype"] == 1
    assert not any(name.startswith(("aten._to_copy", "aten.dot")) for name in ops.seen), ops.seen


def test_without_the_gemm_an_accelerator_upcasts_in_chunks(monkeypatch):
    # An older torch (no out_dtype keyword) or a device without the kernel: the probe says no once.
    real_mm = torch.mm

    def old_mm(*args, **kwargs):
        if "out_dtype" in kwargs:
            raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "mm", old_mm)
    assert precision.half_dot_in_one_gemm("meta", torch.bfloat16) is False
    a = torch.empty(2**25 + 5, dtype=torch.bfloat16, device="meta")
    with _Ops() as ops:
        got = precision.dot_fp32(a, a)
    assert got.dtype == torch.float32 and got.shape == ()
    assert ops.seen["aten.dot.default"] == 3 and ops.seen["aten.mm.dtype"] == 0


def test_fp32_and_fp64_stay_a_plain_dot():
    for dtype in (torch.float32, torch.float64):
        a = torch.empty(1000, dtype=dtype, device="meta")
        with _Ops() as ops:
            got = precision.dot_fp32(a, a)
        assert got.dtype == dtype and dict(ops.seen) == {"aten.dot.default": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GEMM's numerics)")
def test_the_gemm_dot_on_cuda_is_accurate_to_fp32_accumulation():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(50_000_003, generator=g, device="cuda").bfloat16()
    b = torch.randn(50_000_003, generator=g, device="cuda").bfloat16()
    assert precision.half_dot_in_one_gemm("cuda", torch.bfloat16)
    exact = float(a.double() @ b.double())
    got = float(precision.dot_fp32(a, b))
    assert abs(got - exact) <= 1e-5 * float(a.double().abs() @ b.double().abs())


def _fp16_compressed_mean(local: torch.Tensor, order: list[int]) -> torch.Tensor:
    """torch's fp16_compress_hook on N ranks (rows): cast, divide by N, sum in fp16 in ``order``, back to fp32."""
    parts = local.to(torch.float16).div_(local.shape[0])
    total = parts[order[0]].clone()
    for rank in order[1:]:
        total = total + parts[rank]
    return total.to(local.dtype)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_fp16_underflow_floor_bounds_what_the_relative_bound_cannot(world):
    # Gradients from 1 down to 1e-9 (a large model's are mostly under fp16's normal range once divided by N), with
    # zeros; then values at the threshold and just under it. The relative bound plus the floor always holds, and the
    # relative bound alone does not once the values are small (so the floor is what lets a correct wire pass).
    g = torch.Generator().manual_seed(world)
    threshold = world * precision.FP16_SMALLEST_NORMAL
    relative = precision.gamma(world + 1, 2.0**-11) + precision.gamma(world, 2.0**-53)
    edge = torch.randn(world, 50_000, generator=g) * threshold
    edge[:, ::3] = threshold
    edge[:, 1::3] = torch.nextafter(torch.tensor(threshold), torch.tensor(0.0))
    cases = [torch.randn(world, 50_000, generator=g) * scale for scale in (1.0, 1e-2, 1e-4, 3e-5, 1e-5, 1e-6, 1e-7, 1e-9)]
    exceeded_alone = []
    for local in cases + [edge]:
        local[:, :100] = 0.0
        order = torch.randperm(world, generator=g).tolist()
        reduced = _fp16_compressed_mean(local, order).double()
        exact = local.double()
        error = float((reduced - exact.mean(0)).norm())
        abs_mean = float((exact.abs().mean(0)).norm())
        at_risk = ((exact.abs() < threshold) & (exact != 0)).sum(0).double()
        floor = precision.fp16_underflow_floor(world, float(at_risk @ at_risk))
        assert error <= relative * abs_mean + floor, (float(local.abs().max()), error, relative * abs_mean, floor)
        exceeded_alone.append(error > relative * abs_mean)
    assert exceeded_alone[:2] == [False, False] and all(exceeded_alone[4:8]), exceeded_alone

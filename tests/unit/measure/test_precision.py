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

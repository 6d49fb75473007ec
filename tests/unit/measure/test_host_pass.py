"""The host's one pass over a bucket: the same target, ‖g‖² and sketch as the three separate passes, in place too,
by both executors (the C extension and numpy)."""

import math

import pytest
import torch

from healthcheck.measure import host_pass
from healthcheck.measure import sketch as SK
from healthcheck.measure.bucket_plans import BucketPlans

K = 31  # p = 31, m = 16, L = 496, T = 15,376: a 40,000-element bucket crosses chunks and has partial segments


@pytest.fixture(params=["c", "numpy"], autouse=True)
def executor(request, monkeypatch):
    """Every test runs on both executors; the C one must have been built (``pip install -e .`` compiles it)."""
    if request.param == "c":
        assert host_pass._host_fold is not None, "the C pass was not built: pip install -e . (setup.py) compiles it"
        monkeypatch.delenv(SK.KERNEL_SWITCH, raising=False)
    else:
        monkeypatch.setenv(SK.KERNEL_SWITCH, "torch")
    assert host_pass.compiled() == (request.param == "c")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world", [3, 6, 8])
def test_the_target_is_torch_divisions_bits(dtype, world):
    x = torch.randn(40_000, generator=torch.Generator().manual_seed(world), dtype=dtype)
    target = torch.empty_like(x)
    host_pass.divide_square_sketch(x, target, world=world, k=K, seed=1, bucket_id=0)
    assert torch.equal(target, torch.div(x, world))


@pytest.mark.parametrize("run_elements", [496, 2 * 496 + 1, 1 << 17])
@pytest.mark.parametrize("n", [17, 496 * 3, 40_000])
def test_the_sketch_and_the_norm_are_the_separate_passes(monkeypatch, run_elements, n):
    # Shorter runs cut the plan differently: no bin or sign may change, only the fp32 order of the adds.
    monkeypatch.setattr(host_pass, "RUN_ELEMENTS", run_elements)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    sketch, sqnorm = host_pass.divide_square_sketch(x, torch.empty_like(x), world=8, k=K, seed=5, bucket_id=2)
    expected = SK.sketch_bucket(x, k=K, seed=5, bucket_id=2)
    assert sketch.dtype == torch.float32 and sketch.shape == expected.shape
    assert torch.allclose(sketch, expected, rtol=1e-5, atol=1e-5)
    assert isinstance(sqnorm, float) and math.isclose(sqnorm, float(x.double().square().sum()), rel_tol=1e-5)


def test_the_buffer_is_only_read_and_a_non_finite_value_shows():
    x = torch.randn(5_000)
    x[4_321] = math.inf
    before = x.clone()
    _, sqnorm = host_pass.divide_square_sketch(x, torch.empty_like(x), world=2, k=K, seed=0, bucket_id=0)
    assert torch.equal(x, before) and not math.isfinite(sqnorm)


@pytest.mark.parametrize("run_elements", [496, 1 << 17])
@pytest.mark.parametrize("world", [3, 8])
def test_in_place_the_sketch_and_the_norm_are_of_the_values_before_the_division(monkeypatch, run_elements, world):
    # The DDP monitor divides the bucket itself: each run must be folded and squared before it is divided.
    monkeypatch.setattr(host_pass, "RUN_ELEMENTS", run_elements)
    x = torch.randn(40_000, generator=torch.Generator().manual_seed(world))
    original = x.clone()
    sketch, sqnorm = host_pass.divide_square_sketch(x, x, world=world, k=K, seed=5, bucket_id=2)
    assert torch.equal(x, torch.div(original, world))
    assert torch.allclose(sketch, SK.sketch_bucket(original, k=K, seed=5, bucket_id=2), rtol=1e-5, atol=1e-5)
    assert math.isclose(sqnorm, float(original.double().square().sum()), rel_tol=1e-5)


def test_only_contiguous_full_precision_host_buckets_are_fused():
    assert host_pass.fuses(torch.zeros(4)) and host_pass.fuses(torch.zeros(4, dtype=torch.float64))
    assert not host_pass.fuses(torch.zeros(4, dtype=torch.bfloat16))
    assert not host_pass.fuses(torch.zeros(8)[::2])
    assert not host_pass.fuses(torch.zeros(4, device="meta"))


@pytest.mark.parametrize("world", [2, 4, 8, 64])
def test_a_power_of_two_divides_to_the_same_bits_subnormals_included(world):
    # The C pass multiplies by 1/world there: the same exact value, rounded once, also where it turns subnormal.
    tiny = torch.tensor([1e-38, -3e-39, 1.5e-45, 2.0**-126, 7.0, -0.0], dtype=torch.float32)
    x = torch.cat([tiny, torch.randn(3_000, generator=torch.Generator().manual_seed(world))])
    target = torch.empty_like(x)
    host_pass.divide_square_sketch(x, target, world=world, k=K, seed=1, bucket_id=0)
    assert torch.equal(target.view(torch.int32), torch.div(x, world).view(torch.int32))


@pytest.mark.parametrize("n", [0, 1, 495, 497])
def test_tiny_buckets(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    original = x.clone()
    sketch, sqnorm = host_pass.divide_square_sketch(x, x, world=3, k=K, seed=2, bucket_id=1)
    assert torch.equal(x, torch.div(original, 3))
    assert torch.allclose(sketch, SK.sketch_bucket(original, k=K, seed=2, bucket_id=1), rtol=1e-5, atol=1e-5)
    assert math.isclose(sqnorm, float(original.double().square().sum()), rel_tol=1e-5, abs_tol=1e-12)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_planned_bucket_gives_the_one_calls_sketch_norm_and_division_bits(executor, dtype):
    # The DDP monitor plans each bucket once (HostBucket) and runs the C pass on it every step: same bits as the call.
    x = torch.randn(40_000, generator=torch.Generator().manual_seed(3), dtype=dtype)
    bucket = host_pass.HostBucket.of(x, k=K, seed=5, bucket_id=2)
    if executor == "numpy":  # nothing to plan: the monitor keeps calling divide_square_sketch
        assert bucket is None
        return
    assert bucket is not None and bucket.takes(x)
    y = x.clone()
    expected_sketch, expected_sqnorm = host_pass.divide_square_sketch(x, x, world=6, k=K, seed=5, bucket_id=2)
    for _ in range(2):  # a plan serves every step
        z = y.clone()
        sketch, sqnorm = bucket.divide_square_sketch(z, 6)
        assert torch.equal(z, x) and torch.equal(sketch, expected_sketch) and sqnorm == expected_sqnorm


def test_a_plan_takes_only_buckets_of_its_size_and_dtype(executor):
    x = torch.randn(1_000)
    bucket = host_pass.HostBucket.of(x, k=K, seed=0, bucket_id=0)
    if executor == "numpy":
        assert bucket is None
        return
    assert bucket is not None
    assert bucket.takes(torch.zeros(1_000)) and not bucket.takes(torch.zeros(1_001))
    assert not bucket.takes(torch.zeros(1_000, dtype=torch.float64)) and not bucket.takes(torch.zeros(2_000)[::2])
    assert not bucket.takes(torch.zeros(10, 100)) and not bucket.takes(torch.zeros(1_000, device="meta"))
    for unplanned in (torch.zeros(8, dtype=torch.bfloat16), torch.zeros(16)[::2], torch.zeros(2, 4)):
        assert host_pass.HostBucket.of(unplanned, k=K, seed=0, bucket_id=0) is None



def test_the_monitors_plans_follow_a_bucket_that_changes_size(executor):
    plans = BucketPlans(K, 5)
    first = plans.take(0, torch.zeros(1_000))
    assert plans.take(1, torch.zeros(10, device="meta")) is None  # an accelerator's bucket: no host plan
    if executor == "numpy":
        assert first is None and plans.indices() == [] and plans.square_sum(0, torch.ones(1_000), 0, 4) is None
        return
    assert first is not None and plans.take(0, torch.ones(1_000)) is first  # kept while the bucket fits it
    rebuilt = plans.take(0, torch.ones(2_000))  # DDP's rebuild after the first step: another size, a new plan
    assert rebuilt is not None and rebuilt is not first and plans.indices() == [0]
    assert plans.square_sum(0, torch.full((2_000,), 2.0), 10, 20) == 40.0
    assert plans.square_sum(0, torch.ones(1_000), 0, 4) is None and plans.square_sum(3, torch.ones(2_000), 0, 4) is None
    plans.take(0, torch.zeros(8, dtype=torch.bfloat16))  # a bucket the C pass does not take drops the plan
    assert plans.indices() == []

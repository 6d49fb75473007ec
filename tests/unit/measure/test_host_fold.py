"""The C pass's own guards: a table, buffer or divisor that does not fit is an error, never a read past the end.
(What ``fold`` computes is tested against numpy in test_host_pass.py; ``square_sum`` against ``math.fsum`` here.)"""

import math

import numpy as np
import pytest
import torch

from healthcheck.measure import host_pass
from healthcheck.measure.sketch_layout import get_layout, row_table, sign_table

K = 31


def test_the_c_pass_refuses_a_table_that_does_not_fit_the_bucket():
    lay = get_layout(K)
    meta, eps = row_table(1_000, lay, 0, 0)
    tau = sign_table(0, lay.L, torch.device("cpu")).numpy()
    out = np.empty(lay.p, dtype=np.float32)
    short = np.zeros(999, dtype=np.float32)  # one element fewer than the table covers: no read past the end
    with pytest.raises(ValueError, match="does not fit a bucket of 999"):
        host_pass._host_fold.fold(short, tau, meta.reshape(-1), eps, out, lay.m, 1.0)
    with pytest.raises(TypeError, match="x has format"):
        host_pass._host_fold.fold(np.zeros(1_000, dtype=np.int32), tau, meta.reshape(-1), eps, out, lay.m, 1.0)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        host_pass._host_fold.fold(np.zeros(1_000, dtype=np.float32), tau[:10], meta.reshape(-1), eps, out, lay.m, 1.0)
    frozen = np.zeros(1_000, dtype=np.float32)
    frozen.flags.writeable = False  # it divides in place: a read-only bucket is refused, not written
    with pytest.raises(ValueError, match="read-only"):
        host_pass._host_fold.fold(frozen, tau, meta.reshape(-1), eps, out, lay.m, 1.0)
    with pytest.raises(ValueError, match="divisor"):
        host_pass._host_fold.fold(np.zeros(1_000, dtype=np.float32), tau, meta.reshape(-1), eps, out, lay.m, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (0, 7), (3, 4_003), (4_000, 40_000), (0, 40_000)])
def test_square_sum_is_the_float64_sum_of_the_slices_squares(dtype, lo, hi):
    x = torch.randn(40_000, generator=torch.Generator().manual_seed(hi), dtype=dtype) * 1e3
    expected = math.fsum(v * v for v in x[lo:hi].double().tolist())
    assert math.isclose(host_pass._host_fold.square_sum(x.numpy(), lo, hi), expected, rel_tol=1e-13, abs_tol=0.0)


def test_square_sum_refuses_a_slice_outside_the_buffer_and_shows_a_non_finite_value():
    x = torch.ones(10)
    for lo, hi in ((-1, 3), (4, 2), (0, 11)):
        with pytest.raises(ValueError, match="is not within 10 elements"):
            host_pass._host_fold.square_sum(x.numpy(), lo, hi)
    x[5] = math.nan
    assert math.isnan(host_pass._host_fold.square_sum(x.numpy(), 0, 10)) and host_pass._host_fold.square_sum(x.numpy(), 6, 10) == 4.0
    with pytest.raises(TypeError, match="x has format"):
        host_pass._host_fold.square_sum(np.zeros(4, dtype=np.int32), 0, 4)

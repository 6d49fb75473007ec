"""The C pass's own guards: a table, buffer or divisor that does not fit is an error, never a read past the end.
(What it computes is tested against numpy in test_host_pass.py.)"""

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

"""The carried row: a step's per-rank numbers riding in a gradient all-reduce come back bit for bit.

The SUM over ranks is simulated here (each rank's row in its own slot, zeros elsewhere); the real
all-reduce is exercised in tests/multiprocess/test_monitor.py.

    python -m pytest tests/unit/measure/test_step_gather.py -q
"""

from __future__ import annotations

import doctest
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from healthcheck.measure import step_gather

# Any float64 a header may hold: huge, tiny (below fp32's range), negative zero, NaN, infinities.
header_value = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e-40, max_value=1e-40),
    st.sampled_from([0.0, -0.0, 2.0**53 + 1, 1 / 3, 5e-324, 3.4e38, 1e300]),
)


def _carried(values: list[float], sketch: list[float], extras: dict[str, float]) -> step_gather.InFlight:
    loss, tokens, sqnorm, dot, mean_sqnorm = values
    return step_gather.launch(
        step=3, direction="sketch", group=None, world=1, loss=loss, tokens=tokens, sqnorm=torch.tensor(sqnorm, dtype=torch.float64),
        dot=dot, mean_sqnorm=mean_sqnorm, extras=extras, sketch=torch.tensor(sketch, dtype=torch.float32), carried=True,
    )


def _bits(values: list[float]) -> list[bytes]:
    # NaN payloads aside, the same bits: a NaN must stay a NaN (pack itself writes them as float('nan')).
    return [b"nan" if math.isnan(v) else struct.pack("<d", v) for v in values]


def _sum_over_ranks(rows: list[torch.Tensor], world: int) -> torch.Tensor:
    """What a SUM all-reduce of the appended block gives: every rank's row, in order, each plus zeros."""
    width = rows[0].numel()
    block = torch.zeros(world * width, dtype=rows[0].dtype)
    for rank, row in enumerate(rows):
        mine = torch.zeros_like(block)
        mine[rank * width : (rank + 1) * width] = row
        block += mine
    return block.view(world, width)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(header_value, min_size=5, max_size=5),
    sketch=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=9),
    extra=header_value,
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_a_carried_row_comes_back_bit_for_bit(values, sketch, extra, dtype):
    sent = _carried(values, sketch, {"busy_ms": extra})
    packed = sent.source.clone()
    rows = _sum_over_ranks([step_gather.carried_row(sent, dtype)], world=1)
    assert rows.shape[1] == step_gather.carried_width(sent)
    step_gather.receive_carried(sent, rows)
    width = len(step_gather.HEADER) + 1
    got = step_gather.decode_header(sent.rows.tolist(), width)[0]
    want = packed[:width].tolist()
    # -0.0 + 0.0 is +0.0 in the sum: the sign of a zero is the one thing that may not survive.
    assert _bits([abs(v) if v == 0 else v for v in got]) == _bits([abs(v) if v == 0 else v for v in want])
    assert sent.rows[0, (step_gather.CARRY_PARTS + 1) * width :].tolist() == [float(torch.tensor(v)) for v in sketch]


@settings(max_examples=200, deadline=None)
@given(values=st.lists(header_value, min_size=1, max_size=12), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_the_host_split_is_the_tensor_split_bit_for_bit(values, dtype):
    # The host builds the header from Python floats (cheaper), an accelerator with tensor ops: the same row.
    host = torch.tensor(step_gather.split_header(values, dtype), dtype=dtype)
    device = step_gather._split_header_tensor(torch.tensor(values, dtype=torch.float64), dtype)
    assert host.dtype == device.dtype and host.shape == device.shape
    assert _bits(host.double().tolist()) == _bits(device.double().tolist())


def test_every_rank_gets_every_row_and_the_metrics_follow():
    world = 3
    sent = [_carried([0.5 + r, 10 + r, 4.0 * (r + 1), 1.0, 0.25], [1.0, float(r), -1.0], {"compute_ms": 7.0 * r}) for r in range(world)]
    rows = _sum_over_ranks([step_gather.carried_row(s, torch.float32) for s in sent], world)
    received = sent[0]
    step_gather.receive_carried(received, rows)
    received.world = world
    metrics = step_gather.complete(received)
    assert metrics.step == 3 and metrics.per_rank_loss == [0.5, 1.5, 2.5]
    assert metrics.per_rank_tokens == [10, 11, 12]
    assert metrics.per_rank_extras == {"compute_ms": [0.0, 7.0, 14.0]}
    assert metrics.per_rank_grad_norm == pytest.approx([2.0, math.sqrt(8.0), math.sqrt(12.0)])
    sketches = torch.tensor([[1.0, float(r), -1.0] for r in range(world)], dtype=torch.float64)
    expected = (sketches @ sketches.T) / (sketches.norm(dim=1)[:, None] * sketches.norm(dim=1)[None, :])
    assert torch.allclose(torch.tensor(metrics.pairwise_cosine, dtype=torch.float64), expected)


def _device_row(loss, sqnorm: float) -> torch.Tensor:
    """A row as ``pack`` makes it on a device (its header through ``device_column``), here on the host."""
    values = [None if loss is None else torch.tensor(loss), 5, torch.tensor(sqnorm, dtype=torch.float64), 0.0, 1.0,
              0.0 if loss is None else 1.0]
    return torch.cat([step_gather.device_column(values, "cpu"), torch.tensor([1.0, 2.0]).view(torch.float64)])


def test_the_reader_flags_non_finite_ranks_from_the_header():
    # Rank 0's loss was not measured (NaN, no event), rank 1's is NaN, rank 2's header ‖g_i‖² is infinite. Exact mode
    # reads the norms off its Gram (finite here), so only the header's ‖g_i‖² can flag rank 2.
    rows = torch.stack([_device_row(None, 1.0), _device_row(float("nan"), 2.0), _device_row(0.5, float("inf"))])
    gram = torch.eye(3, dtype=torch.float64) + 0.5
    inflight = step_gather.InFlight(step=0, direction="exact", world=3, work=None, rows=rows, names=[], gram=gram, buckets=1,
                                    from_gram="all")
    assert step_gather.complete(inflight).nonfinite_ranks == [1, 2]
    host, _ = step_gather.pack(loss=0.5, tokens=5, sqnorm=2.0, dot=0.0, mean_sqnorm=1.0, extras={})
    assert _bits(host.tolist()) == _bits(_device_row(0.5, 2.0)[: len(step_gather.HEADER)].tolist())  # the same header


def test_a_step_never_sent_says_so():
    never = _carried([1.0, 2, 3.0, 0.0, 0.0], [1.0], {})
    assert step_gather.awaiting_carrier(never)
    with pytest.raises(RuntimeError, match="step 3: its numbers were never exchanged"):
        step_gather.complete(never)


def test_doctests():
    assert doctest.testmod(step_gather).failed == 0

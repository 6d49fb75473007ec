"""A step's rows copied to the host behind their gather, on a side stream (healthcheck.measure.staged_rows).

On the host nothing is staged. The CUDA test (skipped in CI, run on a lent GPU) checks the point of it: the rows
reach the host while the compute stream is still busy, and a bounded wait sees a copy that cannot finish.
"""

from __future__ import annotations

import types

import pytest
import torch

from healthcheck.measure import staged_rows, step_gather


def test_host_rows_are_not_staged():
    assert staged_rows.stage(types.SimpleNamespace(wait=lambda: None), torch.zeros(2, 3)) is None


def test_a_bounded_wait_on_a_staged_copy_that_never_finishes_returns():
    never = types.SimpleNamespace(query=lambda: False, synchronize=lambda: pytest.fail("waited without bound"))
    inflight = step_gather.InFlight(step=0, direction="sketch", world=2, work=None, rows=None, names=[], gram=None, buckets=1,
                                    staged=staged_rows.Staged(host=None, event=never))
    assert not step_gather.finished_within(inflight, 0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (streams)")
def test_staged_rows_reach_the_host_while_the_compute_stream_is_busy():
    compute = torch.cuda.current_stream()
    rows = torch.randn(8, 4099, dtype=torch.float64, device="cuda")
    # As NCCL's wait(): the stream current at the call waits for the collective, which waited for the compute stream.
    gather = types.SimpleNamespace(wait=lambda: torch.cuda.current_stream().wait_stream(compute))
    staged = staged_rows.stage(gather, rows)
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(60):  # tens of ms queued on the compute stream after the gather
        busy = busy @ busy
    compute_done = torch.cuda.Event()
    compute_done.record(compute)
    host = staged.rows()
    assert not compute_done.query(), "the staged copy waited for the compute stream"
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, rows.cpu())
    assert staged.ready()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch's sync debug mode)")
def test_a_gpu_step_is_packed_and_read_back_without_waiting_for_the_device():
    # torch raises at any call that would make the host wait for a stream (a copy from pageable memory, .cpu()).
    # Made before the mode is on: a tensor made from a Python number is itself a copy from pageable memory.
    loss, sqnorm, mean = (torch.tensor(v, device="cuda") for v in (0.5, 4.0, 2.0))
    sketch = torch.randn(4093, device="cuda")
    compute = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flat, names = step_gather.pack(loss=loss, tokens=7, sqnorm=sqnorm, dot=0.0, mean_sqnorm=mean, extras={"busy_ms": 3.0},
                                       sketch=sketch)
        rows = flat.reshape(1, -1).clone()
        staged = staged_rows.stage(types.SimpleNamespace(wait=lambda: torch.cuda.current_stream().wait_stream(compute)), rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    header = staged.rows()[0, : len(step_gather.HEADER) + 1].tolist()
    assert header == [0.5, 7.0, 4.0, 0.0, 2.0, 1.0, 3.0] and names == ["busy_ms"]
    assert torch.equal(step_gather.unpack_sketches(staged.rows(), len(header), 4093)[0], sketch.double().cpu())

"""``WorkerConsistencyMonitor(local_from="grads")`` on 4 gloo ranks: sketch mode with no comm hook, the local gradients
read from ``.grad`` by an autograd callback queued at the start of the backward (before DDP's finalize averages
them), ‖ḡ‖² by one queued after it (``healthcheck/measure/local_grads.py``). Every metric against the float64
reference of ``test_monitor.py``, through accumulation under ``no_sync``, ``every=2``, overlap and bf16; the host
path (the torch sketch per tensor) and the GPU's (``grad_table``'s kernel, in Triton's interpreter).

    python -m pytest tests/multiprocess/test_local_grads.py -q
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from healthcheck.measure import distributed
from healthcheck.measure.monitor import WorkerConsistencyMonitor
from healthcheck.run import launcher
from tests.multiprocess.test_monitor import (
    SKETCH_DIM,
    _batch,
    _CallCounter,
    _make_ddp,
    _run_scenario,
    _train_step,
    launch_interpreted,
)


def _host_worker() -> None:
    distributed.set_worker_threads(4)
    distributed.init_distributed("cpu", "gloo", 120)
    try:
        _run_scenario("sketch", torch.float32, bucket_view=False, accum=2, steps=5, every=2, overlap=True, exchange="auto",
                      local_from="grads")
        _run_scenario("sketch", torch.bfloat16, bucket_view=False, accum=1, steps=3, exchange="gather", local_from="grads")
        # Reduction checks: the local gradients copied before DDP's finalize, the average after it.
        checked = _run_scenario("sketch", torch.float32, bucket_view=False, accum=2, steps=4, every=2, overlap=True,
                                exchange="auto", reduction_every=2, local_from="grads")
        # The ranks' own gradients: fp32 sums of four different vectors round somewhere, so the error is not 0, as it
        # would be if the check's local side had been taken after the finalize (every rank's copy the same average).
        assert all(min(m.per_rank_extras["reduction_rel_error"]) > 0 for m in checked), [m.per_rank_extras for m in checked]
        _check_reduction_after_clipping()
        _check_the_outputs_are_not_kept()
        _check_the_ranks_agree()
        for bucket_view, direction, match in ((True, "sketch", "gradient_as_bucket_view"), (False, "exact", "exact mode")):
            ddp, _ = _make_ddp(torch.float32, bucket_view)
            with pytest.raises(ValueError, match=match):
                WorkerConsistencyMonitor(ddp, direction=direction, local_from="grads")
    finally:
        distributed.destroy_distributed()


def _check_the_ranks_agree() -> None:
    """Every rank reads its gradient the same way (the two paths' sketches are different maps): one rank that cannot
    read .grad puts every rank on the comm hook under "auto" (a warning), and makes every rank refuse "grads"; none
    hangs in a collective the others skipped."""
    from healthcheck.measure import local_grads

    rank = distributed.rank()
    ddp, _ = _make_ddp(torch.float32, rank == 1)  # rank 1 alone shares .grad with DDP's buckets
    message = "here: with gradient_as_bucket_view" if rank == 1 else r"on rank\(s\) 1 \(each says why\)"
    with pytest.raises(ValueError, match=f"local_from='grads' cannot run {message}"):
        WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, local_from="grads")
    # "auto" where only rank 0 would read .grad (as a CUDA rank with Triton among ranks without it would).
    own = local_grads.choose
    local_grads.choose = lambda *args, **kwargs: (True, "") if rank == 0 else (False, "no kernel on this rank")
    try:
        ddp, _ = _make_ddp(torch.float32, False)
        with pytest.warns(UserWarning, match="every rank's monitor uses the comm hook"):
            monitor = WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, local_from="auto")
    finally:
        local_grads.choose = own
    assert monitor.gradient_source == "comm_hook" and monitor._local_pass is None
    monitor.close()
    ddp, _ = _make_ddp(torch.float32, False)
    monitor = WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, local_from="grads")
    assert monitor.gradient_source == "grads"
    monitor.close()
    _check_a_models_own_comm_hook()


def _check_a_models_own_comm_hook() -> None:
    """DDP holds one comm hook: where a rank's model already has one, "auto" puts every rank on .grad (on the host
    too), every rank refuses where some rank cannot read .grad, and the settings that need the slot refuse here."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    rank = distributed.rank()
    ddp, _ = _make_ddp(torch.float32, False)
    if rank == 1:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    monitor = WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, local_from="auto")
    assert monitor.gradient_source == "grads" and monitor._local_pass is not None
    monitor.close()
    ddp, _ = _make_ddp(torch.float32, rank == 2)  # rank 2 alone cannot read .grad
    if rank == 1:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    where = "here: with gradient_as_bucket_view" if rank == 2 else r"on rank\(s\) 2 \(each says why\)"
    with pytest.raises(ValueError, match=f"rank\\(s\\) 1 registered a DDP comm hook of their own .* which cannot run {where}"):
        WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, local_from="auto")
    for options, needs in (({"local_from": "buckets"}, "local_from='buckets'"), ({"direction": "exact"}, "exact mode")):
        ddp, _ = _make_ddp(torch.float32, False)  # no collective on these paths: only the hooked rank raises
        if rank == 1:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            with pytest.raises(ValueError, match=f"already has a DDP comm hook \\(allreduce_hook\\).*{needs}"):
                WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, **options)
        else:
            WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, **options).close()


def _check_the_outputs_are_not_kept() -> None:
    """The hooks that start the pass come off the forward's outputs when the backward starts (or at the next forward,
    if it never came): left on, they kept the outputs alive as long as the loss, into the next step."""
    ddp, _ = _make_ddp(torch.float32, False)
    monitor = WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, overlap=False, local_from="grads")
    x, y = _batch(0, distributed.rank(), 0, torch.float32)
    unused = weakref.ref(ddp(x))  # a forward with grad enabled and no backward
    out = ddp(x)
    watched = weakref.ref(out)
    loss = ((out - y) ** 2).mean()
    del out
    loss.backward()
    assert monitor.end_step(loss.detach()) is not None
    gc.collect()
    assert watched() is None and unused() is None, "the pass's hooks kept a forward's output alive"
    monitor.close()


def _check_reduction_after_clipping() -> None:
    """The check compares the average DDP's finalize wrote, though the loop clips .grad before end_step."""
    ddp, reference_model = _make_ddp(torch.float32, False)
    monitor = WorkerConsistencyMonitor(ddp, sketch_dim=SKETCH_DIM, reduction_every=1, overlap=False, local_from="grads")
    loss, _ = _train_step(ddp, reference_model, 0, 1, torch.float32)
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)  # scales every gradient well below its norm
    worst = max(monitor.end_step(loss).per_rank_extras["reduction_rel_error"])
    assert worst < 1e-5, f"reduction_rel_error {worst} after the loop clipped the gradients"
    monitor.close()


def _interpreted_worker() -> None:
    """As on CUDA: one kernel launch over the gradients' addresses before DDP's finalize, one after it."""
    from healthcheck.measure import local_grads
    from healthcheck.measure.grad_table import GradTable

    distributed.set_worker_threads(4)
    distributed.init_distributed("cpu", "gloo", 120)

    def on_the_host(params, **kwargs):
        return GradTable([p.numel() for p in params], params[0].dtype, "cpu", **kwargs)

    local_grads.make_table = on_the_host
    launches = _CallCounter(GradTable, "_launch")
    try:
        measured = _run_scenario("sketch", torch.float32, bucket_view=False, accum=2, steps=4, overlap=True, local_from="grads")
        assert launches.restore() == 2 * len(measured), (launches.count, len(measured))
    finally:
        distributed.destroy_distributed()


@pytest.mark.multiprocess
def test_the_local_gradients_read_from_grad_match_the_reference():
    launcher.launch_local(_host_worker, 4, run_id="test-local-grads")


@pytest.mark.multiprocess
def test_the_gpu_pass_matches_the_reference_in_triton_interpreter():
    launch_interpreted("test_local_grads", "_interpreted_worker", 4)

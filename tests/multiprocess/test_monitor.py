"""WorkerConsistencyMonitor on real gloo process groups, checked against a brute-force reference.

Each rank computes its local gradient a second time on a plain (non-DDP) copy of the module with
``torch.autograd.grad``, summed over micro-steps; the reference all-gathers those full gradients
and computes every metric in float64. Workers are module-level functions that raise
AssertionError, launched like torchrun through ``healthcheck.run.launcher.launch_local``.

    python -m pytest tests/multiprocess/test_monitor.py -q
"""

from __future__ import annotations

import contextlib
import copy
import gc
import glob
import json
import math
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from healthcheck.measure import distributed, runqueue, shared_rows
from healthcheck.measure.monitor import WorkerConsistencyMonitor
from healthcheck.measure.reduced_norm import DeferredSquares
from healthcheck.run import launcher

REPO = Path(__file__).resolve().parents[2]
SKETCH_DIM = 4096
# Four standard deviations of the sketch cosine error bound sqrt(2/k) stated in monitor.py.
SKETCH_COS_TOL = 4 * math.sqrt(2 / SKETCH_DIM)
# Several buckets after DDP's rebuild (the first iteration always uses one bucket).
BUCKET_CAP_MB = 0.001


def _make_ddp(dtype: torch.dtype, gradient_as_bucket_view: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A ~1.5k-parameter MLP wrapped in DDP, and a plain copy of it for the reference gradients."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    ).to(dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=gradient_as_bucket_view)
    return ddp, copy.deepcopy(model)


def _batch(step: int, rank: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    # Rank-dependent scale so the ranks' gradient norms and directions genuinely differ.
    x = torch.randn(6, 8, generator=generator) * (1 + 0.3 * rank)
    y = torch.randn(6, 4, generator=generator) + 0.5
    return x.to(dtype), y.to(dtype)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _train_step(ddp, reference_model, step: int, accum: int, dtype, poison: bool = False):
    """One optimizer step's backward on the DDP model; returns (mean loss, local gradient in float64)."""
    rank = distributed.rank()
    local = [torch.zeros_like(p) for p in reference_model.parameters()]
    losses = []
    for micro in range(accum):
        x, y = _batch(step, rank, micro, dtype)
        if poison:
            x[0, 0] = float("nan")
        context = ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext()
        with context:
            loss = _loss(ddp, x, y)
            loss.backward()
        losses.append(float(loss.detach()))
        grads = torch.autograd.grad(_loss(reference_model, x, y), list(reference_model.parameters()))
        # Summed in the model's dtype, as autograd accumulates .grad across no_sync micro-steps.
        local = [acc + g for acc, g in zip(local, grads)]
    return sum(losses) / accum, torch.cat([g.reshape(-1) for g in local]).to(torch.float64)


def _finish_step(ddp, reference_model) -> None:
    """A plain SGD step on the DDP model, mirrored onto the reference copy."""
    with torch.no_grad():
        for param in ddp.module.parameters():
            param -= 0.1 * param.grad
    ddp.zero_grad(set_to_none=True)
    reference_model.load_state_dict(ddp.module.state_dict())


def _applied_mean_gradient(ddp) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).to(torch.float64)


def _close(actual: float, expected: float, rel: float, what: str, abs_tol: float = 1e-12) -> None:
    assert math.isclose(actual, expected, rel_tol=rel, abs_tol=abs_tol), f"{what}: {actual!r} != {expected!r}"


def _close_list(actual, expected, rel: float, what: str, abs_tol: float = 1e-12) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} values, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        _close(a, e, rel, f"{what}[{i}]", abs_tol)


def _check_against_reference(m, grads, losses, tokens, exact_pairwise: bool, mean_rel: float) -> None:
    """Every metric of ``m`` against float64 brute force on the gathered local gradients ``grads`` (N×P)."""
    n = grads.shape[0]
    norms = grads.norm(dim=1)
    mean = grads.mean(dim=0)
    cos = (grads @ grads.T) / (norms[:, None] * norms[None, :])
    off = cos[~torch.eye(n, dtype=torch.bool)]
    to_mean = (grads @ mean) / (norms * mean.norm())
    sqnorms = norms**2
    small, big = float(sqnorms.mean()), float(mean.norm() ** 2)
    b_small, b_big = sum(tokens) / n, float(sum(tokens))
    grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)

    _close_list(m.per_rank_loss, losses, 1e-12, "per_rank_loss")
    assert m.per_rank_tokens == tokens, m.per_rank_tokens
    _close_list(m.per_rank_grad_norm, norms.tolist(), 1e-5, "per_rank_grad_norm")
    _close(m.grad_norm_std, float(norms.std(correction=0)), 1e-5, "grad_norm_std")
    _close(m.grad_norm_cv, float(norms.std(correction=0) / norms.mean()), 1e-5, "grad_norm_cv")
    _close(m.loss_std, float(torch.tensor(losses, dtype=torch.float64).std(correction=0)), 1e-9, "loss_std")
    _close(m.loss_range, max(losses) - min(losses), 1e-9, "loss_range")
    # Sketch mode reads the cosine to the mean off the sketches (the hook keeps no local gradient past the all-reduce).
    to_mean_tol = mean_rel if exact_pairwise else SKETCH_COS_TOL
    _close_list(m.cosine_to_mean, to_mean.tolist(), 0.0, "cosine_to_mean", abs_tol=to_mean_tol)
    _close(m.mean_grad_norm, float(mean.norm()), mean_rel, "mean_grad_norm")
    _close(m.gradient_diversity, float(sqnorms.sum() / (n**2 * mean.norm() ** 2)), mean_rel, "gradient_diversity")
    # Differences of nearly equal squared norms: the fp32 hook values lose a few more digits here.
    _close(m.grad_sqnorm_est, grad_sq, 10 * mean_rel, "grad_sqnorm_est")
    _close(m.trace_sigma_est, trace, 10 * mean_rel, "trace_sigma_est")
    _close(m.noise_scale, trace / grad_sq, 20 * mean_rel, "noise_scale")
    assert m.noise_scale_unit == "tokens"
    pairwise = torch.tensor(m.pairwise_cosine, dtype=torch.float64)
    assert pairwise.shape == (n, n)
    assert bool((pairwise.abs() <= 1).all()), "a cosine outside [-1, 1]"
    tol = 1e-5 if exact_pairwise else SKETCH_COS_TOL
    worst = float((pairwise - cos).abs().max())
    assert worst <= tol, f"pairwise_cosine off by {worst:.3g} (tolerance {tol:.3g}, {m.direction})"
    _close(m.cosine_mean, float(off.mean()), 0.0, "cosine_mean", abs_tol=tol)
    _close(m.cosine_min, float(off.min()), 0.0, "cosine_min", abs_tol=tol)
    assert m.nonfinite_ranks == []
    json.dumps(m.to_dict(), allow_nan=False)


def _run_scenario(direction: str, dtype, bucket_view: bool, accum: int, steps: int, every: int = 1,
                  overlap: bool = False, exchange: str = "gather", shared_ok: bool = True, publishes: bool = True,
                  reduction_every: int = 0, local_from: str = "auto") -> list:
    """``steps`` monitored steps, each checked against the reference; returns the measured StepMetrics.

    With ``overlap`` a step's metrics arrive at the next sampled ``end_step`` (the last from ``flush``);
    every one is checked against the reference kept from its own step. With ``exchange="carry"`` they
    ride on the next step's last all-reduce instead of a gather; with "auto" they go through shared
    memory (exact mode: each rank's whole local gradient, instead of its chunked gather), unless a rank could not
    map it (``shared_ok`` False: every rank must then gather). There one rank
    computes each step's metrics and publishes them, unless they cannot be (``publishes`` False: every rank then
    computes them itself). ``reduction_every``: check the reduction every k-th step (exact mode gathers those
    steps in chunks). ``local_from="grads"``: the local gradients are read from ``.grad`` with no comm hook.
    """
    rank, n = distributed.rank(), distributed.world_size()
    ddp, reference_model = _make_ddp(dtype, bucket_view)
    monitor = WorkerConsistencyMonitor(ddp, direction=direction, sketch_dim=SKETCH_DIM, every=every, seed=7,
                                       overlap=overlap, exchange=exchange, reduction_every=reduction_every, local_from=local_from)
    hooked = _CallCounter(WorkerConsistencyMonitor, "_reduce_bucket")
    bf16 = dtype == torch.bfloat16
    references: dict[int, tuple] = {}
    measured: list = []

    def check(m) -> None:
        grads, losses = references.pop(m.step)
        assert m.direction == direction and m.world_size == n
        assert m.per_rank_extras["compute_ms"] == [float(r) for r in range(n)]
        # Exact mode reads everything off the float64 Gram; sketch mode's ‖ḡ‖² is read off the
        # all-reduced mean, which DDP rounds to bf16 for a bf16 model.
        mean_rel = 1e-5 if direction == "exact" or not bf16 else 2e-2
        _check_against_reference(m, grads, losses, [10 + 3 * r for r in range(n)], direction == "exact", mean_rel)
        if reduction_every and m.step % reduction_every == 0:  # a correct all-reduce rounds within the bound
            assert 0 <= max(m.per_rank_extras["reduction_bound_ratio"]) <= 1, m.per_rank_extras
        measured.append(m)

    gathers = _count_step_gathers()
    wrapped = _count_wrapped_all_reduces()
    chunked = _count_chunked_passes()
    completed = []  # the steps whose metrics this rank computed from the rows
    compute = monitor._complete
    monitor._complete = lambda inflight: completed.append(inflight.step) or compute(inflight)  # type: ignore[method-assign]
    for step in range(steps):
        loss, local = _train_step(ddp, reference_model, step, accum, dtype)
        tokens = 10 + 3 * rank
        m = monitor.end_step(torch.tensor(loss, dtype=torch.float64), tokens=tokens, extras={"compute_ms": float(rank)})
        grads = distributed.all_gather_rows(local)
        if step % every == 0:
            references[step] = (grads, distributed.all_gather_rows(torch.tensor([loss], dtype=torch.float64))[:, 0].tolist())
        # DDP must still apply the plain average (bf16: rounded as DDP's own bf16 all-reduce does).
        applied = _applied_mean_gradient(ddp)
        tolerance = 2e-2 * float(grads.mean(0).abs().max()) if bf16 else 1e-6
        assert torch.allclose(applied, grads.mean(0), rtol=0, atol=tolerance), f"step {step}: applied grad != mean"
        if m is not None:
            assert m.step == (step if not overlap else max(s for s in references if s < step)), (m.step, step)
            check(m)
        elif not overlap:
            assert step % every, f"step {step} is sampled (every={every}) but end_step returned None"
        if direction == "sketch" and exchange in ("gather", "auto"):
            # Sketch mode divides each bucket in place: no all-reduce target, no copy of the gradient.
            assert not monitor._host_targets, "sketch mode kept an all-reduce target beside a bucket"
        _finish_step(ddp, reference_model)
    last = monitor.flush()
    if overlap:
        check(last)
    else:
        assert last is None
    shared = exchange == "auto" and shared_ok
    passes = chunked.restore()
    if direction == "exact":
        # Through shared memory, exact mode's local gradients need no gather of their own (exact_rows.py).
        checks = sum(1 for m in measured if reduction_every and m.step % reduction_every == 0)
        expected = checks if shared else len(measured)
        assert passes == expected, f"{passes} chunked gathers of the local gradients, expected {expected}"
    if shared or (overlap and direction == "sketch"):
        # Carried, an fp32 bucket takes each step's rows to every rank, so the only gather of their own is
        # the last step's, in flush(); a bf16 bucket cannot hold them exactly: every sampled step has one.
        # In shared memory (every rank on this host) no step has one, flush() included.
        expected = 0 if shared else 1 if exchange == "carry" and dtype == torch.float32 else len(measured)
        assert gathers.restore() == expected, f"{gathers.count} all-gathers of step rows, expected {expected}"
    else:
        gathers.restore()
    assert (monitor._shared is not None) == shared
    # The hook starts each bucket's all-reduce on the process group itself, not through dist.all_reduce's wrapper
    # (distributed.all_reduce_async says why); sketch mode makes no other all-reduce.
    assert wrapped.restore() == 0 or direction == "exact", f"{wrapped.count} all-reduces through the wrapper"
    grads = local_from == "grads"
    assert (hooked.restore() == 0) == grads, f"{hooked.count} comm hook calls with local_from={local_from!r}"
    if direction == "sketch" and dtype == torch.float32 and not grads:
        # Each bucket's C pass was planned once and kept: one plan per bucket of DDP's rebuilt layout.
        assert monitor._plans.indices() == list(range(measured[-1].buckets)), monitor._plans.indices()
    if shared and overlap:
        # One rank computed each step's metrics and published them; the others read them (shared_rows.py).
        everyone = sorted(step for steps_done in distributed.all_gather_objects(completed) for step in steps_done)
        assert everyone == sorted([m.step for m in measured] * (1 if publishes else n)), everyone
    # Rank 0 unlinks the file once every rank mapped it: nothing is left even if the run is killed now.
    assert not glob.glob(os.path.join(shared_rows.DIRECTORY, "healthcheck-rows-*")), "a shared-rows file was left behind"
    assert [m.step for m in measured] == [s for s in range(steps) if s % every == 0] and not references
    if grads:  # one pass over .grad a step, whatever DDP's buckets
        assert {m.buckets for m in measured} == {1}, [m.buckets for m in measured]
    else:
        assert measured[-1].buckets > 1, f"expected several buckets after DDP's rebuild, got {measured[-1].buckets}"
        # Guards the scenario itself: the bucket layout must change between the first and a later step.
        assert measured[0].buckets != measured[-1].buckets, "DDP did not rebuild its buckets; rebuild path not exercised"
    # Busy time (previous reduction's end to this rank's last bucket) exists from the second step on.
    assert "busy_ms" not in measured[0].per_rank_extras or every > 1
    assert all(v > 0 for m in measured[1:] for v in m.per_rank_extras["busy_ms"])
    # On a CPU host each such step carries the run-queue wait it left out: a number where the kernel gives the
    # clock (measure/runqueue.py), NaN only where it does not and the ranks share cores.
    clocked = runqueue.read() is not None
    waits = [v for m in measured[1:] for v in m.per_rank_extras["runq_ms"]]
    assert all(v >= 0 for v in waits) if clocked else all(v >= 0 or math.isnan(v) for v in waits), waits
    _check_close_restores_average(ddp, reference_model, monitor, dtype)
    return measured


class _CallCounter:
    """Counts the calls of ``owner.name`` (a module's function, looked up there at each call), until ``restore()``."""

    def __init__(self, owner, name: str) -> None:
        self.count, self._owner, self._name = 0, owner, name
        self._original = getattr(owner, name)

        def counting(*args, **kwargs):
            self.count += 1
            return self._original(*args, **kwargs)

        setattr(owner, name, counting)

    def restore(self) -> int:
        setattr(self._owner, self._name, self._original)
        return self.count


def _count_chunked_passes() -> _CallCounter:
    """Exact mode's chunked passes over the local gradients (each a series of all-gathers)."""
    from healthcheck.measure import monitor as monitor_module

    return _CallCounter(monitor_module, "stream_local_gradients")


def _count_step_gathers() -> _CallCounter:
    """The all-gathers a monitor starts for its step rows."""
    return _CallCounter(distributed, "all_gather_rows_async")


def _count_wrapped_all_reduces() -> _CallCounter:
    """Calls of ``torch.distributed.all_reduce``."""
    import torch.distributed as dist

    return _CallCounter(dist, "all_reduce")


def _check_close_restores_average(ddp, reference_model, monitor, dtype) -> None:
    monitor.close()
    _, local = _train_step(ddp, reference_model, 99, 1, dtype)
    mean = distributed.all_gather_rows(local).mean(0)
    tolerance = 2e-2 * float(mean.abs().max()) if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(_applied_mean_gradient(ddp), mean, rtol=0, atol=tolerance), "after close(): not the mean"
    with pytest.raises(RuntimeError, match="close"):
        monitor.end_step(0.0)


def _check_nonfinite() -> None:
    """Rank 2's gradient goes NaN, rank 1 reports a NaN loss: both listed, the rest still measured."""
    rank, n = distributed.rank(), distributed.world_size()
    ddp, reference_model = _make_ddp(torch.float32, False)
    monitor = WorkerConsistencyMonitor(ddp, direction="sketch", overlap=False)
    loss, local = _train_step(ddp, reference_model, 0, 1, torch.float32, poison=rank == 2)
    reported = float("nan") if rank == 1 else loss  # rank 2's loss is NaN too, through its input
    m = monitor.end_step(reported)
    assert m.nonfinite_ranks == [1, 2], m.nonfinite_ranks
    assert math.isnan(m.per_rank_grad_norm[2]) and math.isnan(m.per_rank_loss[1])
    losses = distributed.all_gather_rows(torch.tensor([reported], dtype=torch.float64))[:, 0]
    finite_losses = losses[[0, 3]]
    assert bool(torch.isfinite(finite_losses).all()) and not bool(torch.isfinite(losses[1:3]).any())
    _close(m.loss_std, float(finite_losses.std(correction=0)), 1e-9, "loss_std over finite ranks")
    _close(m.loss_range, float(finite_losses.max() - finite_losses.min()), 1e-9, "loss_range over finite ranks")
    norms = distributed.all_gather_rows(local).norm(dim=1)
    finite_norms = norms[[r for r in range(n) if r != 2]]
    _close(m.grad_norm_std, float(finite_norms.std(correction=0)), 1e-5, "grad_norm_std over finite ranks")
    # The all-reduced mean is NaN, so everything measured against it is NaN, not averaged away.
    assert all(math.isnan(c) for c in m.cosine_to_mean) and math.isnan(m.noise_scale)
    assert math.isnan(m.pairwise_cosine[0][2]) and math.isfinite(m.cosine_min)
    data = m.to_dict()
    json.dumps(data, allow_nan=False)
    assert data["per_rank_grad_norm"][2] is None and data["mean_grad_norm"] is None
    monitor.close()


def _check_close_frees_the_model() -> None:
    """DDP's reducer keeps the monitor as its hook's state, where the garbage collector cannot see: a closed monitor
    that still held the model kept both alive for good (a second model in the same process paid for the first)."""
    ddp, reference_model = _make_ddp(torch.float32, False)
    monitor = WorkerConsistencyMonitor(ddp, direction="sketch", overlap=False)
    loss, _ = _train_step(ddp, reference_model, 0, 1, torch.float32)
    assert monitor.end_step(loss) is not None
    monitor.close()
    module = weakref.ref(ddp.module)
    del ddp, monitor
    gc.collect()
    assert module() is None


def _check_reduction_after_clipping() -> None:
    """The reduction check compares the all-reduce's own result, though the bucket it reduced in place is the
    gradients' storage (gradient_as_bucket_view) and the loop clips them before end_step."""
    for direction in ("sketch", "exact"):
        ddp, reference_model = _make_ddp(torch.float32, True)  # a fresh model: DDP takes one comm hook only
        monitor = WorkerConsistencyMonitor(ddp, direction=direction, reduction_every=1, overlap=False)
        loss, _ = _train_step(ddp, reference_model, 0, 1, torch.float32)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)  # scales every gradient well below its norm
        m = monitor.end_step(loss)
        worst = max(m.per_rank_extras["reduction_rel_error"])
        assert worst < 1e-5, f"{direction}: reduction_rel_error {worst} after the loop clipped the gradients"
        monitor.close()


def _check_squares_after_ddp_finalize() -> None:
    """As on a GPU (reduced_norm.DeferredSquares, here for host buckets too), ‖ḡ‖²'s shares are squared once per step
    after DDP's finalize instead of in each bucket's callback: the same metrics, and the mean's norm is the
    all-reduce's even where the loop clips the gradients, the buckets' storage, before end_step."""
    settled = []
    takes, settle = DeferredSquares.__dict__["takes"], DeferredSquares.settle  # the staticmethod itself
    DeferredSquares.takes = staticmethod(lambda reduced: True)  # type: ignore[method-assign]
    DeferredSquares.settle = lambda self: settled.append(sorted(self._pending)) or settle(self)  # type: ignore[method-assign]
    try:
        measured = _run_scenario("sketch", torch.float32, bucket_view=True, accum=2, steps=4, every=2, overlap=True)
        assert len(settled) == len(measured), settled  # once per sampled step
        assert settled[-1] == list(range(measured[-1].buckets)), settled
        ddp, reference_model = _make_ddp(torch.float32, True)
        monitor = WorkerConsistencyMonitor(ddp, direction="sketch", overlap=False)
        loss, local = _train_step(ddp, reference_model, 0, 1, torch.float32)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)
        m = monitor.end_step(loss)
        _close(m.mean_grad_norm, float(distributed.all_gather_rows(local).mean(0).norm()), 1e-5, "mean_grad_norm after a clip")
        monitor.close()
    finally:
        DeferredSquares.takes, DeferredSquares.settle = takes, settle  # type: ignore[method-assign]


def _interpreted_kernel_worker() -> None:
    """The GPU's path on host buckets: each bucket's Triton kernel (run by Triton's interpreter, which
    ``TRITON_INTERPRET=1`` must switch on before Triton is first imported) adds into its row of BucketPlans' table,
    which end_step zeroes after the pack. The metrics must match the reference step after step, through DDP's
    rebuild, and each bucket must be one kernel launch a sampled step, none of them failed over to the torch sketch."""
    from healthcheck.measure import sketch, sketch_kernel
    from healthcheck.measure.bucket_plans import StepTable

    distributed.set_worker_threads(4)
    distributed.init_distributed("cpu", "gloo", 120)
    sketch._kernel_for = lambda x: sketch_kernel if x.dtype in (torch.float32, torch.bfloat16) else None  # as on CUDA
    launches = _CallCounter(sketch_kernel.DeviceBucket, "add_into")
    row = StepTable.row

    def first_in_its_step(self, index, **kwargs):  # a row zeroed on its own is a launch a bucket: new_step zeroes them
        assert index not in self._written, f"bucket {index}'s row was not zeroed with the table since its last step"
        return row(self, index, **kwargs)

    StepTable.row = first_in_its_step  # type: ignore[method-assign]
    try:
        for overlap in (False, True):
            measured = _run_scenario("sketch", torch.float32, bucket_view=overlap, accum=2, steps=4, overlap=overlap, exchange="auto")
            assert launches.count == sum(m.buckets for m in measured), (launches.count, [m.buckets for m in measured])
            launches.count = 0
        assert not sketch._KERNEL_OFF, sketch._KERNEL_OFF
    finally:
        distributed.destroy_distributed()


def _check_bad_arguments() -> None:
    ddp, _ = _make_ddp(torch.float32, False)
    for field, value in (("direction", "dense"), ("sketch_dim", 0), ("every", 0), ("exact_chunk_numel", -1), ("exchange", "push")):
        with pytest.raises(ValueError, match=field):
            WorkerConsistencyMonitor(ddp, **{field: value})
    for options in ({"direction": "exact"}, {"overlap": False}):
        with pytest.raises(ValueError, match="exchange='carry' needs direction='sketch' and overlap=True"):
            WorkerConsistencyMonitor(ddp, exchange="carry", **options)


def _check_a_rank_that_cannot_map_makes_every_rank_gather() -> None:
    # As a rank on another host would: it finds no file with rank 0's token. The ranks must agree, or the ones
    # still posting to shared memory would wait for a row that never comes while the others sit in an all-gather.
    original = shared_rows._map
    if distributed.rank() == 1:
        shared_rows._map = lambda *args: None  # type: ignore[assignment]
    try:
        _run_scenario("sketch", torch.float32, bucket_view=False, accum=1, steps=3, overlap=True, exchange="auto", shared_ok=False)
    finally:
        shared_rows._map = original  # type: ignore[assignment]


def _check_metrics_that_cannot_be_published_are_computed_by_every_rank() -> None:
    # As when they do not fit the file's result slot: the claimant keeps its own, every other rank computes them.
    original = shared_rows.SharedRows.publish
    shared_rows.SharedRows.publish = lambda self, post, payload: False  # type: ignore[method-assign]
    try:
        _run_scenario("sketch", torch.float32, bucket_view=False, accum=1, steps=3, overlap=True, exchange="auto", publishes=False)
    finally:
        shared_rows.SharedRows.publish = original  # type: ignore[method-assign]


def _four_rank_worker() -> None:
    distributed.set_worker_threads(4)
    distributed.init_distributed("cpu", "gloo", 120)
    try:
        _check_bad_arguments()
        _check_reduction_after_clipping()
        _check_squares_after_ddp_finalize()
        _run_scenario("exact", torch.float32, bucket_view=False, accum=1, steps=3)
        _run_scenario("sketch", torch.float32, bucket_view=True, accum=2, steps=4, every=2)
        _run_scenario("sketch", torch.float32, bucket_view=True, accum=2, steps=5, every=2, overlap=True)
        _run_scenario("sketch", torch.float32, bucket_view=True, accum=2, steps=5, every=2, overlap=True, exchange="carry")
        _run_scenario("exact", torch.float32, bucket_view=False, accum=1, steps=3, overlap=True)
        _run_scenario("exact", torch.bfloat16, bucket_view=True, accum=2, steps=2)
        _run_scenario("sketch", torch.bfloat16, bucket_view=False, accum=1, steps=2, overlap=True, exchange="carry")
        _run_scenario("sketch", torch.float32, bucket_view=True, accum=2, steps=5, every=2, overlap=True, exchange="auto")
        _run_scenario("sketch", torch.bfloat16, bucket_view=False, accum=1, steps=3, exchange="auto")
        _run_scenario("exact", torch.float32, bucket_view=False, accum=1, steps=3, overlap=True, exchange="auto")
        _run_scenario("exact", torch.bfloat16, bucket_view=True, accum=2, steps=2, exchange="auto")
        _check_a_rank_that_cannot_map_makes_every_rank_gather()
        _check_metrics_that_cannot_be_published_are_computed_by_every_rank()
        _check_nonfinite()
        _check_close_frees_the_model()
    finally:
        distributed.destroy_distributed()


def _eight_rank_worker() -> None:
    distributed.set_worker_threads(8)
    distributed.init_distributed("cpu", "gloo", 120)
    try:
        _run_scenario("exact", torch.float32, bucket_view=True, accum=2, steps=2)
        _run_scenario("sketch", torch.float32, bucket_view=False, accum=1, steps=3, overlap=True, exchange="carry")
        _run_scenario("sketch", torch.float32, bucket_view=False, accum=1, steps=4, overlap=True, exchange="auto")
        # Step 0 checks the reduction and posts its header first: the rows must still have room for the gradients.
        _run_scenario("exact", torch.float32, bucket_view=True, accum=2, steps=4, overlap=True, exchange="auto", reduction_every=2)
    finally:
        distributed.destroy_distributed()


def test_rejects_a_model_that_is_not_ddp():
    with pytest.raises(TypeError, match="torch.nn.modules.linear.Linear"):
        WorkerConsistencyMonitor(torch.nn.Linear(2, 2))


@pytest.mark.multiprocess
def test_monitor_matches_reference_on_four_ranks():
    launcher.launch_local(_four_rank_worker, 4, run_id="test-monitor-4")


def launch_interpreted(module: str, worker: str, ranks: int) -> None:
    """``tests.multiprocess.<module>.<worker>`` on ``ranks`` gloo ranks in a fresh interpreter with Triton's interpreter
    switched on (``TRITON_INTERPRET=1`` must be set before Triton is first imported)."""
    pytest.importorskip("triton")  # a test dependency ([test] extra)
    launch = f"from healthcheck.run import launcher; from tests.multiprocess import {module} as t; " \
             f"launcher.launch_local(t.{worker}, {ranks}, run_id='{module}-{worker}'.replace('_', '-'))"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", launch], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.multiprocess
def test_the_gpu_kernels_table_matches_reference_in_triton_interpreter():
    launch_interpreted("test_monitor", "_interpreted_kernel_worker", 4)


@pytest.mark.multiprocess
def test_monitor_matches_reference_on_eight_ranks():
    launcher.launch_local(_eight_rank_worker, 8, run_id="test-monitor-8")

"""The worker-side audits on real gloo process groups: parameter hashes and the reduction-numerics check.

Three ranks train a small MLP under DDP. Clean DDP must keep the parameters bit-identical; a rank whose
last layer has 10x the learning rate must be named, with that layer as the first differing tensor. The
monitor's reduction check must report a rounding-sized error for the real all-reduce, and more than the
rounding bound once the reduction is made lossy (bf16 compression). Workers are module-level functions
that raise AssertionError, launched like torchrun through ``healthcheck.run.launcher.launch_local``.

    python -m pytest tests/multiprocess/test_audits.py -q
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from healthcheck.judge.exact_audits import param_equality_audit, reduction_audit
from healthcheck.measure import distributed
from healthcheck.measure import monitor as monitor_module
from healthcheck.measure.evidence import AuditRecorder
from healthcheck.measure.monitor import WorkerConsistencyMonitor
from healthcheck.run import launcher

pytestmark = pytest.mark.multiprocess

WORLD = 3
FAULTY = 2


def _make_ddp(bucket_view: bool = False) -> tuple[torch.nn.Module, torch.nn.Module]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    # Several small buckets, so the reduction check packs more than one bucket per gather.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001, gradient_as_bucket_view=bucket_view)
    return ddp, copy.deepcopy(model)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 8, generator=generator) * (1 + rank), torch.randn(6, 4, generator=generator)


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _train(lr_for_last_layer: float, steps: int = 4, model_out: list | None = None) -> dict | None:
    ddp, _ = _make_ddp()
    layers = list(ddp.module.children())
    head = list(layers[-1].parameters())
    body = [p for p in ddp.module.parameters() if all(p is not h for h in head)]
    optimizer = torch.optim.AdamW([{"params": body, "lr": 1e-2}, {"params": head, "lr": lr_for_last_layer}])
    recorder = AuditRecorder(ddp.module, param_check_every=2)
    for step in range(steps):
        x, y = _batch(step, distributed.rank())
        recorder.record_batch(0, [step])
        _loss(ddp, x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recorder.after_optimizer_step(step)
    if model_out is not None:
        model_out.append(ddp.module)
    return recorder.finish()


def _check_param_equality() -> None:
    rank = distributed.rank()
    clean = _train(1e-2)
    trained: list = []
    faulty = _train(1e-1 if rank == FAULTY else 1e-2, model_out=trained)
    # Independent reference for the last drift measurement (step 3, the parameters as they are now).
    flat = torch.cat([p.detach().reshape(-1) for p in trained[0].parameters()]).to(torch.float64)
    everyone = distributed.all_gather_rows(flat)
    mean = everyone.mean(0)
    expected_drift = ((everyone - mean).norm(dim=1) / mean.norm()).tolist()
    if rank != 0:
        assert clean is None and faulty is None, "only rank 0 receives the gathered evidence"
        return
    assert [step for step, _ in clean.param_checks] == [0, 2, 3], "every 2nd step from 0, plus the last"
    assert clean.param_names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    outcome = param_equality_audit(clean.param_checks, clean.param_names)
    assert outcome.passed and outcome.signature == "equal" and outcome.ranks == (), outcome
    assert clean.param_drift == [], "equal hashes: the drift all-reduce never runs"
    assert [step for step, _ in faulty.param_drift] == [0, 2, 3]
    last = faulty.param_drift[-1][1]
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(last, expected_drift)), (last, expected_drift)
    assert max(range(WORLD), key=lambda r: last[r]) == FAULTY

    outcome = param_equality_audit(faulty.param_checks, faulty.param_names, faulty.param_drift)
    assert not outcome.passed and outcome.ranks == (FAULTY,), outcome
    assert outcome.signature == "0-1|2", outcome.signature
    assert outcome.details["first_step"] == 0 and outcome.details["first_tensor"] == "4.weight", outcome.details
    assert outcome.message.startswith("rank 2's parameters differ from the majority (ranks 0-1) after step 0 "
                                      "(first differing tensor: 4.weight; 3/3 checks differ); rank 2's distance from "
                                      "the mean parameters grew from "), outcome.message
    assert [p.consumed for p in faulty.per_rank] == [[(0, [s]) for s in range(4)]] * WORLD


def _reduction_extras(direction: str = "sketch", steps: int = 2) -> list[dict[str, list[float]]]:
    """Run ``steps`` monitored steps with the reduction check on; per step, the gathered extras.

    Exact mode runs with gradient_as_bucket_view, where the bucket *is* the gradient DDP overwrites
    with the mean, and computes its Gram in the same chunked pass as the reduction check.
    """
    ddp, reference = _make_ddp(bucket_view=direction == "exact")
    monitor = WorkerConsistencyMonitor(ddp, direction=direction, every=1, reduction_every=1, overlap=False)
    out = []
    for step in range(steps):
        x, y = _batch(step, distributed.rank())
        _loss(ddp, x, y).backward()
        local = torch.cat([g.reshape(-1) for g in torch.autograd.grad(_loss(reference, x, y), list(reference.parameters()))])
        m = monitor.end_step(0.0)
        extras = m.per_rank_extras
        if direction == "exact":  # the Gram from the shared pass still gives the exact norms
            norms = distributed.all_gather_rows(local).norm(dim=1).tolist()
            assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(m.per_rank_grad_norm, norms)), m.per_rank_grad_norm
        # Independent reference: the gradient DDP applied on this rank against the float64 mean of all ranks'.
        mean = distributed.all_gather_rows(local).to(torch.float64).mean(0)
        applied = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).to(torch.float64)
        expected = float((applied - mean).norm() / mean.norm())
        own_error = extras["reduction_rel_error"][distributed.rank()]
        assert math.isclose(own_error, expected, rel_tol=1e-6, abs_tol=1e-15), f"step {step}: {own_error} != {expected}"
        out.append(extras)
        with torch.no_grad():
            for p, r in zip(ddp.module.parameters(), reference.parameters()):
                p -= 0.1 * p.grad
                r.copy_(p)
        ddp.zero_grad(set_to_none=True)
    monitor.close()
    return out


def _check_exact_chunks_ending_on_a_boundary() -> None:
    """Exact mode with a chunk size that divides the gradient: the fused header must still arrive."""
    ddp, reference = _make_ddp()
    numel = sum(p.numel() for p in ddp.module.parameters())
    monitor = WorkerConsistencyMonitor(ddp, direction="exact", exact_chunk_numel=numel // 4, overlap=False)
    assert numel % 4 == 0
    x, y = _batch(0, distributed.rank())
    _loss(ddp, x, y).backward()
    local = torch.cat([g.reshape(-1) for g in torch.autograd.grad(_loss(reference, x, y), list(reference.parameters()))])
    m = monitor.end_step(1.5, extras={"compute_ms": 1.0})
    norms = distributed.all_gather_rows(local).norm(dim=1).tolist()
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(m.per_rank_grad_norm, norms)), m.per_rank_grad_norm
    assert m.per_rank_loss == [1.5] * WORLD and m.per_rank_extras == {"compute_ms": [1.0] * WORLD}
    monitor.close()


def _as_rows(per_step: list[dict[str, list[float]]]) -> list[dict]:
    rows = []
    for step, extras in enumerate(per_step):
        ratios = extras["reduction_bound_ratio"]
        worst = max(range(len(ratios)), key=ratios.__getitem__)
        rows.append({"step": step, "reduction_rel_error": max(extras["reduction_rel_error"]),
                     "reduction_bound_ratio": ratios[worst], "reduction_worst_rank": worst})
    return rows


def _check_reduction_numerics() -> None:
    exact = _reduction_extras("sketch") + _reduction_extras("exact")
    for extras in exact:
        assert all(0 <= e < 1e-6 for e in extras["reduction_rel_error"]), extras
        assert all(0 <= b <= 1 for b in extras["reduction_bound_ratio"]), extras
    assert reduction_audit(_as_rows(exact), WORLD).passed

    # A lossy reduction, as a bf16 compression hook would do: the bound must catch it on every rank.
    original = monitor_module.distributed.all_reduce_async

    def bf16_all_reduce(tensor, group=None):
        tensor.copy_(tensor.to(torch.bfloat16))
        return original(tensor, group)

    monitor_module.distributed.all_reduce_async = bf16_all_reduce
    try:
        lossy = _reduction_extras()
    finally:
        monitor_module.distributed.all_reduce_async = original
    for extras in lossy:
        assert all(e > 1e-4 for e in extras["reduction_rel_error"]), extras
        assert all(b > 10 for b in extras["reduction_bound_ratio"]), extras
    outcome = reduction_audit(_as_rows(lossy), WORLD)
    assert not outcome.passed and outcome.signature == "exceeds-bound" and "lossy reduction" in outcome.message


def _worker() -> None:
    distributed.set_worker_threads(WORLD)
    distributed.init_distributed("cpu", "gloo", 120)
    try:
        _check_param_equality()
        _check_reduction_numerics()
        _check_exact_chunks_ending_on_a_boundary()
    finally:
        distributed.destroy_distributed()


def test_parameter_hashes_and_reduction_numerics_on_three_ranks():
    launcher.launch_local(_worker, WORLD, run_id="test-audits-3")

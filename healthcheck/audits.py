"""Evidence for the exact audits: recorded on the workers, assembled into ``result.audits`` after the run.

Worker side, on every rank (``trainer.TrainLoop`` makes these calls)::

    recorder = AuditRecorder(ddp.module, param_check_every=10)
    recorder.record_rng("rng_start", device)          # before the first step
    recorder.record_batch(epoch, batch["sample_ids"])  # per micro-batch
    recorder.after_optimizer_step(step)                # collective on check steps: parameter hashes
    evidence = recorder.finish()                       # collective; rank 0 gets every rank's evidence

Launcher side, :func:`run_audits` computes the planned sampler order and hands everything to the
pure analyses in :mod:`healthcheck.audit_checks`; ``probe.py`` stores the outcome in ``result.json``.

Cost: a parameter check hashes every parameter on its device (no copy to the host) and gathers one
int64 per tensor per rank; only when the hashes disagree does it all-reduce the parameters to measure
how far each rank has drifted. The sample ids and RNG hashes are gathered once, at the end.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from pathlib import Path
from typing import Any, Mapping, Sequence

from healthcheck import distributed as hdist
from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE, read_jsonl
from healthcheck.audit_checks import (
    AuditOutcome,
    data_shard_audit,
    environment_audit,
    nonfinite_audit,
    param_equality_audit,
    reduction_audit,
    seed_audit,
)
from healthcheck.rank_outliers import (
    OUTLIER_METRICS,
    rank_outlier_audit,
    straggler_audit,
)

#: Elements hashed at a time: bounds the int64 temporaries to a few tens of MiB per tensor.
_HASH_CHUNK_NUMEL = 1 << 22
# Odd multiplier of the golden-ratio hash (2^64 / phi), as a signed int64 so torch accepts it.
_WEIGHT_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)
_WEIGHT_OFFSET = 0x632BE59BD9B4E019


class AuditRecorder:
    """Collects one rank's audit evidence during the probe; see the module docstring for the calls.

    Args:
        model: The trained module (``ddp.module``); its parameters are hashed on check steps.
        param_check_every: Hash and compare the parameters after every k-th optimizer step (from step 0)
            and after the last one.
        extra: Scalars to compare across ranks in the environment audit (e.g. the model dtype).
    """

    def __init__(self, model: Any, *, param_check_every: int, extra: Mapping[str, Any] | None = None):
        if param_check_every < 1:
            raise ValueError(f"param_check_every: expected a positive int, got {param_check_every!r}")
        self.model = model
        self.param_check_every = param_check_every
        self.extra = dict(extra or {})
        self.consumed: list[tuple[int, list[int]]] = []
        self.rng: dict[str, dict[str, str]] = {}
        self.param_checks: list[tuple[int, list[list[int]]]] = []
        self.param_drift: list[tuple[int, list[float]]] = []
        self.last_step: int | None = None

    def record_batch(self, epoch: int, sample_ids: Sequence[int]) -> None:
        self.consumed.append((int(epoch), [int(i) for i in sample_ids]))

    def record_rng(self, when: str, device: Any) -> None:
        self.rng[when] = rng_state_hashes(device)

    def after_optimizer_step(self, step: int) -> None:
        """Collective on check steps (every rank runs the same steps, so every rank joins)."""
        self.last_step = step
        if step % self.param_check_every == 0:
            self._check_params(step)

    def finish(self) -> dict[str, Any] | None:
        """Check the parameters after the last step run, gather every rank's evidence; rank 0 returns it.

        Called on every rank once the loop ended, also after an early stop (all ranks stop at the same
        step, so the collectives still match).
        """
        if self.last_step is not None and (not self.param_checks or self.param_checks[-1][0] != self.last_step):
            self._check_params(self.last_step)
        mine = {"consumed": self.consumed, "rng": self.rng, "extra": self.extra}
        everyone = hdist.all_gather_objects(mine)
        if hdist.rank() != 0:
            return None
        return {
            "per_rank": everyone,
            "param_checks": self.param_checks,
            "param_names": [name for name, _ in self.model.named_parameters()],
            "param_drift": self.param_drift,
        }

    def _check_params(self, step: int) -> None:
        import torch

        parameters = [p for _, p in self.model.named_parameters()]
        hashes = parameter_hashes(parameters)
        if hashes.numel() == 0:
            hashes = torch.zeros(1, dtype=torch.int64, device=hashes.device)
        # One small gather: T int64 per rank. Every rank keeps the table; only rank 0's is used.
        table = hdist.all_gather_rows(hashes).cpu().tolist()
        self.param_checks.append((step, table))
        # Every rank sees the same table, so all of them join the drift measurement or none does:
        # healthy runs never pay for it, and a divergence gets a size, not just a yes.
        if len({tuple(row) for row in table}) > 1:
            self.param_drift.append((step, parameter_drift(parameters)))


def parameter_drift(parameters: Sequence[Any]) -> list[float]:
    """Collective: each rank's relative distance from the rank-averaged parameters, ``|θ_r - θ̄| / |θ̄|``.

    One float64 all-reduce per tensor, one tensor at a time, so the extra memory is two copies of the
    largest tensor. It runs only on check steps where the hashes already disagree.
    """
    import torch

    if not parameters:
        return [0.0] * hdist.world_size()
    world = hdist.world_size()
    device = parameters[0].device
    gap_sq = torch.zeros((), dtype=torch.float64, device=device)
    mean_sq = torch.zeros((), dtype=torch.float64, device=device)
    for parameter in parameters:
        mine = parameter.detach().to(torch.float64)
        mean = mine.clone()
        hdist.all_reduce_async(mean).wait()
        mean /= world
        gap_sq += (mine - mean).square().sum()
        mean_sq += mean.square().sum()
    gaps = hdist.all_gather_rows(gap_sq.reshape(1)).reshape(-1)
    scale = float(mean_sq.sqrt()) or 1.0
    return [float(g) ** 0.5 / scale for g in gaps.cpu().tolist()]


# --------------------------------------------------------------------------- hashing


def tensor_bit_hash(tensor: Any) -> Any:
    """A 0-d int64 device tensor that changes with any change to ``tensor``'s bits, computed on its device.

    The bits are read as integers (fp32 as int32, bf16/fp16 as int16, fp64 as int64) and summed with
    odd position-dependent weights, modulo 2^64. Integer sums do not depend on the reduction order, so
    equal tensors give equal hashes on any device; a change in one element always changes the hash
    (an odd weight times a non-zero difference below 2^64 is never 0 mod 2^64).
    """
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.is_floating_point():
        width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        flat = flat.view(width)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _HASH_CHUNK_NUMEL):
        chunk = flat[start : start + _HASH_CHUNK_NUMEL].to(torch.int64)
        # int64 arithmetic wraps on CPU and GPU alike; that wrap-around is the intended modulo 2^64.
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device)
        weights = (weights * _WEIGHT_MULTIPLIER + _WEIGHT_OFFSET) | 1
        total += (chunk * weights).sum()
    return total


def parameter_hashes(parameters: Sequence[Any]) -> Any:
    """One :func:`tensor_bit_hash` per parameter, as a 1-D int64 tensor on the parameters' device."""
    import torch

    if not parameters:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([tensor_bit_hash(p) for p in parameters])


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def rng_state_hashes(device: Any = None) -> dict[str, str]:
    """Short hashes of this process's python, numpy, torch CPU (and the device's CUDA) RNG states."""
    import numpy as np
    import torch

    name, keys, position, has_gauss, cached = np.random.get_state()
    out = {
        "python": _digest(pickle.dumps(random.getstate())),
        "numpy": _digest(keys.tobytes() + repr((name, position, has_gauss, cached)).encode()),
        "torch": _digest(torch.get_rng_state().numpy().tobytes()),
    }
    if device is not None and getattr(device, "type", None) == "cuda":
        out["cuda"] = _digest(torch.cuda.get_rng_state(device).numpy().tobytes())
    return out


# --------------------------------------------------------------------------- the plan


def planned_shards(
    n_samples: int, world_size: int, seed: int, shuffle: bool, micro_batch_size: int, epochs: int
) -> dict[tuple[int, int], list[int]]:
    """``(rank, epoch) -> sample ids`` that a correct run reads: torch's own DistributedSampler with the
    shared seed, ``set_epoch(epoch)`` each epoch and ``drop_last``, cut to whole micro-batches."""
    from torch.utils.data.distributed import DistributedSampler

    plan = {}
    for rank in range(world_size):
        sampler = DistributedSampler(range(n_samples), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=True)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            order = list(sampler)
            plan[(rank, epoch)] = order[: len(order) // micro_batch_size * micro_batch_size]
    return plan


# --------------------------------------------------------------------------- assembly


def run_audits(config: Any, payload: Mapping[str, Any], run_dir: Path, nonfinite: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Every audit's ``result.audits`` entry for a finished probe.

    Args:
        config: The global :class:`~healthcheck.config.ProbeConfig` (the plan follows *its* seed).
        payload: Rank 0's return value (``ranks``, ``world_size`` and ``audit_evidence``).
        run_dir: The run directory (step files for the stragglers, reduction and non-finite audits).
        nonfinite: ``RunResult.nonfinite`` events.
    """
    world = int(payload["world_size"])
    ranks = list(payload.get("ranks") or [])
    evidence = payload.get("audit_evidence")
    outcomes: dict[str, AuditOutcome] = {}
    if evidence:
        per_rank = evidence["per_rank"]
        consumed = [p["consumed"] for p in per_rank]
        epochs = 1 + max((epoch for batches in consumed for epoch, _ in batches), default=0)
        train = config.train
        seed = train.data_seed if train.data_seed is not None else train.seed
        plan = planned_shards(evidence["plan_samples"], world, seed, train.shuffle, train.micro_batch_size, epochs)
        outcomes["data_shards"] = data_shard_audit(consumed, plan)
        outcomes["param_equality"] = param_equality_audit(evidence["param_checks"], evidence["param_names"],
                                                          evidence.get("param_drift", ()))
        if ranks:
            outcomes["seeds"] = seed_audit([
                {**{k: info[k] for k in ("seed", "sampler_seed", "torch_seed", "python_seed", "numpy_seed")},
                 "rng_start": p["rng"].get("rng_start", {}), "rng_after_first_step": p["rng"].get("rng_after_first_step", {})}
                for info, p in zip(ranks, per_rank)
            ])
            outcomes["environment"] = environment_audit([
                {"versions": info.get("versions", {}), "env": info.get("env", {}), "device_name": info.get("device_name"),
                 "precision": info.get("precision"), **p.get("extra", {})}
                for info, p in zip(ranks, per_rank)
            ])
    events = [e.model_dump() if hasattr(e, "model_dump") else dict(e) for e in nonfinite]
    outcomes["nonfinite"] = nonfinite_audit(events, world)
    rows = list(read_jsonl(Path(run_dir) / STEPS_FILE))
    # cycle_ms (from the previous gather, a moment all ranks share) when the step has it for every rank:
    # compute_ms ends at the all-reduce, also shared, so a rank that merely starts late looks fast in it.
    timing_by_step: dict[int, dict[str, list[float | None]]] = {}
    for row in rows:
        per_step = timing_by_step.setdefault(row["step"], {"cycle_ms": [None] * world, "compute_ms": [None] * world})
        for key in per_step:
            per_step[key][row["rank"]] = row.get(key)
    compute = {step: t["cycle_ms"] if all(v is not None for v in t["cycle_ms"]) else t["compute_ms"]
               for step, t in timing_by_step.items()}
    metrics = config.metrics
    outcomes["stragglers"] = straggler_audit(compute, metrics.straggler_factor, metrics.straggler_max_p)
    per_step: dict[int, dict[str, list[Any]]] = {}
    for row in rows:
        columns = per_step.setdefault(row["step"], {m: [None] * world for m in OUTLIER_METRICS})
        for metric in OUTLIER_METRICS:
            columns[metric][row["rank"]] = row.get(metric)
    outcomes["rank_outliers"] = rank_outlier_audit(per_step, metrics.rank_outlier_max_p)
    checked = [r for r in read_jsonl(Path(run_dir) / AGGREGATES_FILE) if "reduction_rel_error" in r]
    outcomes["reduction_numerics"] = reduction_audit(checked, world)
    return {name: outcome.to_entry() for name, outcome in outcomes.items()}

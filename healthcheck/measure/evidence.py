"""Evidence for the exact audits, recorded on the workers; :mod:`healthcheck.judge.assemble` turns it into
``result.audits`` after the run.

On every rank (``healthcheck.run.trainer.TrainLoop`` makes these calls; under FSDP2, ``sharded=True``
replaces the parameter hashes by :mod:`healthcheck.measure.sharded_state`)::

    recorder = AuditRecorder(ddp.module, param_check_every=10)
    recorder.record_rng("rng_start", device)          # before the first step
    recorder.record_batch(epoch, batch["sample_ids"])  # per micro-batch
    recorder.after_optimizer_step(step)                # collective on check steps: parameter hashes
    evidence = recorder.finish()                       # collective; rank 0 gets every rank's AuditEvidence

Cost: a parameter check hashes every parameter on its device (no copy to the host) and gathers one
int64 per tensor per rank; only when the hashes disagree does it all-reduce the parameters to measure
how far each rank has drifted. The sample ids and RNG hashes are gathered once, at the end.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from typing import Any, Mapping, Optional, Sequence

from healthcheck.artifacts import AuditEvidence, RankEvidence, ReplayEvidence, SamplerPlan
from healthcheck.measure import distributed as hdist
from healthcheck.measure.bit_hash import parameter_hashes


class AuditRecorder:
    """Collects one rank's audit evidence during the probe; see the module docstring for the calls.

    Args:
        model: The trained module (``ddp.module``); its parameters are hashed on check steps.
        param_check_every: Hash and compare the parameters after every k-th optimizer step (from step 0)
            and after the last one.
        extra: Scalars to compare across ranks in the environment audit (e.g. the model dtype).
    """

    def __init__(
        self,
        model: Any,
        *,
        param_check_every: int,
        extra: Mapping[str, Any] | None = None,
        sharded: bool = False,
        pre_shard: Sequence[tuple[str, int]] = (),
    ):
        if param_check_every < 1:
            raise ValueError(f"param_check_every: expected a positive int, got {param_check_every!r}")
        self.model = model
        self.param_check_every = param_check_every
        self.extra = dict(extra or {})
        self.consumed: list[tuple[int, list[int]]] = []
        self.contents: list[tuple[int, list[int]]] = []  #: --script: sample hashes where indices name no sample
        self.rng: dict[str, dict[str, str]] = {}
        self.param_checks: list[tuple[int, list[list[int]]]] = []
        self.param_drift: list[tuple[int, list[float]]] = []
        self.last_step: int | None = None
        #: What sharded the data and whether the loss was seen; a --script probe learns these as it runs.
        self.sampler: Optional[SamplerPlan] = None
        self.shard_source = "sampler"
        self.dataset_digest: Optional[str] = None
        self.dataset_size: Optional[int] = None
        self.batch_facts: dict[str, str] = {}
        self.hints: dict[str, str] = {}  #: :mod:`healthcheck.measure.module_hooks`, never judged
        self.loss_problem: Optional[str] = None
        #: The replay audit's evidence (:mod:`healthcheck.run.replay_rounds` fills it; the same on every rank).
        self.replay: Optional[ReplayEvidence] = None
        #: Steps a GradScaler skipped in part, with their ranks' non-finite gradients (:class:`AuditEvidence`).
        self.scaler_overflows: list[tuple[int, list[int]]] = []
        # FSDP2: no parameter is replicated, so check steps compare the optimizer instead (collective).
        self.sharded = None
        if sharded:
            from healthcheck.measure.sharded_state import ShardedStateRecorder

            self.sharded = ShardedStateRecorder(model, pre_shard)

    def sharded_evidence(self) -> Any:
        """The sharded-state evidence so far (FSDP2), or None for replicas."""
        return self.sharded.evidence if self.sharded is not None else None

    def watch_optimizer(self, optimizer: Any) -> None:
        """The optimizer whose settings and step count a sharded run compares on check steps."""
        if self.sharded is not None:
            self.sharded.optimizer = optimizer

    def record_batch(self, epoch: int, sample_ids: Sequence[int]) -> None:
        self.consumed.append((int(epoch), [int(i) for i in sample_ids]))

    def record_rng(self, when: str, device: Any) -> None:
        self.rng[when] = rng_state_hashes(device)

    def after_optimizer_step(self, step: int, optimizer: Any = None) -> None:
        """Collective on check steps (every rank runs the same steps, so every rank joins). ``optimizer``: the one
        that stepped, where nobody handed it to :meth:`watch_optimizer` before (a script's)."""
        self.last_step = step
        if optimizer is not None and self.sharded is not None and self.sharded.optimizer is None:
            self.watch_optimizer(optimizer)
        if step % self.param_check_every == 0:
            self._check_params(step)

    def finish(self, plan_samples: int = 0) -> Optional[AuditEvidence]:
        """Check the parameters after the last step run, gather every rank's evidence; rank 0 returns it.

        Called on every rank once the loop ended, also after an early stop (all ranks stop at the same
        step, so the collectives still match). ``plan_samples``: the size of the data set the shared
        shard plan splits (rank 0's value is the one kept).
        """
        if self.last_step is not None and not self.checked_at(self.last_step):
            self._check_params(self.last_step)
        sharded = self.sharded.finish() if self.sharded is not None else None
        local_evidence = RankEvidence(
            consumed=self.consumed,
            contents=self.contents,
            rng=self.rng,
            extra=self.extra,
            sampler=self.sampler,
            shard_source=self.shard_source,
            loss_problem=self.loss_problem,
            dataset_digest=self.dataset_digest,
            dataset_size=self.dataset_size,
            batch_facts=self.batch_facts,
            hints=self.hints,
        )
        everyone = hdist.all_gather_objects(local_evidence.model_dump())
        if hdist.rank() != 0:
            return None
        return AuditEvidence(
            per_rank=[RankEvidence.model_validate(item) for item in everyone],
            param_checks=self.param_checks,
            param_names=self.param_names(),
            param_drift=self.param_drift,
            plan_samples=plan_samples,
            sharded=sharded,
            replay=self.replay,
            scaler_overflows=self.scaler_overflows,
        )

    def param_names(self) -> list[str]:
        """The hashed tensors' names, in the hash tables' column order."""
        return [name for name, _ in self.model.named_parameters()]

    def checked_at(self, step: int) -> bool:
        """Whether a parameter check ran after ``step`` (its table is the last one recorded)."""
        if self.sharded is not None:
            checks = self.sharded.evidence.optimizer_checks
            return bool(checks) and checks[-1][0] == step
        return bool(self.param_checks) and self.param_checks[-1][0] == step

    def _check_params(self, step: int) -> None:
        import torch

        if self.sharded is not None:
            self.sharded.check_optimizer(step)
            return

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
        local_values = parameter.detach().to(torch.float64)
        mean = local_values.clone()
        hdist.all_reduce_async(mean).wait()
        mean /= world
        gap_sq += (local_values - mean).square().sum()
        mean_sq += mean.square().sum()
    gaps = hdist.all_gather_rows(gap_sq.reshape(1)).reshape(-1)
    scale = float(mean_sq.sqrt()) or 1.0
    return [float(g) ** 0.5 / scale for g in gaps.cpu().tolist()]


# --------------------------------------------------------------------------- hashing


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def rng_state_hashes(device: Any = None) -> dict[str, str]:
    """Short hashes of this process's python, numpy, torch CPU (and the device's CUDA) RNG states."""
    import numpy as np
    import torch

    name, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    assert not isinstance(keys, str)  # the legacy tuple form: (name, uint32 key array, ...)
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
    n_samples: int,
    world_size: int,
    seed: int,
    shuffle: bool,
    micro_batch_size: int,
    epochs: int,
    drop_last: bool = True,
) -> dict[tuple[int, int], list[int]]:
    """``(rank, epoch) -> sample ids`` that a correct run reads: torch's own DistributedSampler with the
    shared seed and ``set_epoch(epoch)`` each epoch, cut to whole micro-batches (1: no cut)."""
    from torch.utils.data.distributed import DistributedSampler

    plan = {}
    for rank in range(world_size):
        sampler: Any = DistributedSampler(
            range(n_samples),  # type: ignore[arg-type]  # any sized sequence works; the stub wants a Dataset
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            order = list(sampler)
            plan[(rank, epoch)] = order[: len(order) // micro_batch_size * micro_batch_size]
    return plan

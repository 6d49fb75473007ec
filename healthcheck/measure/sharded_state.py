"""Evidence for the ``sharded_state`` audit: what FSDP2 ranks must agree on when no parameter is replicated.

Under FSDP2 each parameter shard has one owner, so "every rank holds the same parameters" (DDP's
parameter-equality audit) does not exist. What must still hold on every rank:

* the same sharding plan: parameter names, global shapes, dtypes and placements;
* the same full parameters when they are all-gathered, after sharding and after the last step (a cheap
  on-device bit hash per tensor, of ``full_tensor()``: one all-gather of the model at each end);
* the same optimizer: learning rate and the other hyperparameters of every parameter group, and the step
  count, on every check step. A rank that steps its shards with another learning rate corrupts the one
  model everyone trains, and nothing else in the run would notice;
* under HSDP (a replicate x shard mesh), the same shard on every replica: ranks with the same coordinate on the
  shard dimension hold the same slices, compared bit for bit after the last step (:func:`replica_facts`). The
  all-gathered parameters only tell that one shard group differs from another; this names the ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

from healthcheck.artifacts import ShardedEvidence
from healthcheck.measure import distributed as hdist
from healthcheck.measure.bit_hash import tensor_bit_hash

#: Optimizer hyperparameters compared across ranks (whichever a parameter group has).
OPTIMIZER_FIELDS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "maximize")


def sharding_plan(model: Any) -> list[str]:
    """One line per parameter: name, global shape, dtype and placements (same on every rank when healthy)."""
    rows = []
    for name, param in model.named_parameters():
        placements = getattr(param, "placements", None)
        rows.append(f"{name} {tuple(param.shape)} {param.dtype} {placements if placements is not None else 'replicated'}")
    return rows


def full_parameter_hashes(model: Any) -> list[int]:
    """Collective: the bit hash of every full (all-gathered) parameter, in ``named_parameters`` order."""
    import torch

    hashes = []
    for _, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        hashes.append(tensor_bit_hash(full.detach()))
    if not hashes:
        return []
    return [int(h) for h in torch.stack(hashes).cpu().tolist()]


def replica_facts(model: Any) -> tuple[int, list[int]]:
    """HSDP: this rank's coordinate on the mesh's shard dimension (the last: FSDP2 shards over it and replicates
    over the first) and the bit hash of its own slice of every parameter; ``(-1, [])`` on a one-dimensional mesh."""
    import torch

    params = [param for _, param in model.named_parameters()]
    mesh = getattr(params[0], "device_mesh", None) if params else None
    if mesh is None or mesh.ndim < 2:
        return -1, []
    coordinate = mesh.get_coordinate()
    hashes = [tensor_bit_hash((param.to_local() if hasattr(param, "to_local") else param).detach()) for param in params]
    return int(coordinate[-1]), [int(h) for h in torch.stack(hashes).cpu().tolist()]


def unsharded_weight_hashes(module: Any) -> list[tuple[str, int]]:
    """``(name, bit hash)`` of every parameter of ``module`` that ``fully_shard`` has not sliced yet (no DTensor).

    ``fully_shard`` keeps each rank's own slice of the weights it finds, without a broadcast (DDP would copy
    rank 0's), so a rank that built or loaded other weights silently contributes its slices. Hashing
    before sharding is the one moment those weights can still be compared.
    """
    return [
        (name, int(tensor_bit_hash(param.detach())))
        for name, param in module.named_parameters()
        if not hasattr(param, "placements")
    ]


def optimizer_facts(optimizer: Any) -> dict[str, Any]:
    """The optimizer's hyperparameters per parameter group and its step count (plain JSON values)."""
    groups = []
    for group in optimizer.param_groups:
        facts: dict[str, Any] = {}
        for field in OPTIMIZER_FIELDS:
            if field in group:
                value = group[field]
                facts[field] = list(value) if isinstance(value, tuple) else (float(value) if isinstance(value, float) else value)
        groups.append(facts)
    steps = {int(float(state["step"])) for state in optimizer.state.values() if "step" in state}
    return {"param_groups": groups, "step": max(steps) if steps else 0, "tensors_with_state": len(optimizer.state)}


class ShardedStateRecorder:
    """Collects one rank's sharded-state evidence; every method is a collective (all ranks call it alike)."""

    def __init__(self, model: Any, pre_shard: Sequence[tuple[str, int]] = ()):
        self.model = model
        self.optimizer: Optional[Any] = None
        plan = sharding_plan(model)
        digest = hashlib.sha256("\n".join(plan).encode()).hexdigest()[:16]
        mine = {"plan": digest, "tensors": len(plan), "hashes": full_parameter_hashes(model), "pre": [h for _, h in pre_shard]}
        everyone = hdist.all_gather_objects(mine)
        self.evidence = ShardedEvidence(
            plans=[e["plan"] for e in everyone],
            plan_tensors=everyone[0]["tensors"],
            pre_shard_names=[name for name, _ in pre_shard],
            pre_shard_hashes=[e["pre"] for e in everyone],
            start_hashes=[e["hashes"] for e in everyone],
        )

    def check_optimizer(self, step: int) -> None:
        if self.optimizer is None:
            return
        facts = hdist.all_gather_objects(optimizer_facts(self.optimizer))
        self.evidence.optimizer_checks.append((step, facts))

    def finish(self) -> ShardedEvidence:
        mine = {"full": full_parameter_hashes(self.model), "replica": replica_facts(self.model)}
        everyone = hdist.all_gather_objects(mine)
        self.evidence.end_hashes = [list(e["full"]) for e in everyone]
        if everyone[0]["replica"][0] >= 0:
            self.evidence.shard_index = [e["replica"][0] for e in everyone]
            self.evidence.end_local_hashes = [list(e["replica"][1]) for e in everyone]
        return self.evidence

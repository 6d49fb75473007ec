"""The exact audits: pure analysis of the evidence the workers gathered, one function per audit.

Nothing here touches a process group, a model or torch. The two statistical audits (stragglers,
rank_outliers) live in :mod:`healthcheck.rank_outliers`. :mod:`healthcheck.audits` collects the
evidence on the workers (samples consumed, seeds and RNG hashes, parameter hashes) and reads the
step files; each function below turns its part into one :class:`AuditOutcome`, which ``result.json``
stores under ``audits[name]`` and :class:`healthcheck.verdict.AuditCheck` turns into ``audit.<name>``.

Every outcome carries a ``signature``: a seed-independent description of the observed state (a rank
grouping such as ``"seed 0|1-7"``, or ``"disjoint"``). An audit passes when it meets the ideal
expectation, or when the baseline approved exactly that signature (see ``Baseline.audits``)::

    >>> seed_audit([{"rank": r, "seed": 1041 if r == 0 else 42} for r in range(8)]).message
    'ranks 1-7 share seed 42; rank 0 has 1041'
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Hashable, Iterable, Mapping, Sequence

#: Field order of the seed audit: the first field on which ranks differ is the one the message names.
SEED_FIELDS = ("seed", "sampler_seed", "torch_seed", "python_seed", "numpy_seed")


@dataclasses.dataclass(frozen=True)
class AuditOutcome:
    """One audit's result: ideal or not, one sentence naming ranks, and a seed-independent signature."""

    passed: bool
    message: str
    signature: str
    ranks: tuple[int, ...] = ()
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_entry(self) -> dict[str, Any]:
        """The ``result.audits[name]`` record (``details`` keys are flattened in beside the fixed ones)."""
        return {**self.details, "passed": self.passed, "message": self.message, "ranks": list(self.ranks),
                "signature": self.signature}


# --------------------------------------------------------------------------- rank grouping


def rank_span(ranks: Iterable[int]) -> str:
    """Compact rank list: runs of consecutive ranks become ``a-b``.

    >>> rank_span([0, 1, 2, 5, 7, 6])
    '0-2,5-7'
    """
    ordered = sorted(set(ranks))
    parts, start = [], None
    for index, rank in enumerate(ordered):
        if start is None:
            start = rank
        if index + 1 == len(ordered) or ordered[index + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``.

    >>> ranks_phrase([3]), ranks_phrase([0, 1, 2, 5])
    ('rank 3', 'ranks 0-2, 5')
    """
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_span(ranks).replace(',', ', ')}"


def group_ranks(values: Sequence[Hashable]) -> list[list[int]]:
    """Ranks grouped by equal value: largest group first, ties broken by the lowest rank.

    >>> group_ranks(["a", "b", "b", "a", "b"])
    [[1, 2, 4], [0, 3]]
    """
    groups: dict[Hashable, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.values(), key=lambda g: (-len(g), g[0]))


def partition_signature(groups: Sequence[Sequence[int]]) -> str:
    """Seed-independent name of a grouping: the groups' rank spans, ordered by lowest rank.

    >>> partition_signature([[1, 2, 3], [0]])
    '0|1-3'
    """
    return "|".join(rank_span(g) for g in sorted(groups, key=min))


def odd_ones_out(groups: Sequence[Sequence[int]]) -> list[int]:
    """Ranks outside a strict majority group; every rank when no group is strictly largest.

    >>> odd_ones_out([[1, 2, 3], [0]]), odd_ones_out([[0], [1]])
    ([0], [0, 1])
    """
    if len(groups) < 2:
        return []
    if len(groups[0]) > len(groups[1]):
        return sorted(r for g in groups[1:] for r in g)
    return sorted(r for g in groups for r in g)


def _grouping_text(groups: Sequence[Sequence[int]], value_of, noun: str) -> str:
    """``ranks 1-7 share seed 42; rank 0 has 1041`` (or ``ranks 0-7 each have a different seed``)."""
    if all(len(g) == 1 for g in groups):
        values = ", ".join(str(value_of(g[0])) for g in sorted(groups))
        return f"ranks {rank_span(r for g in groups for r in g)} each have a different {noun} ({values})"
    parts = []
    for group in groups:
        value = value_of(group[0])
        if len(group) > 1:
            parts.append(f"{ranks_phrase(group)} share {noun} {value}")
        else:
            parts.append(f"{ranks_phrase(group)} has {value}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- 1. data shards


def flatten_epochs(batches: Sequence[tuple[int, Sequence[int]]]) -> dict[int, list[int]]:
    """One rank's consumed micro-batches ``[(epoch, sample_ids), ...]`` as ``{epoch: ids in order}``.

    >>> flatten_epochs([(0, [3, 1]), (0, [2]), (1, [1])])
    {0: [3, 1, 2], 1: [1]}
    """
    out: dict[int, list[int]] = {}
    for epoch, ids in batches:
        out.setdefault(int(epoch), []).extend(int(i) for i in ids)
    return out


def first_departure(consumed: Sequence[int], planned: Sequence[int]) -> int | None:
    """Index of the first sample that differs from the plan (or runs past it); None when it follows it.

    >>> first_departure([5, 2, 9], [5, 2, 7, 1]), first_departure([5, 2], [5, 2, 7])
    (2, None)
    """
    for index, sample in enumerate(consumed):
        if index >= len(planned) or planned[index] != sample:
            return index
    return None


def shard_overlap(per_rank: Sequence[Mapping[int, Sequence[int]]]) -> list[int]:
    """Per rank, how many of its samples some other rank also consumed in the same epoch.

    >>> shard_overlap([{0: [1, 2]}, {0: [2, 3]}, {0: [4, 5]}])
    [1, 1, 0]
    """
    shared = [0] * len(per_rank)
    epochs = {e for rank in per_rank for e in rank}
    for epoch in epochs:
        counts = Counter(i for rank in per_rank for i in set(rank.get(epoch, ())))
        for r, rank in enumerate(per_rank):
            shared[r] += sum(1 for i in set(rank.get(epoch, ())) if counts[i] > 1)
    return shared


def plan_coverage(per_rank: Sequence[Mapping[int, Sequence[int]]], plan: Mapping[tuple[int, int], Sequence[int]]) -> float:
    """Fraction of the planned (epoch, sample) pairs, up to how far each rank got, that some rank consumed.

    >>> plan_coverage([{0: [1, 1]}, {0: [1, 1]}], {(0, 0): [1, 2], (1, 0): [3, 4]})
    0.25
    """
    planned, seen = set(), set()
    for r, rank in enumerate(per_rank):
        for epoch, ids in rank.items():
            planned.update((epoch, i) for i in plan.get((r, epoch), ())[: len(ids)])
            seen.update((epoch, i) for i in ids)
    return len(planned & seen) / len(planned) if planned else 1.0


def data_shard_audit(
    consumed: Sequence[Sequence[tuple[int, Sequence[int]]]], plan: Mapping[tuple[int, int], Sequence[int]]
) -> AuditOutcome:
    """Did the ranks read disjoint shards in the planned order, epoch after epoch?

    Args:
        consumed: Per rank, the micro-batches it trained on, in order, as ``(epoch, sample_ids)``.
        plan: ``(rank, epoch) -> sample ids`` of the shared-seed DistributedSampler with ``set_epoch``.
    """
    per_rank = [flatten_epochs(batches) for batches in consumed]
    world = len(per_rank)
    totals = [sum(len(ids) for ids in rank.values()) for rank in per_rank]
    shared = shard_overlap(per_rank)
    coverage = plan_coverage(per_rank, plan)
    departures = {r: dep for r in range(world) if (dep := _rank_departure(per_rank[r], r, plan)) is not None}
    repeats = {r: eps for r in range(world) if (eps := _epochs_repeating_epoch0(per_rank[r], r, plan))}
    epochs = sorted({e for rank in per_rank for e in rank})
    details = {"samples_per_rank": totals, "shared_per_rank": shared, "coverage": round(coverage, 6),
               "epochs": len(epochs), "departures": {str(r): list(d) for r, d in departures.items()}}
    everyone = list(range(world))
    worst = max(everyone, key=lambda r: (shared[r], -r))
    overlap_text = (f"{ranks_phrase([worst])} shares {shared[worst]} of its {totals[worst]} samples with other ranks; "
                    f"expected 0")
    if world > 1 and all(per_rank[r] == per_rank[0] for r in everyone):
        return AuditOutcome(False, f"every rank read the same samples: {ranks_phrase(everyone)} consumed identical "
                            f"sequences ({overlap_text}; the effective batch collapsed to one rank's)",
                            "identical", tuple(everyone), details)
    if repeats:
        repeated = sorted({e for eps in repeats.values() for e in eps})
        label = f"epoch {repeated[0]}" if len(repeated) == 1 else f"epochs {rank_span(repeated)}"
        verb = "repeats" if len(repeated) == 1 else "repeat"
        return AuditOutcome(False, f"missing set_epoch: {label} {verb} epoch 0's order on {ranks_phrase(repeats)} "
                            f"(the sampler was never told the epoch); coverage of the planned order "
                            f"{coverage:.0%}", f"repeats-epoch-0 {rank_span(repeats)}", tuple(sorted(repeats)), details)
    if departures:
        first = min(departures)
        epoch, index = departures[first]
        where = "from its first sample" if (epoch, index) == (0, 0) else f"at epoch {epoch}, sample {index}"
        who = ranks_phrase(departures)
        verb = "departs" if len(departures) == 1 else "depart"
        message = (f"{who} sampler order {verb} from the plan (the shared-seed DistributedSampler order) "
                   f"{where}: a rank-specific sampler seed or shard; {overlap_text}; coverage of the planned order "
                   f"{coverage:.0%}")
        if len(departures) == 1:
            message = message.replace(f"{who} sampler", f"{who}'s sampler", 1)
        return AuditOutcome(False, message, f"departs {rank_span(departures)}", tuple(sorted(departures)), details)
    if any(shared):
        overlapping = [r for r in everyone if shared[r]]
        return AuditOutcome(False, f"{overlap_text}; coverage of the planned order {coverage:.0%}",
                            f"overlap {rank_span(overlapping)}", tuple(overlapping), details)
    if coverage < 1:
        return AuditOutcome(False, f"the ranks covered {coverage:.1%} of the planned samples; expected 100%",
                            "partial-coverage", (), details)
    return AuditOutcome(True, f"{ranks_phrase(everyone)} read disjoint shards in the planned order "
                        f"({sum(totals)} samples over {len(epochs)} epoch{'s' if len(epochs) != 1 else ''}, "
                        f"100% coverage)", "disjoint", (), details)


def _rank_departure(epochs: Mapping[int, Sequence[int]], rank: int, plan) -> tuple[int, int] | None:
    for epoch in sorted(epochs):
        index = first_departure(epochs[epoch], plan.get((rank, epoch), ()))
        if index is not None:
            return epoch, index
    return None


def _epochs_repeating_epoch0(epochs: Mapping[int, Sequence[int]], rank: int, plan) -> list[int]:
    """Epochs > 0 whose order is epoch 0's planned order where the plan differs (set_epoch never called)."""
    first = plan.get((rank, 0), ())
    out = []
    for epoch, ids in sorted(epochs.items()):
        planned = plan.get((rank, epoch), ())
        if epoch > 0 and ids and list(ids) == list(first[: len(ids)]) and list(planned[: len(ids)]) != list(ids):
            out.append(epoch)
    return out


# --------------------------------------------------------------------------- 2. seeds and RNG


def seed_audit(ranks: Sequence[Mapping[str, Any]]) -> AuditOutcome:
    """Do all ranks share their seeds and the RNG states they start training with?

    Each rank's mapping holds the seeds in :data:`SEED_FIELDS` (any subset) and optionally
    ``rng_start`` (generator -> state hash before the first step) and ``rng_after_first_step``.
    The torch/cuda states *after* the first step are reported, not judged: dropout draws as many
    numbers as the padded batch has elements, and that shape differs between ranks by design.
    python and numpy states after the first step are judged (training draws nothing from them).
    """
    fields = [f for f in SEED_FIELDS if all(f in r for r in ranks)]
    world = len(ranks)
    everyone = list(range(world))
    details: dict[str, Any] = {f: [r[f] for r in ranks] for f in fields}
    for f in fields:
        groups = group_ranks([r[f] for r in ranks])
        if len(groups) > 1:
            noun = f.replace("_", " ")
            text = _grouping_text(groups, lambda rank, f=f: ranks[rank][f], noun)
            return AuditOutcome(False, text, f"{f} {partition_signature(groups)}", tuple(odd_ones_out(groups)), details)
    for when, generators in (("rng_start", None), ("rng_after_first_step", ("python", "numpy"))):
        for generator in sorted({g for r in ranks for g in r.get(when, {})}):
            if generators is not None and generator not in generators:
                continue
            groups = group_ranks([r.get(when, {}).get(generator) for r in ranks])
            if len(groups) > 1:
                moment = "after seeding" if when == "rng_start" else "after the first step"
                shared = f"{ranks_phrase(everyone)} share seed {ranks[0]['seed']}, but" if "seed" in fields else ""
                odd = odd_ones_out(groups)
                text = (f"{shared} the {generator} RNG state {moment} differs on {ranks_phrase(odd)} "
                        f"(groups {partition_signature(groups)})").strip()
                return AuditOutcome(False, text, f"{generator} {partition_signature(groups)}", tuple(odd), details)
    seed = f"seed {ranks[0]['seed']}" if "seed" in fields and ranks else "their seeds"
    return AuditOutcome(True, f"{ranks_phrase(everyone)} share {seed} and identical RNG states after seeding",
                        "shared", (), details)


# --------------------------------------------------------------------------- 3. parameter equality


def param_equality_audit(
    checks: Sequence[tuple[int, Sequence[Sequence[int]]]],
    names: Sequence[str],
    drift: Sequence[tuple[int, Sequence[float]]] = (),
) -> AuditOutcome:
    """Are the parameters bit-identical across ranks at every check step?

    Args:
        checks: ``(step, hashes)`` per check, ``hashes[rank][tensor]`` an integer hash of that tensor's bits.
        names: Parameter tensor names, in the hashes' column order.
        drift: ``(step, distances)`` for the checks whose hashes differed, ``distances[rank]`` the rank's
            relative distance from the rank-averaged parameters; it says how far and how fast they part.
    """
    if not checks:
        return AuditOutcome(True, "no parameter check ran", "unchecked", ())
    world = len(checks[0][1])
    steps = [step for step, _ in checks]
    mismatched = [(step, rows) for step, rows in checks if len({tuple(r) for r in rows}) > 1]
    details: dict[str, Any] = {"check_steps": steps, "tensors": len(names), "mismatched_steps": [s for s, _ in mismatched]}
    if not mismatched:
        return AuditOutcome(True, f"parameters are bit-identical on {ranks_phrase(range(world))} at all {len(steps)} "
                            f"checks (steps {_steps_text(steps)}; {len(names)} tensors)", "equal", (), details)
    step, rows = mismatched[0]
    groups = group_ranks([tuple(r) for r in rows])
    odd = odd_ones_out(groups)
    reference = rows[groups[0][0]]
    column = min(t for r in odd for t in range(len(reference)) if rows[r][t] != reference[t])
    tensor = names[column] if column < len(names) else f"#{column}"
    details.update(first_step=step, first_tensor=tensor)
    if len(groups[0]) > len(groups[1]):
        lead = f"rank {odd[0]}'s parameters differ" if len(odd) == 1 else f"the parameters of {ranks_phrase(odd)} differ"
        lead += f" from the majority ({ranks_phrase(groups[0])})"
    else:
        lead = f"parameters split the ranks into {len(groups)} groups ({partition_signature(groups)}) with no majority"
    message = (f"{lead} after step {step} (first differing tensor: {tensor}; {len(mismatched)}/{len(steps)} checks "
               f"differ){_drift_text(drift, odd, details)}; DDP averages gradients, not parameters, so a rank-local "
               f"optimizer or learning-rate difference is never corrected")
    return AuditOutcome(False, message, partition_signature(groups), tuple(odd), details)


def _drift_text(drift: Sequence[tuple[int, Sequence[float]]], odd: Sequence[int], details: dict[str, Any]) -> str:
    """``; rank 3's distance from the mean parameters grew from 1.0e-05 (step 0) to 2.0e-03 (step 59)``."""
    if not drift:
        return ""
    details["drift"] = [{"step": int(step), "relative_distance": [float(d) for d in distances]} for step, distances in drift]
    if not odd:
        return ""
    worst = max(odd, key=lambda r: drift[-1][1][r])
    (first_step, first), (last_step, last) = drift[0], drift[-1]
    if len(drift) == 1:
        return f"; rank {worst} is {last[worst]:.1e} of the parameters' norm from the mean at step {last_step}"
    verb = "grew" if last[worst] > first[worst] else "went"
    return (f"; rank {worst}'s distance from the mean parameters {verb} from {first[worst]:.1e} (step {first_step}) "
            f"to {last[worst]:.1e} (step {last_step}) of their norm")


def _steps_text(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


# --------------------------------------------------------------------------- 4. environment


#: Variables that differ between ranks by design (one device per rank), so they are not compared.
PER_RANK_ENV = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES", "ASCEND_DEVICE_ID")
UNSET = "<unset>"


def environment_audit(ranks: Sequence[Mapping[str, Any]]) -> AuditOutcome:
    """Do the ranks run the same software, devices, precision, determinism flags and comm variables?

    Each mapping has ``versions`` (dict), ``device_name``, ``precision`` and ``env`` (dict) as in
    :class:`healthcheck.artifacts.RankInfo`, plus any further scalar fields to compare.
    """
    table = [environment_fields(r) for r in ranks]
    keys = sorted({k for row in table for k in row})
    differing = []
    for key in keys:
        values = [row.get(key, UNSET) for row in table]
        groups = group_ranks(values)
        if len(groups) > 1:
            differing.append((key, groups, values))
    everyone = range(len(ranks))
    if not differing:
        first = table[0] if table else {}
        comm = sum(1 for k in first if k.startswith("env."))
        summary = ", ".join(f"{k.removeprefix('versions.')} {first[k]}" for k in ("versions.python", "versions.torch",
                                                                                   "versions.transformers") if k in first)
        return AuditOutcome(True, f"{ranks_phrase(everyone)} agree on {summary}, device {first.get('device_name', '?')}, "
                            f"precision {first.get('precision', '?')} and {comm} NCCL_/HCCL_/TORCH_ variables",
                            "uniform", (), {"compared": len(keys)})
    parts, blamed = [], set()
    for key, groups, values in differing:
        name = key.removeprefix("versions.")
        parts.append(f"{name} differs: " + "; ".join(f"{ranks_phrase(g)} {values[g[0]]}" for g in groups))
        blamed.update(odd_ones_out(groups))
    signature = "; ".join(f"{key} {partition_signature(groups)}" for key, groups, _ in differing)
    return AuditOutcome(False, "; ".join(parts), signature, tuple(sorted(blamed)),
                        {"differing": [key for key, _, _ in differing]})


def environment_fields(rank: Mapping[str, Any]) -> dict[str, str]:
    """One rank's comparable fields, flattened: ``versions.torch``, ``env.NCCL_ALGO``, ``precision``, ...

    >>> environment_fields({"versions": {"torch": "2.13"}, "env": {"NCCL_ALGO": "ring", "CUDA_VISIBLE_DEVICES": "3"},
    ...                     "precision": "bf16"})
    {'versions.torch': '2.13', 'env.NCCL_ALGO': 'ring', 'precision': 'bf16'}
    """
    out = {f"versions.{k}": str(v) for k, v in (rank.get("versions") or {}).items()}
    out.update({f"env.{k}": str(v) for k, v in (rank.get("env") or {}).items() if k not in PER_RANK_ENV})
    for key, value in rank.items():
        if key not in ("versions", "env") and isinstance(value, (str, int, float, bool)):
            out[key] = str(value)
    return out


# --------------------------------------------------------------------------- 5. non-finite


def nonfinite_audit(events: Sequence[Mapping[str, Any]], world_size: int) -> AuditOutcome:
    """Fail on the first NaN/Inf loss or local gradient of each rank (``result.nonfinite``)."""
    if not events:
        return AuditOutcome(True, f"losses and local gradients stayed finite on {ranks_phrase(range(world_size))} "
                            f"at every sampled step", "finite", ())
    ordered = sorted(events, key=lambda e: (e["step"], e["rank"]))
    parts = [f"rank {e['rank']}'s {e['what']} went NaN/Inf first at step {e['step']}" for e in ordered]
    ranks = sorted({e["rank"] for e in ordered})
    return AuditOutcome(False, "; ".join(parts) + " (the probe stopped there)", f"nonfinite {rank_span(ranks)}",
                        tuple(ranks), {"events": [dict(e) for e in ordered]})


# --------------------------------------------------------------------------- 6. reduction numerics


def reduction_audit(rows: Sequence[Mapping[str, Any]], world_size: int) -> AuditOutcome:
    """Is the all-reduced mean gradient the float64 mean of the local gradients, up to rounding?

    Each row is one checked step from ``aggregates.jsonl``: ``reduction_rel_error`` (relative L2
    error of the worst rank's reduced gradient against the float64 mean), ``reduction_bound_ratio``
    (that error over the worst case a correct sum in the bucket dtype can round to, so > 1 cannot be
    rounding) and ``reduction_worst_rank``. Steps where a local gradient was NaN/Inf carry None and
    are left to the non-finite audit.
    """
    checked = [r for r in rows if _finite(r.get("reduction_bound_ratio")) and _finite(r.get("reduction_rel_error"))]
    if not checked:
        return AuditOutcome(True, "reduction numerics not checked (metrics.reduction_check_every is 0 or no finite "
                            "check step)", "unchecked", ())
    worst = max(checked, key=lambda r: r["reduction_bound_ratio"])
    max_error = max(r["reduction_rel_error"] for r in checked)
    details = {"checked_steps": [r["step"] for r in checked], "max_rel_error": max_error,
               "max_bound_ratio": worst["reduction_bound_ratio"]}
    if worst["reduction_bound_ratio"] <= 1:
        return AuditOutcome(True, f"the all-reduced gradient matches the float64 mean of the local gradients on "
                            f"{ranks_phrase(range(world_size))} within rounding: max relative error {max_error:.2g} over "
                            f"{len(checked)} checked steps, at most {worst['reduction_bound_ratio']:.2g} of the "
                            f"worst-case rounding bound", "within-bound", (), details)
    rank = worst.get("reduction_worst_rank")
    ranks = (int(rank),) if isinstance(rank, (int, float)) and math.isfinite(rank) else ()
    who = f" on rank {ranks[0]}" if ranks else ""
    return AuditOutcome(False, f"at step {worst['step']} the all-reduced gradient{who} is off the float64 mean of the "
                        f"local gradients by {worst['reduction_rel_error']:.2g} (relative), "
                        f"{worst['reduction_bound_ratio']:.3g}x the worst case of rounding a correct sum over "
                        f"{world_size} ranks: a lossy reduction (e.g. bf16 compression) or a corrupted one",
                        "exceeds-bound", ranks, details)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)

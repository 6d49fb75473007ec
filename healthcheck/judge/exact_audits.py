"""The exact audits other than the data shards: seeds and RNG states, parameter equality, environment,
non-finite values and reduction numerics. One pure function per audit, each returning an
:class:`~healthcheck.judge.audit_outcome.AuditOutcome`.

Nothing here touches a process group, a model or torch. The statistical audits (stragglers,
rank_outliers) live in :mod:`healthcheck.judge.rank_outliers`, the shard audit in
:mod:`healthcheck.judge.shard_audit`; :mod:`healthcheck.judge.assemble` feeds them all::

    >>> seed_audit([{"rank": r, "seed": 1041 if r == 0 else 42} for r in range(8)]).message
    'ranks 1-7 share seed 42; rank 0 has 1041'
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from healthcheck.finite import is_finite_number
from healthcheck.judge import comm_hooks
from healthcheck.judge.audit_outcome import (
    AuditOutcome,
    group_ranks,
    grouping_text,
    not_measured,
    odd_ones_out,
    partition_signature,
    rank_span,
    ranks_phrase,
)
from healthcheck.measure.environment import compared_variable
from healthcheck.measure.precision import FP16_SMALLEST_NORMAL

#: Field order of the seed audit: the first field on which ranks differ is the one the message names.
SEED_FIELDS = ("seed", "sampler_seed", "torch_seed", "python_seed", "numpy_seed")
#: The seed field that each generator's state follows from.
GENERATOR_SEED = {"torch": "torch_seed", "cuda": "torch_seed", "python": "python_seed", "numpy": "numpy_seed"}


# --------------------------------------------------------------------------- 2. seeds and RNG


def seed_audit(
    ranks: Sequence[Mapping[str, Any]], entropy_seeded: Sequence[str] = (), seeded_per_rank: Optional[Sequence[str]] = None
) -> AuditOutcome:
    """Do all ranks share their seeds and the RNG states they start training with?

    Each rank's mapping holds the seeds in :data:`SEED_FIELDS` (any subset) and optionally
    ``rng_start`` (generator -> state hash before the first step) and ``rng_after_first_step``.
    The torch/cuda states *after* the first step are reported, not judged: dropout draws as many
    numbers as the padded batch has elements, and that shape differs between ranks by design.
    python and numpy states after the first step are judged (training draws nothing from them).

    A generator's state that differs at the start while every rank's seed for it agrees (:data:`GENERATOR_SEED`)
    is reported, not judged: that rank drew another count of numbers since seeding (a data-loader iterator, a
    sanity loss or an example picked to log, on rank 0 alone), which changes what it draws later (its dropout
    masks), no more than any two ranks' batches already differ. Under DDP the parameters it may have initialised
    are broadcast from rank 0. Its state after the first step then differs too and is not judged either. A rank
    with another seed still fails; so does a python or numpy state whose seed is not known (a script whose
    seeding healthcheck did not see), as no state tells a reseed from an extra draw.

    ``entropy_seeded`` names generators that start from OS entropy unless the code seeds them
    (python's and numpy's, in a script healthcheck did not seed). When their states differ on *every*
    rank, the script never seeded them: that is reported, not judged. Some ranks sharing a state
    while others differ still fails: a rank that reseeded. Likewise the seeds of ``seeded_per_rank`` (by default
    ``entropy_seeded``): a seed that differs on every rank is a script seeding per rank on purpose (its own
    augmentation per rank; nanoGPT's ``torch.manual_seed(1337 + ddp_rank)``, which draws each rank's batches), reported,
    not judged, with the states that follow from it. Two ranks sharing a seed there still fail: one took the other's.

        >>> seed_audit([{"rng_start": {"numpy": str(r)}} for r in range(4)], entropy_seeded=("numpy",)).passed
        True
        >>> seed_audit([{"rng_start": {"numpy": "a" if r != 2 else "b"}} for r in range(4)], ("numpy",)).ranks
        (2,)
    """
    fields = [f for f in SEED_FIELDS if all(r.get(f) is not None for r in ranks)]
    if not fields and not any(r.get("rng_start") for r in ranks):
        return not_measured("no seed or RNG state was observed on any rank (no training forward before the first step)")
    world = len(ranks)
    everyone = list(range(world))
    details: dict[str, Any] = {f: [r[f] for r in ranks] for f in fields}
    per_rank_ok = entropy_seeded if seeded_per_rank is None else seeded_per_rank
    for f in fields:
        groups = group_ranks([r[f] for r in ranks])
        generator = f.removesuffix("_seed")
        if generator in per_rank_ok and len(groups) == world and world > 1:
            details.setdefault("seeded_per_rank", []).append(generator)
            continue
        if len(groups) > 1:
            noun = f.replace("_", " ")
            text = grouping_text(groups, lambda rank, f=f: ranks[rank][f], noun)
            named = odd_ones_out(groups)
            if generator in per_rank_ok and 2 * len(groups[0]) <= world:  # no shared seed is the norm: who shares broke it
                named = sorted(r for g in groups if len(g) > 1 for r in g)
            return AuditOutcome(False, text, f"{f} {partition_signature(groups)}", tuple(named), details)
    drawn_apart: set[str] = set()
    for when, generators in (("rng_start", None), ("rng_after_first_step", ("python", "numpy"))):
        for generator in sorted({g for r in ranks for g in r.get(when, {})}):
            if generators is not None and generator not in generators:
                continue
            seeded_by = GENERATOR_SEED.get(generator, generator).removesuffix("_seed")  # cuda's state follows torch's seed
            if generator in drawn_apart or seeded_by in details.get("seeded_per_rank", ()):  # reported already
                continue
            groups = group_ranks([r.get(when, {}).get(generator) for r in ranks])
            if generator in entropy_seeded and len(groups) == world and world > 1:
                details.setdefault("unseeded", []).append(generator)
                continue
            if len(groups) > 1 and when == "rng_start" and GENERATOR_SEED.get(generator) in fields:
                drawn_apart.add(generator)
                details.setdefault("drawn_apart", []).append(f"{generator} {partition_signature(groups)}")
                continue
            if len(groups) > 1:
                moment = "after seeding" if when == "rng_start" else "after the first step"
                shared = f"{ranks_phrase(everyone)} share seed {ranks[0]['seed']}, but" if "seed" in fields else ""
                odd = odd_ones_out(groups)
                text = (
                    f"{shared} the {generator} RNG state {moment} differs on {ranks_phrase(odd)} (groups {partition_signature(groups)})"
                ).strip()
                return AuditOutcome(False, text, f"{generator} {partition_signature(groups)}", tuple(odd), details)
    seed = f"seed {ranks[0]['seed']}" if "seed" in fields and ranks else "their seeds"
    unseeded = sorted(set(details.get("unseeded", ())))
    note = f" ({' and '.join(unseeded)} never seeded by the code: not judged)" if unseeded else ""
    if details.get("seeded_per_rank"):
        seed += f" other than {' and '.join(details['seeded_per_rank'])}'s (seeded per rank by the code: not judged)"
    states = " and identical RNG states after seeding"
    if details.get("drawn_apart"):
        states = (f"; their RNG states at the first training forward differ ({', '.join(details['drawn_apart'])}) under the "
                  "same seeds: a rank drew more numbers before it, which changes only what it draws later, such as its "
                  "dropout masks (not judged)")
    return AuditOutcome(True, f"{ranks_phrase(everyone)} share {seed}{states}{note}", "shared", (), details)


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
        return AuditOutcome(True, "not measured: no parameter check ran", "unchecked", (), measured=False)
    world = len(checks[0][1])
    steps = [step for step, _ in checks]
    mismatched = [(step, rows) for step, rows in checks if len({tuple(r) for r in rows}) > 1]
    details: dict[str, Any] = {"check_steps": steps, "tensors": len(names), "mismatched_steps": [s for s, _ in mismatched]}
    if not mismatched:
        return AuditOutcome(
            True,
            f"parameters are bit-identical on {ranks_phrase(range(world))} at all {len(steps)} "
            f"checks (steps {_steps_text(steps)}; {len(names)} tensors)",
            "equal",
            (),
            details,
        )
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
    message = (
        f"{lead} after step {step} (first differing tensor: {tensor}; {len(mismatched)}/{len(steps)} checks "
        f"differ){_drift_text(drift, odd, details)}; DDP averages gradients, not parameters, so a rank-local "
        f"optimizer or learning-rate difference is never corrected"
    )
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
    return (
        f"; rank {worst}'s distance from the mean parameters {verb} from {first[worst]:.1e} (step {first_step}) "
        f"to {last[worst]:.1e} (step {last_step}) of their norm"
    )


def _steps_text(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


# --------------------------------------------------------------------------- 4. environment


UNSET = "<unset>"
#: A rank's value that could not be read (too little evidence on that rank): left out of the comparison, so the
#: ranks that read it are compared among themselves.
NOT_MEASURED = "not measured"


def environment_audit(ranks: Sequence[Mapping[str, Any]]) -> AuditOutcome:
    """Do the ranks run the same software, devices, precision, determinism flags and comm variables?

    Each mapping has ``versions`` (dict), ``device_name``, ``precision`` and ``env`` (dict) as in
    :class:`healthcheck.artifacts.RankInfo`, plus any further scalar fields to compare. ``details["facts"]`` keeps
    rank 0's fields, so what was compared can be read back from ``result.json`` (its loss graph, its optimizer...).

    >>> outcome = environment_audit([{"precision": "fp32", "loss.graph": "LogSoftmax, NllLoss"}] * 2)
    >>> outcome.passed, outcome.details["facts"]["loss.graph"]
    (True, 'LogSoftmax, NllLoss')
    """
    table = [environment_fields(r) for r in ranks]
    keys = sorted({k for row in table for k in row})
    differing = differing_fields(table)
    everyone = range(len(ranks))
    if not differing:
        first = table[0] if table else {}
        comm = sum(1 for k in first if k.startswith("env."))
        summary = ", ".join(
            f"{k.removeprefix('versions.')} {first[k]}"
            for k in ("versions.python", "versions.torch", "versions.transformers")
            if k in first
        )
        return AuditOutcome(
            True,
            f"{ranks_phrase(everyone)} agree on {summary}, device {first.get('device_name', '?')}, "
            f"precision {first.get('precision', '?')} and {comm} NCCL_/HCCL_/TORCH_/CUBLAS_/compiler variables",
            "uniform",
            (),
            {"compared": len(keys), "facts": first},
        )
    blamed = sorted({rank for _, groups, _ in differing for rank in odd_ones_out(groups)})
    signature = "; ".join(f"{key} {partition_signature(groups)}" for key, groups, _ in differing)
    message = differences_phrase(differing, name=lambda key: key.removeprefix("versions."))
    details = {"differing": [key for key, _, _ in differing], "facts": table[0]}
    return AuditOutcome(False, message, signature, tuple(blamed), details)


def differing_fields(table: Sequence[Mapping[str, str]]) -> list[tuple[str, list[list[int]], list[str]]]:
    """The fields, in name order, on which the ranks' rows disagree: (field, ranks grouped by value, each rank's
    value); a field a row lacks reads ``<unset>``, and a rank whose value is :data:`NOT_MEASURED` is left out.

    >>> differing_fields([{"a": "1", "b": "x"}, {"a": "1", "b": "y"}, {"a": "1"}])
    [('b', [[0], [1], [2]], ['x', 'y', '<unset>'])]
    >>> differing_fields([{"a": "1"}, {"a": "not measured"}, {"a": "1"}])
    []
    """
    out = []
    for key in sorted({k for row in table for k in row}):
        values = [row.get(key, UNSET) for row in table]
        groups = [group for group in group_ranks(values) if values[group[0]] != NOT_MEASURED]
        if len(groups) > 1:
            out.append((key, groups, values))
    return out


def differences_phrase(differing: Sequence[tuple[str, list[list[int]], list[str]]], name: Callable[[str], str] = str) -> str:
    """``field differs: ranks 0-1, 3 value; rank 2 value`` for each of :func:`differing_fields`, joined by ``; ``.

    >>> differences_phrase(differing_fields([{"a": "1"}, {"a": "1"}, {"a": "2"}]))
    'a differs: ranks 0-1 1; rank 2 2'
    """
    return "; ".join(
        f"{name(key)} differs: " + "; ".join(f"{ranks_phrase(g)} {values[g[0]]}" for g in groups) for key, groups, values in differing
    )


def environment_fields(rank: Mapping[str, Any]) -> dict[str, str]:
    """One rank's comparable fields, flattened: ``versions.torch``, ``env.NCCL_ALGO``, ``precision``, ...

    >>> environment_fields({"versions": {"torch": "2.13"}, "env": {"NCCL_ALGO": "ring", "CUDA_VISIBLE_DEVICES": "3"},
    ...                     "precision": "bf16"})
    {'versions.torch': '2.13', 'env.NCCL_ALGO': 'ring', 'precision': 'bf16'}
    """
    out = {f"versions.{k}": str(v) for k, v in (rank.get("versions") or {}).items()}
    out.update({f"env.{k}": str(v) for k, v in (rank.get("env") or {}).items() if compared_variable(k)})
    for key, value in rank.items():
        if key not in ("versions", "env") and isinstance(value, (str, int, float, bool)):
            out[key] = str(value)
    return out


# --------------------------------------------------------------------------- 5. non-finite


def nonfinite_audit(events: Sequence[Mapping[str, Any]], world_size: int, sampled_steps: Optional[int] = None) -> AuditOutcome:
    """Fail on the first NaN/Inf loss or local gradient of each rank (``result.nonfinite``), naming the ranks where
    it came first: one rank's NaN reaches every rank through the step's all-reduce or reduce-scatter, so the ranks
    that follow it at a later step are only said. ``sampled_steps``: how many steps were measured (None: unknown).

    >>> nonfinite_audit([{"rank": 6, "step": 15, "what": "loss"}, *({"rank": r, "step": 16, "what": "loss"} for r in range(6))], 8).message
    "rank 6's loss went NaN/Inf first at step 15; ranks 0-5 followed at step 16 (the probe stopped there)"
    """
    if not events and sampled_steps == 0:
        return AuditOutcome(True, "not measured: no step was measured", "unchecked", (), measured=False)
    if not events:
        return AuditOutcome(
            True, f"losses and local gradients stayed finite on {ranks_phrase(range(world_size))} at every sampled step", "finite", ()
        )
    ordered = sorted(events, key=lambda e: (e["step"], e["rank"]))
    first = [e for e in ordered if e["step"] == ordered[0]["step"]]
    ranks = sorted({e["rank"] for e in first})
    parts = [f"rank {e['rank']}'s {e['what']} went NaN/Inf first at step {e['step']}" for e in first]
    named, followed = set(ranks), dict[int, set[int]]()
    for e in ordered:  # each other rank once, at its first step
        if e["rank"] not in named:
            named.add(e["rank"])
            followed.setdefault(e["step"], set()).add(e["rank"])
    parts += [f"{ranks_phrase(r)} followed at step {step}" for step, r in followed.items()]
    return AuditOutcome(False, "; ".join(parts) + " (the probe stopped there)", f"nonfinite {rank_span(ranks)}", tuple(ranks),
                        {"events": [dict(e) for e in ordered]})


# --------------------------------------------------------------------------- 6. reduction numerics


def _floor(row: Mapping[str, Any]) -> float:
    """A checked row's fp16 underflow floor (0 where the pass did not count it: FSDP2's, or an older run's)."""
    floor = row.get("reduction_fp16_floor")
    return float(floor) if floor is not None and is_finite_number(floor) else 0.0


def reduction_audit(
    rows: Sequence[Mapping[str, Any]],
    world_size: int,
    comm_hook: str = "",
    bucket_dtype: str = "float32",
    hook_state: str = "",
    collective: str = "all-reduced",
) -> AuditOutcome:
    """Is the all-reduced mean gradient the float64 mean of the local gradients, up to rounding?

    Each row is one checked step from ``aggregates.jsonl``: ``reduction_rel_error`` (relative L2
    error of the worst rank's reduced gradient against the float64 mean), ``reduction_bound_ratio``
    (that error over the worst case a correct sum in the bucket dtype can round to, so > 1 cannot be
    rounding) and ``reduction_worst_rank``. Steps where a local gradient was NaN/Inf carry None and
    are left to the non-finite audit. ``comm_hook``: the script's own DDP comm hook, the same on every rank ("" or
    "none" without one); a compressing one is judged against its wire's rounding, an approximating one only on the
    steps it still reduced exactly (:mod:`healthcheck.judge.comm_hooks`); ``bucket_dtype``: the ranks' parameter dtype;
    ``hook_state``: the type of the state the hook was registered with (``ddp.comm_hook_state``); ``collective``: how
    the gradient was reduced, for the message ("reduce-scattered" under FSDP2, whose shards the pass compares).
    """
    hook = "" if comm_hook in ("", "none", "?") else comm_hook
    checked = [r for r in rows if is_finite_number(r.get("reduction_bound_ratio")) and is_finite_number(r.get("reduction_rel_error"))]
    phase = ""
    if hook and comm_hooks.approximates(hook, hook_state):
        exact, phase = comm_hooks.exact_rows(checked, hook)
        if not exact:
            message = comm_hooks.approximating_message(hook, past_start=bool(checked) and "comm_hook_exact" in checked[0])
            return AuditOutcome(True, message, "approximating-hook", (), {"comm_hook": hook}, measured=False)
        checked = exact
    if not checked:
        return AuditOutcome(
            True,
            "not measured: reduction numerics not checked (metrics.reduction_check_every is 0 or no finite check step)",
            "unchecked",
            (),
            measured=False,
        )
    wire = comm_hooks.COMPRESSING.get(comm_hooks.short_name(hook))
    if wire is not None:
        checked = [{**r, "reduction_bound_ratio": comm_hooks.wire_bound_ratio(
            r["reduction_bound_ratio"], world_size, bucket_dtype, wire, _floor(r)), "underflow_share": comm_hooks.underflow_share(
            world_size, bucket_dtype, wire, _floor(r))} for r in checked]
    rounding = comm_hooks.wire_phrase(hook, wire) if wire else "rounding"
    worst = max(checked, key=lambda r: r["reduction_bound_ratio"])
    max_error = max(r["reduction_rel_error"] for r in checked)
    details = {"checked_steps": [r["step"] for r in checked], "max_rel_error": max_error, "max_bound_ratio": worst["reduction_bound_ratio"]}
    if hook:
        details.update({"comm_hook": hook, "wire": wire or "unknown"})
    share = worst.get("underflow_share", 0.0)
    if wire == "fp16":
        details["underflow_share"] = share
    underflow = (f"; fp16 underflow (gradient values under N x {FP16_SMALLEST_NORMAL:.2g} on a rank) makes up {share:.0%} of "
                 "that bound" if share >= 0.005 else "")
    if worst["reduction_bound_ratio"] <= 1:
        return AuditOutcome(
            True,
            f"the {collective} gradient matches the float64 mean of the local gradients on "
            f"{ranks_phrase(range(world_size))} within {rounding}: max relative error {max_error:.2g} over "
            f"{len(checked)} checked steps, at most {worst['reduction_bound_ratio']:.2g} of the "
            f"worst-case rounding bound{underflow}{phase}",
            "within-bound",
            (),
            details,
        )
    rank = worst.get("reduction_worst_rank")
    ranks = (int(rank),) if rank is not None and is_finite_number(rank) else ()
    who = f" on rank {ranks[0]}" if ranks else ""
    if wire == "fp16":
        cause = f"beyond the compression, underflow included: a corrupted reduction{underflow}"
    elif wire:
        cause = "beyond the compression: a corrupted reduction"
    else:
        cause = "a lossy reduction (e.g. bf16 compression) or a corrupted one"
        cause += f"; the script registers its own comm hook, {comm_hooks.short_name(hook)}" if hook else ""
    return AuditOutcome(
        False,
        f"at step {worst['step']} the {collective} gradient{who} is off the float64 mean of the "
        f"local gradients by {worst['reduction_rel_error']:.2g} (relative), "
        f"{worst['reduction_bound_ratio']:.3g}x the worst case of {rounding} of a correct sum over "
        f"{world_size} ranks: {cause}{phase}",
        "exceeds-bound",
        ranks,
        details,
    )

"""After the run: the workers' evidence and the step files become ``result.audits``, one entry per audit.

:func:`run_audits` computes the planned sampler order and hands everything to the pure audits
(:mod:`.shard_audit`, :mod:`.exact_audits`, :mod:`.rank_outliers`, :mod:`.spikes`); ``healthcheck.run.probe`` stores
the outcome in ``result.json``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence

from healthcheck.artifacts import (
    AGGREGATES_FILE,
    STEPS_FILE,
    NonFiniteEvent,
    RankEvidence,
    RankInfo,
    ReplayEvidence,
    SamplerPlan,
    ShardedEvidence,
    WorkerReport,
)
from healthcheck.config import ProbeConfig
from healthcheck.files import read_jsonl
from healthcheck.judge.audit_outcome import AuditOutcome, group_ranks, not_measured, odd_ones_out, partition_signature, ranks_phrase
from healthcheck.judge.content_shards import content_shard_audit
from healthcheck.judge.exact_audits import (
    SEED_FIELDS,
    differences_phrase,
    differing_fields,
    environment_audit,
    nonfinite_audit,
    param_equality_audit,
    reduction_audit,
    seed_audit,
)
from healthcheck.judge.learning_rate import first_split, learning_rate_audit
from healthcheck.judge.loss_weight import loss_weight_audit
from healthcheck.judge.param_causes import explained_by_settings
from healthcheck.judge.rank_outliers import OUTLIER_METRICS, rank_outlier_audit, straggler_audit
from healthcheck.judge.replay_audit import replay_audit
from healthcheck.judge.shard_audit import READ_ONCE, SampleGroups, batch_audit, data_shard_audit
from healthcheck.judge.sharded_audit import sharded_state_audit
from healthcheck.judge.spikes import SPIKE_METRICS, spike_audit
from healthcheck.judge.stale_gradients import stale_gradients_audit
from healthcheck.judge.zero_gradients import zero_gradients_audit
from healthcheck.measure.evidence import planned_shards


def run_audits(config: ProbeConfig, report: WorkerReport, run_dir: Path, nonfinite: Sequence[NonFiniteEvent]) -> dict[str, dict[str, Any]]:
    """Every audit's ``result.audits`` entry for a finished probe.

    Args:
        config: The global probe config (the shard plan follows *its* seed).
        report: Rank 0's :class:`~healthcheck.artifacts.WorkerReport` (ranks, world size, audit evidence).
        run_dir: The run directory (step files for the stragglers, reduction and non-finite audits).
        nonfinite: ``RunResult.nonfinite`` events.
    """
    world = report.world_size
    evidence = report.evidence
    outcomes: dict[str, AuditOutcome] = {}
    per_rank = evidence.per_rank
    if config.script is not None:
        outcomes["data_shards"] = script_shard_audit(per_rank)
    else:
        outcomes["data_shards"] = builtin_shard_audit(config, [e.consumed for e in per_rank], evidence.plan_samples, world)
    outcomes.update(parameter_outcomes(evidence.param_checks, evidence.param_names, evidence.param_drift, evidence.sharded))
    if report.ranks:
        outcomes["seeds"] = seeds_from_evidence(report.ranks, per_rank, script=config.script is not None)
        outcomes["environment"] = environment_from_evidence(report.ranks, per_rank)
    rows = list(read_jsonl(Path(run_dir) / STEPS_FILE))
    outcomes["param_equality"] = explained_by_learning_rate(outcomes["param_equality"], rows, world)
    outcomes["param_equality"] = explained_by_settings(outcomes["param_equality"], outcomes.get("environment"))
    events = [event.model_dump() for event in nonfinite]
    outcomes["nonfinite"] = nonfinite_audit(events, world, sampled_steps=len({row["step"] for row in rows}))
    metrics = config.metrics
    outcomes["stragglers"] = straggler_outcome(rows, world, metrics.straggler_factor, metrics.straggler_max_p)
    per_step: dict[int, dict[str, list[Any]]] = {}
    per_rank_columns = tuple(dict.fromkeys(OUTLIER_METRICS + SPIKE_METRICS))
    for row in rows:
        columns = per_step.setdefault(row["step"], {m: [None] * world for m in per_rank_columns})
        for metric in per_rank_columns:
            columns[metric][row["rank"]] = row.get(metric)
    outcomes["zero_gradients"] = zero_gradients_audit({step: columns["grad_norm"] for step, columns in per_step.items()})
    if config.script is not None:  # script mode's readings: the loss's weight, stale gradients, the learning rate
        keys = ("loss_weight", "loss_weight_u", "tokens", "grads_carried", "lr", "lr_groups")
        read = {key: _by_step(rows, key, world) for key in keys}
        outcomes["loss_weight"] = loss_weight_audit(read["loss_weight"], read["tokens"], rounding=read["loss_weight_u"])
        unseen = first_loss_problem(per_rank)
        if not outcomes["loss_weight"].measured and unseen:  # the reason is the loss's, not the weights'
            outcomes["loss_weight"] = not_measured(f"the loss itself was not measured ({unseen[1]})")
        outcomes["stale_gradients"] = stale_gradients_audit(read["grads_carried"])
        outcomes["learning_rate"] = learning_rate_audit(read["lr"], read["lr_groups"])
    outcomes["rank_outliers"] = rank_outlier_audit(per_step, metrics.rank_outlier_max_p)
    outcomes["spikes"] = spike_audit(per_step, metrics.spike_max_p)
    checked = [r for r in read_jsonl(Path(run_dir) / AGGREGATES_FILE) if "reduction_rel_error" in r]
    # A script's own comm hook, where every rank has the same one (else the environment audit names the rank).
    sharded = config.distributed.strategy == "fsdp" or any("fsdp.mp_policy" in e.extra for e in per_rank)
    outcomes["reduction_numerics"] = reduction_audit(
        checked, world, _common_fact(per_rank, "ddp.comm_hook", ""), _common_fact(per_rank, "model_dtype", "float32"),
        _common_fact(per_rank, "ddp.comm_hook_state", ""), _collective(sharded, _common_fact(per_rank, "fsdp.mesh", "")),
    )
    environment = outcomes.get("environment")
    differ = environment.ranks if environment is not None and not environment.passed else ()
    outcomes["replay"] = replay_outcome(config, evidence.replay, differ, hooks_difference(per_rank))
    stop = report.stopped_early
    if stop is not None and stop.check in outcomes and outcomes[stop.check].passed:
        # The failure that stopped the ranks left its audit nothing to read (the updates a GradScaler skipped write no
        # rows): the report said "nonfinite ok" beside "stopped early at step 2: nonfinite".
        outcomes[stop.check] = AuditOutcome(False, stop.message, "stopped", tuple(stop.ranks), {"stopped_at_step": stop.step})
    return {name: outcome.to_entry() for name, outcome in outcomes.items()}


def first_loss_problem(per_rank: Sequence[Any]) -> Optional[tuple[int, str]]:
    """The first rank whose per-rank loss was not measured, and why, in its words (``RankEvidence.loss_problem``)."""
    return next(((rank, e.loss_problem) for rank, e in enumerate(per_rank) if e.loss_problem), None)


def straggler_outcome(rows: Sequence[dict[str, Any]], world: int, factor: float, max_p: float) -> AuditOutcome:
    """The stragglers audit on the steps.jsonl rows: each step's best timing that every rank has.

    busy_ms (the monitor's: from the previous all-reduce's end, a moment all ranks share, to this rank's
    last gradient bucket, less its waits on the other ranks in between (:mod:`healthcheck.measure.wait_clock`)
    and the time its thread waited for a core on a CPU host) when the step has it
    for every rank; runs recorded before it have cycle_ms. compute_ms ends at the all-reduce, also
    shared, so a rank that merely starts late looks fast in it. A rank that shared its host's cores with
    no run-queue clock (``runq_ms`` None, see :mod:`healthcheck.measure.records`) still has the waits for
    a core in its busy_ms, so the audit is not judged on busy_ms then.

    >>> rows = [{"step": s, "rank": r, "busy_ms": 100.0 + 50 * (r == 1), "runq_ms": 3.0} for s in range(30) for r in range(4)]
    >>> straggler_outcome(rows, 4, 1.035, 1e-4).ranks
    (1,)
    >>> rows[-1]["runq_ms"] = None
    >>> straggler_outcome(rows, 4, 1.035, 1e-4).message[:38]
    'not measured: rank 3 shares their host'
    """
    keys = ("busy_ms", "cycle_ms", "compute_ms")
    timing_by_step: dict[int, dict[str, list[float | None]]] = {}
    for row in rows:
        row_timing = timing_by_step.setdefault(row["step"], {key: [None] * world for key in keys})
        for key in keys:
            row_timing[key][row["rank"]] = row.get(key)
    compute = {
        step: next((t[key] for key in keys if all(v is not None for v in t[key])), t["compute_ms"]) for step, t in timing_by_step.items()
    }
    uses_busy = any(all(v is not None for v in t["busy_ms"]) for t in timing_by_step.values())
    unclocked = sorted({row["rank"] for row in rows if "runq_ms" in row and row["runq_ms"] is None}) if uses_busy else []
    return straggler_audit(compute, factor, max_p, unclocked=unclocked)


def parameter_outcomes(
    checks: Sequence[tuple[int, Any]], names: Sequence[str], drift: Sequence[tuple[int, Any]], sharded: Optional[ShardedEvidence]
) -> dict[str, AuditOutcome]:
    """``param_equality`` for replicas (DDP); for FSDP2, ``sharded_state`` and a not-measured ``param_equality``."""
    if sharded is None:
        return {"param_equality": param_equality_audit(checks, names, drift)}
    return {
        "param_equality": not_measured(
            "parameters are sharded (HSDP): sharded_state compares each shard's replicas after the last step, and "
            "what every rank must share"
            if sharded.shard_index
            else "parameters are sharded (FSDP2): each shard has one owner, so there are no "
            "replicas to compare; sharded_state checks what every rank must share"
        ),
        "sharded_state": sharded_state_audit(
            sharded.plans,
            sharded.plan_tensors,
            sharded.start_hashes,
            sharded.end_hashes,
            sharded.optimizer_checks,
            names,
            sharded.pre_shard_hashes,
            sharded.pre_shard_names,
            sharded.shard_index,
            sharded.end_local_hashes,
        ),
    }


def _by_step(rows: Sequence[dict[str, Any]], key: str, world: int) -> dict[int, list[Any]]:
    """``step -> each rank's value of key`` (None where a rank has no row or no value)."""
    out: dict[int, list[Any]] = {}
    for row in rows:
        out.setdefault(row["step"], [None] * world)[row["rank"]] = row.get(key)
    return out


def explained_by_learning_rate(params: AuditOutcome, rows: Sequence[dict[str, Any]], world: int) -> AuditOutcome:
    """``param_equality`` with, where its ranks stepped with another learning rate, the first sampled step at which
    they did: a per-rank warmup or schedule leaves the first step's optimizer settings equal (warmup starts every
    rank at 0) and only the parameters show it, a few steps later, as "the parameters differ".

    >>> rows = [{"step": s, "rank": r, "lr": s / (4 if r == 2 else 2)} for s in range(3) for r in range(4)]
    >>> explained_by_learning_rate(AuditOutcome(False, "rank 2's parameters differ", "x", (2,)), rows, 4).message
    "rank 2's parameters differ; rank 2 stepped with another learning rate from step 1: ranks 0-1, 3 0.5; rank 2 0.25"
    """
    if params.passed or not params.ranks:
        return params
    split = first_split(_by_step(rows, "lr", world))
    if split is None:
        return params
    step, groups, values = split
    odd = odd_ones_out(groups)
    if not set(odd) <= set(params.ranks):
        return params
    return dataclasses.replace(
        params, message=f"{params.message}; {ranks_phrase(odd)} stepped with another learning rate from step {step}: {values}"
    )


def replay_outcome(
    config: ProbeConfig,
    evidence: Optional[ReplayEvidence],
    settings_differ: Sequence[int] = (),
    hooks_differ: Optional[AuditOutcome] = None,
) -> AuditOutcome:
    """The replay audit, or why it was not measured (switched off, a script whose model gives no loss);
    ``settings_differ`` and ``hooks_differ`` explain a difference (:func:`replay_audit`)."""
    if config.metrics.replay_every == 0:
        return not_measured("metrics.replay_every is 0")
    if evidence is not None and evidence.unavailable:
        return not_measured(evidence.unavailable)
    if evidence is None:
        return not_measured("the workers recorded no replay")
    return replay_audit(evidence, settings_differ, hooks_differ)


def hooks_difference(per_rank: Sequence[RankEvidence]) -> Optional[AuditOutcome]:
    """The ranks whose modules carry other hooks than the majority's, and which, or None where all agree.
    Never an audit of its own: a script may hook one rank's model to log (:mod:`healthcheck.measure.module_hooks`).

    >>> evidence = [RankEvidence(hints={"hooks.Embedding": "1x forward noise"} if r == 2 else {}) for r in range(4)]
    >>> hooks_difference(evidence).ranks
    (2,)
    """
    differing = differing_fields([rank_evidence.hints for rank_evidence in per_rank])
    if not differing:
        return None
    blamed = tuple(sorted({rank for _, groups, _ in differing for rank in odd_ones_out(groups)}))
    return AuditOutcome(False, differences_phrase(differing), "hooks", blamed)


def builtin_shard_audit(
    config: ProbeConfig, consumed: Sequence[Sequence[tuple[int, list[int]]]], plan_samples: int, world: int
) -> AuditOutcome:
    """The shard audit of the built-in trainer: what each rank read against torch's DistributedSampler plan
    with the global config's seed (``consumed[rank]`` is ``(epoch, sample ids)`` per micro-batch)."""
    epochs = 1 + max((epoch for batches in consumed for epoch, _ in batches), default=0)
    train = config.train
    seed = train.data_seed if train.data_seed is not None else train.seed
    plan = planned_shards(plan_samples, world, seed, train.shuffle, train.micro_batch_size, epochs)
    return data_shard_audit(consumed, plan, plan_samples)


def seeds_from_evidence(ranks: Sequence[RankInfo], per_rank: Sequence[RankEvidence], *, script: bool) -> AuditOutcome:
    """The seeds audit on every rank's start-up facts and recorded RNG states."""
    # A script seeds python and numpy itself, or not at all (then each process drew from OS entropy). It may seed
    # torch per rank on purpose too: nanoGPT draws each rank's batches from torch's generator, seeded 1337 + rank
    # (DDP broadcasts rank 0's parameters; FSDP2's are compared before sharding by the sharded-state audit).
    entropy_seeded = ("python", "numpy") if script else ()
    return seed_audit(
        [
            {
                **{field: getattr(info, field) for field in SEED_FIELDS},
                "rng_start": rank_evidence.rng.get("rng_start", {}),
                "rng_after_first_step": rank_evidence.rng.get("rng_after_first_step", {}),
            }
            for info, rank_evidence in zip(ranks, per_rank, strict=True)
        ],
        entropy_seeded=entropy_seeded,
        seeded_per_rank=(*entropy_seeded, "torch") if script else (),
    )


def environment_from_evidence(ranks: Sequence[RankInfo], per_rank: Sequence[RankEvidence]) -> AuditOutcome:
    """The environment audit: versions, variables, device name, precision and the recorded extras.

    A DataLoader's settings (``data.*``) are compared only where every rank read one. Under accelerate's
    ``dispatch_batches`` (its default for an ``IterableDataset``: the Trainer's, TRL's) rank 0 alone reads, every
    rank's batch at once, and sends each its part: the others have no DataLoader, by design, and were failed for it.
    """
    readers = [any(key.startswith("data.") for key in rank_evidence.extra) for rank_evidence in per_rank]
    compared = all(readers) or not any(readers)
    return environment_audit(
        [
            {
                "versions": info.versions,
                "env": info.env,
                "device_name": info.device_name,
                "precision": info.precision,
                **{key: value for key, value in rank_evidence.extra.items() if compared or not key.startswith("data.")},
            }
            for info, rank_evidence in zip(ranks, per_rank, strict=True)
        ]
    )


def script_shard_audit(per_rank: Sequence[RankEvidence]) -> AuditOutcome:
    """The shard audit of a --script probe, on what each rank's DataLoader really fetched.

    The plan is rebuilt from the DistributedSampler the ranks read through, with the seed most ranks
    share (rank 0's on a tie): a rank whose sampler was seeded apart departs from it, and so does a rank whose
    sampler splits another dataset (its length and 32 samples' hash, ``dataset_digest``). Shards from
    something else (accelerate's batch shards, a per-rank split of the data) are judged for identity and overlap
    only, and only between ranks whose datasets are the same: an index names the same sample only there. There,
    a minority of ranks off the dataset a strict majority reads is named; a per-rank split has no majority. On
    one dataset, a rank whose DataLoader makes another batch of the same samples (``batch_facts``: its collate
    tokenizes, pads, truncates or masks otherwise) is named before the shards are.
    """
    consumed = [rank_evidence.consumed for rank_evidence in per_rank]
    contents = [rank_evidence.contents for rank_evidence in per_rank]
    if not any(consumed):
        # An IterableDataset fetched without indices, or no DataLoader at all: the samples are known by content. Not
        # where the ranks differ in how (accelerate's dispatch: rank 0 reads every rank's batch, the others none).
        sources = [rank_evidence.shard_source for rank_evidence in per_rank]
        if all(contents) and len(set(sources)) == 1:
            return content_shard_audit(contents, by_forward=sources[0] == "forward")
        readers = [rank for rank, source in enumerate(sources) if source == "loader"]
        if readers:
            return not_measured(
                f"only {ranks_phrase(readers)} fetched from a DataLoader (accelerate's dispatch_batches, its default for an "
                "IterableDataset: rank 0 reads every rank's batch and sends each its part), so the ranks' samples "
                "cannot be compared"
            )
        return not_measured(
            "no DataLoader batches were seen on any rank: the script samples its data its own way, "
            "so shard overlap and order cannot be checked"
        )
    plans = [rank_evidence.sampler for rank_evidence in per_rank]
    digests = [rank_evidence.dataset_digest for rank_evidence in per_rank]
    datasets = group_ranks(digests) if None not in digests else [list(range(len(per_rank)))]
    # Under a shared sampler every rank must index the same dataset; without one, a strict majority on one dataset
    # says the others read another (a per-rank split leaves no majority).
    if len(datasets) > 1 and (None not in plans or 2 * len(datasets[0]) > len(per_rank)):
        phrase = "; ".join(f"{ranks_phrase(g)} {digests[g[0]]}" for g in datasets)
        named = tuple(odd_ones_out(datasets))
        return AuditOutcome(False, f"the ranks read different datasets: {phrase}", f"datasets {partition_signature(datasets)}", named)
    # On one dataset, the batch each rank's collate_fn makes of the same samples (its tokenizing, padding, masking).
    compared = len(datasets) == 1 and all(rank_evidence.batch_facts for rank_evidence in per_rank)
    if compared and (batches := batch_audit([rank_evidence.batch_facts for rank_evidence in per_rank])) is not None:
        return batches
    # The dataset's length, where every rank reads one: an epoch read whole may repeat the sampler's padding.
    size = per_rank[0].dataset_size if len(datasets) == 1 and digests[0] else None
    # A sampler that reads each sample several times by design (TRL's GRPO groups); where the ranks disagree on it the
    # environment audit names them, and the shards are judged as if it read each once.
    groups = SampleGroups(int(_common_fact(per_rank, "data.sample_group", "1")), int(_common_fact(per_rank, "data.group_rounds", "1")))
    outcome = _shards_read(consumed, plans, datasets, contents, size, groups)
    if compared and outcome.passed and outcome.measured:
        same = "every rank's DataLoader makes the same batch of the dataset's first, middle and last samples"
        outcome = dataclasses.replace(outcome, message=f"{outcome.message}; {same}")
    return outcome


def _shards_read(
    consumed: Sequence[Any],
    plans: Sequence[Optional[SamplerPlan]],
    datasets: Sequence[Sequence[int]],
    contents: Sequence[Any],
    dataset_size: Optional[int] = None,
    groups: SampleGroups = READ_ONCE,
) -> AuditOutcome:
    """Which samples the ranks read, against the shared sampler's plan where there is one."""
    if any(plan is None for plan in plans):
        if all(len(group) == 1 for group in datasets) and len(datasets) > 1:
            if all(contents):  # a per-rank split: the same index is another sample on each rank, the same tokens are not
                return content_shard_audit(contents)
            return not_measured(
                "each rank reads its own dataset (at the same indices the ranks' datasets hold different samples: a "
                "per-rank split such as datasets' split_dataset_by_node), so which samples overlap cannot be told from indices"
            )
        # Tag each index with its dataset: ranks reading different datasets share no sample.
        span = 1 + max((i for batches in consumed for _, ids in batches for i in ids), default=0)
        tag = {rank: number * span for number, group in enumerate(datasets) for rank in group}
        tagged = [[(e, [tag[r] + i for i in ids]) for e, ids in c] for r, c in enumerate(consumed)]
        return data_shard_audit(tagged, None, dataset_size, groups)  # the caller's size is None for several datasets
    seeds = Counter(plan.seed for plan in plans if plan is not None)
    top = max(seeds.values())
    first = plans[0]
    assert first is not None
    seed = first.seed if seeds[first.seed] == top else next(s for s, n in seeds.items() if n == top)
    epochs = 1 + max((epoch for batches in consumed for epoch, _ in batches), default=0)
    plan = planned_shards(first.dataset_size, first.num_replicas, seed, first.shuffle, 1, epochs, drop_last=first.drop_last)
    return data_shard_audit(consumed, plan, first.dataset_size)


def _collective(sharded: bool, mesh: str) -> str:
    """How the checked gradient was reduced, for the reduction audit's message: under HSDP the check compares each
    shard group's reduce-scatter (the replicas' all-reduce comes after it, unchecked)."""
    if not sharded:
        return "all-reduced"
    return "reduce-scattered (per HSDP shard group)" if mesh.startswith("replicate") else "reduce-scattered"


def _common_fact(per_rank: Sequence[RankEvidence], key: str, default: str) -> str:
    """The environment fact ``key`` where every rank has the same value (missing counts as ``default``), else ``default``."""
    values = {str(e.extra.get(key, default)) for e in per_rank}
    return values.pop() if len(values) == 1 else default

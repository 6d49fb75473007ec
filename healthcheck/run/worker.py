"""One probe worker: set up the process group, the model under test, the monitor and the audits, then train.

Every rank runs :func:`probe_worker`, started by ``healthcheck probe`` (through the elastic launcher)
or directly by torchrun::

    torchrun --nproc_per_node 8 -m healthcheck probe --config probe.yaml

Rank 0 returns a :class:`~healthcheck.artifacts.WorkerReport`; a rank that fails leaves a
:class:`~healthcheck.artifacts.WorkerFailure` in ``errors/`` first.
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from healthcheck.artifacts import FailFastPolicy, RankEvidence, RankInfo, WorkerReport
from healthcheck.config import ProbeConfig, resolve_for_rank
from healthcheck.config.monitor_settings import monitor_settings
from healthcheck.errors import InvalidInput
from healthcheck.judge.assemble import (
    builtin_shard_audit,
    environment_from_evidence,
    parameter_outcomes,
    seeds_from_evidence,
)
from healthcheck.judge.fail_fast import FailFast
from healthcheck.measure import distributed as hdist
from healthcheck.measure.environment import rank_identity
from healthcheck.measure.evidence import AuditRecorder
from healthcheck.measure.fsdp_internals import group_settings
from healthcheck.measure.module_facts import module_facts
from healthcheck.measure.sharded_state import unsharded_weight_hashes
from healthcheck.run.console import redirect_worker_output
from healthcheck.run.data import MicroBatches, load_rows, prepare_samples, shard_plan
from healthcheck.run.failures import record_worker_failure
from healthcheck.run.faults import before_process_group as faults_before_process_group
from healthcheck.run.faults import install_faults
from healthcheck.run.modeling import build_model, load_tokenizer
from healthcheck.run.sharding import wrap_model
from healthcheck.run.trainer import TrainLoop, replay_loss
from healthcheck.run.watchdog import Heartbeat

if TYPE_CHECKING:
    from healthcheck.run.replay_rounds import ReplayRounds


class PhaseClock:
    """Wall seconds per named phase on this worker (``Timing.phases``): each :meth:`lap` closes one."""

    def __init__(self, start: float, phases: Optional[dict[str, float]] = None):
        self.last = start
        self.phases = dict(phases or {})

    def lap(self, name: str) -> None:
        now = time.time()
        self.phases[name] = now - self.last
        self.last = now


def start_checks(
    fail_fast: FailFast,
    config: ProbeConfig,
    ranks: list[RankInfo],
    audit: AuditRecorder,
    batches: MicroBatches,
    plan_samples: int,
    grad_accum_steps: int,
) -> None:
    """Collective, before the first step: judge seeds, environment and the data shards on what is already known.

    The shards are judged on each rank's sampler plan for the whole probe (what it *will* read), so an
    overlap stops the probe before a single step. When it does, that plan becomes the shard evidence, and
    the final audit reports the same failure.
    """
    reads = batches.planned_reads(config.train.steps * grad_accum_steps)
    mine = RankEvidence(consumed=reads, rng=audit.rng, extra=audit.extra)
    everyone = [RankEvidence.model_validate(item) for item in hdist.all_gather_objects(mine.model_dump())]
    outcomes = {
        "data_shards": builtin_shard_audit(config, [e.consumed for e in everyone], plan_samples, len(ranks)),
        "seeds": seeds_from_evidence(ranks, everyone, script=False),
        "environment": environment_from_evidence(ranks, everyone),
    }
    sharded = audit.sharded_evidence()
    if sharded is not None:  # FSDP2: the sharding plan and the all-gathered parameters are known now
        outcomes["sharded_state"] = parameter_outcomes([], audit.param_names(), [], sharded)["sharded_state"]
    fail_fast.judge(0, outcomes)
    if fail_fast.stop is not None and fail_fast.stop.check == "data_shards":
        audit.consumed = reads


#: Tolerance mode's sketch size: the distance estimates' relative error is about sqrt(2/p) / 2 (~2%).
def replay_rounds(
    config: ProbeConfig, rank_config: ProbeConfig, model: Any, device: Any, ranks: list[RankInfo], monitor: Any
) -> Optional[ReplayRounds]:
    """The replay audit's rounds on this rank; None when ``metrics.replay_every`` is 0.

    Under FSDP2 (``model`` is then the root, sharded in place) no rank holds a whole gradient: every rank replays
    together through the sharded model, and ``monitor`` hands over each group's local gradient
    (:mod:`healthcheck.measure.sharded_replay`).
    """
    # Imported here: the replay imports torch, and importing the probe must not (``config show`` stays fast).
    from healthcheck.run.replay_rounds import build_rounds

    precision = rank_config.train.precision
    return build_rounds(
        config, model, lambda call, batch: replay_loss(call, batch, device, precision), device, [info.device_name for info in ranks],
        monitor,
    )


def seed_everything(seed: int) -> dict[str, int]:
    """Seed python, numpy and torch on this rank, and read back what took effect.

    Called after the process group exists and the rank is known, so per-rank seeds really differ
    (the public scripts of arXiv 2602.14462 read the rank too early, and their seed perturbations
    were inert).
    """
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return {"python_seed": seed, "numpy_seed": seed % 2**32, "torch_seed": int(torch.initial_seed())}


def lr_lambda(warmup_steps: int) -> Callable[[int], float]:
    """Linear warmup over ``warmup_steps`` optimizer steps, then constant.

    >>> [round(lr_lambda(4)(s), 2) for s in range(5)]
    [0.25, 0.5, 0.75, 1.0, 1.0]
    """

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return factor


def probe_worker(
    config_json: str,
    run_dir: str,
    started_at: float,
    pg_timeout_s: Optional[float] = None,
    launch_attempt: int = 1,
    quiet_console: bool = False,
    fail_fast_json: Optional[str] = None,
) -> Optional[WorkerReport]:
    """Train ``config.train.steps`` steps on this rank; rank 0 returns the run's report.

    ``quiet_console``: under healthcheck's own launcher, this worker's output goes to its log in the run
    directory and the launcher shows the progress (see :mod:`healthcheck.run.console`).
    ``fail_fast_json``: a :class:`~healthcheck.artifacts.FailFastPolicy`; None runs every step (a
    non-finite value still stops the run).
    """
    entered = time.time()
    config = ProbeConfig.model_validate_json(config_json)
    policy = FailFastPolicy.model_validate_json(fail_fast_json) if fail_fast_json else None
    step_marker: dict[str, Optional[int]] = {"step": None}
    if quiet_console:
        redirect_worker_output(Path(run_dir), hdist.get_dist_info().rank)
    try:
        return _train(config, Path(run_dir), started_at, step_marker, pg_timeout_s, launch_attempt, not quiet_console, policy, entered)
    except BaseException as exc:
        record_worker_failure(Path(run_dir), hdist.get_dist_info().rank, step_marker["step"], exc)
        raise


def _train(
    config: ProbeConfig,
    run_dir: Path,
    started_at: float,
    step_marker: dict[str, Optional[int]],
    pg_timeout_s: Optional[float],
    launch_attempt: int,
    show_progress: bool,
    policy: Optional[FailFastPolicy],
    entered: float,
) -> Optional[WorkerReport]:
    import torch

    from healthcheck.measure.monitor import WorkerConsistencyMonitor

    local = hdist.get_dist_info()
    faults_before_process_group(resolve_for_rank(config, local.rank).faults, launch_attempt)
    device_type = hdist.resolve_device(config.distributed.device, local.local_world_size)
    backend = hdist.resolve_backend(config.distributed.backend, device_type)
    info = hdist.init_distributed(device_type, backend, pg_timeout_s or config.distributed.timeout_s)
    clock = PhaseClock(entered, phases={"launch": entered - started_at})
    clock.lap("rendezvous")
    heartbeat = Heartbeat(run_dir, info.rank)
    try:
        hdist.set_worker_threads(info.local_world_size)
        for rank in config.rank_overrides:
            if rank >= info.world_size:
                raise InvalidInput(f"rank_overrides: rank {rank} is outside the world (world size {info.world_size})")
        rank_config = resolve_for_rank(config, info.rank)
        seeds = seed_everything(rank_config.train.seed)
        device = hdist.torch_device(device_type, info.local_rank)
        if rank_config.train.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise InvalidInput("train.precision: bf16 is not supported on this GPU")

        tokenizer = load_tokenizer(rank_config.model)
        samples = prepare_samples(rank_config.data, tokenizer, cache_key=rank_config.model.name)
        model = build_model(rank_config.model, len(tokenizer), rank_config.data.max_length).to(device)
        strategy = config.distributed.strategy
        if strategy == "fsdp" and rank_config.faults.grad_noise_std > 0:
            raise InvalidInput(
                "faults.grad_noise_std cannot be injected with distributed.strategy=fsdp: FSDP2 runs "
                "parameter hooks on the sharded, already reduce-scattered gradient"
            )
        # FSDP2 slices each rank's own weights without a broadcast: hash them while they are still whole.
        pre_shard = unsharded_weight_hashes(model) if strategy == "fsdp" else []
        wrapped = wrap_model(model, config.distributed, device, info.world_size)
        # From the global config, never this rank's: the sketch map must be the same on every rank.
        monitor = WorkerConsistencyMonitor(wrapped, **monitor_settings(config, fsdp=strategy == "fsdp"))
        install_faults(model, rank_config.faults, step_marker)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=rank_config.train.lr, weight_decay=rank_config.train.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(rank_config.train.lr_warmup_steps))
        plan = shard_plan(rank_config.data, rank_config.train, info.rank, info.world_size)
        batches = MicroBatches(samples, plan, rank_config.train, tokenizer.pad_token_id)

        rank_info = RankInfo(
            **rank_identity(info, device),
            seed=rank_config.train.seed,
            sampler_seed=plan.seed,
            sampler_rank=plan.rank,
            sampler_replicas=plan.replicas,
            precision=rank_config.train.precision,
            gradient_source=monitor.gradient_source,
            **seeds,
        )
        all_ranks = [RankInfo.model_validate(item) for item in hdist.all_gather_objects(rank_info.model_dump())]
        audit = AuditRecorder(
            model,
            param_check_every=config.metrics.param_check_every,
            extra={"model_dtype": rank_config.model.dtype, "strategy": strategy, **module_facts(model),
                   **({"fsdp.mesh": group_settings(wrapped).get("fsdp.mesh", "?")} if strategy == "fsdp" else {})},
            sharded=strategy == "fsdp",
            pre_shard=pre_shard,
        )
        audit.watch_optimizer(optimizer)
        replay = replay_rounds(config, rank_config, model, device, all_ranks, monitor)
        audit.replay = replay.evidence if replay is not None else None
        audit.record_rng("rng_start", device)
        # The shard plan is the *global* config's, whatever this rank's data override says (every rank
        # computes the same size: one sample per data row).
        plan_samples = len(samples) if rank_config.data == config.data else len(load_rows(config.data))
        clock.lap("build")
        fail_fast = FailFast(policy)
        if fail_fast.policy.enabled:
            start_checks(fail_fast, config, all_ranks, audit, batches, plan_samples, rank_config.train.grad_accum_steps)
        clock.lap("start_checks")

        loop = TrainLoop(
            config=config,
            rank_config=rank_config,
            info=info,
            device=device,
            model=wrapped,
            monitor=monitor,
            optimizer=optimizer,
            scheduler=scheduler,
            batches=batches,
            run_dir=run_dir,
            heartbeat=heartbeat,
            audit=audit,
            replay=replay,
            fail_fast=fail_fast,
            step_marker=step_marker,
            show_progress=show_progress,
        )
        first_step_at = time.time()
        if fail_fast.stop is None:
            loop.run()
        clock.lap("train")
        monitor.close()
        evidence = audit.finish(plan_samples)
        clock.lap("finish")
        train_s, steps_completed = loop.train_s, loop.steps_completed
        # Free DDP's reducer (and everything holding the model) while the process group still exists: a
        # reducer that outlives destroy_process_group destroys the group itself, later, at exit or in a GC
        # pass, where gloo's threads cannot always be joined (seen: std::terminate at exit under torchrun).
        del loop, replay, monitor, optimizer, scheduler, wrapped, model
        gc.collect()
        if evidence is None:  # not rank 0
            return None
        return WorkerReport(
            evidence=evidence,
            ranks=all_ranks,
            device_type=device_type,
            device_reason=hdist.device_reason(config.distributed.device, device_type, info.local_world_size),
            backend=backend,
            world_size=info.world_size,
            startup_s=first_step_at - started_at,
            train_s=train_s,
            steps_completed=steps_completed,
            stopped_early=fail_fast.stop,
            phases=clock.phases,
        )
    finally:
        hdist.destroy_distributed()

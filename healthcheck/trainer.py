"""One probe worker: real DDP fine-tuning with the consistency monitor attached.

Every rank runs :func:`probe_worker`; rank 0 also writes the per-step rows. Started by
``healthcheck probe`` (through the elastic launcher) or directly by torchrun::

    torchrun --nproc_per_node 8 -m healthcheck probe --config probe.yaml
"""

from __future__ import annotations

import contextlib
import math
import platform
import random
import time
from pathlib import Path
from typing import Any

from healthcheck import distributed as hdist
from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE, JsonlWriter, RankInfo
from healthcheck.audits import AuditRecorder
from healthcheck.config import ProbeConfig, resolve_for_rank
from healthcheck.data import IGNORE_INDEX, MicroBatches, load_rows, prepare_samples, shard_plan
from healthcheck.errors import InvalidInput
from healthcheck.faults import at_step_start as faults_at_step_start
from healthcheck.faults import before_process_group as faults_before_process_group
from healthcheck.faults import install_faults
from healthcheck.modeling import build_model, load_tokenizer
from healthcheck.progress import StepProgress
from healthcheck.records import aggregate_row, rank_rows
from healthcheck.watchdog import Heartbeat


def seed_everything(seed: int) -> dict[str, int]:
    """Seed python, numpy and torch on this rank, and read back what took effect.

    Called after the process group exists and the rank is known, so per-rank seeds really differ
    (the paper's scripts read the rank too early and their seed perturbations were inert).
    """
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return {"python_seed": seed, "numpy_seed": seed % 2**32, "torch_seed": int(torch.initial_seed())}


def lr_lambda(warmup_steps: int):
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return factor


def versions() -> dict[str, str]:
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    if torch.version.cuda:
        out["cuda"] = str(torch.version.cuda)
    out["deterministic_algorithms"] = str(torch.are_deterministic_algorithms_enabled())
    out["cudnn_deterministic"] = str(torch.backends.cudnn.deterministic)
    out["cudnn_benchmark"] = str(torch.backends.cudnn.benchmark)
    return out


def _autocast(device, precision: str):
    import torch

    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sync(device) -> None:
    # The compute-time figure needs the device to have finished; this is one sync per step, not per bucket.
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def micro_step_loss(ddp_model, batch: dict[str, Any], device, precision: str):
    """Summed token cross-entropy of one micro-batch (the caller normalises by the step's tokens)."""
    import torch.nn.functional as F

    input_ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    attention = batch["attention_mask"].to(device, non_blocking=True)
    with _autocast(device, precision):
        logits = ddp_model(input_ids=input_ids, attention_mask=attention).logits
    shifted = logits[:, :-1, :].float()
    return F.cross_entropy(
        shifted.reshape(-1, shifted.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def response_tokens(batch: dict[str, Any]) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def probe_worker(config_json: str, run_dir: str, started_at: float, pg_timeout_s: float | None = None,
                 launch_attempt: int = 1) -> dict[str, Any] | None:
    """Train ``config.train.steps`` steps on this rank; rank 0 returns the run's environment and timing."""
    config = ProbeConfig.model_validate_json(config_json)
    progress_marker = {"step": None}
    try:
        return _probe_worker(config, Path(run_dir), started_at, progress_marker, pg_timeout_s, launch_attempt)
    except BaseException as exc:
        record_worker_failure(Path(run_dir), hdist.get_dist_info().rank, progress_marker["step"], exc)
        raise


def record_worker_failure(run_dir: Path, rank: int, step: int | None, exc: BaseException) -> None:
    """Leave ``errors/rank-<r>.json`` (one-line reason, step) and the traceback for the launcher to report."""
    import json
    import traceback

    try:
        folder = run_dir / "errors"
        folder.mkdir(exist_ok=True)
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]
        report = {"rank": rank, "step": step, "reason": reason, "time": time.time(),
                  "exit_code": int(getattr(exc, "exit_code", 3))}  # InvalidInput keeps its exit 2
        (folder / f"rank-{rank}.json").write_text(json.dumps(report))
        (folder / f"rank-{rank}.traceback.txt").write_text("".join(traceback.format_exception(exc)))
    except OSError:
        pass  # the launcher still reports the exit code


def _probe_worker(
    config: ProbeConfig, run_dir: Path, started_at: float, progress_marker: dict, pg_timeout_s: float | None,
    launch_attempt: int = 1,
) -> dict[str, Any] | None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from healthcheck.monitor import WorkerConsistencyMonitor

    local = hdist.get_dist_info()
    faults_before_process_group(resolve_for_rank(config, local.rank).faults, launch_attempt)
    device_type = hdist.resolve_device(config.distributed.device, local.local_world_size)
    backend = hdist.resolve_backend(config.distributed.backend, device_type)
    info = hdist.init_distributed(device_type, backend, pg_timeout_s or config.distributed.timeout_s)
    heartbeat = Heartbeat(run_dir, info.rank)
    try:
        hdist.set_worker_threads(info.local_world_size)
        for rank in config.rank_overrides:
            if rank >= info.world_size:
                raise InvalidInput(f"rank_overrides: rank {rank} is outside the world (world size {info.world_size})")
        mine = resolve_for_rank(config, info.rank)
        seeds = seed_everything(mine.train.seed)
        device = hdist.torch_device(device_type, info.local_rank)
        if mine.train.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise InvalidInput("train.precision: bf16 is not supported on this GPU")

        tokenizer = load_tokenizer(mine.model)
        samples = prepare_samples(mine.data, tokenizer, cache_key=mine.model.name)
        model = build_model(mine.model, len(tokenizer), mine.data.max_length).to(device)
        ddp = DistributedDataParallel(
            model,
            device_ids=[info.local_rank] if device.type == "cuda" else None,
            bucket_cap_mb=config.distributed.bucket_cap_mb,
            gradient_as_bucket_view=config.distributed.gradient_as_bucket_view,
        )
        # The sketch projection must be identical on every rank, so it is seeded from the global
        # config, never from this rank's (possibly perturbed) seed.
        monitor = WorkerConsistencyMonitor(
            ddp, direction=config.metrics.direction, sketch_dim=config.metrics.sketch_dim,
            every=config.metrics.every, seed=config.train.seed, reduction_every=config.metrics.reduction_check_every,
        )
        install_faults(model, mine.faults)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=mine.train.lr, weight_decay=mine.train.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(mine.train.lr_warmup_steps))
        plan = shard_plan(mine.data, mine.train, info.rank, info.world_size)
        batches = MicroBatches(samples, plan, mine.train, tokenizer.pad_token_id)

        rank_info = RankInfo(
            rank=info.rank, local_rank=info.local_rank, node=info.node, node_rank=info.node_rank, device=str(device),
            device_name=hdist.device_name(device), seed=mine.train.seed, sampler_seed=plan.seed,
            sampler_rank=plan.rank, sampler_replicas=plan.replicas, precision=mine.train.precision,
            versions=versions(), env=hdist.rank_environment(), **seeds,
        )
        all_ranks = hdist.all_gather_objects(rank_info.model_dump())
        audit = AuditRecorder(model, param_check_every=config.metrics.param_check_every,
                              extra={"model_dtype": mine.model.dtype})
        audit.record_rng("rng_start", device)

        loop = TrainLoop(config, mine, info, device, ddp, monitor, optimizer, scheduler, batches, run_dir, progress_marker,
                         heartbeat, audit=audit)
        first_step_at = time.time()
        loop.run()
        monitor.close()
        evidence = audit.finish()
        if info.rank != 0:
            return None
        # The shard plan is the *global* config's, whatever this rank's data override says.
        evidence["plan_samples"] = len(samples) if mine.data == config.data else len(load_rows(config.data))
        return {
            "audit_evidence": evidence,
            "ranks": all_ranks,
            "device_type": device_type,
            "backend": backend,
            "world_size": info.world_size,
            "startup_s": first_step_at - started_at,
            "train_s": loop.train_s,
            "steps_completed": loop.steps_completed,
            "stopped_early": loop.stopped_early,
        }
    finally:
        hdist.destroy_distributed()


class TrainLoop:
    """The optimizer-step loop; rank 0 streams each sampled step's rows to the run directory."""

    def __init__(self, config, mine, info, device, ddp, monitor, optimizer, scheduler, batches, run_dir: Path, marker: dict, heartbeat,
                 audit: AuditRecorder | None = None):
        self.config, self.mine, self.info, self.device = config, mine, info, device
        self.ddp, self.monitor, self.optimizer, self.scheduler, self.batches = ddp, monitor, optimizer, scheduler, batches
        self.run_dir = run_dir
        self.marker = marker  # the step in progress, for the crash report
        self.heartbeat = heartbeat
        self.audit = audit
        self.steps_completed = 0
        self.stopped_early: str | None = None
        self.train_s = 0.0
        self.last_sync_s: float | None = None  # when this rank left the previous step's metrics gather

    def run(self) -> None:
        writers = None
        progress = None
        if self.info.rank == 0:
            writers = (JsonlWriter(self.run_dir / STEPS_FILE), JsonlWriter(self.run_dir / AGGREGATES_FILE))
            progress = StepProgress(self.config.name, self.config.train.steps)
        start = time.perf_counter()
        try:
            for step in range(self.config.train.steps):
                self.marker["step"] = step
                metrics, compute_ms = self.step(step)
                self.steps_completed = step + 1
                if writers is not None and metrics is not None:
                    write_rows(writers, step, metrics, self.scheduler.get_last_lr()[0])
                if progress is not None:
                    progress.advance(step + 1)
                if metrics is not None and metrics.nonfinite_ranks:
                    # Every rank sees the same gathered metrics, so all stop at the same step.
                    self.stopped_early = f"non-finite loss or gradient on rank(s) {metrics.nonfinite_ranks} at step {step}"
                    break
        finally:
            self.train_s = time.perf_counter() - start
            if progress is not None:
                progress.close()
            if writers is not None:
                for writer in writers:
                    writer.close()

    def step(self, step: int):
        import torch

        train, faults = self.mine.train, self.mine.faults
        self.heartbeat.beat(step, "compute")
        faults_at_step_start(faults, step)
        t0 = time.perf_counter()
        micro = []
        for _ in range(train.grad_accum_steps):
            micro.append(self.batches.next())
            if self.audit is not None:  # the epoch is read after next(), which may have started a new one
                self.audit.record_batch(self.batches.epoch, micro[-1]["sample_ids"])
        tokens = sum(response_tokens(batch) for batch in micro)
        # Normalise by the step's response tokens on this rank (known before any forward), so an
        # all-truncated micro-batch contributes zero instead of 0/0.
        denominator = max(tokens, 1)
        loss_sum = torch.zeros((), device=self.device)
        for index, batch in enumerate(micro):
            is_last = index == len(micro) - 1
            context = contextlib.nullcontext() if is_last else self.ddp.no_sync()
            with context:
                summed = micro_step_loss(self.ddp, batch, self.device, train.precision)
                if faults.nan_at_step == step:
                    summed = summed * float("nan")
                if is_last:
                    self.heartbeat.beat(step, "backward")
                (summed * (train.loss_scale / denominator)).backward()
            loss_sum += summed.detach()
        if faults.step_sleep_ms:
            time.sleep(faults.step_sleep_ms / 1000)
        _sync(self.device)
        compute_done = time.perf_counter()
        compute_ms = (compute_done - t0) * 1000
        extras = {"compute_ms": compute_ms}
        if self.last_sync_s is not None:
            # compute_ms ends when DDP's all-reduce completes, a moment all ranks share, so a rank that
            # starts late looks fast for the whole run. Timed from the previous gather (also shared),
            # the cycle has no such bias: ranks differ only by their own work (the stragglers audit).
            extras["cycle_ms"] = (compute_done - self.last_sync_s) * 1000
        local_loss = loss_sum * (train.loss_scale / denominator)
        self.heartbeat.beat(step, "sync")
        metrics = self.monitor.end_step(local_loss, tokens=tokens, extras=extras)
        self.last_sync_s = time.perf_counter() if metrics is not None else None
        self.heartbeat.beat(step, "optimizer")
        if train.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), train.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.audit is not None:
            if step == 0:
                self.audit.record_rng("rng_after_first_step", self.device)
            self.audit.after_optimizer_step(step)  # collective on parameter-check steps
        return metrics, compute_ms


def _finite_or_none(value):
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def write_rows(writers, step: int, metrics, lr: float) -> None:
    """One steps.jsonl row per rank and one aggregates.jsonl row for this step."""
    steps_writer, aggregates_writer = writers
    data = metrics.to_dict()
    for row in rank_rows(step, data):
        steps_writer.write(row)
    aggregates_writer.write(aggregate_row(step, data, lr))

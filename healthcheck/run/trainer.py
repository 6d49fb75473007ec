"""The training step under test and the loop around it: real DDP fine-tuning, one optimizer step at a time.

:func:`backward_over_micro_batches` and :func:`apply_update` are the step itself (the overhead
benchmark times exactly these); :class:`TrainLoop` adds the heartbeats, the injected faults, the
monitor's gather and the audit calls, and on rank 0 streams each sampled step's rows to the run
directory. The worker that builds all of it is :mod:`healthcheck.run.worker`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE
from healthcheck.config import ProbeConfig
from healthcheck.files import JsonlWriter
from healthcheck.judge.assemble import parameter_outcomes
from healthcheck.judge.fail_fast import FailFast
from healthcheck.measure.distributed import DistInfo
from healthcheck.measure.evidence import AuditRecorder
from healthcheck.measure.records import aggregate_row, rank_rows
from healthcheck.measure.step_gather import CLOSE_WAIT_S
from healthcheck.run.data import IGNORE_INDEX, MicroBatches
from healthcheck.run.faults import at_step_start as faults_at_step_start
from healthcheck.run.faults import flip_float32_bit
from healthcheck.run.progress import StepProgress
from healthcheck.run.sharding import sync_context
from healthcheck.run.watchdog import Heartbeat

if TYPE_CHECKING:
    from healthcheck.run.replay_rounds import ReplayRounds


def _autocast(device: Any, precision: str) -> Any:
    import torch

    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _sync(device: Any) -> None:
    # The compute-time figure needs the device to have finished; this is one sync per step, not per bucket.
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def micro_step_loss(model: Any, batch: Mapping[str, Any], device: Any, precision: str) -> Any:
    """Summed token cross-entropy of one micro-batch (the caller normalises by the step's tokens)."""
    import torch.nn.functional as F

    input_ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    attention = batch["attention_mask"].to(device, non_blocking=True)
    with _autocast(device, precision):
        logits = model(input_ids=input_ids, attention_mask=attention).logits
    shifted = logits[:, :-1, :].float()
    return F.cross_entropy(shifted.reshape(-1, shifted.size(-1)), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def replay_loss(call: Callable[..., Any], batch: Mapping[str, Any], device: Any, precision: str) -> Any:
    """The loss of one micro-batch as the training step computes it (per response token), through ``call``.

    The replay audit's forward (:class:`~healthcheck.measure.replay.GradientReplay` passes ``call``, the
    model on detached parameters). A rank's loss-side faults (``loss_scale``, ``nan_at_step``) are settings
    of the step, not of the device, and stay out of it.
    """
    return micro_step_loss(call, batch, device, precision) / max(response_tokens(batch), 1)


def response_tokens(batch: Mapping[str, Any]) -> int:
    """Tokens that carry loss in one micro-batch (labels are shifted by one for a causal LM)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def backward_over_micro_batches(
    model: Any,
    micro: list[dict[str, Any]],
    device: Any,
    *,
    precision: str,
    loss_scale: float = 1.0,
    poison: bool = False,
    flip_bit: Optional[int] = None,
    before_last_backward: Optional[Callable[[], None]] = None,
) -> tuple[Any, int]:
    """Forward and backward every micro-batch of one optimizer step; gradients are reduced on the last one
    only (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``: :func:`~healthcheck.run.sharding.sync_context`).

    The loss is normalised by the step's response tokens on this rank (known before any forward),
    so an all-truncated micro-batch contributes zero instead of 0/0. ``poison`` makes the loss NaN
    (the ``faults.nan_at_step`` fault); ``flip_bit`` flips that bit of the first non-zero summed micro-batch
    loss before its backward (``faults.bitflip_at_step``, see :func:`~healthcheck.run.faults.flip_float32_bit`).
    Returns this rank's token-weighted loss (a 0-d tensor,
    ``loss_scale`` included) and its token count.
    """
    import torch

    tokens = sum(response_tokens(batch) for batch in micro)
    denominator = max(tokens, 1)
    loss_sum = torch.zeros((), device=device)
    for index, batch in enumerate(micro):
        is_last = index == len(micro) - 1
        with sync_context(model, is_last):
            summed = micro_step_loss(model, batch, device, precision)
            if poison:
                summed = summed * float("nan")
            if flip_bit is not None and (exact := float(summed.detach())) != 0:  # a host sync, on the faulted step only
                summed = summed * (flip_float32_bit(exact, flip_bit) / exact)  # a power of two: the flip, exactly
                flip_bit = None
            if is_last and before_last_backward is not None:
                before_last_backward()
            (summed * (loss_scale / denominator)).backward()
        loss_sum += summed.detach()
    return loss_sum * (loss_scale / denominator), tokens


def apply_update(model: Any, optimizer: Any, scheduler: Any = None, *, max_grad_norm: Optional[float]) -> None:
    """Clip the all-reduced gradient, step the optimizer (and scheduler), clear the gradients."""
    import torch

    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


@dataclasses.dataclass(kw_only=True)
class TrainLoop:
    """The optimizer-step loop; rank 0 streams each sampled step's rows to the run directory.

    Attributes:
        config: The global probe config (steps, name).
        rank_config: This rank's resolved config (its train settings and faults).
        info: Where this process sits in the job.
        device: The torch device it computes on.
        model, monitor, optimizer, scheduler: The model under test (DDP or the FSDP2 root) and what drives it.
        batches: This rank's micro-batches.
        run_dir: Where rank 0 writes the rows.
        heartbeat: The watchdog's view of this rank's progress.
        audit: The exact audits' recorder, or None.
        replay: The replay audit's rounds (before step 0 and every ``metrics.replay_every``), or None.
        fail_fast: The stop decision: a non-finite value always stops the loop; a decisive audit failure
            (a parameter-hash mismatch) stops it when fail fast is on.
        step_marker: ``{"step": s}``, the step in progress, for a crash report.
        show_progress: Whether rank 0 prints the progress line itself.
    """

    config: ProbeConfig
    rank_config: ProbeConfig
    info: DistInfo
    device: Any
    model: Any
    monitor: Any
    optimizer: Any
    scheduler: Any
    batches: MicroBatches
    run_dir: Path
    heartbeat: Heartbeat
    audit: Optional[AuditRecorder] = None
    replay: Optional[ReplayRounds] = None
    fail_fast: FailFast = dataclasses.field(default_factory=FailFast)
    step_marker: dict[str, Optional[int]] = dataclasses.field(default_factory=lambda: {"step": None})
    #: Rank 0 prints its own progress line only when no launcher of ours shows one (under torchrun).
    show_progress: bool = True
    steps_completed: int = 0
    train_s: float = 0.0
    #: The learning rate of each step whose metrics have not arrived yet (they arrive a step late).
    pending_lr: dict[int, float] = dataclasses.field(default_factory=dict)

    def run(self) -> None:
        writers = None
        progress = None
        if self.info.rank == 0:
            writers = (JsonlWriter(self.run_dir / STEPS_FILE), JsonlWriter(self.run_dir / AGGREGATES_FILE))
            progress = StepProgress(self.config.name, self.config.train.steps) if self.show_progress else None
        start = time.perf_counter()
        try:
            for step in range(self.config.train.steps):
                self.step_marker["step"] = step
                self.pending_lr[step] = self.scheduler.get_last_lr()[0]
                metrics = self.step(step)
                self.steps_completed = step + 1
                if progress is not None:
                    progress.advance(step + 1)
                self._record(metrics, writers)
                if self.fail_fast.stop is not None:
                    break
            self._record(self.monitor.flush(), writers)  # the last step's gather, still in flight
        except BaseException:
            self._salvage(writers)
            raise
        finally:
            self.train_s = time.perf_counter() - start
            if progress is not None:
                progress.close()
            if writers is not None:
                for writer in writers:
                    writer.close()

    def _salvage(self, writers: Optional[tuple[JsonlWriter, JsonlWriter]]) -> None:
        """On a failure: keep the last completed step's rows when its gather finishes within a bounded wait
        (every rank launched it before the failure, unless a peer died before contributing)."""
        try:
            metrics = self.monitor.flush(timeout_s=CLOSE_WAIT_S)
        except Exception:  # the gather itself failed with its peer: nothing to keep
            return
        if metrics is not None and writers is not None:
            write_rows(writers, metrics.step, metrics, self.pending_lr.pop(metrics.step, None))

    def _record(self, metrics: Any, writers: Optional[tuple[JsonlWriter, JsonlWriter]]) -> None:
        """Write a step's rows (rank 0); a non-finite loss or gradient stops the loop.

        Every rank sees the same gathered metrics, so all of them stop after the same step.
        """
        if metrics is None:
            return
        lr = self.pending_lr.pop(metrics.step, None)
        if writers is not None:
            write_rows(writers, metrics.step, metrics, lr)
        self.fail_fast.nonfinite(metrics.step, metrics.nonfinite_ranks)

    def step(self, step: int) -> Any:
        """One optimizer step; the StepMetrics of the previous sampled step (they arrive a step late), or None."""
        train, faults = self.rank_config.train, self.rank_config.faults
        self.heartbeat.beat(step, "compute")
        faults_at_step_start(faults, step)
        t0 = time.perf_counter()
        if faults.step_sleep_ms:  # a straggler: slower in its own work, before it reaches the all-reduce
            time.sleep(faults.step_sleep_ms / 1000)
        micro = []
        for _ in range(train.grad_accum_steps):
            micro.append(self.batches.next())
            if self.audit is not None:  # the epoch is read after next(), which may have started a new one
                self.audit.record_batch(self.batches.epoch, micro[-1]["sample_ids"])
        if self.replay is not None and self.replay.due(step):  # collective: the same steps on every rank
            self.heartbeat.beat(step, "replay")
            self.fail_fast.judge(step, {"replay": self.replay.check(step, micro[0])})
        local_loss, tokens = backward_over_micro_batches(
            self.model,
            micro,
            self.device,
            precision=train.precision,
            loss_scale=train.loss_scale,
            poison=faults.nan_at_step == step,
            flip_bit=faults.bitflip_bit if faults.bitflip_at_step == step else None,
            before_last_backward=lambda: self.heartbeat.beat(step, "backward"),
        )
        _sync(self.device)
        # Until DDP's last all-reduce completed: a moment all ranks share, so it includes the wait for
        # the slowest. The stragglers audit uses the monitor's busy_ms, which excludes that wait.
        extras = {"compute_ms": (time.perf_counter() - t0) * 1000}
        self.heartbeat.beat(step, "sync")
        metrics = self.monitor.end_step(local_loss, tokens=tokens, extras=extras)
        self.heartbeat.beat(step, "optimizer")
        apply_update(self.model, self.optimizer, self.scheduler, max_grad_norm=train.max_grad_norm)
        if self.audit is not None:
            if step == 0:
                self.audit.record_rng("rng_after_first_step", self.device)
            self.audit.after_optimizer_step(step)  # collective on parameter-check steps
            if self.audit.checked_at(step):  # every rank holds the same hash table: the same decision
                self.fail_fast.judge(
                    step,
                    parameter_outcomes(
                        self.audit.param_checks, self.audit.param_names(), self.audit.param_drift, self.audit.sharded_evidence()
                    ),
                )
        return metrics


def write_rows(writers: tuple[JsonlWriter, JsonlWriter], step: int, metrics: Any, lr: Optional[float]) -> None:
    """One steps.jsonl row per rank and one aggregates.jsonl row for this step."""
    steps_writer, aggregates_writer = writers
    data = metrics.to_dict()
    steps_writer.write_many(rank_rows(step, data))
    aggregates_writer.write(aggregate_row(step, data, lr))

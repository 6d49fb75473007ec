"""Measure worker consistency inside a live ``transformers.Trainer`` job (every rank runs it)::

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    HealthcheckCallback.attach(trainer, envelopes="baselines/my-job.json", stop_on_violation=True)
    trainer.train()   # torchrun --nproc_per_node 8 train.py

Why ``attach`` takes the trainer: callbacks receive ``kwargs["model"]``, which is the *unwrapped*
model; the DistributedDataParallel wrapper is ``trainer.model_wrapped``, created by
``Trainer._prepare_for_training`` just before ``on_train_begin`` fires. The per-rank loss is not
passed to callbacks either: the callback takes it with the same capture a ``--script`` probe uses
(:mod:`healthcheck.integrations.loss_capture`), so both report the token-weighted loss of each
rank's step whatever scaling the Trainer or TRL applied (TRL's ``SFTTrainer`` multiplies by the
world size and divides by a global token count), or say that it is not measured.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from healthcheck.integrations.live_envelopes import step_aggregates, window_envelopes
from healthcheck.integrations.loss_capture import LossCapture
from healthcheck.measure.loss_scale import unscaled

log = logging.getLogger(__name__)


class HealthcheckCallback(TrainerCallback):
    """Measure worker consistency in a live ``transformers.Trainer`` DDP run; optionally stop on a violation.

    The :class:`~healthcheck.measure.monitor.WorkerConsistencyMonitor` takes the DDP model's communication
    hook at ``on_train_begin``. Each optimizer step it gathers the metrics in
    ``on_pre_optimizer_step`` (after the last micro-step's synchronising backward, before
    ``optimizer.step()``, so gradient accumulation is measured on the accumulated gradient), and in
    ``on_step_end`` logs them through ``trainer.log`` as ``healthcheck/<metric>`` (so they reach
    whatever ``report_to`` names, and ``trainer.state.log_history``). Under ``fp16`` the norms are divided by the
    accelerator's GradScaler scale, and a step the scaler skips is neither logged nor judged.

    With ``envelopes``, each envelope's statistic (median, p95, ...) over the last ``window_steps``
    sampled steps after ``warmup_steps`` is checked once ``min_window_steps`` are in the window.
    Violations are logged and collected in :attr:`violations`; with ``stop_on_violation`` the
    callback sets ``control.should_training_stop``. Every rank sees the same gathered metrics, so all
    ranks stop at the same step. Envelopes from a probe baseline only mean something for the job
    they were recorded for: record a baseline from this job's own clean runs.

    Args:
        trainer: The ``Trainer`` (its ``model_wrapped`` is the DDP model; its ``compute_loss`` is wrapped).
        direction, sketch_dim, every, seed, local_from: Passed to the monitor.
        envelopes: A baseline path, a ``Baseline``, or ``{metric: (lower, upper)}`` judged on the median.
        stop_on_violation: Stop training at the first violated envelope.
        warmup_steps: Optimizer steps (0-based ``global_step``) excluded from the window.
        window_steps: Trailing sampled steps the window statistic is taken over.
        min_window_steps: Sampled steps needed before any envelope is judged.
        log_prefix: Prefix of the logged keys.
    """

    def __init__(
        self,
        trainer,
        *,
        direction: str = "sketch",
        sketch_dim: int = 4096,
        every: int = 1,
        seed: int = 0,
        local_from: str = "auto",
        envelopes: Any = None,
        stop_on_violation: bool = False,
        warmup_steps: int = 10,
        window_steps: int = 50,
        min_window_steps: int = 10,
        log_prefix: str = "healthcheck/",
    ):
        if min_window_steps < 1 or window_steps < min_window_steps:
            raise ValueError(f"min_window_steps: expected 1 <= min_window_steps <= window_steps, got {min_window_steps} and {window_steps}")
        self.trainer = trainer
        # overlap=False: each step's metrics are logged through trainer.log at that step, not one later.
        self.monitor_options: dict[str, Any] = {
            "direction": direction,
            "sketch_dim": sketch_dim,
            "every": every,
            "seed": seed,
            "local_from": local_from,
            "overlap": False,
        }
        self.checks = window_envelopes(envelopes)
        self.stop_on_violation = stop_on_violation
        self.warmup_steps, self.window_steps, self.min_window_steps = warmup_steps, window_steps, min_window_steps
        self.log_prefix = log_prefix
        self.monitor: Any = None
        self.violations: list[str] = []
        #: Why the per-rank loss is not measured, when it is not (the loss metrics are then absent).
        self.loss_note: str | None = None
        self.stopped_at_step: int | None = None
        self._capture: LossCapture | None = None
        self._pending: dict[str, float] | None = None
        self._pending_in_window = False
        self._scale: float | None = None
        self._window: list[dict[str, float]] = []

    @classmethod
    def attach(cls, trainer, **options: Any) -> HealthcheckCallback:
        """Create the callback for ``trainer`` and add it to the trainer's callbacks."""
        callback = cls(trainer, **options)
        trainer.add_callback(callback)
        return callback

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.nn.parallel import DistributedDataParallel

        from healthcheck.measure.monitor import WorkerConsistencyMonitor

        wrapped = self.trainer.model_wrapped
        # TrainingArguments(torch_compile=True): accelerate compiles the DDP model; the comm hook goes on the DDP inside.
        wrapped = getattr(wrapped, "_orig_mod", wrapped)
        if not isinstance(wrapped, DistributedDataParallel):
            if args.world_size > 1:
                kind = type(wrapped)
                raise TypeError(
                    "HealthcheckCallback needs DistributedDataParallel training; the Trainer wrapped the model in "
                    f"{kind.__module__}.{kind.__qualname__}"
                )
            log.warning("HealthcheckCallback: a single process has no workers to compare; the callback does nothing")
            return
        self.monitor = WorkerConsistencyMonitor(wrapped, **self.monitor_options)
        self._capture = LossCapture(read_settings=False).__enter__()
        self._capture.watch(wrapped.module)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.monitor is None or self._capture is None:
            return
        step_loss = self._capture.take()
        if step_loss.loss is None and self.loss_note is None:
            self.loss_note = f"step {state.global_step}: {step_loss.reason}"
            log.warning("HealthcheckCallback: loss not measured (%s); the gradient metrics still are", self.loss_note)
        # fp16 (accelerate's GradScaler): the gradients DDP reduced carry the loss scale; its value before update().
        self._scale = self._grad_scale()
        extras = {"grad_scale": self._scale} if self._scale is not None else None
        metrics = self.monitor.end_step(step_loss.loss, tokens=step_loss.tokens, extras=extras)  # a collective: every rank
        if metrics is None:
            return
        self._pending = step_aggregates(unscaled(metrics))
        self._pending_in_window = state.global_step >= self.warmup_steps

    def on_step_end(self, args, state, control, **kwargs):
        if self._pending is None:
            return
        scale = self._grad_scale()
        if self._scale is not None and scale is not None and scale < self._scale:
            # The GradScaler found an inf or NaN gradient (fp16 while its scale settles) and backed its scale off: the
            # update was skipped, so its non-finite gradients are no evidence. Every rank skips alike. (accelerate's
            # optimizer_step_was_skipped misses the skip of an optimizer that takes the scaling itself: fused AdamW.)
            self._pending = None
            return
        if self._pending_in_window:
            self._window = [*self._window, self._pending][-self.window_steps :]
        logs = {f"{self.log_prefix}{name}": value for name, value in self._pending.items()}
        self._pending = None
        found = self._judge()
        if found:
            self.violations += found
            logs[f"{self.log_prefix}violations"] = float(len(found))
            if state.is_world_process_zero:
                for message in found:
                    log.warning("healthcheck: step %d: %s", state.global_step, message)
            if self.stop_on_violation and self.stopped_at_step is None:
                self.stopped_at_step = state.global_step
                control.should_training_stop = True
        # Trainer.log runs the on_log handler, which clears should_log: keep the flag that
        # DefaultFlowCallback just set, or the Trainer's own loss line for this step is dropped.
        should_log = control.should_log
        self.trainer.log(logs)
        control.should_log = self.trainer.control.should_log = should_log
        return control

    def _grad_scale(self) -> float | None:
        """The accelerator's GradScaler scale (``fp16``), None without one."""
        scaler = getattr(getattr(self.trainer, "accelerator", None), "scaler", None)
        return float(scaler.get_scale()) if scaler is not None else None

    def _judge(self) -> list[str]:
        if len(self._window) < self.min_window_steps:
            return []
        found = []
        for check in self.checks:
            message = check.fails([row.get(check.metric) for row in self._window])
            if message:
                found.append(message)
        return found

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None and self._capture is not None:
            self.monitor.close()
            self._capture.close()
            self.monitor = self._capture = None

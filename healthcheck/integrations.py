"""healthcheck outside its own CLI: an OpenMetrics export for CI dashboards and a transformers callback.

OpenMetrics (GitLab's ``artifacts:reports:metrics``, or any Prometheus-style scraper)::

    python -m healthcheck.integrations openmetrics RUN_DIR > metrics.txt

Live runs: measure worker consistency inside a real ``transformers.Trainer`` job (every rank runs it)::

    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    HealthcheckCallback.attach(trainer, envelopes="baselines/my-job.json", stop_on_violation=True)
    trainer.train()   # torchrun --nproc_per_node 8 train.py

Why ``attach`` takes the trainer: callbacks receive ``kwargs["model"]``, which is the *unwrapped*
model; the DistributedDataParallel wrapper is ``trainer.model_wrapped``, created by
``Trainer._prepare_for_training`` just before ``on_train_begin`` fires. The per-rank loss is not
passed to callbacks either, so the callback also wraps ``trainer.compute_loss`` for the duration of
training to tally each micro-batch's summed token loss and label-token count.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from healthcheck.artifacts import RunResult
from healthcheck.metrics import window_summary
from healthcheck.records import aggregate_row
from healthcheck.summary import METRICS

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- OpenMetrics

#: Window statistics exported per metric, in this order (the ``statistic`` label).
STATISTICS = ("median", "p95", "min", "max")


def format_openmetrics_value(value: float) -> str:
    """A sample value as OpenMetrics writes it.

    >>> [format_openmetrics_value(v) for v in (0.5, 3, float("inf"), float("nan"))]
    ['0.5', '3.0', '+Inf', 'NaN']
    """
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def escape_text(text: str) -> str:
    r"""Escape a label value or HELP text as OpenMetrics does: backslash, double quote, newline.

    >>> escape_text('a"b\\c')
    'a\\"b\\\\c'
    """
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    inner = ",".join(f'{key}="{escape_text(value)}"' for key, value in labels.items())
    return "{" + inner + "}" if inner else ""


@dataclasses.dataclass
class _Family:
    """One metric family: metadata lines, then its samples (OpenMetrics keeps a family contiguous)."""

    name: str
    help: str
    unit: str = ""
    samples: list[tuple[dict[str, str], float]] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"# TYPE {self.name} gauge"]
        if self.unit:
            out.append(f"# UNIT {self.name} {self.unit}")
        out.append(f"# HELP {self.name} {escape_text(self.help)}")
        out += [f"{self.name}{_labels(labels)} {format_openmetrics_value(value)}" for labels, value in self.samples]
        return out


def openmetrics_from_result(result: RunResult, *, prefix: str = "healthcheck") -> str:
    """``RUN_DIR/result.json`` as OpenMetrics text: one gauge family per metric, ``# EOF`` last.

    Each summary metric becomes ``<prefix>_<metric>{probe="...",statistic="median|p95|min|max"}``
    over the post-warmup window; missing (None) statistics are left out rather than written as NaN,
    so a short or crashed run exports what it has. Run-level gauges follow: whether the probe
    completed, steps completed, window steps, world size and wall time.

    >>> from healthcheck.config import ProbeConfig
    >>> from healthcheck.artifacts import MetricSummary, Timing
    >>> result = RunResult(name="demo", status="complete", config=ProbeConfig(), config_fingerprint="f",
    ...     timing=Timing(started_at="t"), steps_planned=2, steps_completed=2,
    ...     summary={"loss_std": MetricSummary(median=0.25, p95=0.5, min=0.125, max=0.5, n=2)})
    >>> print(openmetrics_from_result(result).splitlines()[2])
    healthcheck_loss_std{probe="demo",statistic="median"} 0.25
    """
    probe = {"probe": result.name}
    families: list[_Family] = []
    for metric in sorted(result.summary):
        summary = result.summary[metric]
        family = _Family(f"{prefix}_{metric}", f"{METRICS.get(metric, metric)} (window statistic)")
        for statistic in STATISTICS:
            value = getattr(summary, statistic)
            if value is not None:
                family.samples.append(({**probe, "statistic": statistic}, value))
        families.append(family)
    complete = 1.0 if result.status == "complete" else 0.0
    world_size = result.environment.world_size if result.environment else None
    run_gauges = [  # (name, help, unit, value)
        ("probe_complete", "1 when every planned step ran (status complete), else 0", "", complete),
        ("steps_completed", "optimizer steps the probe completed", "", result.steps_completed),
        ("window_steps", "sampled steps inside the summary window", "", result.window_steps),
        ("world_size", "data-parallel workers", "", world_size),
        ("wall_seconds", "whole probe wall time, start-up included", "seconds", result.timing.wall_s),
    ]
    for name, help_text, unit, value in run_gauges:
        family = _Family(f"{prefix}_{name}", help_text, unit)
        if value is not None:
            family.samples.append((dict(probe), value))
        families.append(family)
    lines = [line for family in families if family.samples for line in family.lines()]
    return "\n".join([*lines, "# EOF"]) + "\n"


# --------------------------------------------------------------------------- live runs: envelopes


@dataclasses.dataclass(frozen=True)
class EnvelopeCheck:
    """One metric's approved range for a window statistic of the live run's per-step values."""

    metric: str
    statistic: str
    lower: float
    upper: float

    def fails(self, window: Sequence[float | None]) -> str | None:
        """A one-line message when the window's statistic is outside ``[lower, upper]``, else None.

        >>> EnvelopeCheck("cosine_mean", "median", 0.1, 0.9).fails([0.95, 0.97, 0.99])
        'cosine_mean median 0.97 is above its envelope [0.1, 0.9] over 3 steps'
        >>> EnvelopeCheck("cosine_mean", "median", 0.1, 0.9).fails([0.5]) is None
        True
        """
        value = window_summary(window)[self.statistic]
        if value is None:
            return None
        if self.lower <= value <= self.upper:
            return None
        side = "below" if value < self.lower else "above"
        envelope = f"[{self.lower:.4g}, {self.upper:.4g}]"
        return f"{self.metric} {self.statistic} {value:.4g} is {side} its envelope {envelope} over {len(window)} steps"


def envelope_checks(envelopes: Any) -> list[EnvelopeCheck]:
    """Normalise the callback's ``envelopes`` argument to checks.

    Accepts a baseline file path (read with :func:`healthcheck.baseline.load_baseline`), a
    :class:`~healthcheck.baseline.Baseline`, or a mapping ``{metric: (lower, upper)}`` judged on the
    median.

    >>> envelope_checks({"loss_std": (0.0, 0.5)})
    [EnvelopeCheck(metric='loss_std', statistic='median', lower=0.0, upper=0.5)]
    """
    from healthcheck.baseline import Baseline, load_baseline

    if envelopes is None:
        return []
    if isinstance(envelopes, (str, Path)):
        envelopes = load_baseline(envelopes)
    if isinstance(envelopes, Baseline):
        return [EnvelopeCheck(m, e.statistic, e.lower, e.upper) for m, e in envelopes.envelopes.items()]
    checks = []
    for metric, bounds in envelopes.items():
        if metric not in METRICS:
            raise ValueError(f"envelopes: unknown metric {metric!r} (known: {', '.join(METRICS)})")
        lower, upper = bounds
        if not lower <= upper:
            raise ValueError(f"envelopes.{metric}: lower {lower} is above upper {upper}")
        checks.append(EnvelopeCheck(metric, "median", float(lower), float(upper)))
    return checks


def step_aggregates(metrics) -> dict[str, float]:
    """The per-step values of :data:`healthcheck.summary.METRICS` (the names baselines use), finite only."""
    row = aggregate_row(0, metrics.to_dict())
    wanted = set(METRICS) | {"mean_grad_norm", "tokens_total"}
    return {
        name: float(value)
        for name, value in row.items()
        if name in wanted and isinstance(value, (int, float)) and math.isfinite(value)
    }


# --------------------------------------------------------------------------- live runs: the callback


def _label_tokens(inputs: Mapping[str, Any], shifted: bool):
    """Tokens that carry loss in one micro-batch, as a device tensor (no host sync), or None."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs.get("labels")
        if labels is None:
            return None
        if shifted and labels.dim() >= 2:
            labels = labels[..., 1:]
    return (labels != -100).sum()


class _LossTally:
    """Sums each training micro-batch's token loss and loss-carrying tokens while training runs.

    Wraps ``trainer.compute_loss`` (the token count and ``num_items_in_batch`` are known there) and
    hooks the model's forward (its own ``outputs.loss``, copied before the Trainer rescales that
    tensor in place by the world size). A causal LM's loss is sum/num_items_in_batch when the Trainer
    passes that count (models that accept loss kwargs), else the micro-batch mean; multiplying back
    gives the summed token loss exactly. A custom ``compute_loss_func`` or label smoothing leaves no
    ``outputs.loss``; the loss ``compute_loss`` returns is then taken as the micro-batch mean.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.loss_sum = None
        self.tokens = None
        self._model_loss = None
        self._had_instance_attr = "compute_loss" in vars(trainer)
        self._original = trainer.compute_loss
        trainer.compute_loss = self._compute_loss
        self._hook = trainer.model.register_forward_hook(self._keep_model_loss)

    def _keep_model_loss(self, module, args, output) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else None
        self._model_loss = loss.detach().float().clone() if loss is not None and module.training else None

    def _compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not model.training:  # evaluation goes through compute_loss too
            return self._original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        config = getattr(self.trainer.model, "config", None)
        tokens = _label_tokens(inputs, shifted=not getattr(config, "is_encoder_decoder", False))
        count = tokens if tokens is not None else 1
        self._model_loss = None
        returned = self._original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self._model_loss is not None:
            passed = num_items_in_batch is not None and getattr(self.trainer, "model_accepts_loss_kwargs", False)
            summed = self._model_loss * (num_items_in_batch if passed else count)
        else:
            loss = returned[0] if return_outputs else returned
            summed = loss.detach().float().mean() * count
        self.loss_sum = summed if self.loss_sum is None else self.loss_sum + summed
        self.tokens = count if self.tokens is None else self.tokens + count
        return returned

    def take(self):
        """This rank's token-mean loss and token count since the last call; resets the tally."""
        import torch

        if self.loss_sum is None:
            return float("nan"), None
        tokens = torch.as_tensor(self.tokens)
        loss = self.loss_sum / torch.clamp(tokens, min=1)
        self.loss_sum = self.tokens = None
        return loss, tokens

    def restore(self) -> None:
        self._hook.remove()
        if self._had_instance_attr:
            self.trainer.compute_loss = self._original
        else:
            del self.trainer.compute_loss


class HealthcheckCallback(TrainerCallback):
    """Measure worker consistency in a live ``transformers.Trainer`` DDP run; optionally stop on a violation.

    The :class:`~healthcheck.monitor.WorkerConsistencyMonitor` takes the DDP model's communication
    hook at ``on_train_begin``. Each optimizer step it gathers the metrics in
    ``on_pre_optimizer_step`` (after the last micro-step's synchronising backward, before
    ``optimizer.step()``, so gradient accumulation is measured on the accumulated gradient), and in
    ``on_step_end`` logs them through ``trainer.log`` as ``healthcheck/<metric>`` (so they reach
    whatever ``report_to`` names, and ``trainer.state.log_history``).

    With ``envelopes``, each envelope's statistic (median, p95, ...) over the last ``window_steps``
    sampled steps after ``warmup_steps`` is checked once ``min_window_steps`` are in the window.
    Violations are logged and collected in :attr:`violations`; with ``stop_on_violation`` the
    callback sets ``control.should_training_stop``. Every rank sees the same gathered metrics, so all
    ranks stop at the same step. Envelopes from a probe baseline only mean something for the job
    they were recorded for: record a baseline from this job's own clean runs.

    Args:
        trainer: The ``Trainer`` (its ``model_wrapped`` is the DDP model; its ``compute_loss`` is wrapped).
        direction, sketch_dim, every, seed: Passed to the monitor.
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
        envelopes: Any = None,
        stop_on_violation: bool = False,
        warmup_steps: int = 10,
        window_steps: int = 50,
        min_window_steps: int = 10,
        log_prefix: str = "healthcheck/",
    ):
        if min_window_steps < 1 or window_steps < min_window_steps:
            raise ValueError(
                f"min_window_steps: expected 1 <= min_window_steps <= window_steps, got {min_window_steps} and {window_steps}"
            )
        self.trainer = trainer
        self.monitor_options = {"direction": direction, "sketch_dim": sketch_dim, "every": every, "seed": seed}
        self.checks = envelope_checks(envelopes)
        self.stop_on_violation = stop_on_violation
        self.warmup_steps, self.window_steps, self.min_window_steps = warmup_steps, window_steps, min_window_steps
        self.log_prefix = log_prefix
        self.monitor = None
        self.violations: list[str] = []
        self.stopped_at_step: int | None = None
        self._tally: _LossTally | None = None
        self._pending: dict[str, float] | None = None
        self._window: list[dict[str, float]] = []

    @classmethod
    def attach(cls, trainer, **options: Any) -> HealthcheckCallback:
        """Create the callback for ``trainer`` and add it to the trainer's callbacks."""
        callback = cls(trainer, **options)
        trainer.add_callback(callback)
        return callback

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.nn.parallel import DistributedDataParallel

        from healthcheck.monitor import WorkerConsistencyMonitor

        wrapped = self.trainer.model_wrapped
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
        self._tally = _LossTally(self.trainer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.monitor is None:
            return
        loss, tokens = self._tally.take()
        metrics = self.monitor.end_step(loss, tokens=tokens)  # a collective: every rank, every step
        if metrics is None:
            return
        self._pending = step_aggregates(metrics)
        if state.global_step >= self.warmup_steps:
            self._window = [*self._window, self._pending][-self.window_steps:]

    def on_step_end(self, args, state, control, **kwargs):
        if self._pending is None:
            return
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
        if self.monitor is not None:
            self.monitor.close()
            self._tally.restore()
            self.monitor = self._tally = None


# --------------------------------------------------------------------------- command line


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m healthcheck.integrations openmetrics RUN_DIR [--output FILE]``; exit 2 on a bad run dir."""
    import argparse

    from healthcheck.artifacts import load_result, write_text_atomic
    from healthcheck.errors import HealthcheckError

    parser = argparse.ArgumentParser(prog="python -m healthcheck.integrations", description="Export a finished probe run.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export = commands.add_parser("openmetrics", help="RUN_DIR/result.json summary as OpenMetrics text (GitLab metrics report)")
    export.add_argument("run_dir", type=Path)
    export.add_argument("--output", type=Path, help="write here instead of stdout")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        text = openmetrics_from_result(load_result(args.run_dir))
    except HealthcheckError as exc:
        print(f"healthcheck: error: {exc.message}", file=sys.stderr)
        return int(exc.exit_code)
    if args.output:
        write_text_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

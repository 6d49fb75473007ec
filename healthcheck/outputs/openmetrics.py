"""A finished run's summary as OpenMetrics text, for GitLab's ``artifacts:reports:metrics`` or any
Prometheus-style scraper. Imports neither torch nor transformers::

    python -m healthcheck.integrations openmetrics RUN_DIR > metrics.txt
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from healthcheck.artifacts import RunResult, load_result
from healthcheck.errors import HealthcheckError, one_line
from healthcheck.files import write_text_atomic
from healthcheck.judge.envelope import METRICS

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
        family = _Family(f"{prefix}_{metric}", f"{METRICS[metric].description if metric in METRICS else metric} (window statistic)")
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


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m healthcheck.integrations openmetrics RUN_DIR [--output FILE]``; exit 2 on a bad run dir."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m healthcheck.integrations", description="Export a finished probe run.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export = commands.add_parser("openmetrics", help="RUN_DIR/result.json summary as OpenMetrics text (GitLab metrics report)")
    export.add_argument("run_dir", type=Path)
    export.add_argument("--output", type=Path, help="write here instead of stdout")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        text = openmetrics_from_result(load_result(args.run_dir))
    except HealthcheckError as exc:
        print(f"healthcheck: error: {one_line(exc.message)}", file=sys.stderr)
        return int(exc.exit_code)
    if args.output:
        write_text_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    return 0

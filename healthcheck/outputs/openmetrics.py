"""A finished run's summary as OpenMetrics text, for GitLab's ``artifacts:reports:metrics`` or any
Prometheus-style scraper, written by ``prometheus_client``. Imports neither torch nor transformers::

    python -m healthcheck.integrations openmetrics RUN_DIR > metrics.txt
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from healthcheck.artifacts import RunResult, load_result
from healthcheck.errors import HealthcheckError, one_line
from healthcheck.files import write_text_atomic
from healthcheck.judge.envelope import METRICS

#: Window statistics exported per metric, in this order (the ``statistic`` label).
STATISTICS = ("median", "p95", "min", "max")


class _Families(Collector):
    """A fixed list of metric families, for a one-off registry (prometheus_client writes from a registry)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def openmetrics_from_result(result: RunResult, *, prefix: str = "healthcheck") -> str:
    """``RUN_DIR/result.json`` as OpenMetrics text: one gauge family per metric, ``# EOF`` last.

    Each summary metric becomes ``<prefix>_<metric>{probe="...",statistic="median|p95|min|max"}``
    over the post-warmup window; missing (None) statistics are left out rather than written as NaN,
    so a short or crashed run exports what it has, and a family with no sample is left out. Run-level
    gauges follow: whether the probe completed, steps completed, window steps, world size and wall time.

    >>> from healthcheck.config import ProbeConfig
    >>> from healthcheck.artifacts import MetricSummary, Timing
    >>> result = RunResult(name="demo", status="complete", config=ProbeConfig(), config_fingerprint="f",
    ...     timing=Timing(started_at="t"), steps_planned=2, steps_completed=2,
    ...     summary={"loss_std": MetricSummary(median=0.25, p95=0.5, min=0.125, max=0.5, n=2)})
    >>> print(openmetrics_from_result(result).splitlines()[2])
    healthcheck_loss_std{probe="demo",statistic="median"} 0.25
    """
    families: list[Metric] = []
    for metric in sorted(result.summary):
        summary = result.summary[metric]
        description = METRICS[metric].description if metric in METRICS else metric
        family = GaugeMetricFamily(f"{prefix}_{metric}", f"{description} (window statistic)", labels=["probe", "statistic"])
        for statistic in STATISTICS:
            value = getattr(summary, statistic)
            if value is not None:
                family.add_metric([result.name, statistic], value)
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
        family = GaugeMetricFamily(f"{prefix}_{name}", help_text, labels=["probe"], unit=unit)
        if value is not None:
            family.add_metric([result.name], value)
        families.append(family)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([family for family in families if family.samples]))
    return generate_latest(registry).decode("utf-8")


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

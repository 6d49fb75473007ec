"""``healthcheck baseline show PATH``: a baseline as plain text, provenance first, then one row per envelope."""

from __future__ import annotations

import io

from healthcheck.judge.baseline import Baseline


def render_baseline_text(baseline: Baseline, width: int = 110) -> str:
    """Plain text for ``healthcheck baseline show PATH``: provenance, then one row per envelope."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"baseline {baseline.name}", title_justify="left")
    for column in ("metric", "statistic", "scale", "lower", "center", "upper", "per-run values"):
        table.add_column(column, justify="right" if column in ("lower", "center", "upper") else "left")
    for metric, env in baseline.envelopes.items():
        values = ", ".join(f"{v:.4g}" for v in env.values)
        table.add_row(metric, env.statistic, env.scale, f"{env.lower:.4g}", f"{env.center:.4g}", f"{env.upper:.4g}", values)
    seeds = ", ".join(str(r.seed) for r in baseline.runs)
    header = (
        f"approved by {baseline.approved_by} at {baseline.created_at}: {baseline.reason}\n"
        f"healthcheck {baseline.healthcheck_version}, torch {baseline.torch_version}, "
        f"transformers {baseline.transformers_version}; {baseline.world_size} x {baseline.device_type}\n"
        f"config {baseline.config_fingerprint}; fitted from {len(baseline.runs)} runs (seeds {seeds})\n"
    )
    if baseline.commit:
        dirty = " (dirty)" if baseline.commit.dirty else ""
        branch = f" on {baseline.commit.branch}" if baseline.commit.branch else ""
        header += f"code: commit {baseline.commit.id[:12]}{dirty}{branch}\n"
    header += f"false-alarm target {baseline.false_alarm_rate:.2%} for the whole verdict on an unchanged config\n"
    if baseline.audits:
        header += "approved audit deviations: " + "; ".join(f"{k} = {v!r}" for k, v in sorted(baseline.audits.items())) + "\n"
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(header, table, sep="\n", highlight=False)
    return buffer.getvalue()

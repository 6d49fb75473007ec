"""The terminal report (rich): verdict banner, one row per check, per-rank attribution, config diff.

ASCII boxes and glyphs when the console is not a unicode terminal (CI logs); no ANSI at all under
NO_COLOR. A pure function of (result, verdict, step rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from healthcheck.artifacts import RankSummary, RunResult, Standout
from healthcheck.judge.attribution import (
    PERSISTENCE_P,
    RANK_FIELDS,
    STANDOUT_Z,
    find_standouts,
    rank_summaries,
    standout_sentences,
)
from healthcheck.judge.findings import Verdict
from healthcheck.outputs.text import (
    CHECK_COLUMNS,
    RANK_FORMATS,
    check_rows,
    config_value,
    format_number,
    ranks_suffix,
    run_line,
    verdict_headline,
)

#: The terminal shows at most this many ranks (the most extreme); report.md shows all.
MAX_TERMINAL_RANKS = 16

_ASCII_SIMPLE = box.Box("    \n    \n -- \n    \n    \n -- \n    \n    \n", ascii=True)
_STYLES = {"pass": "bold green", "fail": "bold red", "warn": "bold yellow", "head": "bold", "dim": "dim"}


@dataclass(frozen=True)
class _Glyphs:
    dash: str
    arrow: str
    bullet: str
    separator: str


_UNICODE = _Glyphs(dash="—", arrow="→", bullet="•", separator=" · ")
_ASCII = _Glyphs(dash="--", arrow="->", bullet="-", separator="; ")


def _is_plain(console: Console) -> bool:
    """ASCII boxes and glyphs unless writing to a unicode-capable terminal (CI logs are not terminals)."""
    return not console.is_terminal or console.options.ascii_only


def render_terminal(
    result: RunResult,
    verdict: Optional[Verdict],
    console: Optional[Console] = None,
    *,
    steps: Optional[Sequence[Mapping[str, Any]]] = None,
) -> None:
    """Print the whole report: banner, checks, per-rank attribution, config diff, non-finite events.

    ``console``: None prints to stdout. ``steps``: the ``steps.jsonl`` rows; without them a rank is
    named as standing out on its z alone (the persistence test needs the per-step values).
    """
    console = console or Console(highlight=False)
    plain = _is_plain(console)
    glyphs = _ASCII if plain else _UNICODE
    # NO_COLOR: rich alone strips colours but keeps bold/dim; resolving every style to none emits no ANSI.
    styles = {key: ("" if console.no_color else value) for key, value in _STYLES.items()}
    per_rank = rank_summaries(result, steps)
    standouts = find_standouts(per_rank, steps, result.window_start_step)
    sentences = standout_sentences(standouts)

    label, sentence, style_key = verdict_headline(verdict, result.status, result.failure)
    banner = Text(f"{label} {glyphs.dash} {sentence}", style=styles[style_key])
    for line in sentences:
        banner.append("\n" + line, style=styles["fail"] if verdict and verdict.status == "fail" else "")
    console.print(Panel(banner, box=box.ASCII if plain else box.HEAVY, border_style=styles[style_key]))
    console.print(Text(run_line(result, glyphs.separator), style=styles["dim"]))

    if verdict is not None:
        for note in verdict.notes:
            console.print(Text(f"note: {note}", style=styles["warn"]))
        _print_checks(console, verdict, styles, plain, glyphs)
    _print_attribution(console, result, per_rank, standouts, styles, plain)
    if verdict is not None:
        _print_config_diff(console, verdict, styles, glyphs)
    for event in result.nonfinite:
        console.print(Text(f"non-finite {event.what} on rank {event.rank} at step {event.step}", style=styles["fail"]))


def _table(plain: bool, header_style: str) -> Table:
    # No vertical rules: 6-9 columns then fit in 80 columns without folding the numbers.
    return Table(box=_ASCII_SIMPLE if plain else box.SIMPLE, header_style=header_style, pad_edge=False, show_edge=False)


def _print_checks(console: Console, verdict: Verdict, styles: dict[str, str], plain: bool, glyphs: _Glyphs) -> None:
    rows = check_rows(verdict)
    console.print(Text(f"\nChecks ({len(rows)}, {len(verdict.failures)} failed)", style=styles["head"]))
    if verdict.baseline_path:
        console.print(Text(f"baseline: {verdict.baseline_path}", style=styles["dim"]))
    table = _table(plain, styles["head"])
    for name in CHECK_COLUMNS:
        numeric = name in ("observed", "margin")
        table.add_column(name, justify="right" if numeric else "left", no_wrap=numeric or name == "status")
    for finding, cells in rows:
        table.add_row(*cells, style="" if finding.passed else styles["fail"])
    console.print(table)
    for finding in verdict.failures:
        console.print(Text(f"{glyphs.bullet} {finding.check}: {finding.message}{ranks_suffix(finding)}", style=styles["fail"]))
    for finding in verdict.findings:
        if not finding.measured:  # why it judged nothing: an unmeasured check is not a pass
            console.print(Text(f"{glyphs.bullet} {finding.check}: {finding.message}", style=styles["dim"]))


def _print_attribution(
    console: Console,
    result: RunResult,
    per_rank: Sequence[RankSummary],
    standouts: Sequence[Standout],
    styles: dict[str, str],
    plain: bool,
) -> None:
    if not per_rank:
        return
    marked = {(s.rank, s.metric) for s in standouts}
    shown = list(per_rank)
    if len(shown) > MAX_TERMINAL_RANKS:
        shown = sorted(shown, key=_max_abs_z, reverse=True)[:MAX_TERMINAL_RANKS]
        shown.sort(key=lambda s: s.rank)
    title = f"\nPer-rank means over the window (steps >= {result.window_start_step}); z against the other ranks"
    console.print(Text(title, style=styles["head"]))
    table = _table(plain, styles["head"])
    table.add_column("rank", justify="right")
    for header in ("loss", "grad\nnorm", "cosine\nto mean", "step\nms"):
        table.add_column(header, justify="right", no_wrap=True)
        table.add_column("z", justify="right", no_wrap=True)
    for summary in shown:
        cells: list[str | Text] = [str(summary.rank)]
        for metric in RANK_FIELDS:
            z = getattr(summary, f"z_{metric}")
            star = "*" if (summary.rank, metric) in marked else ""
            z_cell = Text(format_number(z, "+.1f") + star, style=styles["fail"] if star else "")
            cells += [format_number(getattr(summary, metric), RANK_FORMATS[metric]), z_cell]
        table.add_row(*cells, style=styles["fail"] if any(r == summary.rank for r, _ in marked) else "")
    console.print(table)
    legend = f"* stands out: |z| >= {STANDOUT_Z:g}, off the same way in most steps (sign test p <= {PERSISTENCE_P:g})"
    console.print(Text(legend, style=styles["dim"]))
    if len(per_rank) > len(shown):
        console.print(Text(f"({len(per_rank) - len(shown)} ranks closest to the rest not shown)", style=styles["dim"]))


def _max_abs_z(summary: RankSummary) -> float:
    zs = [getattr(summary, f"z_{m}") for m in RANK_FIELDS]
    return max((abs(z) for z in zs if z is not None and math.isfinite(z)), default=0.0)


def _print_config_diff(console: Console, verdict: Verdict, styles: dict[str, str], glyphs: _Glyphs) -> None:
    if not verdict.config_diff:
        console.print(Text("\nConfig: identical to the baseline's snapshot", style=styles["dim"]))
        return
    console.print(Text(f"\nConfig changes vs the baseline ({len(verdict.config_diff)})", style=styles["head"]))
    for change in verdict.config_diff:
        console.print(Text(f"  {change.path}: {config_value(change.old)} {glyphs.arrow} {config_value(change.new)}", style=styles["warn"]))

"""The report: what moved, by how much against what bound, on which rank, after which config change.

Rendered on every run, pass or fail, from ``result.json``, ``verdict.json`` and ``steps.jsonl``:

* the terminal (rich): verdict banner, one row per check, per-rank attribution, config diff. ASCII
  boxes and glyphs when the console is not a unicode terminal (CI logs); no ANSI at all under NO_COLOR;
* ``report.md`` (also appended to ``$GITHUB_STEP_SUMMARY``), ``junit.xml`` and ``plots/*.png``;
* ``::error`` annotations on stdout when ``GITHUB_ACTIONS=true``.

Renderers are pure functions of (result, verdict, step rows). Re-render a finished run with::

    healthcheck report runs/default-20251122T010000.000000Z
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from healthcheck.artifacts import (
    AGGREGATES_FILE,
    STEPS_FILE,
    VERDICT_FILE,
    RankSummary,
    RunResult,
    load_result,
    read_jsonl,
    write_text_atomic,
)
from healthcheck.attribution import (
    ATTRIBUTION_METRICS,
    PERSISTENCE_P,
    STANDOUT_Z,
    Standout,
    find_standouts,
    rank_summaries,
    standout_sentences,
)
from healthcheck.ci_outputs import emit_annotations, render_junit
from healthcheck.findings import (
    Finding,
    Verdict,
    exit_code_for,
    format_envelope,
    format_number,
    ranks_suffix,
    verdict_headline,
)

log = logging.getLogger(__name__)

REPORT_FILE = "report.md"
JUNIT_FILE = "junit.xml"
PLOTS_DIR = "plots"

#: How each attribution metric prints (losses and cosines differ in the third decimal).
_RANK_FORMATS = {"loss": ".3f", "grad_norm": ".4g", "cosine_to_mean": ".3f", "compute_ms": ".1f"}
#: The terminal shows at most this many ranks (the most extreme); report.md shows all.
MAX_TERMINAL_RANKS = 16

_ASCII_SIMPLE = box.Box("    \n    \n -- \n    \n    \n -- \n    \n    \n", ascii=True)
_STYLES = {"pass": "bold green", "fail": "bold red", "warn": "bold yellow", "head": "bold", "dim": "dim"}
_COLUMNS = ("check", "statistic", "observed", "envelope", "status", "margin")


@dataclass(frozen=True)
class _Glyphs:
    dash: str
    arrow: str
    bullet: str
    separator: str


_UNICODE = _Glyphs(dash="—", arrow="→", bullet="•", separator=" · ")
_ASCII = _Glyphs(dash="--", arrow="->", bullet="-", separator="; ")


# --------------------------------------------------------------------------- verdict


def check_rows(verdict: Verdict) -> list[tuple[Finding, tuple[str, ...]]]:
    """One row per finding, failures first, then the closest to a bound: cells as in ``_COLUMNS``."""
    ordered = sorted(verdict.findings, key=lambda f: (f.passed, f.margin if f.margin is not None else math.inf))
    return [
        (
            f,
            (
                f.metric or f.check,
                f.statistic or "-",
                format_number(f.observed),
                format_envelope(f),
                "ok" if f.passed else "FAIL",
                format_number(f.margin, "+.2f"),
            ),
        )
        for f in ordered
    ]


# --------------------------------------------------------------------------- per-rank attribution


# --------------------------------------------------------------------------- terminal


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
    console.print(Text(_run_line(result, glyphs), style=styles["dim"]))

    if verdict is not None:
        for note in verdict.notes:
            console.print(Text(f"note: {note}", style=styles["warn"]))
        _print_checks(console, verdict, styles, plain, glyphs)
    _print_attribution(console, result, per_rank, standouts, styles, plain)
    if verdict is not None:
        _print_config_diff(console, verdict, styles, glyphs)
    for event in result.nonfinite:
        console.print(Text(f"non-finite {event.what} on rank {event.rank} at step {event.step}", style=styles["fail"]))


def _run_line(result: RunResult, glyphs: _Glyphs) -> str:
    env = result.environment
    where = f"{env.world_size} ranks ({env.device_type}/{env.backend}, {env.nnodes} node{'s' * (env.nnodes > 1)})" if env else ""
    parts = [
        f"probe {result.name}",
        where,
        f"steps {result.steps_completed}/{result.steps_planned}, window from step {result.window_start_step}"
        f" ({result.window_steps} sampled)",
        f"{result.timing.wall_s:.1f} s" if result.timing.wall_s is not None else "",
        f"config {result.config_fingerprint}",
    ]
    return glyphs.separator.join(p for p in parts if p)


def _table(plain: bool, header_style: str) -> Table:
    # No vertical rules: 6-9 columns then fit in 80 columns without folding the numbers.
    return Table(box=_ASCII_SIMPLE if plain else box.SIMPLE, header_style=header_style, pad_edge=False, show_edge=False)


def _print_checks(console: Console, verdict: Verdict, styles: dict[str, str], plain: bool, glyphs: _Glyphs) -> None:
    rows = check_rows(verdict)
    console.print(Text(f"\nChecks ({len(rows)}, {len(verdict.failures)} failed)", style=styles["head"]))
    if verdict.baseline_path:
        console.print(Text(f"baseline: {verdict.baseline_path}", style=styles["dim"]))
    table = _table(plain, styles["head"])
    for name in _COLUMNS:
        numeric = name in ("observed", "margin")
        table.add_column(name, justify="right" if numeric else "left", no_wrap=numeric or name == "status")
    for finding, cells in rows:
        table.add_row(*cells, style="" if finding.passed else styles["fail"])
    console.print(table)
    for finding in verdict.failures:
        console.print(Text(f"{glyphs.bullet} {finding.check}: {finding.message}{ranks_suffix(finding)}", style=styles["fail"]))


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
        cells = [str(summary.rank)]
        for metric in ATTRIBUTION_METRICS:
            z = getattr(summary, f"z_{metric}")
            star = "*" if (summary.rank, metric) in marked else ""
            cells += [format_number(getattr(summary, metric), _RANK_FORMATS[metric]), Text(format_number(z, "+.1f") + star, style=styles["fail"] if star else "")]
        table.add_row(*cells, style=styles["fail"] if any(r == summary.rank for r, _ in marked) else "")
    console.print(table)
    legend = f"* stands out: |z| >= {STANDOUT_Z:g}, off the same way in most steps (sign test p <= {PERSISTENCE_P:g})"
    console.print(Text(legend, style=styles["dim"]))
    if len(per_rank) > len(shown):
        console.print(Text(f"({len(per_rank) - len(shown)} ranks closest to the rest not shown)", style=styles["dim"]))


def _max_abs_z(summary: RankSummary) -> float:
    zs = [getattr(summary, f"z_{m}") for m in ATTRIBUTION_METRICS]
    return max((abs(z) for z in zs if z is not None and math.isfinite(z)), default=0.0)


def _value(value: Any) -> str:
    r"""A config value on one line: plain strings bare, everything else (and multi-line prompts) as JSON.

    >>> _value("rank0_differs"), _value(None), _value("### Input:\n{input}")
    ('rank0_differs', 'null', '"### Input:\\n{input}"')
    """
    if isinstance(value, str) and value and value.isprintable() and value.strip() == value:
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _print_config_diff(console: Console, verdict: Verdict, styles: dict[str, str], glyphs: _Glyphs) -> None:
    if not verdict.config_diff:
        console.print(Text("\nConfig: identical to the baseline's snapshot", style=styles["dim"]))
        return
    console.print(Text(f"\nConfig changes vs the baseline ({len(verdict.config_diff)})", style=styles["head"]))
    for change in verdict.config_diff:
        console.print(Text(f"  {change.path}: {_value(change.old)} {glyphs.arrow} {_value(change.new)}", style=styles["warn"]))


# --------------------------------------------------------------------------- markdown


def _md(text: Any) -> str:
    """Escape for a markdown table cell or list item: no pipes, no raw HTML, one line."""
    return re.sub(r"\s*[\r\n]+\s*", " ", str(text)).replace("|", "\\|").replace("<", "&lt;")


def _md_code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render_markdown(
    result: RunResult,
    verdict: Optional[Verdict],
    *,
    steps: Optional[Sequence[Mapping[str, Any]]] = None,
    plots: Sequence[str] = (),
) -> str:
    """The terminal report as GitHub-flavoured markdown; ``plots`` are image paths relative to the file."""
    label, sentence, _ = verdict_headline(verdict, result.status, result.failure)
    per_rank = rank_summaries(result, steps)
    standouts = find_standouts(per_rank, steps, result.window_start_step)
    out = [f"## healthcheck `{result.name}`: {label} — {_md(sentence)}", ""]
    out += [f"> **{_md(line)}**" for line in standout_sentences(standouts)]
    out += ["", _md(_run_line(result, _UNICODE)), ""]
    if verdict is not None:
        out += [f"> note: {_md(note)}" for note in verdict.notes]
        out += [f"### Checks ({len(verdict.findings)}, {len(verdict.failures)} failed)", ""]
        if verdict.baseline_path:
            out += [f"Baseline: `{_md(verdict.baseline_path)}`", ""]
        out += ["| " + " | ".join(_COLUMNS) + " |", "|---|---|--:|---|---|--:|"]
        for finding, cells in check_rows(verdict):
            bold = "" if finding.passed else "**"
            out.append("| " + " | ".join(f"{bold}{_md(c)}{bold}" if c != "-" else c for c in cells) + " |")
        out += [""] + [f"- **{_md(f.check)}**: {_md(f.message + ranks_suffix(f))}" for f in verdict.failures]
    if per_rank:
        marked = {(s.rank, s.metric) for s in standouts}
        out += ["", f"### Per-rank means over the window (steps ≥ {result.window_start_step})", ""]
        out += ["| rank | loss | z | grad norm | z | cos to mean | z | step ms | z |", "|--:" * 9 + "|"]
        for s in per_rank:
            cells = [str(s.rank)]
            for metric in ATTRIBUTION_METRICS:
                z = format_number(getattr(s, f"z_{metric}"), "+.1f")
                cells += [format_number(getattr(s, metric), _RANK_FORMATS[metric]), f"**{z}**" if (s.rank, metric) in marked else z]
            out.append("| " + " | ".join(cells) + " |")
        out += ["", f"z: against the other ranks; **bold**: stands out (\\|z\\| ≥ {STANDOUT_Z:g}, persistent)."]
    if verdict is not None:
        out += ["", f"### Config changes vs the baseline ({len(verdict.config_diff)})", ""]
        out += [
            f"- `{_md(c.path)}`: {_md_code(_value(c.old))} → {_md_code(_value(c.new))}" for c in verdict.config_diff
        ] or ["Identical to the baseline's snapshot."]
    if result.nonfinite:
        out += ["", "### Non-finite values", ""]
        out += [f"- {e.what} on rank {e.rank} at step {e.step}" for e in result.nonfinite]
    if plots:
        out += ["", "### Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------- files


def write_report_files(
    run_dir: Path,
    result: RunResult,
    verdict: Optional[Verdict],
    *,
    environ: Optional[Mapping[str, str]] = None,
) -> list[Path]:
    """Write ``report.md``, ``junit.xml`` and ``plots/*.png`` into ``run_dir``; append the markdown to
    ``$GITHUB_STEP_SUMMARY`` when set. Returns the files written in ``run_dir``."""
    run_dir = Path(run_dir)
    env = os.environ if environ is None else environ
    steps = list(read_jsonl(run_dir / STEPS_FILE))
    aggregates = list(read_jsonl(run_dir / AGGREGATES_FILE))
    plots = _write_plots(run_dir / PLOTS_DIR, result, verdict, steps, aggregates)
    markdown = render_markdown(result, verdict, steps=steps, plots=[p.relative_to(run_dir).as_posix() for p in plots])
    write_text_atomic(run_dir / REPORT_FILE, markdown)
    write_text_atomic(run_dir / JUNIT_FILE, render_junit(result, verdict))
    summary_path = env.get("GITHUB_STEP_SUMMARY")
    if summary_path:
        # The summary cannot show files from the runner, so it gets the report without the images.
        summary = render_markdown(result, verdict, steps=steps) + f"\nPlots and junit.xml: `{run_dir}`\n\n"
        try:
            with open(summary_path, "a", encoding="utf-8") as handle:
                handle.write(summary)
        except OSError as exc:
            log.warning("GITHUB_STEP_SUMMARY %s: cannot append (%s)", summary_path, exc.strerror or exc)
    return [run_dir / REPORT_FILE, run_dir / JUNIT_FILE, *plots]


def _write_plots(
    plots_dir: Path,
    result: RunResult,
    verdict: Optional[Verdict],
    steps: Sequence[Mapping[str, Any]],
    aggregates: Sequence[Mapping[str, Any]],
) -> list[Path]:
    # The verdict is already decided and printed: a plotting failure must not turn it into a
    # traceback and a wrong exit code, so it is logged and the text reports are still written.
    try:
        from healthcheck.plots import write_plots

        return write_plots(plots_dir, result, verdict, steps, aggregates)
    except Exception as exc:  # noqa: BLE001
        log.warning("plots not written to %s: %s: %s", plots_dir, type(exc).__name__, exc)
        return []


def publish_report(run_dir: Path, result: RunResult, verdict: Optional[Verdict], console: Optional[Console] = None) -> int:
    """Everything a run reports, in one call: files, terminal, annotations. Returns the exit code."""
    console = console or Console(highlight=False)
    written = write_report_files(run_dir, result, verdict)
    render_terminal(result, verdict, console, steps=list(read_jsonl(Path(run_dir) / STEPS_FILE)))
    plots = f" (+{len(written) - 2} plots)" if len(written) > 2 else ""
    console.print(Text(f"\nreport: {written[0]}, {written[1].name}{plots}"))
    emit_annotations(verdict, result)
    return exit_code_for(result, verdict)


def render_run(run_dir: Path, console: Optional[Console] = None) -> int:
    """``healthcheck report RUN_DIR``: re-render and rewrite the report of a finished run; its exit code."""
    from healthcheck.verdict import load_verdict

    run_dir = Path(run_dir)
    result = load_result(run_dir)
    verdict = load_verdict(run_dir) if (run_dir / VERDICT_FILE).exists() else None
    return publish_report(run_dir, result, verdict, console)

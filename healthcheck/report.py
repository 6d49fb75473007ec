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
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, TextIO

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
from healthcheck.errors import ExitCode
from healthcheck.findings import Finding, Verdict

log = logging.getLogger(__name__)

REPORT_FILE = "report.md"
JUNIT_FILE = "junit.xml"
PLOTS_DIR = "plots"

#: Per-rank quantities the attribution compares, as named in ``steps.jsonl`` and ``RankSummary``.
ATTRIBUTION_METRICS = ("loss", "grad_norm", "cosine_to_mean", "compute_ms")
#: A rank stands out when its leave-one-out z (``healthcheck.summary``) reaches this *and* it is
#: persistently off: on the same side of the other ranks' mean in enough window steps that a
#: one-sided sign test reaches PERSISTENCE_P. Why both: with 8 ranks the spread of the other 7 is
#: itself noisy, so |z| >= 3 alone names some rank in ~32% of healthy runs per metric (~80% over the
#: four metrics; simulated, 8 ranks x 50 steps of iid noise). A rank that is really off is off in
#: almost every step, a chance z is not: with the sign test, ~1.7% of healthy runs name a rank.
STANDOUT_Z = 3.0
PERSISTENCE_P = 1e-3
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


def exit_code_for(result: RunResult, verdict: Optional[Verdict]) -> int:
    """3 when the probe did not finish, else the verdict's code, else 0 (complete, nothing judged)."""
    if result.status != "complete":
        return int(ExitCode.PROBE_FAILED)
    return verdict.exit_code if verdict is not None else int(ExitCode.PASS)


def verdict_headline(verdict: Optional[Verdict], status: str, failure: Optional[str] = None) -> tuple[str, str, str]:
    """(label, sentence, style key) for the banner, the markdown title, JUnit and plot titles.

    >>> verdict_headline(None, "complete")[:2]
    ('NO BASELINE', 'probe complete, nothing judged (no verdict)')
    """
    if status != "complete":
        label = "INTERRUPTED" if status == "interrupted" else "INCOMPLETE"
        return label, f"probe did not finish: {failure or f'result still marked {status}'}", "fail"
    if verdict is None:
        return "NO BASELINE", "probe complete, nothing judged (no verdict)", "warn"
    total, failed = len(verdict.findings), len(verdict.failures)
    if verdict.status == "fail":
        return "FAIL", f"silent inconsistency: {failed} of {total} checks failed", "fail"
    return "PASS", f"all {total} checks within their baseline envelopes", "pass"


def _num(value: Optional[float], spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
    return format(value, spec)


def _envelope(finding: Finding) -> str:
    if finding.lower is None and finding.upper is None:
        return "-"
    lower = _num(finding.lower) if finding.lower is not None else "-inf"
    upper = _num(finding.upper) if finding.upper is not None else "+inf"
    return f"[{lower}, {upper}]"


def _ranks_suffix(finding: Finding) -> str:
    # verdict.py already names the ranks in an envelope's message; other checks may only fill ``ranks``.
    if not finding.ranks or "rank" in finding.message:
        return ""
    word = "rank" if len(finding.ranks) == 1 else "ranks"
    return f" ({word} {', '.join(str(r) for r in finding.ranks)})"


def check_rows(verdict: Verdict) -> list[tuple[Finding, tuple[str, ...]]]:
    """One row per finding, failures first, then the closest to a bound: cells as in ``_COLUMNS``."""
    ordered = sorted(verdict.findings, key=lambda f: (f.passed, f.margin if f.margin is not None else math.inf))
    return [
        (
            f,
            (
                f.metric or f.check,
                f.statistic or "-",
                _num(f.observed),
                _envelope(f),
                "ok" if f.passed else "FAIL",
                _num(f.margin, "+.2f"),
            ),
        )
        for f in ordered
    ]


# --------------------------------------------------------------------------- per-rank attribution


@dataclass(frozen=True)
class Standout:
    """One rank persistently off the others on one metric."""

    rank: int
    metric: str
    z: float
    same_side_steps: int
    window_steps: int

    def phrase(self) -> str:
        side = "higher" if self.z > 0 else "lower"
        evidence = f" ({side} in {self.same_side_steps}/{self.window_steps} steps)" if self.window_steps else ""
        return f"{self.metric} z={self.z:+.1f}{evidence}"


def _window_rows(steps: Iterable[Mapping[str, Any]], start_step: int) -> list[Mapping[str, Any]]:
    return [row for row in steps if row.get("step", -1) >= start_step and row.get("rank") is not None]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def rank_summaries(result: RunResult, steps: Optional[Sequence[Mapping[str, Any]]] = None) -> list[RankSummary]:
    """``result.per_rank``; or, when the probe died before writing it, the same computed from the step rows."""
    if result.per_rank or not steps:
        return sorted(result.per_rank, key=lambda s: s.rank)
    from healthcheck.summary import summarize_ranks  # the one definition of the per-rank z-scores

    return summarize_ranks([dict(row) for row in steps], result.window_start_step)


def _sign_test_p(successes: int, trials: int) -> float:
    """P(at least ``successes`` of ``trials`` fair coin flips land the same way).

    >>> round(_sign_test_p(10, 10), 5)
    0.00098
    """
    return sum(math.comb(trials, k) for k in range(successes, trials + 1)) / 2**trials


def find_standouts(
    per_rank: Sequence[RankSummary],
    steps: Optional[Iterable[Mapping[str, Any]]] = None,
    start_step: int = 0,
    *,
    z_threshold: float = STANDOUT_Z,
    p_threshold: float = PERSISTENCE_P,
) -> list[Standout]:
    """Ranks with |z| >= ``z_threshold`` that are off the same way in enough window steps (see PERSISTENCE_P).

    Without step rows, |z| alone decides. Ordered by rank, then by |z| (largest first).
    """
    rows = _window_rows(steps or (), start_step)
    found = []
    for metric in ATTRIBUTION_METRICS:
        by_step: dict[int, dict[int, float]] = defaultdict(dict)
        for row in rows:
            if _finite(row.get(metric)):
                by_step[int(row["step"])][int(row["rank"])] = float(row[metric])
        for summary in per_rank:
            z = getattr(summary, f"z_{metric}")
            if z is None or not math.isfinite(z) or abs(z) < z_threshold:
                continue
            same, total = _same_side_steps(by_step, summary.rank, above=z > 0)
            if total and _sign_test_p(same, total) > p_threshold:
                continue
            found.append(Standout(summary.rank, metric, z, same, total))
    return sorted(found, key=lambda s: (s.rank, -abs(s.z)))


def _same_side_steps(by_step: Mapping[int, Mapping[int, float]], rank: int, *, above: bool) -> tuple[int, int]:
    same = total = 0
    for values in by_step.values():
        others = [v for r, v in values.items() if r != rank]
        if rank not in values or len(others) < 2:
            continue
        total += 1
        diff = values[rank] - sum(others) / len(others)
        same += (diff > 0) if above else (diff < 0)
    return same, total


def standout_sentences(standouts: Sequence[Standout]) -> list[str]:
    """One sentence per rank, e.g. ``rank 0 stands out: cosine_to_mean z=-4.1 (lower in 50/50 steps)``."""
    by_rank: dict[int, list[Standout]] = defaultdict(list)
    for s in standouts:
        by_rank[s.rank].append(s)
    return [f"rank {rank} stands out: " + ", ".join(s.phrase() for s in items) for rank, items in by_rank.items()]


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
        console.print(Text(f"{glyphs.bullet} {finding.check}: {finding.message}{_ranks_suffix(finding)}", style=styles["fail"]))


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
            cells += [_num(getattr(summary, metric), _RANK_FORMATS[metric]), Text(_num(z, "+.1f") + star, style=styles["fail"] if star else "")]
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
        out += [""] + [f"- **{_md(f.check)}**: {_md(f.message + _ranks_suffix(f))}" for f in verdict.failures]
    if per_rank:
        marked = {(s.rank, s.metric) for s in standouts}
        out += ["", f"### Per-rank means over the window (steps ≥ {result.window_start_step})", ""]
        out += ["| rank | loss | z | grad norm | z | cos to mean | z | step ms | z |", "|--:" * 9 + "|"]
        for s in per_rank:
            cells = [str(s.rank)]
            for metric in ATTRIBUTION_METRICS:
                z = _num(getattr(s, f"z_{metric}"), "+.1f")
                cells += [_num(getattr(s, metric), _RANK_FORMATS[metric]), f"**{z}**" if (s.rank, metric) in marked else z]
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


# --------------------------------------------------------------------------- JUnit


_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml(text: Any) -> str:
    """XML 1.0 cannot carry most control characters even escaped: replace them."""
    return _XML_INVALID.sub("?", str(text))


def render_junit(result: RunResult, verdict: Optional[Verdict]) -> str:
    """JUnit XML: a ``probe`` testcase (error when it did not finish), then one testcase per finding.

    A complete run without a verdict gets a skipped ``verdict`` testcase, so the file is never empty.
    """
    suite_name = f"healthcheck.{result.name}"
    cases: list[ET.Element] = []
    probe = ET.Element("testcase", name="probe", classname=suite_name, time=f"{result.timing.wall_s or 0:.3f}")
    if result.status != "complete":
        label, sentence, _ = verdict_headline(verdict, result.status, result.failure)
        ET.SubElement(probe, "error", message=_xml(sentence), type=result.status).text = _xml(f"{label}: {sentence}")
    cases.append(probe)
    if verdict is None and result.status == "complete":
        case = ET.Element("testcase", name="verdict", classname=suite_name, time="0")
        ET.SubElement(case, "skipped", message="no baseline: nothing judged")
        cases.append(case)
    for finding in verdict.findings if verdict else []:
        kind = finding.check.split(".", 1)[0]
        case = ET.Element("testcase", name=_xml(finding.check), classname=f"{suite_name}.{kind}", time="0")
        if not finding.passed:
            failure = ET.SubElement(case, "failure", message=_xml(finding.message + _ranks_suffix(finding)), type=finding.check)
            failure.text = _xml(_finding_details(finding))
        cases.append(case)

    counts = {
        "tests": len(cases),
        "failures": sum(c.find("failure") is not None for c in cases),
        "errors": sum(c.find("error") is not None for c in cases),
        "skipped": sum(c.find("skipped") is not None for c in cases),
    }
    counted = {k: str(v) for k, v in counts.items()}
    wall = f"{result.timing.wall_s or 0:.3f}"
    root = ET.Element("testsuites", name="healthcheck", time=wall, **counted)
    env = result.environment
    suite = ET.SubElement(
        root,
        "testsuite",
        name=suite_name,
        time=wall,
        timestamp=result.timing.started_at.removesuffix("Z"),
        hostname=_xml(env.ranks[0].node if env and env.ranks else "localhost"),
        **counted,
    )
    properties = ET.SubElement(suite, "properties")
    for name, value in (
        ("config_fingerprint", result.config_fingerprint),
        ("status", result.status),
        ("baseline", verdict.baseline_path if verdict else None),
        ("world_size", env.world_size if env else None),
    ):
        if value is not None:
            ET.SubElement(properties, "property", name=name, value=_xml(value))
    suite.extend(cases)
    ET.SubElement(suite, "system-out").text = _xml("\n".join(verdict.notes) if verdict else "")
    ET.SubElement(suite, "system-err")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _finding_details(finding: Finding) -> str:
    parts = [f"{finding.title}", finding.message + _ranks_suffix(finding)]
    if finding.observed is not None:
        parts.append(f"{finding.statistic or 'value'} {_num(finding.observed)}, envelope {_envelope(finding)}, margin {_num(finding.margin, '+.2f')}")
    return "\n".join(parts)


# --------------------------------------------------------------------------- GitHub annotations


def escape_data(text: str) -> str:
    """Escape a workflow-command message.

    >>> escape_data("50%\\nup")
    '50%25%0Aup'
    """
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """Escape a workflow-command property value (``title=...``): also ``:`` and ``,``.

    >>> escape_property("envelope.loss_std: p95, median")
    'envelope.loss_std%3A p95%2C median'
    """
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(verdict: Optional[Verdict], result: Optional[RunResult] = None) -> list[str]:
    """One ``::error`` line per failed check, and one when the probe (``result``) did not finish."""
    prefix = f"healthcheck {result.name}" if result is not None else "healthcheck"
    lines = []
    if result is not None and result.status != "complete":
        label, sentence, _ = verdict_headline(verdict, result.status, result.failure)
        lines.append(f"::error title={escape_property(f'{prefix}: {label}')}::{escape_data(sentence)}")
    for finding in verdict.failures if verdict else []:
        title = escape_property(f"{prefix}: {finding.check}")
        lines.append(f"::error title={title}::{escape_data(finding.message + _ranks_suffix(finding))}")
    return lines


def emit_annotations(
    verdict: Optional[Verdict],
    result: Optional[RunResult] = None,
    *,
    file: Optional[TextIO] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> list[str]:
    """On GitHub Actions (``GITHUB_ACTIONS=true``), print :func:`github_annotations`; the lines printed.

    Printed raw to stdout, never through rich, which would wrap or style them and break the command.
    """
    env = os.environ if environ is None else environ
    if env.get("GITHUB_ACTIONS") != "true":
        return []
    lines = github_annotations(verdict, result)
    out = file or sys.stdout
    for line in lines:
        print(line, file=out)
    out.flush()
    return lines


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

"""The report as GitHub-flavoured Markdown (``report.md``, also appended to ``$GITHUB_STEP_SUMMARY``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from healthcheck.artifacts import RunResult
from healthcheck.judge.attribution import RANK_FIELDS, STANDOUT_Z, find_standouts, rank_summaries, standout_sentences
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
    charts: str = "",
) -> str:
    """The terminal report as GitHub-flavoured markdown; ``plots`` are image paths relative to the file,
    ``charts`` a Markdown section of Mermaid charts (:func:`healthcheck.outputs.mermaid.summary_charts`)."""
    label, sentence, _ = verdict_headline(verdict, result.status, result.failure)
    per_rank = rank_summaries(result, steps)
    standouts = find_standouts(per_rank, steps, result.window_start_step)
    out = [f"## healthcheck `{result.name}`: {label} — {_md(sentence)}", ""]
    out += [f"> **{_md(line)}**" for line in standout_sentences(standouts)]
    out += ["", _md(run_line(result)), ""]
    if verdict is not None:
        out += [f"> note: {_md(note)}" for note in verdict.notes]
        out += [f"### Checks ({len(verdict.findings)}, {len(verdict.failures)} failed)", ""]
        if verdict.baseline_path:
            out += [f"Baseline: `{_md(verdict.baseline_path)}`", ""]
        out += ["| " + " | ".join(CHECK_COLUMNS) + " |", "|---|---|--:|---|---|--:|"]
        for finding, check_cells in check_rows(verdict):
            bold = "" if finding.passed else "**"
            out.append("| " + " | ".join(f"{bold}{_md(c)}{bold}" if c != "-" else c for c in check_cells) + " |")
        out += [""] + [f"- **{_md(f.check)}**: {_md(f.message + ranks_suffix(f))}" for f in verdict.failures]
        # Why a check judged nothing: a CI reader must not take an unmeasured check for a pass.
        out += [f"- {_md(f.check)}: {_md(f.message)}" for f in verdict.findings if not f.measured]
    if per_rank:
        marked = {(s.rank, s.metric) for s in standouts}
        out += ["", f"### Per-rank means over the window (steps ≥ {result.window_start_step})", ""]
        out += ["| rank | loss | z | grad norm | z | cos to mean | z | step ms | z |", "|--:" * 9 + "|"]
        for s in per_rank:
            cells: list[str] = [str(s.rank)]
            for metric in RANK_FIELDS:
                z = format_number(getattr(s, f"z_{metric}"), "+.1f")
                cells += [format_number(getattr(s, metric), RANK_FORMATS[metric]), f"**{z}**" if (s.rank, metric) in marked else z]
            out.append("| " + " | ".join(cells) + " |")
        out += ["", f"z: against the other ranks; **bold**: stands out (\\|z\\| ≥ {STANDOUT_Z:g}, persistent)."]
    if verdict is not None:
        out += ["", f"### Config changes vs the baseline ({len(verdict.config_diff)})", ""]
        out += [f"- `{_md(c.path)}`: {_md_code(config_value(c.old))} → {_md_code(config_value(c.new))}" for c in verdict.config_diff] or [
            "Identical to the baseline's snapshot."
        ]
    if result.nonfinite:
        out += ["", "### Non-finite values", ""]
        out += [f"- {e.what} on rank {e.rank} at step {e.step}" for e in result.nonfinite]
    if charts:
        out += ["", charts.rstrip()]
    if plots:
        out += ["", "### Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(out).rstrip() + "\n"

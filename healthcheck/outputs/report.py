"""The report of a run, written on every run, pass or fail: what moved, by how much against what bound,
on which rank, after which config change.

:func:`publish_report` writes every file and prints the terminal report:

* the terminal (:mod:`.terminal`);
* ``report.html`` (:mod:`.html`: one self-contained page with inline SVG charts), ``report.md``
  (:mod:`.markdown`), ``junit.xml`` (:mod:`.ci_outputs`) and ``plots/*.png`` (:mod:`.plots`);
* the Markdown, with Mermaid charts (:mod:`.mermaid`), appended to ``$GITHUB_STEP_SUMMARY``;
* ``::error`` annotations on stdout when ``GITHUB_ACTIONS=true``.

Re-render a finished run with ``healthcheck report runs/default-20251122T010000.000000Z``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from rich.console import Console
from rich.text import Text

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE, RunResult
from healthcheck.files import read_jsonl, write_text_atomic
from healthcheck.judge.findings import Verdict
from healthcheck.outputs.ci_outputs import emit_annotations, render_junit
from healthcheck.outputs.html import render_html
from healthcheck.outputs.markdown import render_markdown
from healthcheck.outputs.mermaid import summary_charts
from healthcheck.outputs.terminal import render_terminal

log = logging.getLogger(__name__)

HTML_FILE = "report.html"
REPORT_FILE = "report.md"
JUNIT_FILE = "junit.xml"
PLOTS_DIR = "plots"


def write_report_files(
    run_dir: Path,
    result: RunResult,
    verdict: Optional[Verdict],
    *,
    environ: Optional[Mapping[str, str]] = None,
    plots: bool = True,
) -> list[Path]:
    """Write ``report.html``, ``report.md``, ``junit.xml`` and ``plots/*.png`` (unless not ``plots``) into
    ``run_dir``; append the Markdown, with Mermaid charts, to ``$GITHUB_STEP_SUMMARY`` when set. Returns the files
    written in ``run_dir``, ``report.html`` first."""
    run_dir = Path(run_dir)
    env = os.environ if environ is None else environ
    steps = list(read_jsonl(run_dir / STEPS_FILE))
    aggregates = list(read_jsonl(run_dir / AGGREGATES_FILE))
    html = _write_html(run_dir / HTML_FILE, result, verdict, steps, aggregates)
    # report.html draws its own charts; the PNGs are report.md's (matplotlib: ~0.7 s of a small probe's ~4 s).
    pngs = _write_plots(run_dir / PLOTS_DIR, result, verdict, steps, aggregates) if plots else []
    markdown = render_markdown(result, verdict, steps=steps, plots=[p.relative_to(run_dir).as_posix() for p in pngs])
    write_text_atomic(run_dir / REPORT_FILE, markdown)
    write_text_atomic(run_dir / JUNIT_FILE, render_junit(result, verdict))
    summary_path = env.get("GITHUB_STEP_SUMMARY")
    if summary_path:
        # The summary cannot show files from the runner: no images, but Mermaid charts GitHub draws itself.
        try:
            charts = summary_charts(result, verdict, steps, aggregates)
        except Exception as exc:  # noqa: BLE001  (as for the plots: never a wrong exit code)
            log.warning("step summary charts left out: %s: %s", type(exc).__name__, exc)
            charts = ""
        summary = render_markdown(result, verdict, steps=steps, charts=charts) + f"\nreport.html, plots and junit.xml: `{run_dir}`\n\n"
        try:
            with open(summary_path, "a", encoding="utf-8") as handle:
                handle.write(summary)
        except OSError as exc:
            log.warning("GITHUB_STEP_SUMMARY %s: cannot append (%s)", summary_path, exc.strerror or exc)
    return [*html, run_dir / REPORT_FILE, run_dir / JUNIT_FILE, *pngs]


def _write_html(
    path: Path,
    result: RunResult,
    verdict: Optional[Verdict],
    steps: Sequence[Mapping[str, Any]],
    aggregates: Sequence[Mapping[str, Any]],
) -> list[Path]:
    # Like the plots: the verdict is decided, so a rendering bug is logged, never a wrong exit code.
    try:
        write_text_atomic(path, render_html(result, verdict, steps, aggregates))
    except Exception as exc:  # noqa: BLE001
        log.warning("%s not written: %s: %s", path, type(exc).__name__, exc)
        return []
    return [path]


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
        from healthcheck.outputs.plots import write_plots

        return write_plots(plots_dir, result, verdict, steps, aggregates)
    except Exception as exc:  # noqa: BLE001
        log.warning("plots not written to %s: %s: %s", plots_dir, type(exc).__name__, exc)
        return []


def publish_report(
    run_dir: Path, result: RunResult, verdict: Optional[Verdict], console: Optional[Console] = None, *, plots: bool = True
) -> None:
    """Everything a run reports, in one call: files (the PNG plots unless not ``plots``), terminal, annotations."""
    console = console or Console(highlight=False)
    written = write_report_files(run_dir, result, verdict, plots=plots)
    render_terminal(result, verdict, console, steps=list(read_jsonl(Path(run_dir) / STEPS_FILE)))
    others = [p.name for p in written[1:] if p.parent == written[0].parent]
    drawn = len(written) - 1 - len(others)
    console.print(Text(f"\nreport: {written[0]} (also {', '.join(others)}{f', {drawn} plots' if drawn else ''})"))
    emit_annotations(verdict, result)

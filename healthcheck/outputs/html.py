"""``report.html``: the whole report as one self-contained page a person opens from a CI artifact.

The verdict banner, the checks table (failed checks first), the standout ranks, the per-rank table,
the config diff and the charts (inline SVG, :mod:`.charts`). No scripts, no network, no external
assets: inline CSS and system fonts only, so the page works offline and from ``file://``. Every piece
of text that comes from the run (names, config values, messages) is escaped. Below 600 px the tables
turn into cards and the charts stack, so it reads in a narrow window.

Elements a test can find: ``[data-testid=verdict]``, ``#checks tr[data-status=fail|pass]``, and the
charts by id (``#chart-loss``, ``#chart-loss_std``, ``#chart-grad_norm_cv``, ``#chart-cosine_mean``,
``#chart-cosine``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from healthcheck.artifacts import RankSummary, RunResult, Standout
from healthcheck.judge.attribution import RANK_FIELDS, STANDOUT_Z, find_standouts, rank_summaries, standout_sentences
from healthcheck.judge.findings import Verdict
from healthcheck.outputs.charts import Chart, cosine_chart, dispersion_charts, loss_chart
from healthcheck.outputs.svg import esc
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
from healthcheck.version import __version__

CSS = """
*{box-sizing:border-box}
body{margin:0;font:15px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,'Liberation Sans','DejaVu Sans',Arial,sans-serif;
 color:#222;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:16px}
h1{font-size:1.3rem;margin:0 0 12px;overflow-wrap:anywhere}
h2{font-size:1.05rem;margin:24px 0 8px}
code{font-size:.9em;overflow-wrap:break-word}
.verdict{border-radius:8px;padding:14px 18px;margin:0 0 12px;color:#fff;display:flex;flex-wrap:wrap;align-items:baseline;gap:4px 16px}
.verdict.fail{background:#b3261e}.verdict.pass{background:#1e7b34}.verdict.warn{background:#9a6700}
.verdict strong{font-size:1.6rem;letter-spacing:.04em}
.standouts{margin:0 0 12px;padding:10px 14px 10px 32px;background:#fdf1f0;border:1px solid #f1c4c0;border-radius:8px;color:#8c1c13}
.meta{color:#555;font-size:.85rem;margin:0 0 12px;overflow-wrap:anywhere}
.note{background:#fff8e1;border:1px solid #f0d98c;border-radius:6px;padding:6px 10px;overflow-wrap:anywhere}
.table-wrap{overflow-x:auto;background:#fff;border:1px solid #ddd;border-radius:8px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:6px 10px;border-bottom:1px solid #eee;vertical-align:top}
th{background:#fafafa;font-size:.85rem;color:#444}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr:last-child td{border-bottom:0}
td.detail{overflow-wrap:anywhere;color:#444;font-size:.9rem}
.badge{display:inline-block;min-width:3.2em;text-align:center;border-radius:4px;padding:1px 6px;font-size:.78rem;font-weight:700;color:#fff}
.badge.fail{background:#b3261e}.badge.pass{background:#1e7b34}
tr.fail td{background:#fdf1f0}
td.standout{color:#b3261e;font-weight:700}
ul.diff{background:#fff;border:1px solid #ddd;border-radius:8px;padding:10px 10px 10px 28px;margin:0;overflow-wrap:anywhere}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,460px),1fr));gap:16px}
figure{margin:0;background:#fff;border:1px solid #ddd;border-radius:8px;padding:10px;min-width:0}
figure.failed{border:2px solid #b3261e}
figcaption{font-size:.85rem;color:#555;margin-top:4px}
footer{color:#777;font-size:.8rem;margin:24px 0 8px}
@media (max-width:600px){
 main{padding:8px}
 .verdict strong{font-size:1.3rem}
 figure{padding:6px}
 #checks thead{display:none}
 #checks tr{display:block;padding:6px 8px;border-bottom:1px solid #eee}
 #checks td{display:inline-block;border:0;padding:0 10px 2px 0;background:none}
 #checks td[data-label]::before{content:attr(data-label) " ";color:#777;font-size:.8rem}
 #checks td.detail{display:block}
 #checks td.empty{display:none}
 #ranks th,#ranks td{padding:4px 3px;font-size:.8rem}
 #ranks th{white-space:normal}
}
"""


def render_html(
    result: RunResult,
    verdict: Optional[Verdict],
    steps: Sequence[Mapping[str, Any]] = (),
    aggregates: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The page for one run: a pure function of the result, its verdict and its step and aggregate rows."""
    label, sentence, style = verdict_headline(verdict, result.status, result.failure)
    per_rank = rank_summaries(result, steps)
    standouts = find_standouts(per_rank, steps, result.window_start_step)
    ranks = sorted({s.rank for s in standouts})
    body = [
        f"<h1>healthcheck <code>{esc(result.name)}</code></h1>",
        f'<div class="verdict {style}" data-testid="verdict" role="status"><strong>{esc(label)}</strong><span>{esc(sentence)}</span></div>',
    ]
    sentences = standout_sentences(standouts)
    if sentences:
        body.append('<ul class="standouts" data-testid="standouts">' + "".join(f"<li>{esc(s)}</li>" for s in sentences) + "</ul>")
    body.append(f'<p class="meta">{esc(run_line(result))}</p>')
    if verdict is not None:
        body += [f'<p class="note">note: {esc(note)}</p>' for note in verdict.notes]
        body += _checks(verdict)
    body += _attribution(result, per_rank, standouts)
    if verdict is not None:
        body += _config_diff(verdict)
    if result.nonfinite:
        body += ["<h2>Non-finite values</h2>", "<ul>"]
        body += [f"<li>{esc(e.what)} on rank {e.rank} at step {e.step}</li>" for e in result.nonfinite] + ["</ul>"]
    charts = [
        c
        for c in (
            loss_chart(result, steps, aggregates, ranks),
            *dispersion_charts(result, verdict, aggregates),
            cosine_chart(result, aggregates, ranks),
        )
        if c is not None
    ]
    if charts:
        body += ["<h2>Charts</h2>", '<div class="charts">', *map(_figure, charts), "</div>"]
    body.append(
        f"<footer>healthcheck {esc(__version__)} · self-contained page: no scripts, no network · "
        f"re-render with <code>healthcheck report RUN_DIR</code></footer>"
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>healthcheck {esc(result.name)}: {esc(label)}</title><style>{CSS}</style></head>\n"
        "<body><main>\n" + "\n".join(body) + "\n</main></body></html>\n"
    )


def _checks(verdict: Verdict) -> list[str]:
    out = [f"<h2>Checks ({len(verdict.findings)}, {len(verdict.failures)} failed)</h2>"]
    if verdict.baseline_path:
        out.append(f'<p class="meta">baseline: <code>{esc(verdict.baseline_path)}</code></p>')
    numeric = {"observed", "margin"}
    head = "".join(f'<th class="num">{c}</th>' if c in numeric else f"<th>{c}</th>" for c in CHECK_COLUMNS if c != "status")
    out.append(f'<div class="table-wrap"><table id="checks"><thead><tr><th>status</th>{head}<th>detail</th></tr></thead><tbody>')
    for finding, cells in check_rows(verdict):
        status = "pass" if finding.passed else "fail"
        row = [f'<td><span class="badge {status}">{esc(cells[CHECK_COLUMNS.index("status")])}</span></td>']
        for column, cell in zip(CHECK_COLUMNS, cells, strict=True):
            if column == "check":
                row.append(f"<td><code>{esc(cell)}</code></td>")
            elif column != "status":
                css = " ".join(["num"] * (column in numeric) + ["empty"] * (cell == "-"))
                row.append(f'<td class="{css}" data-label="{column}">{esc(cell)}</td>')
        row.append(f'<td class="detail">{esc(finding.message + ranks_suffix(finding))}</td>')
        out.append(f'<tr class="{status}" data-status="{status}" data-check="{esc(finding.check)}">{"".join(row)}</tr>')
    out.append("</tbody></table></div>")
    return out


def _attribution(result: RunResult, per_rank: Sequence[RankSummary], standouts: Sequence[Standout]) -> list[str]:
    if not per_rank:
        return []
    marked = {(s.rank, s.metric) for s in standouts}
    out = [
        f"<h2>Per-rank means over the window (steps ≥ {result.window_start_step})</h2>",
        '<div class="table-wrap"><table id="ranks"><thead><tr><th class="num">rank</th>',
    ]
    for header in ("loss", "grad norm", "cos to mean", "step ms"):
        out.append(f'<th class="num">{header}</th><th class="num">z</th>')
    out.append("</tr></thead><tbody>")
    for summary in per_rank:
        cells = [f'<td class="num">{summary.rank}</td>']
        for metric in RANK_FIELDS:
            z = format_number(getattr(summary, f"z_{metric}"), "+.1f")
            css = "num standout" if (summary.rank, metric) in marked else "num"
            cells.append(
                f'<td class="num">{esc(format_number(getattr(summary, metric), RANK_FORMATS[metric]))}</td><td class="{css}">{esc(z)}</td>'
            )
        out.append(f'<tr data-rank="{summary.rank}">{"".join(cells)}</tr>')
    out.append("</tbody></table></div>")
    out.append(f'<p class="meta">z: against the other ranks; red: stands out (|z| ≥ {STANDOUT_Z:g}, off the same way in most steps).</p>')
    return out


def _config_diff(verdict: Verdict) -> list[str]:
    out = [f"<h2>Config changes vs the baseline ({len(verdict.config_diff)})</h2>"]
    if not verdict.config_diff:
        return out + ['<p class="meta">Identical to the baseline\'s snapshot.</p>']
    items = [
        f"<li><code>{esc(c.path)}</code>: <code>{esc(config_value(c.old))}</code> → <code>{esc(config_value(c.new))}</code></li>"
        for c in verdict.config_diff
    ]
    return out + ['<ul class="diff" id="config-diff">', *items, "</ul>"]


def _figure(chart: Chart) -> str:
    failed = ' class="failed"' if chart.failed else ""
    return f'<figure{failed} data-testid="chart">{chart.svg}<figcaption>{esc(chart.caption)}</figcaption></figure>'

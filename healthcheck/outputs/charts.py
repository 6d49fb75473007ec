"""The charts of ``report.html``, as inline SVG: the same three views as the PNGs in ``plots/``.

* :func:`loss_chart`: each rank's loss per step, the global mean over them, the standout ranks in red;
* :func:`dispersion_charts`: loss std, grad-norm CV and mean pairwise cosine per step, each with its
  baseline envelope over the judged window and the observed window statistic;
* :func:`cosine_chart`: the pairwise gradient-cosine matrix averaged over the window.

Every chart has a fixed ``id`` (``chart-loss``, ``chart-loss_std``, ..., ``chart-cosine``) that the
page and its browser test find it by. The data comes from :mod:`.series`, like the PNGs'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from healthcheck.artifacts import RunResult
from healthcheck.judge.findings import Verdict
from healthcheck.outputs.series import (
    DISPERSION_PANELS,
    cosine_scale,
    findings_for,
    loss_by_rank,
    mean_loss,
    mean_pairwise_cosine,
    panel_points,
)
from healthcheck.outputs.svg import Band, Line, line_chart
from healthcheck.outputs.svg_heatmap import heatmap

#: Colour of the ranks that do not stand out (muted behind the mean and the standouts).
RANK_COLOUR = "#1f77b4"


@dataclass(frozen=True)
class Chart:
    """One chart of the page: its id, whether it shows a failed check (a red frame), the caption under it, the ``<svg>``."""

    id: str
    failed: bool
    caption: str
    svg: str


def _warmup(result: RunResult, first_step: Optional[int]) -> Optional[tuple[float, float]]:
    if first_step is None or result.window_start_step <= first_step:
        return None
    return (first_step, result.window_start_step)


def _stop(result: RunResult, last_step: Optional[int]) -> tuple[Optional[tuple[float, str]], Optional[float]]:
    """On an unfinished probe: where it stopped, and an axis that spans the planned steps."""
    if result.status == "complete" or last_step is None:
        return None, None
    return (last_step, f"stopped ({result.status}) after step {last_step}"), float(max(result.steps_planned - 1, last_step))


def loss_chart(
    result: RunResult,
    steps: Sequence[Mapping[str, Any]],
    aggregates: Sequence[Mapping[str, Any]],
    standouts: Sequence[int],
) -> Optional[Chart]:
    """Each rank's loss against the global mean (the smooth average that hides a divergent rank)."""
    per_rank = loss_by_rank(steps)
    mean = mean_loss(per_rank, aggregates)
    if not mean:
        return None
    xs = list(mean)
    lines = [
        Line(f"rank {rank}", [(s, values.get(s)) for s in xs], colour=RANK_COLOUR, legend="each rank")
        for rank, values in per_rank.items()
        if rank not in standouts
    ]
    lines.append(Line("global mean", list(mean.items()), role="reference", legend="global mean"))
    lines += [
        Line(f"rank {rank}", [(s, per_rank.get(rank, {}).get(s)) for s in xs], role="highlight", legend=f"rank {rank} (stands out)")
        for rank in standouts
    ]
    stop, x_max = _stop(result, xs[-1])
    svg = line_chart(
        lines,
        title=f"training loss per rank ({len(per_rank)} ranks)",
        y_label="loss (nats/token)",
        warmup=_warmup(result, xs[0]),
        stop=stop,
        x_max=x_max,
        cid="chart-loss",
    )
    named = ", ".join(f"rank {r}" for r in standouts)
    caption = (
        (f"{named} in red: stands out against the other ranks. " if standouts else "")
        + ("Black: the global mean, the smooth curve a dashboard shows.")
        + (" Grey: warmup, not judged." if _warmup(result, xs[0]) else "")
    )
    return Chart("chart-loss", False, caption, svg)


def dispersion_charts(result: RunResult, verdict: Optional[Verdict], aggregates: Sequence[Mapping[str, Any]]) -> list[Chart]:
    """One chart per dispersion panel, each with its envelope over the judged window (when judged)."""
    if not aggregates:
        return []
    all_steps = sorted(int(a["step"]) for a in aggregates)
    window_end = all_steps[-1]
    stop, x_max = _stop(result, all_steps[-1])
    charts = []
    for key, label in DISPERSION_PANELS:
        bands = []
        for finding in findings_for(verdict, key):
            observed = finding.observed if finding.observed is not None else math.nan
            state = "inside" if finding.passed else "OUTSIDE"
            bands.append(
                Band(
                    finding.lower,
                    finding.upper,
                    result.window_start_step,
                    window_end,
                    f"envelope of the window {finding.statistic}",
                    observed=observed,
                    observed_label=f"window {finding.statistic} = {observed:.3g} ({state})",
                    passed=finding.passed,
                )
            )
        failed = any(not band.passed for band in bands)
        note = "" if verdict else " (not judged)"
        svg = line_chart(
            [Line(key, panel_points(aggregates, key), role="reference", legend="per step")],
            title=f"{label}{note}",
            y_label=key,
            warmup=_warmup(result, all_steps[0]),
            bands=bands,
            stop=stop,
            x_max=x_max,
            height=260,
            cid=f"chart-{key}",
        )
        if bands:
            caption = "; ".join(band.observed_label for band in bands) + ". The envelope bounds the window statistic, not single steps."
        else:
            caption = "No envelope: not gated by this run's verdict." if verdict else "No baseline: nothing judged."
        charts.append(Chart(f"chart-{key}", failed, caption, svg))
    return charts


def cosine_chart(result: RunResult, aggregates: Sequence[Mapping[str, Any]], standouts: Sequence[int]) -> Optional[Chart]:
    """The window-mean pairwise cosine; the diagonal (always 1) is left blank so it does not set the scale."""
    matrix = mean_pairwise_cosine(aggregates, result.window_start_step)
    if matrix is None:
        return None
    low, high = cosine_scale(matrix)
    cells: list[list[Optional[float]]] = [[None if i == j else v for j, v in enumerate(row)] for i, row in enumerate(matrix)]
    svg = heatmap(
        cells,
        labels=[str(r) for r in range(len(matrix))],
        vmin=low,
        vmax=high,
        highlight=standouts,
        title=f"pairwise gradient cosine, mean over steps ≥ {result.window_start_step}",
        missing_text="self",
        axis_label="rank",
        colorbar_label="cosine (1 = same direction)",
        cid="chart-cosine",
    )
    named = ", ".join(str(r) for r in standouts)
    caption = (f"Rank{'s' * (len(standouts) > 1)} {named} in red. " if standouts else "") + (
        "A rank whose gradients point elsewhere shows as a dark row and column."
    )
    return Chart("chart-cosine", False, caption, svg)

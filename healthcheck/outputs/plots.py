"""The run's plots, ``RUN_DIR/plots/*.png``, drawn with matplotlib's Agg canvas (no display, no pyplot).

* ``loss.png``: the global mean loss against the per-rank min-max band and each rank's own curve
  (the paper's point: a smooth average can hide one rank's divergence);
* ``dispersion.png``: loss std, grad-norm CV and mean pairwise cosine per step, each over its
  baseline envelope when there is a verdict, warmup shaded;
* ``cosine.png``: the pairwise gradient-cosine matrix averaged over the post-warmup window.

matplotlib is imported inside :func:`write_plots` so that importing the package stays fast.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from healthcheck.artifacts import RunResult
from healthcheck.files import write_bytes_atomic
from healthcheck.judge.findings import Finding, Verdict
from healthcheck.outputs import series
from healthcheck.outputs.series import (
    DISPERSION_PANELS,
    cosine_scale,
    findings_for,
    loss_by_rank,
    mean_loss,
    mean_pairwise_cosine,
    panel_points,
)
from healthcheck.outputs.text import verdict_headline

LOSS_PNG = "loss.png"
DISPERSION_PNG = "dispersion.png"
COSINE_PNG = "cosine.png"
DPI = 110
#: Panel y labels, wrapped for matplotlib's narrow axis.
_PANEL_YLABELS = {
    "loss_std": "loss std across ranks\n(nats/token)",
    "grad_norm_cv": "grad-norm CV across ranks\n(std / mean)",
    "cosine_mean": "mean pairwise\ngradient cosine",
}
_OK, _BAD, _BAND, _WARMUP = "#2a9d4a", "#d62728", "#1f77b4", "#bbbbbb"


def write_plots(
    plots_dir: Path,
    result: RunResult,
    verdict: Optional[Verdict],
    steps: Sequence[Mapping[str, Any]],
    aggregates: Sequence[Mapping[str, Any]],
) -> list[Path]:
    """Draw every plot the records allow (none without rows) into ``plots_dir``; the paths written."""
    from matplotlib.figure import Figure  # lazily: matplotlib costs ~0.3 s to import

    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    label = verdict_headline(verdict, result.status, result.failure)[0]
    standouts = series.standout_ranks(result, steps)
    written = []
    if steps:
        fig = Figure(figsize=(9, 5), layout="constrained")
        draw_loss(fig, result, steps, aggregates, standouts, label)
        written.append(_save(fig, plots_dir / LOSS_PNG))
    if aggregates:
        fig = Figure(figsize=(11, 8), layout="constrained")
        draw_dispersion(fig, result, verdict, aggregates, label)
        written.append(_save(fig, plots_dir / DISPERSION_PNG))
    matrix = mean_pairwise_cosine(aggregates, result.window_start_step)
    if matrix is not None:
        fig = Figure(figsize=(7, 6), layout="constrained")
        draw_cosine(fig, result, matrix, standouts, label)
        written.append(_save(fig, plots_dir / COSINE_PNG))
    return written


def _save(fig: Any, path: Path) -> Path:
    # Through the one atomic writer, like every other run-dir file: readers never see half a PNG.
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    write_bytes_atomic(path, buffer.getvalue())
    return path


def _mark_warmup(ax: Any, result: RunResult, first_step: int, *, label: bool) -> None:
    if result.window_start_step > first_step:
        ax.axvspan(first_step, result.window_start_step, color=_WARMUP, alpha=0.25, lw=0, label="warmup (not judged)" if label else None)


def _mark_stop(ax: Any, result: RunResult, last_step: Optional[int]) -> None:
    """On an unfinished probe: where it stopped, on an axis that spans the planned steps."""
    if result.status == "complete" or last_step is None:
        return
    ax.axvline(last_step, color=_BAD, lw=1.5, ls=":", label=f"probe stopped ({result.status}) after step {last_step}")
    ax.set_xlim(right=max(result.steps_planned - 1, last_step))


def draw_loss(
    fig: Any,
    result: RunResult,
    steps: Sequence[Mapping[str, Any]],
    aggregates: Sequence[Mapping[str, Any]],
    standout_ranks: Sequence[int],
    label: str,
) -> None:
    """Global mean loss over the per-rank min-max band and each rank's thin line."""
    per_rank = loss_by_rank(steps)
    mean_by_step = mean_loss(per_rank, aggregates)
    xs = list(mean_by_step)
    mean = list(mean_by_step.values())
    by_step = {s: [values[s] for values in per_rank.values() if s in values] for s in xs}

    ax = fig.add_subplot()
    _mark_warmup(ax, result, xs[0] if xs else 0, label=True)
    ax.fill_between(
        xs, [min(by_step[s]) for s in xs], [max(by_step[s]) for s in xs], color=_BAND, alpha=0.18, lw=0, label="per-rank min-max band"
    )
    first_normal = True
    for rank in sorted(per_rank):
        points = sorted(per_rank[rank].items())
        if rank in standout_ranks:
            continue
        ax.plot(
            [p[0] for p in points], [p[1] for p in points], color=_BAND, alpha=0.45, lw=0.7, label="each rank" if first_normal else None
        )
        first_normal = False
    for rank in standout_ranks:  # drawn last, on top
        points = sorted(per_rank.get(rank, {}).items())
        ax.plot([p[0] for p in points], [p[1] for p in points], color=_BAD, lw=1.4, label=f"rank {rank} (stands out)")
    ax.plot(xs, mean, color="black", lw=2.2, label="global mean (what a dashboard shows)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross-entropy, nats/token)")
    ax.set_title(f"{result.name} — {label}\nglobal mean loss vs per-rank spread ({len(per_rank)} ranks)")
    ax.grid(alpha=0.3)
    if xs:
        ax.set_xlim(*_step_span(xs))
        _mark_stop(ax, result, xs[-1])
    ax.legend(loc="upper right", fontsize=9)


def _step_span(steps: Sequence[int]) -> tuple[float, float]:
    """The x range of the plotted steps. One step alone (a probe stopped at its first) gets half a step each side:
    equal limits made matplotlib warn on the user's terminal.

    >>> _step_span([3, 4, 9]), _step_span([2])
    ((3, 9), (1.5, 2.5))
    """
    return (steps[0], steps[-1]) if steps[-1] > steps[0] else (steps[0] - 0.5, steps[0] + 0.5)


def draw_dispersion(fig: Any, result: RunResult, verdict: Optional[Verdict], aggregates: Sequence[Mapping[str, Any]], label: str) -> None:
    """Three stacked panels sharing the step axis, each with its envelope band and window statistic.

    An envelope bounds a window statistic (median, p95), not single steps, so it is shaded over the
    window only, with the observed statistic drawn across it.
    """
    axes = fig.subplots(len(DISPERSION_PANELS), 1, sharex=True)
    xs_all = [int(a["step"]) for a in aggregates]
    window_end = xs_all[-1] if xs_all else result.window_start_step
    for ax, (key, _) in zip(axes, DISPERSION_PANELS, strict=True):
        points = [(step, value) for step, value in panel_points(aggregates, key) if value is not None]
        _mark_warmup(ax, result, xs_all[0] if xs_all else 0, label=True)
        ax.plot([p[0] for p in points], [p[1] for p in points], color="black", lw=1.3, label="per step")
        for finding in findings_for(verdict, key):
            _draw_envelope(ax, finding, result.window_start_step, window_end)
            if not finding.passed:
                for spine in ax.spines.values():
                    spine.set(color=_BAD, linewidth=1.6)
        ax.margins(y=0.12)
        if xs_all:
            ax.set_xlim(*_step_span(xs_all))
            _mark_stop(ax, result, xs_all[-1])
        ax.set_ylabel(_PANEL_YLABELS.get(key, key))
        ax.grid(alpha=0.3)
        # Outside the panel: inside, the legend would hide the very steps that moved.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    axes[-1].set_xlabel("optimizer step")
    note = "" if verdict else " (not judged: no envelopes)"
    fig.suptitle(f"{result.name} — {label}\nconsistency across ranks per step{note}")


def _draw_envelope(ax: Any, finding: Finding, window_start: int, window_end: int) -> None:
    bottom, top = ax.dataLim.y0, ax.dataLim.y1
    lower = finding.lower if finding.lower is not None else min(bottom, finding.observed)
    upper = finding.upper if finding.upper is not None else max(top, finding.observed)
    ax.fill_between(
        [window_start, window_end],
        lower,
        upper,
        color=_OK,
        alpha=0.15,
        lw=0,
        label=f"baseline envelope for the window {finding.statistic}",
    )
    color = _OK if finding.passed else _BAD
    verdict_word = "inside" if finding.passed else "OUTSIDE"
    ax.hlines(
        finding.observed,
        window_start,
        window_end,
        colors=color,
        linestyles="--",
        lw=2,
        label=f"window {finding.statistic} = {finding.observed:.3g} ({verdict_word})",
    )


def _text_color(image: Any, value: float) -> str:
    """Black on light cells, white on dark ones (relative luminance of the cell's colour)."""
    if not math.isfinite(value):
        return "black"
    red, green, blue, _ = image.cmap(image.norm(value))
    return "black" if 0.2126 * red + 0.7152 * green + 0.0722 * blue > 0.45 else "white"


def draw_cosine(fig: Any, result: RunResult, matrix: list[list[float]], standout_ranks: Sequence[int], label: str) -> None:
    """Heatmap of the window-mean pairwise cosine; the diagonal (always 1) is left blank so it does not set the scale."""
    import numpy as np

    data = np.array(matrix, dtype=float)
    n = data.shape[0]
    np.fill_diagonal(data, np.nan)
    low, high = cosine_scale(matrix)
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_invalid(data), cmap="viridis", vmin=low, vmax=high)
    ax.set_facecolor("#eeeeee")
    fig.colorbar(image, ax=ax, label="gradient cosine, mean over the window (1 = same direction)")
    ticks = list(range(n))
    ax.set_xticks(ticks, [str(r) for r in ticks])
    ax.set_yticks(ticks, [str(r) for r in ticks])
    for tick_labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        for rank, tick in enumerate(tick_labels):
            if rank in standout_ranks:
                tick.set_color(_BAD)
                tick.set_fontweight("bold")
    ax.set_xlabel("rank")
    ax.set_ylabel("rank")
    if n <= 8:
        for i in range(n):
            for j in range(n):
                value = data[i, j]
                text = "—" if i == j else ("n/a" if not math.isfinite(value) else f"{value:.2f}")
                ax.text(j, i, text, ha="center", va="center", color=_text_color(image, value), fontsize=10)
    named = ""
    if standout_ranks:
        named = f"; rank{'s' * (len(standout_ranks) > 1)} {', '.join(map(str, standout_ranks))} "
        named += "stand out" if len(standout_ranks) > 1 else "stands out"
    ax.set_title(f"{result.name} — {label}\npairwise gradient cosine, steps ≥ {result.window_start_step}{named}")

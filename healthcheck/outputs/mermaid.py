"""Charts for the GitHub step summary as Mermaid ``xychart-beta`` blocks, which GitHub draws itself.

The step summary cannot show the run's PNGs (they sit on the runner), but it renders Mermaid. Only
the subset that parses and renders on mermaid 10.6 to 12.3 is written: the ``xychart-beta`` keyword,
a categorical step axis, plain decimals (an exponent is a parse error), no missing values (a gap is
a parse error), no double quotes inside strings, and a palette set with ``%%{init}%%`` (the default
first colour is nearly invisible). Legends are drawn only from mermaid 11.17, so each title also says
which colour is which series.

The charts are kept small: at most :data:`MAX_POINTS` steps (every k-th step, first and last kept)
and :data:`MAX_SERIES` series, with a short title naming the colours (mermaid does not wrap titles)
and a Markdown line above each chart with the details. A step where a shown series has no finite
value is dropped, not filled in, and the title says how many were dropped.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any, Mapping, Optional, Sequence

from healthcheck.artifacts import RunResult
from healthcheck.judge.attribution import rank_summaries
from healthcheck.judge.findings import Verdict
from healthcheck.outputs.series import DISPERSION_PANELS, findings_for, loss_by_rank, mean_loss, panel_points, standout_ranks

#: At most this many steps per chart: mermaid labels every category, and at 30 the step labels still fit
#: GitHub's 700-pixel chart (at 60 they overlap). The issue's cap is 60.
MAX_POINTS = 30
MAX_SERIES = 8
#: (colour, its name in the title) per kind of series.
STANDOUT_COLOURS = (("#d62728", "red"), ("#8c1c13", "dark red"), ("#ff7f0e", "orange"), ("#e377c2", "pink"))
MEAN_COLOUR = ("#000000", "black")
OTHER_COLOUR = ("#7fb2e5", "light blue")
PER_STEP_COLOUR = ("#0072b2", "blue")
FAILED_COLOUR = ("#d62728", "red")
ENVELOPE_COLOUR = ("#2ca02c", "green")


def plain_number(value: float, digits: int = 4) -> str:
    """``value`` rounded to ``digits`` significant digits, never in exponent notation (mermaid cannot parse it).

    >>> plain_number(3.2e-07), plain_number(2.345678), plain_number(-0.0), plain_number(123456.7)
    ('0.00000032', '2.346', '0', '123500')
    >>> plain_number(float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: mermaid xychart cannot show nan: drop the step
    """
    if not math.isfinite(value):
        raise ValueError(f"mermaid xychart cannot show {value}: drop the step")
    if value == 0:
        return "0"
    text = format(Decimal(f"{value:.{digits - 1}e}"), "f")
    text = text.rstrip("0").rstrip(".") if "." in text else text
    return "0" if text in ("-0", "") else text


def downsample(count: int, max_points: int = MAX_POINTS) -> list[int]:
    """Indices of at most ``max_points`` evenly spaced items out of ``count``, first and last included.

    >>> downsample(5), downsample(100, 4)
    ([0, 1, 2, 3, 4], [0, 33, 66, 99])
    """
    if count <= max_points:
        return list(range(count))
    return sorted({round(i * (count - 1) / (max_points - 1)) for i in range(max_points)})


def _text(value: object) -> str:
    """A title or label: one line, no double quotes (mermaid has no escape for them), no backticks (the fence)."""
    return " ".join(str(value).replace('"', "'").replace("`", "'").split())


def xychart(
    steps: Sequence[int],
    series: Sequence[tuple[str, Sequence[Optional[float]], tuple[str, str]]],
    *,
    title: str,
    y_label: str,
) -> str:
    """One fenced ``mermaid`` block: ``series`` is ``(name, value per step, (colour, colour name))``; the
    title should say which colour is which (keep it under ~60 characters: mermaid does not wrap it).

    Steps where any series has no finite value are dropped (counted in the title), then the rest is
    downsampled to :data:`MAX_POINTS`; series past :data:`MAX_SERIES` are left out.

    >>> print(xychart([0, 1, 2], [("mean", [3.0, None, 2.5], ("#000000", "black"))], title='loss "x": black = mean',
    ...               y_label="loss"))
    ```mermaid
    %%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "#000000"}}}}%%
    xychart-beta
        title "loss 'x': black = mean (1 step left out: no value)"
        x-axis "step" [0, 2]
        y-axis "loss" 2.475 --> 3.025
        line "mean" [3, 2.5]
    ```
    """
    series = list(series)[:MAX_SERIES]
    kept = [i for i in range(len(steps)) if all(_is_finite(values[i]) for _, values, _ in series)]
    dropped = len(steps) - len(kept)
    kept = [kept[i] for i in downsample(len(kept))]
    columns = [[v for v in (values[i] for i in kept) if v is not None] for _, values, _ in series]
    numbers = [v for column in columns for v in column]
    if not numbers:
        return ""
    low, high = min(numbers), max(numbers)
    pad = (high - low) * 0.1 or abs(high) * 0.1 or 1.0
    bottom = low - pad / 2 if low < 0 or low - pad / 2 >= 0 else 0.0  # a non-negative series keeps a non-negative axis
    note = f" ({dropped} step{'s' * (dropped != 1)} left out: no value)" if dropped else ""
    lines = [
        "```mermaid",
        '%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "' + ", ".join(c[0] for _, _, c in series) + '"}}}}%%',
        "xychart-beta",
        f'    title "{_text(title)}{note}"',
        f'    x-axis "step" [{", ".join(str(int(steps[i])) for i in kept)}]',
        f'    y-axis "{_text(y_label)}" {plain_number(bottom)} --> {plain_number(high + pad / 2)}',
    ]
    for (name, _, _), column in zip(series, columns, strict=True):
        lines.append(f'    line "{_text(name)}" [{", ".join(plain_number(v) for v in column)}]')
    return "\n".join([*lines, "```"])


def _is_finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


def loss_block(result: RunResult, steps: Sequence[Mapping[str, Any]], aggregates: Sequence[Mapping[str, Any]]) -> str:
    """Per-rank loss: a few other ranks (light blue, the most extreme first), the mean (black), the standouts (red) on top."""
    per_rank = loss_by_rank(steps)
    mean = mean_loss(per_rank, aggregates)
    if not mean:
        return ""
    xs = list(mean)
    standouts = [r for r in standout_ranks(result, steps) if r in per_rank][: len(STANDOUT_COLOURS)]
    by_extremity = sorted(rank_summaries(result, steps), key=lambda s: -abs(s.z_loss or 0.0))
    others = [s.rank for s in by_extremity if s.rank in per_rank and s.rank not in standouts]
    others = sorted(others[: max(0, MAX_SERIES - 1 - len(standouts))])
    series = [(f"rank {r}", [per_rank[r].get(s) for s in xs], OTHER_COLOUR) for r in others]
    series.append(("mean", [mean[s] for s in xs], MEAN_COLOUR))
    series += [(f"rank {r}", [per_rank[r].get(s) for s in xs], STANDOUT_COLOURS[i]) for i, r in enumerate(standouts)]
    legend = [f"{STANDOUT_COLOURS[i][1]}: rank {r} (stands out)" for i, r in enumerate(standouts)]
    legend.append(f"black: the mean of all {len(per_rank)} ranks")
    if others:
        legend.append(f"light blue: rank{'s' * (len(others) > 1)} {', '.join(map(str, others))}")
    short = ", ".join((["red = standout rank"] if standouts else []) + ["black = mean"] + (["blue = others"] if others else []))
    caption = f"**Training loss per rank** (nats/token): {'; '.join(legend)}."
    return caption + "\n\n" + xychart(xs, series, title=f"loss: {short}", y_label="loss")


def dispersion_blocks(result: RunResult, verdict: Optional[Verdict], aggregates: Sequence[Mapping[str, Any]]) -> list[str]:
    """One chart per dispersion panel: the value per step, and its envelope's bounds as two flat lines."""
    blocks = []
    for key, label in DISPERSION_PANELS:
        points = panel_points(aggregates, key)
        if not any(v is not None for _, v in points):
            continue
        xs = [s for s, _ in points]
        findings = [f for f in findings_for(verdict, key) if f.lower is not None and f.upper is not None][:1]
        failed = any(not f.passed for f in findings)
        colour = FAILED_COLOUR if failed else PER_STEP_COLOUR
        series: list[tuple[str, Sequence[Optional[float]], tuple[str, str]]] = [(key, [v for _, v in points], colour)]
        caption = f"**{label}**: not judged." if verdict is None else f"**{label}**: not gated by this baseline."
        for finding in findings:
            series += [
                ("envelope lower", [finding.lower] * len(xs), ENVELOPE_COLOUR),
                ("envelope upper", [finding.upper] * len(xs), ENVELOPE_COLOUR),
            ]
            state = "inside" if finding.passed else "**OUTSIDE**"
            caption = (
                f"**{label}**: window {finding.statistic} {plain_number(finding.observed or 0.0, 3)} is {state} the envelope "
                f"[{plain_number(finding.lower or 0.0, 3)}, {plain_number(finding.upper or 0.0, 3)}] (green)."
            )
        title = f"{key}{' FAILED' if failed else ''}: {colour[1]} = per step" + (", green = envelope" if findings else "")
        block = xychart(xs, series, title=title, y_label=key)
        if block:
            blocks.append(caption + "\n\n" + block)
    return blocks


def summary_charts(
    result: RunResult,
    verdict: Optional[Verdict],
    steps: Sequence[Mapping[str, Any]],
    aggregates: Sequence[Mapping[str, Any]],
) -> str:
    """The step summary's chart section (Markdown), or ``""`` when the run has no rows to draw."""
    blocks = [b for b in (loss_block(result, steps, aggregates), *dispersion_blocks(result, verdict, aggregates)) if b]
    if not blocks:
        return ""
    intro = (
        f"At most {MAX_POINTS} steps per chart (every k-th step). An envelope bounds a window statistic "
        f"(steps ≥ {result.window_start_step}), not single steps."
    )
    return "\n\n".join(["### Charts", intro, *blocks]) + "\n"

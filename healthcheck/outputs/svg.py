"""Inline-SVG chart primitives for the self-contained ``report.html`` (standard library only).

:func:`line_chart` draws step series (muted, highlighted or a reference such as the mean), a shaded
warmup, envelope bands over the judged window, and a legend; :mod:`.svg_heatmap` draws matrices.
Every chart is one ``<svg>`` element with a ``viewBox``, ``width="100%"`` and ``height:auto``, so it
scales down in a narrow window; no scripts, no external fonts or references. All caller text is
escaped, and the output is byte-stable for the same input (ids are hashes of it).

>>> svg = line_chart([Line("loss", [(0, 3.0), (1, 2.0), (2, 1.5)])], title="a < b & c")
>>> svg.startswith("<svg ") and 'width="100%"' in svg and "viewBox=" in svg
True
>>> "a &lt; b &amp; c" in svg and "a < b" not in svg
True
>>> import xml.etree.ElementTree as ET
>>> ET.fromstring(svg).tag
'{http://www.w3.org/2000/svg}svg'
"""

from __future__ import annotations

import hashlib
import html
import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

#: Okabe-Ito colour-blind-safe palette, for series without a colour of their own.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#555555")
#: Highlighted series (a standout rank): red first, then darker and warmer reds.
HIGHLIGHT_COLOURS = ("#D62728", "#8C1C13", "#E377C2", "#FF7F0E")
REFERENCE_COLOUR = "#111111"
OK_COLOUR, BAD_COLOUR = "#1E7B1E", "#D62728"
FONT = "system-ui,-apple-system,'Segoe UI',Roboto,'Liberation Sans','DejaVu Sans',Arial,sans-serif"
TEXT, MUTED, GRID = "#222", "#666", "#e5e5e5"
#: A white outline behind labels that sit on data, so they stay readable over lines.
HALO = 'paint-order="stroke" stroke="#fff" stroke-width="3" stroke-linejoin="round"'


def esc(text: object) -> str:
    """Escape any value for SVG/HTML text or a double-quoted attribute.

    >>> esc('<b a="1">&\\'x\\'</b>')
    '&lt;b a=&quot;1&quot;&gt;&amp;&#x27;x&#x27;&lt;/b&gt;'
    """
    return html.escape(str(text), quote=True)


def num(value: float) -> str:
    """A coordinate: 2 decimals, no trailing zeros.

    >>> num(12.0), num(3.14159), num(-0.001)
    ('12', '3.14', '0')
    """
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def nice_ticks(low: float, high: float, target: int = 5) -> list[float]:
    """ "Nice" tick values (1, 2, 2.5 or 5 x 10^k apart) covering [low, high].

    >>> nice_ticks(0, 1)
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    >>> nice_ticks(2.31, 2.87, 4)
    [2.2, 2.4, 2.6, 2.8, 3.0]
    >>> nice_ticks(5, 5)
    [4.0, 4.5, 5.0, 5.5, 6.0]
    """
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError("tick range must be finite")
    low, high = min(low, high), max(low, high)
    if high == low:
        pad = abs(low) * 0.2 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / max(1, target)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = magnitude
    for multiple in (1, 2, 2.5, 5, 10):
        step = multiple * magnitude
        if raw <= step:
            break
    first, last = math.floor(low / step + 1e-9), math.ceil(high / step - 1e-9)
    return [float(round(i * step, 12)) for i in range(first, last + 1)]


def format_tick(value: float, step: float) -> str:
    """A tick label with just the precision the tick step needs.

    >>> format_tick(0.30000000000000004, 0.1), format_tick(1500, 500), format_tick(2.5, 2.5)
    ('0.3', '1500', '2.5')
    >>> format_tick(2000000, 1000000), format_tick(0.0002, 0.0001), format_tick(0, 0.0001)
    ('2M', '2e-04', '0')
    """
    if value == 0:
        return "0"
    step = abs(step) or abs(value)
    if abs(value) >= 1e6 and step >= 1e5:
        for divisor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
            if abs(value) >= divisor:
                return format_tick(value / divisor, step / divisor) + suffix
    if step < 1e-3:
        exact = abs(value / step - round(value / step)) < 1e-6 and step >= abs(value) / 10
        return f"{value:.0e}" if exact else f"{value:.2e}"
    decimals = 0
    while decimals < 6 and abs(round(step, decimals) - step) > step * 1e-6:
        decimals += 1
    return f"{value:.{decimals}f}"


def text_width(text: str, size: float) -> float:
    """Rough rendered width of ``text`` in a sans-serif font (no font metrics here)."""
    return len(text) * size * 0.58


def truncate(text: str, max_chars: int) -> str:
    """Shorten to ``max_chars`` characters with an ellipsis.

    >>> truncate("abcdefgh", 5)
    'abcd…'
    """
    return text if len(text) <= max_chars else text[: max_chars - 1] + "\u2026"


def chart_id(prefix: str, *parts: object) -> str:
    """A deterministic element id for a chart, from its inputs."""
    return f"{prefix}-{hashlib.sha1(repr(parts).encode('utf-8', 'replace')).hexdigest()[:8]}"


def svg_open(width: float, height: float, label: str, max_scale: float, cid: str) -> str:
    """The ``<svg>`` start tag every chart shares: responsive width, accessible label."""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" id="{esc(cid)}" class="hc-chart" viewBox="0 0 {num(width)} {num(height)}" '
        f'width="100%" preserveAspectRatio="xMidYMid meet" role="img" aria-label="{esc(label)}" '
        f'style="display:block;height:auto;max-width:{int(width * max_scale)}px;font-family:{esc(FONT)};font-size:12px">'
    )


def title_text(title: str, width: float, size: int) -> str:
    return (
        f'<text x="{num(width / 2)}" y="{size + 6}" text-anchor="middle" font-size="{size + 2}" '
        f'font-weight="600" fill="{TEXT}">{esc(title)}</text>'
    )


@dataclass(frozen=True)
class Line:
    """One series: ``(step, value)`` points, None for a gap.

    ``role``: ``normal`` (muted when anything is highlighted), ``highlight`` (thick, red, on top) or
    ``reference`` (thick, black: the global mean). Series with the same ``legend`` label share one
    legend entry (None: the series' name).
    """

    name: str
    points: Sequence[tuple[float, Optional[float]]]
    role: Literal["normal", "highlight", "reference"] = "normal"
    legend: Optional[str] = None
    colour: Optional[str] = None


@dataclass(frozen=True)
class Band:
    """A baseline envelope ``[lower, upper]`` shaded over steps ``start..end`` (the judged window), and
    the ``observed`` window statistic drawn across it, green inside and red outside."""

    lower: Optional[float]
    upper: Optional[float]
    start: float
    end: float
    label: str
    observed: Optional[float] = None
    observed_label: str = ""
    passed: bool = True


def _colours(lines: Sequence[Line]) -> list[str]:
    out, palette, highlight = [], iter(PALETTE * 8), iter(HIGHLIGHT_COLOURS * 8)
    for line in lines:
        if line.colour:
            out.append(line.colour)
        elif line.role == "highlight":
            out.append(next(highlight))
        elif line.role == "reference":
            out.append(REFERENCE_COLOUR)
        else:
            out.append(next(palette))
    return out


def _paths(points: Sequence[tuple[float, Optional[float]]], sx: Callable[[float], float], sy: Callable[[float], float]) -> list[str]:
    """Path ``d`` strings, split at gaps (None, NaN, inf)."""
    runs: list[list[str]] = [[]]
    for x, y in points:
        if y is None or not math.isfinite(y):
            runs.append([])
        else:
            runs[-1].append(f"{num(sx(x))},{num(sy(y))}")
    return ["M" + " L".join(run) for run in runs if run]


def line_chart(
    lines: Sequence[Line],
    *,
    title: str = "",
    y_label: str = "",
    x_label: str = "step",
    warmup: Optional[tuple[float, float]] = None,
    bands: Sequence[Band] = (),
    stop: Optional[tuple[float, str]] = None,
    x_max: Optional[float] = None,
    width: int = 480,
    height: int = 290,
    font_size: int = 13,
    max_scale: float = 1.4,
    cid: Optional[str] = None,
) -> str:
    """A line chart as one inline ``<svg>``.

    ``warmup``: a shaded ``(start, end)`` region; ``bands``: envelopes (:class:`Band`); ``stop``:
    ``(step, label)`` of a dotted vertical line where an unfinished probe stopped, with ``x_max``
    stretching the axis to the planned steps.

    >>> svg = line_chart([Line("rank 0", [(0, 3.0), (1, 2.9), (3, None)], role="highlight"),
    ...                   Line("mean", [(0, 3.0), (1, 2.5), (3, 2.2)], role="reference")],
    ...                  warmup=(0, 1), bands=[Band(2.0, 2.4, 1, 3, "envelope", observed=2.5, passed=False)])
    >>> svg.count('class="hc-series'), 'class="hc-warmup"' in svg, 'class="hc-envelope"' in svg
    (2, True, True)
    >>> line_chart([]).count("no data")
    1
    """
    fs = font_size
    label = title or (f"{y_label} per {x_label}" if y_label else "line chart")
    cid = cid or chart_id("lc", title, [line.name for line in lines], width, height)
    ys = [y for line in lines for _, y in line.points if y is not None and math.isfinite(y)]
    xs = [x for line in lines for x, _ in line.points]
    out = [svg_open(width, height, label, max_scale, cid), f"<title>{esc(label)}</title>"]
    top = fs + 18 if title else 8
    if title:
        out.append(title_text(title, width, fs))
    if not ys:
        out.append(f'<text x="{num(width / 2)}" y="{num(height / 2)}" text-anchor="middle" fill="{MUTED}">no data</text></svg>')
        return "".join(out)

    x_lo, x_hi = min(xs), max(xs + ([x_max] if x_max is not None else []) + ([warmup[1]] if warmup else []))
    y_lo, y_hi = min(ys), max(ys)
    for band in bands:
        extra = [v for v in (band.lower, band.upper, band.observed) if v is not None and math.isfinite(v)]
        y_lo, y_hi = min([y_lo, *extra]), max([y_hi, *extra])
    x_ticks = nice_ticks(x_lo, x_hi, 6)
    if x_hi == x_lo:
        x_lo, x_hi = x_ticks[0], x_ticks[-1]
    x_ticks = [t for t in x_ticks if x_lo - 1e-9 <= t <= x_hi + 1e-9]
    y_ticks = nice_ticks(y_lo, y_hi, 5)
    y_lo, y_hi = y_ticks[0], y_ticks[-1]
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    y_tick_labels = [format_tick(t, y_step) for t in y_ticks]

    colours = _colours(lines)
    legend: dict[str, tuple[str, Line]] = {}  # label -> (colour, first series with it)
    for line, colour in zip(lines, colours, strict=True):
        legend.setdefault(line.legend or line.name, (colour, line))
    swatch, gap = 18, 14
    rows: list[list[tuple[str, str, float]]] = [[]]  # (label, shown text, x offset)
    row_width = 0.0
    for name in legend:
        shown = truncate(name, 30)
        entry = swatch + 5 + text_width(shown, fs) + gap
        if row_width + entry > width - 16 and rows[-1]:
            rows.append([])
            row_width = 0.0
        rows[-1].append((name, shown, row_width))
        row_width += entry
    legend_h = len(rows) * (fs + 8) + 4

    left = 10 + max(text_width(s, fs - 1) for s in y_tick_labels) + (fs + 10 if y_label else 4)
    right = 14
    bottom = fs + 10 + (fs + 8 if x_label else 0) + legend_h
    pw, ph = width - left - right, height - top - bottom
    if ph < 140:  # many legend rows: grow the chart instead of squashing the plot
        height += int(math.ceil(140 - ph))
        ph = height - top - bottom
        out[0] = svg_open(width, height, label, max_scale, cid)

    def sx(x: float) -> float:
        return left + (x - x_lo) / ((x_hi - x_lo) or 1) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y_lo) / ((y_hi - y_lo) or 1) * ph

    clip = f"{cid}-clip"  # a little outside the plot, so lines on an edge stay whole
    out.append(
        f'<defs><clipPath id="{esc(clip)}"><rect x="{num(left - 4)}" y="{num(top - 4)}" '
        f'width="{num(pw + 8)}" height="{num(ph + 8)}"/></clipPath></defs><g class="hc-axis hc-y">'
    )
    for tick, text in zip(y_ticks, y_tick_labels, strict=True):
        y = num(sy(tick))
        out.append(
            f'<line x1="{num(left)}" x2="{num(left + pw)}" y1="{y}" y2="{y}" stroke="{GRID}"/>'
            f'<text x="{num(left - 6)}" y="{y}" dy="0.32em" text-anchor="end" font-size="{fs - 1}" '
            f'fill="{MUTED}">{esc(text)}</text>'
        )
    out.append("</g>")
    if warmup is not None and sx(min(warmup[1], x_hi)) > sx(max(warmup[0], x_lo)):
        x0, x1 = sx(max(warmup[0], x_lo)), sx(min(warmup[1], x_hi))
        out.append(
            f'<g class="hc-warmup"><title>warmup: not judged</title><rect x="{num(x0)}" y="{num(top)}" '
            f'width="{num(x1 - x0)}" height="{num(ph)}" fill="#999" fill-opacity="0.15"/>'
            f'<text x="{num(x0 + 4)}" y="{num(top + fs + 2)}" font-size="{fs - 1}" fill="{MUTED}" {HALO}>warmup</text></g>'
        )
    out += [_band(band, sx, sy, (x_lo, x_hi, y_lo, y_hi), top, fs) for band in bands]
    out.append(
        f'<g class="hc-axis hc-x"><line x1="{num(left)}" x2="{num(left + pw)}" y1="{num(top + ph)}" y2="{num(top + ph)}" stroke="#999"/>'
    )
    for tick in x_ticks:
        x = num(sx(tick))
        out.append(
            f'<line x1="{x}" x2="{x}" y1="{num(top + ph)}" y2="{num(top + ph + 4)}" stroke="#999"/>'
            f'<text x="{x}" y="{num(top + ph + fs + 5)}" text-anchor="middle" font-size="{fs - 1}" '
            f'fill="{MUTED}">{esc(format_tick(tick, x_step))}</text>'
        )
    out.append("</g>")
    if x_label:
        out.append(
            f'<text x="{num(left + pw / 2)}" y="{num(top + ph + 2 * fs + 12)}" text-anchor="middle" fill="{TEXT}">{esc(x_label)}</text>'
        )
    if y_label:
        cy = num(top + ph / 2)
        out.append(f'<text x="{fs}" y="{cy}" text-anchor="middle" transform="rotate(-90 {fs} {cy})" fill="{TEXT}">{esc(y_label)}</text>')

    emphasis = any(line.role != "normal" for line in lines)
    order = {"normal": 0, "reference": 1, "highlight": 2}  # the highlighted rank on top
    out.append(f'<g clip-path="url(#{esc(clip)})" fill="none" stroke-linejoin="round" stroke-linecap="round">')
    for line, colour in sorted(zip(lines, colours, strict=True), key=lambda pair: order[pair[0].role]):
        stroke_width = {"normal": 1.3, "reference": 2.4, "highlight": 2.4}[line.role]
        opacity = 0.5 if emphasis and line.role == "normal" else 1.0
        classes = "hc-series" + ("" if line.role == "normal" else f" hc-{line.role}")
        out.append(
            f'<g class="{classes}" data-series="{esc(line.name)}" stroke="{colour}" stroke-width="{stroke_width}" '
            f'stroke-opacity="{opacity}"><title>{esc(line.name)}</title>'
        )
        out += [f'<path d="{d}"/>' for d in _paths(line.points, sx, sy)]
        valid = [(x, y) for x, y in line.points if y is not None and math.isfinite(y)]
        if len(valid) <= 20:
            out += [f'<circle cx="{num(sx(x))}" cy="{num(sy(y))}" r="2.2" fill="{colour}" stroke="none"/>' for x, y in valid]
        out.append("</g>")
    out.append("</g>")
    if stop is not None:
        x = num(sx(stop[0]))
        out.append(
            f'<g class="hc-stop"><line x1="{x}" x2="{x}" y1="{num(top)}" y2="{num(top + ph)}" stroke="{BAD_COLOUR}" '
            f'stroke-width="1.5" stroke-dasharray="2 3"/><text x="{num(sx(stop[0]) - 4)}" y="{num(top + fs + 2)}" '
            f'text-anchor="end" font-size="{fs - 1}" fill="{BAD_COLOUR}" {HALO}>{esc(stop[1])}</text></g>'
        )

    legend_y = height - legend_h + 6
    out.append('<g class="hc-legend">')
    for index, row in enumerate(rows):
        row_w = row[-1][2] + swatch + 5 + text_width(row[-1][1], fs)
        row_x, row_y = max(8.0, (width - row_w) / 2), legend_y + index * (fs + 8) + fs / 2
        for name, shown, offset in row:
            colour, first = legend[name]
            bold = ' font-weight="700"' if first.role == "highlight" else ""
            lx, ly = num(row_x + offset), num(row_y)
            out.append(
                f'<g data-series="{esc(name)}"><title>{esc(name)}</title><line x1="{lx}" x2="{num(row_x + offset + swatch)}" '
                f'y1="{ly}" y2="{ly}" stroke="{colour}" stroke-width="{2 if first.role == "normal" else 3}"/>'
                f'<text x="{num(row_x + offset + swatch + 5)}" y="{ly}" dy="0.32em" fill="{TEXT}"{bold}>{esc(shown)}</text></g>'
            )
    out.append("</g></svg>")
    return "".join(out)


def _band(
    band: Band,
    sx: Callable[[float], float],
    sy: Callable[[float], float],
    limits: tuple[float, float, float, float],
    top: float,
    fs: int,
) -> str:
    x_lo, x_hi, y_lo, y_hi = limits
    x0, x1 = sx(max(band.start, x_lo)), sx(min(band.end, x_hi))
    upper = band.upper if band.upper is not None else y_hi
    lower = band.lower if band.lower is not None else y_lo
    y0, y1 = sy(min(upper, y_hi)), sy(max(lower, y_lo))
    bounds = f"[{esc(band.lower if band.lower is not None else '-inf')}, {esc(band.upper if band.upper is not None else '+inf')}]"
    out = [
        f'<g class="hc-envelope"><title>{esc(band.label)}: {bounds}</title>'
        f'<rect x="{num(x0)}" y="{num(y0)}" width="{num(max(0.0, x1 - x0))}" height="{num(max(0.0, y1 - y0))}" '
        f'fill="#2ca02c" fill-opacity="0.12" stroke="#2ca02c" stroke-opacity="0.6" stroke-dasharray="4 3"/>'
        f'<text x="{num(x1 - 4)}" y="{num(y0 - 4 if y0 - top > fs + 4 else y0 + fs + 2)}" text-anchor="end" '
        f'font-size="{fs - 1}" fill="{OK_COLOUR}" {HALO}>{esc(band.label)}</text>'
    ]
    if band.observed is not None and math.isfinite(band.observed):
        colour = OK_COLOUR if band.passed else BAD_COLOUR
        y_px = sy(band.observed)
        y, dy = num(y_px), "-0.4em" if y_px - top > fs + 4 else "1.2em"  # at the top edge: below the line, clear of the title
        out.append(
            f'<g class="hc-observed" data-passed="{str(band.passed).lower()}"><title>{esc(band.observed_label)}</title>'
            f'<line x1="{num(x0)}" x2="{num(x1)}" y1="{y}" y2="{y}" stroke="{colour}" stroke-width="2" stroke-dasharray="6 3"/>'
            f'<text x="{num(x0 + 4)}" y="{y}" dy="{dy}" font-size="{fs - 1}" fill="{colour}" {HALO}>'
            f"{esc(band.observed_label)}</text></g>"
        )
    return "".join(out) + "</g>"

"""An N x N matrix as an inline-SVG heatmap with a colour bar, for ``report.html`` (standard library only).

>>> svg = heatmap([[None, 0.5], [0.45, None]], labels=["<a>", "b"], title="t", highlight=[0])
>>> svg.count('class="hc-cell"'), "&lt;a&gt;" in svg, svg.count('data-missing="1"')
(4, True, 2)
>>> import xml.etree.ElementTree as ET
>>> ET.fromstring(svg).tag
'{http://www.w3.org/2000/svg}svg'
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from healthcheck.outputs.svg import BAD_COLOUR, MUTED, TEXT, chart_id, esc, num, svg_open, text_width, title_text, truncate

_VIRIDIS = ((0.0, (68, 1, 84)), (0.25, (59, 82, 139)), (0.5, (33, 145, 140)), (0.75, (94, 201, 98)), (1.0, (253, 231, 37)))


def colour_at(t: float) -> str:
    """The viridis colour at ``t`` in [0, 1] (clamped) as ``#rrggbb``.

    >>> colour_at(0), colour_at(1), colour_at(7)
    ('#440154', '#fde725', '#fde725')
    """
    t = 0.0 if not math.isfinite(t) else min(1.0, max(0.0, t))
    for (t0, c0), (t1, c1) in zip(_VIRIDIS, _VIRIDIS[1:], strict=False):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            return "#" + "".join(f"{round(a + (b - a) * f):02x}" for a, b in zip(c0, c1, strict=True))
    return "#" + "".join(f"{c:02x}" for c in _VIRIDIS[-1][1])


def _text_on(colour: str) -> str:
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return "#000" if 0.299 * red + 0.587 * green + 0.114 * blue > 140 else "#fff"


def heatmap(
    matrix: Sequence[Sequence[Optional[float]]],
    *,
    labels: Sequence[str],
    title: str = "",
    vmin: Optional[float] = None,
    vmax: Optional[float] = None,
    highlight: Sequence[int] = (),
    value_format: str = "{:.2f}",
    missing_text: str = "n/a",
    colorbar_label: str = "",
    axis_label: str = "",
    width: int = 480,
    font_size: int = 13,
    max_scale: float = 1.3,
    cid: Optional[str] = None,
) -> str:
    """A square matrix as one inline ``<svg>``: viridis cells, values printed where they fit, a colour bar.

    Missing or non-finite cells are hatched grey (their tooltip says ``missing_text``); labels at the
    ``highlight`` indices are red and bold; every cell has a tooltip with its row, column and value.
    """
    rows = [list(row) for row in matrix]
    n = len(rows)
    if any(len(row) != n for row in rows) or len(labels) != n:
        raise ValueError(f"heatmap needs an N x N matrix and N labels; got {n} rows, {len(labels)} labels")
    fs = font_size
    label = title or f"heatmap {n}x{n}"
    cid = cid or chart_id("hm", title, list(labels))
    values = [v for row in rows for v in row if v is not None and math.isfinite(v)]
    if not values:
        return (
            svg_open(width, 120, label, max_scale, cid) + f"<title>{esc(label)}</title>"
            f'<text x="{num(width / 2)}" y="60" text-anchor="middle" fill="{MUTED}">no data</text></svg>'
        )
    low = min(values) if vmin is None else vmin
    high = max(values) if vmax is None else vmax
    if high <= low:
        high = low + 1

    shown = [truncate(str(text), 12) for text in labels]
    top = 8 + (fs + 14 if title else 0)
    left = 8 + max(text_width(s, fs - 1) for s in shown) + 6 + (fs + 6 if axis_label else 0)
    tick_w = max(text_width(value_format.format(v), fs - 1) for v in (low, (low + high) / 2, high))
    bar_w = 18 + 21 + tick_w + 6 + (fs + 4 if colorbar_label else 0)  # gap, bar and ticks, tick labels, rotated label
    cell = max(8.0, min(48.0, (width - left - bar_w - 4) / n))
    grid = cell * n
    label_h = fs + 8 + (fs + 8 if axis_label else 0)
    height = int(math.ceil(max(top + grid + label_h + 8, top + 120)))
    longest = max(len(value_format.format(v)) for v in values)
    value_fs = min(float(fs), cell / 2.6, (cell - 5) / (0.6 * max(1, longest)))

    out = [svg_open(width, height, label, max_scale, cid), f"<title>{esc(label)}</title>"]
    if title:
        out.append(title_text(title, width, fs))
    hatch, gradient = f"{cid}-hatch", f"{cid}-grad"
    stops = "".join(f'<stop offset="{int(t * 100)}%" stop-color="{colour_at(1 - t)}"/>' for t in (0, 0.25, 0.5, 0.75, 1))
    out.append(
        f'<defs><pattern id="{esc(hatch)}" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        f'<rect width="6" height="6" fill="#eee"/><line x1="0" y1="0" x2="0" y2="6" stroke="#bbb" stroke-width="2"/></pattern>'
        f'<linearGradient id="{esc(gradient)}" x1="0" y1="0" x2="0" y2="1">{stops}</linearGradient></defs><g class="hc-cells">'
    )
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            x, y = num(left + j * cell), num(top + i * cell)
            if value is None or not math.isfinite(value):
                out.append(
                    f'<g class="hc-cell" data-row="{i}" data-col="{j}" data-missing="1"><title>{esc(labels[i])} / '
                    f'{esc(labels[j])}: {esc(missing_text)}</title><rect x="{x}" y="{y}" width="{num(cell)}" '
                    f'height="{num(cell)}" fill="url(#{esc(hatch)})" stroke="#fff"/></g>'
                )
                continue
            colour, text = colour_at((value - low) / (high - low)), value_format.format(value)
            out.append(
                f'<g class="hc-cell" data-row="{i}" data-col="{j}" data-value="{esc(repr(value))}"><title>{esc(labels[i])} / '
                f'{esc(labels[j])}: {esc(text)}</title><rect x="{x}" y="{y}" width="{num(cell)}" height="{num(cell)}" '
                f'fill="{colour}" stroke="#fff"/>'
            )
            if value_fs >= 9:  # values only where they are readable; the tooltip has them all
                out.append(
                    f'<text x="{num(left + (j + 0.5) * cell)}" y="{num(top + (i + 0.5) * cell)}" dy="0.35em" '
                    f'text-anchor="middle" font-size="{value_fs:.1f}" fill="{_text_on(colour)}">{esc(text)}</text>'
                )
            out.append("</g>")
    out.append("</g>")

    label_fs = float(min(fs - 1, max(9.0, cell - 1)))
    every = max(1, math.ceil((label_fs + 1) / cell))  # small cells: label every k-th rank only
    out.append(f'<g class="hc-labels" font-size="{label_fs:g}" fill="{TEXT}">')
    for i, text in enumerate(shown):
        if i % every and i not in highlight:
            continue
        style = f' fill="{BAD_COLOUR}" font-weight="700"' if i in highlight else ""
        out.append(
            f'<text x="{num(left - 6)}" y="{num(top + (i + 0.5) * cell)}" dy="0.32em" text-anchor="end"{style}>{esc(text)}</text>'
            f'<text x="{num(left + (i + 0.5) * cell)}" y="{num(top + grid + 6)}" dy="0.8em" text-anchor="middle"{style}>'
            f"{esc(text)}</text>"
        )
    out.append("</g>")
    if axis_label:
        cy = num(top + grid / 2)
        out.append(
            f'<text x="{fs}" y="{cy}" text-anchor="middle" transform="rotate(-90 {fs} {cy})" fill="{TEXT}">{esc(axis_label)}</text>'
            f'<text x="{num(left + grid / 2)}" y="{num(top + grid + 2 * fs + 14)}" text-anchor="middle" fill="{TEXT}">'
            f"{esc(axis_label)}</text>"
        )

    bar_x, bar_h = left + grid + 18, max(grid, 100)
    out.append(
        f'<g class="hc-colorbar"><rect x="{num(bar_x)}" y="{num(top)}" width="14" height="{num(bar_h)}" '
        f'fill="url(#{esc(gradient)})" stroke="#ccc"/>'
    )
    for fraction, value in ((0.0, high), (0.5, (low + high) / 2), (1.0, low)):
        y = num(top + fraction * bar_h)
        out.append(
            f'<line x1="{num(bar_x + 14)}" x2="{num(bar_x + 18)}" y1="{y}" y2="{y}" stroke="#999"/>'
            f'<text x="{num(bar_x + 21)}" y="{y}" dy="0.32em" font-size="{fs - 1}" fill="{MUTED}">'
            f"{esc(value_format.format(value))}</text>"
        )
    if colorbar_label:
        cx, cy = num(bar_x + 21 + tick_w + 6 + fs / 2), num(top + bar_h / 2)
        out.append(
            f'<text x="{cx}" y="{cy}" text-anchor="middle" font-size="{fs - 1}" fill="{TEXT}" '
            f'transform="rotate(90 {cx} {cy})">{esc(colorbar_label)}</text>'
        )
    out.append("</g></svg>")
    return "".join(out)

"""The SVG chart primitives: gaps, legends, envelopes and the heatmap's cells, labels and colour bar."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from healthcheck.outputs.svg import Band, Line, line_chart
from healthcheck.outputs.svg_heatmap import heatmap

SVG = "{http://www.w3.org/2000/svg}"


def series_groups(svg: str) -> dict[str, ET.Element]:
    root = ET.fromstring(svg)
    return {g.get("data-series"): g for g in root.iter(f"{SVG}g") if "hc-series" in (g.get("class") or "")}


def test_a_gap_splits_the_line_and_nothing_is_drawn_for_it():
    svg = line_chart([Line("rank 0", [(0, 1.0), (1, math.nan), (2, None), (3, 2.0), (4, 2.5)])])
    paths = series_groups(svg)["rank 0"].findall(f"{SVG}path")
    assert [p.get("d").count("L") for p in paths] == [0, 1]


def test_ranks_share_one_legend_entry_and_the_highlight_is_drawn_last():
    lines = [Line(f"rank {r}", [(0, 1.0 + r), (1, 2.0)], legend="each rank", colour="#1f77b4") for r in range(1, 8)]
    lines += [Line("mean", [(0, 4.0), (1, 2.0)], role="reference"), Line("rank 0", [(0, 9.0), (1, 3.0)], role="highlight")]
    svg = line_chart(lines, warmup=(0, 0.5))
    root = ET.fromstring(svg)
    legend = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "hc-legend")
    assert [g.get("data-series") for g in legend.findall(f"{SVG}g")] == ["each rank", "mean", "rank 0"]
    drawn = list(series_groups(svg))
    assert drawn[-2:] == ["mean", "rank 0"] and len(drawn) == 9
    assert "hc-highlight" in series_groups(svg)["rank 0"].get("class")


def test_an_envelope_shows_its_bounds_and_whether_the_statistic_is_outside():
    band = Band(0.39, 0.46, 10, 59, "envelope", observed=0.35, observed_label="median 0.35 (OUTSIDE)", passed=False)
    root = ET.fromstring(line_chart([Line("cosine_mean", [(s, 0.35) for s in range(60)])], bands=[band]))
    envelope = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "hc-envelope")
    assert envelope.find(f"{SVG}title").text == "envelope: [0.39, 0.46]"
    observed = envelope.find(f"{SVG}g")
    assert observed.get("data-passed") == "false" and observed.find(f"{SVG}line").get("stroke") == "#D62728"


def test_heatmap_cells_labels_and_bad_shapes():
    svg = heatmap([[None, 0.2, 0.3], [0.2, None, 0.9], [0.3, 0.9, None]], labels=["0", "1", "2"], highlight=[0], colorbar_label="cos")
    root = ET.fromstring(svg)
    cells = [g for g in root.iter(f"{SVG}g") if g.get("class") == "hc-cell"]
    assert len(cells) == 9 and sum(c.get("data-missing") == "1" for c in cells) == 3
    labels = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "hc-labels")
    assert [t.get("fill") for t in labels if t.text == "0"] == ["#D62728", "#D62728"]
    width = float(root.get("viewBox").split()[2])
    label_x = [float(t.get("x")) for t in root.iter(f"{SVG}text") if t.text == "cos"]
    assert label_x and label_x[0] + 13 / 2 <= width  # the colour bar's label stays inside the chart
    with pytest.raises(ValueError, match="N x N"):
        heatmap([[1.0, 2.0]], labels=["0"])

"""The PNGs: they exist, decode, carry an image, and their axes say what they show."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.image import imread

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE
from healthcheck.files import read_jsonl
from healthcheck.outputs import plots, series
from tests.fixtures_runs import write_fake_run


def _records(run_dir):
    return list(read_jsonl(run_dir / STEPS_FILE)), list(read_jsonl(run_dir / AGGREGATES_FILE))


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fail")
    result, verdict = write_fake_run(run_dir)
    steps, aggregates = _records(run_dir)
    return result, verdict, steps, aggregates


@pytest.fixture(scope="module")
def written(failing, tmp_path_factory):
    return plots.write_plots(tmp_path_factory.mktemp("plots"), *failing)


def test_three_pngs_that_decode_and_are_not_blank(written):
    assert [p.name for p in written] == ["loss.png", "dispersion.png", "cosine.png"]
    for path in written:
        assert path.stat().st_size > 10_000, path
        pixels = imread(path)
        height, width = pixels.shape[:2]
        assert width >= 600 and height >= 500, (path, pixels.shape)
        rgb = (pixels[..., :3] * 255).astype(np.uint32).reshape(-1, 3)
        colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])
        assert len(colours) > 50, path  # lines, text and fills, not a flat colour
    assert not list(written[0].parent.glob(".*.tmp"))  # temp files renamed away


def test_loss_plot_shows_the_mean_the_band_and_the_outlier(failing):
    result, verdict, steps, aggregates = failing
    fig = Figure()
    plots.draw_loss(fig, result, steps, aggregates, standout_ranks=[0], label="FAIL")
    (ax,) = fig.axes
    assert ax.get_xlabel() == "optimizer step"
    assert "nats/token" in ax.get_ylabel()
    assert "s1-2-probe" in ax.get_title() and "FAIL" in ax.get_title()
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "rank 0 (stands out)" in legend
    assert any(label.startswith("global mean") for label in legend)
    assert "per-rank min-max band" in legend
    assert "warmup (not judged)" in legend
    assert len(ax.get_lines()) == 8 + 1  # each rank, and the mean


def test_dispersion_plot_has_three_panels_with_envelopes(failing):
    result, verdict, steps, aggregates = failing
    fig = Figure()
    plots.draw_dispersion(fig, result, verdict, aggregates, label="FAIL")
    assert len(fig.axes) == 3
    assert all(ax.get_ylabel() for ax in fig.axes)
    assert fig.axes[-1].get_xlabel() == "optimizer step"
    assert "FAIL" in fig.get_suptitle()
    for ax in fig.axes:
        legend = [text.get_text() for text in ax.get_legend().get_texts()]
        assert any(label.startswith("baseline envelope") for label in legend), legend
    cosine_panel = fig.axes[2]
    legend = [text.get_text() for text in cosine_panel.get_legend().get_texts()]
    assert "window median = 0.353 (OUTSIDE)" in legend
    assert to_rgba(cosine_panel.spines["left"].get_edgecolor()) == to_rgba(plots._BAD)
    assert to_rgba(fig.axes[0].spines["left"].get_edgecolor()) != to_rgba(plots._BAD)


def test_dispersion_without_a_verdict_draws_no_envelope(failing):
    result, _, steps, aggregates = failing
    fig = Figure()
    plots.draw_dispersion(fig, result, None, aggregates, label="NO BASELINE")
    assert "not judged" in fig.get_suptitle()
    for ax in fig.axes:
        assert not any("envelope" in text.get_text() for text in ax.get_legend().get_texts())


def test_cosine_heatmap_is_labelled_and_annotated(failing):
    result, verdict, steps, aggregates = failing
    matrix = series.mean_pairwise_cosine(aggregates, result.window_start_step)
    fig = Figure()
    plots.draw_cosine(fig, result, matrix, standout_ranks=[0], label="FAIL")
    ax = fig.axes[0]
    image = ax.get_images()[0]
    assert image.get_array().shape == (8, 8)
    assert image.get_array().mask.diagonal().all()  # self-cosine blank, not on the colour scale
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(r) for r in range(8)]
    assert ax.get_xlabel() == ax.get_ylabel() == "rank"
    assert len(ax.texts) == 64
    assert ax.get_xticklabels()[0].get_color() == plots._BAD
    assert "rank 0 stands out" in ax.get_title()
    assert len(fig.axes) == 2 and "cosine" in fig.axes[1].get_ylabel()  # the colorbar


def test_an_incomplete_run_marks_where_it_stopped(tmp_path):
    result, _ = write_fake_run(tmp_path, status="incomplete")
    steps, aggregates = _records(tmp_path)
    fig = Figure()
    plots.draw_loss(fig, result, steps, aggregates, standout_ranks=[0], label="INCOMPLETE")
    ax = fig.axes[0]
    assert any(t.get_text().startswith("probe stopped (incomplete) after step 35") for t in ax.get_legend().get_texts())
    assert ax.get_xlim()[1] == result.steps_planned - 1


def test_no_records_no_plots(failing, tmp_path):
    result, verdict, _, _ = failing
    assert plots.write_plots(tmp_path, result, verdict, [], []) == []


def test_importing_the_report_does_not_import_matplotlib():
    code = "import sys, healthcheck.outputs.report, healthcheck.outputs.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"

"""The step summary's Mermaid charts stay inside the subset GitHub's mermaid parses: no exponents, no
gaps, no double quotes in strings, at most 60 points and 8 series, one value per step on every line."""

from __future__ import annotations

import re

import pytest

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE
from healthcheck.files import read_jsonl
from healthcheck.outputs import mermaid
from tests.fixtures_runs import write_fake_run


def parse_blocks(markdown: str) -> list[dict]:
    """Each fenced block's title, steps and ``{series: values}``, checking the safe subset on the way."""
    blocks = []
    for body in re.findall(r"```mermaid\n(.*?)\n```", markdown, re.S):
        lines = body.splitlines()
        assert lines[0].startswith('%%{init: {"themeVariables": {"xyChart": {"plotColorPalette": "#')
        assert lines[1] == "xychart-beta"
        title = re.fullmatch(r'    title "([^"`]*)"', lines[2]).group(1)
        steps = re.fullmatch(r'    x-axis "step" \[([0-9, ]+)\]', lines[3]).group(1).split(", ")
        low, high = re.fullmatch(r'    y-axis "[^"]*" (-?[0-9.]+) --> (-?[0-9.]+)', lines[4]).groups()
        series = {}
        for line in lines[5:]:
            name, values = re.fullmatch(r'    line "([^"`]*)" \[(-?[0-9.]+(?:, -?[0-9.]+)*)\]', line).groups()
            series[name] = [float(v) for v in values.split(", ")]
            assert len(series[name]) == len(steps), name
            assert all(float(low) <= v <= float(high) for v in series[name]), name
        palette = lines[0].split('"plotColorPalette": "')[1].split('"')[0].split(", ")
        assert len(palette) == len(series)
        blocks.append({"title": title, "steps": [int(s) for s in steps], "series": series})
    return blocks


def summary_of(run_dir, **kwargs) -> str:
    result, verdict = write_fake_run(run_dir, **kwargs)
    steps, aggregates = list(read_jsonl(run_dir / STEPS_FILE)), list(read_jsonl(run_dir / AGGREGATES_FILE))
    return mermaid.summary_charts(result, verdict, steps, aggregates)


def charts_of(run_dir, **kwargs) -> list[dict]:
    return parse_blocks(summary_of(run_dir, **kwargs))


def test_a_failing_run_gets_the_loss_and_every_dispersion_panel(tmp_path):
    text = summary_of(tmp_path)
    blocks = parse_blocks(text)
    assert len(blocks) == 4
    loss, *panels = blocks
    assert list(loss["series"])[-2:] == ["mean", "rank 0"]  # the standout drawn last, on top
    assert loss["title"] == "loss: red = standout rank, black = mean, blue = others"
    assert "red: rank 0 (stands out); black: the mean of all 8 ranks; light blue: ranks 1, 2, 3, 4, 6, 7." in text
    assert len(loss["series"]) == mermaid.MAX_SERIES
    assert len(loss["steps"]) == mermaid.MAX_POINTS and (loss["steps"][0], loss["steps"][-1]) == (0, 59)
    assert "window median 0.353 is **OUTSIDE** the envelope [0.39, 0.46] (green)." in text
    assert all(len(block["title"]) <= 60 for block in blocks)  # mermaid does not wrap titles
    keys = ("loss_std", "grad_norm_cv", "cosine_mean")
    assert [list(p["series"]) for p in panels] == [[k, "envelope lower", "envelope upper"] for k in keys]
    assert panels[2]["title"] == "cosine_mean FAILED: red = per step, green = envelope"
    assert set(panels[2]["series"]["envelope lower"]) == {0.39}


def test_long_runs_and_many_ranks_are_downsampled(tmp_path):
    blocks = charts_of(tmp_path, steps=200, warmup=20, ranks=24, outlier_rank=5)
    for block in blocks:
        assert len(block["steps"]) <= mermaid.MAX_POINTS and len(block["series"]) <= mermaid.MAX_SERIES
        assert block["steps"][0] == 0 and block["steps"][-1] == 199
    assert "rank 5" in blocks[0]["series"] and "mean" in blocks[0]["series"]


def test_non_finite_values_drop_their_step(tmp_path):
    result, verdict = write_fake_run(tmp_path)
    steps = list(read_jsonl(tmp_path / STEPS_FILE))
    for row in steps:
        if row["rank"] == 0 and row["step"] in (20, 21):
            row["loss"] = float("nan")
        if row["rank"] == 0 and row["step"] == 22:
            row["loss"] = None
    loss = parse_blocks(mermaid.summary_charts(result, verdict, steps, list(read_jsonl(tmp_path / AGGREGATES_FILE))))[0]
    assert not {20, 21, 22} & set(loss["steps"]) and (loss["steps"][0], loss["steps"][-1]) == (0, 59)
    assert loss["title"].endswith("(3 steps left out: no value)")


def test_titles_cannot_break_the_block():
    text = mermaid.xychart([0, 1], [('a"`b', [1.0, 2.0], ("#000000", "black"))], title='x"```\ny', y_label="`")
    assert text.count("```") == 2
    block = parse_blocks(text)[0]
    assert block["title"] == "x'''' y" and list(block["series"]) == ["a''b"]


def test_no_rows_no_charts(tmp_path):
    result, verdict = write_fake_run(tmp_path)
    assert mermaid.summary_charts(result, verdict, [], []) == ""


@pytest.mark.parametrize("value", [1e-12, 3.25e-7, 0.5, 12345.678, 9.99e15, -2.5e-5])
def test_plain_numbers_have_no_exponent_and_keep_four_digits(value):
    text = mermaid.plain_number(value)
    assert re.fullmatch(r"-?\d+(\.\d+)?", text), text
    assert float(text) == pytest.approx(value, rel=1e-3)

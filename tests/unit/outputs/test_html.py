"""report.html as text: self-contained, escaped, failed checks first, a chart per view, on every kind of run.

How it looks in a browser is checked in ``tests/e2e/test_report_browser.py``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE
from healthcheck.files import read_jsonl
from healthcheck.judge.findings import ConfigChange
from healthcheck.outputs.html import render_html
from tests.fixtures_runs import write_fake_run

CHART_IDS = ["chart-loss", "chart-loss_std", "chart-grad_norm_cv", "chart-cosine_mean", "chart-cosine"]
HOSTILE = '<script>alert("x")</script><img src=https://evil.example/x.png onerror=alert(1)>&amp;'


class Page(HTMLParser):
    """Every start tag with its attributes, and the text, as a browser's parser sees them."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data):
        self.text.append(data)

    def rows(self) -> list[dict[str, str]]:
        return [attrs for tag, attrs in self.tags if tag == "tr" and "data-status" in attrs]


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("html")
    kinds = {"fail": {}, "pass": {"outlier_rank": None}, "none": {"judged": False}, "incomplete": {"status": "incomplete"}}
    out = {}
    for kind, kwargs in kinds.items():
        result, verdict = write_fake_run(root / kind, **kwargs)
        steps, aggregates = list(read_jsonl(root / kind / STEPS_FILE)), list(read_jsonl(root / kind / AGGREGATES_FILE))
        out[kind] = (result, verdict, steps, aggregates, render_html(result, verdict, steps, aggregates))
    return out


@pytest.mark.parametrize(("kind", "label"), [("fail", "FAIL"), ("pass", "PASS"), ("none", "NO BASELINE"), ("incomplete", "INCOMPLETE")])
def test_every_kind_of_run_gets_a_banner_and_every_chart(pages, kind, label):
    text = pages[kind][-1]
    assert re.search(rf'data-testid="verdict"[^>]*><strong>{label}</strong>', text)
    ids = [attrs["id"] for tag, attrs in Page(text).tags if tag == "svg"]
    assert ids == CHART_IDS
    for svg in re.findall(r"<svg .*?</svg>", text, re.S):
        ET.fromstring(svg)  # each chart is well-formed XML


def test_failed_checks_come_first_and_carry_their_message(pages):
    result, verdict, *_, text = pages["fail"]
    rows = Page(text).rows()
    assert [r["data-status"] for r in rows] == ["fail"] * 3 + ["pass"] * 4
    assert [r["data-check"] for r in rows[:3]] == ["envelope.cosine_to_mean_min", "envelope.cosine_mean", "audit.seeds"]
    assert "rank 0 used seed 1041, the other ranks seed 42" in text
    assert "rank 0 stands out: cosine_to_mean z=-60.9" in text
    assert "<code>seed_policy</code>: <code>shared</code> → <code>rank0_differs</code>" in text
    assert re.findall(r'<figure class="failed" data-testid="chart"><svg [^>]*id="([^"]+)"', text) == ["chart-cosine_mean"]


def test_without_a_verdict_there_is_no_checks_table(pages):
    for kind in ("none", "incomplete"):
        text = pages[kind][-1]
        assert 'id="checks"' not in text and "Config changes" not in text
    assert "(not judged)" in pages["none"][-1]
    assert "stopped (incomplete) after step 35" in pages["incomplete"][-1]


def test_the_page_is_self_contained(pages):
    for *_, text in pages.values():
        page = Page(text)
        tags = {tag for tag, _ in page.tags}
        assert not tags & {"script", "link", "img", "iframe", "object", "embed", "base"}, tags
        for tag, attrs in page.tags:
            for name in ("src", "href", "xlink:href", "srcset", "action"):
                assert not attrs.get(name, "#").strip() or attrs.get(name, "#").startswith("#"), (tag, attrs)
        # CSS only references the page itself (url(#gradient)), never a file or a host.
        assert re.findall(r"url\((?!#)", text) == []
        assert "@import" not in text and "@font-face" not in text
        assert re.findall(r"https?://(?!www\.w3\.org/2000/svg\")", text) == []


def test_hostile_text_is_escaped(pages):
    result, verdict, steps, aggregates, _ = pages["fail"]
    failed = verdict.failures[0].model_copy(update={"message": HOSTILE, "check": f"audit.{HOSTILE}"})
    verdict = verdict.model_copy(update={
        "findings": [failed, *verdict.findings[1:]],
        "notes": [HOSTILE],
        "baseline_path": HOSTILE,
        "config_diff": [ConfigChange(path=f"data.{HOSTILE}", old=HOSTILE, new={"x": HOSTILE})],
    })
    result = result.model_copy(update={"name": HOSTILE})
    text = render_html(result, verdict, steps, aggregates)
    page = Page(text)
    assert not {tag for tag, _ in page.tags} & {"script", "img"}
    assert not any(name.startswith("on") for _, attrs in page.tags for name in attrs)
    assert HOSTILE not in text
    shown = "".join(page.text)
    assert shown.count('<script>alert("x")</script>') >= 6  # the parser gives back the text people read
    assert not any("evil.example" in attrs.get(name, "") for _, attrs in page.tags for name in ("src", "href", "srcset", "style"))


def test_rendering_is_deterministic(pages):
    result, verdict, steps, aggregates, text = pages["fail"]
    assert render_html(result, verdict, steps, aggregates) == text

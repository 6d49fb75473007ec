"""``report.html`` as a person sees it: the real ``healthcheck probe`` on a faulted scenario, its page
rendered in a real headless Chromium (``tests/browser.py``), at a desktop width and at 420 px.

The scenario is identical data on every rank (``--set data.sharding=replicated``), judged against the
committed ``baselines/default.json`` with ``--no-fail-fast`` (fail fast would stop it before the first
step, with nothing to chart), shortened to 24 steps: the data_shards audit and several envelopes fail. One probe run
is shared by every test here. Screenshots are saved into that run directory; to also write the
desktop one where the README shows it::

    HEALTHCHECK_REPORT_SCREENSHOT=docs/report-fail.png python3 -m pytest -q tests/e2e/test_report_browser.py

Without Chromium these tests fail (never skip), with the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest

from tests import browser
from tests.e2e.conftest import REPO, run_cli

pytestmark = pytest.mark.e2e

CHART_IDS = ("chart-loss", "chart-loss_std", "chart-grad_norm_cv", "chart-cosine_mean", "chart-cosine")
SCREENSHOT_ENV = "HEALTHCHECK_REPORT_SCREENSHOT"

#: What the page shows, measured by the browser: visibility from computed style and layout boxes.
PAGE_FACTS_JS = r"""
(() => {
  const visible = (el) => {
    if (!el) return false;
    const cs = getComputedStyle(el), r = el.getBoundingClientRect();
    return cs.display !== 'none' && cs.visibility !== 'hidden' && parseFloat(cs.opacity) > 0 && r.width > 0 && r.height > 0;
  };
  const box = (el) => { const r = el.getBoundingClientRect();
    return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height}; };
  const verdict = document.querySelector('[data-testid=verdict]');
  return {
    verdict: verdict && {text: verdict.innerText.trim(), visible: visible(verdict),
                         in_first_screen: verdict.getBoundingClientRect().bottom <= innerHeight},
    checks: [...document.querySelectorAll('#checks tbody tr')].map(tr => ({
        check: tr.dataset.check, status: tr.dataset.status, top: box(tr).y, visible: visible(tr)})),
    charts: Object.fromEntries([...document.querySelectorAll('svg.hc-chart')].map(s => [s.id, {visible: visible(s), ...box(s)}])),
    page_width: document.documentElement.scrollWidth,
    page_height: document.documentElement.scrollHeight,
    resources: performance.getEntriesByType('resource').map(e => e.name),
  };
})()
"""


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """One browser for the module, checked dead (and its profile gone) at teardown."""
    try:
        session = browser.Browser(timeout=60, tmp_dir=tmp_path_factory.mktemp("chromium"))
    except browser.BrowserNotFound as exc:
        pytest.fail(f"the report tests need a real browser: {exc}", pytrace=False)
    try:
        yield session
    finally:
        session.close()
        assert browser.browser_processes(session.profile) == [], "browser processes left running"
        assert not os.path.exists(session.profile), "temporary browser profile left behind"


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report-browser") / "run"
    # 24 steps (14 after the warm-up) still draw every chart and fail audit.data_shards, in about half the time of 60.
    done = run_cli("probe", "--set", "data.sharding=replicated", "--set", "train.steps=24", "--no-fail-fast", "--out", out)
    assert done.returncode == 1, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert (out / "report.html").is_file()
    return out


@pytest.mark.parametrize("width", [1200, 420])
def test_the_failing_report_renders_in_a_browser(chromium, faulted_run, width):
    page = chromium.new_page(width=width, height=900)
    try:
        page.goto(faulted_run / "report.html")
        facts = page.eval_js(PAGE_FACTS_JS)
        shot = faulted_run / f"report-{width}.png"
        page.screenshot(shot)
    finally:
        page.close()

    verdict = facts["verdict"]
    assert verdict is not None and verdict["visible"] and verdict["in_first_screen"], verdict
    assert verdict["text"].split()[0] == "FAIL", verdict["text"]

    checks = facts["checks"]
    assert checks and all(row["visible"] for row in checks)
    in_page_order = sorted(checks, key=lambda row: row["top"])
    assert in_page_order[0]["status"] == "fail", in_page_order[0]
    statuses = [row["status"] for row in in_page_order]
    assert statuses == sorted(statuses, key=lambda s: s != "fail"), f"a failed check is listed after a passed one: {statuses}"
    assert "audit.data_shards" in [row["check"] for row in checks if row["status"] == "fail"]

    for chart_id in CHART_IDS:
        chart = facts["charts"].get(chart_id)
        assert chart is not None, f"{chart_id} missing; charts: {sorted(facts['charts'])}"
        assert chart["visible"] and chart["width"] > 0 and chart["height"] > 0, (chart_id, chart)
        assert chart["x"] + chart["width"] <= width + 0.5, f"{chart_id} is wider than the {width} px window: {chart}"
    assert facts["page_width"] <= width, f"the page scrolls sideways at {width} px"
    assert facts["resources"] == [], "the page loaded something besides itself"

    assert png_size(shot) == (width, facts["page_height"])
    target = os.environ.get(SCREENSHOT_ENV)
    if target and width == 1200:
        path = Path(target) if Path(target).is_absolute() else REPO / target
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, path)


def test_healthcheck_report_regenerates_the_page(faulted_run):
    page = faulted_run / "report.html"
    original = page.read_text()
    page.unlink()
    done = run_cli("report", faulted_run)
    assert done.returncode == 1, done.stderr[-2000:]
    assert page.read_text() == original
    assert f"report: {page}" in done.stdout.replace("\n", "")


def test_a_missing_browser_fails_with_the_install_command(monkeypatch):
    monkeypatch.setenv("HEALTHCHECK_CHROMIUM", "/nonexistent/chromium")
    with pytest.raises(browser.BrowserNotFound, match="apt-get install -y --no-install-recommends chromium"):
        browser.Browser()

"""The report: terminal (golden-style, at 80 columns), markdown, JUnit, GitHub annotations, run re-rendering.

Runs are fake but realistic (``tests/fixtures_runs.py``): 8 ranks, 60 steps, rank 0 persistently off.
"""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from healthcheck import gate
from healthcheck.artifacts import STEPS_FILE, VERDICT_FILE, RunResult
from healthcheck.errors import InvalidInput
from healthcheck.files import read_jsonl
from healthcheck.judge import attribution, stats
from healthcheck.judge.findings import ConfigChange, Finding, Verdict
from healthcheck.outputs import ci_outputs, report, terminal
from healthcheck.outputs import markdown as markdown_module
from tests.fixtures_runs import write_fake_run

BOX_DRAWING = re.compile("[\u2500-\u257f\u2580-\u259f]")


class Run(NamedTuple):
    dir: Path
    result: RunResult
    verdict: Optional[Verdict]
    steps: list


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("runs")
    kinds = {
        "fail": {},
        "pass": {"outlier_rank": None},
        "none": {"judged": False},
        "incomplete": {"status": "incomplete"},
    }
    out = {}
    for kind, kwargs in kinds.items():
        result, verdict = write_fake_run(root / kind, **kwargs)
        out[kind] = Run(root / kind, result, verdict, list(read_jsonl(root / kind / STEPS_FILE)))
    return out


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_plots(monkeypatch):
    """Report-file tests need no PNGs (test_plots draws them); skipping them keeps these fast."""
    monkeypatch.setattr("healthcheck.outputs.plots.write_plots", lambda *args, **kwargs: [])


def render(run: Run, *, verdict: Optional[Verdict] = None, **console_kwargs) -> str:
    console = Console(record=True, width=80, file=io.StringIO(), **console_kwargs)
    terminal.render_terminal(run.result, verdict if verdict is not None else run.verdict, console, steps=run.steps)
    return console.export_text()


# ----------------------------------------------------------------------------- banner and attribution


def test_fail_banner_names_the_verdict_and_the_outlier_rank(runs):
    text = render(runs["fail"])
    lines = text.splitlines()
    assert "FAIL -- silent inconsistency: 3 of 7 checks failed" in lines[1]
    assert re.search(r"rank 0 stands out: cosine_to_mean z=-\d+\.\d \(lower in 50/50 steps\)", lines[2])
    assert not re.search(r"rank [1-7] stands out", text)


def test_pass_banner_names_no_rank_although_one_has_a_chance_z_above_3(runs):
    run = runs["pass"]
    # The healthy fixture has a rank whose window z is past 3 by chance; the persistence test must not name it.
    assert max(abs(s.z_cosine_to_mean) for s in run.result.per_rank) >= attribution.STANDOUT_Z
    text = render(run)
    assert "PASS -- all 7 checks within their baseline envelopes" in text.splitlines()[1]
    assert not re.search(r"rank \d+ stands out", text)
    assert "*" not in text.split("Per-rank")[1].split("* stands out")[0]


def test_without_step_rows_a_rank_is_named_on_z_alone(runs):
    per_rank = runs["pass"].result.per_rank
    assert attribution.find_standouts(per_rank, None) != []
    assert attribution.find_standouts(per_rank, runs["pass"].steps, runs["pass"].result.window_start_step) == []


def test_no_verdict_and_incomplete_banners_and_exit_codes(runs):
    none_text = render(runs["none"])
    assert "NO BASELINE -- probe complete, nothing judged" in none_text
    assert "Checks (" not in none_text
    assert gate.exit_code_for(runs["none"].result, None) == 0

    incomplete_text = render(runs["incomplete"])
    assert "INCOMPLETE -- probe did not finish: rank 3 exited with code 1 at step 36" in incomplete_text
    assert "steps 36/60" in incomplete_text
    assert gate.exit_code_for(runs["incomplete"].result, None) == 3
    assert gate.exit_code_for(runs["fail"].result, runs["fail"].verdict) == 1
    assert gate.exit_code_for(runs["pass"].result, runs["pass"].verdict) == 0


def test_checks_table_has_one_row_per_check_failures_first(runs):
    text = render(runs["fail"])
    table = text.split("Checks (7, 3 failed)")[1].split("\n\n")[0]
    rows = [line.split() for line in table.splitlines() if line.split() and line.split()[0] in (
        "cosine_mean", "cosine_to_mean_min", "loss_std", "grad_norm_cv", "loss_range", "audit.param_equality",
        "audit.seeds",
    )]
    assert len(rows) == 7
    assert [row[0] for row in rows[:3]] == ["cosine_to_mean_min", "cosine_mean", "audit.seeds"]
    cosine = next(row for row in rows if row[0] == "cosine_mean")
    assert cosine[1:] == ["median", "0.3525", "[0.39,", "0.46]", "FAIL", "-1.07"]
    assert next(row for row in rows if row[0] == "loss_std")[-2:] == ["ok", "+0.91"]


def test_attribution_table_marks_the_outlier_cells(runs):
    text = render(runs["fail"])
    rank_rows = {line.split()[0]: line.split() for line in text.split("Per-rank")[1].splitlines() if re.match(r"\s+\d+\s", line)}
    assert sorted(rank_rows) == [str(r) for r in range(8)]
    assert [cell for cell in rank_rows["0"] if cell.endswith("*")] == ["+17.7*", "+37.9*", "-60.9*"]
    assert not any(cell.endswith("*") for r in "1234567" for cell in rank_rows[r])


def test_config_diff_lines(runs):
    ascii_text = render(runs["fail"])
    assert "  seed_policy: shared -> rank0_differs" in ascii_text.splitlines()
    assert "  train.lr: 0.001 -> 0.002" in ascii_text.splitlines()
    unicode_text = render(runs["fail"], force_terminal=True)
    assert "  seed_policy: shared → rank0_differs" in unicode_text.splitlines()
    assert "Config: identical to the baseline's snapshot" in render(runs["pass"])


def test_config_diff_keeps_multi_line_values_on_one_line(runs):
    template = "### Instruction:\n{instruction}\n\n### Response:\n"
    change = ConfigChange(path="data.prompt_template", old=template, new=template.upper())
    verdict = runs["fail"].verdict.model_copy(update={"config_diff": [change]})
    lines = render(runs["fail"], verdict=verdict).splitlines()
    diff_lines = lines[lines.index("Config changes vs the baseline (1)") + 1:]
    assert diff_lines[0].startswith('  data.prompt_template: "### Instruction:\\n{instruction}\\n\\n###')
    assert len(diff_lines) <= 3  # one entry, wrapped at most once or twice at 80 columns
    markdown = markdown_module.render_markdown(runs["fail"].result, verdict)
    assert '- `data.prompt_template`: `"### Instruction:\\n{instruction}' in markdown


def _long_verdict(verdict: Verdict) -> Verdict:
    long_message = "the gradient direction of this rank moved " + "very " * 40 + "far; see " + "x" * 120
    findings = [f.model_copy(update={"message": long_message}) if not f.passed else f for f in verdict.findings]
    findings.append(Finding(check="audit." + "a_really_long_audit_name_" * 4, title="t", passed=False, message=long_message))
    diff = [ConfigChange(path="data.path", old="/data/" + "deep/" * 30 + "train.json", new={"k": list(range(40))})]
    return verdict.model_copy(update={"findings": findings, "config_diff": diff, "notes": [long_message]})


@pytest.mark.parametrize("kind", ["fail", "pass", "none", "incomplete"])
def test_no_line_exceeds_80_columns_in_a_non_tty_log(runs, kind):
    text = render(runs[kind])
    assert max(len(line) for line in text.splitlines()) <= 80


def test_long_messages_and_values_wrap_within_80_columns(runs):
    verdict = _long_verdict(runs["fail"].verdict)
    for console_kwargs in ({}, {"force_terminal": True}):
        text = render(runs["fail"], verdict=verdict, **console_kwargs)
        assert "x" * 40 in text  # the long content is there, folded, not cut
        assert max(len(line) for line in text.splitlines()) <= 80


def test_non_tty_output_is_plain_ascii_and_a_terminal_gets_boxes(runs):
    plain = render(runs["fail"])
    assert plain.isascii()
    assert not BOX_DRAWING.search(plain)
    fancy = render(runs["fail"], force_terminal=True)
    assert BOX_DRAWING.search(fancy)


class _Latin1Stream(io.StringIO):
    encoding = "latin-1"


def test_a_terminal_that_cannot_encode_unicode_gets_ascii(runs):
    console = Console(record=True, width=80, file=_Latin1Stream(), force_terminal=True)
    terminal.render_terminal(runs["fail"].result, runs["fail"].verdict, console, steps=runs["fail"].steps)
    text = console.export_text()
    assert not BOX_DRAWING.search(text)
    assert text.isascii()


def _ansi_output(run: Run) -> str:
    stream = io.StringIO()
    console = Console(file=stream, width=80, force_terminal=True, color_system="standard")
    terminal.render_terminal(run.result, run.verdict, console, steps=run.steps)
    return stream.getvalue()


def test_no_color_means_no_ansi_escapes_at_all(runs, monkeypatch):
    assert "\x1b[" in _ansi_output(runs["fail"])  # the control: a colour terminal does get styles
    monkeypatch.setenv("NO_COLOR", "1")
    output = _ansi_output(runs["fail"])
    assert "\x1b[" not in output
    assert "FAIL — silent inconsistency" in output


def test_per_rank_attribution_is_recomputed_when_the_result_has_none(runs):
    run = runs["fail"]
    bare = run.result.model_copy(update={"per_rank": []})
    summaries = attribution.rank_summaries(bare, run.steps)
    assert [s.rank for s in summaries] == list(range(8))
    standouts = attribution.find_standouts(summaries, run.steps, bare.window_start_step)
    assert {s.rank for s in standouts} == {0}
    assert "rank 0 stands out: cosine_to_mean" in render(run._replace(result=bare))


def test_many_ranks_show_the_most_extreme_in_the_terminal(tmp_path):
    result, verdict = write_fake_run(tmp_path, ranks=24, outlier_rank=5)
    steps = list(read_jsonl(tmp_path / STEPS_FILE))
    text = render(Run(tmp_path, result, verdict, steps))
    rank_rows = [line for line in text.split("Per-rank")[1].splitlines() if re.match(r"\s+\d+\s", line)]
    assert len(rank_rows) == terminal.MAX_TERMINAL_RANKS
    assert any(row.split()[0] == "5" for row in rank_rows)
    assert f"{24 - terminal.MAX_TERMINAL_RANKS} ranks closest to the rest not shown" in text
    assert "rank 5 stands out" in text


def test_sign_test_p():
    assert stats.sign_test_p(10, 10) == pytest.approx(1 / 1024)
    assert stats.sign_test_p(0, 10) == pytest.approx(1.0)
    assert stats.sign_test_p(37, 50) < attribution.PERSISTENCE_P < stats.sign_test_p(35, 50)


# ----------------------------------------------------------------------------- markdown


def test_markdown_carries_the_same_content(runs):
    fail = runs["fail"]
    markdown = markdown_module.render_markdown(fail.result, fail.verdict, steps=fail.steps, plots=["plots/loss.png"])
    assert markdown.startswith("## healthcheck `s1-2-probe`: FAIL — silent inconsistency: 3 of 7 checks failed\n")
    assert re.search(r"^> \*\*rank 0 stands out: cosine_to_mean z=-60\.9", markdown, re.M)
    assert "| **cosine_mean** | **median** | **0.3525** | **[0.39, 0.46]** | **FAIL** | **-1.07** |" in markdown
    assert "- `seed_policy`: `shared` → `rank0_differs`" in markdown
    assert "![loss](plots/loss.png)" in markdown
    assert len([line for line in markdown.splitlines() if re.match(r"\| \d+ \|", line)]) == 8


def test_markdown_escapes_table_breaking_text(runs):
    verdict = runs["fail"].verdict
    odd = verdict.model_copy(update={"findings": [verdict.findings[0].model_copy(update={"message": "a|b\n<img> c"})]})
    markdown = markdown_module.render_markdown(runs["fail"].result, odd)
    assert "a\\|b &lt;img> c" in markdown
    assert "<img>" not in markdown


# ----------------------------------------------------------------------------- JUnit


def parse_junit(text: str) -> ET.Element:
    """Parse and check the JUnit shape CI tools read (Jenkins/GitLab/GitHub test reporters)."""
    root = ET.fromstring(text)
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = suite.findall("testcase")
    actual = {
        "tests": len(cases),
        "failures": sum(case.find("failure") is not None for case in cases),
        "errors": sum(case.find("error") is not None for case in cases),
        "skipped": sum(case.find("skipped") is not None for case in cases),
    }
    for element in (root, suite):
        assert {key: int(element.get(key)) for key in actual} == actual
        float(element.get("time"))
    for attribute in ("name", "timestamp", "hostname"):
        assert suite.get(attribute)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", suite.get("timestamp"))
    children = [child.tag for child in suite]
    assert children[0] == "properties" and children[-2:] == ["system-out", "system-err"]
    for case in cases:
        assert case.get("name") and case.get("classname")
        float(case.get("time"))
        assert len([child for child in case if child.tag in ("failure", "error", "skipped")]) <= 1
    return suite


def test_junit_for_a_failing_verdict(runs):
    run = runs["fail"]
    suite = parse_junit(ci_outputs.render_junit(run.result, run.verdict))
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("8", "3", "0")
    cases = {case.get("name"): case for case in suite.findall("testcase")}
    assert set(cases) == {"probe"} | {f.check for f in run.verdict.findings}
    failure = cases["envelope.cosine_mean"].find("failure")
    finding = next(f for f in run.verdict.findings if f.check == "envelope.cosine_mean")
    assert failure.get("message").startswith(finding.message)
    assert "margin -1.07" in failure.text
    assert cases["envelope.loss_std"].find("failure") is None
    assert cases["audit.seeds"].get("classname") == "healthcheck.s1-2-probe.audit"


def test_junit_for_a_passing_verdict(runs):
    suite = parse_junit(ci_outputs.render_junit(runs["pass"].result, runs["pass"].verdict))
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("8", "0", "0", "0")


def test_junit_without_verdict_and_for_an_incomplete_probe(runs):
    suite = parse_junit(ci_outputs.render_junit(runs["none"].result, None))
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("2", "0", "1")
    suite = parse_junit(ci_outputs.render_junit(runs["incomplete"].result, None))
    assert (suite.get("tests"), suite.get("errors")) == ("1", "1")
    error = suite.find("testcase").find("error")
    assert "rank 3 exited with code 1 at step 36" in error.get("message")
    assert error.get("type") == "incomplete"


def test_junit_survives_hostile_text(runs):
    verdict = runs["fail"].verdict
    message = 'loss <"& \' > \x00\x1b[31m\nline two'
    hostile = verdict.model_copy(update={"findings": [verdict.findings[0].model_copy(update={"message": message})]})
    suite = parse_junit(ci_outputs.render_junit(runs["fail"].result, hostile))
    failure = suite.find("testcase[@name='envelope.cosine_mean']/failure")
    assert failure.get("message").startswith('loss <"& \' > ??[31m\nline two')


# ----------------------------------------------------------------------------- GitHub annotations


def _unescape_data(text: str) -> str:
    return text.replace("%0A", "\n").replace("%0D", "\r").replace("%25", "%")


def _unescape_property(text: str) -> str:
    return _unescape_data(text.replace("%3A", ":").replace("%2C", ","))


def test_workflow_command_escaping():
    assert ci_outputs.escape_data("100% up\r\nnext: a, b") == "100%25 up%0D%0Anext: a, b"
    assert ci_outputs.escape_property("100% up\r\nnext: a, b") == "100%25 up%0D%0Anext%3A a%2C b"
    assert ci_outputs.escape_data("%0A") == "%250A"  # a literal escape sequence stays literal


@given(st.text())
def test_escaping_round_trips_and_leaves_no_delimiters(text):
    data, prop = ci_outputs.escape_data(text), ci_outputs.escape_property(text)
    assert _unescape_data(data) == text and _unescape_property(prop) == text
    assert not set("\r\n") & set(data)
    assert not set("\r\n:,") & set(prop)
    assert re.fullmatch(r"([^%]|%25|%0D|%0A)*", data, re.S)


def test_annotations_one_error_per_failed_check(runs):
    run = runs["fail"]
    lines = ci_outputs.github_annotations(run.verdict, run.result)
    assert len(lines) == len(run.verdict.failures) == 3
    assert lines[0] == (
        "::error title=healthcheck s1-2-probe%3A envelope.cosine_mean::"
        "cosine_mean median 0.3525 is outside the baseline envelope [0.39, 0.46] (rank 0)"
    )
    assert ci_outputs.github_annotations(runs["pass"].verdict, runs["pass"].result) == []
    (incomplete,) = ci_outputs.github_annotations(None, runs["incomplete"].result)
    assert incomplete.startswith("::error title=healthcheck s1-2-probe%3A INCOMPLETE::probe did not finish")


def test_annotation_message_with_newlines_stays_one_line(runs):
    finding = runs["fail"].verdict.failures[0].model_copy(update={"message": "up 50%\nsee: log, plots"})
    (line,) = ci_outputs.github_annotations(runs["fail"].verdict.model_copy(update={"findings": [finding]}))
    assert line == f"::error title=healthcheck%3A {finding.check}::up 50%25%0Asee: log, plots (rank 0)"


def test_annotations_print_only_on_github_actions(runs):
    run = runs["fail"]
    stream = io.StringIO()
    assert ci_outputs.emit_annotations(run.verdict, run.result, file=stream, environ={}) == []
    assert stream.getvalue() == ""
    printed = ci_outputs.emit_annotations(run.verdict, run.result, file=stream, environ={"GITHUB_ACTIONS": "true"})
    assert stream.getvalue().splitlines() == printed and len(printed) == 3


# ----------------------------------------------------------------------------- files and re-rendering


def test_write_report_files_on_a_failing_run(runs, no_plots, tmp_path, monkeypatch):
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    run = runs["fail"]
    written = report.write_report_files(run.dir, run.result, run.verdict)
    assert written == [run.dir / "report.html", run.dir / "report.md", run.dir / "junit.xml"]
    assert "<strong>FAIL</strong>" in (run.dir / "report.html").read_text()
    assert not list(run.dir.glob(".*.tmp"))  # written through the atomic writer
    markdown = (run.dir / "report.md").read_text()
    assert "FAIL — silent inconsistency" in markdown and "rank 0 stands out" in markdown
    parse_junit((run.dir / "junit.xml").read_text())
    report.write_report_files(run.dir, run.result, run.verdict)
    appended = summary.read_text()
    assert appended.startswith("earlier step\n")
    assert appended.count("## healthcheck `s1-2-probe`: FAIL") == 2
    assert "![" not in appended  # runner files cannot show in the summary
    assert appended.count("```mermaid\n%%{init") == 2 * 4  # loss + 3 dispersion panels, twice; GitHub draws them
    assert "```mermaid" not in markdown  # report.md links the PNGs instead


@pytest.mark.parametrize(("kind", "label"), [("none", "NO BASELINE"), ("incomplete", "INCOMPLETE")])
def test_write_report_files_without_a_verdict(runs, no_plots, kind, label):
    run = runs[kind]
    (run.dir / "report.html").unlink(missing_ok=True)
    report.write_report_files(run.dir, run.result, None)
    assert label in (run.dir / "report.md").read_text()
    assert f"<strong>{label}</strong>" in (run.dir / "report.html").read_text()
    suite = parse_junit((run.dir / "junit.xml").read_text())
    assert (suite.get("skipped"), suite.get("errors")) == {"none": ("1", "0"), "incomplete": ("0", "1")}[kind]


@pytest.mark.parametrize(("kind", "code"), [("fail", 1), ("pass", 0), ("none", 0), ("incomplete", 3)])
def test_render_run_rewrites_the_files_and_returns_the_exit_code(runs, no_plots, monkeypatch, capsys, kind, code):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    run = runs[kind]
    for name in ("report.md", "report.html"):
        (run.dir / name).unlink(missing_ok=True)
    console = Console(record=True, width=80, file=io.StringIO())
    assert gate.rerender(run.dir, console) == code
    assert all((run.dir / name).exists() for name in ("report.html", "report.md", "junit.xml"))
    assert f"report:{run.dir / 'report.html'}(alsoreport.md,junit.xml)" in re.sub(r"\s", "", console.export_text())
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("::error ")]
    assert len(errors) == {"fail": 3, "pass": 0, "none": 0, "incomplete": 1}[kind]


def test_render_run_names_a_corrupt_verdict_file(tmp_path, no_plots):
    write_fake_run(tmp_path)
    (tmp_path / VERDICT_FILE).write_text('{"status": "maybe"}')
    with pytest.raises(InvalidInput, match=re.escape(str(tmp_path / VERDICT_FILE))):
        gate.rerender(tmp_path, Console(file=io.StringIO()))


def test_a_plotting_failure_does_not_stop_the_text_reports(runs, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr("healthcheck.outputs.plots.write_plots", broken)
    run = runs["pass"]
    written = report.write_report_files(run.dir, run.result, run.verdict)
    assert written == [run.dir / name for name in ("report.html", "report.md", "junit.xml")]
    assert "plots not written" in caplog.text and "no fonts" in caplog.text


def test_an_html_failure_does_not_stop_the_other_reports(runs, no_plots, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ValueError("bad chart")

    monkeypatch.setattr(report, "render_html", broken)
    run = runs["pass"]
    assert report.write_report_files(run.dir, run.result, run.verdict) == [run.dir / "report.md", run.dir / "junit.xml"]
    assert "report.html not written: ValueError: bad chart" in caplog.text

"""What CI systems read: the JUnit file and GitHub Actions annotations.

JUnit: one testcase per finding (failures carry the finding's message), plus one for the probe
itself, so GitLab, Jenkins and GitHub test reporters show the verdict. Annotations: one
``::error`` workflow command per failed check, escaped per the workflow-command rules.
"""

from __future__ import annotations

import os
import re
import sys
import xml.etree.ElementTree as ET
from typing import Any, Mapping, Optional, TextIO

from healthcheck.artifacts import RunResult
from healthcheck.judge.findings import Finding, Verdict
from healthcheck.outputs.text import format_envelope, format_number, ranks_suffix, verdict_headline

# --------------------------------------------------------------------------- JUnit


_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml(text: Any) -> str:
    """XML 1.0 cannot carry most control characters even escaped: replace them."""
    return _XML_INVALID.sub("?", str(text))


def render_junit(result: RunResult, verdict: Optional[Verdict]) -> str:
    """JUnit XML: a ``probe`` testcase (error when it did not finish), then one testcase per finding.

    A complete run without a verdict gets a skipped ``verdict`` testcase, so the file is never empty.
    """
    suite_name = f"healthcheck.{result.name}"
    cases: list[ET.Element] = []
    probe = ET.Element("testcase", name="probe", classname=suite_name, time=f"{result.timing.wall_s or 0:.3f}")
    if result.status != "complete":
        label, sentence, _ = verdict_headline(verdict, result.status, result.failure)
        ET.SubElement(probe, "error", message=_xml(sentence), type=result.status).text = _xml(f"{label}: {sentence}")
    cases.append(probe)
    if verdict is None and result.status == "complete":
        case = ET.Element("testcase", name="verdict", classname=suite_name, time="0")
        ET.SubElement(case, "skipped", message="no baseline: nothing judged")
        cases.append(case)
    for finding in verdict.findings if verdict else []:
        kind = finding.check.split(".", 1)[0]
        case = ET.Element("testcase", name=_xml(finding.check), classname=f"{suite_name}.{kind}", time="0")
        if not finding.passed:
            failure = ET.SubElement(case, "failure", message=_xml(finding.message + ranks_suffix(finding)), type=finding.check)
            failure.text = _xml(_finding_details(finding))
        cases.append(case)

    counts = {
        "tests": len(cases),
        "failures": sum(c.find("failure") is not None for c in cases),
        "errors": sum(c.find("error") is not None for c in cases),
        "skipped": sum(c.find("skipped") is not None for c in cases),
    }
    counted = {k: str(v) for k, v in counts.items()}
    wall = f"{result.timing.wall_s or 0:.3f}"
    root = ET.Element("testsuites", {"name": "healthcheck", "time": wall, **counted})
    env = result.environment
    suite = ET.SubElement(
        root,
        "testsuite",
        {
            "name": suite_name,
            "time": wall,
            "timestamp": result.timing.started_at.removesuffix("Z"),
            "hostname": _xml(env.ranks[0].node if env and env.ranks else "localhost"),
            **counted,
        },
    )
    properties = ET.SubElement(suite, "properties")
    for name, value in (
        ("config_fingerprint", result.config_fingerprint),
        ("status", result.status),
        ("baseline", verdict.baseline_path if verdict else None),
        ("world_size", env.world_size if env else None),
    ):
        if value is not None:
            ET.SubElement(properties, "property", name=name, value=_xml(value))
    suite.extend(cases)
    ET.SubElement(suite, "system-out").text = _xml("\n".join(verdict.notes) if verdict else "")
    ET.SubElement(suite, "system-err")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _finding_details(finding: Finding) -> str:
    parts = [f"{finding.title}", finding.message + ranks_suffix(finding)]
    if finding.observed is not None:
        parts.append(
            f"{finding.statistic or 'value'} {format_number(finding.observed)}, envelope {format_envelope(finding)}, "
            f"margin {format_number(finding.margin, '+.2f')}"
        )
    return "\n".join(parts)


# --------------------------------------------------------------------------- GitHub annotations


def escape_data(text: str) -> str:
    """Escape a workflow-command message.

    >>> escape_data("50%\\nup")
    '50%25%0Aup'
    """
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """Escape a workflow-command property value (``title=...``): also ``:`` and ``,``.

    >>> escape_property("envelope.loss_std: p95, median")
    'envelope.loss_std%3A p95%2C median'
    """
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(verdict: Optional[Verdict], result: Optional[RunResult] = None) -> list[str]:
    """One ``::error`` line per failed check, and one when the probe (``result``) did not finish."""
    prefix = f"healthcheck {result.name}" if result is not None else "healthcheck"
    lines = []
    if result is not None and result.status != "complete":
        label, sentence, _ = verdict_headline(verdict, result.status, result.failure)
        lines.append(f"::error title={escape_property(f'{prefix}: {label}')}::{escape_data(sentence)}")
    for finding in verdict.failures if verdict else []:
        title = escape_property(f"{prefix}: {finding.check}")
        lines.append(f"::error title={title}::{escape_data(finding.message + ranks_suffix(finding))}")
    return lines


def emit_annotations(
    verdict: Optional[Verdict],
    result: Optional[RunResult] = None,
    *,
    file: Optional[TextIO] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> list[str]:
    """On GitHub Actions (``GITHUB_ACTIONS=true``), print :func:`github_annotations`; the lines printed.

    Printed raw to stdout, never through rich, which would wrap or style them and break the command.
    """
    env = os.environ if environ is None else environ
    if env.get("GITHUB_ACTIONS") != "true":
        return []
    lines = github_annotations(verdict, result)
    out = file or sys.stdout
    for line in lines:
        print(line, file=out)
    out.flush()
    return lines

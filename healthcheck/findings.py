"""The verdict's vocabulary: a :class:`Finding` per check, collected into one :class:`Verdict`.

Checks (envelopes in ``verdict.py``, audits in ``audits.py``) each return findings; the verdict maps
all of them to one exit code, and the report renders them. Stored as ``RUN_DIR/verdict.json``.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from healthcheck.errors import ExitCode

VERDICT_SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Finding(_Model):
    """The outcome of one check."""

    check: str = Field(description="Stable id, e.g. 'envelope.cosine_mean' or 'audit.param_equality'.")
    title: str = Field(description="Short human name of what was checked.")
    passed: bool
    message: str = Field(description="One sentence a person can act on: what moved, by how much, against what.")
    metric: Optional[str] = Field(None, description="Metric name for envelope checks.")
    statistic: Optional[str] = Field(None, description="Window statistic: median, p95, min, max, ratio_of_means.")
    observed: Optional[float] = None
    lower: Optional[float] = Field(None, description="Envelope lower bound (None: unbounded).")
    upper: Optional[float] = Field(None, description="Envelope upper bound (None: unbounded).")
    margin: Optional[float] = Field(
        None,
        description="Signed distance to the nearest bound in units of the envelope half-width: >0 inside, <0 outside.",
    )
    ranks: list[int] = Field(default_factory=list, description="Ranks the finding is attributed to.")
    details: dict[str, Any] = Field(default_factory=dict)


class ConfigChange(_Model):
    """One field that differs between the baseline's config snapshot and the candidate's."""

    path: str
    old: Any = None
    new: Any = None


class Verdict(_Model):
    schema_version: int = VERDICT_SCHEMA_VERSION
    status: Literal["pass", "fail"] = Field(description="pass: every check passed; fail: at least one failed.")
    exit_code: int
    baseline_path: Optional[str] = None
    forced: bool = Field(False, description="Compared despite a world-size/device mismatch, because the user forced it.")
    notes: list[str] = Field(default_factory=list, description="Caveats the reader must see (e.g. forced comparison).")
    findings: list[Finding] = Field(default_factory=list)
    config_diff: list[ConfigChange] = Field(default_factory=list)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.passed]

    @classmethod
    def collect(cls, findings: list[Finding], **kwargs: Any) -> "Verdict":
        """Map all findings to one status and exit code."""
        failed = any(not f.passed for f in findings)
        return cls(
            status="fail" if failed else "pass",
            exit_code=int(ExitCode.INCONSISTENT if failed else ExitCode.PASS),
            findings=findings,
            **kwargs,
        )


# --------------------------------------------------------------------------- text shared by every report format


def exit_code_for(result, verdict: Optional[Verdict]) -> int:
    """3 when the probe did not finish, else the verdict's code, else 0 (complete, nothing judged)."""
    if result.status != "complete":
        return int(ExitCode.PROBE_FAILED)
    return verdict.exit_code if verdict is not None else int(ExitCode.PASS)


def verdict_headline(verdict: Optional[Verdict], status: str, failure: Optional[str] = None) -> tuple[str, str, str]:
    """(label, sentence, style key) for the banner, the markdown title, JUnit and plot titles.

    >>> verdict_headline(None, "complete")[:2]
    ('NO BASELINE', 'probe complete, nothing judged (no verdict)')
    """
    if status != "complete":
        label = "INTERRUPTED" if status == "interrupted" else "INCOMPLETE"
        return label, f"probe did not finish: {failure or f'result still marked {status}'}", "fail"
    if verdict is None:
        return "NO BASELINE", "probe complete, nothing judged (no verdict)", "warn"
    total, failed = len(verdict.findings), len(verdict.failures)
    if verdict.status == "fail":
        return "FAIL", f"silent inconsistency: {failed} of {total} checks failed", "fail"
    return "PASS", f"all {total} checks within their baseline envelopes", "pass"


def format_number(value: Optional[float], spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "nan" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
    return format(value, spec)


def format_envelope(finding: Finding) -> str:
    if finding.lower is None and finding.upper is None:
        return "-"
    lower = format_number(finding.lower) if finding.lower is not None else "-inf"
    upper = format_number(finding.upper) if finding.upper is not None else "+inf"
    return f"[{lower}, {upper}]"


def ranks_suffix(finding: Finding) -> str:
    # verdict.py already names the ranks in an envelope's message; other checks may only fill ``ranks``.
    if not finding.ranks or "rank" in finding.message:
        return ""
    word = "rank" if len(finding.ranks) == 1 else "ranks"
    return f" ({word} {', '.join(str(r) for r in finding.ranks)})"

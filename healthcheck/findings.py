"""The verdict's vocabulary: a :class:`Finding` per check, collected into one :class:`Verdict`.

Checks (envelopes in ``verdict.py``, audits in ``audits.py``) each return findings; the verdict maps
all of them to one exit code, and the report renders them. Stored as ``RUN_DIR/verdict.json``.
"""

from __future__ import annotations

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

"""The verdict's vocabulary: a :class:`Finding` per check, collected into one :class:`Verdict`, and the
config diff it carries.

Checks (envelopes and audits, in :mod:`healthcheck.judge.verdict`) each return a finding; the verdict
maps all of them to one exit code, and the report renders them. Stored as ``RUN_DIR/verdict.json``.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from healthcheck.config import ProbeConfig
from healthcheck.errors import ExitCode
from healthcheck.typed import Record

VERDICT_SCHEMA_VERSION = 1


class Finding(Record):
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
    measured: bool = Field(True, description="False: the run left no evidence for this check; nothing was judged.")
    details: dict[str, Any] = Field(default_factory=dict)


class ConfigChange(Record):
    """One field that differs between the baseline's config snapshot and the candidate's."""

    path: str
    old: Any = None
    new: Any = None


class Verdict(Record):
    schema_version: int = VERDICT_SCHEMA_VERSION
    status: Literal["pass", "fail"] = Field(description="pass: every check passed; fail: at least one failed.")
    exit_code: int
    baseline_path: Optional[str] = None
    forced: bool = Field(False, description="Compared despite a world-size/device mismatch, because the user forced it.")
    audits_only: bool = Field(False, description="Only the exact audits were judged (--audits-only); no envelope.")
    notes: list[str] = Field(default_factory=list, description="Caveats the reader must see (e.g. forced comparison).")
    stopped_early: Optional[str] = Field(
        None, description="'stopped early at step S: <check>' when the probe failed fast; its envelopes were not judged."
    )
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


# --------------------------------------------------------------------------- config diff


def normalized_snapshot(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The baseline's config as today's model sees it, defaults filled in.

    A baseline recorded before a config field existed would otherwise show that field as a
    change (``null -> default``) in every verdict. A snapshot today's model rejects is diffed raw.
    """
    try:
        return ProbeConfig.model_validate(snapshot).model_dump(mode="json")
    except ValueError:
        return snapshot


def config_diff(baseline_config: dict[str, Any], candidate_config: dict[str, Any]) -> list[ConfigChange]:
    """Every leaf that differs, as dotted paths. Keys compare as strings (a JSON round trip turns
    ``rank_overrides`` keys 0 into "0"); list items are addressed by index; added or removed keys have
    ``old`` or ``new`` None.

    >>> [c.path for c in config_diff({"train": {"lr": 1}, "rank_overrides": {0: {"a": 1}}},
    ...                              {"train": {"lr": 2}, "rank_overrides": {"0": {"a": 1}, "1": {"a": 2}}})]
    ['train.lr', 'rank_overrides.1']
    """
    changes: list[ConfigChange] = []
    _diff(baseline_config, candidate_config, "", changes)
    return changes


def _diff(old: Any, new: Any, path: str, out: list[ConfigChange]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        old_by_key = {str(k): v for k, v in old.items()}
        new_by_key = {str(k): v for k, v in new.items()}
        for key in list(old_by_key) + [k for k in new_by_key if k not in old_by_key]:
            child = f"{path}.{key}" if path else key
            if key not in new_by_key:
                out.append(ConfigChange(path=child, old=old_by_key[key], new=None))
            elif key not in old_by_key:
                out.append(ConfigChange(path=child, old=None, new=new_by_key[key]))
            else:
                _diff(old_by_key[key], new_by_key[key], child, out)
    elif isinstance(old, list) and isinstance(new, list):
        for index in range(max(len(old), len(new))):
            child = f"{path}.{index}" if path else str(index)
            if index >= len(new):
                out.append(ConfigChange(path=child, old=old[index], new=None))
            elif index >= len(old):
                out.append(ConfigChange(path=child, old=None, new=new[index]))
            else:
                _diff(old[index], new[index], child, out)
    elif old != new:
        out.append(ConfigChange(path=path, old=old, new=new))

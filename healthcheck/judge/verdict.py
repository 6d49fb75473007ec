"""Judge a finished probe against its baseline: one finding per check, collected into one verdict.

Each check is a small object whose ``evaluate(result)`` returns a :class:`Finding`; :func:`judge` runs
every envelope check and turns the audits the probe already ran into findings, diffs the configs, and
hands everything to :meth:`Verdict.collect`, which maps it to one exit code. ``healthcheck.gate``
calls::

    verdict = judge(load_result(run_dir), load_baseline(path), baseline_path=str(path))
    write_verdict(run_dir, verdict)        # RUN_DIR/verdict.json
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path, PurePath
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from healthcheck.artifacts import RESULT_FILE, VERDICT_FILE, RunResult
from healthcheck.errors import BaselineError, InvalidInput, ProbeFailed
from healthcheck.files import read_model_file, write_text_atomic
from healthcheck.judge.baseline import Baseline, record_command
from healthcheck.judge.envelope import METRICS, Envelope
from healthcheck.judge.findings import Finding, Verdict, config_diff, normalized_snapshot

# --------------------------------------------------------------------------- pure helpers


def envelope_margin(observed: float, envelope: Envelope) -> Optional[float]:
    """Signed distance to the nearest bound in half-widths of that side: 1 at the centre, 0 on a bound, <0 outside.

    >>> env = Envelope(statistic="median", center=0.3, lower=0.2, upper=0.4)
    >>> round(envelope_margin(0.35, env), 6), round(envelope_margin(0.6, env), 6)
    (0.5, -2.0)
    """
    # Log-scale envelopes are asymmetric in metric units, so each side uses its own half-width.
    if observed >= envelope.center:
        half, distance = envelope.upper - envelope.center, envelope.upper - observed
    else:
        half, distance = envelope.center - envelope.lower, observed - envelope.lower
    return distance / half if half > 0 else None


# --------------------------------------------------------------------------- checks


@dataclasses.dataclass(frozen=True)
class EnvelopeCheck:
    """Is ``result.summary[metric].<statistic>`` inside the baseline's envelope?"""

    metric: str
    envelope: Envelope

    def evaluate(self, result: RunResult) -> Finding:
        env, spec = self.envelope, METRICS.get(self.metric)
        summary = result.summary.get(self.metric)
        observed = getattr(summary, env.statistic) if summary is not None else None
        base = dict(
            check=f"envelope.{self.metric}",
            title=spec.title if spec else self.metric,
            metric=self.metric,
            statistic=env.statistic,
            lower=env.lower,
            upper=env.upper,
        )
        label = f"{self.metric} {env.statistic}"
        if observed is None or not math.isfinite(observed):
            what = "missing from the result (the probe did not record it)" if observed is None else f"not finite ({observed})"
            return Finding(**base, passed=False, message=f"{label} is {what}; cannot check it against [{env.lower:.3g}, {env.upper:.3g}]")
        passed = env.lower <= observed <= env.upper
        margin = envelope_margin(observed, env)
        bounds = f"[{env.lower:.3g}, {env.upper:.3g}]"
        if passed:
            inside = f" ({margin:.1f} half-widths from the nearest bound)" if margin is not None else ""
            message = f"{label} {observed:.3g} is inside the envelope {bounds}{inside}"
            return Finding(**base, passed=True, message=message, observed=observed, margin=margin)
        side, excess = ("above", observed - env.upper) if observed > env.upper else ("below", env.lower - observed)
        outside = f" ({-margin:.1f} half-widths)" if margin is not None else ""
        message = f"{label} {observed:.3g} is {side} the envelope {bounds} by {excess:.3g}{outside}"
        # Ranks are named by the one attribution rule (persistent |z| >= 3), computed at summary time.
        family = spec.rank_z.removeprefix("z_") if spec and spec.rank_z else None
        standouts = sorted((o for o in result.standouts if o.metric == family), key=lambda o: -abs(o.z))
        if standouts:
            named = ", ".join(f"{o.rank} ({o.phrase()})" for o in standouts)
            message += f"; {'rank' if len(standouts) == 1 else 'ranks'} {named} {'stands' if len(standouts) == 1 else 'stand'} out"
        return Finding(**base, passed=False, message=message, observed=observed, margin=margin, ranks=[o.rank for o in standouts])


class AuditEntry(BaseModel):
    """What the probe stores under ``result.audits[name]``; extra keys become the finding's details."""

    model_config = ConfigDict(extra="allow")

    passed: bool = Field(description="Whether the exact audit held.")
    message: str = Field(description="One sentence on what was checked and found.")
    ranks: list[int] = Field(default_factory=list, description="Ranks the audit blames.")
    signature: Optional[str] = Field(None, description="Seed-independent description of the observed state.")
    measured: bool = Field(True, description="False when the run left no evidence for this audit.")


@dataclasses.dataclass(frozen=True)
class AuditCheck:
    """Turn an audit the probe already ran (``result.audits[name]``) into a finding ``audit.<name>``.

    It passes when the audit met its ideal expectation, or when ``approved`` (the baseline's
    ``audits[name]``) equals the observed signature: a deviation someone recorded on purpose.
    """

    name: str
    approved: Optional[str] = None

    def evaluate(self, result: RunResult) -> Finding:
        try:
            entry = AuditEntry.model_validate(result.audits[self.name])
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(part) for part in ("audits", self.name, *err["loc"]))
            raise InvalidInput(f"{RESULT_FILE}: {field}: {err['msg']} (expected passed, message, ranks)") from None
        details = dict(entry.model_extra or {})
        if entry.signature is not None:
            details["signature"] = entry.signature
        title = self.name.replace("_", " ")
        if not entry.passed and self.approved is not None and entry.signature == self.approved:
            details["approved_signature"] = self.approved
            return Finding(
                check=f"audit.{self.name}",
                title=title,
                passed=True,
                ranks=entry.ranks,
                details=details,
                message=f"approved deviation (baseline audits.{self.name} = {self.approved!r}): {entry.message}",
            )
        if not entry.passed and self.approved is not None:
            details["approved_signature"] = self.approved
            message = f"{entry.message} (the baseline approves only {self.approved!r}, observed {entry.signature!r})"
            return Finding(check=f"audit.{self.name}", title=title, passed=False, message=message, ranks=entry.ranks, details=details)
        return Finding(
            check=f"audit.{self.name}",
            title=title,
            passed=entry.passed,
            message=entry.message,
            ranks=entry.ranks,
            measured=entry.measured,
            details=details,
        )


# --------------------------------------------------------------------------- verdict


def _layout_mismatch(result: RunResult, baseline: Baseline) -> Optional[str]:
    env = result.environment
    if env is None:
        return "the run has no environment record, so its world size and device type are unknown"
    if (env.world_size, env.device_type) != (baseline.world_size, baseline.device_type):
        return (
            f"baseline was recorded with world_size {baseline.world_size} on {baseline.device_type}, "
            f"this run has world_size {env.world_size} on {env.device_type}"
        )
    return None


def _subject_mismatch(result: RunResult, baseline: Baseline) -> Optional[str]:
    """Whether the baseline was recorded for another training program: the built-in probe against a script, or
    scripts of different file names (the same name in another directory is the same script checked out elsewhere).

    >>> from types import SimpleNamespace as NS
    >>> run = NS(config=NS(script=NS(path="jobs/train.py", module=None)))
    >>> _subject_mismatch(run, NS(config={"script": None}))
    'baseline was recorded for the built-in probe, this run probes the script train.py'
    >>> _subject_mismatch(run, NS(config={"script": {"path": "/ci/checkout/jobs/train.py"}})) is None
    True
    >>> _subject_mismatch(NS(config=NS(script=NS(path=None, module="scripts.base_train"))), NS(config={"script": {"path": "train.py"}}))
    'baseline was recorded for the script train.py, this run probes the module scripts.base_train'
    """
    recorded = baseline.config.get("script") or {}
    script = result.config.script
    probed = {"path": script.path, "module": script.module} if script is not None else {}

    def subject(section: dict) -> Optional[str]:
        if section.get("module"):
            return f"the module {section['module']}"
        return f"the script {PurePath(section['path']).name}" if section.get("path") else None

    was, now = subject(recorded) or "the built-in probe", subject(probed) or "the built-in probe"
    return None if was == now else f"baseline was recorded for {was}, this run probes {now}"


def _measurement_notes(result: RunResult) -> list[str]:
    """What the run could not measure as asked: the loss, and the gradients where the script reduces them early."""
    notes = [f"loss not measured: {result.loss_note}"] if result.loss_note else []
    return notes + ([f"gradients: {result.gradient_note}"] if result.gradient_note else [])


def judge(
    result: RunResult, baseline: Baseline, *, baseline_path: Optional[str] = None, force: bool = False, record_hint: Optional[str] = None
) -> Verdict:
    """Check every envelope and audit, diff the configs, and collect one verdict.

    Raises:
        ProbeFailed: The run did not complete; an unfinished probe is never judged as pass (exit 3).
        BaselineError: The baseline's world size or device type differs from the run's, or it was recorded for
            another training program (the built-in probe against a script, another script), and ``force`` is
            False (exit 2).
    """
    if result.status != "complete":
        raise ProbeFailed(
            f"probe {result.name} is {result.status} ({result.failure or 'no reason recorded'}); an unfinished probe is not judged"
        )
    notes = []
    hint = record_hint or record_command()
    # (what differs, what the envelopes do not transfer between, the remedy, what they may not apply to)
    refusals = [
        (_subject_mismatch(result, baseline), "between training programs", f"Record one for it ({hint}), pass --baseline FILE,", "it"),
        (_layout_mismatch(result, baseline), "across layouts", f"Re-record for this layout ({hint})", "this layout"),
    ]
    forced = False
    for mismatch, between, remedy, subject in refusals:
        if mismatch and not force:
            raise BaselineError(
                f"{baseline_path or 'baseline'}: {mismatch}; envelopes do not transfer {between}. "
                f"{remedy} or pass --force to compare anyway"
            )
        if mismatch:
            forced = True
            notes.append(f"forced comparison: {mismatch}; the envelopes may not apply to {subject}")
    if baseline.name != result.name:
        notes.append(f"baseline is for probe {baseline.name!r}, this run is probe {result.name!r}")
    findings = []
    if result.stopped_early is None:
        findings = [EnvelopeCheck(metric, envelope).evaluate(result) for metric, envelope in baseline.envelopes.items()]
    findings += [AuditCheck(name, baseline.audits.get(name)).evaluate(result) for name in sorted(result.audits)]
    notes += _stopped_early_notes(result, findings, envelopes=len(baseline.envelopes))
    notes += _measurement_notes(result)
    diff = config_diff(normalized_snapshot(baseline.config), result.config.model_dump(mode="json"))
    return Verdict.collect(
        findings,
        baseline_path=baseline_path,
        forced=forced,
        notes=notes,
        config_diff=diff,
        stopped_early=result.stopped_early.headline() if result.stopped_early else None,
    )


def _stopped_early_notes(result: RunResult, findings: list[Finding], envelopes: int = 0) -> list[str]:
    """What a fail-fast stop means for the verdict; appends a failed finding if no audit shows the failure.

    The workers stopped on an audit that failed, and the same evidence fails it again here; the extra
    finding only guards the exit code, so that a stopped probe never passes.
    """
    stop = result.stopped_early
    if stop is None:
        return []
    if all(f.passed for f in findings):
        findings.append(Finding(check="fail_fast", title="Fail fast", passed=False, message=f"{stop.headline()}: {stop.message}"))
    skipped = f"its {envelopes} statistical envelopes were not judged" if envelopes else "no statistical envelope was judged"
    then = "the ranks cannot train past it, with --no-fail-fast either" if stop.unavoidable else "rerun with --no-fail-fast to see them"
    return [f"{stop.headline()} ({result.steps_completed} of {result.steps_planned} steps ran): {skipped} on a truncated window; {then}"]


def judge_audits_only(result: RunResult) -> Verdict:
    """The exact audits against their ideal expectations, with no baseline (``--audits-only``).

    For a first run, before any baseline exists: every audit's evidence is judged as a healthy run
    would show it (disjoint shards, shared seeds, equal parameters, ...). No envelope is judged.
    """
    if result.status != "complete":
        raise ProbeFailed(
            f"probe {result.name} is {result.status} ({result.failure or 'no reason recorded'}); an unfinished probe is not judged"
        )
    notes = ["audits only: no baseline envelope was judged; each audit was judged against its ideal expectation"]
    findings = [AuditCheck(name).evaluate(result) for name in sorted(result.audits)]
    notes += _stopped_early_notes(result, findings)
    notes += _measurement_notes(result)
    return Verdict.collect(
        findings, notes=notes, audits_only=True, stopped_early=result.stopped_early.headline() if result.stopped_early else None
    )


def write_verdict(run_dir: Path | str, verdict: Verdict) -> Path:
    """Write ``RUN_DIR/verdict.json`` atomically and return its path."""
    path = Path(run_dir) / VERDICT_FILE
    write_text_atomic(path, verdict.model_dump_json(indent=2) + "\n")
    return path


def load_verdict(run_dir: Path | str) -> Verdict:
    """Read ``RUN_DIR/verdict.json`` or raise a one-line :class:`InvalidInput` (exit 2)."""
    return read_model_file(Path(run_dir) / VERDICT_FILE, Verdict, "the run has not been judged against a baseline yet")

"""Baselines: the approved envelope per metric, fitted from K clean probe runs and kept as reviewable JSON.

Record one (``healthcheck baseline record`` calls :func:`fit_baseline`, then :func:`save_baseline`)::

    healthcheck baseline record --config probe.yaml --repeats 5   # seeds seed, seed+1, ..., seed+4

``baselines/<probe name>.json`` is a :class:`Baseline` (never a pickle). Saving replaces it atomically
under ``baselines/<name>.json.lock`` and first appends the version it replaces, as one compact JSON
line, to ``baselines/<name>.history.jsonl``, so ``tail -n 1`` of the history recovers the previous one.

How the bounds are derived: see :mod:`healthcheck.judge.envelope`.

Approved audit deviations
-------------------------
The exact audits (``result.audits``) pass when they meet their ideal expectation (disjoint shards,
shared seeds, equal parameters, ...). A config that deviates on purpose (say, per-rank seeds) would
fail every time, so ``Baseline.audits`` maps an audit name to the *signature* of an approved
non-ideal state, e.g. ``{"seeds": "seed 0|1|2|3|4|5|6|7"}``. :func:`fit_baseline` fills it only when
all K recording runs failed that audit with the same signature (signatures do not depend on the
seed); a run then passes that audit when it shows exactly the approved signature. An audit that
fails in some recording runs and not others is not approved, so it keeps failing. Baselines
written before this field existed load with no approved deviations.

Bounds are two-sided on purpose: a run that is *too* consistent (cosine 1.0, zero dispersion: every
rank read the same data) is a regression just like one that diverges.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any, Optional, Sequence

import filelock
from pydantic import Field, ValidationError

from healthcheck.artifacts import RunResult, load_result, utc_now
from healthcheck.errors import BaselineError
from healthcheck.files import read_text, write_text_atomic
from healthcheck.judge.envelope import (
    DEFAULT_FALSE_ALARM_RATE,
    METRICS,
    Envelope,
    MetricSpec,
    envelope_multiplier,
    fit_envelope,
)
from healthcheck.judge.findings import config_diff
from healthcheck.typed import FiniteRecord, format_validation_error

BASELINE_SCHEMA_VERSION = 1
MIN_RUNS = 3


class FittedRun(FiniteRecord):
    """One run a baseline was fitted from."""

    seed: int = Field(description="train.seed of the run.")
    run_id: Optional[str] = Field(None, description="Run directory name, when known.")
    started_at: str = Field(description="When the run started (UTC).")
    config_fingerprint: str = Field(description="The run's own config fingerprint.")


class CommitInfo(FiniteRecord):
    """The code a baseline was recorded with, as pytest-benchmark's ``commit_info`` records it."""

    id: str = Field(description="git commit hash of the working directory's repository.")
    branch: Optional[str] = Field(None, description="Branch name, when not detached.")
    dirty: bool = Field(description="Whether the working tree had uncommitted changes.")
    time: Optional[str] = Field(None, description="Commit time (ISO 8601).")


def commit_info(cwd: Optional[Path] = None) -> Optional[CommitInfo]:
    """The git commit of ``cwd`` (default: the working directory), or None outside a git checkout."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise OSError(done.stderr.strip())
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        branch = git("rev-parse", "--abbrev-ref", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        when = git("show", "-s", "--format=%cI", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None
    return CommitInfo(id=commit, branch=None if branch == "HEAD" else branch, dirty=dirty, time=when or None)


class Baseline(FiniteRecord):
    """``baselines/<name>.json``: what was approved, by whom, why, on what, and the envelopes."""

    schema_version: int = Field(BASELINE_SCHEMA_VERSION, description="Baseline file format version.")
    name: str = Field(description="Probe name.")
    created_at: str = Field(description="UTC time the baseline was fitted.")
    approved_by: str = Field(description="Who approved it.")
    reason: str = Field(description="Why it was recorded or changed.")
    healthcheck_version: str = Field(description="healthcheck version of the fitting runs.")
    torch_version: str = Field(description="torch version of the fitting runs.")
    transformers_version: str = Field(description="transformers version of the fitting runs.")
    device_type: str = Field(description="cpu, cuda or npu.")
    world_size: int = Field(ge=1, description="Workers in the fitting runs.")
    # A plain dict, not ProbeConfig: an old snapshot must stay loadable (and diffable) after the config
    # model gains or drops a field.
    config: dict[str, Any] = Field(description="The approved ProbeConfig dump (seed of the first run).")
    config_fingerprint: str = Field(description="ProbeConfig.fingerprint() of that snapshot.")
    runs: list[FittedRun] = Field(description="The runs the envelopes were fitted from.")
    false_alarm_rate: float = Field(DEFAULT_FALSE_ALARM_RATE, gt=0, lt=1, description="Target P(any envelope fails | unchanged config).")
    envelopes: dict[str, Envelope] = Field(min_length=1, description="Per gated metric.")
    audits: dict[str, str] = Field(
        default_factory=dict,
        description="Approved non-ideal audit signatures, by audit name (filled when all fitting runs agreed on one).",
    )
    commit: Optional[CommitInfo] = Field(
        None, description="The git commit of the directory the baseline was recorded in; None outside a checkout."
    )

    def config_snapshot_baseline_path(self) -> Path:
        """Where the snapshot's config keeps its baseline: its ``baseline`` field, else ``baselines/<name>.json``."""
        return Path(self.config.get("baseline") or Path("baselines") / f"{self.name}.json")


# --------------------------------------------------------------------------- fitting from runs


def default_approver() -> str:
    """``git config user.name``, else ``$USER``, else ``unknown``: the default for ``approved_by``."""
    try:
        name = subprocess.run(["git", "config", "user.name"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        name = ""
    return name or os.environ.get("USER", "") or "unknown"


def _label(result: RunResult, index: int) -> str:
    return f"run {index + 1} ({result.name}, seed {result.config.train.seed}, started {result.timing.started_at})"


def _check_fittable(results: list[RunResult]) -> None:
    if len(results) < MIN_RUNS:
        raise BaselineError(f"need at least {MIN_RUNS} complete runs to fit a baseline, got {len(results)} (use --repeats 5)")
    for index, result in enumerate(results):
        if result.status != "complete":
            raise BaselineError(f"{_label(result, index)} is {result.status}, not complete; fit only from finished runs")
        if result.environment is None:
            raise BaselineError(f"{_label(result, index)} has no environment record; cannot know its world size")
    first = results[0]
    reference = first.config.model_dump(mode="json")
    for index, result in enumerate(results[1:], start=1):
        changes = [c for c in config_diff(reference, result.config.model_dump(mode="json")) if c.path != "train.seed"]
        if changes:
            shown = ", ".join(f"{c.path}: {c.old!r} -> {c.new!r}" for c in changes[:3])
            raise BaselineError(
                f"{_label(result, index)}: config differs from run 1 beyond train.seed ({shown}); fit from runs of one config"
            )
        env, env0 = result.environment, first.environment
        assert env is not None and env0 is not None  # checked in the loop above
        if (env.world_size, env.device_type) != (env0.world_size, env0.device_type):
            raise BaselineError(
                f"{_label(result, index)}: ran on world_size {env.world_size}/{env.device_type}, run 1 on "
                f"{env0.world_size}/{env0.device_type}; fit from runs of one layout"
            )
    seeds = [r.config.train.seed for r in results]
    if len(set(seeds)) != len(seeds):
        raise BaselineError(
            f"runs share a train.seed ({sorted(seeds)}); record with distinct seeds (seed, seed+1, ...) so the envelope "
            "sees seed-to-seed spread"
        )


def _metric_values(results: list[RunResult], metric: str, statistic: str) -> list[float]:
    values = []
    for index, result in enumerate(results):
        summary = result.summary.get(metric)
        value = getattr(summary, statistic) if summary is not None else None
        if value is None or not math.isfinite(value):
            raise BaselineError(f"{_label(result, index)}: summary.{metric}.{statistic} is {value}; cannot fit its envelope")
        values.append(float(value))
    return values


def fit_baseline(
    results: list[RunResult],
    *,
    reason: str,
    approved_by: Optional[str],
    name: Optional[str] = None,
    run_ids: Optional[Sequence[str]] = None,
    metrics: Optional[dict[str, MetricSpec]] = None,
    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE,
) -> Baseline:
    """Fit every gated metric's envelope from K >= 3 complete runs of one config with distinct seeds.

    Args:
        results: The runs, in any order (sorted by seed here).
        reason: Why the baseline is recorded or changed (kept in the file for review).
        approved_by: Who approved it; None means :func:`default_approver`.
        name: Probe name; defaults to the runs' config name.
        run_ids: Run directory names, parallel to ``results``.
        metrics: Metric table; defaults to :data:`~healthcheck.judge.envelope.METRICS`. Only ``gated`` entries are fitted.
        false_alarm_rate: Target probability that an unchanged config fails any envelope.

    Raises:
        BaselineError: Too few runs, an unfinished run, configs differing beyond ``train.seed``,
            mixed layouts, repeated seeds, or a gated metric missing from a run.
    """
    ids: list[Optional[str]] = list(run_ids) if run_ids is not None else [None] * len(results)
    if len(ids) != len(results):
        raise BaselineError(f"got {len(ids)} run ids for {len(results)} runs")
    _check_fittable(results)
    order = sorted(range(len(results)), key=lambda i: results[i].config.train.seed)
    results, ids = [results[i] for i in order], [ids[i] for i in order]
    gated = {m: s for m, s in (metrics or METRICS).items() if s.gated and (s.required or _measured(results, m, s))}
    if not gated:
        raise BaselineError("the metric table gates no metric; nothing to fit")
    multiplier = envelope_multiplier(len(results), len(gated), false_alarm_rate)
    envelopes = {}
    for metric, spec in gated.items():
        try:
            envelopes[metric] = fit_envelope(_metric_values(results, metric, spec.statistic), spec, multiplier)
        except ValueError as exc:
            raise BaselineError(f"{metric}: {exc}") from None
    first, env = results[0], results[0].environment
    assert env is not None  # _check_fittable refused runs without one
    return Baseline(
        name=name or first.config.name,
        created_at=utc_now(),
        approved_by=approved_by or default_approver(),
        reason=reason,
        healthcheck_version=env.healthcheck,
        torch_version=env.torch,
        transformers_version=env.transformers,
        device_type=env.device_type,
        world_size=env.world_size,
        config=first.config.model_dump(mode="json"),
        config_fingerprint=first.config.fingerprint(),
        runs=[
            FittedRun(seed=r.config.train.seed, run_id=i, started_at=r.timing.started_at, config_fingerprint=r.config_fingerprint)
            for r, i in zip(results, ids, strict=True)
        ],
        false_alarm_rate=false_alarm_rate,
        envelopes=envelopes,
        audits=approved_audit_signatures(results),
        commit=commit_info(),
    )


def _measured(results: list[RunResult], metric: str, spec: MetricSpec) -> bool:
    return any(getattr(r.summary.get(metric), spec.statistic, None) is not None for r in results)


def approved_audit_signatures(results: Sequence[RunResult]) -> dict[str, str]:
    """Audits that every run failed with one and the same signature: the deviations the baseline approves."""
    approved: dict[str, str] = {}
    names = set.intersection(*(set(r.audits) for r in results)) if results else set()
    for name in sorted(names):
        entries = [r.audits[name] for r in results]
        signatures = {e.get("signature") for e in entries if isinstance(e, dict)}
        failed_everywhere = all(isinstance(e, dict) and e.get("passed") is False for e in entries)
        signature = signatures.pop() if len(signatures) == 1 else None
        if failed_everywhere and isinstance(signature, str):
            approved[name] = signature
    return approved


def baseline_from_runs(run_dirs: list[Path], *, reason: str, approved_by: Optional[str]) -> Baseline:
    """Load ``RUN_DIR/result.json`` for each directory and fit (``healthcheck baseline update --from``)."""
    results = [load_result(Path(d)) for d in run_dirs]
    return fit_baseline(results, reason=reason, approved_by=approved_by, run_ids=[Path(d).name for d in run_dirs])


# --------------------------------------------------------------------------- persistence


def history_path(path: Path) -> Path:
    """``baselines/default.json`` -> ``baselines/default.history.jsonl``."""
    return path.with_name(path.stem + ".history.jsonl")


def save_baseline(baseline: Baseline, path: Path | str) -> None:
    """Write atomically under a file lock, first appending the replaced version to the history file."""
    path = Path(path)
    try:
        _save_locked(baseline, path)
    except OSError as exc:
        # Disk full or read-only: the temp file is removed and the old baseline was never touched.
        raise BaselineError(f"{path}: cannot write baseline ({exc.strerror or exc}); the previous baseline, if any, is unchanged") from None


def _save_locked(baseline: Baseline, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock"):
        if path.exists():
            old = path.read_text(encoding="utf-8")
            try:
                line = json.dumps(json.loads(old), separators=(",", ":"))
            except json.JSONDecodeError:
                line = json.dumps(old)  # a corrupt file is kept verbatim, as a JSON string
            # History first: a crash between the two steps duplicates a version, it never loses one.
            _append_history_line(history_path(path), line)
        write_text_atomic(path, baseline.model_dump_json(indent=2) + "\n")


def _append_history_line(history: Path, line: str) -> None:
    """Append one JSON line, first cutting off a line torn by a crash during an earlier append.

    Dropping the torn tail loses nothing: that append was killed before the atomic replace that
    follows it, so the version it was saving is still the current file and is the one appended now.
    """
    encoded = (line + "\n").encode("utf-8")
    with open(history, "a+b") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        if size:
            handle.seek(size - 1)
            if handle.read(1) != b"\n":
                handle.seek(0)
                keep = handle.read().rfind(b"\n") + 1  # 0 when the torn line is the only one
                handle.truncate(keep)
        handle.write(encoded)  # "a" mode: always at the (possibly new) end
        handle.flush()
        os.fsync(handle.fileno())


def record_command(
    config: Optional[str] = None,
    sets: Sequence[str] = (),
    script: Optional[str] = None,
    script_args: Optional[Sequence[str]] = None,
    repeats: int = 5,
    module: bool = False,
) -> str:
    """The command that records a baseline for the probe the user ran, with their own arguments, ready to copy.

    >>> record_command("probe.yaml", ["train.steps=20"], "train.py", ["--lr", "1e-4"])
    'healthcheck baseline record --config probe.yaml --set train.steps=20 --script train.py --repeats 5 -- --lr 1e-4'
    >>> record_command()
    'healthcheck baseline record --repeats 5'
    """
    parts = ["healthcheck", "baseline", "record"]
    if config:
        parts += ["--config", config]
    for expr in sets:
        parts += ["--set", expr]
    if script:
        parts += ["--script", script, *(["-m"] if module else [])]
    parts += ["--repeats", str(repeats)]
    if script_args:
        parts += ["--", *script_args]
    return shlex.join(parts)


def load_baseline(path: Path | str, record_hint: Optional[str] = None) -> Baseline:
    """Read and validate a baseline, or raise a one-line :class:`BaselineError` (exit 2).

    Args:
        path: The baseline file.
        record_hint: The command that records one, shown when the file is missing or too old
            (default: :func:`record_command` for the default probe).
    """
    path = Path(path)
    hint = record_hint or record_command()
    text = read_text(
        path, missing=f"{path}: no baseline found; record one with: {hint}", unreadable=f"{path}: cannot read baseline", error=BaselineError
    )
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BaselineError(f"{path}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise BaselineError(f"{path}: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != BASELINE_SCHEMA_VERSION:
        raise BaselineError(
            f"{path}: schema_version: unknown baseline schema version {version!r} (this healthcheck reads "
            f"{BASELINE_SCHEMA_VERSION}); re-record with: {hint}"
        )
    try:
        return Baseline.model_validate(data)
    except ValidationError as exc:
        raise BaselineError(format_validation_error(exc, str(path))) from None

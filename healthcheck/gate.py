"""The CI gate: judge a finished run against its baseline, persist the verdict, report, pick the exit code.

Shared by ``healthcheck probe`` (right after the run), ``healthcheck compare`` (a finished run,
again) and ``healthcheck report`` (re-render only). Report files are written on every path: pass,
fail, no baseline, or a probe that did not finish.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from healthcheck.artifacts import VERDICT_FILE, RunResult, load_result
from healthcheck.errors import BaselineError, ExitCode, ProbeFailed
from healthcheck.judge.baseline import load_baseline
from healthcheck.judge.findings import Verdict
from healthcheck.judge.verdict import judge, judge_audits_only, load_verdict, write_verdict
from healthcheck.outputs.report import publish_report


def exit_code_for(result: RunResult, verdict: Optional[Verdict]) -> int:
    """3 when the probe did not finish, else the verdict's code, else 0 (complete, nothing judged).

    >>> from healthcheck.config import ProbeConfig
    >>> from healthcheck.artifacts import Timing
    >>> run = RunResult(name="p", status="interrupted", config=ProbeConfig(), config_fingerprint="f",
    ...                 timing=Timing(started_at="t"), steps_planned=1)
    >>> exit_code_for(run, None)
    3
    """
    if result.status != "complete":
        return int(ExitCode.PROBE_FAILED)
    return verdict.exit_code if verdict is not None else int(ExitCode.PASS)


def gate_run(
    result: RunResult,
    run_dir: Path,
    baseline_path: Path,
    *,
    force: bool = False,
    console: Any = None,
    record_hint: Optional[str] = None,
    judge_against_baseline: bool = True,
    audits_only: bool = False,
    plots: bool = True,
) -> int:
    """Judge ``result`` against the baseline at ``baseline_path`` and report; return the exit code.

    With ``audits_only`` no baseline is read: the exact audits are judged against their ideal
    expectations and the report says that no envelope was judged. Raises :class:`ProbeFailed`
    (exit 3) for a probe that did not finish and :class:`BaselineError` (exit 2) when there is no
    usable baseline, each after the report files for the run itself have been written.
    """
    if result.status != "complete":
        publish_report(run_dir, result, None, console, plots=plots)
        raise ProbeFailed(f"probe {result.status}: {result.failure or 'no reason recorded'}; partial artifacts in {run_dir}")
    if not judge_against_baseline:
        publish_report(run_dir, result, None, console, plots=plots)
        return exit_code_for(result, None)
    if audits_only:
        verdict = judge_audits_only(result)
        write_verdict(run_dir, verdict)
        publish_report(run_dir, result, verdict, console, plots=plots)
        return exit_code_for(result, verdict)
    try:
        baseline = load_baseline(baseline_path, record_hint=record_hint)
        verdict = judge(result, baseline, baseline_path=str(baseline_path), force=force, record_hint=record_hint)
    except BaselineError:
        publish_report(run_dir, result, None, console, plots=plots)
        raise
    write_verdict(run_dir, verdict)
    publish_report(run_dir, result, verdict, console, plots=plots)
    return exit_code_for(result, verdict)


def rerender(run_dir: Path, console: Any = None) -> int:
    """``healthcheck report RUN_DIR``: rewrite the report of a finished run from its files; its exit code."""
    run_dir = Path(run_dir)
    result = load_result(run_dir)
    verdict = load_verdict(run_dir) if (run_dir / VERDICT_FILE).exists() else None
    publish_report(run_dir, result, verdict, console)
    return exit_code_for(result, verdict)

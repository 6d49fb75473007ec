"""The CI gate: judge a finished run against its baseline, persist the verdict, report, pick the exit code.

Shared by ``healthcheck probe`` (right after the run) and ``healthcheck compare`` (a finished run,
again). Report files are written on every path, pass, fail or no baseline.
"""

from __future__ import annotations

from pathlib import Path

from healthcheck.artifacts import RunResult
from healthcheck.errors import BaselineError, ProbeFailed


def gate_run(
    result: RunResult,
    run_dir: Path,
    baseline_path: Path,
    *,
    force: bool = False,
    console=None,
    config_hint: str | None = None,
    judge_against_baseline: bool = True,
) -> int:
    """Judge ``result`` against the baseline at ``baseline_path`` and report; return the exit code.

    Raises :class:`BaselineError` (exit 2) when there is no usable baseline, after the report
    files for the run itself have been written.
    """
    from healthcheck.baseline import load_baseline
    from healthcheck.report import publish_report
    from healthcheck.verdict import judge, write_verdict

    if result.status != "complete":
        publish_report(run_dir, result, None, console)
        raise ProbeFailed(f"probe {result.status}: {result.failure or 'no reason recorded'}; partial artifacts in {run_dir}")
    if not judge_against_baseline:
        return publish_report(run_dir, result, None, console)
    try:
        baseline = load_baseline(baseline_path, config_hint=config_hint)
        verdict = judge(result, baseline, baseline_path=str(baseline_path), force=force)
    except BaselineError:
        publish_report(run_dir, result, None, console)
        raise
    write_verdict(run_dir, verdict)
    return publish_report(run_dir, result, verdict, console)

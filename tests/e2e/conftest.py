"""Helpers for end-to-end tests: run the real ``healthcheck`` command and read its artifacts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"


def healthcheck_command() -> list[str]:
    # The console script pip installed beside this interpreter first: PATH may put a version manager's shim ahead
    # of it (pyenv's runs bash and pyenv itself, ~60 ms a call, over a hundred calls a suite).
    beside = Path(sys.executable).with_name("healthcheck")
    exe = str(beside) if beside.is_file() else shutil.which("healthcheck")
    return [exe] if exe else [sys.executable, "-m", "healthcheck"]


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    full_env.pop("GITHUB_ACTIONS", None)
    full_env.pop("GITHUB_STEP_SUMMARY", None)
    return subprocess.run(
        [*healthcheck_command(), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def failed_findings(run_dir: Path) -> dict[str, dict]:
    """The run's verdict.json findings that failed, by check name."""
    verdict = json.loads((run_dir / "verdict.json").read_text())
    return {finding["check"]: finding for finding in verdict["findings"] if not finding["passed"]}


def failed_ranks(run_dir: Path) -> dict[str, list[int]]:
    """The ranks each failed check names, by check name."""
    return {check: finding["ranks"] for check, finding in failed_findings(run_dir).items()}


@pytest.fixture
def cli():
    return run_cli

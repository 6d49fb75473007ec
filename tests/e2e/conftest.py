"""Helpers for end-to-end tests: run the real ``healthcheck`` command (:func:`run_cli`) and read its artifacts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.warm_cli import WarmCommands

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"


def healthcheck_command() -> list[str]:
    # The console script pip installed beside this interpreter first: PATH may put a version manager's shim ahead
    # of it (pyenv's runs bash and pyenv itself, ~60 ms a call, over a hundred calls a suite).
    beside = Path(sys.executable).with_name("healthcheck")
    exe = str(beside) if beside.is_file() else shutil.which("healthcheck")
    return [exe] if exe else [sys.executable, "-m", "healthcheck"]


def command_env(env: dict | None = None) -> dict[str, str]:
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    full_env.pop("GITHUB_ACTIONS", None)
    full_env.pop("GITHUB_STEP_SUMMARY", None)
    return full_env


_warm: WarmCommands | None = None


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """The ``healthcheck`` command, as ``subprocess.run`` gives it back (:func:`run_command`)."""
    return run_command([*healthcheck_command(), *map(str, args)], cwd=cwd, timeout=timeout, env=env)


def run_command(argv: list[str], cwd: Path = REPO, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """A command of this interpreter (the console script, or ``python -m``), forked from a process that has torch and
    transformers imported (:mod:`tests.e2e.warm_cli`), unless its environment differs from that process's or
    ``HEALTHCHECK_TESTS_COLD=1`` is set: then ``subprocess.run`` itself, a fresh interpreter."""
    global _warm
    full_env = command_env(env)
    if os.environ.get("HEALTHCHECK_TESTS_COLD") != "1":
        if _warm is None:
            _warm = WarmCommands(full_env, REPO)
        if _warm.takes(full_env):
            return _warm.run(argv, cwd, timeout, full_env)
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.fixture(scope="session", autouse=True)
def _warm_commands_end():
    yield
    if _warm is not None:
        _warm.close()


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

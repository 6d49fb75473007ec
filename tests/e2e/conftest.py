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
    exe = shutil.which("healthcheck")
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


@pytest.fixture
def cli():
    return run_cli

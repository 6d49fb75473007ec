"""The e2e tier's forked commands (:mod:`tests.e2e.warm_cli`) against the console script in a fresh interpreter."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e import conftest
from tests.e2e.conftest import REPO, command_env, healthcheck_command, run_cli
from tests.e2e.test_reliability import assert_no_workers_left, worker_pids


def cold(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([*healthcheck_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=command_env())


@pytest.mark.parametrize("args", [("--version",), ("probe", "--set", "train.steps=zero"), ("config", "show"),
                                  ("report", "no-such-run")])
def test_a_forked_command_says_and_exits_what_the_console_script_does(args, tmp_path):
    warm, fresh = run_cli(*args, cwd=tmp_path), cold(*args, cwd=tmp_path)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.skipif(os.environ.get("HEALTHCHECK_TESTS_COLD") == "1", reason="every command is a fresh interpreter")
def test_a_command_past_its_timeout_is_ended_with_its_workers(tmp_path):
    out = tmp_path / "run"
    started, started_wall = time.monotonic(), time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        # Steps enough that no host finishes them in 8 s (the default 60 took under 8 s on a faster 2-core host).
        run_cli("probe", "--no-judge", "--no-plots", "--out", out, "--set", "distributed.nproc=2", "--set", "train.steps=2000",
                timeout=8)
    assert time.monotonic() - started < 60
    assert worker_pids(out)  # the workers had started
    session = conftest._warm.last_pid  # the command's session: the command and every process it started
    for _ in range(100):  # SIGKILL is delivered at once, the exit a moment later
        if not alive_in_session(session):
            break
        time.sleep(0.1)
    assert not alive_in_session(session)
    assert_no_workers_left(out)
    # A launcher killed by SIGKILL cannot remove its private folder for torch's launcher files (run/launcher.py).
    for left in Path(tempfile.gettempdir()).glob("healthcheck-launch-*"):
        if left.stat().st_mtime >= started_wall - 1:
            shutil.rmtree(left, ignore_errors=True)


def alive_in_session(session: int) -> list[str]:
    """The processes of ``session`` that are not zombies (one parent's to reap)."""
    listed = subprocess.run(["ps", "-s", str(session), "-o", "pid=,stat="], capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if not line.split()[1].startswith("Z")]

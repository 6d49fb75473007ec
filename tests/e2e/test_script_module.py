"""A training module run as ``python -m`` runs it (``--script NAME -m``), as torchtitan and nanochat launch theirs.

``tests/clients/modproject`` is laid out like those projects: ``scripts/train.py`` imports the library beside it from
the working directory and its options relatively, and refuses to run as anything but the module ``scripts.train``.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import REPO, failed_ranks, run_cli

PROJECT = REPO / "tests" / "clients" / "modproject"


def probe(out, *script_args: str, nproc: int = 2):
    return run_cli("probe", "--script", "scripts.train", "-m", "--out", str(out), "--audits-only", "--no-plots", "--set",
                   f"distributed.nproc={nproc}", "--set", "train.steps=6", "--set", "metrics.warmup_steps=1", "--", "--steps", "20",
                   *script_args, cwd=PROJECT)


def test_a_module_runs_as_python_dash_m_runs_it(tmp_path):
    done = probe(tmp_path / "run")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["name"] == "train" and result["steps_completed"] == 6, (result["name"], result["steps_completed"])
    assert result["config"]["script"] == {"path": None, "module": "scripts.train", "args": ["--steps", "20"]}
    assert all(audit["passed"] for audit in result["audits"].values()), result["audits"]


def test_a_rank_with_its_own_learning_rate_is_named_in_a_module(tmp_path):
    done = probe(tmp_path / "run", "--lr-rank", "1=0.002", nproc=3)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(tmp_path / "run") == {"audit.environment": [1]}


@pytest.mark.parametrize("args, cwd, error", [
    (("--script", "scripts.nope", "-m"), PROJECT,
     "script.module: scripts.nope: no such module (looked in the working directory, then sys.path)"),
    (("--script", "toylib", "-m"), PROJECT, "script.module: toylib is a package without __main__; name the module that trains"),
    (("--script", "scripts.train", "-m"), REPO,
     "script.module: scripts.train: no module named scripts (looked in the working directory, then sys.path)"),
    (("-m",), PROJECT, "-m/--module makes --script's value a module's name; give --script NAME -m"),
])
def test_a_module_that_cannot_run_is_one_line_before_any_worker_starts(args, cwd, error):
    done = run_cli("probe", *args, "--audits-only", cwd=cwd)
    assert done.returncode == 2 and done.stderr.strip() == f"healthcheck: error: {error}", (done.returncode, done.stderr)

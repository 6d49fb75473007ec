"""Import a ``benchmarks/*.py`` script as a module for its smoke tests (the folder is not a package), or run it."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def loaded_script(name: str):
    """Yield ``benchmarks/<name>.py`` as a module, registered in ``sys.modules`` while in use."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve their module through sys.modules while the class body executes.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def run_script(name: str, *args: str, timeout_s: float = 300) -> str:
    """Run ``benchmarks/<name>.py args`` in a fresh interpreter, as a user does, and return its stdout.

    Why not in the test process: a script that launches ranks forks them from the long-lived pytest process, and
    such launches hung in CI (a rank of fsdp_cost's, then overhead's elastic agent waiting on workers never joined).
    """
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=BENCHMARKS.parent,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout

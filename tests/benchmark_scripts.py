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

    A launch forked from the long-lived pytest process inherits that process's state, which a user's run never has.
    The hangs that once pointed there (fsdp_cost's, then overhead's: 1 run in 6-19 even in a fresh interpreter) were a
    DDP reducer destroying the process group at teardown, now freed first in both scripts.
    """
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], cwd=BENCHMARKS.parent,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout

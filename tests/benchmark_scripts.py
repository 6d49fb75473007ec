"""Import a ``benchmarks/*.py`` script as a module for its smoke tests (the folder is not a package)."""

from __future__ import annotations

import contextlib
import importlib.util
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

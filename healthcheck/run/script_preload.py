"""The heavy libraries a ``--script`` imports, loaded once in the launcher so that the forked workers inherit them.

Every worker of a Hugging Face script imports ``transformers`` (and ``datasets``, ``trl``, ``accelerate``,
``peft``) itself: one to two seconds of CPU each, paid ``nproc`` times where the ranks share a few cores (a CI
runner, the 8 CPU ranks of the default probe). Imported once before the fork, the workers start with them loaded:
a 4-rank ``transformers.Trainer`` probe on 2 cores took a median 7.19 s instead of 8.75 s
(``python benchmarks/script_startup.py --rounds 3``, 2026-11-28).

Only what the script itself imports at its top level is loaded, read from its source (never run), and only from
:data:`PRELOADABLE`, libraries whose import runs no accelerator code and starts no thread. Two things would make
the parent's copy another module than the one the script would import, so they stop the preload:

* a statement before the import that writes the environment (``os.environ[...] = ...``, ``load_dotenv()``): these
  libraries read variables such as ``HF_HUB_OFFLINE`` when they are imported;
* a file or folder of the same name beside the script (a project's own ``datasets/``), which the worker, with the
  script's folder first on ``sys.path``, imports instead.

It runs only where torch is a CPU-only build and torch_npu is not installed (:func:`fork_safe_build`): a library
that asked a GPU build whether CUDA is there (``torch.cuda.is_available()`` initializes the driver) would leave
the forked workers unable to use it, and transformers imports torch_npu, whose import has side effects, where it
is installed. GPU nodes have a core per rank or more, where the workers' own imports run side by side anyway.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: Top-level packages the launcher may import on a script's behalf.
PRELOADABLE = ("transformers", "datasets", "trl", "accelerate", "peft")

#: Words whose presence in a top-level statement means it may write the environment the imports read.
_ENV_WRITES = ("environ", "putenv", "dotenv")


def preloadable_imports(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """The ``(module, names)`` of the script's top-level imports of :data:`PRELOADABLE` packages, in order, up to
    the first statement that may write the environment; ``[]`` for a source that does not parse.

    >>> preloadable_imports("import torch\\nfrom transformers import Trainer, AutoTokenizer\\nimport datasets as ds")
    [('transformers', ('Trainer', 'AutoTokenizer')), ('datasets', ())]
    >>> preloadable_imports("import os\\nos.environ['HF_HUB_OFFLINE'] = '1'\\nimport transformers")
    []
    >>> preloadable_imports("try:\\n    import peft\\nexcept ImportError:\\n    peft = None\\nfrom .local import x")
    [('peft', ())]
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found: list[tuple[str, tuple[str, ...]]] = []
    for statement in tree.body:
        if any(word in ast.dump(statement) for word in _ENV_WRITES):  # `from os import environ` too
            break
        if isinstance(statement, ast.Try):  # `try: import peft / except ImportError:` is an optional import
            inner = statement.body
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            inner = [statement]
        else:
            continue
        for node in inner:
            if isinstance(node, ast.Import):
                found += [(alias.name, ()) for alias in node.names if _preloadable(alias.name)]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _preloadable(node.module):
                found.append((node.module, tuple(alias.name for alias in node.names if alias.name != "*")))
    return found


def _preloadable(module: str) -> bool:
    return module.split(".")[0] in PRELOADABLE


def fork_safe_build() -> bool:
    """True where no import can touch an accelerator before the fork: a CPU-only torch without torch_npu."""
    import torch

    return torch.version.cuda is None and torch.version.hip is None and importlib.util.find_spec("torch_npu") is None


def preload_script_imports(script: Path) -> list[str]:
    """Import what :func:`preloadable_imports` finds in ``script`` (the modules imported, in order), on a
    :func:`fork_safe_build` only.

    A failing import is left to the script, whose worker raises it where the user wrote it."""
    if not fork_safe_build():
        return []
    try:
        source = script.read_text()
    except (OSError, UnicodeDecodeError):
        return []
    folder = script.resolve().parent
    loaded = []
    for module, names in preloadable_imports(source):
        top = module.split(".")[0]
        if (folder / top).exists() or (folder / f"{top}.py").exists():
            break  # the script's own module of that name: its worker imports that one, not ours
        try:
            imported = importlib.import_module(module)
            for name in names:  # transformers' lazy module imports a name's submodule on first access
                getattr(imported, name, None)
        except Exception as exc:  # noqa: BLE001  (any import error is the script's to raise, in its worker)
            log.debug("not preloaded: %s: %s: %s", module, type(exc).__name__, exc)
            continue
        loaded.append(module)
    return loaded

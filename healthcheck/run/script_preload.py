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

Two more imports every worker would make are made here too. The script session's patches import
:data:`SESSION_MODULES` in each worker, whatever the script. And a script that builds a transformers model (a name
such as ``AutoModelForCausalLM``, ``LlamaForCausalLM``, ``Trainer`` or ``get_peft_model`` among what it takes from
these libraries) imports :data:`MODEL_BASE` lazily, at ``from_pretrained``: ``torch._dynamo``, generation and the
losses, ~3 s of CPU a rank, more than the libraries' own imports. A 4-rank ``ddp_tutorial.py`` probe on 2 cores
took 6.1-6.3 s instead of 6.5-6.8 s with both (hand-timed, three runs each, 2026-11-28). A script that takes only a
tokenizer pays neither.

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
import re
from pathlib import Path

log = logging.getLogger(__name__)

#: Top-level packages the launcher may import on a script's behalf.
PRELOADABLE = ("transformers", "datasets", "trl", "accelerate", "peft")

#: Imported by the script session's patches in every worker (healthcheck/integrations/script/patches.py).
SESSION_MODULES = ("torch.distributed.fsdp",)

#: What every transformers model's modeling file imports first; loaded only for a script that builds a model.
MODEL_BASE = "transformers.modeling_utils"

#: A name taken from these libraries that builds or trains a model: ``AutoModelForCausalLM``, ``GPT2LMHeadModel``,
#: ``Trainer``, ``SFTTrainer``, ``get_peft_model``, ``pipeline``; not ``AutoTokenizer``, ``AutoConfig``, ``load_dataset``.
#: Only "model" is matched in either case (``get_peft_model``): "for" in any case would take ``format`` and ``transform``.
_MODEL_NAME = re.compile(r"(?i:model)|For[A-Z]|Trainer|^pipeline$")

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


def builds_a_model(source: str, imports: list[tuple[str, tuple[str, ...]]]) -> bool:
    """Whether a name the script takes from :data:`PRELOADABLE` builds a model: imported by name, or read off the
    package (``transformers.AutoModelForCausalLM``).

    >>> builds_a_model("", [("transformers", ("AutoTokenizer", "AutoModelForCausalLM"))])
    True
    >>> builds_a_model("tok = transformers.AutoTokenizer.from_pretrained(path)", [("transformers", ())])
    False
    >>> builds_a_model("model = transformers.AutoModelForCausalLM.from_pretrained(path)", [("transformers", ())])
    True
    >>> builds_a_model("", [("trl", ("SFTTrainer", "SFTConfig")), ("peft", ("LoraConfig",))])
    True
    >>> builds_a_model("", [("transformers", ("AutoTokenizer", "DataCollatorWithPadding", "set_seed"))])
    False
    """
    names = [name for _, taken in imports for name in taken]
    packages = {module.split(".")[0] for module, taken in imports if not taken}
    if packages:
        names += re.findall(rf"\b(?:{'|'.join(sorted(packages))})\.(\w+)", source)
    return any(_MODEL_NAME.search(name) for name in names)


def _preloadable(module: str) -> bool:
    return module.split(".")[0] in PRELOADABLE


def fork_safe_build() -> bool:
    """True where no import can touch an accelerator before the fork: a CPU-only torch without torch_npu."""
    import torch

    return torch.version.cuda is None and torch.version.hip is None and importlib.util.find_spec("torch_npu") is None


def preload_script_imports(script: Path) -> list[str]:
    """Import :data:`SESSION_MODULES`, what :func:`preloadable_imports` finds in ``script`` and, for a script that
    :func:`builds_a_model`, :data:`MODEL_BASE` (the modules imported, in order), on a :func:`fork_safe_build` only.

    A failing import is left to the script, whose worker raises it where the user wrote it."""
    if not fork_safe_build():
        return []
    try:
        source = script.read_text()
    except (OSError, UnicodeDecodeError):
        return []
    folder = script.resolve().parent
    loaded = [module for module in SESSION_MODULES if _imported(module, ())]
    found = preloadable_imports(source)
    for module, names in found:
        top = module.split(".")[0]
        if (folder / top).exists() or (folder / f"{top}.py").exists():
            return loaded  # the script's own module of that name: its worker imports that one, not ours
        if _imported(module, names):
            loaded.append(module)
    if builds_a_model(source, found) and _imported(MODEL_BASE, ()):
        loaded.append(MODEL_BASE)
    return loaded


def _imported(module: str, names: tuple[str, ...]) -> bool:
    try:
        imported = importlib.import_module(module)
        for name in names:  # transformers' lazy module imports a name's submodule on first access
            getattr(imported, name, None)
    except Exception as exc:  # noqa: BLE001  (any import error is the script's to raise, in its worker)
        log.debug("not preloaded: %s: %s: %s", module, type(exc).__name__, exc)
        return False
    return True

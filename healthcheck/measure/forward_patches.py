"""Which module forwards a script replaced with code from another package (``model.patched_forwards``), and which
function transformers' attention registry runs (``model.attention_function``).

Why: fine-tuning repositories patch model code at import time. FastChat's and LongLoRA's attention patches assign
``LlamaAttention.forward``, Liger's ``apply_liger_kernel_to_llama`` assigns ``LlamaForCausalLM.forward`` to its fused
linear cross-entropy, and a launch path that applies such a patch on some nodes only leaves those ranks computing
another function (or the same one with other kernels) from the same parameters, config and batch. No setting says
so: the config still reads ``sdpa``. Only the replay audit saw it, as a device that "computes differently", and it
advised draining a sound node.

A forward is patched when its code was defined outside the top-level package of the class that holds it (read from
the code's own globals, so a ``functools.wraps`` wrapper, which copies ``__module__`` and ``__qualname__`` from the
function it wraps, still shows where it was written). Decorators a package writes for its own classes stay inside
it and are no patch; one from another package reads as one, alike on every rank that has that package (transformers
wraps its attention forwards with the Hub's ``kernels`` where that is installed). An instance's own ``forward``
(accelerate's autocast wrapper, its offloading hooks) is read the same way.
"""

from __future__ import annotations

import functools
from typing import Any


def patched_forwards(named: list[tuple[str, Any]]) -> str:
    """Each patched forward as ``Class.forward from module.function`` (``Class instance.forward`` for one set on an
    instance), sorted, or ``none``.

    >>> import torch
    >>> class Block(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), Block())
    >>> patched_forwards(list(net.named_modules()))
    'none'
    >>> Block.forward = torch.nn.Identity.forward  # code from another package
    >>> patched_forwards(list(net.named_modules()))
    'Block.forward from torch.nn.modules.linear.Identity.forward'
    """
    found: set[str] = set()
    classes: set[type] = set()
    for _, module in named:
        cls = type(module)
        if cls not in classes:
            classes.add(cls)
            owner = next((base for base in cls.__mro__ if "forward" in vars(base)), None)
            if owner is not None and (origin := _patch_origin(vars(owner)["forward"], owner)) is not None:
                found.add(f"{owner.__name__}.forward from {origin}")
        if "forward" in vars(module) and (origin := _patch_origin(vars(module)["forward"], cls)) is not None:
            found.add(f"{cls.__name__} instance.forward from {origin}")
    return ", ".join(sorted(found)) or "none"


def attention_function(kernel: str) -> str | None:
    """Where transformers' attention registry sends the kernel a model's config names (``sdpa``, ``flash_attention_2``,
    ...), as ``module.function``; None where transformers is not imported or the registry has no such entry (``eager``
    is each model's own function).

    The registry is global and writable (``AttentionInterface.register("sdpa", fn)``, ``ALL_ATTENTION_FUNCTIONS[...] =
    fn``): a node whose launch path registers its own attention under ``sdpa`` computes another attention while the
    config still reads ``sdpa`` and no forward was replaced.

    >>> attention_function("no-such-kernel") is None
    True
    """
    import sys

    registry = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
    try:
        function = registry[kernel] if registry is not None else None
    except (KeyError, TypeError):
        return None
    return None if function is None else _code_origin(function)


def _patch_origin(forward: Any, owner: type) -> str | None:
    """``module.qualname`` of ``forward``'s code where it was written outside ``owner``'s top-level package, else None."""
    origin = _code_origin(forward)
    if origin is None or origin.split(".")[0] == str(owner.__module__).split(".")[0]:
        return None
    return origin


def _code_origin(forward: Any) -> str | None:
    """``module.qualname`` of the code ``forward`` runs, read from the code's globals; None for a builtin."""
    function = forward
    while True:  # a bound method, a partial (accelerate's hooks) or a staticmethod in a class body
        if isinstance(function, functools.partial):
            function = function.func
        elif hasattr(function, "__func__"):
            function = function.__func__
        else:
            break
    code, globals_ = getattr(function, "__code__", None), getattr(function, "__globals__", None)
    if code is None or not isinstance(globals_, dict):  # a builtin or a callable object: nothing to read
        return None
    where = str(globals_.get("__name__", "?"))
    return f"{where}.{getattr(code, 'co_qualname', getattr(function, '__qualname__', code.co_name))}"

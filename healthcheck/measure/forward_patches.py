"""Which module forwards a script replaced with code from another package (``model.patched_forwards``), which
functions and classes of the model's code modules it replaced (``model.patched_functions``), and which functions
transformers' attention and mask registries run (``model.attention_function``, ``model.mask_function``).

Why: fine-tuning repositories patch model code at import time. FastChat's and LongLoRA's attention patches assign
``LlamaAttention.forward``, Liger's ``apply_liger_kernel_to_llama`` assigns ``LlamaForCausalLM.forward`` to its fused
linear cross-entropy, and a launch path that applies such a patch on some nodes only leaves those ranks computing
another function (or the same one with other kernels) from the same parameters, config and batch. No setting says
so: the config still reads ``sdpa``. Only the replay audit saw it, as a device that "computes differently", and it
advised draining a sound node.

A forward is patched when its code was defined outside the top-level packages of the class that holds it and of
that class's bases (read from the code's own globals, so a ``functools.wraps`` wrapper, which copies ``__module__``
and ``__qualname__`` from the function it wraps, still shows where it was written). Decorators a package writes for
its own classes stay inside it and are no patch; one from another package reads as one, alike on every rank that has
that package, but for the Hub's ``kernels`` decorator that transformers wraps its attention forwards with, which only
routes calls. An instance's own ``forward`` (accelerate's autocast wrapper, its offloading hooks) is read the same way.

A patch need not touch a forward: Liger's ``apply_liger_kernel_to_llama`` also assigns ``modeling_llama.
apply_rotary_pos_emb`` and ``modeling_llama.LlamaRMSNorm``, which ``LlamaAttention.forward`` and the model's constructor
look up in their module at each call. So the modules that define the model's classes, and :data:`SHARED_MODULES`
(``torch.nn.functional``, transformers' attention, mask and loss modules), are read too: a name the module's source
defines at its top level (``def``, ``class`` or an assignment) that now holds a function or class written in another
package is a patch. Names a module imports are not in its source's definitions, so ``from kernels import ...`` is
none.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any

#: healthcheck's own top-level package, whose wrappers are no patch of the script's.
_OURS = __name__.split(".")[0]
#: Modules every model's step calls into, read beside those that define the model's classes where they are imported:
#: torch's functions, and transformers' attention kernels, masks (sample-packing patches replace
#: ``_get_unpad_data`` or the mask functions) and losses.
SHARED_MODULES = ("torch.nn.functional", "transformers.masking_utils", "transformers.modeling_flash_attention_utils",
                  "transformers.integrations.sdpa_attention", "transformers.integrations.flash_attention",
                  "transformers.integrations.flex_attention", "transformers.loss.loss_utils")
#: A name a module's source binds at its top level: a def, a class, or an assignment (``gelu = _add_docstr(...)``).
_TOP_LEVEL_NAME = re.compile(r"^(?:async[ \t]+def|def|class)[ \t]+(\w+)|^(\w+)[ \t]*(?::[^=\n]*)?=(?!=)", re.MULTILINE)


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


def patched_functions(named: list[tuple[str, Any]]) -> str:
    """Each function or class of the model's code modules (and :data:`SHARED_MODULES`) that code from another package
    replaced, as ``module.name from module.function`` (by module, in the order of its source), or ``none``.

    >>> import torch
    >>> import torch.nn.functional as F
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU())
    >>> patched_functions(list(net.named_modules()))
    'none'
    >>> fast_gelu = eval("lambda x, approximate='none': x", {"__name__": "fast_kernels"})  # another package's code
    >>> gelu, F.gelu = F.gelu, fast_gelu
    >>> patched_functions(list(net.named_modules()))
    'torch.nn.functional.gelu from fast_kernels.<lambda>'
    >>> F.gelu = gelu

    healthcheck's own wrappers (the loss capture's ``F.cross_entropy``) are seen through, to what they wrap.
    """
    names = {type(module).__module__ for _, module in named} | {name for name in SHARED_MODULES if name in sys.modules}
    found: list[str] = []
    for name in sorted(names):
        module = sys.modules.get(name)
        top = name.split(".")[0]
        for defined in _top_level_names(module):
            value = vars(module).get(defined)
            origin = _value_origin(value)
            while origin is not None and origin.split(".")[0] == _OURS:
                value = getattr(value, "__wrapped__", None)  # functools.wraps keeps what our wrapper wraps
                origin = _value_origin(value)
            if origin is not None and origin.split(".")[0] != top:
                found.append(f"{name}.{defined} from {origin}")
    return ", ".join(found) or "none"


def _value_origin(value: Any) -> str | None:
    """``module.qualname`` where ``value`` was written: a class's own, a function's read from its code."""
    return f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else _code_origin(value)


def _top_level_names(module: Any) -> list[str]:
    """The names ``module``'s source binds at its top level, in order; none where it has no readable source (a
    builtin or compiled module, ``__main__``, whose entry in ``sys.modules`` is the launcher's and not the script's)."""
    path = getattr(module, "__file__", None)
    if module is None or module.__name__ == "__main__" or not isinstance(path, str) or not path.endswith(".py"):
        return []
    return list(_names_in_source(path))


@functools.lru_cache(maxsize=None)
def _names_in_source(path: str) -> tuple[str, ...]:
    """The top-level names of the source file at ``path``, read once: the facts are read before every forward until
    one is backwarded (an evaluation pass first reads them at each batch), and reading and scanning these files was
    nearly all of that read's time; what the names hold now is read each time."""
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            text = source.read()
    except OSError:
        return ()
    return tuple(dict.fromkeys(a or b for a, b in _TOP_LEVEL_NAME.findall(text)))


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
    return _registered("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS", kernel)


def mask_function(kernel: str) -> str | None:
    """Where transformers' mask registry sends the kernel a model's config names, as ``module.function``; None where
    transformers' ``masking_utils`` is not imported or has no such entry.

    The same kind of global, writable registry (``AttentionMaskInterface.register("sdpa", fn)``): a sample-packing
    patch that builds its own mask, applied on some nodes only, lets their documents attend to each other while the
    config and every forward agree.

    >>> mask_function("no-such-kernel") is None
    True
    """
    return _registered("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS", kernel)


def _registered(module: str, registry: str, kernel: str) -> str | None:
    """``module.function`` of ``sys.modules[module].<registry>[kernel]``; None where there is none."""
    table = getattr(sys.modules.get(module), registry, None)
    try:
        function = table[kernel] if table is not None else None
    except (KeyError, TypeError):
        return None
    return None if function is None else _code_origin(function)


def _patch_origin(forward: Any, owner: type) -> str | None:
    """``module.qualname`` of ``forward``'s code where it was written outside every package of :func:`_packages`
    (``owner``'s), else None. A routing decorator (:func:`_routes`) is seen through to the forward it wraps."""
    origin = _code_origin(forward)
    while _routes(origin) and hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
        origin = _code_origin(forward)
    if origin is None or origin.split(".")[0] in _packages(owner):
        return None
    return origin


def _packages(owner: type) -> set[str]:
    """The top-level packages of ``owner`` and of its bases but ``nn.Module`` and ``object``, which every module has.

    FSDP2 gives each module it shards a class of its own made in torch, ``FSDPLlamaDecoderLayer(FSDPModule,
    LlamaDecoderLayer)``, and transformers' ``GradientCheckpointingLayer.__init_subclass__`` sets that class's
    ``forward`` to its own wrapper: code of a base's package, no patch.

    >>> import torch
    >>> class Block(torch.nn.Linear):
    ...     pass
    >>> sorted(_packages(Block))  # a doctest's class is this module's
    ['healthcheck', 'torch']
    """
    shared = {("torch.nn.modules.module", "Module"), ("builtins", "object")}
    bases = [base for base in owner.__mro__[1:] if (base.__module__, base.__qualname__) not in shared]
    return {str(base.__module__).split(".")[0] for base in [owner, *bases]}


def _routes(origin: str | None) -> bool:
    """Whether code at ``origin`` is a decorator that transformers applies to its own classes and that computes nothing:
    the Hub's ``kernels`` (a dependency of transformers) wraps each attention forward with ``use_kernelized_func``,
    which only routes the calls of the functions it names to per-instance wrappers (the functions themselves unless
    ``kernels.kernelize`` replaced them, which replaces forwards of its own).

    >>> _routes("kernels._internals.layer.layer.use_kernelized_func.<locals>.decorator.<locals>.new_forward")
    True
    >>> _routes("fastchat.train.llama_flash_attn_monkey_patch.forward")
    False
    """
    return origin is not None and origin.startswith("kernels.") and ".use_kernelized_func.<locals>." in origin


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

"""Settings of a model that no parameter holds and every rank must share, for the environment audit.

A rank whose attention dropout is 0.3 where the others' is 0, whose modules were left in eval mode by an
evaluation pass, or whose transformers model dispatches to another attention kernel computes another
function from the same weights. Parameter equality cannot see it (no tensor changes), and the statistics
barely do: in a 12-step, 4-rank script-mode probe of a small Llama, one rank training with attention
dropout 0.3 while the others ran without dropout passed the rank-outlier audit. So these are compared
exactly, as strings, like the optimizer's hyperparameters:

* ``model.dropout``: the dropout probabilities in the model and how many modules use each: ``nn.Dropout``
  and its kin (``p``), and the float attributes named ``*dropout*`` that transformers' attention modules
  keep instead of a module (``attention_dropout``);
* ``model.eval_modules``: the modules that are in eval mode (``training`` False) during a training forward;
* ``model.attn_implementation``: the attention kernel a transformers model dispatches to (eager, sdpa,
  flash_attention_2, ...), where it has one;
* ``model.config.<key>``: each setting of a transformers model's config (nested ones as
  ``rope_parameters.rope_theta``), but those that cannot change what a training step computes (paths, the
  transformers version, cache and output switches). A node whose copy of ``config.json`` is another revision
  (``rms_norm_eps`` 1e-5 against 1e-6, another ``rope_theta``) builds the same parameters and computes another
  function: in a 4-rank script-mode probe of a small Llama, only the replay audit noticed a rank with
  ``rms_norm_eps`` 1e-5, and it blamed the device;
* ``model.adapter.<name>.<key>``: each setting of a PEFT adapter (``peft_config``: LoRA's ``r``, ``lora_alpha``,
  ``target_modules``, ...), but the base model's path. A rank whose adapters scale by another ``lora_alpha`` holds
  the same parameters and computes another function: in a 4-rank LoRA fine-tune with ``transformers.Trainer``,
  only the replay audit noticed a rank with twice the others' ``lora_alpha``, and it advised draining the node;
* ``model.modules.<type>``: for each module type with settings in its ``extra_repr`` (``LayerNorm``'s eps,
  ``GELU``'s approximation, a norm's shape), the distinct settings and how many modules have each. This is
  the same check for a model without a transformers config: another revision of the model code on one node;
* ``model.compile``: the modules ``torch.compile`` compiled, wrapped (``torch.compile(module)``) or in place
  (``module.compile()``). A rank that compiles where the others run eagerly computes the same function with other
  kernels: on 3 ranks of a DDP loop, a rank compiled before ``DDP(...)`` was named only as ``model.eval_modules
  differs: ... none of 33 ...; rank 1 none of 34`` (the wrapper counted as a module), and one compiled in place
  passed. The wrappers are left out of the other facts, and ``_orig_mod`` out of the names. Each compiled module
  says how it was compiled (:func:`compile_backend`): a rank compiled with ``mode="max-autotune"`` runs other,
  autotuned kernels where the others run inductor's defaults, and one compiled with ``aot_eager`` runs none;
* ``model.patched_forwards``: module forwards replaced with another package's code (an attention patch applied at
  import on some nodes only), ``model.patched_functions``: the functions and classes of the model's code modules
  replaced so (Liger's rotary embedding), and ``model.attention_function`` and ``model.mask_function``, the functions
  transformers' attention and mask registries run for the config's kernel (one registered over ``sdpa``;
  :mod:`healthcheck.measure.forward_patches`).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from typing import Any, Iterator

from healthcheck.measure.forward_patches import attention_function, mask_function, patched_forwards, patched_functions

#: Config keys that cannot change what a training step computes; they may differ between ranks harmlessly
#: (the checkpoint's path on each node) or are compared elsewhere (the transformers version). Keys that
#: start with ``_`` are private bookkeeping (``_name_or_path``, ``_commit_hash``) and are skipped too.
IGNORED_CONFIG_KEYS = frozenset(
    {"transformers_version", "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript"}
)
#: An adapter's settings that cannot change what a step computes: where each node keeps the base checkpoint.
IGNORED_ADAPTER_KEYS = frozenset({"base_model_name_or_path"})
#: A longer value is shown by its start and a digest, so a rank's record stays small.
MAX_VALUE_CHARS = 120
#: A device index in a module's settings (``cuda:3``) is per rank by design, not a difference.
_DEVICE_INDEX = re.compile(r"\b(cuda|npu|xpu|mps|hpu):\d+")
#: torch.compile's wrapper names the module it wraps ``_orig_mod``: the same module, named as without it.
_ORIG_MOD = re.compile(r"(?:^|\.)_orig_mod(?=\.|$)")


def module_facts(model: Any) -> dict[str, str]:
    """The model's dropout rates, eval-mode modules, attention kernel, config and module settings, as strings.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Dropout(0.1))
    >>> facts = module_facts(net)
    >>> facts["model.dropout"], facts["model.eval_modules"], facts["model.modules.Dropout"]
    ('p=0.1 in 2 modules', 'none of 4 in eval mode', '2x p=0.1, inplace=False')
    >>> _ = net[2].eval()
    >>> module_facts(net)["model.eval_modules"]
    '1 of 4 in eval mode: 2'
    """
    from torch.nn.modules.dropout import _DropoutNd

    every = list(model.named_modules())
    named = [(_ORIG_MOD.sub("", name).strip("."), module) for name, module in every if not is_compile_wrapper(module)]
    rates: Counter[float] = Counter()
    for _, module in named:
        if isinstance(module, _DropoutNd):
            rates[float(module.p)] += 1
            continue
        for attribute, value in vars(module).items():
            if "dropout" in attribute and isinstance(value, (int, float)) and not isinstance(value, bool):
                rates[float(value)] += 1
    facts = {
        "model.dropout": ", ".join(f"p={p:g} in {n} module{'s' if n > 1 else ''}" for p, n in sorted(rates.items()))
        or "none",
        "model.eval_modules": _eval_modules(named),
        "model.compile": compiled_modules(every),
        "model.patched_forwards": patched_forwards(named),
        "model.patched_functions": patched_functions(named),
    }
    config = _transformers_config(named)
    kernel = getattr(config, "_attn_implementation", None)
    if isinstance(kernel, str):
        facts["model.attn_implementation"] = kernel
        if (function := attention_function(kernel)) is not None:
            facts["model.attention_function"] = function
        if (function := mask_function(kernel)) is not None:
            facts["model.mask_function"] = function
    if config is not None:
        facts.update({f"model.config.{key}": _shown(value) for key, value in _flat(_settings_of(config))})
    facts.update(adapter_settings(named))
    facts.update(module_settings(named))
    return facts


def compiled_modules(named: list[tuple[str, Any]]) -> str:
    """The modules ``torch.compile`` compiled and how, with how many of each, or ``none``.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> compiled_modules(list(net.named_modules()))
    'none'
    >>> net[0].compile(); net[1].compile()
    >>> compiled_modules(list(torch.compile(net, mode="max-autotune-no-cudagraphs").named_modules()))
    '2x Linear (in place, inductor), 1x Sequential (wrapped, inductor coordinate_descent_tuning=True max_autotune=True)'
    """
    kinds: Counter[str] = Counter()
    for _, module in named:
        if is_compile_wrapper(module):
            kinds[f"{type(module._orig_mod).__name__} (wrapped, {compile_backend(module)})"] += 1
        elif (compiled := getattr(module, "_compiled_call_impl", None)) is not None:  # nn.Module.compile()
            kinds[f"{type(module).__name__} (in place, {compile_backend(compiled)})"] += 1
    return ", ".join(f"{count}x {kind}" for kind, count in sorted(kinds.items())) or "none"


def compile_backend(compiled: Any) -> str:
    """How ``torch.compile`` was asked to compile: its backend, with the settings its ``mode`` and ``options`` set
    and ``dynamic`` where given, from ``compiled`` (a wrapper module, or the function ``module.compile()`` made);
    ``?`` where this torch keeps them elsewhere.

    >>> import torch
    >>> compile_backend(torch.compile(torch.nn.Linear(2, 2), backend="aot_eager", dynamic=False))
    'aot_eager dynamic=False'
    >>> compile_backend(torch.compile(torch.nn.Linear(2, 2), options={"epilogue_fusion": False}))
    'inductor epilogue_fusion=False'
    """
    try:
        from torch._dynamo.eval_frame import innermost_backend

        context = getattr(compiled, "dynamo_ctx", None)
        if context is None:  # the compiled function keeps its context in the closure of get_compiler_config
            config = compiled.get_compiler_config
            context = dict(zip(config.__code__.co_freevars, config.__closure__ or (), strict=False))["self"].cell_contents
        backend = innermost_backend(context.callback)
    except (ImportError, AttributeError, KeyError, AssertionError):
        return "?"
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", type(backend).__name__)
    # The inductor wrapper holds its mode's and options' config patches; another backend its keyword arguments.
    settings = {**(getattr(backend, "config", None) or {}), **(getattr(backend, "kwargs", None) or {})}
    if (dynamic := getattr(backend, "dynamic", None)) is not None:
        settings["dynamic"] = dynamic
    return " ".join([str(name), *(f"{key}={value}" for key, value in sorted(settings.items()))])


def is_compile_wrapper(module: Any) -> bool:
    """torch.compile's ``OptimizedModule``: a wrapper whose one child, ``_orig_mod``, is the compiled module."""
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def module_settings(named: list[tuple[str, Any]]) -> dict[str, str]:
    """``model.modules.<type>``: each module type's distinct ``extra_repr`` settings and how many modules have each.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.LeakyReLU(0.2), torch.nn.GELU("tanh"), torch.nn.LeakyReLU(0.01), torch.nn.LeakyReLU(0.2))
    >>> for key, value in module_settings(list(net.named_modules())).items():
    ...     print(key, "=", value)
    model.modules.GELU = 1x approximate='tanh'
    model.modules.LeakyReLU = 1x negative_slope=0.01 | 2x negative_slope=0.2
    """
    settings: dict[str, Counter[str]] = {}
    for _, module in named:
        text = _DEVICE_INDEX.sub(r"\1:N", _repr_of(module))
        if text:
            settings.setdefault(type(module).__name__, Counter())[text] += 1
    return {
        f"model.modules.{kind}": _shown(" | ".join(f"{count}x {text}" for text, count in sorted(seen.items())))
        for kind, seen in sorted(settings.items())
    }


def adapter_settings(named: list[tuple[str, Any]]) -> dict[str, str]:
    """``model.adapter.<name>.<key>``: the settings of each PEFT adapter of the outermost module that has them.

    >>> import dataclasses, torch
    >>> @dataclasses.dataclass
    ... class LoraConfig:  # the shape of peft's configs: a dataclass with to_dict()
    ...     r: int = 4
    ...     lora_alpha: int = 8
    ...     target_modules: frozenset = frozenset({"v_proj", "q_proj"})
    ...     base_model_name_or_path: str = "/nodes/7/llama"
    ...     def to_dict(self):
    ...         return dataclasses.asdict(self)
    >>> net = torch.nn.Linear(2, 2)
    >>> net.peft_config = {"default": LoraConfig()}
    >>> for key, value in adapter_settings(list(net.named_modules())).items():
    ...     print(key, "=", value)
    model.adapter.default.lora_alpha = 8
    model.adapter.default.r = 4
    model.adapter.default.target_modules = ['q_proj', 'v_proj']
    """
    for _, module in named:
        adapters = getattr(module, "peft_config", None)
        if isinstance(adapters, dict) and adapters:
            return {
                f"model.adapter.{name}.{key}": _shown(value)
                for name, adapter in sorted(adapters.items(), key=lambda item: str(item[0]))
                for key, value in _flat(_settings_of(adapter))
                if key not in IGNORED_ADAPTER_KEYS
            }
    return {}


# A fact that cannot be read is left out rather than ending the probe: these settings are one check among many.
_UNREADABLE = (AttributeError, RuntimeError, TypeError, ValueError)


def _settings_of(config: Any) -> dict[str, Any]:
    try:
        return dict(config.to_dict())
    except _UNREADABLE:
        return {}


def _repr_of(module: Any) -> str:
    try:
        return str(module.extra_repr())
    except _UNREADABLE:
        return ""


def _transformers_config(named: list[tuple[str, Any]]) -> Any:
    """The config of the outermost module that has a transformers-style one (under a DDP or PEFT wrapper too)."""
    for _, module in named:
        config = getattr(module, "config", None)
        if callable(getattr(config, "to_dict", None)):
            return config
    return None


def _flat(settings: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A config dict's comparable leaves, nested keys joined by dots, in key order.

    >>> list(_flat({"b": 1, "_name_or_path": "/x", "use_cache": True, "a": {"c": [1, 2]}, "d": {"y", "x"}}))
    [('a.c', [1, 2]), ('b', 1), ('d', ['x', 'y'])]
    """
    for key in sorted(settings, key=str):
        if str(key).startswith("_") or key in IGNORED_CONFIG_KEYS:
            continue
        value = settings[key]
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            yield from _flat(value, f"{prefix}{key}.")
        elif isinstance(value, (set, frozenset)):
            # A set prints in hash order, which differs between processes for strings (PEP 456): sorted, equal
            # settings read the same on every rank.
            yield f"{prefix}{key}", sorted(value, key=str)
        else:
            yield f"{prefix}{key}", value


def _shown(value: Any) -> str:
    """A setting as a short string; a long one as its start and a digest of all of it.

    >>> _shown(1e-06), _shown("x" * 200)[-30:]
    ('1e-06', 'xxxxx... (200 chars, aa20c23e)')
    """
    text = str(value)
    if len(text) <= MAX_VALUE_CHARS:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{text[:MAX_VALUE_CHARS - 40]}... ({len(text)} chars, {digest})"


def _eval_modules(named: list[tuple[str, Any]]) -> str:
    """How many of the modules are in eval mode; for some but not all, the first by name and a digest of the set."""
    off = [name or "(root)" for name, module in named if not module.training]
    if not off:
        return f"none of {len(named)} in eval mode"
    if len(off) == len(named):
        return f"all {len(named)} in eval mode"
    summary = f"{len(off)} of {len(named)} in eval mode: {off[0]}"
    if len(off) > 1:
        # Two ranks with as many eval-mode modules but different ones must still differ.
        digest = hashlib.sha256("\n".join(off).encode()).hexdigest()[:8]
        summary += f", ... (set {digest})"
    return summary

"""The hooks a script registered on its model's modules: a hint, never judged on its own.

A forward hook can change what a module computes: transformers' NEFTune (``neftune_noise_alpha``) adds noise to
the input embeddings through one. A Trainer rank with NEFTune switched on among ranks without it shares every
setting the environment audit reads; only the replay audit saw it, as a rank computing another gradient of the
same micro-batch, and it advised draining a sound node. Comparing hooks exactly would fail sound runs instead:
a script may hook rank 0's model alone, to log activations. So the hooks are recorded per rank at the first
training forward and used only to explain a replay difference (:func:`healthcheck.judge.replay_audit.replay_audit`).

Hooks are named by their function's qualified name and grouped by module type. The global ones, which torch runs
on every module (``register_module_forward_hook`` and its kin, as profilers and debugging tools register them),
are ``hooks.(every module)``. healthcheck's own hooks are left out.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

#: The hook tables of ``nn.Module`` and the kind each holds; each has a global twin, ``_global<table>``, in torch's
#: module of ``nn.Module``.
_TABLES = (
    ("_forward_pre_hooks", "forward_pre"),
    ("_forward_hooks", "forward"),
    ("_backward_pre_hooks", "backward_pre"),
    ("_backward_hooks", "backward"),
)


def module_hooks(model: Any) -> dict[str, str]:
    """``hooks.<module type>``: the hooks on the model's modules of that type, with how many modules carry each.

    >>> import torch
    >>> def add_noise(module, args, output):
    ...     return output
    >>> add_noise.__module__ = "train"  # the user's script (a doctest runs in this module, whose hooks are left out)
    >>> net = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 2))
    >>> _ = net[0].register_forward_hook(add_noise)
    >>> module_hooks(net)
    {'hooks.Embedding': '1x forward add_noise'}
    >>> handle = torch.nn.modules.module.register_module_forward_hook(add_noise)
    >>> module_hooks(net)["hooks.(every module)"]
    '1x forward add_noise'
    >>> handle.remove()
    """
    import torch

    # (the name hooks are grouped under, what holds the tables, the tables' prefix there)
    owners = [(type(module).__name__, module, "") for _, module in model.named_modules()]
    owners.append(("(every module)", torch.nn.modules.module, "_global"))
    per_type: dict[str, Counter[str]] = {}
    for type_name, owner, prefix in owners:
        for table, kind in _TABLES:
            for hook in (getattr(owner, prefix + table, None) or {}).values():
                name = _name(hook)
                if name is not None:
                    per_type.setdefault(type_name, Counter())[f"{kind} {name}"] += 1
    return {
        f"hooks.{type_name}": ", ".join(f"{count}x {hook}" for hook, count in sorted(counts.items()))
        for type_name, counts in sorted(per_type.items())
    }


def _name(hook: Any) -> str | None:
    """The hook's qualified name; None for healthcheck's own (seen through ``torch.compiler.disable``'s wrapper)."""
    function = inspect.unwrap(getattr(hook, "__func__", hook))
    module = getattr(function, "__module__", None) or ""
    if module == "healthcheck" or module.startswith("healthcheck."):
        return None
    return getattr(function, "__qualname__", None) or type(function).__name__

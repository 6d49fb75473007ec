"""The other models a script runs before its first update: a DPO or GRPO reference, a distillation teacher, a reward
model. Each rank loads its own copy, and no data-parallel wrapper broadcasts or checks it.

A rank whose node holds another revision of the reference computes another loss from the same batch and the same
trained weights: on 3 ranks of TRL's ``DPOTrainer`` given ``ref_model=``, a rank whose reference was another
checkpoint passed every check (the parameters stay equal, since DDP averages the gradients; the replay re-runs the
trained model only). Each such model's parameters are compared as an environment fact, ``other_model.<class>``
(``other_model.LlamaForCausalLM differs: ranks 0-1 21 tensors, bits 1980c00e28c9; rank 2 21 tensors, bits ...``).

Which models: the roots of the process's module trees (``gc``: one pass over its objects when the trained model is
wrapped, ~75 ms with transformers and TRL loaded) that hold parameters and share none with the trained model; of those,
the ones whose forward (or a submodule's) ran before the first update, read by pre-hooks that are removed there. A
model built and never run, however it was initialised, is not compared. Sharded models (FSDP2's DTensors) are left
out, as the trained model's own are (:mod:`healthcheck.measure.start_state`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Optional

from healthcheck.measure.eager import eager
from healthcheck.measure.start_state import parameters_fact


class OtherModels:
    """Pre-hooks on every module of the other models, from :meth:`watch` to :meth:`facts`."""

    def __init__(self) -> None:
        #: Weak: a model the script lets go of before its first update (a teacher whose logits it kept) is freed.
        self._roots: dict[int, weakref.ref] = {}
        self._called: set[int] = set()
        self._handles: list[Any] = []

    def watch(self, trained: Any) -> None:
        """Find the other models (the trained model is the one holding ``trained``'s parameters) and hook them."""
        if self._roots or self._handles:
            return
        for root in other_roots(trained):
            key = id(root)
            self._roots[key] = weakref.ref(root)
            hook = eager(lambda module, args, key=key: self._called.add(key))
            self._handles += [module.register_forward_pre_hook(hook) for module in root.modules()]

    def facts(self) -> dict[str, str]:
        """Unhook, and the parameters of each model that ran: ``other_model.<class>``, ``#2`` on for another of a class."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        ran = [root for key, ref in self._roots.items() if key in self._called and (root := ref()) is not None]
        described = sorted((type(root).__name__, fact) for root in ran if (fact := _parameters(root)) is not None)
        self._roots = {}
        seen: Counter[str] = Counter()
        facts = {}
        for name, fact in described:
            seen[name] += 1
            facts[f"other_model.{name}" + (f"#{seen[name]}" if seen[name] > 1 else "")] = fact
        return facts


def other_roots(trained: Any) -> list[Any]:
    """The roots of the process's module trees that have parameters and share none with ``trained``.

    >>> import torch
    >>> student, teacher = torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> [type(root).__name__ for root in other_roots(student) if root is teacher]
    ['Sequential']
    >>> any(root is student or root is teacher[0] for root in other_roots(student))
    False
    """
    import gc

    import torch

    # type(), not isinstance(): isinstance reads __class__, which some module proxies answer with a deprecation warning.
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), torch.nn.Module)]
    children = {id(child) for module in modules for child in module.children()}
    mine = {id(parameter) for parameter in trained.parameters()}
    roots = []
    for module in modules:
        if id(module) in children:
            continue
        parameters = [id(parameter) for parameter in module.parameters()]
        if parameters and not mine.intersection(parameters):
            roots.append(module)
    return roots


def _parameters(root: Any) -> Optional[str]:
    """:func:`parameters_fact`, or None where the bits cannot be read (a model left on the ``meta`` device)."""
    try:
        return parameters_fact(root)
    except (RuntimeError, NotImplementedError):
        return None

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
  flash_attention_2, ...), where it has one.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any


def module_facts(model: Any) -> dict[str, str]:
    """The model's dropout rates, eval-mode modules and attention kernel, as comparable strings.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Dropout(0.1))
    >>> module_facts(net)
    {'model.dropout': 'p=0.1 in 2 modules', 'model.eval_modules': 'none of 4 in eval mode'}
    >>> _ = net[2].eval()
    >>> module_facts(net)["model.eval_modules"]
    '1 of 4 in eval mode: 2'
    """
    from torch.nn.modules.dropout import _DropoutNd

    named = list(model.named_modules())
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
    }
    config = getattr(model, "config", None)
    kernel = getattr(config, "_attn_implementation", None)
    if isinstance(kernel, str):
        facts["model.attn_implementation"] = kernel
    return facts


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

"""What a training script reveals about itself at its first training forward and step, for the audits.

* :func:`first_forward_facts`: RNG state hashes, the torch seed, the precision and the model's settings outside
  its parameters (:mod:`healthcheck.measure.module_facts`) at the first training forward (the first one
  backwarded, :mod:`.forwards`), before any randomness of training was drawn.
* :func:`optimizer_facts` / :func:`wrapper_facts`: settings every rank must share, for the environment audit.

The DataLoaders' records are :mod:`.loaders`'.
"""

from __future__ import annotations

from typing import Any, Optional

from healthcheck.artifacts import RankInfo, SamplerPlan
from healthcheck.integrations.script.call_stack import callers
from healthcheck.integrations.script.loaders import LoaderRecord
from healthcheck.integrations.script.trainer_args import trainer_args_facts
from healthcheck.measure.evidence import rng_state_hashes
from healthcheck.measure.module_facts import compile_backend, is_compile_wrapper, module_facts
from healthcheck.measure.module_hooks import module_hooks
from healthcheck.measure.start_state import optimizer_state_fact, parameters_fact


def first_forward_facts(module: Any) -> dict[str, Any]:
    """The RNG and precision a rank starts training with, read at its first training forward."""
    import torch

    parameter = next(module.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    device_type = device.type
    # Without autocast a model computes in its parameters' dtype (a model loaded in bf16 trains in bf16).
    dtype = parameter.dtype if parameter is not None else torch.float32
    precision = "fp32" if dtype == torch.float32 else str(dtype).removeprefix("torch.")
    if torch.is_autocast_enabled(device_type):
        precision = f"{str(torch.get_autocast_dtype(device_type)).removeprefix('torch.')} autocast"
    else:
        precision = forward_autocast(module, device_type) or sharded_compute_dtype(module) or precision
    return {
        "rng": rng_state_hashes(device),
        "torch_seed": int(torch.initial_seed()),
        "precision": precision,
        "device": str(device),
        "model_dtype": str(parameter.dtype).removeprefix("torch.") if parameter is not None else "none",
        # Dropout rates, eval-mode modules and the attention kernel, as this forward runs them.
        "module": {**(settings := module_facts(module)), "model.compile": _compile_fact(module, settings["model.compile"])},
        "hooks": module_hooks(module),
    }


#: Frames looked through for a torch.compile wrapper calling the model: a handful between its call and this hook.
_COMPILE_DEPTH = 32


def _compile_fact(module: Any, inside: str) -> str:
    """``model.compile`` with the wrapper that calls ``module``, or the DDP model around it, where one does:
    ``torch.compile(DDP(model))`` leaves no trace in the model's tree, so a rank compiled that way alone passed every
    check. Read from the frames below this forward's hook (the wrapper's ``self``), as :mod:`.trainer_args` finds
    the Trainer.

    >>> import torch
    >>> _compile_fact(torch.nn.Linear(2, 2), "none")  # called by no compiled wrapper
    'none'
    """
    for caller in callers(_COMPILE_DEPTH):
        wrapped = caller._orig_mod if is_compile_wrapper(caller) else None
        if wrapped is not None and (wrapped is module or getattr(wrapped, "module", None) is module):  # DDP's .module
            wrapper = f"1x {type(wrapped).__name__} (wrapped, {compile_backend(caller)})"
            return wrapper if inside == "none" else f"{wrapper}, {inside}"
    return inside


def sharded_compute_dtype(module: Any) -> Optional[str]:
    """The dtype an FSDP2 model computes in where its ``MixedPrecisionPolicy`` sets one (``param_dtype``: the
    parameters are all-gathered in it), or None. Its parameters stay fp32 and no autocast is entered, so a TRL run
    in bf16 under FSDP2 read "fp32".

    >>> import torch
    >>> sharded_compute_dtype(torch.nn.Linear(2, 2)) is None
    True
    """
    from healthcheck.measure.fsdp_internals import group_settings

    dtypes = group_settings(module).get("fsdp.param_dtype", "None")
    return None if dtypes == "None" else f"{dtypes.replace('torch.', '')} (FSDP2 param_dtype)"


def forward_autocast(module: Any, device_type: str) -> Optional[str]:
    """The autocast a forward of ``module`` or of one of its submodules enters inside itself, from the wrapper an
    instance's ``forward`` was replaced by (``torch.autocast`` as a decorator), or None.

    accelerate's mixed precision (the Trainer's ``bf16=True``, ``Accelerator(mixed_precision=...)``) replaces the model's
    ``forward`` by one that enters autocast, inside the DDP forward this pre-hook runs before. A rank given
    ``bf16=True`` by its own launch config read fp32 here, trained in bf16, and the replay audit, which alone saw it,
    told to drain a sound node. Read from the wrappers, not from hooks on the layers: those would break a compiled
    model's graph.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> forward_autocast(net, "cpu") is None
    True
    >>> net[0].forward = torch.autocast("cpu", dtype=torch.bfloat16)(net[0].forward)
    >>> forward_autocast(net, "cpu")
    'bfloat16 autocast'
    >>> class Half(torch.nn.Linear):
    ...     @torch.autocast("cpu", dtype=torch.float16)
    ...     def forward(self, x):
    ...         return super().forward(x)
    >>> forward_autocast(torch.nn.Sequential(Half(2, 2)), "cpu"), forward_autocast(Half(2, 2), "cuda") is None
    ('float16 autocast', True)
    """
    classes: set[type] = set()
    for sub in module.modules():
        # The instance's forward (accelerate's wrapper), and its class's once (a forward decorated where it is defined).
        forwards = [vars(sub).get("forward")]
        if type(sub) not in classes:
            classes.add(type(sub))
            forwards.append(getattr(type(sub), "forward", None))
        for forward in forwards:
            found = _autocast_in(forward, device_type)
            if found is not None:
                return f"{str(found.fast_dtype).removeprefix('torch.')} autocast"
    return None


def _autocast_in(fn: Any, device_type: str, depth: int = 8, seen: Optional[set[int]] = None) -> Any:
    """An enabled ``torch.autocast`` for ``device_type`` among ``fn``'s wrappers (closures and ``__wrapped__``)."""
    import torch

    seen = set() if seen is None else seen
    if fn is None or depth == 0 or id(fn) in seen:
        return None
    seen.add(id(fn))
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    inner = [getattr(fn, "__wrapped__", None), getattr(fn, "model_forward", None)]  # accelerate's ConvertOutputsToFp32
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.autocast):
            if value._enabled and value.device == device_type:
                return value
        elif callable(value) and not isinstance(value, type):
            inner.append(value)
    for candidate in inner:
        found = _autocast_in(candidate, device_type, depth - 1, seen)
        if found is not None:
            return found
    return None


def rank_info(facts: dict[str, Any], plan: Optional[SamplerPlan], monitor: Any) -> tuple[RankInfo, Any]:
    """This rank's :class:`RankInfo` from the first training forward's facts, its sampler and monitor; its device."""
    import torch

    from healthcheck.measure import distributed as hdist
    from healthcheck.measure.environment import rank_identity

    device = torch.device(facts.get("device", "cpu"))
    return RankInfo(
        **rank_identity(hdist.get_dist_info(), device),
        torch_seed=facts.get("torch_seed"),
        python_seed=facts.get("python_seed"),
        numpy_seed=facts.get("numpy_seed"),
        sampler_seed=plan.seed if plan else None,
        sampler_rank=plan.rank if plan else None,
        sampler_replicas=plan.num_replicas if plan else None,
        precision=facts.get("precision", "unknown"),
        gradient_source=getattr(monitor, "gradient_source", None),
    ), device


def start_facts(first_forward: dict[str, Any], optimizer: Any, model: Any, loader: Optional[LoaderRecord], forwards: int) -> dict[str, str]:
    """What a rank trains with, for the environment audit, read at its first optimizer step: the model's dtype
    and settings at its first training forward, the optimizer, the data-parallel wrapper, the training
    loader's batch size, and ``train.forwards_in_step_0``, the forwards backwarded before that step
    (:mod:`.forwards`; a rank with
    its own gradient accumulation runs another number of micro-batches per update, and its data counts
    otherwise; DDP's all-reduces still pair up, one per update, so nothing else notices)."""
    return {
        "model_dtype": first_forward.get("model_dtype", "unknown"),
        **first_forward.get("module", {}),
        **optimizer_facts(optimizer),
        **wrapper_facts(model),
        # Read before the first update: parameters loaded after DDP's broadcast (a resumed run's) are not shared.
        **({"model.parameters": parameters} if (parameters := parameters_fact(model)) is not None else {}),
        "train.forwards_in_step_0": str(forwards),
        # How the loop calls the model: a rank that leaves out its attention mask attends to its padding.
        "train.forward_args": first_forward.get("forward_args", "none"),
        **(loader.settings if loader else {}),
        **trainer_args_facts(),  # a transformers (or TRL) Trainer's arguments, where one is training
    }


#: Parameter groups after the first whose settings are facts of their own; the rest are one digest.
_GROUPS_NAMED = 8


def optimizer_facts(optimizer: Any) -> dict[str, str]:
    """The optimizer's class and its parameter groups' hyperparameters (a rank with its own learning rate differs
    here before its parameters do): the first group's as ``optimizer.<name>``, the next ones' as
    ``optimizer[i].<name>`` (a rank whose no-decay group, or its embeddings' group, has its own learning rate was
    named only by ``param_equality``, a step later, without the setting), and beyond them a digest; and, read
    before the first update, its state (``optimizer.state``: a resumed run's, which DDP never broadcasts;
    :mod:`healthcheck.measure.start_state`).

    >>> import torch
    >>> weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    >>> facts = optimizer_facts(torch.optim.AdamW([{"params": [weight]}, {"params": [bias], "lr": 1e-4}], lr=1e-3))
    >>> facts["optimizer.lr"], facts["optimizer[1].lr"], facts["optimizer[1].weight_decay"]
    ('0.001', '0.0001', '0.01')

    Which parameters each group holds is a setting too (``optimizer[i].params``, counted): a rank whose rule for the
    no-decay group misses the final norm decays it where the others do not, and under FSDP2, each rank updating
    only its own slice, nothing replicated showed it.

    >>> facts["optimizer.params"], facts["optimizer[1].params"]
    ('1 tensors, 4 elements', '1 tensors, 2 elements')
    """
    import hashlib

    groups = optimizer.param_groups
    facts = {"optimizer": type(optimizer).__name__, "optimizer.param_groups": str(len(groups))}
    rest = []
    for index, group in enumerate(groups):
        settings = {key: repr(value) for key, value in sorted(group.items())
                    if key != "params" and isinstance(value, (int, float, str, bool, tuple, type(None)))}
        # A DTensor's numel is the whole tensor's: the same on every rank of a sharded model.
        settings["params"] = f"{len(group['params'])} tensors, {sum(p.numel() for p in group['params'])} elements"
        if index > _GROUPS_NAMED:
            rest.append(settings)
            continue
        prefix = "optimizer." if index == 0 else f"optimizer[{index}]."
        facts.update({prefix + key: value for key, value in settings.items()})
    if rest:
        digest = hashlib.sha256(repr(rest).encode()).hexdigest()[:12]
        facts[f"optimizer[{_GROUPS_NAMED + 1}:]"] = f"{len(rest)} groups, sha256 {digest}"
    if (state := optimizer_state_fact(optimizer)) is not None:
        facts["optimizer.state"] = state
    return facts


def wrapper_facts(model: Any) -> dict[str, str]:
    """Settings of the data-parallel wrapper that change how gradients are reduced (DDP or FSDP2)."""
    from healthcheck.measure import script_hook
    from healthcheck.measure.fsdp_internals import is_fsdp_module, root_facts

    if is_fsdp_module(model):
        return root_facts(model)
    return {
        **script_hook.hook_facts(model),  # the script's own hook and its state: a rank that compresses reduces others
        "ddp.bucket_bytes_cap": str(getattr(model, "bucket_bytes_cap", "?")),
        # DDP broadcasts only a module that has buffers: without any the setting changes nothing.
        "ddp.broadcast_buffers": str(getattr(model, "broadcast_buffers", "?")) if has_buffers(model) else "no buffers",
        "ddp.find_unused_parameters": str(getattr(model, "find_unused_parameters", "?")),
        "ddp.gradient_as_bucket_view": str(getattr(model, "gradient_as_bucket_view", "?")),
        "ddp.static_graph": str(getattr(model, "static_graph", "?")),
    }


def has_buffers(module: Any) -> bool:
    """Whether ``module`` (a DDP model holds its wrapped module's) has any buffer: DDP broadcasts only those."""
    return hasattr(module, "buffers") and any(True for _ in module.buffers())

"""Before DDP's collectives: do the ranks set DDP the same way?

Why: DDP's collectives follow each rank's own settings. Its constructor broadcasts the initial weights, with the
buffers unless ``broadcast_buffers=False`` (nothing with ``init_sync=False``); ``broadcast_buffers`` also adds a
broadcast of the buffers at each forward, ``find_unused_parameters`` an all-reduce of the used-parameter map after each
backward; ``bucket_cap_mb`` sets the sizes of the gradient all-reduces, ``static_graph`` changes the first iterations'
reductions, and a communication hook (PowerSGD, fp16 compression) replaces them. A rank set otherwise (a per-node
``TrainingArguments`` or launch config) meets the others' collectives with its own. Among 4 ``transformers.Trainer``
ranks, one with ``ddp_broadcast_buffers=False`` made gloo abort inside DDP's constructor (the stacks naming ranks 1 and
3 in ``_sync_params_and_buffers``), and with ``ddp_find_unused_parameters=False`` the others waited in their backward
until ``distributed.timeout_s``: exit 3 both ways, the rank not named. The environment audit compares these settings,
but only at the first optimizer step, which such a run never reaches.

So what the constructor will broadcast is compared before it (:func:`constructor_facts`), and the wrapper's
settings at DDP's first forward, before it broadcasts anything (:func:`reduction_facts`: a comm hook is registered
after the constructor). Each is one small gather; where the ranks differ every rank stops there (exit 1), the
environment audit naming the rank, as :mod:`.shard_agreement` does for FSDP2. ``gradient_as_bucket_view`` changes no
collective and is left to the first step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from healthcheck.integrations.script.observe import has_buffers, wrapper_facts
from healthcheck.integrations.script.shard_agreement import ranks_agree, sharding_facts
from healthcheck.judge.audit_outcome import AuditOutcome
from healthcheck.measure.fsdp_internals import is_fsdp_module

#: The wrapper facts (:func:`.observe.wrapper_facts`) that change the number or the sizes of DDP's collectives.
COLLECTIVE_SETTINGS = ("ddp.bucket_bytes_cap", "ddp.find_unused_parameters", "ddp.static_graph", "ddp.broadcast_buffers",
                       "ddp.comm_hook", "ddp.comm_hook_state")


def reduction_facts(ddp: Any) -> dict[str, str]:
    """The settings of the DDP model ``ddp`` that its collectives depend on.

    >>> import torch
    >>> class Wrapper(torch.nn.Module):  # DDP's attributes, without a process group
    ...     bucket_bytes_cap, find_unused_parameters, static_graph, broadcast_buffers = 26214400, False, False, True
    ...     def __init__(self, module):
    ...         super().__init__()
    ...         self.module = module
    >>> reduction_facts(Wrapper(torch.nn.BatchNorm1d(2)))["ddp.broadcast_buffers"]
    'True'
    >>> reduction_facts(Wrapper(torch.nn.Linear(2, 2)))["ddp.broadcast_buffers"]
    'no buffers'
    """
    facts = wrapper_facts(ddp)
    return {name: facts[name] for name in COLLECTIVE_SETTINGS if name in facts}


#: The environment fact that says what DDP's constructor broadcasts from rank 0 (:func:`constructor_facts`).
INIT_SYNC = "ddp.init_sync"


def init_broadcast(init_sync: Any, broadcast_buffers: Any, forward_sync_buffers: Any, has_buffers: bool) -> str:
    """What ``DistributedDataParallel``'s constructor broadcasts, from its arguments: the parameters unless
    ``init_sync=False``, and with them the buffers unless ``broadcast_buffers=False`` (torch 2.13's
    ``forward_sync_buffers``, when given, always syncs them at the constructor; ``None`` is the default, ``True``).

    >>> init_broadcast(True, None, None, True), init_broadcast(True, True, None, True)
    ('parameters and buffers', 'parameters and buffers')
    >>> init_broadcast(True, False, None, True), init_broadcast(True, False, True, True), init_broadcast(True, False, None, False)
    ('parameters', 'parameters and buffers', 'parameters')
    >>> init_broadcast(False, None, None, True)
    'nothing'
    """
    if init_sync is False:
        return "nothing"
    buffers = has_buffers and (forward_sync_buffers is not None or broadcast_buffers is not False)
    return "parameters and buffers" if buffers else "parameters"


def constructor_facts(init: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[tuple[Any, dict[str, str]]]:
    """The module that ``DistributedDataParallel.__init__`` (``init``, unpatched) is about to wrap and
    :data:`INIT_SYNC`, what it will broadcast (:func:`init_broadcast`), or None where DDP reduces over a group of its
    own (only its ranks build it) or the call is not DDP's to bind.

    >>> import torch
    >>> def init(self, module, broadcast_buffers=None, init_sync=True, process_group=None): ...
    >>> constructor_facts(init, (torch.nn.BatchNorm1d(2),), {"broadcast_buffers": False})[1]
    {'ddp.init_sync': 'parameters'}
    >>> constructor_facts(init, (torch.nn.BatchNorm1d(2),), {"broadcast_buffers": True})[1]
    {'ddp.init_sync': 'parameters and buffers'}
    >>> constructor_facts(init, (torch.nn.Linear(2, 2),), {"process_group": object()}) is None
    True
    """
    import inspect

    import torch.distributed as dist

    try:
        bound = inspect.signature(init).bind(None, *args, **kwargs)
    except TypeError:  # DDP raises its own error
        return None
    bound.apply_defaults()
    given = bound.arguments
    if given.get("process_group") not in (None, dist.group.WORLD) or given.get("device_mesh") is not None:
        return None
    module: Any = given.get("module")
    buffers = has_buffers(module)
    sync = init_broadcast(given.get("init_sync", True), given.get("broadcast_buffers"), given.get("forward_sync_buffers"), buffers)
    return module, {INIT_SYNC: sync}


def check_agreement(ddp: Any) -> AuditOutcome:
    """Collective: gather every rank's :func:`reduction_facts` and compare them (the same outcome on every rank)."""
    return ranks_agree(reduction_facts(ddp))


def agreement_facts(model: Any) -> dict[str, str]:
    """What the ranks compare before their first collectives of training, for the environment audit of a probe that
    stops there: the parameters and FSDP2's sharding (:func:`.shard_agreement.sharding_facts`), or DDP's settings."""
    return {**sharding_facts(model), **({} if is_fsdp_module(model) else reduction_facts(model))}


def constructor_disagreement(init: Callable[..., Any], args: tuple, kwargs: dict) -> Optional[tuple[Any, AuditOutcome, dict[str, str]]]:
    """Collective where :func:`constructor_facts` has facts: the module, the failed comparison and this rank's facts,
    or None where the ranks agree (the same on every rank)."""
    given = constructor_facts(init, args, kwargs)
    if given is None or (outcome := ranks_agree(given[1])).passed:
        return None
    return given[0], outcome, given[1]

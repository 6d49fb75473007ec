"""Before FSDP2's first all-gather: do the ranks shard the same model the same way?

Why: FSDP2 all-gathers each parameter group at its first forward, sized by *this* rank's view of the group.
A rank with another mixed-precision ``param_dtype`` (fp32 where the others use bf16), another model dtype or
other parameter shapes sends a buffer of another size (and another ``reduce_dtype`` or reshard choice breaks
the backward's collectives the same way). On gloo the receiving rank aborts in C++
(``Received data size doesn't match expected size``) and the rank that differs is not the one that dies; on
NCCL a size mismatch can hang, and equal byte counts of different dtypes would be mixed silently. The
environment audit compares the same settings, but only at the first optimizer step, which such a run never
reaches.

So the root's first forward first exchanges these facts (one small gather, before FSDP's own pre-forward
hook). When they disagree no rank can train past that all-gather, so every rank stops there, fail fast or not,
with the environment audit's finding naming the rank that differs (exit 1), instead of a crash.

The same holds for the order of forwards and updates until the first optimizer step (:func:`lockstep_fact`): a
rank with its own gradient accumulation runs a forward, and its all-gathers, while the others reduce-scatter,
clip (the norm of sharded gradients is an all-reduce) or step, and the ranks hung until ``distributed.timeout_s``
(exit 3). So until then every root forward, clip and the first step exchange where the rank is, and the ranks
stop as soon as they are not at the same place.
"""

from __future__ import annotations

import hashlib
from typing import Any

from healthcheck.judge.audit_outcome import AuditOutcome
from healthcheck.judge.exact_audits import environment_audit
from healthcheck.measure import distributed as hdist
from healthcheck.measure.fsdp_internals import gradient_sync, group_settings

#: The settings that change the size or the number of FSDP2's collectives.
COLLECTIVE_SETTINGS = ("fsdp.param_dtype", "fsdp.reduce_dtype", "fsdp.reshard_after_forward")
#: The environment fact that says where a rank is before its first update (:func:`lockstep_fact`).
LOCKSTEP = "train.before_first_update"
_PLACES = {"step": "optimizer step", "clip": "gradient clipping"}


def sharding_facts(root: Any) -> dict[str, str]:
    """What the sizes and the number of FSDP2's collectives depend on: the dtypes it all-gathers and
    reduce-scatters in, whether it re-gathers in the backward, and a digest of the parameters' names, global
    shapes and dtypes (a DTensor's shape is the unsharded one). Settings that leave the collectives alike
    (``output_dtype``, offloading) are left to the environment audit at the first step: a run can train
    past those.

    >>> import torch
    >>> sharding_facts(torch.nn.Linear(2, 3))["fsdp.parameters"]
    '2 tensors, 9 elements, sha256 3c76b58e672b'
    """
    params = [(name, tuple(p.shape), str(p.dtype)) for name, p in root.named_parameters()]
    digest = hashlib.sha256(repr(params).encode()).hexdigest()[:12]
    settings = group_settings(root)
    out = {name: settings[name] for name in COLLECTIVE_SETTINGS if name in settings}
    out["fsdp.parameters"] = f"{len(params)} tensors, {sum(_numel(shape) for _, shape, _ in params)} elements, sha256 {digest}"
    out["fsdp.dtypes"] = " | ".join(sorted({dtype.removeprefix("torch.") for _, _, dtype in params}))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def check_agreement(root: Any) -> AuditOutcome:
    """Collective: gather every rank's :func:`sharding_facts` and compare them (the same outcome on every rank)."""
    return environment_audit(hdist.all_gather_objects(sharding_facts(root)))


def lockstep_fact(root: Any, *, forwards: int, at: str = "forward") -> str:
    """Where this rank is before its first update: at the optimizer step or a gradient clip (``at``: "step",
    "clip") after ``forwards`` forwards of the root, or at forward ``forwards`` (with autograd on or not, and
    whether its backward reduce-scatters).

    >>> import torch
    >>> lockstep_fact(torch.nn.Linear(2, 2), forwards=2), lockstep_fact(None, forwards=2, at="step")
    ('forward 2 (gradient sync on)', 'optimizer step after 2 forwards')
    >>> lockstep_fact(None, forwards=2, at="clip")
    'gradient clipping after 2 forwards'
    """
    import torch

    if at != "forward":
        return f"{_PLACES[at]} after {forwards} forward{'' if forwards == 1 else 's'}"
    if not torch.is_grad_enabled():
        return f"forward {forwards} (no grad)"
    return f"forward {forwards} (gradient sync {gradient_sync(root)})"


def check_lockstep(fact: str) -> AuditOutcome:
    """Collective: gather every rank's :func:`lockstep_fact` and compare them (the same outcome on every rank)."""
    return environment_audit(hdist.all_gather_objects({LOCKSTEP: fact}))

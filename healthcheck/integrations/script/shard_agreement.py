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

The order of forwards, clips and updates before the first optimizer step is compared in the same way
(:mod:`.lockstep`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from healthcheck.judge.audit_outcome import AuditOutcome
from healthcheck.judge.exact_audits import environment_audit
from healthcheck.measure import distributed as hdist
from healthcheck.measure.fsdp_internals import group_settings

#: The settings that change the size or the number of FSDP2's collectives.
COLLECTIVE_SETTINGS = ("fsdp.param_dtype", "fsdp.reduce_dtype", "fsdp.reshard_after_forward")


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


def ranks_agree(facts: dict[str, str]) -> AuditOutcome:
    """Collective: gather every rank's ``facts`` and compare them as the environment audit does (the same outcome on
    every rank). What each check before the first update runs: the sharding here, DDP's settings
    (:mod:`.ddp_agreement`), where the ranks are (:mod:`.lockstep`)."""
    return environment_audit(hdist.all_gather_objects(facts))


def check_agreement(root: Any) -> AuditOutcome:
    """Collective: gather every rank's :func:`sharding_facts` and compare them (the same outcome on every rank)."""
    return ranks_agree(sharding_facts(root))

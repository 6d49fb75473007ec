"""Before FSDP2's first all-gather: do the ranks shard the same model the same way?

Why: FSDP2 all-gathers each parameter group at its first forward, sized by *this* rank's view of the group.
A rank with another mixed-precision policy (``param_dtype`` fp32 where the others use bf16), another model
dtype or other parameter shapes sends a buffer of another size. On gloo the receiving rank aborts in C++
(``Received data size doesn't match expected size``) and the rank that differs is not the one that dies; on
NCCL a size mismatch can hang, and equal byte counts of different dtypes would be mixed silently. The
environment audit compares the same settings, but only at the first optimizer step, which such a run never
reaches.

So the root's first forward first exchanges these facts (one small gather, before FSDP's own pre-forward
hook) and stops every rank at once, naming the rank that differs, when they disagree.
"""

from __future__ import annotations

import hashlib
from typing import Any

from healthcheck.judge.exact_audits import environment_audit
from healthcheck.measure import distributed as hdist
from healthcheck.measure.fsdp_internals import root_facts


class ShardingDiffers(RuntimeError):
    """The ranks would all-gather different buffers: the script cannot train consistently (exit 3)."""


def sharding_facts(root: Any) -> dict[str, str]:
    """What every rank's FSDP2 all-gathers depend on: the root's sharding settings, and a digest of its
    parameters' names, global shapes and dtypes (a DTensor's shape is the unsharded one).

    >>> import torch
    >>> sharding_facts(torch.nn.Linear(2, 3))["fsdp.parameters"]
    '2 tensors, 9 elements, sha256 3c76b58e672b'
    """
    params = [(name, tuple(p.shape), str(p.dtype)) for name, p in root.named_parameters()]
    digest = hashlib.sha256(repr(params).encode()).hexdigest()[:12]
    facts = dict(root_facts(root)) if hasattr(root, "_get_fsdp_state") else {}
    facts["fsdp.parameters"] = f"{len(params)} tensors, {sum(_numel(shape) for _, shape, _ in params)} elements, sha256 {digest}"
    facts["fsdp.dtypes"] = " | ".join(sorted({dtype.removeprefix("torch.") for _, _, dtype in params}))
    return facts


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def check_agreement(root: Any) -> None:
    """Collective: gather every rank's :func:`sharding_facts`; raise :class:`ShardingDiffers` on every rank
    alike when they differ."""
    outcome = environment_audit(hdist.all_gather_objects(sharding_facts(root)))
    if not outcome.passed:
        raise ShardingDiffers(
            f"the ranks shard the model differently, so FSDP2's first all-gather would fail or mix their buffers: "
            f"{outcome.message}"
        )

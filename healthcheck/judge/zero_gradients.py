"""The zero-gradients audit: does every rank's loss reach the trained parameters?

A local gradient whose norm is exactly 0 carries nothing into the update. One step of it happens (a micro-batch
whose every label is masked, under a loss divided by a count over every rank), but a rank at 0 in every sampled
step while the others are not trains nothing of its own data: its loss is multiplied by 0, or its labels are all
masked by a per-node setting, and DDP's average hides it. Every rank at 0 in every step means nothing trains at
all, which the other audits, all comparisons between ranks, pass: in a 4-rank FSDP2 probe with
``MixedPrecisionPolicy(reduce_dtype=torch.float16)`` and gradients of ~1e-10 (the loss times 1e-7), every gradient
underflowed to 0 in the cast for the reduce-scatter and every audit passed. Exact, not statistical: the norms are
exact zeros or not, in exact and sketch mode alike (a sketch of a zero vector is zero).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from healthcheck.judge.audit_outcome import AuditOutcome, not_measured
from healthcheck.ranks import rank_span, ranks_phrase

#: A rank is named only when it read 0 in every one of at least this many sampled steps: a single step at 0 can
#: be a fully masked batch.
MIN_STEPS_FOR_A_RANK = 3
CAUSES = (
    "a loss that does not depend on the trained parameters, parameters that are all frozen, or gradients that "
    "underflow where they are cast for the reduction (an fp16 reduce dtype, a loss scaled far down)"
)


def zero_gradients_audit(norms: Mapping[int, Sequence[Optional[float]]]) -> AuditOutcome:
    """Judge ``step -> per-rank local gradient norm`` (None: not measured on that rank).

    >>> print(zero_gradients_audit({s: [0.5, 0.25, 0.0] for s in range(1)}).message)
    no rank's local gradient was zero in every sampled step (1 step)
    >>> outcome = zero_gradients_audit({s: [0.5, 0.0, 0.25, 0.5] for s in range(4)})
    >>> print(outcome.message)  # doctest: +NORMALIZE_WHITESPACE
    the local gradient was exactly zero on rank 1 in every one of 4 sampled steps, and not on ranks 0, 2-3: its loss
    does not reach the model's parameters (multiplied by 0, or every label masked), and the average of the ranks'
    gradients hides it
    >>> outcome.ranks, outcome.signature
    ((1,), 'zero 1')
    >>> print(zero_gradients_audit({s: [0.0, 0.0] for s in range(2)}).message)  # doctest: +NORMALIZE_WHITESPACE
    every rank's local gradient was exactly zero in every one of 2 sampled steps: nothing trains (a loss that
    does not depend on the trained parameters, parameters that are all frozen, or gradients that underflow where
    they are cast for the reduction (an fp16 reduce dtype, a loss scaled far down))
    """
    measured = {step: row for step, row in norms.items() if row and any(v is not None for v in row)}
    if not measured:
        return not_measured("no step measured a local gradient norm")
    world = max(len(row) for row in measured.values())
    steps_of = {r: [row[r] for row in measured.values() if r < len(row) and row[r] is not None] for r in range(world)}
    zero = [r for r in range(world) if steps_of[r] and all(v == 0 for v in steps_of[r])]
    details = {"steps_judged": len(measured), "zero_ranks": zero}
    if zero and len(zero) == world:
        message = (
            f"every rank's local gradient was exactly zero in every one of {len(measured)} sampled steps: nothing "
            f"trains ({CAUSES})"
        )
        return AuditOutcome(False, message, "zero all", tuple(zero), details)
    named = [r for r in zero if len(steps_of[r]) >= MIN_STEPS_FOR_A_RANK]
    if not named:
        return AuditOutcome(
            True,
            f"no rank's local gradient was zero in every sampled step ({len(measured)} step{'s' * (len(measured) > 1)})",
            "nonzero",
            (),
            details,
        )
    others = [r for r in range(world) if r not in named]
    its, gradient = ("its", "gradient was") if len(named) == 1 else ("their", "gradients were")
    message = (
        f"the local {gradient} exactly zero on {ranks_phrase(named)} in every one of "
        f"{min(len(steps_of[r]) for r in named)} sampled steps, and not on {ranks_phrase(others)}: {its} loss does not "
        "reach the model's parameters (multiplied by 0, or every label masked), and the average of the ranks' "
        "gradients hides it"
    )
    return AuditOutcome(False, message, f"zero {rank_span(named)}", tuple(named), details)

"""The loss-weight audit: does every rank's loss enter its own backward with the same weight?

Each rank's weight per step (:mod:`healthcheck.integrations.loss_weight`) is the factor c in the script's
``backward(c · token-mean loss)``: 1 for a plain loop, 1/accum per micro-batch summed to 1, the loss scale
under a ``GradScaler`` (the same on every rank, whatever it does from step to step). A rank whose loss the
script scales on its own (a per-node config, a bug in one branch) has a constant ratio to the others.

Exact, not statistical: the weights are read off the backward, so ranks that agree agree to float
rounding (~1e-7 relative). Two cases are told apart by the ratios to the step's median over the ranks:

* every rank's ratio is the same in every judged step: a constant per-rank scale. The audit fails when
  the ranks fall into more than one level, naming the ranks outside the largest;
* some rank's ratio moves from step to step: the script weighs each rank's loss by its data. Where it divides
  by a count over every rank (TRL, the Trainer's ``num_items_in_batch``), w = c · N_rank / N_all, so the
  weight per loss token, w / N_rank = c / N_all, is the same on every rank: the audit judges that instead.
  Weights that follow the data either way are not judged, and the audit says so.
"""

from __future__ import annotations

import math
import statistics
from typing import Mapping, Optional, Sequence

from healthcheck.judge.audit_outcome import (
    AuditOutcome,
    group_ranks,
    not_measured,
    odd_ones_out,
    partition_signature,
    ranks_phrase,
)

#: Relative difference within which two weights (or a rank's ratio in two steps) are the same: float32
#: rounding of the loss and its gradient is ~1e-7, and a scale that matters is far above 1e-4.
TOLERANCE = 1e-4

#: Unit roundoffs within which weights read in a coarser dtype are the same: each weight carries the rounding of the
#: loss and of its gradient (2u), a ratio of two weights twice that, and a ratio compared across steps twice again.
ROUNDINGS = 8


def loss_weight_audit(
    weights: Mapping[int, Sequence[Optional[float]]],
    tokens: Optional[Mapping[int, Sequence[Optional[float]]]] = None,
    tolerance: float = TOLERANCE,
    rounding: Optional[Mapping[int, Sequence[Optional[float]]]] = None,
) -> AuditOutcome:
    """Judge ``step -> per-rank weight`` (None where a rank's loss was not seen in its backward), and, where the
    weights follow the data, the weights per token (``tokens``: ``step -> per-rank`` loss tokens). ``rounding``:
    ``step -> per-rank`` unit roundoff the weights were read to; the tolerance grows to :data:`ROUNDINGS` of the
    largest (a loss computed in bf16: 3%, still far under the scales that matter).

    >>> clean = {s: [1.0, 1.0, 1.0, 1.0] for s in range(5)}
    >>> print(loss_weight_audit(clean).message)
    every rank's loss enters its backward with the same weight (1 in each of 5 steps)
    >>> scaled = {s: [1.0, 1.0, 1.0, 1.5] for s in range(5)}
    >>> print(loss_weight_audit(scaled).message)
    rank 3's loss enters its backward with 1.5x the weight of ranks 0-2's, in each of 5 steps: that data trains the model 1.5x as hard
    >>> counts = {s: [40.0 + s, 50.0, 45.0 - s, 60.0] for s in range(5)}  # a count over every rank: w = N / N_all
    >>> global_count = {s: [n / sum(row) * (1.5 if r == 2 else 1.0) for r, n in enumerate(row)] for s, row in counts.items()}
    >>> print(loss_weight_audit(global_count, counts).message)  # doctest: +ELLIPSIS
    rank 2's loss enters its backward with 1.5x the weight per token of ranks 0-1, 3's, ...
    >>> loss_weight_audit(global_count).signature  # without the counts
    'data-dependent'
    >>> bf16 = {s: [1.0 + 0.003 * ((s + r) % 3 - 1) for r in range(4)] for s in range(5)}  # weights of 1, read in bf16
    >>> loss_weight_audit(bf16).signature, loss_weight_audit(bf16, rounding={s: [2.0**-8] * 4 for s in bf16}).signature
    ('data-dependent', 'equal')
    """
    judged = sorted(s for s, row in weights.items() if row and all(_positive(w) for w in row))
    units = [u for s in judged for u in (rounding or {}).get(s, ()) if u is not None and math.isfinite(u)]
    tolerance = max([tolerance] + [ROUNDINGS * u for u in units])
    if len(judged) < 2:
        return not_measured(
            f"{len(judged)} step(s) in which every rank's captured loss reached its backward; 2 are needed to tell "
            "a constant per-rank scale from weights that follow the data"
        )
    table = {s: [float(w) for w in weights[s] if w is not None] for s in judged}  # every weight is known there
    ratios, moving = _ratios(table, tolerance)
    per = ""
    per_token: dict[int, list[float]] = {}
    if moving and tokens is not None:
        # A script that divides by a count over every rank: w = c * N_rank / N_all, so w / N_rank is c / N_all.
        counted = [s for s in judged if s in tokens and all(_positive(n) for n in tokens[s])]
        if len(counted) >= 2:
            per_token = {s: [w / float(n) for w, n in zip(table[s], tokens[s], strict=True) if n is not None] for s in counted}
            token_ratios, token_moving = _ratios(per_token, tolerance)
            if not token_moving:
                judged, table, ratios, moving, per = counted, per_token, token_ratios, token_moving, " per token"
    details = {"steps_judged": len(judged), "ratio_to_median": [round(statistics.median(v), 6) for v in ratios]}
    if per:
        details["per_token"] = True
    if moving and (apart := _apart_from_a_majority(per_token or table, tolerance, " per token" if per_token else "")) is not None:
        return apart
    if moving:
        lo, hi = min(min(ratios[r]) for r in moving), max(max(ratios[r]) for r in moving)
        return AuditOutcome(
            True,
            f"not judged: the ranks' loss weights follow their data ({ranks_phrase(moving)} at {lo:.3g}x to {hi:.3g}x the "
            "ranks' median), per rank and per token alike; a constant per-rank scale is what this audit detects",
            "data-dependent",
            (),
            details,
            measured=False,
        )
    world, steps = len(ratios), len(judged)
    # The digits the weights are known to: 4 (6 for the weight every rank shares) in float32, 2 in bf16.
    precise = tolerance <= TOLERANCE
    digits = 4 if precise else max(2, int(-math.log10(tolerance)) + 1)
    levels = group_ranks([ratios[r][0] for r in range(world)], same=lambda a, b: _same(a, b, tolerance))
    if len(levels) == 1:
        first = [table[s][0] for s in judged]
        if per:
            same = f"per token (the script divides by a count over every rank), in each of {steps} steps"
        elif all(_same(first[0], w, tolerance) for w in first):
            same = f"({first[0]:.{6 if precise else digits}g} in each of {steps} steps)"
        else:
            same = f"(equal across ranks in {steps} steps)"
        return AuditOutcome(True, f"every rank's loss enters its backward with the same weight {same}", "equal", (), details)
    odd = odd_ones_out(levels)
    if len(odd) == world:  # no majority: every level is named
        listed = ", ".join(f"{ranks_phrase(g)} {ratios[g[0]][0]:.{digits}g}" for g in sorted(levels, key=min))
        message = (
            f"the ranks' losses enter their backward with different weights{per}, in each of {steps} steps: "
            f"{listed} (relative to the median)"
        )
    else:
        majority, base = levels[0], ratios[levels[0][0]][0]
        parts = [
            f"{ranks_phrase(g)}'s loss enters its backward with {ratios[g[0]][0] / base:.{digits}g}x the weight{per} of "
            f"{ranks_phrase(majority)}'s"
            for g in levels[1:]
        ]
        message = "; ".join(parts) + f", in each of {steps} steps"
        if len(levels) == 2:
            message += f": that data trains the model {ratios[levels[1][0]][0] / base:.{digits}g}x as hard"
    return AuditOutcome(False, message, partition_signature(levels), tuple(odd), details)


def _apart_from_a_majority(table: Mapping[int, Sequence[float]], tolerance: float, per: str = "") -> Optional[AuditOutcome]:
    """The failure where a strict majority of ranks (two at least) weigh their loss (per token, where ``table`` is
    per token) exactly alike in every judged step, and the others do not: weights that follow the data agree between
    ranks only by chance, step after step never. A rank whose loss is no token mean (TRL's ``loss_type="dft"``, a
    focal loss, a per-sample mean) on one node moves against ranks that agree to float rounding: it was "not judged".

    >>> steps = {s: [0.5, 0.5 * (s + 1) / 700, 0.5, 0.5] for s in range(4)}
    >>> print(_apart_from_a_majority(steps, 1e-4).message)  # doctest: +NORMALIZE_WHITESPACE
    rank 1's loss enters its backward with another weight than ranks 0, 2-3's in each of 4 steps (0.00143x to
    0.00571x theirs), which agree exactly: it weighs its data otherwise (another loss, or a scale of its own)
    >>> _apart_from_a_majority({s: [1.0 + s * r for r in range(4)] for s in range(4)}, 1e-4) is None  # all follow
    True
    """
    steps = sorted(table)
    world = len(table[steps[0]])
    rows = [tuple(table[s][r] for s in steps) for r in range(world)]
    groups = group_ranks(rows, same=lambda a, b: all(_same(x, y, tolerance) for x, y in zip(a, b, strict=True)))
    majority = groups[0]
    if len(majority) < 2 or 2 * len(majority) <= world:
        return None
    odd = sorted(r for r in range(world) if r not in majority)
    base = majority[0]
    scale = [rows[r][i] / rows[base][i] for r in odd for i in range(len(steps))]
    message = (
        f"{ranks_phrase(odd)}'s loss enters its backward with another weight{per} than {ranks_phrase(majority)}'s in each "
        f"of {len(steps)} steps ({min(scale):.3g}x to {max(scale):.3g}x theirs), which agree exactly: it weighs its data "
        "otherwise (another loss, or a scale of its own)"
    )
    details = {"steps_judged": len(steps), "scale_to_majority": [round(min(scale), 6), round(max(scale), 6)]}
    return AuditOutcome(False, message, partition_signature(groups), tuple(odd), details)


#: Judged steps after which a failing loss-weight audit stops the probe (fail fast). A per-rank scale is
#: constant from the first step; weights that follow the data keep the ratios constant over this many steps
#: only when the counts behind them are themselves constant, which is no data dependence at all.
DECISIVE_STEPS = 4


class LossWeightWatch:
    """The loss-weight audit as the steps' weights arrive (the same gathered values on every rank), for fail fast.

    >>> watch = LossWeightWatch()
    >>> [watch.add(s, [1.0, 1.0, 2.0], None) for s in range(3)]
    [None, None, None]
    >>> print(watch.add(3, [1.0, 1.0, 2.0], None).message)
    rank 2's loss enters its backward with 2x the weight of ranks 0-1's, in each of 4 steps: that data trains the model 2x as hard
    """

    def __init__(self, decisive_steps: int = DECISIVE_STEPS):
        self.decisive_steps = decisive_steps
        self.weights: dict[int, list[Optional[float]]] = {}
        self.tokens: dict[int, list[Optional[float]]] = {}
        self.rounding: dict[int, list[Optional[float]]] = {}

    def add(self, step: int, weights: Sequence[Optional[float]], tokens: Optional[Sequence[Optional[float]]],
            rounding: Optional[Sequence[Optional[float]]] = None) -> Optional[AuditOutcome]:
        """Record a step; the audit's failure once it has judged ``decisive_steps`` steps, else None."""
        self.weights[step] = list(weights)
        if tokens is not None:
            self.tokens[step] = [float(n) if n is not None else None for n in tokens]
        if rounding is not None:
            self.rounding[step] = list(rounding)
        outcome = loss_weight_audit(self.weights, self.tokens, rounding=self.rounding)
        if outcome.passed or outcome.details.get("steps_judged", 0) < self.decisive_steps:
            return None
        return outcome


def _ratios(table: Mapping[int, Sequence[float]], tolerance: float = TOLERANCE) -> tuple[list[list[float]], list[int]]:
    """Per rank, its value over the step's median in each step; and the ranks whose ratio is not constant.

    >>> _ratios({0: [1.0, 2.0, 1.0], 1: [3.0, 6.0, 3.0]})
    ([[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]], [])
    """
    steps = sorted(table)
    world = len(table[steps[0]])
    ratios = [[table[s][r] / statistics.median(table[s]) for s in steps] for r in range(world)]
    return ratios, [r for r in range(world) if not _same(min(ratios[r]), max(ratios[r]), tolerance)]


def _same(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * max(abs(a), abs(b))


def _positive(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value) and value > 0

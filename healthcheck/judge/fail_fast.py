"""Fail fast: stop a probe at the first decisive failure instead of running its remaining steps.

Some evidence is final long before the last step: shards that overlap are in the sampler plan before
the first step, seeds and the environment are known at start-up, and a parameter-hash mismatch, a
rank whose replay of a shared micro-batch disagrees or a non-finite value is known at its step; a rank
whose loss enters its backward with another weight, after a few steps (:class:`.loss_weight.LossWeightWatch`), and a
rank that carries its gradients into a step others start cleared (:mod:`.stale_gradients`), at that step. The
workers judge that evidence with the same pure audits the post-run assembly uses (:mod:`.assemble`),
on data every rank holds identically after a gather, so every rank reaches the same decision at the same step without another collective.

A failure is decisive when its audit is exact (:data:`DECISIVE`) and the baseline does not approve that
very signature. Statistical checks (envelopes, stragglers, rank outliers) never stop a probe: their
false-alarm rates are stated for the whole window.

    >>> from healthcheck.artifacts import FailFastPolicy
    >>> from healthcheck.judge.audit_outcome import AuditOutcome
    >>> gate = FailFast(FailFastPolicy(approved={"seeds": "seed {0}{1-7}"}))
    >>> gate.judge(0, {"seeds": AuditOutcome(False, "rank 0 has seed 1", "seed {0}{1-7}", (0,))})
    False
    >>> gate.judge(4, {"param_equality": AuditOutcome(False, "rank 2 differs", "{0,1,3}{2}", (2,))})
    True
    >>> gate.stop.headline()
    'stopped early at step 4: param_equality'
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from healthcheck.artifacts import EarlyStop, FailFastPolicy
from healthcheck.finite import finite_or_none
from healthcheck.judge.audit_outcome import AuditOutcome
from healthcheck.judge.learning_rate import learning_rate_audit
from healthcheck.judge.loss_weight import LossWeightWatch
from healthcheck.judge.stale_gradients import stale_gradients_audit
from healthcheck.ranks import ranks_phrase

#: Audits whose failure is final once seen: exact evidence that more steps cannot undo.
DECISIVE = (
    "data_shards", "seeds", "environment", "param_equality", "sharded_state", "replay", "nonfinite", "loss_weight",
    "stale_gradients", "learning_rate",
)


class FailFast:
    """The workers' stop decision; ``stop`` holds the first decisive failure, the same on every rank.

    Args:
        policy: Whether to stop at decisive audit failures, and the baseline's approved signatures.
            None: never stop on an audit (a non-finite value still stops the run).
    """

    def __init__(self, policy: Optional[FailFastPolicy] = None):
        self.policy = policy or FailFastPolicy(enabled=False)
        self.stop: Optional[EarlyStop] = None

    def judge(self, step: int, outcomes: Mapping[str, AuditOutcome]) -> bool:
        """Record the first decisive failure among ``outcomes`` (audit name -> outcome); True once stopped."""
        if self.stop is not None or not self.policy.enabled:
            return self.stop is not None
        for name in DECISIVE:
            outcome = outcomes.get(name)
            if outcome is None or outcome.passed or not outcome.measured:
                continue
            if self.policy.approved.get(name) == outcome.signature:
                continue  # a deviation the baseline records on purpose
            self.stop = EarlyStop(step=step, check=name, message=outcome.message, ranks=list(outcome.ranks))
            break
        return self.stop is not None

    def nonfinite(self, step: int, ranks: Sequence[int]) -> bool:
        """A non-finite loss or gradient at ``step`` on ``ranks`` stops the run, fail fast or not."""
        if ranks:
            self.cannot_continue(step, "nonfinite", f"non-finite loss or gradient on {ranks_phrase(ranks)} at step {step}", ranks)
        return self.stop is not None

    def cannot_continue(self, step: int, check: str, message: str, ranks: Sequence[int] = ()) -> None:
        """A failure the ranks cannot train past (the update spread it, or their collectives would no longer
        match) stops the run at ``step``, fail fast or not, and whatever the baseline approves."""
        if self.stop is None:
            self.stop = EarlyStop(step=step, check=check, message=message, unavoidable=True, ranks=list(ranks))


class StepAudits:
    """Script mode's exact audits of each step's gathered per-rank values, judged as the steps arrive (the same
    on every rank), for :meth:`FailFast.judge`.

    >>> audits = StepAudits()
    >>> audits.add(0, {"loss_weight": [1.0, 1.0], "grads_carried": [0.0, 0.0]}, None)
    {}
    >>> audits.add(1, {"loss_weight": [1.0, 1.0], "grads_carried": [0.0, float("nan")]}, None)  # a rank not read
    {}
    >>> audits.add(2, {"loss_weight": [1.0, 1.0], "grads_carried": [0.0, 1.0]}, None)["stale_gradients"].ranks
    (1,)
    >>> audits.add(3, {"lr": [0.5, 0.5]}, None), audits.add(4, {"lr": [0.75, 0.625]}, None)["learning_rate"].passed
    ({}, False)
    >>> StepAudits().add(0, {"lr": [0.5] * 3, "lr_groups": [7.0, 7.0, 9.0]}, None)["learning_rate"].ranks  # another group
    (2,)
    """

    def __init__(self) -> None:
        self.loss_weights = LossWeightWatch()
        self.readings: dict[int, list[Optional[float]]] = {}
        self.rates: dict[int, list[Optional[float]]] = {}
        self.group_rates: dict[int, list[Optional[float]]] = {}

    def add(
        self, step: int, extras: Mapping[str, Sequence[Optional[float]]], tokens: Optional[Sequence[Optional[float]]]
    ) -> dict[str, AuditOutcome]:
        """The step's per-rank ``extras`` (``loss_weight``, ``grads_carried``, ``lr``, ``lr_groups``): the outcomes that
        fail, by audit name."""
        outcomes = {}
        weights = extras.get("loss_weight")
        rounding = extras.get("loss_weight_u")
        if weights is not None and (weight_outcome := self.loss_weights.add(step, weights, tokens, rounding)) is not None:
            outcomes["loss_weight"] = weight_outcome
        # Exact per-step readings: judged once a step's values, read on every rank, differ.
        for name, key, store, audit in (
            ("stale_gradients", "grads_carried", self.readings, stale_gradients_audit),
            ("learning_rate", "lr", self.rates, learning_rate_audit),
            ("learning_rate", "lr_groups", self.group_rates, lambda digests: learning_rate_audit(self.rates, digests)),
        ):
            values = extras.get(key)
            if values is not None:
                row = store[step] = [finite_or_none(v) for v in values]  # the gather sends a None as NaN
                if None not in row and len(set(row)) > 1 and name not in outcomes:
                    outcomes[name] = audit(store)
        return outcomes

"""The replay audit inside the training loop: one round before the first step and every ``metrics.replay_every``.

A round (a collective; every rank calls :meth:`ReplayRounds.check` at the same step, before the step's own
forward): every rank replays the micro-batch of a rank chosen by the step (:mod:`healthcheck.measure.replay`),
the fingerprints are gathered, and ranks are grouped within their device group
(:mod:`healthcheck.judge.replay_audit`). Only when a rank is outside its group's majority does the round cost
more: an exact difference against a majority rank, then a second replay on the odd rank and a second
difference, which tells a persistent fault from a transient one. Every rank builds the same
:class:`~healthcheck.artifacts.ReplayEvidence`, so every rank reaches the same fail-fast decision.

In tolerance mode (a GPU without deterministic algorithms) the first round replays twice on every rank,
and the largest spread between the two sets the bound (:func:`~healthcheck.judge.replay_audit.replay_tolerance`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

from healthcheck.artifacts import ReplayDifference, ReplayEvidence, ReplayRound
from healthcheck.judge.audit_outcome import AuditOutcome, group_ranks
from healthcheck.judge.replay_audit import ReplaySplit, replay_audit, replay_tolerance, split_replays, tolerance_labels
from healthcheck.measure.replay import GradientReplay, LocalReplay, ReplayTable

#: Folded-sketch size for the tolerance mode's distances (relative error ~sqrt(2/1024) = 4%).
REPLAY_SKETCH_DIM = 1024


def build_rounds(
    config: Any, module: Any, loss_of: Callable[[Callable[..., Any], Mapping[str, Any]], Any], device: Any, device_names: Sequence[str],
    monitor: Any = None,
) -> Optional[ReplayRounds]:
    """This rank's replay rounds for ``module`` (the trained module, not its DDP wrapper; an FSDP2 root, with its
    ``monitor``), or None when ``metrics.replay_every`` is 0. ``loss_of(call, batch)`` is the loss the replay
    differentiates."""
    if config.metrics.replay_every == 0:
        return None
    from healthcheck.measure.environment import replay_determinism
    from healthcheck.measure.fsdp_internals import is_fsdp_module
    from healthcheck.measure.replay import GradientReplay
    from healthcheck.measure.sharded_replay import ShardedGradientReplay

    mode, reason = replay_determinism(device)
    # The global seed: the same batch choice and dropout masks on every rank.
    settings = {"device": device, "seed": config.train.seed, "sketch_dim": REPLAY_SKETCH_DIM if mode == "tolerance" else 0}
    if is_fsdp_module(module):
        replay: GradientReplay = ShardedGradientReplay(module, monitor, loss_of, **settings)
    else:
        replay = GradientReplay(module, loss_of, **settings)
    return ReplayRounds(replay, every=config.metrics.replay_every, device_names=device_names, mode=mode, mode_reason=reason)


class ReplayRounds:
    """Runs the replay rounds of one probe and keeps their evidence.

    Args:
        replay: This rank's :class:`~healthcheck.measure.replay.GradientReplay`.
        every: ``metrics.replay_every`` (0: never).
        device_names: Every rank's device name, in rank order (ranks compare within a name).
        mode: ``bitwise`` or ``tolerance`` (:func:`healthcheck.measure.environment.replay_determinism`).
        mode_reason: Why that mode, in words, for the report.
    """

    def __init__(self, replay: GradientReplay, *, every: int, device_names: Sequence[str], mode: str, mode_reason: str):
        if mode == "tolerance" and replay.sketcher is None:
            raise ValueError("mode: tolerance needs a GradientReplay with a sketch (sketch_dim > 0)")
        self.replay = replay
        self.every = every
        self.evidence = ReplayEvidence(
            mode=mode,
            mode_reason=mode_reason,
            device_groups=group_ranks(list(device_names)),
            every=every,
        )

    def due(self, step: int) -> bool:
        """Whether a round runs before ``step`` (step 0, then every ``every``-th)."""
        return self.every > 0 and step % self.every == 0

    def check(self, step: int, batch: Mapping[str, Any]) -> AuditOutcome:
        """Collective: one round at ``step`` (``batch`` is this rank's first micro-batch); the audit so far."""
        start = time.perf_counter()
        source, shared = self.replay.source_batch(step, batch)
        first = self.replay.local(step, shared)
        if self.evidence.mode == "tolerance" and not self.evidence.rounds:
            self._measure_tolerance(step, shared, first)
        table = self.replay.gather(first)
        split = split_replays(self._labels(table), self.evidence.device_groups)
        params_agree = len(set(table.param_hashes)) == 1
        # Every rank holds the same table, so all of them join the comparisons or none does.
        differences = self._differences(step, shared, first, split) if split.references and params_agree else []
        self.evidence.rounds.append(
            ReplayRound(
                step=step,
                source_rank=source,
                groups=split.groups,
                params_agree=params_agree,
                differences=differences,
                no_majority=split.no_majority,
                seconds=time.perf_counter() - start,
            )
        )
        return replay_audit(self.evidence)

    def _labels(self, table: ReplayTable) -> list[Hashable]:
        if self.evidence.mode == "bitwise":
            return list(table.grad_hashes)
        return list(tolerance_labels(table.relative_distances(), self.evidence.tolerance, self.evidence.device_groups))

    def _measure_tolerance(self, step: int, batch: Mapping[str, Any], first: LocalReplay) -> None:
        """Collective: replay once more on every rank; the spread between the two sets the tolerance."""
        again = self.replay.local(step, batch)
        spreads = self.replay.gather_floats(self.replay.spread(again, first))
        self.evidence.repeat_spread = spreads
        self.evidence.tolerance = replay_tolerance(spreads)

    def _differences(self, step: int, batch: Mapping[str, Any], first: LocalReplay, split: ReplaySplit) -> list[ReplayDifference]:
        """Collective: exact differences of the odd ranks, and of their second replay, from their references."""
        references = sorted(set(split.references.values()))
        measured = {ref: self.replay.compare_to(first.grads, ref) for ref in references}
        if self.replay.collective:  # FSDP2: each comparison replays again on every rank, so this one is the third
            repeat = first.grads
        else:  # the second replay runs on the odd ranks only; the others hand in their first gradient again
            repeat = self.replay.local(step, batch).grads if self.replay.rank in split.references else first.grads
        repeated = {ref: self.replay.compare_to(repeat, ref) for ref in references}
        out = []
        for rank, ref in sorted(split.references.items()):
            max_abs, rel_l2, first_tensor = measured[ref][rank]
            repeat_max, repeat_rel, _ = repeated[ref][rank]
            reproduced = repeat_max > 0 if self.evidence.mode == "bitwise" else repeat_rel > self.evidence.tolerance
            out.append(
                ReplayDifference(
                    rank=rank,
                    reference_rank=ref,
                    max_abs=max_abs,
                    rel_l2=rel_l2,
                    first_tensor=self.replay.names[first_tensor] if first_tensor >= 0 else "",
                    reproduced=reproduced,
                    repeat_rel_l2=repeat_rel,
                )
            )
        return out

"""Which module an FSDP2 script trains, and what happens at its first forward (no process group: the ranks'
comparison is replaced by a fixed outcome)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from healthcheck.errors import InvalidInput
from healthcheck.integrations.script import lockstep as lockstep_module
from healthcheck.integrations.script import sharded_root
from healthcheck.integrations.script.clipping import ClipRecorder
from healthcheck.integrations.script.lockstep import Lockstep
from healthcheck.integrations.script.patches import _clipped
from healthcheck.integrations.script.sharded_root import ShardedRoot
from healthcheck.judge.audit_outcome import AuditOutcome

AGREE = AuditOutcome(True, "the same", "", ())
DIFFER = AuditOutcome(False, "fsdp.param_dtype differs: ranks 0-1 bfloat16; rank 2 float32", "x", (2,))


class Calls:
    def __init__(self, monkeypatch, outcome, lockstep=lambda fact: AGREE):
        self.watched, self.training, self.disagreed, self.compared, self.facts = [], [], [], 0, []
        monkeypatch.setattr(sharded_root, "check_agreement", self._compare)
        monkeypatch.setattr(lockstep_module, "check_lockstep", lambda fact: self.facts.append(fact) or lockstep(fact))
        self.outcome = outcome
        self.lockstep = Lockstep(lambda outcome: self.disagreed.append((self.root.root, outcome)))
        self.root = ShardedRoot(self._watch, lambda module, args, kwargs: self.training.append(module),
                                lambda module, outcome: self.disagreed.append((module, outcome)), self.lockstep)

    def _watch(self, module):
        self.watched.append(module)
        return []

    def _compare(self, module):
        self.compared += 1
        return self.outcome


def _model() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))


def test_the_module_sharded_last_is_the_root_and_a_block_sharded_after_it_does_not_take_over(monkeypatch):
    calls, model = Calls(monkeypatch, AGREE), _model()
    calls.root.add(model[0])
    calls.root.add(model[1])
    calls.root.add(model)
    calls.root.add(model[0])  # a block sharded after its parent
    assert calls.root.root is model and calls.watched == [model[0], model[1], model]
    model[0](torch.ones(1, 2))  # a former candidate's hooks are gone
    assert calls.training == [] and calls.compared == 0
    with torch.no_grad():  # an evaluation forward compares the ranks, but does not start training
        model(torch.ones(1, 2))
    assert calls.training == [] and calls.compared == 1
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    assert calls.training == [model] and calls.compared == 1 and calls.disagreed == []
    # Until the first update every root forward, and that update, say where the rank is; after it nothing does.
    calls.lockstep.first_update()
    model(torch.ones(1, 2))
    assert calls.facts == ["the model's first forward", "forward 1 (no grad)", "forward 2 (gradient sync on)",
                           "forward 3 (gradient sync on)", "optimizer step after 3 forwards"]


def test_ranks_at_different_places_before_the_first_update_end_the_run(monkeypatch):
    # A rank with its own gradient accumulation: at forward 2 it accumulates while the others reduce-scatter.
    calls, model = Calls(monkeypatch, AGREE, lockstep=lambda fact: DIFFER if fact.startswith("forward 2") else AGREE), _model()
    calls.root.add(model)
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    assert calls.disagreed == [(model, DIFFER)] and calls.lockstep.fact == "forward 2 (gradient sync on)"


def test_ranks_that_shard_differently_end_the_run_before_training_starts(monkeypatch):
    calls, model = Calls(monkeypatch, DIFFER), _model()
    calls.root.add(model)
    model(torch.ones(1, 2))
    assert calls.disagreed == [(model, DIFFER)] and calls.training == [] and calls.compared == 1
    assert calls.facts == ["the model's first forward"]  # before the sharding's: the others may be at a script's collective


def test_a_sharded_module_outside_the_trained_root_is_bad_input(monkeypatch):
    calls, model, other = Calls(monkeypatch, AGREE), _model(), torch.nn.Linear(2, 2)
    calls.root.add(other)
    calls.root.add(model)
    with pytest.raises(InvalidInput, match="Linear is not inside Sequential"):
        model(torch.ones(1, 2))
    assert calls.training == []


def test_a_clip_of_the_roots_gradients_before_the_first_update_compares_where_the_ranks_are(monkeypatch):
    # Under FSDP2 the clip's norm is an all-reduce over the shards. A rank with its own gradient accumulation and a
    # reduce-scatter per micro-batch (the Trainer's FSDP2 default) was still at a forward, all-gathering against it,
    # and the ranks hung until distributed.timeout_s.
    behind = lambda fact: DIFFER if fact.startswith("gradient clipping") else AGREE  # noqa: E731
    calls, model, other = Calls(monkeypatch, AGREE, lockstep=behind), _model(), torch.nn.Linear(2, 2)
    calls.root.add(model)
    # What the clip patch calls: the recorder says whether the model's gradients were clipped (patches._clipped).
    session = SimpleNamespace(clips=ClipRecorder(lambda: {id(p) for p in model.parameters()}), fsdp=calls.root,
                              lockstep=calls.lockstep, model=None)
    _clipped(session, "clip_grad_norm_", list(model.parameters()), (1.0,), {})  # before training started: nothing
    model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    session.model = model  # the session's trained model from its first training forward
    _clipped(session, "clip_grad_norm_", list(other.parameters()), (1.0,), {})  # not the root's: no collective of FSDP2's
    assert calls.disagreed == []
    _clipped(session, "clip_grad_norm_", list(model.parameters()), (1.0,), {})
    assert calls.disagreed == [(model, DIFFER)] and calls.lockstep.fact == "gradient clipping after 2 forwards"


def test_clips_are_compared_until_the_first_update_only(monkeypatch):
    calls, model = Calls(monkeypatch, AGREE), _model()
    calls.root.add(model)
    model(torch.ones(1, 2))
    calls.lockstep.at("clip")
    calls.lockstep.first_update()
    calls.lockstep.at("clip")
    assert calls.facts == ["the model's first forward", "forward 1 (gradient sync on)", "gradient clipping after 1 forward",
                           "optimizer step after 1 forward"]

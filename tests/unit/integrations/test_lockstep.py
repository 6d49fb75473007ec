"""Where the ranks compare their place before the first update (no process group: the comparison is replaced by a
fixed outcome per fact)."""

from __future__ import annotations

import pytest
import torch

from healthcheck.integrations.script import lockstep as lockstep_module
from healthcheck.integrations.script.lockstep import Lockstep, compared_first
from healthcheck.judge.audit_outcome import AuditOutcome

AGREE = AuditOutcome(True, "the same", "", ())
DIFFER = AuditOutcome(False, "train.before_first_update differs", "x", (2,))


class Compared:
    """The facts a :class:`Lockstep` compares, and what it was told when one differed."""

    def __init__(self, monkeypatch, differs=lambda fact: False):
        self.facts, self.stopped = [], []
        monkeypatch.setattr(lockstep_module, "check_lockstep", lambda fact: self.facts.append(fact) or (DIFFER if differs(fact) else AGREE))
        self.lockstep = Lockstep(self.stopped.append)


def _call_from(module, collective, *args, **kwargs):
    """``collective`` called from code of the module named ``module``."""
    namespace = {"__name__": module, "collective": collective}
    exec("def call(*args, **kwargs):\n    return collective(*args, **kwargs)\n", namespace)
    return namespace["call"](*args, **kwargs)


class Wrapper(torch.nn.Module):
    """DDP's shape: a wrapper whose forward broadcasts (logged in ``events``) and then calls its ``module``."""

    def __init__(self, events: list):
        super().__init__()
        self.module, self.events, self.require_backward_grad_sync = torch.nn.Linear(2, 2), events, True

    def forward(self, x):
        self.events.append("broadcast")
        if x.numel() != 2:
            raise RuntimeError("failed before its module's forward")
        return self.module(x)


def _attached(monkeypatch, differs=lambda fact: False):
    compared = Compared(monkeypatch, differs)
    events = []
    compare = lockstep_module.check_lockstep  # Compared's
    monkeypatch.setattr(lockstep_module, "check_lockstep", lambda fact: events.append(fact) or compare(fact))
    ddp = Wrapper(events)
    compared.lockstep.attach_ddp(ddp)
    return compared, ddp, events


def test_ddp_training_forwards_say_whether_their_backward_reduces(monkeypatch):
    # A rank with its own accumulation runs its 2nd forward under no_sync while the others' 2nd all-reduces: DDP's
    # all-reduce met that rank's next collective and the ranks hung until distributed.timeout_s.
    compared, ddp, _ = _attached(monkeypatch, differs=lambda fact: fact == "forward 2 (gradient sync off)")
    ddp.require_backward_grad_sync = False
    ddp(torch.ones(2))
    with torch.no_grad():  # an evaluation forward prepares no all-reduce: not a place the ranks must share
        ddp(torch.ones(2))
    assert compared.facts == ["forward 1 (gradient sync off)"] and compared.stopped == []
    ddp(torch.ones(2))
    assert compared.stopped == [DIFFER] and compared.lockstep.fact == "forward 2 (gradient sync off)"


def test_a_ddp_forward_is_compared_after_ddps_own_broadcast_and_the_wrapped_modules_own_calls_are_not(monkeypatch):
    # Rank 0 logs a validation loss before it trains: its broadcast pairs with the others' first forward's in torch.
    compared, ddp, events = _attached(monkeypatch)
    with torch.no_grad():
        ddp(torch.ones(2))
    ddp.module(torch.ones(2))  # model.module(...): a sanity loss outside DDP, which no rank need compute
    ddp(torch.ones(2))
    assert events == ["broadcast", "broadcast", "forward 1 (gradient sync on)"]
    with pytest.raises(RuntimeError, match="before its module"):  # it leaves no DDP call pending
        ddp(torch.ones(3))
    ddp.module(torch.ones(2))
    assert compared.facts == ["forward 1 (gradient sync on)"]


def test_nothing_is_compared_after_the_first_update(monkeypatch):
    compared, ddp, _ = _attached(monkeypatch)
    ddp(torch.ones(2))
    compared.lockstep.first_update()
    compared.lockstep.first_update()
    ddp(torch.ones(2))
    compared.lockstep.at("clip")
    assert compared.facts == ["forward 1 (gradient sync on)", "optimizer step after 1 forward"]


def test_the_scripts_collectives_on_the_default_group_are_compared_once_the_model_exists(monkeypatch):
    # accelerate's loop gathers every micro-batch's loss: the others' first update met the gather of a rank that
    # accumulates more, and gloo aborted on the sizes without naming it. A Trainer gathers each step's token count
    # before its first forward: from the wrapping on, not from the first forward.
    compared = Compared(monkeypatch, differs=lambda fact: "all_gather" in fact)
    steps = compared.lockstep
    calls = []

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        calls.append(group)
        return "done"

    gather = compared_first(all_gather, "all_gather", lambda: steps)
    assert _call_from("train", gather, [], 1) == "done" and compared.facts == []  # before the model: nothing to compare
    steps.start()
    assert _call_from("train", gather, [], 1) == "done" and compared.facts == ["the script's torch.distributed.all_gather after 0 forwards"]
    steps.forward("on")
    for own in ("healthcheck.measure.distributed", "torch.nn.modules._functions"):  # healthcheck's and torch's calls
        assert _call_from(own, gather, [], 1) == "done" and compared.facts[1:] == ["forward 1 (gradient sync on)"]
    assert _call_from("train", gather, [], 1, object()) == "done"  # another group: the ranks outside it skip it
    assert _call_from("train", gather, [], 1, group=object()) == "done" and compared.stopped == [DIFFER]  # the first's
    assert _call_from("train", gather, [], 1, group=torch.distributed.group.WORLD) == "done"
    assert compared.facts[-1] == "the script's torch.distributed.all_gather after 1 forward"
    assert compared.stopped == [DIFFER, DIFFER] and len(calls) == 7


def test_the_models_first_forward_is_compared_once_whatever_ran_before_it(monkeypatch):
    # A Trainer rank set not to gather its token count went to its first forward while the others gathered.
    compared = Compared(monkeypatch, differs=lambda fact: "all_gather" in fact)
    steps = compared.lockstep
    steps.first_forward()
    steps.first_forward()
    steps.first_update()
    steps.first_forward()
    assert compared.facts == ["the model's first forward", "optimizer step after 0 forwards"] and compared.stopped == []

"""Where the ranks compare their place before the first update (no process group: the comparison is replaced by a
fixed outcome per fact)."""

from __future__ import annotations

from types import SimpleNamespace

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


def test_ddp_training_forwards_say_whether_their_backward_reduces(monkeypatch):
    # A rank with its own accumulation runs its 2nd forward under no_sync while the others' 2nd all-reduces: DDP's
    # all-reduce met that rank's next collective and the ranks hung until distributed.timeout_s.
    compared = Compared(monkeypatch, differs=lambda fact: fact == "forward 2 (gradient sync off)")
    steps = compared.lockstep
    ddp = SimpleNamespace(require_backward_grad_sync=False)
    steps.ddp_forward(ddp, ())
    with torch.no_grad():  # an evaluation forward prepares no all-reduce: not a place the ranks must share
        steps.ddp_forward(ddp, ())
    assert compared.facts == ["forward 1 (gradient sync off)"] and compared.stopped == []
    steps.ddp_forward(ddp, ())
    assert compared.stopped == [DIFFER] and steps.fact == "forward 2 (gradient sync off)"


def test_nothing_is_compared_after_the_first_update(monkeypatch):
    compared = Compared(monkeypatch)
    steps = compared.lockstep
    steps.ddp_forward(SimpleNamespace(require_backward_grad_sync=True), ())
    steps.first_update()
    steps.first_update()
    steps.ddp_forward(SimpleNamespace(require_backward_grad_sync=True), ())
    steps.at("clip")
    assert compared.facts == ["forward 1 (gradient sync on)", "optimizer step after 1 forward"]


def test_the_scripts_collectives_on_the_default_group_are_compared_once_it_trains(monkeypatch):
    # accelerate's loop gathers every micro-batch's loss: the others' first update met the gather of a rank that
    # accumulates more, and gloo aborted on the sizes without naming it.
    compared = Compared(monkeypatch, differs=lambda fact: "all_gather" in fact)
    steps = compared.lockstep
    calls = []

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        calls.append(group)
        return "done"

    gather = compared_first(all_gather, "all_gather", lambda: steps)
    assert _call_from("train", gather, [], 1) == "done" and compared.facts == []  # before training: nothing to compare
    steps.forward("on")
    for own in ("healthcheck.measure.distributed", "torch.nn.modules._functions"):  # healthcheck's and torch's calls
        assert _call_from(own, gather, [], 1) == "done" and compared.facts == ["forward 1 (gradient sync on)"]
    assert _call_from("train", gather, [], 1, object()) == "done"  # another group: the ranks outside it skip it
    assert _call_from("train", gather, [], 1, group=object()) == "done" and compared.stopped == []
    assert _call_from("train", gather, [], 1, group=torch.distributed.group.WORLD) == "done"
    assert compared.facts[-1] == "the script's torch.distributed.all_gather after 1 forward"
    assert compared.stopped == [DIFFER] and len(calls) == 6

"""torch's composable ``replicate()`` handed to the session as the DDP it stands for
(healthcheck/integrations/script/replicated.py), in a one-rank gloo group."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from healthcheck.integrations.script import replicated
from healthcheck.integrations.script.patches import Patches

pytestmark = pytest.mark.unit
HOME = importlib.import_module("torch.distributed._composable.replicate")


def test_the_wrapper_hooks_run_around_ddps_forward_and_the_replay_runs_bare(one_rank):
    seen, events = [], []
    originals = (HOME.replicate, torch.distributed._composable.replicate)
    patches = Patches()
    replicated.patch(patches, seen.append)
    try:
        from torch.distributed._composable.replicate import replicate

        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        replicate(model)
        (ddp,) = seen
        assert ddp.module is model and [id(p) for p in ddp.parameters()] == [id(p) for p in model.parameters()]
        with pytest.raises(AttributeError, match="built at its first forward"):
            _ = ddp.ddp
        assert getattr(ddp, "require_backward_grad_sync", "unbuilt") == "unbuilt"  # as the session reads it
        ddp.register_forward_pre_hook(lambda inner, args: events.append(("wrapper pre", type(inner).__name__, replicated.building())))
        ddp.register_module_pre_hook(lambda module, args: events.append(("module pre", ddp.require_backward_grad_sync)))
        model.register_forward_pre_hook(lambda module, args: events.append(("model's own pre",)))
        ddp.register_forward_hook(lambda inner, args, output: events.append(("wrapper post",)))
        model(torch.ones(3, 4)).sum().backward()  # the first forward builds the DDP
        assert events == [("wrapper pre", "DistributedDataParallel", False), ("module pre", True), ("model's own pre",),
                          ("wrapper post",)]
        assert isinstance(ddp.ddp, DistributedDataParallel) and ddp.bucket_bytes_cap == ddp.ddp.bucket_bytes_cap
        model.set_requires_gradient_sync(False)  # replicate's accumulation: DDP's no_sync
        events.clear()
        model(torch.ones(3, 4))
        assert events[1] == ("module pre", False)
        events.clear()
        with ddp.bare():  # the replay's forward: neither DDP's hooks nor the wrapper's
            model(torch.ones(3, 4))
        assert events == [("model's own pre",)]
    finally:
        patches.restore()
    assert (HOME.replicate, torch.distributed._composable.replicate) == originals


def test_a_model_without_replicates_hooks_is_refused_on_one_line():
    # Another torch's replicate() could keep its hooks elsewhere: a clear exit 2, not a StopIteration in the script.
    from healthcheck.errors import InvalidInput

    state = HOME._ReplicateState()
    with pytest.raises(InvalidInput, match="DistributedDataParallel instead"):
        replicated.ReplicatedDDP(torch.nn.Linear(2, 2), state)

"""What a rank's training starts from: its optimizer's state and its parameters' bits (healthcheck/measure/start_state.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from healthcheck.measure.start_state import optimizer_state_fact, parameters_fact

pytestmark = pytest.mark.unit


def trained(steps: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-2}], lr=1e-3)
    for _ in range(steps):
        model(torch.ones(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def resumed(checkpoint: dict, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer loading ``checkpoint``, as each rank of a resumed run does."""
    model, optimizer = trained(0, seed)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
    return model, optimizer


def test_ranks_that_load_one_checkpoint_agree_and_a_stale_or_missing_state_differs():
    model, optimizer = trained(3)
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    stale_model, stale_optimizer = trained(2)
    ranks = [resumed(checkpoint, seed) for seed in range(3)]  # another initialisation, the same state once loaded
    facts = {optimizer_state_fact(opt) for _, opt in ranks}
    assert len(facts) == 1 and next(iter(facts)).startswith("step 3, 12 tensors, bits "), facts  # 4 tensors x 3 states
    assert len({parameters_fact(m) for m, _ in ranks}) == 1
    assert optimizer_state_fact(stale_optimizer).startswith("step 2, 12 tensors, bits ")
    assert parameters_fact(stale_model) != parameters_fact(ranks[0][0])
    assert optimizer_state_fact(trained(0)[1]) == "empty"  # a node that resumed without optimizer.pt
    # One moment off by one ulp: the same step count, another state.
    _, nudged = resumed(checkpoint)
    moment = nudged.state[next(iter(nudged.state))]["exp_avg"]
    moment.view(-1)[0] = torch.nextafter(moment.view(-1)[0], torch.tensor(1.0))
    assert optimizer_state_fact(nudged) != optimizer_state_fact(ranks[0][1])


def test_the_state_is_read_in_the_parameter_groups_order_not_in_the_order_it_was_filled():
    _, optimizer = trained(1)
    shuffled = dict(reversed(list(optimizer.state.items())))
    before = optimizer_state_fact(optimizer)
    optimizer.state.clear()
    optimizer.state.update(shuffled)
    assert optimizer_state_fact(optimizer) == before


# ZeroRedundancyOptimizer scripts its helpers with torch.jit, which torch 2.13 deprecates: not this test's subject.
@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_a_state_each_rank_holds_a_part_of_gives_no_fact(one_rank):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.Linear(4, 2)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    zero.step()
    assert optimizer_state_fact(zero) is None  # ZeroRedundancyOptimizer: each rank steps its own partition
    sharded = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    adam = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    sharded(torch.ones(2, 4)).sum().backward()
    adam.step()
    assert optimizer_state_fact(adam) is None and parameters_fact(sharded) is None  # FSDP2's DTensor shards


def test_a_history_of_tensors_is_hashed_item_by_item():
    # L-BFGS keeps lists of tensors: each is hashed, so one changed element changes the fact.
    weight = torch.nn.Parameter(torch.ones(3))
    lbfgs = torch.optim.LBFGS([weight], history_size=3)
    lbfgs.step(lambda: (weight.square().sum().backward(), weight.square().sum())[1])
    before = optimizer_state_fact(lbfgs)
    history = lbfgs.state[weight]["old_dirs"]
    assert history and " tensors, bits " in before, before
    history[0].view(-1)[0] += 1.0
    assert optimizer_state_fact(lbfgs) != before

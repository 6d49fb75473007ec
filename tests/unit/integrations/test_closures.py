"""``optimizer.step(closure)``: the session's pre-step work runs after the closure's backward, before the update
(healthcheck/integrations/script/closures.py), with torch's own optimizers calling the hooks."""

from __future__ import annotations

import pytest
import torch

from healthcheck.integrations.script.closures import ClosureSteps

pytestmark = pytest.mark.unit


@pytest.fixture
def events():
    """(event, what the parameter's gradient and value were then), with the hooks installed globally."""
    log: list[tuple] = []
    param = torch.nn.Parameter(torch.ones(2))

    def seen(name):
        return lambda opt, args, kwargs: log.append((name, None if param.grad is None else param.grad.tolist(), param.tolist()))

    handles = ClosureSteps(seen("pre"), seen("post")).register()
    yield log, param
    for handle in handles:
        handle.remove()


def _closure(param, log):
    def closure():
        log.append(("closure",))
        param.grad = None
        (param * 3).sum().backward()
        return torch.tensor(0.5)

    return closure


@pytest.mark.parametrize("positional", [False, True])
def test_the_pre_step_sees_the_closures_gradient_before_the_update(events, positional):
    log, param = events
    sgd = torch.optim.SGD([param], lr=0.1)
    closure = _closure(param, log)
    loss = sgd.step(closure) if positional else sgd.step(closure=closure)
    assert float(loss) == 0.5
    assert log == [("closure",), ("pre", [3.0, 3.0], [1.0, 1.0]), ("post", [3.0, 3.0], [pytest.approx(0.7)] * 2)], log


def test_without_a_closure_the_pre_step_runs_at_once(events):
    log, param = events
    sgd = torch.optim.SGD([param], lr=0.1)
    (param * 3).sum().backward()
    sgd.step()
    assert [event[0] for event in log] == ["pre", "post"]


def test_a_subclass_that_steps_its_base_class_gets_both_pre_steps_before_either_post(events):
    # Each class's step() fires the global hooks; the inner one receives the outer's wrapped closure.
    class Wrapped(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    log, param = events
    Wrapped([param], lr=0.1).step(_closure(param, log))
    assert [event[0] for event in log] == ["closure", "pre", "pre", "post", "post"], log


def test_an_optimizer_that_never_calls_its_closure_still_pairs_every_post_with_a_pre(events):
    class Ignores(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            return None

    log, param = events
    Ignores([param], lr=0.1).step(_closure(param, log))
    assert [event[0] for event in log] == ["pre", "post"], log


def test_a_compiled_optimizer_step_runs_the_hooks_eagerly():
    # PyTorch's compiled-optimizer recipe compiles a function that calls opt.step(): dynamo traced the global step
    # hooks with it, and the session's step work (floats read from tensors, hashes, collectives on the process
    # group) broke the graph and then crashed every rank at step 0 (`healthcheck probe --script` of such a loop).
    seen: list[tuple[str, bool, float]] = []
    param = torch.nn.Parameter(torch.ones(2))

    def record(name):
        return lambda opt, args, kwargs: seen.append((name, torch.compiler.is_compiling(), float(param.sum())))

    handles = ClosureSteps(record("pre"), record("post")).register()
    sgd = torch.optim.SGD([param], lr=0.1)

    @torch.compile(fullgraph=False, backend="eager")
    def step():
        sgd.step()

    torch._dynamo.reset()
    try:
        param.grad = torch.full((2,), 3.0)
        step()
    finally:
        for handle in handles:
            handle.remove()
        torch._dynamo.reset()
    assert seen == [("pre", False, 2.0), ("post", False, pytest.approx(1.4))], seen
    assert param.tolist() == [pytest.approx(0.7)] * 2

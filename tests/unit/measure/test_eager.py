"""Hooks wrapped in ``eager`` stay out of a compiled model's graph and guards."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from healthcheck.measure.eager import eager

KEPT: dict[str, torch.Tensor] = {}


def keep_first(x):
    """A hook that keeps the first batch it sees, as the replay audit's does."""
    if "batch" not in KEPT:
        KEPT["batch"] = x


def frames_compiled(hook) -> int:
    KEPT.clear()
    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(lambda x: (hook(x), x * 2)[1], backend=counter)
    step(torch.ones(2))
    step(torch.ones(2))
    assert torch.equal(KEPT["batch"], torch.ones(2))  # the hook ran, with the real tensor
    return counter.frame_count


def test_a_traced_hook_recompiles_the_step_when_its_state_changes_and_an_eager_one_does_not():
    try:
        assert frames_compiled(keep_first) == 2
        assert frames_compiled(eager(keep_first)) == 1
    finally:
        torch._dynamo.reset()


def test_an_eager_partial_runs_outside_the_compiled_function_that_calls_it():
    # The callbacks healthcheck makes at each forward or step (tensor hooks, queued callbacks) are partials of one
    # eager function: a compiled training step that runs them must not trace them.
    from healthcheck.measure.eager import eager_partial

    seen: list[tuple[str, bool]] = []

    def record(tag, x):
        seen.append((tag, torch.compiler.is_compiling()))

    torch._dynamo.reset()
    try:
        step = torch.compile(lambda x: (eager_partial(record, "eager")(x), record("traced", x), x * 2)[2], backend="eager")
        assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        torch._dynamo.reset()
    assert ("eager", False) in seen and ("traced", True) in seen, seen

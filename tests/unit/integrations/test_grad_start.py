"""The reading of whether a step's first backward found the last step's gradients (script mode's stale-gradients audit)."""

import torch

from healthcheck.integrations.script.grad_start import WATCHED, GradientStart


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _loss(model):
    return model(torch.randn(3, 4)).pow(2).sum()


def _run(model, start, clear, micro_batches=1, clear_after_forward=False):
    """One optimizer step the way a script writes it; the reading the optimizer step takes."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if clear == "none" and not clear_after_forward:
        optimizer.zero_grad(set_to_none=True)
    elif clear == "zero" and not clear_after_forward:
        optimizer.zero_grad(set_to_none=False)
    for _ in range(micro_batches):
        loss = _loss(model)
        if clear and clear_after_forward:  # forward, zero_grad, backward: the order some tutorials use
            optimizer.zero_grad(set_to_none=clear == "none")
        loss.backward()
    reading = start.take()
    optimizer.step()
    start.armed_after_step()
    return reading


def test_each_way_of_clearing_reads_cleared_and_not_clearing_reads_carried():
    model = _model()
    start = GradientStart(model)
    start.attach(model)
    readings = [_run(model, start, clear) for clear in ("none", "none", "zero", "", "none")]
    readings.append(_run(model, start, "none", clear_after_forward=True))
    readings.append(_run(model, start, "", clear_after_forward=True))
    assert readings == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_accumulation_within_a_step_is_not_carrying():
    model = _model()
    start = GradientStart(model)
    start.attach(model)
    assert [_run(model, start, "none", micro_batches=3) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_a_backward_before_training_left_uncleared_is_carried_into_the_first_step():
    model = _model()
    _loss(model).backward()  # a rank that checks gradients flow, and never clears them
    start = GradientStart(model)
    start.attach(model)
    assert _run(model, start, "") == 1.0


def test_forwards_without_backward_and_backwards_between_steps_are_not_read():
    model = _model()
    start = GradientStart(model)
    start.attach(model)
    model(torch.randn(2, 4))  # a sanity forward with autograd on, never backwarded
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert _run(model, start, "none") == 0.0
    model.zero_grad()
    _loss(model).backward()  # the next step's training backward
    assert start.take() == 0.0  # its optimizer step
    # Between the step's reading and the next arming (the replay audit runs there), a backward is not read.
    _loss(model).backward()
    start.armed_after_step()
    assert start.take() is None  # no backward reached the model's output in the step after


def test_after_the_first_step_a_few_of_the_smallest_parameters_are_watched():
    model = _model()
    start = GradientStart(model)
    start.attach(model)
    _run(model, start, "none")
    watched = start._watched
    assert watched is not None and len(watched) == WATCHED
    sizes = sorted(p.numel() for p in model.parameters())
    assert sorted(p.numel() for p in watched) == sizes[:WATCHED]

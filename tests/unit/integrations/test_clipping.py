"""The clipping patch: a script's calls reach the recorder, and clip exactly as they would unpatched."""

from __future__ import annotations

import torch

from healthcheck.integrations.script import clipping
from healthcheck.integrations.script.clipping import ClipRecorder
from healthcheck.integrations.script.patches import Patches


def _model_with_grads() -> torch.nn.Linear:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    return model


def test_a_clip_through_the_patch_is_recorded_and_clips_as_the_original():
    model, reference = _model_with_grads(), _model_with_grads()
    recorder = ClipRecorder(lambda: {id(p) for p in model.parameters()})
    patches = Patches()
    clipping.patch(patches, recorder.observe)
    try:
        # A generator, as scripts pass it: the patch must not use it up before torch clips.
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=1.0)
        torch.nn.utils.clip_grad.clip_grad_value_(model.parameters(), clip_value=0.01)
    finally:
        patches.restore()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type=1.0)
    torch.nn.utils.clip_grad_value_(reference.parameters(), clip_value=0.01)
    assert torch.equal(total, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert recorder.facts() == {"clip": "clip_grad_norm_ max_norm=0.5 norm_type=1 | clip_grad_value_ clip_value=0.01"}
    assert torch.nn.utils.clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_  # both homes restored alike


def test_only_the_trained_models_parameters_count_and_no_clip_is_a_fact():
    model, other = _model_with_grads(), _model_with_grads()
    recorder = ClipRecorder(lambda: {id(p) for p in model.parameters()})
    recorder.observe("clip_grad_norm_", list(other.parameters()), (0.1,), {})  # another model: not compared
    assert recorder.facts() == {"clip": "none"}
    recorder = ClipRecorder(lambda: {id(p) for p in model.parameters()})
    recorder.observe("clip_grad_norm_", [model.weight], (torch.tensor(1.0), float("inf")), {})
    assert recorder.facts() == {"clip": "clip_grad_norm_ max_norm=1 norm_type=inf"}


def test_a_clip_in_two_calls_reads_as_the_one_call_and_clips_as_the_original():
    # accelerate (1.16 and later, for every model) and torchtitan clip by the norm in two calls: get_total_norm of the
    # gradients, then clip_grads_with_norm_. The pair is torch's clip_grad_norm_ and must read alike.
    model, reference = _model_with_grads(), _model_with_grads()
    recorder = ClipRecorder(lambda: {id(p) for p in model.parameters()}, lambda: clipping.grad_ids(model))
    patches = Patches()
    clipping.patch(patches, recorder.observe)
    try:
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], 3.0)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.25, total)
    finally:
        patches.restore()
    assert torch.equal(total, torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.25, norm_type=3.0))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert recorder.facts() == {"clip": "clip_grad_norm_ max_norm=0.25 norm_type=3"}


def test_a_norm_only_logged_is_no_clip_and_another_models_norm_is_not_read():
    model, other = _model_with_grads(), _model_with_grads()
    recorder = ClipRecorder(lambda: {id(p) for p in model.parameters()}, lambda: clipping.grad_ids(model))
    assert not recorder.observe("get_total_norm", [p.grad for p in other.parameters()], (1.0,), {})
    assert recorder.observe("get_total_norm", [p.grad for p in model.parameters()], (), {})  # logged, never clipped
    assert recorder.facts() == {"clip": "none"}


def test_a_clip_compiled_with_the_optimizer_step_is_recorded_and_clips_as_the_original():
    # PyTorch's compiled-optimizer recipe with the clip in the compiled function: traced, the recorder saw fake
    # tensors, matched no parameter of the model, and the clip read `none`.
    model, reference = _model_with_grads(), _model_with_grads()
    recorder = ClipRecorder(lambda: {id(p) for p in model.parameters()})
    patches = Patches()
    clipping.patch(patches, recorder.observe)
    torch._dynamo.reset()
    try:
        step = torch.compile(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5), backend="eager")
        total = step()
    finally:
        patches.restore()
        torch._dynamo.reset()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    assert torch.allclose(total, expected)
    assert all(torch.allclose(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert recorder.facts() == {"clip": "clip_grad_norm_ max_norm=0.5 norm_type=2"}, recorder.facts()

"""The other models a script runs before its first update (healthcheck/integrations/script/other_models.py)."""

from __future__ import annotations

import pytest
import torch

from healthcheck.integrations.script.other_models import OtherModels

pytestmark = pytest.mark.unit


def test_the_models_that_ran_are_compared_and_the_others_not():
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Linear(2, 2))
    teacher = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))  # its submodule is called, not itself
    reward_a, reward_b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)  # two of a class: numbered
    unused = torch.nn.Linear(2, 2)  # built (with this rank's randomness, say) and never run
    on_meta = torch.nn.Linear(2, 2, device="meta")
    others = OtherModels()
    others.watch(student)
    with torch.no_grad():
        teacher[0](torch.ones(1, 2))
        reward_a(torch.ones(1, 2))
        reward_b(torch.ones(1, 2))
        on_meta(torch.ones(1, 2, device="meta"))
    student(torch.ones(1, 2))
    facts = others.facts()
    assert set(facts) == {"other_model.Sequential", "other_model.Linear", "other_model.Linear#2"}, facts
    assert facts["other_model.Sequential"].startswith("4 tensors, bits ")
    # Unhooked at the first update: later forwards change nothing, and nothing is held on to.
    assert all(not module._forward_pre_hooks for root in (teacher, reward_a, unused) for module in root.modules())
    assert others.facts() == {}
    del unused


def test_a_model_sharing_parameters_with_the_trained_one_is_no_other_model():
    student = torch.nn.Linear(2, 2)
    wrapper = torch.nn.Sequential(student)  # a wrapper of the trained model (DDP's, torch.compile's)
    others = OtherModels()
    others.watch(student)
    wrapper(torch.ones(1, 2))
    assert others.facts() == {}


def test_a_model_let_go_of_before_the_first_update_is_freed_not_kept():
    import gc
    import weakref

    student, teacher = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    others = OtherModels()
    others.watch(student)
    teacher(torch.ones(1, 2))  # its logits kept, the teacher freed (on a GPU, its memory)
    gone = weakref.ref(teacher)
    del teacher
    gc.collect()
    assert gone() is None and others.facts() == {}

"""Training healthcheck cannot measure is refused on one line (healthcheck/integrations/script/refusals.py):
DeepSpeed's engine at its construction, once the script imported it, and a step without a DDP or FSDP2 model."""

from __future__ import annotations

import sys
import types

import pytest

from healthcheck.errors import InvalidInput
from healthcheck.integrations.script import refusals
from healthcheck.integrations.script.patches import Patches

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """``deepspeed.runtime.engine`` as ``import deepspeed`` leaves it: an engine class whose construction records it."""
    built = []

    class DeepSpeedEngine:
        def __init__(self, model):
            built.append(model)

    class PipelineEngine(DeepSpeedEngine):  # DeepSpeed's other engines build their base class
        pass

    module = types.ModuleType(refusals.DEEPSPEED_ENGINE)
    module.DeepSpeedEngine = DeepSpeedEngine
    monkeypatch.setitem(sys.modules, refusals.DEEPSPEED_ENGINE, module)
    return DeepSpeedEngine, PipelineEngine, built


def test_deepspeeds_engine_is_refused_before_it_is_built_and_restored_after(fake_deepspeed):
    engine, pipeline, built = fake_deepspeed
    patches = Patches()
    refusals.refuse_deepspeed(patches)
    refusals.refuse_deepspeed(patches)  # the script's second process group (or a re-init) wraps nothing twice
    for kind in (engine, pipeline):
        with pytest.raises(InvalidInput, match="DeepSpeed's engine") as raised:
            kind("model")
        assert "\n" not in str(raised.value) and refusals.MEASURED in str(raised.value)
    assert built == []
    patches.restore()
    engine("model")
    assert built == ["model"]


def test_without_deepspeed_nothing_is_wrapped(monkeypatch):
    monkeypatch.delitem(sys.modules, refusals.DEEPSPEED_ENGINE, raising=False)
    patches = Patches()
    refusals.refuse_deepspeed(patches)
    assert patches._saved == []


@pytest.mark.parametrize(
    ("world_size", "workers", "modules", "says"),
    [
        (2, 2, ["torch", refusals.DEEPSPEED_ENGINE], "DeepSpeed's engine"),  # an engine that started its own process group
        (8, 8, ["torch"], "with 8 workers but no DistributedDataParallel or FSDP2"),
        # A torch.distributed.launch script that goes distributed only when given --local_rank.
        (1, 8, ["torch"], "without a process group, as 1 of 8 workers (WORLD_SIZE)"),
        (1, 1, ["torch"], "a single-process script has no workers to compare"),
    ],
)
def test_a_step_without_a_measured_model_says_what_the_script_did(world_size, workers, modules, says):
    message = refusals.no_model_message(world_size, modules, workers)
    assert says in message and "\n" not in message


def test_fsdp2s_replicate_is_refused_before_it_replicates_and_restored_after():
    # FSDP2's all-reducing sibling: it was told "no DistributedDataParallel or FSDP2 model ... wrap it in DDP".
    import torch
    import torch.distributed._composable.replicate_with_fsdp as fsdp_replicate

    from healthcheck.integrations.script.patches import install
    from tests.unit.integrations.test_observe import Session

    original = fsdp_replicate.replicate
    patches = install(Session())
    try:
        with pytest.raises(InvalidInput, match="replicate_with_fsdp") as raised:
            fsdp_replicate.replicate(torch.nn.Linear(2, 2))
        assert refusals.MEASURED in str(raised.value) and "\n" not in str(raised.value)
    finally:
        patches.restore()
    assert fsdp_replicate.replicate is original

"""A running transformers Trainer's arguments as environment facts (healthcheck/integrations/script/trainer_args.py)."""

from __future__ import annotations

import pytest
import torch

from healthcheck.integrations.script.trainer_args import trainer_args_facts

pytestmark = pytest.mark.unit


def test_the_trainer_below_the_call_gives_its_arguments_but_not_its_folders(tmp_path):
    from transformers import Trainer, TrainingArguments

    class Probed(Trainer):
        def read(self):  # as the optimizer step's hook runs, below the Trainer's training loop
            return (lambda: trainer_args_facts())()

    args = TrainingArguments(output_dir=str(tmp_path / "rank-0"), use_cpu=True, report_to=[], lr_scheduler_type="cosine",
                             neftune_noise_alpha=5.0, resume_from_checkpoint=str(tmp_path / "node-1" / "checkpoint-3"))
    facts = Probed(model=torch.nn.Linear(2, 2), args=args).read()
    assert facts["trainer.lr_scheduler_type"] == "cosine" and facts["trainer.neftune_noise_alpha"] == "5.0", facts
    assert facts["trainer.learning_rate"] == "5e-05" and facts["trainer.seed"] == "42"
    assert not any(name.endswith("_dir") or name in ("trainer.run_name", "trainer.ddp_find_unused_parameters") for name in facts)
    # The checkpoint's path names a node's files; the step the Trainer resumed at is compared instead.
    assert "trainer.resume_from_checkpoint" not in facts and facts["trainer.state.global_step"] == "0"
    assert trainer_args_facts() == {}  # no Trainer below this test

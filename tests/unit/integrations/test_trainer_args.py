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


def test_what_only_the_main_process_shows_or_reports_is_no_fact(tmp_path):
    # report_to="wandb" if local_rank == 0 else "none", disable_tqdm=local_rank != 0, a log level per rank: common
    # habits of clean scripts, which changed no batch, loss or update and failed the probe (exit 1).
    import warnings

    from transformers import Trainer, TrainingArguments
    from trl import GRPOConfig, SFTConfig

    from healthcheck.integrations.script.trainer_args import PRESENTATION_ONLY

    class Probed(Trainer):
        def read(self):
            return trainer_args_facts()

    def facts(**kwargs):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)
        return Probed(model=torch.nn.Linear(2, 2), args=args).read()

    main = facts(disable_tqdm=False, log_level="info", skip_memory_metrics=False, dataloader_num_workers=2)
    replica = facts(disable_tqdm=True, log_level="warning", skip_memory_metrics=True, dataloader_num_workers=0)
    assert main == replica and not {f"trainer.{name}" for name in PRESENTATION_ONLY} & set(main), sorted(main)
    # What the loop does with the loss stays: the Trainer gathers it from every rank at each logging step.
    assert facts(logging_steps=1)["trainer.logging_steps"] != facts(logging_steps=2)["trainer.logging_steps"]
    assert {"trainer.logging_steps", "trainer.save_strategy", "trainer.push_to_hub", "trainer.dataloader_drop_last"} <= set(main)
    with warnings.catch_warnings():  # TRL's own default, gradient_checkpointing, is deprecated by transformers 5
        warnings.simplefilter("ignore", FutureWarning)
        known = {name for config in (SFTConfig, GRPOConfig)  # TrainingArguments' fields and TRL's own
                 for name in config(output_dir=str(tmp_path), use_cpu=True).to_dict()}
    assert PRESENTATION_ONLY <= known, PRESENTATION_ONLY - known  # a field renamed by transformers or TRL would be compared again

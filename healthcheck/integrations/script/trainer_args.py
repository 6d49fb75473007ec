"""The arguments of the ``transformers.Trainer`` a script trains with, one environment fact each (``trainer.<field>``).

TRL's trainers are Trainers and their configs ``TrainingArguments`` (``SFTConfig``, ``DPOConfig``, ``GRPOConfig``). A
rank whose node runs with a config of its own differs in one of them, and most differences reach the gradients only
through a symptom, or not at all within a probe: on 4 ranks of TRL's ``GRPOTrainer`` (8 generations a prompt), one
rank's ``loss_type="dr_grpo"``, ``scale_rewards="none"``, ``max_completion_length=8`` or ``top_p=0.5`` each passed
every audit; its ``temperature=0.5`` was taken by the replay audit for a device computing wrong, and a Trainer
rank's ``lr_scheduler_type="cosine"`` was named a step later by the learning rate and the parameters, without the
setting. Compared as facts at the first step, each is named by its field: ``trainer.top_p differs: ranks 0-1, 3 1.0;
rank 2 0.5``.

The Trainer is the ``self`` of a frame below the first optimizer step (its training loop calls the step): no patch
of transformers, and nothing is imported. Fields that name this rank's files, not how it trains (``output_dir``, a
temporary folder per rank in many scripts, and the other ``*_dir`` fields, and ``resume_from_checkpoint``), are left
out (:data:`NOT_COMPARED`), and so are those that change only what a rank prints or reports
(:data:`PRESENTATION_ONLY`). What a resumed checkpoint holds is compared instead: the step the Trainer resumed at
(``trainer.state.global_step``; a node whose copy of ``trainer_state.json`` is stale skips other batches and stops
at another step), the optimizer's state and the parameters (:mod:`healthcheck.measure.start_state`).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

from healthcheck.integrations.script.call_stack import callers

#: Fields left out: those that name this rank's place or files (any ``*_dir`` field too), and the DDP settings the
#: environment audit compares as DDP resolved them (``ddp.*``): the Trainer turns ``None`` into a value of its own, so
#: one rank's ``ddp_find_unused_parameters=True`` among ranks with ``None`` builds the same DDP (checked by hand).
#: ``ddp_timeout`` changes no collective, only how long one waits.
NOT_COMPARED = frozenset({"run_name", "local_rank", "hub_token", "push_to_hub_token", "ddp_find_unused_parameters",
                          "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_timeout", "resume_from_checkpoint"})

#: Fields that change only what a rank prints or reports, or how fast it reads: scripts set them per rank on purpose
#: (``report_to="wandb" if local_rank == 0 else "none"``, ``disable_tqdm=local_rank != 0``, a log level per rank,
#: DataLoader workers per node's cores, whether they persist and how they start, TRL's ``dataset_num_proc``; GRPO
#: prints and logs its completions from the main process alone, after gathering them on every rank whatever these
#: say), and a clean Trainer with ``disable_tqdm=local_rank != 0`` failed as ``trainer.disable_tqdm differs`` (exit 1).
#: None of them runs a collective or touches a batch, a loss or an update: every reporting callback of transformers
#: acts on the main process alone, the memory tracker only reads, TRL tokenizes alike with any number of processes,
#: and what the DataLoader yields is judged by the data audit. Logging steps stay compared (the Trainer gathers the
#: loss from every rank at each), and so do saving and ``push_to_hub`` (a save can gather a sharded model).
PRESENTATION_ONLY = frozenset({
    "disable_tqdm", "report_to", "log_level", "log_level_replica", "log_on_each_node", "skip_memory_metrics", "project",
    "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_prefetch_factor", "dataloader_persistent_workers", "dataloader_multiprocessing_context",
    "dataset_num_proc", "log_completions", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo"})

#: A value's text kept whole up to this many characters; a longer one (a config dict) ends in a digest of the rest.
_LONGEST = 160


def trainer_args_facts() -> dict[str, str]:
    """``trainer.<field>`` for each of the running Trainer's arguments; empty where no Trainer is training.

    >>> trainer_args_facts()  # no transformers Trainer below this call
    {}
    """
    trainer = _running_trainer()
    args = getattr(trainer, "args", None)
    to_dict = getattr(args, "to_dict", None)
    if not callable(to_dict):
        return {}
    try:
        fields = to_dict()
    except Exception:  # noqa: BLE001 - an argument class of another transformers: no facts rather than no probe
        return {}
    facts = {f"trainer.{name}": _text(value) for name, value in sorted(fields.items())
             if name not in NOT_COMPARED and name not in PRESENTATION_ONLY and not name.endswith("_dir")}
    step = getattr(getattr(trainer, "state", None), "global_step", None)
    if step is not None:
        facts["trainer.state.global_step"] = str(step)
    return facts


def _running_trainer() -> Optional[Any]:
    """The ``transformers.Trainer`` whose method is on the call stack, if transformers' trainer module is loaded."""
    module = sys.modules.get("transformers.trainer")
    trainer_class = getattr(module, "Trainer", None)
    if trainer_class is None:
        return None
    return next((caller for caller in callers() if isinstance(caller, trainer_class)), None)


def _text(value: Any) -> str:
    """A field's value as the facts compare it: scalars as ``str``, containers as sorted JSON, long ones digested.

    >>> _text(0.5), _text("cosine"), _text(None), _text({"b": 1, "a": [2]})
    ('0.5', 'cosine', 'None', '{"a": [2], "b": 1}')
    >>> _text("x" * 400)[-40:]
    'xxxx... (400 chars, sha256 7b0bd700ce06)'
    """
    import hashlib

    if isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, sort_keys=True, default=str)
    else:
        text = str(value)
    if len(text) <= _LONGEST:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{text[:_LONGEST - 40]}... ({len(text)} chars, sha256 {digest})"

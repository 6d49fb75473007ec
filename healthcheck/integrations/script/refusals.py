"""What a script that trains in a way healthcheck cannot measure is told: one line, exit 2, as early as it is known.

healthcheck measures the gradients that DistributedDataParallel's buckets and FSDP2's per-parameter reduce-scatters
carry. Three other ways of training on several workers reduce gradients where neither is: FSDP1's flat parameters,
DeepSpeed's engine (ZeRO buckets of its own), and a loop that averages each ``.grad`` with ``dist.all_reduce`` itself
(PyTorch's "Writing Distributed Applications" tutorial). Each used to reach its first optimizer step and be told that
it had no distributed model and that "a single-process script has no workers to compare", which named none of them.

FSDP1 and DeepSpeed are refused when their wrapper is built, before it shards or partitions anything
(:func:`refuse_deepspeed` wraps DeepSpeed's engine once the script's process group exists: ``deepspeed`` is
imported by then, by the script or by accelerate, and importing it here would cost every probe seconds). A script
whose engine starts its own process group, or that averages its gradients itself, is told at its first step
(:func:`no_model_message`); so is one that makes no process group at all though it runs as one of several workers (a
script written for ``torch.distributed.launch``, which goes distributed only when given ``--local_rank``).

>>> "DeepSpeed" in no_model_message(world_size=2, modules=["deepspeed.runtime.engine"])
True
>>> no_model_message(world_size=4, modules=[]).startswith("the script stepped an optimizer with 4 workers")
True
>>> "single-process" in no_model_message(world_size=1, modules=[])
True
>>> print(no_model_message(world_size=1, modules=[], workers=8).split(";")[0])
the script stepped an optimizer without a process group, as 1 of 8 workers (WORLD_SIZE)
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable

from healthcheck.errors import InvalidInput

#: What healthcheck measures, as every refusal names it.
MEASURED = ("DistributedDataParallel (also torch.distributed._composable.replicate) and FSDP2 (torch.distributed.fsdp.fully_shard; "
            "with accelerate, fsdp_version: 2)")

#: What a script that wraps its model in FSDP1 is told (exit 2, before any rank shards it).
FSDP1_REFUSED = (
    f"the script wraps its model in FullyShardedDataParallel (FSDP1), which healthcheck does not measure: it measures {MEASURED}"
)

#: What a script that makes its model data-parallel with FSDP2's replicate is told (exit 2, before it replicates).
REPLICATE_WITH_FSDP_REFUSED = (
    "the script makes its model data-parallel with torch.distributed._composable.replicate_with_fsdp (FSDP2's machinery, "
    f"all-reducing), which healthcheck does not measure: it measures {MEASURED}"
)

#: What a script that trains through DeepSpeed is told (exit 2; at ``deepspeed.initialize`` where it can be).
DEEPSPEED_REFUSED = (
    "the script trains through DeepSpeed's engine (deepspeed.initialize, or a DeepSpeed config given to transformers "
    "or accelerate), which reduces the gradients in buckets of its own; healthcheck does not measure it: it measures "
    f"{MEASURED}"
)

#: The module that defines DeepSpeed's engine; ``import deepspeed`` imports it.
DEEPSPEED_ENGINE = "deepspeed.runtime.engine"


def no_model_message(world_size: int, modules: Iterable[str], workers: int = 1) -> str:
    """Why a script that stepped an optimizer before training a DDP or FSDP2 model cannot be probed. ``world_size``:
    its process group's (1 without one); ``workers``: how many the launcher started (``WORLD_SIZE``)."""
    if DEEPSPEED_ENGINE in set(modules):
        return DEEPSPEED_REFUSED
    if world_size == 1 and workers > 1:
        # torch.distributed.launch passed --local_rank; torchrun and healthcheck set LOCAL_RANK, and a script that
        # goes distributed only when given the argument trains alone on every worker.
        return (
            f"the script stepped an optimizer without a process group, as 1 of {workers} workers (WORLD_SIZE); it must call "
            "torch.distributed.init_process_group and wrap its model in DistributedDataParallel or FSDP2. A script written "
            "for torch.distributed.launch, which goes distributed only when given --local_rank, reads LOCAL_RANK from the "
            "environment under torchrun and healthcheck"
        )
    if world_size > 1:
        return (
            f"the script stepped an optimizer with {world_size} workers but no DistributedDataParallel or FSDP2 "
            "(fully_shard) model; healthcheck measures the gradients those reduce, and a loop that averages its "
            "gradients itself (dist.all_reduce on each .grad) hides each worker's own: wrap the model in "
            "DistributedDataParallel"
        )
    return (
        "the script stepped an optimizer before training a DistributedDataParallel or FSDP2 (fully_shard) model; "
        "healthcheck attaches to those, and a single-process script has no workers to compare"
    )


def refuse_no_model() -> InvalidInput:
    """:func:`no_model_message` for this process: its process group's size and the modules it imported."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    workers = os.environ.get("WORLD_SIZE", "1")
    return InvalidInput(no_model_message(world, list(sys.modules), int(workers) if workers.isdigit() else 1))


def refuse_step_before_forward() -> InvalidInput:
    """The script stepped the optimizer of its DDP model, which never ran a forward: no gradient was reduced."""
    return InvalidInput(
        "the script stepped its optimizer before a forward through its DistributedDataParallel model; "
        "healthcheck measures the gradients DDP reduces, so call the DDP model, not its .module"
    )


def refuse_deepspeed(patches: Any) -> None:
    """Refuse DeepSpeed's engine at its construction, if the script imported DeepSpeed; once per process."""
    engine = sys.modules.get(DEEPSPEED_ENGINE)
    owner = getattr(engine, "DeepSpeedEngine", None)
    if owner is None or patches.holds(owner, "__init__"):
        return

    def refuse(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            raise InvalidInput(DEEPSPEED_REFUSED)

        return __init__

    patches.wrap(owner, "__init__", refuse)

"""``distributed.strategy``: wrap the probe's model for data parallelism, DDP replicas or FSDP2 shards.

FSDP2 is applied the way torchtitan and accelerate apply it to a transformer: ``fully_shard`` on every
transformer block (the classes a transformers model names in ``_no_split_modules``), then on the root,
which takes the embeddings, the final norm and the head.
"""

from __future__ import annotations

import contextlib
from typing import Any

from healthcheck.config import DistributedConfig
from healthcheck.errors import InvalidInput
from healthcheck.measure.fsdp_internals import is_fsdp_module


def wrap_model(model: Any, config: DistributedConfig, device: Any, world_size: int) -> Any:
    """The model as the strategy trains it: a DDP replica, or the FSDP2 root (``model`` itself, sharded)."""
    if config.strategy == "fsdp":
        return fully_shard_blocks(model, device, world_size, config.replicas)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=config.bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
    )


def transformer_blocks(model: Any) -> list[Any]:
    """The modules whose class the model names as its blocks (``_no_split_modules``), in module order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def fully_shard_blocks(model: Any, device: Any, world_size: int, replicas: int = 1) -> Any:
    """FSDP2 on every block, then the root; with ``replicas`` > 1, HSDP: a (replicas, world / replicas) mesh, the
    first dimension replicated, the second sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    blocks = transformer_blocks(model)
    if not blocks:
        raise InvalidInput(
            f"distributed.strategy: fsdp needs a model that names its transformer blocks "
            f"(_no_split_modules); {type(model).__name__} names none"
        )
    if world_size % replicas:
        raise InvalidInput(f"distributed.replicas: {replicas} does not divide the world size {world_size}")
    if replicas > 1:
        mesh = init_device_mesh(device.type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world_size,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sync_context(model: Any, is_last: bool) -> Any:
    """Reduce gradients only on the last micro-batch of an optimizer step: ``no_sync`` for DDP,
    ``set_requires_gradient_sync`` for FSDP2 (whose default would reduce-scatter every micro-batch)."""
    if is_fsdp_module(model):
        model.set_requires_gradient_sync(is_last)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if is_last else model.no_sync()


def trained_module(model: Any) -> Any:
    """The module whose parameters are trained: DDP's ``.module``, or the FSDP2 root itself."""
    return model if is_fsdp_module(model) else getattr(model, "module", model)

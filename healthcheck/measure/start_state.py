"""What a rank's training starts from, read before its first update: the optimizer's state and the parameters' bits.

A resumed run loads both on every rank. DDP broadcasts rank 0's parameters when it wraps the model, but never the
optimizer's state: a node whose copy of the checkpoint is stale or incomplete (a ``transformers.Trainer`` skips a
missing ``optimizer.pt`` without a word) steps with other Adam moments from the first update on, and parameters
loaded after the wrap (``accelerator.load_state``, or PyTorch's DDP tutorial loading ``ddp_model.load_state_dict``)
are never broadcast at all. Each became visible only a step later, as parameters that parted, and the advice blamed
a learning rate. As environment facts (``optimizer.state``, ``model.parameters``) they are named before anything moves:
``optimizer.state differs: ranks 0, 2-3 step 3, 63 tensors, bits 2f1c...; rank 1 empty``.

The bits are :func:`~healthcheck.measure.bit_hash.tensor_bit_hash`'s, on the tensors' device: one pass over the
state, once per probe. A sharded state (FSDP2's DTensors, ``ZeroRedundancyOptimizer``'s partitions) differs between
ranks by design and gives no fact; FSDP2's sharded audit compares its optimizer's step count instead.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Optional

#: Optimizers whose state each rank holds a part of: the parts differ by design.
PARTITIONED = frozenset({"ZeroRedundancyOptimizer"})


def optimizer_state_fact(optimizer: Any) -> Optional[str]:
    """``empty`` for an optimizer that has not stepped, else its step count, state tensors and their bits; None
    where each rank holds only its part of the state.

    >>> import torch
    >>> weight = torch.nn.Parameter(torch.ones(3))
    >>> adam = torch.optim.AdamW([weight], lr=1e-3)
    >>> optimizer_state_fact(adam)
    'empty'
    >>> weight.grad = torch.full((3,), 0.5); adam.step()
    >>> optimizer_state_fact(adam)[:20]
    'step 1, 3 tensors, b'
    """
    if type(optimizer).__name__ in PARTITIONED:
        return None
    entries = list(_state_entries(optimizer))
    if not entries:
        return "empty"
    if any(_is_sharded(value) for _, value in entries):
        return None
    steps = {_number(value) for key, value in entries if key == "step"}
    tensors = [value for _, value in entries if _is_tensor(value)]
    others = [f"{key}={value!r}" for key, value in entries if not _is_tensor(value)]
    digest = _digest(tensors, others)
    step = f"step {max(steps)}, " if steps else ""
    return f"{step}{len(tensors)} tensors, bits {digest}"


def parameters_fact(module: Any) -> Optional[str]:
    """How many parameters ``module`` has and their bits; None without any.

    >>> import torch
    >>> parameters_fact(torch.nn.Linear(2, 2)) == parameters_fact(torch.nn.Linear(2, 2))  # other random weights
    False
    """
    parameters = [parameter.detach() for parameter in module.parameters()]
    if not parameters or any(_is_sharded(parameter) for parameter in parameters):
        return None
    return f"{len(parameters)} tensors, bits {_digest(parameters, [])}"


def _state_entries(optimizer: Any) -> Iterator[tuple[str, Any]]:
    """Each parameter's state, in the parameter groups' order (a dict's order would follow the state's loading); a
    list of tensors (L-BFGS's history) as its items, so that each is hashed, not printed."""
    state = getattr(optimizer, "state", {})
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            for key, value in sorted(state.get(parameter, {}).items(), key=lambda item: str(item[0])):
                items = value if isinstance(value, (list, tuple)) else [value]
                yield from ((str(key), item) for item in items)


def _digest(tensors: list[Any], others: list[str]) -> str:
    """sha256 of the tensors' bit hashes (one host copy) and of the other values' text, 12 hex digits."""
    from healthcheck.measure.bit_hash import parameter_hashes

    values = parameter_hashes(tensors).cpu().tolist()
    shapes = [tuple(tensor.shape) for tensor in tensors]
    return hashlib.sha256(repr((values, shapes, others)).encode()).hexdigest()[:12]


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _is_sharded(value: Any) -> bool:
    """A DTensor (FSDP2's parameters and their optimizer state): each rank holds its own shard."""
    return _is_tensor(value) and type(value).__name__ == "DTensor"


def _number(value: Any) -> Any:
    """A step count, a tensor's or a number's, as an int where it is whole."""
    number = float(value.item()) if _is_tensor(value) else float(value)
    return int(number) if number.is_integer() else number

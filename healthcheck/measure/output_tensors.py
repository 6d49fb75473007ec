"""The tensors in a model's output that a backward will reach: what the hooks that notice a backward start watch
(the ``.grad`` pass of :mod:`.local_grads`, and script mode's forward counting and gradient-start reading)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional


def differentiable_tensors(value: Any, depth: Optional[int] = None) -> list[Any]:
    """The floating tensors that require grad in a model's output (a tensor, or inside tuples, lists, dicts and
    ``ModelOutput``s, ``depth`` containers deep; None: any depth).

    >>> import torch
    >>> [t.shape[0] for t in differentiable_tensors({"loss": torch.zeros(1, requires_grad=True), "ids": (torch.zeros(2), "x")}, 3)]
    [1]
    >>> w = torch.ones(2, requires_grad=True)
    >>> [t.shape for t in differentiable_tensors({"loss": (w * 2).sum(), "logits": [w * 3, torch.zeros(1)]})]
    [torch.Size([]), torch.Size([2])]
    """
    import torch

    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if depth == 0:
        return []
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        deeper = None if depth is None else depth - 1
        return [t for item in value for t in differentiable_tensors(item, deeper)]
    return []

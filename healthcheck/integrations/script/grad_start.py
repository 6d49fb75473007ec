"""Whether a rank starts each step's backward with its gradients cleared, for the stale-gradients audit.

Why: a rank that skips ``zero_grad`` (the call indented into an ``if rank == 0:`` logging branch, a per-node
code path) adds the previous step's gradient to its new one. Under DDP every rank still applies the same
averaged update, so the parameters stay bit-equal and no exact audit saw it: the carried gradient is a
momentum only that rank's data gets. In an 8-step probe of a DDP loop with it on rank 3, every audit passed.
Under FSDP2 the rank's own shard accumulates, and its slice of every update is wrong.

It is read where the script can no longer clear and autograd has not accumulated yet: when a step's first
backward reaches the trained model's output (a gradient hook on the output's tensors, as :mod:`.forwards`
counts forwards; the model's parameters get their gradients after it). "Carried" (1.0) when a watched
parameter's ``.grad`` holds a nonzero value, "cleared" (0.0) when it is None or all zero, whichever way the
script cleared it. At the first step every parameter is watched (a rank that ran a backward before training
and never cleared it); after it, the three smallest whose gradient was nonzero at that step, which costs
microseconds. The reading stays a device tensor until the optimizer step, where the loss weight's read
(:func:`healthcheck.integrations.loss_weight.step_weight`) already waits for the device, so a GPU does not
synchronise in the middle of the backward.
"""

from __future__ import annotations

from typing import Any, Optional

from healthcheck.measure.eager import eager, eager_partial
from healthcheck.measure.output_tensors import differentiable_tensors

#: Parameters watched after the first step: a few, in case one of them got no gradient in a step.
WATCHED = 3
_OUTPUT_DEPTH = 3


class GradientStart:
    """The state of the trained model's gradients as each step's first backward begins.

    Armed from the start and again after every optimizer step (:meth:`armed_after_step`); the first backward
    through the model's output while armed reads the state, :meth:`take` hands it over at the step's end.

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> start = GradientStart(model)
    >>> _ = start.attach(model)
    >>> def train_step(clear):
    ...     if clear:
    ...         model.zero_grad()
    ...     model(torch.ones(1, 2)).sum().backward()
    ...     reading = start.take()
    ...     start.armed_after_step()
    ...     return reading
    >>> train_step(clear=True), train_step(clear=True), train_step(clear=False), train_step(clear=True)
    (0.0, 0.0, 1.0, 0.0)
    """

    def __init__(self, model: Any):
        self._model = model
        self._watched: Optional[list[Any]] = None  #: None: every parameter (the first step)
        self._armed = True
        self._reading: Optional[list[Any]] = None  #: device booleans: a watched gradient is nonzero

    def attach(self, module: Any) -> list[Any]:
        """Hook ``module``'s forwards; returns the handles. The hook is compiled around, never into."""
        return [module.register_forward_hook(eager(self._after_forward))]

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        import torch

        if not self._armed or not torch.is_grad_enabled():
            return
        tensors = differentiable_tensors(output, _OUTPUT_DEPTH)
        if tensors:  # "any": once, when the first gradient reaches this output
            torch.autograd.graph.register_multi_grad_hook(tensors, eager_partial(self._read), mode="any")

    def _read(self, _: Any) -> None:
        if not self._armed:  # a second forward's hook of the same step
            return
        self._armed = False
        watched = self._watched if self._watched is not None else [p for p in self._model.parameters() if p.requires_grad]
        if watched:  # none: no parameter had a gradient at the first step, so nothing tells a carried one
            self._reading = [_local(p.grad).ne(0).any() for p in watched if p.grad is not None and _local(p.grad).numel()]

    def take(self) -> Optional[float]:
        """At the optimizer step: 1.0 carried, 0.0 cleared, None when no backward reached the model's output."""
        reading, self._reading, self._armed = self._reading, None, False
        if reading is None:
            return None
        return 1.0 if any(bool(r) for r in reading) else 0.0

    def armed_after_step(self) -> None:
        """After an optimizer step: the next backward reads again; after the first, watch a few parameters."""
        if self._watched is None:
            with_gradient = [p for p in self._model.parameters() if p.requires_grad and p.grad is not None]
            nonzero = [p for p in with_gradient if _local(p.grad).numel() and bool(_local(p.grad).ne(0).any())]
            self._watched = sorted(nonzero, key=lambda p: _local(p.grad).numel())[:WATCHED]
        self._armed = True


def _local(grad: Any) -> Any:
    """This rank's part of a gradient: a DTensor's local shard (FSDP2), or the tensor itself."""
    return getattr(grad, "_local_tensor", grad)

"""The trained model's forwards before its first update: how many a rank trained on, and what the first ran with.

A forward counts when a gradient flows back through its output. Counting every forward with autograd on would
also count a sanity loss a script computes on rank 0 only (``model.module(**batch)`` without ``no_grad``), and
would read that forward's facts: the environment audit would then fail rank 0 for being in eval mode, on a run
that trains consistently. A rank with its own gradient accumulation still shows: it backwards more forwards.

The facts (:func:`.observe.first_forward_facts`) are read before each forward until one is backwarded, so they
are those of the first training forward, before its randomness was drawn. Usually that is the first forward:
its backward runs before the next one. With them go the forward's arguments (:func:`forward_arguments`): a rank
whose loop calls the model without its ``attention_mask`` (a per-node flag for a padding-free path) attends to
its padding, and neither its batches, its settings nor its statistics on a freshly initialised model showed it.
The other models that run before the first update (a reference, a teacher) are watched from the same attach to the
same stop (:mod:`.other_models`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from healthcheck.integrations.script.other_models import OtherModels
from healthcheck.measure.eager import eager, eager_partial
from healthcheck.measure.output_tensors import differentiable_tensors

#: How deep the output is searched for tensors (a ModelOutput, a tuple of them, a dict of losses).
_OUTPUT_DEPTH = 3


class TrainingForwards:
    """Forward hooks on the trained module, counting until the first update (:meth:`stop`).

    Args:
        read_facts: What to record about a rank before a forward (the module is its argument).
    """

    def __init__(self, read_facts: Callable[[Any], dict[str, Any]], synced: Callable[[], bool] = lambda: False):
        self._read_facts = read_facts
        self._synced = synced
        self.count = 0  #: forwards whose output received a gradient before the first update
        self.reductions = 0  #: of those, the ones whose backward DDP all-reduced (not under no_sync)
        self.facts: Optional[dict[str, Any]] = None  #: read before the first of them
        self.backwards = 0  #: backwards through the model's output, all run long (:mod:`.updates`)
        self._pending: Optional[dict[str, Any]] = None
        self._others = OtherModels()
        self._stopped = False

    def attach(self, module: Any) -> list[Any]:
        """Hook ``module``'s forwards, and the other models'; returns the handles. The hooks are compiled around, never into."""
        self._others.watch(module)
        return [module.register_forward_pre_hook(eager(self.before), with_kwargs=True), module.register_forward_hook(eager(self.after))]

    def before(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        if self._stopped or self.facts is not None or not torch.is_grad_enabled():
            return
        self._pending = {**self._read_facts(module), "forward_args": forward_arguments(args, kwargs)}

    def after(self, module: Any, args: Any, output: Any) -> None:
        import torch

        if not torch.is_grad_enabled():
            return
        tensors = differentiable_tensors(output, _OUTPUT_DEPTH)
        if not tensors:
            return
        facts, synced = (None, False) if self._stopped else (self._pending, self._synced())
        # "any": once per backward through this output, whichever of its tensors the loss came from.
        torch.autograd.graph.register_multi_grad_hook(tensors, eager_partial(lambda _: self._backwarded(facts, synced)), mode="any")

    def _backwarded(self, facts: Optional[dict[str, Any]], synced: bool = False) -> None:
        self.backwards += 1
        if self._stopped:
            return
        self.count += 1
        self.reductions += synced
        if self.facts is None:
            self.facts = facts

    def restart(self) -> None:
        """The script skipped an update (a GradScaler's inf): what ran before it belongs to no update, so the counts
        start again; the first training forward's facts stay (it still came first)."""
        self.count = self.reductions = 0

    def reduction_facts(self, model: Any) -> dict[str, str]:
        """``ddp.reductions_in_step_0`` for a DDP ``model``: how many of the first update's backwards DDP all-reduced.
        More than one is gradient accumulation without ``no_sync``: each micro-batch is averaged into ``.grad`` before
        the next adds to it, so the last reduction, the one the monitor reads, carries the earlier micro-batches'
        average, not this rank's own gradients (``run/probe.py`` says so in the report)."""
        return {"ddp.reductions_in_step_0": str(self.reductions)} if hasattr(model, "require_backward_grad_sync") else {}

    def stop(self) -> dict[str, Any]:
        """The first update: stop counting. Returns the facts (those of the last forward read when no output was
        backwarded, as with a model whose outputs need no gradient; empty when no forward ran)."""
        self._stopped = True
        return self.facts or self._pending or {}

    def other_model_facts(self) -> dict[str, str]:
        """At the first update: the parameters of the other models that ran before it (:mod:`.other_models`)."""
        return self._others.facts()


def forward_arguments(args: tuple, kwargs: dict) -> str:
    """A forward's arguments as the ranks must share them: a tensor's dtype and number of dimensions (not its shape,
    which follows the batch), any other value by its name alone (``num_items_in_batch`` differs by design).

    >>> import torch
    >>> forward_arguments((torch.zeros(2, 3),), {"labels": torch.ones(2, 3, dtype=torch.long), "attention_mask": None,
    ...                                         "num_items_in_batch": 12})
    '#0 float32 2-d, attention_mask, labels int64 2-d, num_items_in_batch'
    """
    import torch

    def kind(name: str, value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{name} {str(value.dtype).removeprefix('torch.')} {value.ndim}-d"
        return name

    return ", ".join([kind(f"#{i}", value) for i, value in enumerate(args)] + [kind(name, kwargs[name]) for name in sorted(kwargs)])

"""What the replay audit needs from an unmodified script: the inputs of a training forward, and a loss.

The replay audit (:mod:`healthcheck.measure.replay`) recomputes one rank's micro-batch on every rank. In a
``--script`` probe healthcheck has no batch of its own, so :class:`BatchKeeper` keeps the inputs of the
first training forward of each step (references to the script's tensors, no copy), and
:func:`model_loss` runs the model on them. That works where the model computes its own loss from those
inputs (Hugging Face models given ``labels``: ``transformers.Trainer``, TRL, most ``accelerate`` loops); a
loss computed outside the model (``F.cross_entropy(model(x).logits, y)``) cannot be replayed, and
:func:`unavailable` says so.

>>> unavailable({"input_ids": 1})
"the script's model is called without labels, so its forward returns no loss to replay (the loss is computed outside the model)"
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from healthcheck.integrations.eager import eager

#: Keys under which the positional arguments of the forward are kept (``__arg0``, ``__arg1``, ...).
_ARG_PREFIX = "__arg"


class BatchKeeper:
    """Keeps the inputs of the first training forward of ``module`` since :meth:`reset`."""

    def __init__(self, module: Any):
        self.batch: Optional[dict[str, Any]] = None
        self.paused = False
        self._handle = module.register_forward_pre_hook(eager(self._keep), with_kwargs=True)

    def _keep(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        if self.batch is None and not self.paused and torch.is_grad_enabled():
            self.batch = {**{f"{_ARG_PREFIX}{i}": value for i, value in enumerate(args)}, **kwargs}

    def reset(self) -> None:
        self.batch = None

    def close(self) -> None:
        self._handle.remove()


def unavailable(batch: Optional[Mapping[str, Any]]) -> Optional[str]:
    """Why ``batch`` cannot be replayed, or None when it can."""
    if batch is None:
        return "the script's model ran no training forward before its first optimizer step"
    if batch.get("labels") is None:
        return (
            "the script's model is called without labels, so its forward returns no loss to replay "
            "(the loss is computed outside the model)"
        )
    return None


def model_loss(call: Any, batch: Mapping[str, Any]) -> Any:
    """The model's own loss on ``batch``, with ``call`` as the model (what the replay differentiates)."""
    positional = sorted((k for k in batch if k.startswith(_ARG_PREFIX)), key=lambda k: int(k[len(_ARG_PREFIX) :]))
    output = call(*(batch[k] for k in positional), **{k: v for k, v in batch.items() if not k.startswith(_ARG_PREFIX)})
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError("the script's model returned no loss for its own training inputs")
    return loss

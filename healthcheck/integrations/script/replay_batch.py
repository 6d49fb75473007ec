"""What the replay audit needs from an unmodified script: the inputs of a training forward, and a loss.

The replay audit (:mod:`healthcheck.measure.replay`) recomputes one rank's micro-batch on every rank. In a
``--script`` probe healthcheck has no batch of its own, so :class:`BatchKeeper` keeps the inputs of the
first training forward of each step (references to the script's tensors, no copy), and
:func:`model_loss` runs the model on them and returns what the replay differentiates:

* the model's own ``loss`` output, where it computes one from those inputs (Hugging Face models given
  ``labels``: ``transformers.Trainer``, TRL, most ``accelerate`` loops);
* otherwise (a loss computed outside the model, ``F.cross_entropy(model(x).logits, y)``, as the PyTorch
  tutorials write it) a fixed surrogate of the model's outputs (:func:`output_surrogate`). The replay compares
  the ranks with each other, not with the training step, so any fixed function of the outputs whose gradient
  reaches the parameters serves: a device that computes the forward or the backward wrongly gives another
  gradient of it. Until 2026-11-24 such a script's replay audit was "not measured".

>>> unavailable({"input_ids": 1}) is None
True
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from healthcheck.measure.eager import eager
from healthcheck.measure.output_tensors import differentiable_tensors

#: Keys under which the positional arguments of the forward are kept (``__arg0``, ``__arg1``, ...).
_ARG_PREFIX = "__arg"


class BatchKeeper:
    """Keeps the inputs of the first training forward of ``module`` since :meth:`reset`."""

    def __init__(self, module: Any):
        self.batch: Optional[dict[str, Any]] = None
        self.paused = False
        self._module = module
        self._forward: Any = None  #: the instance's own ``forward`` attribute at the kept call, if it had one
        self._handle = module.register_forward_pre_hook(eager(self.keep), with_kwargs=True)

    def keep(self, module: Any, args: tuple, kwargs: dict) -> None:
        """The forward pre-hook; called directly for a forward already under way when the keeper is made."""
        import torch

        if self.batch is None and not self.paused and torch.is_grad_enabled():
            self.batch = {**{f"{_ARG_PREFIX}{i}": value for i, value in enumerate(args)}, **kwargs}
            self._forward = vars(module).get("forward")

    @property
    def redirected(self) -> bool:
        """The kept call ran a ``forward`` set on the instance for that call alone: the script routed it to another
        method (PyTorch Lightning sets one so that DDP's forward runs ``training_step``, and puts the module's own
        back after it), which calling the module again would not run. A ``forward`` wrapped for good (accelerate's
        fp32 output conversion, TRL's and peft's wrappers) is the same object still, and replays as it trained."""
        return self._forward is not None and vars(self._module).get("forward") is not self._forward

    def reset(self) -> None:
        self.batch = None

    def close(self) -> None:
        self._handle.remove()


def unavailable(batch: Optional[Mapping[str, Any]], redirected: bool = False) -> Optional[str]:
    """Why ``batch`` cannot be replayed, or None when it can.

    >>> print(unavailable({"__arg0": 1}, redirected=True))
    the script's training forward ran another method in place of the model's forward (PyTorch Lightning's \
training_step), which a replay cannot call outside the script's loop
    """
    if batch is None:
        return "the script's model ran no training forward before its first optimizer step"
    if redirected:
        return (
            "the script's training forward ran another method in place of the model's forward (PyTorch Lightning's "
            "training_step), which a replay cannot call outside the script's loop"
        )
    return None


def model_loss(call: Any, batch: Mapping[str, Any]) -> Any:
    """What the replay differentiates on ``batch``, with ``call`` as the model: its own loss, else
    :func:`output_surrogate` of its outputs."""
    positional = sorted((k for k in batch if k.startswith(_ARG_PREFIX)), key=lambda k: int(k[len(_ARG_PREFIX) :]))
    output = call(*(batch[k] for k in positional), **{k: v for k, v in batch.items() if not k.startswith(_ARG_PREFIX)})
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if loss is not None else output_surrogate(output)


def output_surrogate(output: Any) -> Any:
    """The sum over the output's differentiable floating tensors (a tensor, or one inside a tuple, list, dict or
    ``ModelOutput``, two levels deep) of their mean square, in fp32: the same function on every rank.

    Why a mean square: its gradient, 2·y/n, is nonzero wherever the output is, so the backward runs through
    every parameter that produced it, and it stays O(|y|²) whatever the output's size.

    >>> import torch
    >>> y = torch.tensor([1.0, 3.0], requires_grad=True)
    >>> float(output_surrogate({"logits": y, "past_key_values": None}).detach())
    5.0
    """
    import torch

    found = differentiable_tensors(output, depth=2)
    if not found:
        raise ValueError("the script's model returned no loss and no differentiable floating-point output to replay")
    return torch.stack([t.float().square().mean() for t in found]).sum()

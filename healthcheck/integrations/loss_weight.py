"""How much a rank's own loss weighs in its own backward: the gradient that reaches the captured loss.

A script that scales its loss on one rank (``loss * 1.5`` after the model's loss, an accumulation divisor or
a loss scale read from a per-node config) trains that rank's data harder. DDP and FSDP2 average the
gradients, so every replica stays equal and the statistics see only a rank whose gradient norm is a little
larger: in a 10-step probe rank 3's ×1.5 had the largest norm in 8 of 10 steps, not significant.

The backward itself says it exactly. For a captured loss tensor X (a cross-entropy's result, the model's
``loss`` output, TRL's log-probs, a :func:`~healthcheck.record_loss` value) whose micro-batch sums the token
loss S over N tokens, the script's root R hands X the gradient G = ∂R/∂X. When R = c · S/N (plus terms
without X), ⟨G, X⟩ = c · S/N for every such X: a mean or summed cross-entropy (G = c or c/N), per-token
losses (G = c/N each), log-probs (G = −c/N on the counted tokens). So w = ⟨G, X⟩ · N / S = c, and a step's
weight is the sum over its micro-batches: 1 for ``(loss / accum).backward()`` on each of ``accum``.

A script that divides by a count over every rank (TRL, the Trainer's ``num_items_in_batch``) has
w = c · N / N_all, which follows the data; :mod:`healthcheck.judge.loss_weight` tells the two apart.

The same gradient says whether X is a loss at all (:meth:`WeightProbe.both_signs`). A token loss, however its
tokens are weighted (per-sequence means, a dynamic weight per token), hands every counted token of X a gradient of
one sign. A preference or RL objective computed from the same per-token log-probs does not: TRL's DPOTrainer sums
them per sequence and trains ``-logsigmoid(β · (chosen − rejected))``, which pushes the chosen tokens' likelihood up
and the rejected ones' down. Read as a loss, their mean NLL was reported as each rank's loss (6.23 on a tiny Llama
whose DPO loss was 0.693).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from healthcheck.measure.eager import eager_partial


class WeightProbe:
    """Watches one captured loss tensor for the gradient the backward hands it.

    >>> import torch
    >>> logits = torch.randn(3, 5, requires_grad=True)
    >>> loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2]))
    >>> probe = WeightProbe(loss)
    >>> (1.5 * loss).backward()
    >>> round(float(probe.weight(loss.detach() * 3, 3)), 6)
    1.5
    >>> WeightProbe(loss.detach()).weight(loss.detach() * 3, 3) is None  # never in a backward
    True
    >>> unused = WeightProbe(loss)
    >>> unused._seen(None)  # an undefined gradient (DDP's _DDPSink on an output the root never used)
    >>> unused.weight(loss.detach() * 3, 3) is None
    True
    """

    def __init__(self, tensor: Any, counted: Optional[Any] = None):
        self.value = tensor.detach()
        self.counted = counted  #: per-token X: which of its entries are counted tokens (None: all)
        self.grad: Optional[Any] = None
        if tensor.requires_grad:
            tensor.register_hook(eager_partial(self._seen))

    def _seen(self, grad: Any) -> None:
        # None: the backward passed through X without a gradient for it. DDP with find_unused_parameters (what the
        # Trainer picks for a peft model) routes a module's outputs through its _DDPSink, whose backward hands an
        # output the root never used (TRL's model ``loss``, beside the fused log-probs it trains on) an undefined
        # gradient. That X weighs nothing in this backward.
        if grad is None:
            return
        self.grad = grad.detach() if self.grad is None else self.grad + grad.detach()

    @property
    def rounding(self) -> float:
        """The unit roundoff of the coarser of X's and G's dtypes (bf16: 2⁻⁸), 0 before a backward: the weight is
        read to a few of these, and a loss computed in bf16 (a script's cross-entropy on a bf16 model's logits) made
        the ranks' weights of 1 scatter by ±0.4%, which the audit took for weights that follow the data."""
        if self.grad is None:
            return 0.0
        import torch

        return max(torch.finfo(t.dtype).eps / 2 for t in (self.value, self.grad) if t.dtype.is_floating_point)

    def dot(self) -> Optional[Any]:
        """``⟨G, X⟩`` as a float64 tensor (no host sync), or None where no gradient reached X."""
        if self.grad is None:
            return None
        import torch

        return (self.grad.to(torch.float64) * self.value.to(torch.float64)).sum()

    def weight(self, summed: Any, tokens: Any) -> Optional[Any]:
        """``⟨G, X⟩ · N / S`` as a float64 tensor (no host sync), or None where no gradient reached X."""
        return _per(self.dot(), summed, tokens)

    def both_signs(self) -> bool:
        """Whether the backward handed X's counted tokens gradients of both signs: X is then no loss the script
        minimises (a preference objective's log-probs), whatever its value. One host sync; False before a backward.

        >>> import torch
        >>> logps = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]], requires_grad=True)
        >>> nll, dpo = WeightProbe(logps), WeightProbe(logps, counted=torch.tensor([[True, True], [True, False]]))
        >>> (-logps.sum(dim=1).mean()).backward(retain_graph=True)  # a token loss, per-sequence weights: one sign
        >>> nll.both_signs()
        False
        >>> nll.grad = dpo.grad = None
        >>> chosen, rejected = logps.sum(dim=1)
        >>> (-torch.nn.functional.logsigmoid(0.1 * (chosen - rejected))).backward()  # DPO's: chosen up, rejected down
        >>> nll.both_signs(), dpo.both_signs()
        (True, True)
        """
        grad = self.grad
        if grad is None or grad.dim() == 0:
            return False
        counted = self.counted
        if counted is not None and counted.shape == grad.shape:
            grad = grad[counted.bool().to(grad.device)]
        return bool((grad > 0).any() & (grad < 0).any())


class JointProbe:
    """Several captured tensors that are one loss together (the chunks of a chunked cross-entropy): S and N are
    their sums, and ``⟨G, X⟩`` is the sum of theirs."""

    def __init__(self, probes: Sequence[WeightProbe]):
        self.probes = list(probes)

    @property
    def grad(self) -> Optional[Any]:
        return next((probe.grad for probe in self.probes if probe.grad is not None), None)

    def weight(self, summed: Any, tokens: Any) -> Optional[Any]:
        dots = [probe.dot() for probe in self.probes]
        known = [dot for dot in dots if dot is not None]
        if not dots or len(known) < len(dots):
            return None
        return _per(sum(known[1:], known[0]), summed, tokens)

    def both_signs(self) -> bool:
        return any(probe.both_signs() for probe in self.probes)

    @property
    def rounding(self) -> float:
        return max((probe.rounding for probe in self.probes), default=0.0)


def _per(dot: Optional[Any], summed: Any, tokens: Any) -> Optional[Any]:
    """``dot · N / S``: the loss's weight in the backward."""
    if dot is None:
        return None
    import torch

    def as64(value: Any) -> Any:
        return torch.as_tensor(value, dtype=torch.float64, device=dot.device)

    return dot * as64(tokens) / as64(summed)


def step_weight(weights: Sequence[Optional[Any]]) -> float:
    """The step's weight: the sum of its micro-batches' (read on the host); NaN when any is unknown or 0/0.

    >>> import torch
    >>> step_weight([torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)])
    1.0
    >>> math.isnan(step_weight([torch.tensor(1.0), None])), math.isnan(step_weight([]))
    (True, True)
    """
    known = [float(w) for w in weights if w is not None]
    if not weights or len(known) < len(weights):
        return math.nan
    total = math.fsum(known)
    return total if math.isfinite(total) else math.nan

"""Several cross-entropy calls in one micro-batch: which of them are the loss the rank trains.

A micro-batch often calls ``F.cross_entropy`` more than once, for three reasons that the values alone do not tell
apart, and the backward does:

* **the same loss twice**: a Hugging Face model given labels computes it, and the script again from the logits.
  Equal values (sum and token count) count once;
* **a loss computed for a log** (per-token losses over the prompt too, a loss without the script's masking), with
  autograd on. The backward never reaches it, and it is dropped. Before, any second value made the step's loss "not
  measured";
* **chunks of one loss**: a memory-saving loss computes the cross-entropy over slices of the sequence and adds them
  (torchtune's ``CEWithChunkedOutputLoss``: ``reduction="sum"`` per chunk, divided by the micro-batch's token count).
  Every token of every chunk then weighs the same in the backward: ρ = ⟨G, X⟩ / S, the root's derivative per unit
  of token loss, is c/N for each chunk whatever its reduction. Chunks with the same ρ are summed into one loss
  (their S and N added); a chunk of ignored tokens only (the padding at the end) adds nothing.

Calls that the backward weighs differently (a main loss and an auxiliary one at half its weight) are no single
token loss, and the step's loss is not measured, saying so.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from healthcheck.integrations.loss_weight import JointProbe, WeightProbe

#: Relative difference within which two chunks' per-token weights are the same (float32 rounding of the loss and
#: its gradient is ~1e-7; the weights of different losses differ by far more).
SAME_RATE = 1e-4


def resolve_calls(entries: Sequence[tuple[Any, Any]], probes: Sequence[WeightProbe]) -> tuple[Any, Any, Optional[str]]:
    """(summed loss, tokens), the probe to weigh it with, and None; or None, None and why no single loss is known.

    >>> import torch
    >>> logits, labels = torch.randn(6, 5, requires_grad=True), torch.tensor([0, 1, 2, 3, -100, -100])
    >>> chunks = [torch.nn.functional.cross_entropy(logits[i:i + 2], labels[i:i + 2], reduction="sum") for i in (0, 2, 4)]
    >>> entries = [(c.detach(), (labels[i:i + 2] != -100).sum()) for c, i in zip(chunks, (0, 2, 4))]
    >>> probes = [WeightProbe(c) for c in chunks]
    >>> (sum(chunks) / 4).backward()  # torchtune's chunked loss: the chunks' sums over the micro-batch's tokens
    >>> (summed, tokens), probe, problem = resolve_calls(entries, probes)
    >>> int(tokens), problem, round(float(probe.weight(summed, tokens)), 6)
    (4, None, 1.0)
    >>> whole = torch.nn.functional.cross_entropy(logits.detach(), labels, reduction="sum")
    >>> abs(float(summed) - float(whole)) < 1e-5
    True
    """
    groups = _distinct(entries)
    if len(groups) > 1:
        # Of different values, the ones the backward went through: the others were computed for a log.
        trained = [group for group in groups if any(probes[i].grad is not None for i in group)]
        groups = trained or groups
    if len(groups) == 1:
        # Of equal values, the one the backward went through (a script's recomputation for logging gets none).
        equal = [probes[i] for i in groups[0]]
        return entries[groups[0][0]], next((p for p in equal if p.grad is not None), equal[0]), None
    return _chunks(entries, probes, groups)


def _chunks(entries: Sequence[tuple[Any, Any]], probes: Sequence[WeightProbe], groups: list[list[int]]) -> tuple[Any, Any, Optional[str]]:
    """Several different values: one loss if the backward weighs a unit of each group's token loss the same."""
    counted = [group for group in groups if int(entries[group[0]][1]) > 0]  # a chunk of ignored tokens adds nothing
    picked = [next((i for i in group if probes[i].grad is not None), None) for group in counted]
    rates = [math.nan if i is None else _rate(probes[i], entries[i][0]) for i in picked]
    if not counted or not all(math.isfinite(r) and r > 0 for r in rates) or max(rates) - min(rates) > SAME_RATE * max(rates):
        return None, None, f"{len(groups)} different cross-entropy losses were computed; which one trains is unknown"
    chosen = [i for i in picked if i is not None]
    summed = sum(entries[i][0] for i in chosen)
    tokens = sum(entries[i][1] for i in chosen)
    return (summed, tokens), JointProbe([probes[i] for i in chosen]), None


def _rate(probe: WeightProbe, summed: Any) -> float:
    """ρ = ⟨G, X⟩ / S, the root's derivative per unit of the token loss X carries; NaN where no gradient reached X."""
    dot = probe.dot()
    return math.nan if dot is None else float(dot) / float(summed)


def _distinct(entries: Sequence[tuple[Any, Any]]) -> list[list[int]]:
    """The entries' indices grouped by equal value: the same loss is often computed twice (inside a Hugging Face
    model given labels, and again by the script), and equal values count once. One host sync per micro-batch
    with several calls only."""
    groups: list[list[int]] = []
    for index, (summed, tokens) in enumerate(entries):
        s, n = float(summed), int(tokens)
        for group in groups:
            o, c = entries[group[0]]
            if abs(s - float(o)) <= 1e-6 * max(1.0, abs(s)) and n == int(c):
                group.append(index)
                break
        else:
            groups.append([index])
    return groups

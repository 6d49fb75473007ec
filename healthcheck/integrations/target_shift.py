"""Which shift of the forward's input tokens a rank's loss targets are: the causal-LM contract every rank shares.

A causal language model learns token t+1 from the tokens up to t, so the targets of its loss are its input ids
shifted by one position: a Hugging Face model shifts ``labels`` inside, a script shifts its logits and labels
itself, nanoGPT reads ``y`` one token after ``x``. Two faults on one node break that contract where nothing else
looks, in the loop between the DataLoader and the loss:

* the loop shifts once more (labels that arrive shifted, shifted again): the rank learns the token two ahead;
* the loop changes the inputs after the labels were made (a token-masking augmentation left on for one node): the
  targets are no shift of the inputs at all.

The DataLoader's batches agree (their collate is audited), the loss settings agree, the replay hands every rank
the same inputs, and on a freshly initialised model, whose loss barely depends on which token it predicts, each
fault passed a 20-step ``--audits-only`` probe, its rank-outlier and spike tests included.

:class:`TargetShifts` reads, at the first step, every cross-entropy the backward goes through, against the inputs
of the forward it belongs to, and reports one fact per rank (``loss.target_shift``) for the environment audit.
Scripts whose targets are no shift of their inputs (a classifier, a seq2seq decoder, masked-LM) report "not the
inputs" on every rank alike; a rank with too few targets to tell reports "not measured" and is not compared.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from healthcheck.integrations.loss_hooks import when_trained
from healthcheck.judge.exact_audits import NOT_MEASURED

#: Counted targets a shift must be checked on: fewer could match a wrong shift by chance (a class id that happens
#: to equal a token id).
MIN_TOKENS = 16
#: Input positions a target may leave out and still be read: a causal shift drops one or two. A narrower target is a
#: slice of the sequence (a chunked loss's chunk), whose offset in it is unknown: the shift its chunk reads, 65 for the
#: second of 64 columns, depends on where that rank's first counted target falls, so chunks are not read at all.
MAX_SHIFT = 4
#: Candidate shifts checked at most, nearest first.
MAX_CANDIDATES = 64
#: The fact of a rank whose targets are no shift of its inputs.
NOT_INPUTS = "not the inputs"


def target_shift(inputs: Any, target: Any, ignore_index: int = -100) -> Union[int, str, None]:
    """The shift k with ``target[b, j] == inputs[b, j + k]`` at every counted target whose ``j + k`` is a position
    of the inputs, :data:`NOT_INPUTS` when none holds, or None when it cannot tell: no 2-D integer ``inputs``, a
    target that is no sequence per row or spans fewer than all but :data:`MAX_SHIFT` of the inputs' positions (a
    chunk), or fewer than :data:`MIN_TOKENS` counted targets to check.

    ``target`` may be flat (``logits.view(-1, V)``'s labels). The smallest shift in magnitude wins.

    >>> import torch
    >>> ids = torch.arange(40).reshape(2, 20) % 37
    >>> labels = ids.clone(); labels[:, :5] = -100                      # the prompt masked
    >>> target_shift(ids, labels[:, 1:].reshape(-1))                    # a script's shift
    1
    >>> target_shift(ids, torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 2:])  # shifted twice
    2
    >>> noisy = ids.clone(); noisy[0, 9] = 0                            # an input changed after the labels
    >>> target_shift(noisy, labels[:, 1:])
    'not the inputs'
    >>> target_shift(ids, torch.tensor([1, 0])) is None                 # a class per row
    True
    """
    import numpy as np

    if getattr(inputs, "ndim", 0) != 2 or inputs.is_floating_point() or target.is_floating_point() or inputs.is_complex():
        return None
    rows, width = inputs.shape
    if rows == 0 or target.numel() % rows or target.numel() // rows < max(2, width - MAX_SHIFT):
        return None
    x = inputs.detach().cpu().numpy()
    y = target.detach().reshape(rows, -1).cpu().numpy()
    counted = y != ignore_index
    if counted.sum() < MIN_TOKENS:
        return None
    # The shifts at which the earliest and the latest counted target occur in their rows: the true shift, if any,
    # is among them (the earliest is in range for a forward shift, the latest for a backward one).
    columns = np.flatnonzero(counted.any(axis=0))
    candidates: set[int] = set()
    for column in (columns[0], columns[-1]):
        row = int(np.flatnonzero(counted[:, column])[0])
        candidates.update(int(k) for k in np.flatnonzero(x[row] == y[row, column]) - column)
    # The nearest first, and only so many: a token as common as counted padding puts a candidate at each of its
    # positions, and a shift is a few positions at most.
    for shift in sorted(candidates, key=lambda k: (abs(k), k < 0))[:MAX_CANDIDATES]:
        if _holds(x, y, counted, shift):
            return shift
    return NOT_INPUTS


def _holds(x: Any, y: Any, counted: Any, shift: int) -> bool:
    """Every counted target in range of the inputs at ``shift`` equals its input, and enough of them are in range."""
    import numpy as np

    source = np.arange(y.shape[1]) + shift
    inside = (source >= 0) & (source < x.shape[1])
    compared = counted[:, inside]
    # Half the counted targets at least: a shift far enough to leave a few in range could match them by chance.
    if compared.sum() < max(MIN_TOKENS, counted.sum() / 2):
        return False
    return bool((x[:, source[inside]] == y[:, inside])[compared].all())


def token_ids(args: tuple, kwargs: dict) -> Any:
    """A forward's input ids: ``input_ids``, else its first 2-D integer tensor argument (``model(x, y)``), or None.

    >>> import torch
    >>> token_ids((torch.zeros(2, 3), torch.ones(2, 5, dtype=torch.long)), {}).shape
    torch.Size([2, 5])
    """
    import torch

    found = kwargs.get("input_ids")
    candidates = [found] if found is not None else list(args)
    return next((t for t in candidates if isinstance(t, torch.Tensor) and t.ndim == 2 and not t.is_floating_point()), None)


class TargetShifts:
    """This rank's target shifts at its first step, from the cross-entropies its backward went through.

    >>> import torch
    >>> shifts = TargetShifts()
    >>> ids = torch.arange(40).reshape(2, 20)
    >>> logits = torch.randn(2, 19, 40, requires_grad=True)
    >>> loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 40), ids[:, 1:].reshape(-1))
    >>> shifts.observe(ids, ids[:, 1:].reshape(-1), -100, loss)
    >>> shifts.observe(ids, ids[:, 2:].reshape(-1), -100, loss.detach() * 0 + 1)  # no gradient: not the loss trained
    >>> loss.backward()
    >>> shifts.facts()
    {'loss.target_shift': 'the inputs shifted by 1'}
    """

    def __init__(self) -> None:
        self._seen: Optional[set[Union[int, str]]] = set()  # None once read

    def observe(self, inputs: Any, target: Any, ignore_index: int, result: Any) -> None:
        """A cross-entropy's targets and result, with the inputs of its forward; counted once the backward reaches it
        (a loss computed for a log, with other targets, is no rank's training loss)."""
        if (seen := self._seen) is None or inputs is None or not getattr(result, "requires_grad", False):
            return
        if (shift := target_shift(inputs, target, ignore_index)) is not None:
            when_trained(result, lambda: seen.add(shift))  # after facts() read the set, an add changes nothing read

    def facts(self) -> dict[str, str]:
        """``loss.target_shift``: the shifts seen ("the inputs shifted by 1"; "... by 1 and 2" for a loss that also
        predicts the token after next), "not the inputs", both for losses of both kinds, or "not measured"; read once."""
        seen, self._seen = self._seen or set(), None
        shifts = sorted(shift for shift in seen if isinstance(shift, int))
        parts = [f"the inputs shifted by {' and '.join(map(str, shifts))}"] if shifts else []
        parts += [NOT_INPUTS] if NOT_INPUTS in seen else []
        return {"loss.target_shift": " | ".join(parts) or NOT_MEASURED}

"""Which optimizer steps make one update of the trained model, when a script steps several optimizers.

nanochat trains its matrices with Muon and its embeddings and head with AdamW, each an optimizer of its own, and
LoRA+ or a separate embedding learning rate do the same: one backward, then one ``step()`` per optimizer. Each of
those steps updates the model's parameters, so each looked like a probe step, and the second asked the monitor for
a step's gradients that no backward had produced: every rank ended in exit 3. An update begins at the first step of
an optimizer that owns the model's parameters after a backward through the model; a step of another optimizer
before the next backward joins it (:class:`UpdateSteps`). The probe's work for the update runs around its first
optimizer's step, so a parameter check hashes the parameters before the others have stepped; every rank does the
same, and an optimizer that differs on one rank still shows at the next check. The other optimizers' settings join
the environment audit's facts as ``optimizer#2``, ``optimizer#2.lr``, ... (at the end of the probe: the first
step's gather has already run when they step).
"""

from __future__ import annotations

from typing import Any, Callable


class UpdateSteps:
    """Tells, at an owning optimizer's step, whether it begins an update or joins the one under way.

    Args:
        backwards: How many backwards have gone through the trained model's output so far
            (:attr:`.forwards.TrainingForwards.backwards`).

    >>> count = [0]
    >>> updates = UpdateSteps(lambda: count[0])
    >>> import torch
    >>> muon, adamw = torch.optim.SGD([torch.zeros(1)]), torch.optim.AdamW([torch.zeros(1)], lr=0.01)
    >>> count[0] += 1  # a backward
    >>> updates.joins(muon), updates.joins(adamw)
    (False, True)
    >>> updates.facts["optimizer#2"], updates.facts["optimizer#2.lr"]
    ('AdamW', '0.01')
    >>> count[0] += 1
    >>> updates.joins(muon), updates.joins(adamw)
    (False, True)
    >>> updates.joins(muon)  # the same optimizer again without a backward: not part of this update
    False
    >>> count[0] += 1  # the replay audit's backward, inside muon's step
    >>> updates.settle()
    >>> updates.joins(adamw), updates.under_way()
    (True, True)
    >>> count[0] += 1; updates.under_way()  # the next step's backward
    False
    """

    def __init__(self, backwards: Callable[[], int]):
        self._backwards = backwards
        self._at_begin = -1  #: the backward count when the update under way began
        self._stepped: set[int] = set()  #: the optimizers that stepped in it
        self._updates = 0
        self.facts: dict[str, str] = {}  #: the settings of the first update's other optimizers

    def joins(self, optimizer: Any) -> bool:
        """True when ``optimizer`` is another optimizer stepping before any backward since the update began."""
        count = self._backwards()
        if count == self._at_begin and id(optimizer) not in self._stepped:
            self._stepped.add(id(optimizer))
            if self._updates == 1:
                from healthcheck.integrations.script.observe import optimizer_facts

                tag = f"optimizer#{len(self._stepped)}"
                self.facts.update({tag + key.removeprefix("optimizer"): value for key, value in optimizer_facts(optimizer).items()})
            return True
        self._at_begin, self._stepped = count, {id(optimizer)}
        self._updates += 1
        return False

    def under_way(self) -> bool:
        """True from an update's first optimizer step to the next backward: an optimizer stepping then is one of its."""
        return self._updates > 0 and self._backwards() == self._at_begin

    def settle(self) -> None:
        """After the update's first optimizer stepped: backwards until now (the replay audit's, run inside that step)
        were no training backward, so they do not end the update."""
        self._at_begin = self._backwards()

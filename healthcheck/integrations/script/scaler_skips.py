"""A GradScaler's skip when a script steps several optimizers through it: the whole update, or part of it.

A ``GradScaler`` checks each optimizer's gradients on its own. With one optimizer per parameter group (the AMP
recipe's several optimizers, Muon and AdamW under fp16), an inf in one group's gradients skips that optimizer alone,
and the others step. Two things went wrong with that:

* the optimizer stepped first was skipped and a later one stepped: the session had already discarded the step's
  numbers as a skipped update, so the later step found no gradient, and every rank ended in exit 3. A skip is
  whole only when no other optimizer steps before the model's next forward, so the discard waits for that forward
  (:class:`PendingSkip`);
* a later optimizer was skipped: the step's gradients, gathered with their inf, failed ``nonfinite`` (exit 1) on a
  correct run. The scaler rejected them, so the step measures nothing: :func:`overflowed_in_part` tells such a step
  from the gathered numbers, the same on every rank, and the session keeps it out of the rows and says so.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

from healthcheck.integrations.eager import eager


class PendingSkip:
    """A GradScaler skipped the first owning optimizer of an update: whole or in part is known later.

    Args:
        whole: Called, with the time of the skip, at the model's next forward when no optimizer stepped since
            (the session then forgets what the monitor, the loss capture and the forward counts recorded).

    >>> confirmed = []
    >>> skip = PendingSkip(confirmed.append)
    >>> skip.arm(); skip.cancel()  # another optimizer stepped on the same gradients: part of an update
    True
    >>> skip.forward(None, ()); confirmed
    []
    >>> skip.arm(); skip.forward(None, ()); len(confirmed)  # the next forward came first: the whole update
    1
    """

    def __init__(self, whole: Callable[[float], None]):
        self._whole = whole
        self._at: Optional[float] = None

    def attach(self, module: Any) -> Any:
        """Before every other forward pre-hook of ``module`` (the loss capture's and the batch keeper's read the new
        step): the skipped step's records go first."""
        return module.register_forward_pre_hook(eager(self.forward), prepend=True)

    def arm(self) -> None:
        if self._at is None:  # two optimizers skipped: one skip, from the first
            self._at = time.perf_counter()

    def cancel(self) -> bool:
        """An owning optimizer steps on the gradients the scaler skipped another for: nothing is discarded."""
        armed, self._at = self._at is not None, None
        return armed

    def forward(self, module: Any, args: Any) -> None:
        if self._at is not None:
            at, self._at = self._at, None
            self._whole(at)


def overflowed_in_part(metrics: Any) -> bool:
    """Whether a probe step's non-finite gradients are an overflow every rank's GradScaler rejected.

    Under an enabled scaler on every rank (``scaler_skips`` is None without one, or with ``enabled=False``), a
    non-finite local gradient makes the reduced one non-finite on every rank, and each scaler skips the optimizer
    that owns it: the optimizer that began the update stepped, a later one did not. A measured loss stays finite (a
    non-finite loss makes every gradient so, and the whole update is skipped, never a probe step). Read from the
    gathered numbers (where a None was gathered as NaN), so every rank decides alike.

    >>> from types import SimpleNamespace as Step
    >>> def step(skips, losses=(2.1, 2.3), nonfinite=(1,)):
    ...     return Step(nonfinite_ranks=list(nonfinite), per_rank_loss=list(losses), loss_measured=True,
    ...                 per_rank_extras={"scaler_skips": list(skips)})
    >>> overflowed_in_part(step([0.0, 0.0]))
    True
    >>> overflowed_in_part(step([0.0, math.nan]))  # rank 1 has no enabled scaler: its inf is no scaler's business
    False
    >>> overflowed_in_part(step([0.0, 0.0], losses=(2.1, math.inf))), overflowed_in_part(step([0.0, 0.0], nonfinite=()))
    (False, False)
    """
    skips = metrics.per_rank_extras.get("scaler_skips") or []
    if not metrics.nonfinite_ranks or not skips or not all(math.isfinite(value) for value in skips):
        return False
    return not metrics.loss_measured or all(math.isfinite(loss) for loss in metrics.per_rank_loss)

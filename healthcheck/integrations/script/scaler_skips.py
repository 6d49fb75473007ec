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

And a skip that never ends: a rank whose own gradient overflows at every update (a device that computes wrong in
fp16) spreads its inf to every rank through the all-reduce, and every rank's scaler skips every update. The script
then ran out of steps with nothing measured (exit 3). After :data:`PERSISTENT_SKIPS` whole skips in a row the ranks
compare whose own gradient was non-finite (:func:`persistent_overflow`), and the probe stops there, naming them.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

from healthcheck.measure.eager import eager
from healthcheck.ranks import ranks_phrase

#: Whole skips in a row, after the probe's first step, that stop it. A healthy run skips while its scale falls to what
#: its gradients allow, at the start (one skip per halving, before the first step it takes); after that, one update
#: now and then, when the scale grows back too far. 8 in a row is no calibration. Before the first step nothing stops:
#: ``ScriptEnded`` names the skips if the script runs out of steps there.
PERSISTENT_SKIPS = 8


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


def persistent_overflow(skips: int, steps_done: int, nonfinite: Optional[bool]) -> Optional[tuple[str, list[int]]]:
    """Why the probe stops at this whole skip, or None. Collective when ``skips`` (in a row) reaches the limit after
    the first step: every rank skips the same updates (the inf is all-reduced), so every rank gathers here.
    ``nonfinite``: whether this rank's own gradient in the skipped update was (None: not recorded, as with gradients
    read from ``.grad``). Returns the message and the ranks it names."""
    if steps_done == 0 or skips != PERSISTENT_SKIPS:
        return None
    from healthcheck.measure import distributed as hdist

    flags = hdist.all_gather_objects(bool(nonfinite))
    ranks = [rank for rank, flag in enumerate(flags) if flag]
    message = overflow_message(ranks, len(flags), skips)
    return None if message is None else (message, ranks)


def overflow_message(ranks: list[int], world: int, skips: int) -> Optional[str]:
    """The stop's message for the ranks whose own gradient overflowed (None when no rank's did, or none was read).

    >>> overflow_message([1], 3, 8).split(", and")[0]
    "rank 1's own gradient was inf or NaN in each of the last 8 updates"
    >>> overflow_message([], 3, 8) is None
    True
    """
    if not ranks:
        return None
    whose = f"{ranks_phrase(ranks)}'s own gradient was" if len(ranks) == 1 else f"the own gradients of {ranks_phrase(ranks)} were"
    if len(ranks) == world:
        return (f"every rank's own gradient was inf or NaN in each of the last {skips} updates, which every GradScaler "
                "skipped: the training diverges, or the loss scale starts far too high")
    return (f"{whose} inf or NaN in each of the last {skips} updates, and every rank's GradScaler skipped them (the "
            "gradient reduction spread it): a device that computes wrong in fp16, or a loss that overflows on that rank's data")

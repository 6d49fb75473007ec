"""A rank whose loop ends inside torch's ``Join`` (uneven inputs) ends the probe there, at once, in one line.

PyTorch's recipe for ranks with different numbers of batches wraps the training loop in
``torch.distributed.algorithms.join.Join([ddp_model])``; accelerate's ``Accelerator.join_uneven_inputs`` enters the
same context. A rank that runs out first waits in ``Join.__exit__`` and shadows DDP's all-reduces with zeros while
the others train on. It shadows only DDP's own collectives, not the monitor's gathers or a compared script
collective, so under a probe the others waited for it until ``distributed.timeout_s`` (300 s by default) and the
probe ended in exit 3 with a collective mismatch inside ``Join``. The probe compares steps that every rank takes, so
a rank that leaves the loop before ``train.steps`` ends the probe where it leaves, as a script that returns too soon
does: :class:`InputsExhausted` unwinds it, and the worker turns it into that one-line end
(:func:`ended_in_join`).
"""

from __future__ import annotations

from typing import Any, Callable


class InputsExhausted(BaseException):
    """The script's loop ended inside ``Join`` before the probe had its steps (a BaseException, as
    :class:`~healthcheck.integrations.script.session_hooks.ProbeComplete`: ``except Exception`` lets it by)."""


def patch(patches: Any, probing: Callable[[], bool]) -> None:
    """Wrap ``Join.__exit__``: while ``probing()``, a rank that leaves the context on its own raises
    :class:`InputsExhausted` instead of shadowing the others. A context left by an exception (the probe's own end
    included) or made with ``enable=False`` is torch's as before."""
    try:
        from torch.distributed.algorithms.join import Join
    except ImportError:  # a torch built without distributed has no Join for a script to enter
        return

    def make(original: Any) -> Any:
        def __exit__(self: Any, exc_type: Any, exc: Any, traceback: Any) -> Any:
            if exc_type is None and getattr(self, "_enable", True) and probing():
                raise InputsExhausted()
            return original(self, exc_type, exc, traceback)

        return __exit__

    patches.wrap(Join, "__exit__", make)


def ended_in_join(done: int, planned: int) -> str:
    """Why the probe could not finish, and what to change.

    >>> line = ended_in_join(4, 60)
    >>> line.split(" and entered")[0]
    "the script's loop ran out of inputs after 4 of the probe's 60 optimizer steps"
    >>> line.split(": ")[-1]
    'lower train.steps to 4, or give every rank more batches'
    >>> ended_in_join(0, 60).endswith("give every rank more batches")
    True
    """
    lower = f"lower train.steps to {done}, or " if done > 0 else ""
    return (f"the script's loop ran out of inputs after {done} of the probe's {planned} optimizer steps and entered torch's "
            f"Join (uneven inputs), which lets the ranks with inputs left train on without it; the probe compares steps "
            f"every rank takes: {lower}give every rank more batches")

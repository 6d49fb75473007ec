"""A rank that leaves torch's ``Join`` before the probe has its steps ends the probe on one line
(healthcheck/integrations/script/uneven_inputs.py); an exception, or a disabled Join, is torch's as before."""

from __future__ import annotations

import pytest
from torch.distributed.algorithms.join import Join

from healthcheck.integrations.script import uneven_inputs
from healthcheck.integrations.script.patches import Patches
from healthcheck.integrations.script.uneven_inputs import InputsExhausted

pytestmark = pytest.mark.unit


def join(enable: bool) -> Join:
    """A Join as the script's ``with`` leaves it, without the process group its constructor reads."""
    context = Join.__new__(Join)
    context._enable = enable
    return context


def test_leaving_join_while_the_probe_runs_ends_it_and_the_patch_is_undone():
    original, probing = Join.__exit__, [True]
    patches = Patches()
    uneven_inputs.patch(patches, lambda: probing[0])
    try:
        with pytest.raises(InputsExhausted):
            with join(enable=True):
                pass  # the rank's loop ran out of inputs: torch would shadow the others' all-reduces from here
        with pytest.raises(ValueError):  # the script's own error (or the probe's end) propagates as torch lets it
            with join(enable=True):
                raise ValueError("bad batch")
        with join(enable=False):  # Join(enable=False), accelerate's with even batches: nothing to shadow
            pass
        probing[0] = False  # the probe has its steps: torch's Join again (disabled here: it needs no process group)
        with join(enable=False):
            pass
    finally:
        patches.restore()
    assert Join.__exit__ is original
    assert not issubclass(InputsExhausted, Exception)  # a script's ``except Exception`` must let it by

"""What the run layer hands a script session, and how the session ends the script once the probe has its steps."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


class ProbeComplete(BaseException):
    """Unwinds the script once the probe has its steps (a BaseException: ``except Exception`` lets it by)."""


@dataclasses.dataclass(kw_only=True)
class SessionHooks:
    """What the run layer does at the session's moments (every callable runs on every rank)."""

    beat: Callable[[int, str], None]  #: heartbeat: (step, phase)
    at_step_start: Callable[[int], None]  #: injected faults of the step (crash, hang)
    after_step: Callable[[int], None] = lambda step: None  #: injected slowness, inside the next step's work
    on_metrics: Callable[[int, Any], None]  #: (step, StepMetrics): rows and progress
    on_process_group: Callable[[], None] = lambda: None  #: the script's process group now exists
    install_faults: Callable[[Any], None] = lambda module: None  #: gradient-side faults on the model
    #: (module, loss_of, device, device names, monitor) -> the replay audit's rounds, or None when switched off
    make_replay: Callable[[Any, Any, Any, list[str], Any], Any] = lambda module, loss_of, device, names, monitor: None

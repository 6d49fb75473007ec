"""What reaches the console while a probe runs: the launcher's progress line and, at the end, the report.

Under healthcheck's own launcher every worker writes its stdout and stderr (the script's prints,
``transformers``' progress bars and warnings, a traceback) to ``RUN_DIR/logs/rank-<r>.log`` instead of
the console, where 8 ranks would repeat everything 8 times; ``--verbose`` keeps them on the console.
The launcher shows progress itself, read off rank 0's heartbeats. Under torchrun there is no launcher
of ours, so nothing is redirected and rank 0 prints the progress line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from healthcheck.run.progress import StepProgress
from healthcheck.run.watchdog import PHASES, RankBeat

LOGS_DIR = "logs"


def redirect_worker_output(run_dir: Path, rank: int) -> Path:
    """Send this process's stdout and stderr (the file descriptors, so C and child output too) to its log."""
    folder = run_dir / LOGS_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"rank-{rank}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def steps_done(beat: RankBeat) -> int:
    """Optimizer steps a rank has finished, from its heartbeat (a step counts once it reached the optimizer).

    >>> steps_done(RankBeat(0, 4, "optimizer", 1, 0.0)), steps_done(RankBeat(0, 4, "compute", 1, 0.0))
    (5, 4)
    """
    if beat.step < 0:
        return 0
    return beat.step + 1 if PHASES.index(beat.phase) >= PHASES.index("optimizer") else beat.step


class HeartbeatProgress:
    """The launcher's progress line: rank 0's finished steps, as its heartbeats report them."""

    def __init__(self, name: str, total_steps: int):
        self.progress: Optional[StepProgress] = None
        self.name, self.total = name, total_steps
        self.done = 0

    def update(self, beats: list[RankBeat]) -> None:
        lead = next((b for b in beats if b.rank == 0 and b.phase in PHASES), None)
        if lead is None or lead.step < 0:
            return
        if self.progress is None:  # timed from the first beat, so start-up does not count as slow steps
            self.progress = StepProgress(self.name, self.total, start_done=steps_done(lead))
        if steps_done(lead) > self.done:
            self.done = steps_done(lead)
            self.progress.advance(self.done)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()

"""Rank 0's live progress: a rich bar on a terminal, a plain line every ~10% in a CI log."""

from __future__ import annotations

import sys
import time


class StepProgress:
    """Progress over ``total_steps``; the rate counts the steps after ``start_done`` (those done when it is made).

    Why ``start_done``: the launcher's line starts at rank 0's first heartbeat, often after its first step has
    finished. Counting that step against the moments since would print thousands of steps a second.

    >>> import io
    >>> out = io.StringIO()
    >>> progress = StepProgress("default", 10, stream=out, start_done=1)
    >>> progress.advance(1)
    >>> print(out.getvalue(), end="")
    probe default: step 1/10
    """

    def __init__(self, name: str, total_steps: int, stream=None, start_done: int = 0):
        self.name, self.total = name, total_steps
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self.start_done = start_done
        self._last_reported = 0
        self._bar = None
        if self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"probe {name}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:.1f} steps/s"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self._task = self._bar.add_task("steps", total=total_steps, rate=0.0)
            self._bar.start()

    def rate(self, done: int) -> float:
        """Steps a second since this was made; 0 while no step has finished since then."""
        elapsed = time.perf_counter() - self.started
        steps = done - self.start_done
        return steps / elapsed if elapsed > 0 and steps > 0 else 0.0

    def advance(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, rate=self.rate(done))
            return
        if done == self.total or done - self._last_reported >= max(1, self.total // 10):
            self._last_reported = done
            rate = self.rate(done)
            pace = f"  {rate:.1f} steps/s  ETA {(self.total - done) / rate:.0f}s" if rate > 0 else ""
            print(f"probe {self.name}: step {done}/{self.total}{pace}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

"""Rank 0's live progress: a rich bar on a terminal, a plain line every ~10% in a CI log."""

from __future__ import annotations

import sys
import time


class StepProgress:
    def __init__(self, name: str, total_steps: int, stream=None):
        self.name, self.total = name, total_steps
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
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
        elapsed = time.perf_counter() - self.started
        return done / elapsed if elapsed > 0 else 0.0

    def advance(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, rate=self.rate(done))
            return
        if done == self.total or done - self._last_reported >= max(1, self.total // 10):
            self._last_reported = done
            rate = self.rate(done)
            eta = (self.total - done) / rate if rate > 0 else float("nan")
            print(f"probe {self.name}: step {done}/{self.total}  {rate:.1f} steps/s  ETA {eta:.0f}s", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

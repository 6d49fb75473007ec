"""Hang detection: workers leave heartbeats, the launcher's watchdog ends a probe that stops moving.

Each rank rewrites ``RUN_DIR/heartbeat/rank-<r>.json`` (step, phase, pid) at every phase of every
step. When no heartbeat changes for ``distributed.timeout_s``, the watchdog kills the workers so the
launcher returns, and names the rank(s) that lag: when one rank sleeps or spins, the others wait
in a later phase of the same step (their next collective), so the least advanced rank is the
suspect. A gloo/NCCL timeout would also end the probe, but it cannot say who hung. Before it kills,
the watchdog asks every rank for its Python stacks (:mod:`.stacks`) and adds where each one waits.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from healthcheck.ranks import ranks_phrase
from healthcheck.run import stacks

HEARTBEAT_DIR = "heartbeat"
#: Phases of one step, in order; a rank further along has a higher (step, phase index).
#: "backward" is the final micro-step's backward, where DDP's all-reduce runs: a rank waiting there
#: for a peer is distinguishable from the peer still computing.
#: "script" is a --script probe's worker before its first optimizer step; "replay" is the replay audit's
#: extra forward and backward (and its collectives), before the step's own.
PHASES = ("start", "script", "compute", "replay", "backward", "sync", "optimizer")


class Heartbeat:
    """Worker side: one small file per rank, replaced atomically so the watchdog never reads half."""

    def __init__(self, run_dir: Path, rank: int):
        self.folder = run_dir / HEARTBEAT_DIR
        self.folder.mkdir(exist_ok=True)
        self.path = self.folder / f"rank-{rank}.json"
        self.tmp = self.folder / f".rank-{rank}.tmp"
        self.rank = rank
        stacks.arm(run_dir, rank)  # before the first beat publishes the pid the watchdog may signal
        self.beat(-1, "start")

    def beat(self, step: int, phase: str) -> None:
        self.tmp.write_text(json.dumps({"rank": self.rank, "step": step, "phase": phase, "pid": os.getpid(), "time": time.time()}))
        os.replace(self.tmp, self.path)


@dataclass
class RankBeat:
    rank: int
    step: int
    phase: str
    pid: int
    time: float

    @property
    def progress(self) -> tuple[int, int]:
        return (self.step, PHASES.index(self.phase) if self.phase in PHASES else 0)


def read_beats(run_dir: Path) -> list[RankBeat]:
    beats = []
    for path in sorted((run_dir / HEARTBEAT_DIR).glob("rank-*.json")):
        try:
            beats.append(RankBeat(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return beats


def before_first_step(phase: str) -> str:
    """Where a rank that has not begun a step is, by its heartbeat phase: a --script worker beats "script" from
    its start (the user's code is running), any other is still in healthcheck's start-up.

    >>> before_first_step("script"), before_first_step("start")
    ('the script, before its first optimizer step', 'start-up')
    """
    return "the script, before its first optimizer step" if phase == "script" else "start-up"


def describe_hang(beats: list[RankBeat], expected_ranks: int, idle_s: float) -> str:
    """One line: which rank(s) lag, where, and what the others are doing.

    >>> b = [RankBeat(0, 5, "sync", 1, 0.0), RankBeat(1, 5, "compute", 2, 0.0), RankBeat(2, 5, "sync", 3, 0.0)]
    >>> describe_hang(b, 3, 30.0)
    'no progress for 30 s: rank 1 stuck in step 5 (compute) while ranks 0, 2 wait in step 5 (sync)'
    """
    seen = {b.rank for b in beats}
    missing = sorted(set(range(expected_ranks)) - seen)
    if missing:
        return f"no progress for {idle_s:.0f} s: {ranks_phrase(missing)} never reached training (stuck in start-up)"
    if not beats:
        return f"no progress for {idle_s:.0f} s before any worker started"
    lowest = min(b.progress for b in beats)
    laggards = [b for b in beats if b.progress == lowest]
    others = [b for b in beats if b.progress != lowest]
    first = laggards[0]
    where = f"step {first.step} ({first.phase})" if first.step >= 0 else before_first_step(first.phase)
    if not others:
        return f"no progress for {idle_s:.0f} s: every rank stuck in {where}"
    ahead = max(others, key=lambda b: b.progress)
    return (
        f"no progress for {idle_s:.0f} s: {ranks_phrase([b.rank for b in laggards])} stuck in {where} "
        f"while {ranks_phrase([b.rank for b in others])} {'waits' if len(others) == 1 else 'wait'} "
        f"in step {ahead.step} ({ahead.phase})"
    )


class Watchdog:
    """Launcher side: a daemon thread that kills the workers after ``timeout_s`` without a heartbeat.

    Start-up has its own, shorter limit: a rank writes its first heartbeat as soon as its process
    group exists, which takes seconds. One that has not after ``startup_timeout_s`` is stuck before
    training (``stalled_in_startup``), and the launcher may safely start the workers again.
    """

    def __init__(
        self,
        run_dir: Path,
        nproc: int,
        timeout_s: float,
        poll_s: float = 0.5,
        startup_timeout_s: float | None = None,
        on_poll: Callable[[list[RankBeat]], None] | None = None,
    ):
        self.run_dir, self.nproc, self.timeout_s, self.poll_s = run_dir, nproc, timeout_s, poll_s
        #: Called with every poll's heartbeats (the launcher's progress line reads them).
        self.on_poll = on_poll
        self.startup_timeout_s = min(startup_timeout_s or timeout_s, timeout_s)
        self.fired: str | None = None
        self.stalled_in_startup = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="healthcheck-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        started = last_change = time.monotonic()
        last_signature = None
        while not self._stop.wait(self.poll_s):
            beats = read_beats(self.run_dir)
            if self.on_poll is not None:
                self.on_poll(beats)
            waited = time.monotonic() - started
            if len(beats) < self.nproc and waited >= self.startup_timeout_s:
                missing = sorted(set(range(self.nproc)) - {b.rank for b in beats})
                self.fired = (
                    f"{ranks_phrase(missing)} did not join the process group within {waited:.0f} s of launch "
                    f"(distributed.startup_timeout_s); stuck in start-up"
                )
                self.stalled_in_startup = True
                self._kill(beats)
                return
            signature = tuple((b.rank, b.step, b.phase, b.time) for b in beats)
            if signature != last_signature:
                last_signature, last_change = signature, time.monotonic()
                continue
            idle = time.monotonic() - last_change
            if idle >= self.timeout_s:
                self.fired = describe_hang(beats, self.nproc, idle)
                waits = stacks.describe(stacks.request(self.run_dir, {b.rank: b.pid for b in beats}))
                if waits:
                    self.fired += f"; {waits} (stacks: {self.run_dir / stacks.STACKS_DIR})"
                self._kill(beats)
                return

    @staticmethod
    def _kill(beats: list[RankBeat]) -> None:
        # SIGKILL: a hung rank may be blocked in C++ (a collective) where SIGTERM handlers never run.
        # The elastic agent then sees the dead worker and tears the rest down. Workers are forked
        # from this process, so its children cover ranks that never wrote a heartbeat.
        for pid in {b.pid for b in beats} | set(child_pids(os.getpid())):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


def child_pids(parent: int) -> list[int]:
    """Direct children of ``parent``, from /proc (Linux; elsewhere only heartbeat pids are known)."""
    children = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            children.append(int(entry.parent.name))
    return children

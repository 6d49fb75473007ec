"""Where each rank waits when a probe hangs: Python stacks dumped on request, read by the watchdog.

A hang in a user's stack is most often a collective mismatch: one rank calls a collective the others
do not (a per-rank setting that changes a trainer's code path), and every rank blocks. The heartbeats
say only that no rank moves. Before the watchdog kills the workers, it asks each for its stacks
(a real-time signal, :data:`DUMP_SIGNAL`, answered by :mod:`faulthandler` in C, so a main thread
blocked inside a gloo or NCCL wait still answers) and names, per rank, the collective and the code that called it.

Each rank's dump is ``RUN_DIR/stacks/rank-<r>.txt``: a first line naming the main thread, then
faulthandler's text. The reading half is pure text, tested without signals.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from healthcheck.ranks import ranks_phrase

STACKS_DIR = "stacks"
#: Not SIGUSR1/SIGUSR2: SLURM requeue handlers (Lightning, submitit) claim those, and a script that replaces
#: the handler would silently take the request. None where the platform has no real-time signals.
DUMP_SIGNAL: Optional[int] = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
_MAIN_LINE = re.compile(r"^main (0x[0-9a-f]+)$")
_THREAD_LINE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME_LINE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.+)$')
#: A frame of a Python traceback (``traceback.format_exception``), outermost first.
_TRACEBACK_LINE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.+)$')
#: Frames in these files are the machinery between a caller and the wait, not the call site (wait_clock
#: is healthcheck's transparent timer around a script's collectives, clipping its recorder around the clip functions).
_MACHINERY = ("/torch/", "/multiprocessing/", "/threading.py", "/concurrent/", "/healthcheck/measure/wait_clock.py",
              "/healthcheck/integrations/script/clipping.py")
_COLLECTIVES = ("/torch/distributed/", "/torch/nn/parallel/")
# torch wraps its collectives in logging decorators; the collective is the frame they wrap. ``__call__`` is an
# operator's dispatch (``torch/_ops.py``): a DTensor's collective waits in ``wait_tensor`` under it, and a rank
# clipping FSDP2's sharded gradients was said to wait "in __call__", as if outside any collective.
_WRAPPERS = {"wrapper", "inner", "_fn", "_exception_logger", "_time_logger", "decorate_context", "__call__"}
_armed: Optional[IO[str]] = None


def arm(run_dir: Path, rank: int) -> None:
    """Worker side: answer :data:`DUMP_SIGNAL` with this process's stacks in ``RUN_DIR/stacks/rank-<r>.txt``.

    Call it before the pid is published (the heartbeat), so no signal reaches an unarmed worker,
    whose default action would be to die silently.
    """
    global _armed
    if DUMP_SIGNAL is None or not hasattr(faulthandler, "register"):  # a hang is then described without stacks
        return
    path = dump_path(run_dir, rank)
    path.parent.mkdir(exist_ok=True)
    if _armed is not None:
        _armed.close()
    _armed = open(path, "w")
    _armed.write(f"main {threading.main_thread().ident:#x}\n")
    _armed.flush()
    faulthandler.register(DUMP_SIGNAL, file=_armed, all_threads=True)


def dump_path(run_dir: Path, rank: int) -> Path:
    return run_dir / STACKS_DIR / f"rank-{rank}.txt"


def request(run_dir: Path, pids: dict[int, int], wait_s: float = 3.0) -> dict[int, str]:
    """Launcher side: signal each rank's pid, wait until its dump stops growing; rank -> dump text.

    Ranks that do not answer within ``wait_s`` (dead, or a platform without faulthandler) are left out.
    """
    sizes: dict[int, int] = {}
    for rank, pid in pids.items():
        try:
            before = dump_path(run_dir, rank).stat().st_size
            assert DUMP_SIGNAL is not None  # a stacks file exists only where arm() could register
            os.kill(pid, DUMP_SIGNAL)
        except OSError:  # no stacks file (never armed), or the process is gone: nothing to wait for
            continue
        sizes[rank] = before
    dumps: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    last: dict[int, int] = {}
    while sizes.keys() - dumps.keys() and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank in sizes.keys() - dumps.keys():
            path = dump_path(run_dir, rank)
            size = path.stat().st_size if path.exists() else 0
            # faulthandler writes the whole dump from one signal handler; two equal sizes mean it is done.
            if size > sizes[rank] and last.get(rank) == size:
                dumps[rank] = path.read_text(errors="replace")
            last[rank] = size
    return dumps


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str


def main_stack(dump: str) -> list[Frame]:
    """The main thread's frames, innermost first, from the last dump in the text.

    >>> text = '''main 0x7f01
    ... Thread 0x00007f02 (most recent call first):
    ...   File "/usr/lib/python3.11/threading.py", line 320 in wait
    ...
    ... Current thread 0x00007f01 (most recent call first):
    ...   File "/venv/site-packages/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
    ...   File "/work/train.py", line 52 in main
    ... '''
    >>> [f.func for f in main_stack(text)]
    ['all_reduce', 'main']
    """
    lines = dump.splitlines()
    main = next((m.group(1) for line in lines if (m := _MAIN_LINE.match(line))), None)
    stacks: dict[int, list[Frame]] = {}
    current: Optional[list[Frame]] = None
    for line in lines:
        if thread := _THREAD_LINE.match(line):
            current = stacks[int(thread.group(1), 16)] = []  # a later dump replaces an earlier one
        elif current is not None and (frame := _FRAME_LINE.match(line)):
            current.append(Frame(frame["file"], int(frame["line"]), frame["func"]))
    if main is not None and int(main, 16) in stacks:
        return stacks[int(main, 16)]
    return max(stacks.values(), key=len, default=[])


def traceback_stacks(text: str) -> list[list[Frame]]:
    """The frames of each traceback in a formatted exception, innermost first: a chained exception's in the order
    printed, the one it was handling first.

    >>> text = '''Traceback (most recent call last):
    ...   File "/w/train.py", line 9, in main
    ...     dist.all_gather(out, t)
    ...   File "/v/torch/distributed/distributed_c10d.py", line 4287, in all_gather
    ...     work.wait()
    ... RuntimeError: Connection closed by peer'''
    >>> [[f.func for f in stack] for stack in traceback_stacks(text)]
    [['all_gather', 'main']]
    """
    stacks = []
    for part in text.split("Traceback (most recent call last):")[1:]:
        frames = [Frame(m["file"], int(m["line"]), m["func"]) for line in part.splitlines() if (m := _TRACEBACK_LINE.match(line))]
        stacks.append(frames[::-1])
    return stacks


def short_path(path: str) -> str:
    """A file as a reader names it: from its top-level package (installed, or a source tree's folders with
    ``__init__.py``), else its file name.

    >>> short_path("/venv/lib/python3.11/site-packages/trl/trainer/sft_trainer.py"), short_path("/nowhere/train.py")
    ('trl/trainer/sft_trainer.py', 'train.py')
    """
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    parts = Path(path).parts
    top = len(parts) - 1
    while top > 1 and (Path(*parts[:top]) / "__init__.py").is_file():
        top -= 1
    return "/".join(parts[top:])


def where_waiting(frames: list[Frame]) -> str:
    """One phrase for a main-thread stack: the collective (or innermost call) and the code that made it.

    >>> where_waiting([Frame("/x/torch/distributed/c10d_logger.py", 81, "wrapper"),
    ...                Frame("/x/torch/distributed/distributed_c10d.py", 3340, "all_gather"),
    ...                Frame("/x/site-packages/accelerate/utils/operations.py", 380, "_gpu_gather_one"),
    ...                Frame("/x/site-packages/trl/trainer/sft_trainer.py", 1034, "compute_loss"),
    ...                Frame("/work/train.py", 9, "main")])
    'all_gather, called from accelerate/utils/operations.py:380 (_gpu_gather_one) in trl/trainer/sft_trainer.py:1034 (compute_loss)'
    >>> where_waiting([Frame("/w/me/data.py", 7, "load"), Frame("/w/me/train.py", 30, "main")])
    'data.py:7 (load) in train.py:30 (main)'
    """
    if not frames:
        return "no Python stack"
    # A --script worker runs the script through runpy: the frames beyond it are healthcheck's runner.
    frames = frames[: next((i for i, f in enumerate(frames) if i and f.file == "<frozen runpy>"), len(frames))]
    wait = _innermost_torch(frames)
    start = frames.index(wait) if wait else 0
    callers = [f for f in frames[start:] if not any(part in f.file for part in _MACHINERY)]
    if not callers:
        return wait.func if wait else _site(frames[0])
    # The first caller outside torch, and the first after it from another package: a library's gather
    # helper alone would not say which trainer code path called it.
    first = callers[0]
    package = short_path(first.file).split("/")[0]
    outer = next((f for f in callers[1:] if short_path(f.file).split("/")[0] != package), None)
    phrase = f"{wait.func}, called from {_site(first)}" if wait else _site(first)
    return phrase + (f" in {_site(outer)}" if outer is not None else "")


def _site(frame: Frame) -> str:
    return f"{short_path(frame.file)}:{frame.line} ({frame.func})"


def describe(dumps: dict[int, str]) -> Optional[str]:
    """Ranks grouped by where they wait, or None without a single stack.

    >>> head = "main 0x1\\nCurrent thread 0x1 (most recent call first):\\n"
    >>> a = head + '  File "/t/torch/distributed/distributed_c10d.py", line 5 in all_reduce\\n  File "/w/train.py", line 9 in f\\n'
    >>> describe({0: a, 1: a, 2: a.replace("all_reduce", "broadcast").replace("line 9", "line 12")})  # doctest: +NORMALIZE_WHITESPACE
    'collective mismatch: ranks 0-1 wait in all_reduce, called from train.py:9 (f);
     rank 2 waits in broadcast, called from train.py:12 (f)'
    """
    groups: dict[str, list[int]] = {}
    collectives: set[str] = set()
    for rank, dump in sorted(dumps.items()):
        frames = main_stack(dump)
        if frames:
            groups.setdefault(where_waiting(frames), []).append(rank)
        if in_collective(frames):
            collectives.add(where_waiting(frames))
    if not groups:
        return None
    parts = [f"{ranks_phrase(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in {where}" for where, ranks in groups.items()]
    # Every rank blocked, in different collectives: they can never match. The usual cause is a code path
    # that differs between ranks, so this is said first.
    mismatch = len(groups) > 1 and collectives == groups.keys()
    return ("collective mismatch: " if mismatch else "") + "; ".join(parts)


def in_collective(frames: list[Frame]) -> bool:
    """Whether the innermost torch frame (wrappers aside) is a collective or DDP's communication."""
    return collective_of(frames) is not None


def collective_of(frames: list[Frame]) -> Optional[str]:
    """The function of the collective (or DDP communication) the innermost torch frame is in, or None."""
    wait = _innermost_torch(frames)
    return wait.func if wait is not None and any(part in wait.file for part in _COLLECTIVES) else None


def _innermost_torch(frames: list[Frame]) -> Optional[Frame]:
    """The innermost torch frame that is not a decorator, when the stack ends in torch (a wait in user
    code with torch further out, e.g. under the elastic launcher, is not a wait in torch)."""
    leading = []
    for frame in frames:
        if "/torch/" not in frame.file:
            break
        leading.append(frame)
    return next((f for f in leading if f.func not in _WRAPPERS), None)


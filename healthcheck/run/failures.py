"""Why a probe did not finish, in one line: the failed worker's own report, and the launcher's view.

A failing worker writes :class:`~healthcheck.artifacts.WorkerFailure` to ``RUN_DIR/errors/rank-<r>.json``
(and its traceback beside it) before it dies; :func:`describe_failure` reads them back and names
the rank and step that caused the failure, not the peers that failed because of it.
"""

from __future__ import annotations

import re
import signal
import time
import traceback
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from healthcheck.artifacts import WorkerFailure
from healthcheck.errors import one_line
from healthcheck.judge.audit_outcome import ranks_phrase
from healthcheck.judge.summary import summarize_run
from healthcheck.run.console import LOGS_DIR
from healthcheck.run.stacks import collective_of, in_collective, main_stack, traceback_stacks, where_waiting
from healthcheck.run.watchdog import before_first_step, read_beats

ERRORS_DIR = "errors"

#: Errors a rank raises because a *peer* went away: symptoms, not the cause.
PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker crashing",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "Timed out",
)


def record_worker_failure(run_dir: Path, rank: int, step: Optional[int], exc: BaseException) -> None:
    """Leave ``errors/rank-<r>.json`` (one-line reason, step) and the traceback for the launcher to report."""
    try:
        folder = run_dir / ERRORS_DIR
        folder.mkdir(exist_ok=True)
        report = WorkerFailure(
            rank=rank,
            step=step,
            reason=f"{type(exc).__name__}: {one_line(exc)}"[:500],
            time=time.time(),
            exit_code=int(getattr(exc, "exit_code", 3)),  # InvalidInput keeps its exit 2
            raised_in=raised_in_healthcheck(exc),
        )
        (folder / f"rank-{rank}.json").write_text(report.model_dump_json())
        (folder / f"rank-{rank}.traceback.txt").write_text("".join(traceback.format_exception(exc)))
    except OSError:
        pass  # the launcher still reports the exit code


def raised_in_healthcheck(exc: BaseException) -> Optional[str]:
    """``healthcheck/<module>.py:<line>`` when ``exc`` is an unexpected error raised by healthcheck's own code, else None.

    A probe runs the script's training with healthcheck's hooks inside it, so an error in a hook kills the script
    and reads as the script's: ``AttributeError: 'NoneType' object has no attribute 'detach'`` sent a user to debug a
    script that trained fine alone. Only the raise site counts (the innermost frame): an error that torch or the
    script raises under a healthcheck wrapper (a patched ``F.cross_entropy`` given bad labels) is not healthcheck's.
    Nor is an error healthcheck raises on purpose, with a ``raise`` statement (bad input, a refused script, the end
    of the probe): its message says what to do.

    >>> from healthcheck.measure.metrics import as_matrix
    >>> from healthcheck.ranks import rank_span
    >>> try:
    ...     rank_span(None)
    ... except TypeError as exc:
    ...     print(raised_in_healthcheck(exc).split(":")[0])
    healthcheck/ranks.py
    >>> try:
    ...     as_matrix([[1.0, 2.0]])
    ... except ValueError as exc:  # on purpose
    ...     print(raised_in_healthcheck(exc))
    None
    >>> raised_in_healthcheck(ValueError("the script's own")) is None  # never raised: no frame
    True
    """
    from healthcheck.errors import HealthcheckError

    if isinstance(exc, (HealthcheckError, KeyboardInterrupt, SystemExit)) or exc.__traceback__ is None:
        return None
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    package = Path(__file__).resolve().parents[1]
    try:
        where = Path(frame.filename).resolve().relative_to(package)
    except ValueError:
        return None
    if (frame.line or "").lstrip().startswith("raise"):
        return None
    return f"{package.name}/{where.as_posix()}:{frame.lineno}"


def read_worker_failures(run_dir: Path) -> list[WorkerFailure]:
    """Every readable ``errors/rank-<r>.json``; a torn or foreign file is skipped."""
    reports = []
    for path in (run_dir / ERRORS_DIR).glob("rank-*.json"):
        try:
            reports.append(WorkerFailure.model_validate_json(path.read_bytes()))
        except (OSError, ValidationError):
            continue
    return reports


def input_error_in_workers(run_dir: Path) -> Optional[str]:
    """The reason, when the first failing worker rejected its input (exit 2, not a crash).

    Some inputs can only be checked where the worker runs (a device that this node lacks, a
    dataset that does not tokenize); those are bad input, not a probe that could not finish.
    """
    reports = read_worker_failures(run_dir)
    if not reports:
        return None
    first = min(reports, key=lambda r: r.time)
    if first.exit_code != 2:
        return None
    return first.reason.split(": ", 1)[-1]


def describe_failure(run_dir: Path, launcher_message: str, signals: Optional[dict[int, int]] = None) -> str:
    """Name the rank and step that died, not the peers that failed because of it.

    In order: a rank the launcher saw die by a signal; the earliest report that is not a peer
    failure; a rank that left no report while its peers report broken connections (killed by a
    signal or the OOM killer before the launcher noticed); the launcher's own view.
    """
    beats = {beat.rank: beat for beat in read_beats(run_dir)}

    def before_steps(rank: int) -> str:
        beat = beats.get(rank)
        place = before_first_step(beat.phase if beat else "start")
        return "during start-up" if place == "start-up" else f"in {place}"

    def where(rank: int) -> str:
        beat = beats.get(rank)
        return f"in step {beat.step} ({beat.phase})" if beat and beat.step >= 0 else before_steps(rank)

    for rank, signum in sorted((signals or {}).items()):
        words = _last_words(run_dir, rank)
        line = f"rank {rank} was killed by signal {signum} ({_signal_name(signum)}) {where(rank)}{words}"
        return line + (_collectives(run_dir, rank) if "mismatch" in words else "")
    reports = read_worker_failures(run_dir)
    causes = [r for r in reports if not any(marker in r.reason for marker in PEER_FAILURE_MARKERS)]
    if causes:
        first = min(causes, key=lambda r: r.time)
        at = f"at step {first.step}" if first.step is not None else before_steps(first.rank)
        alike = [r.rank for r in causes if r.reason == first.reason and r.step == first.step]
        # Every rank failing alike (a check every rank makes, an error in the script's shared code) is not one
        # rank's fault: naming the fastest reporter would point at the wrong rank.
        who = "every rank" if len(alike) == len(beats) > 1 else f"rank {first.rank}"
        return f"{who} failed {at}: {first.reason}{_internal(first)}"
    silent = sorted(set(beats) - {r.rank for r in reports})
    if reports and silent:
        ranks = ", ".join(map(str, silent))
        peers = ", ".join(str(r.rank) for r in sorted(reports, key=lambda r: r.rank))
        words = _last_words(run_dir, silent[0])
        return (
            f"rank {ranks} died without an error report {where(silent[0])}"
            f"{words or ' (killed by a signal or the OOM killer?)'}; rank {peers} then lost the connection to it"
        )
    if reports:
        first = min(reports, key=lambda r: r.time)
        return f"rank {first.rank} failed at step {first.step}: {first.reason}{_internal(first)}"
    last = summarize_run(run_dir, 0)["last_step"]
    return f"{launcher_message} (last recorded step {last}, so it died in step {last + 1})"


def _collectives(run_dir: Path, dead: int) -> str:
    """``"; collective mismatch: ranks 0, 2-3 in ...; rank 1 in ..."`` for a rank that died of a mismatch: where every
    rank was, the dead one from its log, the others from their tracebacks (their collective failed when its connection
    closed; one the agent's SIGTERM stopped while it handled that error, where the error was raised). The rank that died saw
    the mismatch first, and is not necessarily the one whose code path differs: a Trainer rank 1 with its own
    ``average_tokens_across_devices`` skipped an all_gather the others made, and rank 2 died of it."""
    stacks = {dead: main_stack(_log_tail(run_dir, dead))}
    for path in (run_dir / ERRORS_DIR).glob("rank-*.traceback.txt"):
        rank = int(path.name.split(".")[0].removeprefix("rank-"))
        # The exception a rank was handling when the agent's SIGTERM stopped it holds the collective.
        tracebacks = traceback_stacks(path.read_text(errors="replace"))
        stacks.setdefault(rank, next((frames for frames in tracebacks if in_collective(frames)), []))
    # Grouped by the collective alone: a traceback caught inside torch's logging wrapper stops there, without callers.
    groups: dict[str, list[int]] = {}
    places: dict[str, str] = {}
    for rank, frames in sorted(stacks.items()):
        if (collective := collective_of(frames)) is not None:
            groups.setdefault(collective, []).append(rank)
            places[collective] = max(places.get(collective, ""), where_waiting(frames), key=len)
    if len(groups) < 2:
        return ""
    return "; collective mismatch: " + "; ".join(f"{ranks_phrase(ranks)} in {places[c]}" for c, ranks in groups.items())


def _internal(report: WorkerFailure) -> str:
    """The clause that puts an error raised in healthcheck's own code on healthcheck, not on the script."""
    if report.raised_in is None:
        return ""
    return (
        f" (raised in healthcheck's own code, {report.raised_in}, not by the script: a healthcheck bug; please report it "
        f"with {ERRORS_DIR}/rank-{report.rank}.traceback.txt)"
    )


#: gloo's prefix on its enforce messages: a source location in torch's build tree, of no use to the reader.
_ENFORCE_AT = re.compile(r"^\[enforce fail at [^]]*\] ")


def _last_words(run_dir: Path, rank: int) -> str:
    """``": <what the rank printed as it died>"`` from its log (when the console was quiet), or ``""``."""
    words = dying_words(_log_tail(run_dir, rank))
    return f": {words}" if words else ""


def _log_tail(run_dir: Path, rank: int) -> str:
    """The last 64 KiB of a rank's console log, or ``""``."""
    try:
        with open(run_dir / LOGS_DIR / f"rank-{rank}.log", "rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 65536))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def dying_words(log: str) -> Optional[str]:
    """What a process that died without a Python exception printed last: a C++ exception's type and ``what()``
    (a gloo enforce, an NCCL error), or faulthandler's fatal error, with where its main thread was.

    >>> dying_words('''terminate called after throwing an instance of 'gloo::EnforceNotMet'
    ...   what():  [enforce fail at pair.cc:456] op.nbytes. 32800 vs 16400. Is there a collective mismatch?
    ... Fatal Python error: Aborted
    ...
    ... Thread 0x00007f2b9e53cb80 (most recent call first):
    ...   File "/v/site-packages/torch/distributed/distributed_c10d.py", line 4394 in all_gather_single
    ...   File "/w/train.py", line 76 in main
    ... ''')
    'gloo::EnforceNotMet: op.nbytes. 32800 vs 16400. Is there a collective mismatch? (in all_gather_single, called from train.py:76 (main))'
    """
    lines = log.splitlines()
    cpp = [i for i, line in enumerate(lines) if line.startswith("terminate called after throwing an instance of")]
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")]
    words = None
    if cpp:
        kind = lines[cpp[-1]].split("instance of", 1)[1].strip().strip("'")
        what = next((line.split("what():", 1)[1].strip() for line in lines[cpp[-1] + 1 : cpp[-1] + 3] if "what():" in line), "")
        words = f"{kind}: {_ENFORCE_AT.sub('', what)}".rstrip(": ")
    elif fatal:
        words = lines[fatal[-1]].removeprefix("Fatal Python error: ").strip()
    if words is None:
        return None
    if fatal and (frames := main_stack("\n".join(lines[fatal[-1] :]))):
        words += f" (in {where_waiting(frames)})"
    return one_line(words)[:600]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"

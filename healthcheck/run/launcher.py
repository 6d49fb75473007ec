"""The launcher side of a probe: forking the local workers through torch's elastic launcher, turning
signals into a clean interrupt, and describing a failed child in one line.

This is the code path torchrun takes; under an external torchrun none of it runs and each process
joins as one worker (:mod:`healthcheck.measure.distributed`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import tempfile
import threading
from typing import Any, Callable, Iterator

from healthcheck.errors import ProbeFailed
from healthcheck.measure.distributed import LOOPBACK


def quiet_elastic_logs() -> None:
    """Keep the launcher's own logging out of the CI log.

    The elastic agent logs every rendezvous at INFO and a failed worker's whole traceback at
    ERROR; healthcheck reports failures itself in one line (rank, step, reason) and keeps the
    traceback in ``RUN_DIR/errors/``.
    """
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)


def launch_local(
    entrypoint: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    run_id: str = "healthcheck",
    start_method: str = "fork",
    monitor_interval_s: float = 0.1,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` on ``nproc`` local workers through torch's elastic launcher.

    This is the code path torchrun takes. The rendezvous listens on ``127.0.0.1:0`` so the OS
    picks a free port and two probes on one machine never collide. Workers are forked from this
    process: torch and transformers are imported once here instead of once per worker, which is
    what lets 8 ranks start on 2 cores in under a second. Each forked worker waits for its last sibling
    to be forked before it runs ``entrypoint`` (:class:`ForkGate`).

    Returns ``{rank: return value}``; raises :class:`ProbeFailed` naming the failed rank(s).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    quiet_elastic_logs()
    _protect_forked_workers()
    with launch_scratch() as (scratch, tempdir):
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=run_id,
            rdzv_backend="c10d",
            # Numeric loopback, never a host name: the workers are forked from a process whose threads
            # (the agent's store and keep-alive) may hold glibc's resolver lock at fork time, and a
            # child that then resolves "localhost" waits on that lock forever. A numeric address skips
            # the resolver, and MASTER_ADDR comes from local_addr instead of a getfqdn() lookup.
            rdzv_endpoint=f"{LOOPBACK}:0",
            local_addr=LOOPBACK,
            max_restarts=0,
            monitor_interval=monitor_interval_s,
            start_method=start_method,
            logs_specs=DefaultLogsSpecs(log_dir=scratch),
        )
        gate = ForkGate(nproc) if start_method == "fork" else None
        try:
            return elastic_launch(config, _after_every_fork)(gate, tempdir, entrypoint, *args)
        except ChildFailedError as exc:
            signals = {rank: -f.exitcode for rank, f in exc.failures.items() if f.exitcode is not None and f.exitcode < 0}
            raise ProbeFailed(describe_child_failure(exc), signals) from None


#: How long a forked worker waits for its siblings to be forked (:class:`ForkGate`) before it goes on anyway.
FORK_GATE_TIMEOUT_S = 30.0


class ForkGate:
    """Holds every forked worker until the launcher has forked all of them.

    Why: the elastic agent forks the workers one after another while the first ones already connect to its
    TCPStore, and torch's socket code formats each connection's address with ``getnameinfo``, a reverse lookup
    that takes glibc's resolver lock. A fork while a launcher thread holds that lock hands the child a lock
    nobody will release, and the child's own first connection then waits on it forever: one rank stuck in
    ``getnameinfo`` under ``TCPStore::TCPStore``, the rest waiting for it in gloo's rendezvous (py-spy dumps of
    stalled launches, ``benchmarks/startup_stalls.py --dump``; its stall counts are in the README's Reliability
    section). Once every worker exists, no fork is left to inherit the lock.
    """

    def __init__(self, parties: int):
        import multiprocessing

        # A fork context's barrier is shared memory and semaphores unlinked at creation: the workers inherit it,
        # and nothing is left to clean up after them.
        self._barrier = multiprocessing.get_context("fork").Barrier(parties)

    def wait(self, timeout_s: float = FORK_GATE_TIMEOUT_S) -> bool:
        """Block until every worker has arrived (True), or ``timeout_s`` passed (False: a sibling never started,
        which the process group's rendezvous and the watchdog report better than this could)."""
        try:
            self._barrier.wait(timeout_s)
        except threading.BrokenBarrierError:
            return False
        return True


def _after_every_fork(gate: ForkGate | None, tempdir: str | None, entrypoint: Callable[..., Any], *args: Any) -> Any:
    """A worker's entry point: through the :class:`ForkGate` first, before anything can resolve an address, and
    with the temporary folder the launcher had before :func:`launch_scratch` (a forked worker inherits the swap)."""
    tempfile.tempdir = tempdir
    if gate is not None:
        gate.wait()
    return entrypoint(*args)


@contextlib.contextmanager
def launch_scratch() -> Iterator[tuple[str, str | None]]:
    """A private folder for torch's launcher files, removed after the launch; yields it and the temporary
    folder setting it replaced.

    torch's launcher writes into the temporary folder and never removes what it wrote: a log tree per launch
    (``torchelastic_*``, empty unless a worker fails) and a pickled traceback per failed worker
    (``pytorch-errorfile-*.pickle``). A CI runner that probes on every job would keep them all. healthcheck
    already keeps a failed worker's traceback in ``RUN_DIR/errors/``, so nothing is lost with them. The log
    tree's folder is a parameter; the error files' is not (``torch.multiprocessing`` makes them in this
    process with :mod:`tempfile`), so the process's temporary folder points here for the launch. A forked
    worker sets it back first thing (:func:`_after_every_fork`): the script's own temporary files are the
    user's, and stay where the user's settings put them.
    """
    scratch = tempfile.mkdtemp(prefix="healthcheck-launch-")
    replaced = tempfile.tempdir
    tempfile.tempdir = scratch
    try:
        yield scratch, replaced
    finally:
        tempfile.tempdir = replaced
        shutil.rmtree(scratch, ignore_errors=True)


_fork_hook_installed = False


def _protect_forked_workers() -> None:
    """Keep a forked worker from running destructors of the launcher's garbage.

    A long-lived launcher (``baseline record``, the scenario sweeps, a test session) holds the
    dead objects of earlier launches: agents, TCPStore servers, process groups. A forked worker
    inherits them, and when its garbage collector frees them their C++ destructors act on threads
    and sockets that do not exist in the child: a segfault or a deadlock before the worker joins
    the process group. Collecting in the launcher first, and freezing everything a worker
    inherits (Python's documented fork recipe, ``gc.freeze``), means only the worker's own objects
    are ever collected in the worker.
    """
    global _fork_hook_installed
    gc.collect()
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=gc.freeze)
        _fork_hook_installed = True


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interrupts_as_keyboard_interrupt():
    """Treat SIGTERM like Ctrl-C while a probe runs, so both end in the same clean 'interrupted' path.

    While workers run, the elastic agent installs its own SIGTERM/SIGINT handlers, shuts the
    workers down and raises ``SignalException``; that too becomes ``KeyboardInterrupt`` here.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    if on_main_thread:
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        yield
    except SignalException as exc:
        raise KeyboardInterrupt(str(exc)) from None
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def describe_child_failure(exc) -> str:
    """One line naming each failed rank and why, from a ``ChildFailedError``."""
    parts = []
    for rank_id, failure in sorted(exc.failures.items()):
        message = failure.message
        if isinstance(message, dict):  # newer torch wraps the error file's message in a dict
            message = message.get("message", "")
        message = message if isinstance(message, str) else ""
        if not message or message.startswith("To enable traceback"):
            message = f"exit code {failure.exitcode}"
            if failure.exitcode is not None and failure.exitcode < 0:
                message = f"killed by signal {-failure.exitcode}"
        parts.append(f"rank {rank_id}: {message.strip().splitlines()[-1] if message.strip() else message}")
    return "worker failure: " + "; ".join(parts)


def prepare_fork() -> None:
    """Settings the launcher needs before it forks workers.

    The tokenizers library runs a Rust thread pool; after a fork its workers would deadlock, so
    the launcher disables it before it tokenizes anything.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

"""One worker of a ``--script`` probe: the user's training script, run unmodified under a ScriptSession.

The script runs as ``__main__`` with ``sys.argv = [path, *args]`` (``{seed}`` filled in), in the
user's working directory and environment, with the script's folder first on ``sys.path`` as
``python train.py`` would have it; a module (``script.module``) as ``python -m pkg.train`` runs it: the working
directory first on ``sys.path``, ``sys.argv[0]`` the module's file. :mod:`healthcheck.integrations.script.session` measures it; this
module supplies what the run layer owns: heartbeats, injected faults, the rows rank 0 writes, and
the one-line failure a rank leaves when the script raises or ends too soon.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from healthcheck.artifacts import AGGREGATES_FILE, STEPS_FILE, FailFastPolicy, WorkerReport
from healthcheck.config import ProbeConfig, resolve_for_rank
from healthcheck.errors import one_line
from healthcheck.files import JsonlWriter
from healthcheck.integrations.script.session import ProbeComplete, ScriptSession, SessionHooks
from healthcheck.integrations.script.uneven_inputs import InputsExhausted, ended_in_join
from healthcheck.measure import distributed as hdist
from healthcheck.run.console import redirect_worker_output
from healthcheck.run.failures import record_worker_failure
from healthcheck.run.faults import at_step_start, before_process_group, install_faults
from healthcheck.run.progress import StepProgress
from healthcheck.run.script_exit import StderrTail, exit_reason
from healthcheck.run.trainer import write_rows
from healthcheck.run.watchdog import Heartbeat


class ScriptEnded(RuntimeError):
    """The script returned or exited before the probe had its ``train.steps`` optimizer steps."""


def script_worker(
    config_json: str,
    run_dir: Optional[str],
    started_at: float,
    pg_timeout_s: Optional[float] = None,
    launch_attempt: int = 1,
    quiet_console: bool = False,
    fail_fast_json: Optional[str] = None,
    choose_run_dir: Optional[Callable[[], str]] = None,
) -> Optional[WorkerReport]:
    """Run the config's script on this rank; rank 0 returns the run's report.

    ``run_dir`` is known up front under healthcheck's own launcher; under torchrun it is None and
    ``choose_run_dir`` agrees on one (a collective) once the script has created its process group.
    ``quiet_console`` sends the script's output to its log in the run directory. ``fail_fast_json``: a
    :class:`~healthcheck.artifacts.FailFastPolicy` (None: run every step).
    """
    config = ProbeConfig.model_validate_json(config_json)
    if quiet_console and run_dir:
        redirect_worker_output(Path(run_dir), hdist.get_dist_info().rank)
    policy = FailFastPolicy.model_validate_json(fail_fast_json) if fail_fast_json else None
    worker = _ScriptRun(
        config, Path(run_dir) if run_dir else None, started_at, choose_run_dir, show_progress=not quiet_console, fail_fast=policy
    )
    try:
        return worker.run(launch_attempt)
    except BaseException as exc:
        if worker.run_dir is not None:
            record_worker_failure(worker.run_dir, hdist.get_dist_info().rank, worker.step, exc)
        raise


class _ScriptRun:
    def __init__(
        self,
        config: ProbeConfig,
        run_dir: Optional[Path],
        started_at: float,
        choose_run_dir: Optional[Callable[[], str]],
        show_progress: bool,
        fail_fast: Optional[FailFastPolicy],
    ):
        self.config, self.run_dir, self.started_at = config, run_dir, started_at
        self.fail_fast = fail_fast
        self.show_progress = show_progress
        self._step_marker: dict[str, Optional[int]] = {"step": 0}  #: the step in progress, for faults that start at a step
        self.choose_run_dir = choose_run_dir
        self.rank = hdist.get_dist_info().rank
        self.rank_config = resolve_for_rank(config, self.rank)
        self.step: Optional[int] = None
        self.heartbeat: Optional[Heartbeat] = None
        self.writers: Optional[tuple[JsonlWriter, JsonlWriter]] = None
        self.progress: Optional[StepProgress] = None

    def run(self, launch_attempt: int) -> Optional[WorkerReport]:
        assert self.config.script is not None
        before_process_group(self.rank_config.faults, launch_attempt)
        if self.run_dir is not None:
            self.heartbeat = Heartbeat(self.run_dir, self.rank)
            self.heartbeat.beat(-1, "script")
        hdist.set_worker_threads(hdist.get_dist_info().local_world_size)
        hooks = SessionHooks(
            beat=self._beat,
            at_step_start=self._at_step_start,
            after_step=self._after_step,
            on_metrics=self._on_metrics,
            on_process_group=self._on_process_group,
            install_faults=lambda module: install_faults(module, self.rank_config.faults, self._step_marker),
            make_replay=functools.partial(_build_rounds, self.config),
        )
        session = ScriptSession(self.config, hooks, self.started_at, fail_fast=self.fail_fast)
        script = self.config.script
        saved_argv, saved_path, saved_stderr = list(sys.argv), list(sys.path), sys.stderr
        sys.argv = script.argv(self.config.train.seed)
        sys.stderr = tail = StderrTail(sys.stderr)
        sys.path.insert(0, str(Path(script.path).resolve().parent) if script.path is not None else os.getcwd())
        ended = "returned"
        try:
            with session:
                try:
                    if script.module is not None:
                        runpy.run_module(script.module, run_name="__main__", alter_sys=True)
                    else:
                        runpy.run_path(str(script.path), run_name="__main__")
                except ProbeComplete:
                    pass
                except InputsExhausted:
                    raise ScriptEnded(ended_in_join(session.steps_done, self.config.train.steps)) from None
                except SystemExit as exc:
                    if session.complete:
                        pass
                    elif exc.code not in (None, 0):
                        raise ScriptEnded(
                            "the script " + exit_reason(exc.code, tail.last_line,
                                                        f"after {session.steps_done} of {self.config.train.steps} optimizer steps")
                        ) from None
                    else:
                        ended = "exited with status 0"
        finally:
            sys.argv, sys.path[:], sys.stderr = saved_argv, saved_path, saved_stderr
            self._close()
            hdist.destroy_distributed()
        if not session.complete:
            raise ScriptEnded(_ended_early(session.steps_done, self.config.train.steps, ended, session.model is not None,
                                           skipped=session.scales.skips))
        return session.report

    # ------------------------------------------------------------------ hooks

    def _on_process_group(self) -> None:
        if self.run_dir is None and self.choose_run_dir is not None:
            self.run_dir = Path(self.choose_run_dir())

    def _beat(self, step: int, phase: str) -> None:
        self.step = step
        if self.heartbeat is not None:
            self.heartbeat.beat(step, phase)

    def _at_step_start(self, step: int) -> None:
        at_step_start(self.rank_config.faults, step)

    def _after_step(self, step: int) -> None:
        self._step_marker["step"] = step + 1  # the forwards from here on are the next step's
        # Between the optimizer step and the next forward: part of this rank's own work.
        if self.rank_config.faults.step_sleep_ms:
            time.sleep(self.rank_config.faults.step_sleep_ms / 1000)

    def _on_metrics(self, step: int, metrics: Any) -> None:
        if self.rank != 0 or self.run_dir is None:
            return
        if self.writers is None:
            self.writers = (JsonlWriter(self.run_dir / STEPS_FILE), JsonlWriter(self.run_dir / AGGREGATES_FILE))
            # The first rows arrive a step late (the gather overlaps the next step): that step is not timed.
            self.progress = StepProgress(self.config.name, self.config.train.steps, start_done=step + 1) if self.show_progress else None
        # The aggregate row's learning rate is rank 0's, gathered with every rank's (the rows' lr).
        write_rows(self.writers, step, metrics, (metrics.per_rank_extras.get("lr") or [None])[0])
        if self.progress is not None:
            self.progress.advance(step + 1)

    def _close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.writers is not None:
            for writer in self.writers:
                writer.close()


def _ended_early(done: int, planned: int, how: str, built_ddp: bool, skipped: int = 0) -> str:
    """Why a script that stopped on its own is a probe that could not finish. ``skipped``: the updates its GradScaler
    skipped whole since the last probe step. Many in a row are the cause, not too little data: an inf or NaN gradient
    at every update (a rank whose gradients overflow at every step spreads its inf to every rank through the
    all-reduce, and every rank's scaler then skips), which more steps would not end.

    >>> _ended_early(0, 60, "returned", built_ddp=False)
    'the script returned without stepping an optimizer on a DistributedDataParallel model (the probe needs 60 steps)'
    >>> _ended_early(12, 60, "returned", built_ddp=True)
    "the script returned after 12 of the probe's 60 optimizer steps; give it more data or steps (or lower train.steps)"
    >>> _ended_early(2, 6, "returned", built_ddp=True, skipped=38).split("; ")[1]
    'its GradScaler skipped the last 38 updates whole: an inf or NaN gradient at every one'
    """
    if skipped >= _SKIPS_NAMED:
        return (f"the script {how} after {done} of the probe's {planned} optimizer steps; its GradScaler skipped the last "
                f"{skipped} updates whole: an inf or NaN gradient at every one; a rank whose gradients overflow at every "
                "step (a device that computes wrong in fp16) makes every rank skip, as does a loss scale still falling "
                "from too high a start")
    if done == 0:
        what = "" if built_ddp else " on a DistributedDataParallel model"
        return f"the script {how} without stepping an optimizer{what} (the probe needs {planned} steps)"
    return f"the script {how} after {done} of the probe's {planned} optimizer steps; give it more data or steps (or lower train.steps)"


#: Whole skips in a row that name the GradScaler as why the script ran out of steps: each halves the scale, and a
#: healthy run settles within a few (its default start of 2**16 is rarely more than ~8 halvings too high).
_SKIPS_NAMED = 8


def _build_rounds(config: ProbeConfig, module: Any, loss_of: Any, device: Any, names: Any, monitor: Any) -> Any:
    # Imported here: the replay pulls in torch, and the CLI imports this module to check a config (a bad
    # one must fail in a fraction of a second, before torch loads); the launcher imports torch before forking.
    from healthcheck.run.replay_rounds import build_rounds

    return build_rounds(config, module, loss_of, device, names, monitor)


def script_target_error(path: Optional[str], module: Optional[str] = None) -> Optional[str]:
    """The one-line problem with ``script.path`` (or ``script.module``) before anything starts, or None.

    >>> script_target_error("/no/such/train.py")
    'script.path: /no/such/train.py: no such file'
    >>> script_target_error(None, "no_such_package.train")
    'script.module: no_such_package.train: no module named no_such_package (looked in the working directory, then sys.path)'
    """
    if module is not None:
        return _module_error(module)
    assert path is not None
    if not os.path.exists(path):
        return f"script.path: {path}: no such file"
    if os.path.isdir(path):
        return f"script.path: {path} is a directory; give the training script's .py file"
    if not os.access(path, os.R_OK):
        return f"script.path: {path}: not readable"
    return _source_error(path)


def _source_error(path: str) -> Optional[str]:
    """Whether the file is Python this interpreter can run. A team's ``launch.sh`` (``torchrun ... train.py``) was
    started on every worker and failed there, exit 3 with a SyntaxError; it is bad input, known before any worker.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
    ...     _ = f.write("#!/bin/bash\\ntorchrun --nproc_per_node 8 train.py --lr 1e-4\\n")
    >>> print(_source_error(f.name).replace(f.name, "launch.sh"))
    script.path: launch.sh is a shell script (#!/bin/bash), not Python: give the Python script it launches, its arguments after --
    >>> os.remove(f.name)
    """
    import tokenize

    try:
        with tokenize.open(path) as file:  # honours the file's encoding declaration, as python does
            source = file.read()
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        return f"script.path: {path} cannot be read as Python source: {exc}"
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        first = source.splitlines()[0] if source else ""
        # Only a file that is no Python says which interpreter it is for (uv's "#!/usr/bin/env -S uv run" is Python).
        if first.startswith("#!") and "python" not in first:
            return (f"script.path: {path} is a shell script ({first.strip()}), not Python: give the Python script it "
                    "launches, its arguments after --")
        return f"script.path: {path} is not Python this interpreter can run: SyntaxError: {exc.msg} (line {exc.lineno})"
    except ValueError as exc:  # null bytes: a binary file
        return f"script.path: {path} is not Python source: {exc}"
    return None


def _module_error(module: str) -> Optional[str]:
    """Whether ``python -m MODULE`` would find it from here: its package is imported to look (as ``python -m`` does),
    and a package needs a ``__main__``."""
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
            spec = importlib.util.find_spec(f"{module}.__main__")
            if spec is None:
                return f"script.module: {module} is a package without __main__; name the module that trains"
    except ModuleNotFoundError as exc:
        return f"script.module: {module}: no module named {exc.name} (looked in the working directory, then sys.path)"
    except Exception as exc:  # its package failed to import: python -m would fail the same way on every rank
        return f"script.module: {module}: importing its package failed: {one_line(exc)}"
    finally:
        sys.path.remove(os.getcwd())
    if spec is None:
        return f"script.module: {module}: no such module (looked in the working directory, then sys.path)"
    return None

"""A ``healthcheck`` command that starts with torch and transformers already imported: the e2e tier's probes.

Why: importing torch and ``transformers.modeling_utils`` is ~4-5 s of one core on the 2-core CI host, and the e2e
tier runs some 150 commands, most of them 5-10 s probes. That import was a third to a half of the tier, paid
again by every command although no test is about it.

How: this process imports them once (and healthcheck's probe path), then forks one child per command, as
``os.fork`` after the imports is what healthcheck's own launcher does before it forks the workers. A child is the
command a user runs, from ``healthcheck.cli.run`` on: its own session, working folder, ``sys.argv``, standard
streams on the caller's files and stdin on ``/dev/null``, its exit status as ``subprocess`` reports it. What it
cannot be is a fresh interpreter, so :func:`tests.e2e.conftest.run_cli` keeps the real console script for a
command given its own environment (torch and transformers read some variables when imported), and the tests
whose subject is the process itself run it themselves: the README's commands, the signals, the start-up
benchmarks. Only :data:`PRELOAD` is imported here; what a script imports (``datasets``, ``trl``, ``peft``) is
imported by the probe's launcher as it would be, so its preload rules (``healthcheck/run/script_preload.py``)
still act.

Protocol, one JSON object a line: a request ``{"argv", "cwd", "env", "stdout", "stderr"}`` on stdin; the replies
``{"pid": N}`` when the child exists and ``{"returncode": N}`` when it has ended. End of stdin ends this process.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

#: What every e2e probe imports before it forks its workers: torch, the transformers model base (the built-in
#: probe's GPT-2 and every client's model), and healthcheck's probe path.
PRELOAD = ("torch", "transformers.modeling_utils", "healthcheck.cli", "healthcheck.run.probe", "healthcheck.gate")

#: Variables that change while the imports stay valid: pytest names the running test in the environment.
VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})


def _command(request: dict) -> None:
    """In the forked child: become the command, and never return."""
    code = 1
    try:
        os.setsid()  # as its own process group, so that a timeout can end it and its workers together
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                               (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
            opened = os.open(path, mode | (os.O_CREAT if fd else 0), 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        argv = list(request["argv"])
        if argv[1:2] == ["-m"]:  # `python -m MODULE ARGS`: the working folder first on the path, as there
            sys.argv, sys.path[0] = [argv[2], *argv[3:]], os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            code = 0
        else:  # the console script: its own folder first on the path, where `python -m` put this one's
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            from healthcheck.cli import run

            run(argv[1:])  # leaves through os._exit with the command's code
    except SystemExit as exc:  # what the interpreter would make of it
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        # An interpreter that dies of Ctrl-C ends by the signal itself.
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the traceback an interpreter prints, then its status 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def main() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints of this process never reach the replies
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _command(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


class WarmCommands:
    """The caller's side: one forking process for the session, started on the first command, with ``env``."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.env, self.cwd = env, cwd
        self.proc: subprocess.Popen | None = None
        self.pending = b""
        self.last_pid: int | None = None  # the last command's process, its session's leader

    def takes(self, env: dict[str, str]) -> bool:
        """Whether a command with ``env`` runs here: the environment this process was imported in, but for
        :data:`VOLATILE`."""
        return {k: v for k, v in env.items() if k not in VOLATILE} == {k: v for k, v in self.env.items() if k not in VOLATILE}

    def run(self, argv: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
        """``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``, forked from
        here (:meth:`takes` ``env``)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="warm-cli-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = self.last_pid = self._reply(60)["pid"]
            try:
                code = self._reply(timeout)["returncode"]
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # it may have ended since
                    os.killpg(pid, signal.SIGKILL)  # the command and its workers: subprocess.run would leave the workers
                self._reply(60)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(60)
            self.proc = None

    def _start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.warm_cli"], cwd=self.cwd, env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = b""
        self._reply(300)  # {"ready": pid}, after the imports

    def _reply(self, timeout: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise subprocess.TimeoutExpired("warm_cli", timeout)
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"tests.e2e.warm_cli ended (status {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


if __name__ == "__main__":
    main()

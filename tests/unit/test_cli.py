"""The thin CLI: exit codes for each kind of failure, one-line errors, and a reader that leaves the pipe."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from healthcheck.cli import build_parser, main
from healthcheck.errors import ExitCode, ProbeFailed
from tests.synthetic_runs import fitted


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_every_subcommand_parses():
    parser = build_parser()
    for argv in (["probe"], ["config", "show"], ["config", "schema"], ["config", "check"], ["report", "r"],
                 ["compare", "r"], ["baseline", "show", "b"], ["baseline", "update", "--from", "r", "--reason", "x"],
                 ["baseline", "record"], ["scenarios", "list"], ["scenarios", "run", "clean"]):
        assert parser.parse_args(argv).command == argv[0]


def test_a_bad_set_is_exit_2_on_one_line():
    code, _, err = run_main(["config", "show", "--set", "train.steps=many"])
    assert code == ExitCode.INVALID_INPUT
    assert err.count("\n") == 1 and err.startswith("healthcheck: error: ") and "train.steps" in err


REFUSE = r"""
import json, sys
from healthcheck.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--set", "train.stepz=3"],
        ["--config", "/no/such/probe.yaml"],
        ["--set", "data.source=json", "--set", "data.path=/no/such.json"],
        ["--set", "model.name=./no/such/model"],
        ["--script", "/no/such/train.py"],
        ["--set", "distributed.device=npu"],
        # Judged against a baseline, a window with no step (train.steps <= metrics.warmup_steps) fails every envelope.
        ["--set", "train.steps=8"],
    ],
)
def test_probe_refuses_bad_input_before_torch_loads(tmp_path, argv):
    # A CI job with a typo should hear about it at once, not after the seconds torch takes to import.
    done = subprocess.run([sys.executable, "-c", REFUSE, "probe", "--out", str(tmp_path / "run"), *argv],
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("healthcheck: error: ") and len(lines) == 2, done.stderr
    assert json.loads(lines[-1]) == {"code": ExitCode.INVALID_INPUT, "heavy": []}
    assert not (tmp_path / "run").exists()


def test_multi_line_messages_are_folded_onto_one_line(tmp_path):
    config = tmp_path / "probe.yaml"
    config.write_text("train: [\n  unclosed\n")
    code, _, err = run_main(["config", "show", "--config", str(config)])
    assert code == ExitCode.INVALID_INPUT and err.count("\n") == 1 and "not valid YAML" in err


def test_an_unwritable_output_is_exit_2(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    code, _, err = run_main(["baseline", "update", "--from", str(tmp_path / "no-run"), "--reason", "r",
                             "--output", str(target / "b.json")])
    assert code == ExitCode.INVALID_INPUT and err.count("\n") == 1


def test_probe_failed_is_exit_3_and_interrupts_too(monkeypatch):
    def fail(args):
        raise ProbeFailed("rank 1 died", {1: 9})

    monkeypatch.setitem(__import__("healthcheck.cli").cli.COMMANDS, "report", fail)
    code, _, err = run_main(["report", "x"])
    assert code == ExitCode.PROBE_FAILED and "rank 1 died" in err

    def interrupt(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(__import__("healthcheck.cli").cli.COMMANDS, "report", interrupt)
    assert run_main(["report", "x"])[0] == ExitCode.PROBE_FAILED


def test_probe_failed_signals_belong_to_each_instance():
    first, second = ProbeFailed("a", {3: 9}), ProbeFailed("b")
    assert first.signals == {3: 9} and second.signals == {}
    second.signals[1] = 15
    assert ProbeFailed("c").signals == {}


def test_a_reader_that_leaves_the_pipe_is_not_an_error(tmp_path):
    # `healthcheck baseline show X | head`: the reader is gone before the writer writes. It used to
    # report "cannot write" with exit 2 because OSError was caught before BrokenPipeError.
    from healthcheck.judge.baseline import save_baseline

    path = tmp_path / "default.json"
    save_baseline(fitted(), path)
    process = subprocess.Popen([sys.executable, "-m", "healthcheck", "baseline", "show", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader leaves at once
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err.decode()
    assert err.decode() == ""


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_version_and_help_exit_0(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0


def test_an_empty_window_is_refused_by_baseline_record():
    code, _, err = run_main(["baseline", "record", "--set", "train.steps=4", "--repeats", "3"])
    assert code == ExitCode.INVALID_INPUT and err.count("\n") == 1
    assert "train.steps 4 ends before metrics.warmup_steps 10" in err and "no envelope can be fitted" in err


LEAVE = r"""
import atexit, sys, threading, time
from pathlib import Path
from healthcheck.cli import run

out = Path(sys.argv[1])
atexit.register(lambda: ((out / "atexit").write_text("ran"), sys.stdout.write("bye")))  # no flush: run() must
late = threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("joined")))  # not a daemon
late.start()
sys.stdout.write("x" * 200_000)  # more than a pipe's buffer: the reader gets all of it only if it is flushed
run(["config", "show", "--set", "train.steps=7"])
"""


def test_the_console_script_skips_the_teardown_but_loses_nothing(tmp_path):
    # run() leaves with os._exit: the non-daemon threads are still joined, the atexit handlers still run and
    # everything written to stdout still reaches the reader, and main()'s exit code is the process's.
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a CI shell runs it: block-buffered
    done = subprocess.run([sys.executable, "-c", LEAVE, str(tmp_path)], capture_output=True, text=True, timeout=120, env=buffered)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("x" * 200_000) and "steps: 7" in done.stdout and done.stdout.endswith("bye")
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"
    bad = subprocess.run([sys.executable, "-c", LEAVE.replace("train.steps=7", "train.steps=many"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == ExitCode.INVALID_INPUT and bad.stderr.startswith("healthcheck: error: "), bad.stderr

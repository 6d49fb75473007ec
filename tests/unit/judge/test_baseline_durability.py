"""Baselines are never lost: SIGKILL mid-write, a full disk, and the history of replaced versions."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from healthcheck import files
from healthcheck.errors import BaselineError
from healthcheck.judge.baseline import fit_baseline, history_path, load_baseline, save_baseline
from tests.synthetic_runs import clean_runs, fitted

KILLS = 15  # each a fresh writer process (~0.4 s to import), killed at a random point of its writes

WRITER = textwrap.dedent(
    """
    import sys
    from healthcheck.judge.baseline import Baseline, save_baseline
    a, b = (Baseline.model_validate_json(open(p).read()) for p in sys.argv[1:3])
    target = sys.argv[3]
    print("ready", flush=True)
    while True:
        save_baseline(a, target)
        save_baseline(b, target)
    """
)


def two_versions(tmp_path: Path):
    a = fitted()
    b = fit_baseline(clean_runs(rng_seed=1), reason="approved change", approved_by="bob")
    paths = []
    for name, version in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(version.model_dump_json())
        paths.append(tmp_path / name)
    return a, b, paths


def test_sigkill_during_writes_never_truncates_or_mixes(tmp_path):
    a, b, (path_a, path_b) = two_versions(tmp_path)
    target = tmp_path / "baselines" / "default.json"
    rng = random.Random(0)
    for _ in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path_a), str(path_b), str(target)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if target.exists():
            assert load_baseline(target) in (a, b)
    history = history_path(target).read_text().splitlines()
    assert len(history) > KILLS  # every replaced version was kept
    for line in history[:-1]:  # only the very last append can have been cut by a kill
        assert json.loads(line)["schema_version"] == 1


def test_disk_full_keeps_the_previous_baseline(tmp_path, monkeypatch):
    a, b, _ = two_versions(tmp_path)
    target = tmp_path / "default.json"
    save_baseline(a, target)

    real_fdopen = os.fdopen

    def full_disk(fd, *args, **kwargs):
        handle = real_fdopen(fd, *args, **kwargs)

        def write(_text):
            raise OSError(errno.ENOSPC, "No space left on device")

        handle.write = write
        return handle

    monkeypatch.setattr(files.os, "fdopen", full_disk)
    with pytest.raises(BaselineError) as info:
        save_baseline(b, target)
    assert "No space left on device" in info.value.message and "unchanged" in info.value.message
    assert "\n" not in info.value.message
    monkeypatch.undo()
    assert load_baseline(target) == a
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_history_line_torn_by_a_crash_is_cut_before_the_next_append(tmp_path):
    a, b, _ = two_versions(tmp_path)
    target = tmp_path / "default.json"
    save_baseline(a, target)
    save_baseline(b, target)  # history: [a]
    history = history_path(target)
    complete = history.read_bytes()
    # A kill part-way through the next append leaves half a line and no newline; the atomic
    # replace after it never ran, so ``b`` is still the current baseline.
    with open(history, "ab") as handle:
        handle.write(b'{"schema_version":1,"name":"def')
    save_baseline(a, target)
    lines = history.read_text().splitlines()
    assert history.read_bytes().startswith(complete)
    assert [json.loads(line)["reason"] for line in lines] == [a.reason, b.reason]
    assert load_baseline(target) == a


def test_a_torn_first_history_line_is_dropped(tmp_path):
    a, b, _ = two_versions(tmp_path)
    target = tmp_path / "default.json"
    save_baseline(a, target)
    history_path(target).write_bytes(b'{"schema_ver')
    save_baseline(b, target)
    assert [json.loads(line)["reason"] for line in history_path(target).read_text().splitlines()] == [a.reason]

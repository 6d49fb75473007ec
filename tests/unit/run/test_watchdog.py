"""Heartbeats and the hang watchdog, with fake beats and a fake child process: no workers needed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from healthcheck.run.watchdog import HEARTBEAT_DIR, PHASES, Heartbeat, RankBeat, Watchdog, describe_hang, read_beats


def test_heartbeat_files_round_trip_and_a_torn_one_is_skipped(tmp_path):
    beat = Heartbeat(tmp_path, 3)
    beat.beat(7, "backward")
    (tmp_path / HEARTBEAT_DIR / "rank-9.json").write_text("{torn")
    beats = read_beats(tmp_path)
    assert [(b.rank, b.step, b.phase) for b in beats] == [(3, 7, "backward")]
    assert beats[0].progress == (7, PHASES.index("backward"))


def test_describe_hang_names_the_least_advanced_rank():
    beats = [RankBeat(0, 9, "sync", 1, 0.0), RankBeat(1, 9, "sync", 2, 0.0), RankBeat(2, 8, "compute", 3, 0.0)]
    assert describe_hang(beats, 3, 12.0) == ("no progress for 12 s: rank 2 stuck in step 8 (compute) "
                                             "while ranks 0-1 wait in step 9 (sync)")


def test_describe_hang_before_training_and_with_everyone_stuck():
    assert "ranks 1-2 never reached training" in describe_hang([RankBeat(0, -1, "start", 1, 0.0)], 3, 5.0)
    same = [RankBeat(r, 4, "optimizer", r, 0.0) for r in range(2)]
    assert describe_hang(same, 2, 5.0) == "no progress for 5 s: every rank stuck in step 4 (optimizer)"


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_watchdog_kills_a_rank_that_stops_beating(tmp_path):
    child = _sleeper()
    try:
        folder = tmp_path / HEARTBEAT_DIR
        folder.mkdir()
        for rank in range(2):
            (folder / f"rank-{rank}.json").write_text(json.dumps(
                {"rank": rank, "step": 3, "phase": "sync" if rank else "compute", "pid": child.pid, "time": 0.0}))
        with Watchdog(tmp_path, 2, timeout_s=0.6, poll_s=0.05) as watchdog:
            child.wait(timeout=10)
        assert child.returncode == -9
        assert watchdog.fired.startswith("no progress for") and "rank 0 stuck in step 3 (compute)" in watchdog.fired
        assert not watchdog.stalled_in_startup
    finally:
        child.kill()


def test_watchdog_calls_a_missing_rank_a_start_up_stall(tmp_path):
    child = _sleeper()
    try:
        Heartbeat(tmp_path, 0).beat(-1, "start")
        (tmp_path / HEARTBEAT_DIR / "rank-0.json").write_text(json.dumps(
            {"rank": 0, "step": -1, "phase": "start", "pid": child.pid, "time": 0.0}))
        with Watchdog(tmp_path, 2, timeout_s=30, poll_s=0.05, startup_timeout_s=0.3) as watchdog:
            child.wait(timeout=10)
        assert watchdog.stalled_in_startup
        assert watchdog.fired.startswith("rank 1 did not join the process group")
    finally:
        child.kill()


def test_a_healthy_beat_keeps_the_watchdog_quiet(tmp_path):
    heartbeat = Heartbeat(tmp_path, 0)
    with Watchdog(tmp_path, 1, timeout_s=0.5, poll_s=0.05) as watchdog:
        for step in range(12):
            heartbeat.beat(step, "compute")
            time.sleep(0.1)
    assert watchdog.fired is None

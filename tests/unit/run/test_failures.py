"""Naming the rank and the moment a probe died, from the files its workers leave (no processes)."""

from __future__ import annotations

from healthcheck.run.failures import describe_failure, record_worker_failure
from healthcheck.run.watchdog import Heartbeat


def test_a_script_that_fails_before_its_first_optimizer_step_is_not_said_to_fail_in_start_up(tmp_path):
    # A --script worker beats phase "script" from its start: an error there is the script's, not healthcheck's.
    for rank in range(2):
        Heartbeat(tmp_path, rank).beat(-1, "script")
    record_worker_failure(tmp_path, 1, None, KeyError("labels"))
    assert describe_failure(tmp_path, "exit 1") == "rank 1 failed in the script, before its first optimizer step: KeyError: 'labels'"


def test_a_built_in_worker_that_fails_before_its_first_step_fails_in_start_up(tmp_path):
    for rank in range(2):
        Heartbeat(tmp_path, rank)  # beats phase "start"
    record_worker_failure(tmp_path, 0, None, OSError("no such model directory"))
    assert describe_failure(tmp_path, "exit 1") == "rank 0 failed during start-up: OSError: no such model directory"


def test_a_failure_in_a_step_names_the_step(tmp_path):
    Heartbeat(tmp_path, 0).beat(4, "backward")
    record_worker_failure(tmp_path, 0, 4, RuntimeError("boom"))
    assert describe_failure(tmp_path, "exit 1") == "rank 0 failed at step 4: RuntimeError: boom"


def test_a_rank_killed_by_a_signal_in_the_script_before_its_first_step(tmp_path):
    Heartbeat(tmp_path, 2).beat(-1, "script")
    assert describe_failure(tmp_path, "exit -9", signals={2: 9}) == (
        "rank 2 was killed by signal 9 (SIGKILL) in the script, before its first optimizer step"
    )

"""Naming the rank and the moment a probe died, from the files its workers leave (no processes)."""

from __future__ import annotations

import re

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


def test_an_error_raised_in_healthcheck_code_is_put_on_healthcheck_not_on_the_script(tmp_path):
    # A hook of healthcheck's inside the script's backward failed (TRL's LoRA path once did): the reason alone read as
    # the script's error. Raised by the interpreter in healthcheck's code, it is said to be healthcheck's.
    from healthcheck.ranks import rank_span

    for rank in range(2):
        Heartbeat(tmp_path, rank).beat(2, "backward")
    try:
        rank_span(None)  # type: ignore[arg-type]
    except TypeError as exc:
        record_worker_failure(tmp_path, 0, 2, exc)
    message = describe_failure(tmp_path, "exit 1")
    assert message.startswith("rank 0 failed at step 2: TypeError: "), message
    assert re.search(r" \(raised in healthcheck's own code, healthcheck/ranks\.py:\d+, not by the script: a healthcheck bug; "
                     r"please report it with errors/rank-0\.traceback\.txt\)$", message), message
    # The script's own error, even one from a library it calls, reads as before.
    try:
        int("x")
    except ValueError as exc:
        record_worker_failure(tmp_path, 1, 2, exc)
    (tmp_path / "errors" / "rank-0.json").unlink()
    assert describe_failure(tmp_path, "exit 1") == "rank 1 failed at step 2: ValueError: invalid literal for int() with base 10: 'x'"


def test_a_rank_killed_by_a_signal_in_the_script_before_its_first_step(tmp_path):
    Heartbeat(tmp_path, 2).beat(-1, "script")
    assert describe_failure(tmp_path, "exit -9", signals={2: 9}) == (
        "rank 2 was killed by signal 9 (SIGKILL) in the script, before its first optimizer step"
    )


_ABORT_LOG = """\
[transformers] Token indices sequence length is longer than the specified maximum sequence length
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /__w/pytorch/third_party/gloo/pair.cc:456] op.preamble.length <= op.nbytes. 32800 vs 16400. \
Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?
Fatal Python error: Aborted

Thread 0x00007f2b9e53cb80 (most recent call first):
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 4394 in all_gather_single
  File "/v/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/v/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 119 in __call__
  File "/w/train.py", line 76 in main
  File "/w/train.py", line 97 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/w/healthcheck/run/script_worker.py", line 117 in run
"""


def test_a_rank_that_aborted_in_cpp_is_described_by_its_last_words(tmp_path):
    # A C++ exception (here gloo's check on a collective whose sizes differ between ranks) kills the process
    # with SIGABRT and no Python exception: what it printed is the only account of why.
    Heartbeat(tmp_path, 3).beat(-1, "script")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-3.log").write_text(_ABORT_LOG)
    assert describe_failure(tmp_path, "exit -6", signals={3: 6}) == (
        "rank 3 was killed by signal 6 (SIGABRT) in the script, before its first optimizer step: gloo::EnforceNotMet: "
        "op.preamble.length <= op.nbytes. 32800 vs 16400. Received data size doesn't match expected size. Is there a "
        "distributed collective mismatch in your code? (in all_gather_single, called from train.py:76 (main))"
    )


_PEER_TRACEBACK = """\
Traceback (most recent call last):
  File "/w/train.py", line {line}, in main
    {call}
  File "/v/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
    return func(*args, **kwargs)
  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 4287, in {collective}
    work.wait()
RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:34467. This is typically caused by a remote worker crashing.
"""


def test_a_rank_that_died_of_a_collective_mismatch_is_told_with_where_every_rank_was(tmp_path):
    # Rank 3 died of the mismatch, and rank 1 is the one on another code path: the line used to name rank 3 alone.
    for rank in range(4):
        Heartbeat(tmp_path, rank).beat(-1, "script")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-3.log").write_text(_ABORT_LOG)
    for rank, collective, line in ((0, "all_gather_single", 76), (1, "all_reduce", 80), (2, "all_gather_single", 76)):
        record_worker_failure(tmp_path, rank, None, RuntimeError("Connection closed by peer"))
        call = f"dist.{collective}(out, t)"
        (tmp_path / "errors" / f"rank-{rank}.traceback.txt").write_text(_PEER_TRACEBACK.format(line=line, call=call, collective=collective))
    line = describe_failure(tmp_path, "exit -6", signals={3: 6})
    assert line.endswith("; collective mismatch: ranks 0, 2-3 in all_gather_single, called from train.py:76 (main); "
                         "rank 1 in all_reduce, called from train.py:80 (main)"), line
    # Every rank in the same collective is no mismatch between code paths: nothing is added.
    (tmp_path / "errors" / "rank-1.traceback.txt").write_text(_PEER_TRACEBACK.format(line=76, call="", collective="all_gather_single"))
    assert describe_failure(tmp_path, "exit -6", signals={3: 6}).endswith("(in all_gather_single, called from train.py:76 (main))")


def test_a_silent_death_with_a_fatal_error_in_its_log_says_so_instead_of_guessing(tmp_path):
    for rank in range(2):
        Heartbeat(tmp_path, rank).beat(5, "backward")
    record_worker_failure(tmp_path, 0, 5, RuntimeError("Connection reset by peer"))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-1.log").write_text(
        'Fatal Python error: Segmentation fault\n\nCurrent thread 0x01 (most recent call first):\n  File "/w/ext.py", line 3 in kernel\n'
    )
    assert describe_failure(tmp_path, "exit -11") == (
        "rank 1 died without an error report in step 5 (backward): Segmentation fault (in ext.py:3 (kernel)); "
        "rank 0 then lost the connection to it"
    )


def test_every_rank_failing_alike_is_not_blamed_on_the_fastest_reporter(tmp_path):
    for rank in range(3):
        Heartbeat(tmp_path, rank).beat(-1, "script")
        record_worker_failure(tmp_path, rank, None, RuntimeError("the ranks shard the model differently: rank 2 ..."))
    assert describe_failure(tmp_path, "exit 1") == (
        "every rank failed in the script, before its first optimizer step: RuntimeError: the ranks shard the model "
        "differently: rank 2 ..."
    )

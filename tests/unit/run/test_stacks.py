"""Stacks on request: a real process armed, signalled and read; the grouping of ranks by where they wait."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from healthcheck.run import stacks

_BLOCKED = textwrap.dedent(
    """
    import sys, threading
    from pathlib import Path
    from healthcheck.run import stacks

    def deep(n):  # a longer stack than the main thread's: the main thread is found by its id, not its depth
        return deep(n - 1) if n else threading.Event().wait()

    def blocked_in_the_script():
        threading.Event().wait()

    stacks.arm(Path(sys.argv[1]), int(sys.argv[2]))
    threading.Thread(target=deep, args=(30,), daemon=True).start()
    print("armed", flush=True)
    blocked_in_the_script()
    """
)


def _blocked_process(run_dir, rank: int) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", _BLOCKED, str(run_dir), str(rank)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "armed"
    return child


def _request_once_blocked(run_dir, pid: int, rank: int) -> dict[int, str]:
    # "armed" is printed a few bytecodes before the main thread enters its wait: on a loaded CI host the first dump
    # can land on <module>. Asking again until the wait shows is what a user's later request would see.
    deadline = time.monotonic() + 30
    while True:
        dumps = stacks.request(run_dir, {rank: pid})
        if stacks.main_stack(dumps[rank])[0].func == "wait" or time.monotonic() > deadline:
            return dumps
        time.sleep(0.1)


def test_a_blocked_process_answers_with_its_main_threads_stack(tmp_path):
    child = _blocked_process(tmp_path, 5)
    try:
        dumps = _request_once_blocked(tmp_path, child.pid, 5)
        assert child.poll() is None  # asking does not kill
        frames = stacks.main_stack(dumps[5])
        assert [f.func for f in frames[:2]] == ["wait", "wait"] and frames[2].func == "blocked_in_the_script"
        assert "deep" not in {f.func for f in frames}
        # A second request reads the newer dump, not the first one again.
        assert stacks.main_stack(stacks.request(tmp_path, {5: child.pid})[5]) == frames
        assert stacks.describe(dumps).startswith("rank 5 waits in <string>:")
    finally:
        child.kill()
        child.wait()


def test_a_process_that_never_armed_is_not_signalled(tmp_path):
    # The dump signal's default action is to end the process: only a rank with a stacks file is asked.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert stacks.request(tmp_path, {0: child.pid}, wait_s=0.3) == {}
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def _dump(*frames: tuple[str, int, str]) -> str:
    lines = ["main 0x1", "Current thread 0x0000000000000001 (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {func}' for file, line, func in frames]
    return "\n".join(lines) + "\n"


C10D = "/v/site-packages/torch/distributed/distributed_c10d.py"


def test_ranks_in_different_collectives_are_called_a_mismatch():
    gather = _dump((C10D, 1, "all_gather"), ("/v/site-packages/trl/trainer/sft_trainer.py", 40, "compute_loss"))
    ddp = _dump(("/v/site-packages/torch/nn/parallel/distributed.py", 9, "_sync_buffers"), ("/w/a/train.py", 8, "main"))
    line = stacks.describe({0: gather, 1: ddp, 2: gather})
    assert line == ("collective mismatch: ranks 0, 2 wait in all_gather, called from trl/trainer/sft_trainer.py:40 "
                    "(compute_loss); rank 1 waits in _sync_buffers, called from train.py:8 (main)")


def test_a_rank_outside_any_collective_is_not_a_mismatch():
    waiting = _dump((C10D, 1, "all_reduce"), ("/w/a/train.py", 8, "main"))
    spinning = _dump(("/w/a/data.py", 3, "load"), ("/w/a/train.py", 7, "main"))
    line = stacks.describe({0: waiting, 1: spinning})
    assert line == "rank 0 waits in all_reduce, called from train.py:8 (main); rank 1 waits in data.py:3 (load) in train.py:7 (main)"
    assert stacks.describe({0: "main 0x1\n"}) is None


def test_a_source_tree_file_is_named_from_its_top_package(tmp_path):
    inner = tmp_path / "repo" / "pkg" / "sub"
    inner.mkdir(parents=True)
    for folder in (inner, inner.parent):
        (folder / "__init__.py").write_text("")
    assert stacks.short_path(str(inner / "mod.py")) == "pkg/sub/mod.py"
    assert stacks.short_path(str(tmp_path / "repo" / "train.py")) == "train.py"


def test_a_rank_in_a_dtensor_collective_waits_in_a_collective():
    # FSDP2's clip_grad_norm_ all-reduces the norm of sharded gradients through DTensor; the dump's innermost frame is
    # the operator's dispatch, and healthcheck's clip recorder sits between the script and torch.
    site = "/v/site-packages/"
    clipping = _dump((site + "torch/_ops.py", 1279, "__call__"),
                     (site + "torch/distributed/_functional_collectives.py", 142, "wait_tensor"),
                     (site + "torch/distributed/tensor/_redistribute.py", 1640, "redistribute_local_tensor"),
                     (site + "torch/nn/utils/clip_grad.py", 230, "clip_grad_norm_"),
                     ("/w/healthcheck/integrations/script/clipping.py", 82, "clip"),
                     ("/w/a/train.py", 211, "main"))
    forward = _dump((C10D, 4287, "all_gather"), ("/w/a/train.py", 197, "main"))
    line = stacks.describe({0: clipping, 1: clipping, 2: forward, 3: clipping})
    assert line == ("collective mismatch: ranks 0-1, 3 wait in wait_tensor, called from train.py:211 (main); "
                    "rank 2 waits in all_gather, called from train.py:197 (main)")

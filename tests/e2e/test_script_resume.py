"""Resumed runs probed unmodified: ``transformers.Trainer(resume_from_checkpoint=...)`` and accelerate's
``save_state``/``load_state``, each from checkpoints the client itself wrote.

DDP broadcasts rank 0's parameters when it wraps the model, never the optimizer's state. A node whose copy of the
checkpoint is incomplete or stale starts with another state: the Trainer skips a missing ``optimizer.pt`` without a
word, and ``accelerator.load_state`` loads parameters after the wrap. The second was named a step later by
``param_equality``, with advice about a learning rate; both are now named before the first update.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import failed_ranks, run_cli, run_command
from tests.e2e.test_script_mode import CLIENTS, DATA, probe_args, tiny_llama  # noqa: F401 (tiny_llama is a fixture)

pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")


def client_alone(client: str, model: Path, log: Path, *script_args: str) -> None:
    """The client under torchrun on one rank, as its user would run it to write the checkpoints."""
    # --log-dir beside the log: torchrun's default is a /tmp/torchelastic_* folder it never removes.
    done = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                        "--log-dir", str(log.with_suffix(".torchrun")), "--", str(CLIENTS / f"{client}.py"), "--model",
                        str(model), "--data", str(DATA), "--log", str(log), *script_args], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("checkpoints")
    client_alone("hf_trainer", tiny_llama, folder / "trainer.jsonl", "--steps", "3", "--save-steps", "3",
                 "--output-dir", str(folder / "trainer"))
    # A node's copy that an interrupted sync left without the optimizer's state: the Trainer resumes without it.
    shutil.copytree(folder / "trainer" / "checkpoint-3", folder / "partial")
    (folder / "partial" / "optimizer.pt").unlink()
    client_alone("accelerate_loop", tiny_llama, folder / "accelerate.jsonl", "--steps", "2", "--save-every", "1",
                 "--save-to", str(folder / "accelerate"))
    return folder


def resume_probe(client, tmp_path, tiny_llama, *script_args):  # noqa: F811
    out = tmp_path / "run"
    done = run_cli(*probe_args(client, out, tiny_llama, tmp_path / "loss.jsonl", steps=3, script_args=script_args))
    return done, json.loads((out / "result.json").read_text()), out


def test_a_trainer_rank_whose_checkpoint_lacks_the_optimizer_state_is_named_before_it_steps(checkpoints, tiny_llama, tmp_path):  # noqa: F811
    done, result, out = resume_probe("hf_trainer", tmp_path, tiny_llama, "--resume", str(checkpoints / "trainer" / "checkpoint-3"),
                                     "--override", f"1:resume_from_checkpoint={checkpoints / 'partial'}")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.environment": [1]}
    assert result["stopped_early"]["step"] == 0 and result["steps_completed"] == 0
    message = result["audits"]["environment"]["message"]
    assert "optimizer.state differs: ranks 0, 2-3 step 3, 63 tensors, bits " in message and "; rank 1 empty" in message, message
    # The checkpoint's path names a node's files, not how it trains; the ranks that resumed alike agree on the rest.
    assert "resume_from_checkpoint" not in message and "model.parameters" not in message, message
    assert result["audits"]["environment"]["facts"]["trainer.state.global_step"] == "3"


@pytest.mark.parametrize("stale_rank", [None, 2])
def test_accelerate_load_state_resumes_alike_and_a_stale_copy_is_named(stale_rank, checkpoints, tiny_llama, tmp_path):  # noqa: F811
    newest, older = checkpoints / "accelerate" / "step_2", checkpoints / "accelerate" / "step_1"
    stale = () if stale_rank is None else ("--resume-rank", f"{stale_rank}:{older}")
    done, result, out = resume_probe("accelerate_loop", tmp_path, tiny_llama, "--resume-from", str(newest), *stale)
    environment = result["audits"]["environment"]
    if stale_rank is None:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert all(audit["passed"] for audit in result["audits"].values()), result["audits"]
        assert environment["facts"]["optimizer.state"].startswith("step 2, 63 tensors, bits "), environment["facts"]
        return
    # accelerate loads the parameters into the wrapped model: DDP never broadcasts them. Before, param_equality named
    # the rank after its first update and blamed "a rank-local optimizer or learning-rate difference".
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.environment": [stale_rank]}
    assert result["stopped_early"]["step"] == 0 and result["steps_completed"] == 0
    message = environment["message"]
    assert message.startswith("model.parameters differs: ranks 0-1, 3 21 tensors, bits "), message
    assert "optimizer.state differs: ranks 0-1, 3 step 2, 63 tensors" in message and "rank 2 step 1, 63 tensors" in message, message

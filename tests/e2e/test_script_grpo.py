"""TRL's GRPOTrainer probed unmodified (``tests/clients/trl_grpo.py``): its prompts are read in groups by design.

GRPO's sampler yields each prompt once per completion it will generate, and accelerate deals those reads out to the
ranks: a group of 8 on ranks with batches of 4 sends one prompt to both. Before, the shard audit failed that clean
run (exit 1 at step 0: "every rank read the same samples ... the effective batch collapsed"); the ranks generate
different completions of it. What it must still catch: a rank whose sampler drew other prompts, so that the ranks
sharing a group read halves of two.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import read_rows, run_cli
from tests.e2e.test_script_mode import DATA, probe_args, tiny_llama  # noqa: F401 (tiny_llama is a fixture)

pytest.importorskip("trl")
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")


def grpo_probe(tmp_path, tiny_llama, *script_args):  # noqa: F811
    out = tmp_path / "run"
    done = run_cli(*probe_args("trl_grpo", out, tiny_llama, tmp_path / "loss.jsonl", steps=3, extra=("--set", "distributed.nproc=2"),
                               script_args=("--generations", "8", *script_args)))
    return done, json.loads((out / "result.json").read_text()), out


def test_grpo_groups_that_span_ranks_pass_and_its_rl_loss_is_not_measured(tiny_llama, tmp_path):  # noqa: F811
    done, result, out = grpo_probe(tmp_path, tiny_llama)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    shards = result["audits"]["data_shards"]
    assert shards["passed"] and shards["message"].startswith("ranks 0-1 read each sample in whole groups of 8 reads"), shards
    assert "a preference or RL objective" in result["loss_note"], result["loss_note"]
    rows = read_rows(out / "steps.jsonl")
    assert len(rows) == 6 and all(row["loss"] is None and row["grad_norm"] > 0 for row in rows), rows


def test_a_grpo_rank_whose_sampler_draws_other_prompts_splits_the_groups_and_is_named(tiny_llama, tmp_path):  # noqa: F811
    done, result, _ = grpo_probe(tmp_path, tiny_llama, "--override", "1:seed=7")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    shards = result["audits"]["data_shards"]
    assert not shards["passed"] and shards["signature"] == "split-groups 0-1", shards
    assert "no whole group of 8" in shards["message"], shards["message"]

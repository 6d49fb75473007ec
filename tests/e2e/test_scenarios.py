"""The real CLI: exact audits in result.json for two short 4-rank probes, and the scenario catalogue commands.

Two probes (4 ranks, 6 steps) keep this file around half a minute on busy cores: one with rank 0 seeded
differently (S1-2), one with every rank reading the same samples. Each asserts the audit that must fire,
its message and the ranks it names, and that the audits that must hold still pass. A third (4 ranks, 14
steps) flips an exponent bit of one rank's loss at one step, which only the spikes audit names.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import run_cli

pytestmark = pytest.mark.e2e

SHORT = ["--no-plots", "--set", "train.steps=6", "--set", "metrics.warmup_steps=1", "--set", "distributed.nproc=4",
         "--set", "metrics.param_check_every=2", "--set", "metrics.reduction_check_every=2"]
ALL_AUDITS = {"data_shards", "seeds", "param_equality", "environment", "nonfinite", "stragglers", "reduction_numerics",
              "rank_outliers", "replay", "spikes", "zero_gradients"}


def probe_audits(tmp_path, name, *extra) -> dict:
    out = tmp_path / name
    done = run_cli("probe", "--no-judge", "--out", out, *SHORT, *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert set(result["audits"]) == ALL_AUDITS
    return result["audits"]


def test_rank0_own_seed_is_named_by_seeds_and_shards(tmp_path):
    audits = probe_audits(tmp_path, "s1-2", "--set", "seed_policy=rank0_differs")
    seeds, shards = audits["seeds"], audits["data_shards"]
    assert not seeds["passed"] and seeds["ranks"] == [0] and seeds["signature"] == "seed 0|1-3"
    assert seeds["message"] == "ranks 1-3 share seed 42; rank 0 has 1041"
    assert not shards["passed"] and shards["ranks"] == [0] and shards["signature"] == "departs 0"
    assert shards["message"].startswith("rank 0's sampler order departs from the plan")
    # What a seed does not change must still hold exactly: DDP keeps the parameters equal, the
    # reduction is within rounding, and the environment is the same on every rank.
    for name in ("param_equality", "reduction_numerics", "environment", "nonfinite", "stragglers", "rank_outliers", "replay",
                 "spikes"):
        assert audits[name]["passed"], (name, audits[name]["message"])
    assert audits["param_equality"]["check_steps"] == [0, 2, 4, 5]
    assert audits["reduction_numerics"]["checked_steps"] == [0, 2, 4]


def test_identical_data_is_named(tmp_path):
    audits = probe_audits(tmp_path, "replicated", "--set", "data.sharding=replicated")
    shards = audits["data_shards"]
    assert not shards["passed"] and shards["ranks"] == [0, 1, 2, 3] and shards["signature"] == "identical"
    assert shards["message"].startswith("every rank read the same samples: ranks 0-3 consumed identical sequences "
                                        "(rank 0 shares 24 of its 24 samples with other ranks; expected 0")
    assert audits["seeds"]["passed"] and audits["param_equality"]["passed"]


def test_a_one_step_bitflip_is_named_by_the_spikes_audit_alone(tmp_path):
    out = tmp_path / "bitflip"
    done = run_cli("probe", "--audits-only", "--out", out, "--set", "distributed.nproc=4", "--set", "train.steps=14",
                   "--set", "metrics.warmup_steps=1", "--set", "rank_overrides={2: {faults: {bitflip_at_step: 9}}}")
    assert done.returncode == 1, done.stderr[-2000:]
    audits = json.loads((out / "result.json").read_text())["audits"]
    spikes = audits["spikes"]
    assert not spikes["passed"] and spikes["ranks"] == [2] and spikes["signature"] == "spike 2"
    assert spikes["message"].startswith("rank 2 at step 9: loss ") and "; grad norm " in spikes["message"]
    assert {(s["metric"], s["step"]) for s in spikes["spikes"]} == {("loss", 9), ("grad_norm", 9)}
    assert "audit.spikes" in done.stdout and "rank 2 at step 9" in done.stdout
    # The flipped loss is ~1e10, finite: the non-finite audit has nothing to say, and one step moves no window.
    assert [name for name, audit in audits.items() if not audit["passed"]] == ["spikes"]


def test_scenarios_list_and_bad_names():
    listed = run_cli("scenarios", "list")
    assert listed.returncode == 0, listed.stderr
    table = listed.stdout.split("\n\n")[0]  # the FSDP expectations and the usage line follow a blank line
    names = [line.split()[0] for line in table.splitlines()[1:]]
    assert names == ["s1-2", "s1-3", "identical-data", "missing-set-epoch", "loss-x2", "fp32-vs-bf16", "lr-x10",
                     "label-mask-bug", "grad-noise", "straggler", "bad-device", "bitflip", "nan"]
    assert "rank_overrides={{rank}: {train: {lr: 0.01}}}" in listed.stdout  # the rank is drawn from the seed
    unknown = run_cli("scenarios", "run", "lr-x100")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert "unknown scenario 'lr-x100' (known: s1-2, s1-3," in unknown.stderr


def test_scenarios_run_needs_a_baseline(tmp_path):
    done = run_cli("scenarios", "run", "lr-x10", "--baseline", tmp_path / "none.json", "--runs-root", tmp_path)
    assert done.returncode == 2 and "no baseline found; record one with: healthcheck baseline record" in done.stderr
    assert not list(tmp_path.iterdir()), "no probe may start without a baseline"

"""The real CLI: an 8-rank probe per seed policy, the real loading paths, and every bad-input exit code."""

from __future__ import annotations

import json
import math

import pytest

from tests.e2e.conftest import SHARED_DATA, read_rows, run_cli

pytestmark = pytest.mark.e2e

SHORT = ["--set", "train.steps=4", "--set", "metrics.warmup_steps=1"]


def probe(tmp_path, name, *extra, nproc=8):
    out = tmp_path / name
    done = run_cli("probe", "--no-judge", "--out", out, *SHORT, "--set", f"distributed.nproc={nproc}", *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    return out, json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def policy_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policies")
    # The PNG plots are drawn for one policy and skipped (--no-plots) for the others: the test below checks both.
    return {policy: probe(tmp, policy, "--set", f"seed_policy={policy}", *(() if policy == "shared" else ("--no-plots",)))
            for policy in ("shared", "rank0_differs", "per_rank")}


@pytest.mark.parametrize(
    ("policy", "expected_seeds"),
    [("shared", [42] * 8), ("rank0_differs", [1041] + [42] * 7), ("per_rank", [42 + r for r in range(8)])],
)
def test_eight_rank_probe_artifacts_and_seeds(policy_runs, policy, expected_seeds):
    out, result = policy_runs[policy]
    assert result["status"] == "complete"
    assert result["environment"]["world_size"] == 8
    ranks = result["environment"]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(8))
    assert [r["seed"] for r in ranks] == expected_seeds
    assert [r["torch_seed"] for r in ranks] == expected_seeds  # read back from torch after seeding
    assert [r["sampler_seed"] for r in ranks] == expected_seeds  # data_seed follows the seed
    rows = read_rows(out / "steps.jsonl")
    assert len(rows) == 4 * 8
    assert sorted({(r["step"], r["rank"]) for r in rows}) == [(s, r) for s in range(4) for r in range(8)]
    assert all(math.isfinite(r["loss"]) and r["tokens"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert len(read_rows(out / "aggregates.jsonl")) == 4
    assert (out / "config.yaml").exists()
    assert result["schema_version"] == 1 and result["timing"]["wall_s"] > 0
    pngs = ["plots/loss.png", "plots/dispersion.png", "plots/cosine.png"]
    markdown = (out / "report.md").read_text()
    if policy == "shared":
        assert all((out / png).stat().st_size > 0 for png in pngs) and all(f"]({png})" in markdown for png in pngs)
    else:  # --no-plots: report.html and report.md still written, without images
        assert not (out / "plots").exists() and "### Plots" not in markdown and (out / "report.html").is_file()


def test_a_probe_without_plots_gets_them_from_healthcheck_report(policy_runs, cli):
    out = policy_runs["per_rank"][0]
    done = cli("report", out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["cosine.png", "dispersion.png", "loss.png"]
    assert "](plots/loss.png)" in (out / "report.md").read_text()


def test_seed_perturbation_really_changes_rank0_data(policy_runs):
    # Same data seed on ranks 1-7 means the same first batches there; rank 0's sampler moved.
    def first_tokens(policy):
        rows = read_rows(policy_runs[policy][0] / "steps.jsonl")
        return [r["tokens"] for r in rows if r["step"] == 0]

    shared, rank0 = first_tokens("shared"), first_tokens("rank0_differs")
    assert shared[1:] == rank0[1:]
    assert shared[0] != rank0[0]


def test_local_model_dir_and_parquet(tmp_path):
    from healthcheck.config import ModelConfig
    from healthcheck.run.data import synthetic_rows
    from healthcheck.run.modeling import build_model, byte_level_tokenizer

    model_dir = tmp_path / "model"
    tokenizer = byte_level_tokenizer()
    build_model(ModelConfig(name="tiny-llama"), len(tokenizer), 512).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    import datasets

    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list(synthetic_rows(64, seed=3)).to_parquet(str(parquet))
    out, result = probe(
        tmp_path, "local", "--set", f"model.name={model_dir}", "--set", "data.source=datasets",
        "--set", f"data.path={parquet}", nproc=2,
    )
    assert result["status"] == "complete"
    assert result["config"]["model"]["name"] == str(model_dir)
    assert len(read_rows(out / "steps.jsonl")) == 4 * 2


@pytest.mark.skipif(not (SHARED_DATA / "gsm8k_alpaca.json").exists(), reason="../shared/data not available")
def test_real_gsm8k_with_truncation_stays_finite(tmp_path):
    out, result = probe(
        tmp_path, "gsm8k", "--set", "data.source=json", "--set", f"data.path={SHARED_DATA / 'gsm8k_alpaca.json'}",
        "--set", "data.max_length=128", nproc=2,
    )
    rows = read_rows(out / "steps.jsonl")
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in rows)
    assert all(isinstance(r["tokens"], int) for r in rows)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "train.stepz=3"], "train.stepz: unknown key"),
        (["--set", "train.lr=fast"], "train.lr"),
        (["--set", "model.name=./no/such/model"], "model.name: model directory not found"),
        (["--set", "model.name=tiny-gpt3"], "model.name: unknown preset 'tiny-gpt3'"),
        (["--set", "data.source=json", "--set", "data.path=/no/such.json"], "data.path: file not found"),
        (["--set", "distributed.nproc=1"], "distributed.nproc: must be >= 2"),
        (["--set", "rank_overrides={8: {train: {lr: 0.1}}}"], "rank_overrides: rank 8 is outside the world"),
        (["--config", "/no/such/probe.yaml"], "config file not found"),
        # Refused by the launcher's preflight; a worker that cannot import torch_npu (torchrun) says the same.
        (["--set", "distributed.device=npu", "--set", "distributed.nproc=2"], "distributed.device: 'npu' needs torch_npu"),
    ],
)
def test_bad_input_exits_2_in_one_line(tmp_path, args, expected):
    done = run_cli("probe", "--out", tmp_path / "run", *args, timeout=120)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "steps.jsonl").exists()


def test_unwritable_out_dir_exits_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = run_cli("probe", "--out", blocker / "run", timeout=120)
    assert done.returncode == 2
    assert "--out" in done.stderr and "not writable" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_config_check_runs_the_preflight_without_launching(tmp_path):
    ok = run_cli("config", "check", timeout=60)
    assert ok.returncode == 0 and "config OK: probe 'default', 8 workers" in ok.stdout
    bad = run_cli("config", "check", "--set", "data.source=json", "--set", "data.path=/no/such.json", timeout=60)
    assert bad.returncode == 2 and "data.path: file not found: /no/such.json" in bad.stderr


def test_config_show_round_trips_through_the_cli(tmp_path):
    shown = run_cli("config", "show", "--set", "seed_policy=per_rank", "--set", "train.steps=7", timeout=60)
    assert shown.returncode == 0
    path = tmp_path / "probe.yaml"
    path.write_text(shown.stdout)
    again = run_cli("config", "show", "--config", path, timeout=60)
    assert again.stdout == shown.stdout
    schema = run_cli("config", "schema", timeout=60)
    assert json.loads(schema.stdout)["title"] == "ProbeConfig"

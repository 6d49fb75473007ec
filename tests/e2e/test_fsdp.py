"""FSDP2 end to end: a user's ``fully_shard`` script probed unmodified, and the built-in probe sharded.

The client (``tests/clients/fsdp2_tutorial.py``) shards a small Llama the way PyTorch's FSDP2 example and
torchtitan do and accumulates two micro-batches per step. The same script with ``--wrap ddp`` trains the
same loop under DistributedDataParallel, whose metrics are checked against a float64 reference in
``test_script_mode.py``; here the FSDP2 run must agree with it rank by rank and step by step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.conftest import failed_ranks, read_rows, run_cli
from tests.e2e.test_script_mode import DATA, probe_args, tiny_llama  # noqa: F401 (tiny_llama is a fixture)

STEPS = 4
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")


def _probe(tmp: Path, model: Path, name: str, *, direction: str, script_args: tuple) -> tuple[Path, object]:
    out = tmp / name
    args = probe_args("fsdp2_tutorial", out, model, tmp / f"{name}-loss.jsonl", steps=STEPS,
                      extra=("--set", f"metrics.direction={direction}"), script_args=("--accum", "2", *script_args))
    return out, run_cli(*args)


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("fsdp2")
    return {
        "ddp": _probe(tmp, tiny_llama, "ddp", direction="exact", script_args=("--wrap", "ddp")),
        "replicate": _probe(tmp, tiny_llama, "replicate", direction="exact", script_args=("--wrap", "replicate")),
        "fsdp": _probe(tmp, tiny_llama, "fsdp", direction="exact", script_args=()),
        "fsdp-sketch": _probe(tmp, tiny_llama, "fsdp-sketch", direction="sketch", script_args=("--sync-every-microbatch",)),
        "hsdp": _probe(tmp, tiny_llama, "hsdp", direction="sketch", script_args=("--hsdp", "2")),
    }


def _by_step_rank(out: Path) -> dict[tuple[int, int], dict]:
    return {(row["step"], row["rank"]): row for row in read_rows(out / "steps.jsonl")}


@pytest.mark.parametrize("name", ["ddp", "replicate", "fsdp", "fsdp-sketch", "hsdp"])
def test_the_fsdp2_script_runs_unmodified_and_passes_its_audits(runs, name):
    out, done = runs[name]
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "complete" and result["steps_completed"] == STEPS and result["loss_note"] is None
    audits = result["audits"]
    assert all(entry["passed"] for entry in audits.values()), {k: v["message"] for k, v in audits.items()}
    if name in ("ddp", "replicate"):
        assert audits["param_equality"]["measured"] and "sharded_state" not in audits
    else:
        # No replicas under FSDP2: the sharded-state audit compares what the ranks must share instead.
        assert audits["sharded_state"]["measured"] and not audits["param_equality"]["measured"]
        assert audits["environment"]["passed"]
        # The optimizer is compared on check steps in script mode too (before: "the optimizer at 0 checks").
        assert "the optimizer at 2 checks" in audits["sharded_state"]["message"], audits["sharded_state"]["message"]
        assert ("the replicas of each shard (HSDP)" in audits["sharded_state"]["message"]) == (name == "hsdp")


def test_exact_metrics_under_fsdp2_equal_the_same_loop_under_ddp(runs):
    fsdp, ddp = _by_step_rank(runs["fsdp"][0]), _by_step_rank(runs["ddp"][0])
    assert set(fsdp) == set(ddp) == {(s, r) for s in range(STEPS) for r in range(4)}
    for key, row in fsdp.items():
        assert row["loss"] == pytest.approx(ddp[key]["loss"], rel=1e-6), key
        assert row["grad_norm"] == pytest.approx(ddp[key]["grad_norm"], rel=1e-5), key
        assert row["cosine_to_mean"] == pytest.approx(ddp[key]["cosine_to_mean"], abs=1e-5), key


def test_torchs_composable_replicate_is_measured_as_the_same_loop_under_ddp(runs):
    # torchtitan's data-parallel path: DDP built at the model's first forward, run from the model's own hooks. It was
    # refused (exit 2: "stepped its optimizer before a forward through its DistributedDataParallel model").
    replicated, ddp = _by_step_rank(runs["replicate"][0]), _by_step_rank(runs["ddp"][0])
    assert set(replicated) == set(ddp) == {(s, r) for s in range(STEPS) for r in range(4)}
    for key, row in replicated.items():
        assert [row[k] for k in ("loss", "tokens", "grad_norm", "cosine_to_mean")] == [
            ddp[key][k] for k in ("loss", "tokens", "grad_norm", "cosine_to_mean")], key


def test_sketch_mode_follows_a_reduce_scatter_per_microbatch(runs):
    # FSDP2's default reduce-scatters both micro-batches; the monitor adds their sketches (linear) and reads
    # the norms and cosines off the sum: estimates whose relative std is sqrt(2/p) (p = 4096).
    sketch, ddp = _by_step_rank(runs["fsdp-sketch"][0]), _by_step_rank(runs["ddp"][0])
    bound = 4 * math.sqrt(2 / 4096)
    for key, row in sketch.items():
        assert row["grad_norm"] == pytest.approx(ddp[key]["grad_norm"], rel=bound), key
        assert row["cosine_to_mean"] == pytest.approx(ddp[key]["cosine_to_mean"], abs=bound), key


def test_hsdp_measures_every_rank_of_every_replica(runs):
    # HSDP (2 replicas x 2 shards): each reduce-scatter spans one shard group, and its output is that group's mean,
    # not the job's. The monitor gathers from all 4 ranks; the local norms stay exact (the same as the same loop
    # under DDP), and ‖ḡ‖² takes its cross terms from the sketches, so the cosines and the mean's norm are estimates
    # within the sketch's bound. Before, HSDP was refused ("not supported").
    hsdp, ddp = _by_step_rank(runs["hsdp"][0]), _by_step_rank(runs["ddp"][0])
    assert set(hsdp) == set(ddp) == {(s, r) for s in range(STEPS) for r in range(4)}
    bound = 4 * math.sqrt(2 / 4096)
    for key, row in hsdp.items():
        assert row["loss"] == pytest.approx(ddp[key]["loss"], rel=1e-6), key
        assert row["grad_norm"] == pytest.approx(ddp[key]["grad_norm"], rel=1e-5), key
        assert row["cosine_to_mean"] == pytest.approx(ddp[key]["cosine_to_mean"], abs=bound), key
    mean = {r["step"]: r["mean_grad_norm"] for r in read_rows(runs["hsdp"][0] / "aggregates.jsonl")}
    exact = {r["step"]: r["mean_grad_norm"] for r in read_rows(runs["ddp"][0] / "aggregates.jsonl")}
    assert all(mean[s] == pytest.approx(exact[s], rel=bound) for s in range(STEPS)), (mean, exact)
    audits = json.loads((runs["hsdp"][0] / "result.json").read_text())["audits"]
    assert "reduce-scattered (per HSDP shard group)" in audits["reduction_numerics"]["message"]


def test_an_hsdp_replica_that_drifts_is_named_with_its_partner(tiny_llama, tmp_path):  # noqa: F811
    # After the 2nd update one rank's slice of lm_head.weight moves by 1e-3 (a device that wrote an update wrong).
    # Its replica in the other shard group holds the same slice: the two are named, at the shard they share. The
    # all-gathered parameters alone said only "ranks 0-3 differ" (two shard groups, no majority). The mesh is
    # [[0, 1], [2, 3]]: rank 1's replica is rank 3.
    drifter, partner = 1, 3
    out = tmp_path / "run"
    done = run_cli(*probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS,
                               script_args=("--hsdp", "2", "--bug", f"drift-rank={drifter}")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.sharded_state": sorted([drifter, partner])}, failed_ranks(out)
    message = json.loads((out / "result.json").read_text())["audits"]["sharded_state"]["message"]
    assert message.startswith(f"ranks {min(drifter, partner)}, {max(drifter, partner)} hold the same shard ({drifter % 2}) "
                              "but their slices of lm_head.weight differ after the last step"), message


def test_a_rank_whose_learning_rate_schedule_differs_is_named_under_fsdp2(tiny_llama, tmp_path):  # noqa: F811
    # Rank 1 warms up over 8 steps, the others over 4: every rank starts at lr 0, so the first step's settings agree,
    # and under FSDP2 no replica shows the difference. The learning rate each rank stepped with does, from step 1; so
    # does the optimizer, compared at the last step (--no-fail-fast). Before, script mode never compared the optimizer
    # (sharded_state said "the optimizer at 0 checks") and the probe passed.
    out = tmp_path / "run"
    done = run_cli(*probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS, extra=("--no-fail-fast",),
                               script_args=("--warmup", "4", "--bug", "warmup-rank=1")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.sharded_state": [1], "audit.learning_rate": [1]}, failed_ranks(out)
    audits = json.loads((out / "result.json").read_text())["audits"]
    assert audits["sharded_state"]["message"] == (
        f"rank 1's optimizer differs at step {STEPS - 1}: param_groups.0.lr 0.000375 (ranks 0, 2-3: 0.00075)"), audits["sharded_state"]
    assert audits["learning_rate"]["message"].startswith(
        "rank 1 stepped with another learning rate from step 1: ranks 0, 2-3 0.00025; rank 1 0.000125"), audits["learning_rate"]


def test_stale_weights_own_clipping_and_a_slow_logger_are_each_named_at_their_rank(tiny_llama, tmp_path):  # noqa: F811
    # Four faults no replicated state shows under FSDP2: rank 3's checkpoint differs before sharding, rank 1 clips
    # its own shard at a tenth of the others' max_norm, rank 0 sleeps 50 ms after its update, so the others wait
    # for it in the script's logging all_reduce rather than in FSDP2's collectives (before that wait counted toward
    # blame, this straggler passed), and rank 2 never clears its gradients, so its shard adds every step's gradient to
    # the last. Rank 1's rule for the no-decay group also misses the final norm, which it alone decays: no replicated
    # state shows that either, and it passed every check until each group's parameters were counted. --no-fail-fast:
    # the environment audit would stop the run before step 1.
    out = tmp_path / "run"
    args = probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=30, extra=("--no-fail-fast",),
                      script_args=("--clip", "1.0", "--weight-decay", "0.1",
                                   "--bug", "stale-weights-rank=3,clip-rank=1,slow-rank=0,no-zero-grad-rank=2,decay-rule-rank=1"))
    done = run_cli(*args)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = failed_ranks(out)
    assert failed == {"audit.sharded_state": [3], "audit.environment": [1], "audit.stragglers": [0], "audit.stale_gradients": [2]}, failed
    audits = json.loads((out / "result.json").read_text())["audits"]
    assert "lm_head.weight" in audits["sharded_state"]["message"]
    assert audits["environment"]["message"].startswith(
        "clip differs: ranks 0, 2-3 clip_grad_norm_ max_norm=1 norm_type=2; rank 1 clip_grad_norm_ max_norm=0.1 norm_type=2; "
        "optimizer.params differs: ranks 0, 2-3 16 tensors, "), audits["environment"]["message"]
    assert "; rank 1 17 tensors, " in audits["environment"]["message"]


def test_a_rank_that_shards_with_another_precision_is_named_before_the_first_all_gather(tiny_llama, tmp_path):  # noqa: F811
    # Without the check, gloo aborts in C++ on a rank that receives rank 2's larger buffer (not always rank 2).
    # No rank can train past that all-gather, so the stop comes with --no-fail-fast too: a verdict, not a crash.
    out = tmp_path / "run"
    args = probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=2,
                      extra=("--no-fail-fast",), script_args=("--bug", "bf16-except-rank=2"))
    done = run_cli(*args)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "stopped early at step 0: environment" in done.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["failure"] is None and result["steps_completed"] == 0
    message = "fsdp.param_dtype differs: ranks 0-1, 3 torch.bfloat16; rank 2 torch.float32"
    assert result["stopped_early"] == {"step": 0, "check": "environment", "message": message, "unavoidable": True, "ranks": [2]}
    # The audit also says what each rank computes in: the policy's param_dtype (it read "fp32" on every rank before).
    message += "; precision differs: ranks 0-1, 3 bfloat16 (FSDP2 param_dtype); rank 2 float32 (FSDP2 param_dtype)"
    assert result["audits"]["environment"]["message"] == message
    verdict = json.loads((out / "verdict.json").read_text())
    assert failed_ranks(out) == {"audit.environment": [2]}
    assert verdict["notes"][-1].endswith("the ranks cannot train past it, with --no-fail-fast either"), verdict["notes"]


@pytest.mark.parametrize(
    ("script_args", "rank", "places"),
    [
        # Gradient sync off for all but the last micro-batch (torchtitan, the built-in probe): at forward 2 the others
        # reduce-scatter in their backward and rank 1 does not.
        (("--bug", "accum-rank=1"), 1, "ranks 0, 2-3 forward 2 (gradient sync on); rank 1 forward 2 (gradient sync off)"),
        # A reduce-scatter per micro-batch (FSDP2's default, and accelerate's) and clipping: the others clip after
        # their 2nd forward, and the norm of sharded gradients is an all-reduce, which rank 2's 3rd forward met with an
        # all-gather (a hang until the clip compared where the ranks are too).
        (("--sync-every-microbatch", "--clip", "1", "--bug", "accum-rank=2"), 2,
         "ranks 0-1, 3 gradient clipping after 2 forwards; rank 2 forward 3 (gradient sync on)"),
    ],
    ids=["sync-off", "clip"],
)
def test_a_rank_with_its_own_gradient_accumulation_is_named_before_the_ranks_hang(tiny_llama, tmp_path, script_args, rank,  # noqa: F811
                                                                                  places):
    # Rank R accumulates 3 micro-batches where the others take 2: the ranks hung until distributed.timeout_s and the
    # probe ended in exit 3. Now every rank stops where they first differ.
    out = tmp_path / "run"
    args = probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=2,
                      extra=("--set", "distributed.timeout_s=60"), script_args=("--accum", "2", *script_args))
    done = run_cli(*args)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    message = f"train.before_first_update differs: {places}"
    assert result["stopped_early"] == {"step": 0, "check": "environment", "message": message, "unavoidable": True, "ranks": [rank]}
    assert failed_ranks(out) == {"audit.environment": [rank]} and result["audits"]["environment"]["message"] == message


def test_gradients_that_underflow_in_an_fp16_reduce_scatter_are_named(tiny_llama, tmp_path):  # noqa: F811
    # MixedPrecisionPolicy(reduce_dtype=float16) and the loss times 1e-7: every local gradient (~1e-10 a value) is 0
    # once FSDP2 casts it for the reduce-scatter. The ranks agree on everything, so every comparison passed and the
    # probe said PASS on a run that trains nothing.
    out = tmp_path / "run"
    args = probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=3,
                      extra=("--set", "distributed.nproc=2", "--set", "metrics.reduction_check_every=1"),
                      script_args=("--reduce-dtype", "fp16", "--loss-times", "1e-7"))
    done = run_cli(*args)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.zero_gradients": [0, 1]}
    audits = json.loads((out / "result.json").read_text())["audits"]
    assert audits["zero_gradients"]["message"].startswith("every rank's local gradient was exactly zero in every one of 3")
    reduction = audits["reduction_numerics"]
    assert reduction["passed"] and reduction["checked_steps"] == [0, 1, 2], reduction
    assert reduction["message"].startswith("the reduce-scattered gradient matches the float64 mean"), reduction["message"]


def test_the_builtin_probe_sharded_names_a_rank_whose_optimizer_differs(tmp_path):
    out = tmp_path / "run"
    done = run_cli("probe", "--out", str(out), "--audits-only", "--no-plots", "--set", "distributed.strategy=fsdp",
                   "--set", "distributed.nproc=4", "--set", "train.steps=4", "--set", "metrics.param_check_every=2",
                   "--set", "rank_overrides={2: {train: {lr: 0.01}}}")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = failed_ranks(out)
    assert failed.get("audit.sharded_state") == [2], failed
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["distributed"]["strategy"] == "fsdp"
    assert "lr" in result["audits"]["sharded_state"]["message"]


def test_the_builtin_probe_under_hsdp_names_a_straggler_and_a_rank_whose_optimizer_differs(tmp_path):
    # distributed.replicas=2: 2 replicas of a 2-rank shard group ([[0, 1], [2, 3]]). Rank 2's learning rate moves its
    # shard otherwise, which parts it from its replica (rank 0) too: the optimizer, the cause, is what is named. Rank
    # 1 sleeps 50 ms a step: its shard group waits for it, then that group reaches the replicas' all-reduce late as a
    # whole, so rank 0's lateness there is explained by its wait for rank 1 (measure/lateness.py). Before the
    # replicas' all-reduce was timed and judged among its own ranks, the straggler passed (1.008x).
    out = tmp_path / "run"
    done = run_cli("probe", "--out", str(out), "--audits-only", "--no-plots", "--no-fail-fast", "--set", "distributed.strategy=fsdp",
                   "--set", "distributed.replicas=2", "--set", "distributed.nproc=4", "--set", "train.steps=30",
                   "--set", "metrics.replay_every=0",
                   "--set", "rank_overrides={1: {faults: {step_sleep_ms: 50}}, 2: {train: {lr: 0.01}}}")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.sharded_state": [2], "audit.stragglers": [1]}, failed_ranks(out)
    message = json.loads((out / "result.json").read_text())["audits"]["sharded_state"]["message"]
    # The built-in schedule's warmup: step 0 steps at 0.4 of train.lr.
    assert message.startswith("rank 2's optimizer differs at step 0: param_groups.0.lr 0.004 (ranks 0-1, 3: 0.0004)"), message


def test_a_straggler_under_fsdp2_is_named_though_every_collective_waits_for_it(tmp_path):
    # FSDP2's all-gathers make every rank wait for the slowest inside the step, so every rank's step is as
    # long as the straggler's. busy_ms is the ranks' median own work plus the time the others waited for
    # this rank alone (measure/lateness.py). 50 ms is the catalogue's straggler. Rank 0, which also writes the
    # run's files, on 4 ranks and 20 steps: 8 ranks and 30 steps took 26 s of the suite for the same verdict (1.35x).
    out = tmp_path / "run"
    done = run_cli("probe", "--out", str(out), "--audits-only", "--no-plots", "--set", "distributed.strategy=fsdp",
                   "--set", "distributed.nproc=4", "--set", "train.steps=20", "--set", "metrics.replay_every=0",
                   "--set", "rank_overrides={0: {faults: {step_sleep_ms: 50}}}")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = failed_ranks(out)
    assert failed == {"audit.stragglers": [0]}, failed


def test_a_torchtitan_style_stream_rank_reading_another_part_is_named_with_it(tiny_llama, tmp_path):  # noqa: F811
    # datasets' IterableDataset split with split_dataset_by_node, as torchtitan reads its data: no index names a
    # sample, and the wrong part on rank 2 was not measured (or, with a batch size, an int(None) in the script's loop).
    out = tmp_path / "run"
    done = run_cli(*probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS,
                               script_args=("--stream", "--bug", "stream-rank=2")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.data_shards": [2, 3]}, failed_ranks(out)
    shards = json.loads((out / "result.json").read_text())["audits"]["data_shards"]
    assert shards["by"] == "content" and shards["message"].startswith("ranks 2-3 trained on the same samples"), shards


def test_an_fsdp1_script_is_refused_on_one_line_before_it_shards(tiny_llama, tmp_path):  # noqa: F811
    # FSDP1 (FullyShardedDataParallel, as PyTorch's FSDP1 tutorial wraps each decoder layer) runs on CPU/gloo but
    # reduce-scatters flat parameters nothing here measures. Before, the script reached its first optimizer step
    # and was told it built no distributed model.
    out = tmp_path / "run"
    done = run_cli(*probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS,
                               extra=("--set", "distributed.nproc=2"), script_args=("--wrap", "fsdp1")))
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("healthcheck: error:")]
    assert len(errors) == 1 and "FullyShardedDataParallel (FSDP1)" in errors[0] and "fsdp_version: 2" in errors[0], done.stderr
    assert not (tmp_path / "loss.jsonl").exists()  # refused before the first step the script logs


def test_a_bad_device_under_fsdp2_is_named_by_the_replay(tiny_llama, tmp_path):  # noqa: F811
    # Rank 1's matmuls are off by 1e-3 from step 2. Every rank replays the same micro-batch through the sharded model
    # (FSDP2 all-gathers as in training) and fingerprints each group's unsharded local gradient in the reduce-scatter.
    # Before, the replay was "not measured" under FSDP2, and this fault passed every check.
    out = tmp_path / "run"
    fault = "rank_overrides={1: {faults: {matmul_error: 0.001, matmul_error_from_step: 2}}}"
    done = run_cli(*probe_args("fsdp2_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS,
                               extra=("--set", "metrics.replay_every=2", "--set", fault), script_args=("--accum", "2")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    replay = result["audits"]["replay"]
    assert failed_ranks(out) == {"audit.replay": [1]} and replay["replay_steps"] == [0, 2], replay
    assert replay["message"].startswith("rank 1 computed a different gradient at step 2"), replay["message"]
    assert "reproduced on a second replay (persistent) [bitwise]: drain the node" in replay["message"], replay["message"]
    assert result["stopped_early"]["check"] == "replay" and result["stopped_early"]["step"] == 2

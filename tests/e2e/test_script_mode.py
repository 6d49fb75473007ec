"""``healthcheck probe --script``: real third-party training scripts, run unmodified on 4 CPU ranks.

The clients in ``tests/clients`` are written as users write them and import nothing from healthcheck:
the PyTorch DDP tutorial style with a DistributedSampler, ``transformers.Trainer``, TRL's
``SFTTrainer`` (prompt/completion data, ``completion_only_loss``) and an ``accelerate`` loop with
``gradient_accumulation_steps=2``, on a small local Llama (``save_pretrained``) and ../shared/data.

For each: the per-step global loss rebuilt from healthcheck's per-rank rows (token-weighted) equals the
framework's own logged loss within 1%, and the gradient metrics equal a float64 reference taken from
per-parameter hooks (:mod:`tests.e2e.with_gradient_reference`), independent of the monitor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from healthcheck.measure import runqueue
from tests.e2e.conftest import REPO, SHARED_DATA, failed_findings, failed_ranks, read_rows, run_cli, run_command

DATA = SHARED_DATA / "gsm8k_alpaca.json"
CLIENTS = REPO / "tests" / "clients"
STEPS = 6
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    sys.path.insert(0, str(CLIENTS))
    try:
        from make_model import make_tiny_llama
    finally:
        sys.path.remove(str(CLIENTS))
    return Path(make_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny-llama")))


def probe_args(client: str, out: Path, model: Path, log: Path, *, steps: int = STEPS, extra: tuple = (),
               script_args: tuple = ()) -> list[str]:
    # --no-plots: these tests read result.json and the terminal; the PNGs are test_probe_cli's and test_plots.py's.
    return ["probe", "--script", str(CLIENTS / f"{client}.py"), "--out", str(out), "--audits-only", "--no-plots",
            "--set", "distributed.nproc=4", "--set", f"train.steps={steps}", "--set", "metrics.warmup_steps=1", *extra,
            "--", "--model", str(model), "--data", str(DATA), "--steps", "40", "--log", str(log), *script_args]


def run_with_reference(dump: Path, args: list[str]) -> subprocess.CompletedProcess:
    return run_command([sys.executable, "-m", "tests.e2e.with_gradient_reference", str(dump), *args], timeout=900)


CLIENT_NAMES = ("ddp_tutorial", "hf_trainer", "trl_sft", "accelerate_loop")


@pytest.fixture(scope="module", params=CLIENT_NAMES)
def client_run(request, tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    out, log, dump = folder / "run", folder / "own-loss.jsonl", folder / "reference"
    done = run_with_reference(dump, probe_args(request.param, out, tiny_llama, log,
                                               extra=("--set", "metrics.direction=exact")))
    return request.param, done, out, log, dump


def test_the_script_runs_unmodified_and_passes_its_audits(client_run):
    name, done, out, _, _ = client_run
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "complete" and result["steps_completed"] == STEPS
    assert result["config"]["script"]["path"].endswith(f"{name}.py")
    assert result["loss_note"] is None, result["loss_note"]
    assert result["gradient_note"] is None, result["gradient_note"]  # accumulation under no_sync: one reduction a step
    assert result["environment"]["world_size"] == 4
    # Exact mode on the host: the comm hook reads DDP's buckets (test_script_grads.py takes the .grad path).
    assert {rank["gradient_source"] for rank in result["environment"]["ranks"]} == {"comm_hook"}
    audits = result["audits"]
    assert all(entry["passed"] for entry in audits.values()), {k: v["message"] for k, v in audits.items()}
    assert audits["data_shards"]["measured"] and audits["data_shards"]["samples_per_rank"][0] >= STEPS
    # Each client's collate (its own, transformers' and TRL's collators) made the same batch of the same samples.
    assert audits["data_shards"]["message"].endswith("makes the same batch of the dataset's first, middle and last samples")
    assert "PASS" in done.stdout and "audits only" in done.stdout
    # The replay audit runs on every client: with the model's own loss where it is given labels, else (the DDP
    # tutorial's loss is computed outside the model) with a surrogate of its outputs.
    replay = audits["replay"]
    assert replay["measured"] and "bit-identical" in replay["message"], (name, replay["message"])
    # Every client clears its gradients between updates (the Trainer and TRL with model.zero_grad(), accelerate's
    # optimizer only on its synchronising micro-steps): read at each step's first backward, on every rank.
    stale = audits["stale_gradients"]
    assert stale["message"] == f"every rank started each step's backward with cleared gradients ({STEPS} steps)", (name, stale)


def test_global_loss_from_the_rows_equals_the_frameworks_own_logged_loss(client_run):
    name, _, out, log, _ = client_run
    rows = read_rows(out / "steps.jsonl")
    own = {entry["step"]: entry["loss"] for entry in read_rows(log)}
    compared = 0
    for step in range(STEPS):
        ranks = [r for r in rows if r["step"] == step]
        assert len(ranks) == 4 and all(r["loss"] is not None and r["tokens"] > 0 for r in ranks), ranks
        # Each rank's learning rate as it stepped (what param_equality's message reads): one value per step.
        assert len({r["lr"] for r in ranks}) == 1 and ranks[0]["lr"] is not None, ranks
        rebuilt = sum(r["loss"] * r["tokens"] for r in ranks) / sum(r["tokens"] for r in ranks)
        # The scripts number steps from 1 and log after the optimizer step; the probe ends inside its last one.
        if step + 1 in own:
            assert abs(rebuilt - own[step + 1]) <= 0.01 * abs(own[step + 1]), (name, step, rebuilt, own[step + 1])
            compared += 1
    assert compared >= STEPS - 1, f"{name}: only {compared} logged steps to compare ({sorted(own)})"


def reference_metrics(dump: Path, step: int, ranks: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 reference at ``step`` (:mod:`tests.e2e.with_gradient_reference`): each rank's gradient norm and
    cosine to the mean, and the pairwise cosines."""
    local = torch.stack([torch.load(dump / f"rank{r}-step{step}.pt") for r in range(ranks)])
    norms, mean = local.norm(dim=1), local.mean(dim=0)
    return norms, (local @ mean) / (norms * mean.norm()), (local @ local.T) / (norms[:, None] * norms[None, :])


def test_gradient_metrics_equal_a_float64_reference(client_run):
    name, _, out, _, dump = client_run
    rows = read_rows(out / "steps.jsonl")
    aggregates = {a["step"]: a for a in read_rows(out / "aggregates.jsonl")}
    for step in range(STEPS):
        norms, to_mean, cosine = reference_metrics(dump, step)
        by_rank = {r["rank"]: r for r in rows if r["step"] == step}
        for rank in range(4):
            assert by_rank[rank]["grad_norm"] == pytest.approx(float(norms[rank]), rel=1e-5), (name, step, rank)
            assert by_rank[rank]["cosine_to_mean"] == pytest.approx(float(to_mean[rank]), abs=1e-5), (name, step, rank)
        pairwise = torch.tensor(aggregates[step]["pairwise_cosine"], dtype=torch.float64)
        assert float((pairwise - cosine).abs().max()) <= 1e-5, (name, step)


# --------------------------------------------------------------------------- detection in script mode


@pytest.mark.parametrize(
    ("bugs", "steps", "expected"),
    [
        # Decisive at step 0 (fail fast), each named at its own rank: a rank that reseeds after init_process_group; a
        # setting no parameter holds, read at the first training forward; a rank whose data file differs (its indices
        # follow the plan, its samples do not: it passed before the dataset digest); a rank with lower matmul precision;
        # a rank that patches its attention's forward at import, and one that patches the module-level rotary
        # embedding its attention calls, as Liger does (only the replay saw either, and blamed the device).
        ("reseed-rank=1,dropout-rank=3,stale-data-rank=2,matmul-medium-rank=0,attention-patch-rank=0,rope-patch-rank=2",
         STEPS, {"audit.seeds": {1}, "audit.environment": {0, 2, 3}, "audit.data_shards": {2}}),
        # A sampler seeded per rank; a rank left in eval mode by a validation pass; a loss setting on one rank (near the
        # uniform distribution, label smoothing barely moves the statistics); a rank whose model config is another
        # revision (the same parameters, another function: only the replay noticed it, and blamed the device); a rank
        # with its own batch size (its DistributedSampler shard is still disjoint: only the loader's setting shows it).
        # A rank whose no-decay group has its own learning rate (the first group, which alone was read, agrees).
        ("sampler-seed-per-rank,eval-pass-rank=0,label-smoothing-rank=1,norm-eps-rank=2,batch-size-rank=3,nodecay-lr-rank=1", STEPS,
         {"audit.data_shards": {1, 2, 3}, "audit.environment": {0, 1, 2, 3}}),
        # Judged after the run, over its steps (--no-fail-fast). Exact: the backward hands rank 3's loss twice the others'
        # gradient (judge/loss_weight.py; the gradient norms' outlier test needed 12 steps). Rank 2 is slow after its
        # backward: the others wait for it in the next forward's buffer broadcast and in the script's logging all-reduce;
        # neither may land in their step time (measure/wait_clock.py). Rank 1's collate drops the EOS: its indices and
        # dataset agree with everyone's, the batch it makes of the same samples does not (decisive at step 0 otherwise).
        # Rank 0 never clears its gradients: DDP still hands every rank the same update (judge/stale_gradients.py).
        ("loss-x2-rank=3,slow-rank=2,no-eos-rank=1,no-zero-grad-rank=0", 30,
         {"audit.loss_weight": {3}, "audit.stragglers": {2}, "audit.data_shards": {1}, "audit.stale_gradients": {0}}),
        # The loop between the loader and the loss, as another revision of the training code on one node has it: one
        # more shift of the labels, inputs masked after the labels were made, a forward without the attention mask, a
        # z-loss added to the loss (no cross-entropy call). The batches, settings and replays agree, and on this freshly
        # initialised model no statistic moved: all four passed before (target_shift.py, forwards.py, loss_graph.py).
        ("loop-shift-rank=1,input-noise-rank=3,no-mask-rank=2,z-loss-rank=0", STEPS, {"audit.environment": {0, 1, 2, 3}}),
    ],
    ids=["seeds-environment-data", "sampler-eval-smoothing", "loss-x2-slow", "loop-shift-noise-mask"],
)
def test_faulty_scripts_fail_and_name_each_fault_at_its_rank(bugs, steps, expected, tiny_llama, tmp_path):
    if "audit.stragglers" in expected and runqueue.read() is None and runqueue.cores_shared(4):
        pytest.skip("4 ranks share this host's cores and it gives no run-queue clock: stragglers are not judged here")
    out = tmp_path / "run"
    full = "audit.stragglers" in expected  # judged over every step: no fail fast
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=steps,
                               extra=("--no-fail-fast",) if full else (), script_args=("--bug", bugs)))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = {check: set(ranks) for check, ranks in failed_ranks(out).items()}
    assert {check: failed.get(check) for check in expected} == expected, failed
    result = json.loads((out / "result.json").read_text())
    if full:
        assert result["stopped_early"] is None and result["steps_completed"] == steps
    else:
        stop = result["stopped_early"]
        assert stop["step"] == 0 and f"audit.{stop['check']}" in expected, stop
        assert stop["message"] == result["audits"][stop["check"]]["message"] and result["steps_completed"] == 0
    if "no-eos-rank=1" in bugs:  # the fields its collate makes differently, at rank 1 only
        message = result["audits"]["data_shards"]["message"]
        assert message.startswith("the ranks' DataLoaders make different batches of the same samples: [0] differs: "
                                  "ranks 0, 2-3 int64[3,"), message
        assert "[2] differs" in message and "; rank 1 int64[3," in message, message
    if "audit.environment" in expected:  # the settings that differ, and nothing else
        settings = {"eval-pass-rank": ["model.eval_modules"],
                    "dropout-rank": ["model.config.attention_dropout", "model.dropout"],
                    # Smoothing adds its own term to the loss: the mean of -log p over the vocabulary.
                    "label-smoothing-rank": ["loss.label_smoothing", "loss.graph"],
                    "norm-eps-rank": ["model.config.rms_norm_eps", "model.modules.LlamaRMSNorm"],
                    "batch-size-rank": ["data.batch_size"],
                    "nodecay-lr-rank": ["optimizer[1].lr"],
                    "attention-patch-rank": ["model.patched_forwards"], "rope-patch-rank": ["model.patched_functions"],
                    "loop-shift-rank": ["loss.target_shift"], "input-noise-rank": ["loss.target_shift"],
                    "no-mask-rank": ["train.forward_args"], "z-loss-rank": ["loss.graph"],
                    # "medium" lowers every backend's fp32 matmul that has no precision of its own: cuBLAS and oneDNN
                    "matmul-medium-rank": ["fp32_precision.cuda.matmul", "fp32_precision.mkldnn.matmul"]}
        named = {s for bug in bugs.split(",") for s in settings.get(bug.partition("=")[0], [])}
        message = result["audits"]["environment"]["message"]
        assert all(f"{setting} differs" in message for setting in named) and message.count("differs") == len(named), message
        if "loop-shift-rank=1" in bugs:
            assert ("loss.target_shift differs: ranks 0, 2 the inputs shifted by 1; rank 1 the inputs shifted by 2; "
                    "rank 3 not the inputs") in message, message
            assert "rank 2 input_ids int64 2-d" in message, message
            assert "loss.graph differs: ranks 1-3 " in message and "; rank 0 " in message and "Logsumexp" in message, message


def test_labels_shifted_before_a_model_that_shifts_them_are_named(tiny_llama, tmp_path):
    # A plain loop that hands its labels to the model (transformers' loss pads and shifts them), rank 2 shifting them
    # first: it learns the token two ahead. Its batches, settings and replays agree with everyone's, and on this
    # freshly initialised model a 20-step probe passed it, its rank-outlier and spike tests included.
    out = tmp_path / "run"
    done = run_cli(*probe_args("sft_loop", out, tiny_llama, tmp_path / "loss.jsonl", script_args=("--bug", "label-shift=2")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.environment": [2]}
    result = json.loads((out / "result.json").read_text())
    assert result["audits"]["environment"]["message"] == (
        "loss.target_shift differs: ranks 0-1, 3 the inputs shifted by 1; rank 2 the inputs shifted by 2")
    assert result["stopped_early"]["step"] == 0


@pytest.mark.parametrize(
    ("client", "rank", "script_args"),
    [
        # transformers.Trainer's model computes its loss from the batch. With reentrant activation checkpointing,
        # which refuses autograd.grad: the replay used it and ended in exit 3.
        ("hf_trainer", 2, ("--gradient-checkpointing", "reentrant")),
        # The DDP tutorial computes its loss outside the model: the replay differentiates a surrogate of the
        # model's outputs (it was "not measured").
        ("ddp_tutorial", 1, ()),
    ],
)
def test_a_bad_device_is_named_by_the_replay(client, rank, script_args, tiny_llama, tmp_path):
    # Every rank can replay one rank's micro-batch; the faulted rank's matmuls are off by 1e-3 from step 1 (a device
    # fault, in its replays too).
    out, fault = tmp_path / "run", "{faults: {matmul_error: 0.001, matmul_error_from_step: 1}}"
    done = run_cli(*probe_args(client, out, tiny_llama, tmp_path / "loss.jsonl", steps=6,
                               extra=("--set", "metrics.replay_every=2", "--set", f"rank_overrides={{{rank}: {fault}}}"),
                               script_args=script_args))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = failed_ranks(out)
    assert failed == {"audit.replay": [rank]}, failed
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_early"]["step"] == 2 and "reproduced" in result["stopped_early"]["message"]


def test_a_rank_with_a_global_module_hook_is_sent_to_check_it_not_to_drain_its_node(tiny_llama, tmp_path):
    # A forward hook registered for every module (register_module_forward_hook), as a node's activation checker would,
    # rounds rank 1's embeddings to bfloat16. No setting differs and the model's own modules carry no hook: the replay
    # saw another gradient and advised draining a sound node.
    out = tmp_path / "run"
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=2,
                               script_args=("--bug", "global-hook-rank=1")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.replay": [1]}, failed_ranks(out)
    message = json.loads((out / "result.json").read_text())["audits"]["replay"]["message"]
    assert "hooks.(every module) differs: ranks 0, 2-3 <unset>; rank 1 1x forward main.<locals>.check_bf16" in message, message
    assert message.endswith("check them before suspecting the device") and "drain the node" not in message, message


def test_a_trainer_whose_main_process_alone_shows_progress_passes(tiny_llama, tmp_path):
    # disable_tqdm=local_rank != 0 and a log level per rank, as many scripts set them (report_to="wandb" on the main
    # process alone too): nothing the ranks compute differs, and the probe failed as trainer.disable_tqdm differs.
    # Rank 2's node has the cores for persistent DataLoader workers (they read the same batches): that failed too.
    out = tmp_path / "run"
    workers = ("--override", "2:dataloader_num_workers=2", "--override", "2:dataloader_persistent_workers=True")
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", steps=2,
                               script_args=("--main-reports", *workers)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    facts = json.loads((out / "result.json").read_text())["audits"]["environment"]["facts"]
    assert facts["trainer.logging_steps"] == "1" and "trainer.disable_tqdm" not in facts and "trainer.log_level" not in facts
    assert "trainer.dataloader_persistent_workers" not in facts


def test_a_trainer_rank_with_neftune_is_named_by_its_argument_and_not_sent_to_be_drained(tiny_llama, tmp_path):
    # NEFTune on one rank adds noise to its embeddings through a forward hook. No setting the environment audit read
    # differed, and the replay, which alone saw it, advised draining a sound node; then the replay named the rank's
    # hooks. Now the Trainer's own argument is a fact (trainer_args.py), named at step 0; run on, the replay sends that
    # rank to its settings, not to be drained (tests/unit/judge cover its hooks' hint, for a script without a Trainer).
    out = tmp_path / "run"
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", steps=2, extra=("--no-fail-fast",),
                               script_args=("--neftune-rank", "1")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = failed_findings(out)
    assert list(failed) == ["audit.environment", "audit.replay"] and failed["audit.replay"]["ranks"] == [1], list(failed)
    assert "trainer.neftune_noise_alpha differs: ranks 0, 2-3 None; rank 1 5.0" in failed["audit.environment"]["message"]
    message = failed["audit.replay"]["message"]
    assert "rank 1 also runs with other settings (audit.environment)" in message and "drain the node" not in message, message


def test_a_trainer_rank_in_bf16_is_named_for_its_precision_not_its_device(tiny_llama, tmp_path):
    # TrainingArguments(bf16=True) on one rank: accelerate replaces the model's forward by one that enters autocast
    # inside the DDP forward, after healthcheck's pre-hook. That rank read fp32, and the replay, which alone saw it,
    # advised draining a sound node.
    out = tmp_path / "run"
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", steps=2, script_args=("--bf16-rank", "2")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_early"]["step"] == 0 and result["stopped_early"]["check"] == "environment", result["stopped_early"]
    assert [rank["precision"] for rank in result["environment"]["ranks"]] == ["fp32", "fp32", "bfloat16 autocast", "fp32"]
    message = result["audits"]["environment"]["message"]
    assert "precision differs: ranks 0-1, 3 fp32; rank 2 bfloat16 autocast" in message, message
    assert "drain the node" not in result["audits"]["replay"]["message"], result["audits"]["replay"]


@pytest.mark.parametrize(
    "variant",
    [
        # TrainingArguments(torch_compile=True): accelerate compiles the DDP model, and the Hugging Face loss runs in
        # the compiled graph. dynamo took healthcheck's patched cross-entropy for torch's own and evaluated it on
        # fake tensors; reading them ended this probe in exit 3 (DataDependentOutputException). aot_eager traces as
        # inductor does, without a C++ compile per rank.
        ("--torch-compile-backend", "aot_eager"),
        # TrainingArguments(label_smoothing_factor=0.1): the Trainer takes the labels away from the model and
        # computes the loss with its LabelSmoother, so no cross-entropy and no model loss exist: the loss was "not
        # measured". It is the smoothed objective the Trainer logs.
        ("--label-smoothing", "0.1"),
    ],
    ids=["torch_compile", "label_smoothing"],
)
def test_a_trainer_variant_is_measured_and_its_loss_is_the_trainers(variant, tiny_llama, tmp_path):
    out, log, steps = tmp_path / "run", tmp_path / "loss.jsonl", 3
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, log, steps=steps, extra=("--set", "distributed.nproc=2"),
                               script_args=variant))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["environment"]["world_size"] == 2 and result["steps_completed"] == steps
    assert result["loss_note"] is None, result["loss_note"]
    if variant[0] == "--torch-compile-backend":  # the model computes its loss, so the replay can re-run it
        assert result["audits"]["replay"]["measured"], result["audits"]["replay"]["message"]
    rows, own = read_rows(out / "steps.jsonl"), {entry["step"]: entry["loss"] for entry in read_rows(log)}
    for step in range(steps - 1):  # the probe ends inside its last step, before the Trainer logs it
        ranks = [r for r in rows if r["step"] == step]
        rebuilt = sum(r["loss"] * r["tokens"] for r in ranks) / sum(r["tokens"] for r in ranks)
        assert rebuilt == pytest.approx(own[step + 1], rel=1e-4), (step, rebuilt, own)


def test_the_loss_is_what_the_backward_trains_in_chunks_and_beside_a_validation_pass(tiny_llama, tmp_path):
    # torchtune's chunked loss: four cross-entropies of different values in each backward. Before, the capture could not
    # tell which one trained, and the loss was not measured; the backward weighs each chunk's tokens the same. And a
    # validation loss after every step, without no_grad: its forward was taken for a micro-batch of the next step, its
    # loss added to that step's and its unknown weight left the step's unjudged.
    out, log, steps = tmp_path / "run", tmp_path / "loss.jsonl", 4
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, log, steps=steps, extra=("--set", "distributed.nproc=2"),
                               script_args=("--loss-chunks", "4", "--val-every", "1")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["loss_note"] is None, result["loss_note"]
    weight = result["audits"]["loss_weight"]["message"]
    assert weight.startswith(f"every rank's loss enters its backward with the same weight (1 in each of {steps} steps"), weight
    rows, own = read_rows(out / "steps.jsonl"), {entry["step"]: entry["loss"] for entry in read_rows(log)}
    for step in range(steps - 1):
        ranks = [r for r in rows if r["step"] == step]
        rebuilt = sum(r["loss"] * r["tokens"] for r in ranks) / sum(r["tokens"] for r in ranks)
        assert rebuilt == pytest.approx(own[step + 1], rel=1e-5), (step, rebuilt, own)


def test_a_doubled_loss_is_named_in_a_bf16_model_whose_weights_carry_bf16_rounding(tiny_llama, tmp_path):
    # A model trained in bf16 computes its loss on bf16 logits: each rank's weight of 1 reads within ±0.4% of it (2⁻⁸),
    # and the audit took that scatter for weights that follow the data ("not judged"), doubled loss or not.
    out = tmp_path / "run"
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=5,
                               extra=("--set", "distributed.nproc=3"),
                               script_args=("--dtype", "bfloat16", "--bug", "loss-x2-rank=1")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.loss_weight": [1]}, failed_ranks(out)
    rows = read_rows(out / "steps.jsonl")
    assert {row["loss_weight_u"] for row in rows} == {2.0**-8}, rows
    result = json.loads((out / "result.json").read_text())
    assert [rank["precision"] for rank in result["environment"]["ranks"]] == ["bfloat16"] * 3  # not "fp32"
    message = result["audits"]["loss_weight"]["message"]
    assert message.startswith("rank 1's loss enters its backward with 2x the weight of ranks 0, 2's"), message


def test_a_trainer_rank_with_its_own_gradient_accumulation_is_named_at_step_0(tiny_llama, tmp_path):
    # Rank 1 runs 4 micro-batches per update, the others 2: DDP's all-reduces pair up (one per update), the Trainer
    # divides by a token count over every rank, so the loss weights per token agree, and the shards stay disjoint.
    # It passed every audit; then the number of training forwards in step 0 showed it, at the first update. Now its
    # 2nd forward does (under no_sync, where the others' all-reduce), as under FSDP2 (:mod:`.lockstep`).
    out = tmp_path / "run"
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", steps=3, script_args=("--accum-rank", "1")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_early"]["check"] == "environment" and result["steps_completed"] == 0, result["stopped_early"]
    assert result["audits"]["environment"]["message"] == ("train.before_first_update differs: ranks 0, 2-3 forward 2 "
                                                          "(gradient sync on); rank 1 forward 2 (gradient sync off)")
    assert failed_ranks(out) == {"audit.environment": [1]}


@pytest.mark.parametrize(
    "override, fsdp2, message",
    [
        # The Trainer gathers each step's token count before its forwards; rank 3 does not, and went to its first
        # forward while the others gathered: gloo aborted on the sizes (exit 3, SIGABRT on rank 0).
        ("3:average_tokens_across_devices=False", False,
         "train.before_first_update differs: ranks 0-2 the script's torch.distributed.all_gather after 0 forwards; "
         "rank 3 the model's first forward"),
        # The same under FSDP2, where the others, stopped before the Trainer's model.train(), were still in the eval
        # mode from_pretrained leaves: the environment audit named that too, a mode no rank trains in.
        ("1:average_tokens_across_devices=False", True,
         "train.before_first_update differs: ranks 0, 2-3 the script's torch.distributed.all_gather after 0 forwards; "
         "rank 1 the model's first forward"),
        # The Trainer gives DDP find_unused_parameters=True for a transformers model; rank 2 all-reduces no
        # used-parameter map after its backward, and the others waited for it until distributed.timeout_s (exit 3).
        ("2:ddp_find_unused_parameters=False", False,
         "ddp.find_unused_parameters differs: ranks 0-1, 3 True; rank 2 False"),
        # DDP's constructor broadcasts the initial weights, rank 1's without its buffers (the rotary frequencies):
        # gloo aborted there, the stacks naming ranks 1 and 3, before any hook of healthcheck's ran.
        ("1:ddp_broadcast_buffers=False", False, "ddp.init_sync differs: ranks 0, 2-3 parameters and buffers; rank 1 parameters"),
    ],
    ids=["token-count-gather", "token-count-gather-fsdp2", "find-unused", "broadcast-buffers"],
)
def test_a_trainer_rank_whose_collectives_differ_is_named_before_its_first_forward(override, fsdp2, message, tiny_llama, tmp_path):
    out = tmp_path / "run"
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", steps=3,
                               extra=("--set", "distributed.timeout_s=60"),
                               script_args=("--override", override, *(("--fsdp2",) if fsdp2 else ()))))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_early"]["check"] == "environment" and result["steps_completed"] == 0, result["stopped_early"]
    assert result["audits"]["environment"]["message"] == message
    assert failed_ranks(out) == {"audit.environment": [int(override[0])]}


def test_trl_scaling_one_ranks_loss_is_named_though_its_weights_follow_the_data(tiny_llama, tmp_path):
    # TRL divides by a token count over every rank, so each rank's weight is N_rank / N_all: judged per token.
    # Fail fast stops the probe once 4 steps are judged; their weights arrive a step late, so after 5 of its 12 steps.
    out = tmp_path / "run"
    done = run_cli(*probe_args("trl_sft", out, tiny_llama, tmp_path / "loss.jsonl", steps=12,
                               script_args=("--loss-scale-rank", "1")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = failed_ranks(out)
    assert failed == {"audit.loss_weight": [1]}, failed
    result = json.loads((out / "result.json").read_text())
    message = result["audits"]["loss_weight"]["message"]
    assert message.startswith("rank 1's loss enters its backward with 1.5x the weight per token of ranks 0, 2-3's"), message
    stop = result["stopped_early"]
    assert (stop["step"], stop["check"], result["steps_completed"]) == (3, "loss_weight", 5), (stop, result["steps_completed"])
    assert stop["message"].startswith("rank 1's loss enters its backward with 1.5x") and "in each of 4 steps" in stop["message"]


def test_a_script_that_splits_its_data_per_rank_is_not_failed_for_equal_indices(tiny_llama, tmp_path):
    # datasets' split_dataset_by_node, then the same shuffled loader on every rank: equal indices into different
    # parts. It was failed (exit 1) as "every rank read the same samples"; then it went unmeasured. The samples'
    # tokens tell the parts apart.
    out = tmp_path / "run"
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=2,
                               script_args=("--split-by-node",)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    shards = json.loads((out / "result.json").read_text())["audits"]["data_shards"]
    assert shards["measured"] and shards["by"] == "content", shards
    assert shards["message"].startswith("ranks 0-3 trained on different samples"), shards["message"]


@pytest.mark.parametrize("script_args, code, named", [
    # An IterableDataset is fetched with None for indices: recording them raised in the script's loop (exit 3). Read
    # through a DataLoader worker, as a streaming pipeline is, it passes on what the ranks trained on.
    (("--workers", "1"), 0, ()),
    (("--bug", "stream-shard-rank=1"), 1, (1, 2)),  # rank 1 reads rank 2's part: both named, the hashes can't say which moved
    # Two workers, each yielding the rank's whole part (no get_worker_info split): every batch twice, on every rank.
    (("--workers", "2", "--bug", "stream-no-worker-split"), 1, (0, 1, 2, 3)),
])
def test_a_stream_that_shards_itself_is_judged_by_its_samples_tokens(tiny_llama, tmp_path, script_args, code, named):
    out = tmp_path / "run"
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=3 + 2 * ("--workers" in script_args),
                               script_args=("--stream", *script_args)))
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-2000:]
    shards = json.loads((out / "result.json").read_text())["audits"]["data_shards"]
    assert shards["measured"] and shards["by"] == "content" and tuple(shards["ranks"]) == named, shards
    if code == 0:
        assert shards["samples_per_rank"] == [20] * 4, shards
        assert shards["message"].startswith("ranks 0-3 trained on different samples (80 samples"), shards["message"]
    else:
        assert failed_ranks(out) == {"audit.data_shards": list(named)}, failed_ranks(out)
        expected = "trained on the same batch twice in a row" if len(named) == 4 else "ranks 1-2 trained on the same samples"
        assert expected in shards["message"], shards["message"]


@pytest.fixture(scope="module")
def nanogpt_tokens(tiny_llama, tmp_path_factory) -> Path:
    """The client's own ``--prepare`` output (one flat uint16 token file), made once for the tests that read it."""
    data = tmp_path_factory.mktemp("nanogpt") / "train.bin"
    subprocess.run([sys.executable, str(CLIENTS / "nanogpt_style.py"), "--prepare", "--model", str(tiny_llama), "--data",
                    str(DATA), "--bin", str(data)], check=True, timeout=120)
    return data


@pytest.mark.parametrize("bug, code, wrap", [("none", 0, ()), ("same-seed", 1, ()), ("same-seed", 1, ("--fsdp2",))])
def test_a_nanogpt_style_loop_seeds_per_rank_and_is_judged_on_its_forwards_inputs(tiny_llama, nanogpt_tokens, tmp_path, bug,
                                                                                   code, wrap):
    # nanoGPT's train.py: no DataLoader, torch seeded 1337 + rank so that get_batch draws each rank's own offsets. That
    # per-rank seed failed the seeds audit (exit 1, at step 0); the batches went unjudged. Without the offset every
    # rank trains on the same batches, and only the inputs of each step's forward show it. Under FSDP2 no forward's
    # inputs were kept (the replay kept them for DDP only) and this was "not measured".
    data, client = nanogpt_tokens, str(CLIENTS / "nanogpt_style.py")
    out = tmp_path / "run"
    done = run_cli("probe", "--script", client, "--out", str(out), "--audits-only", "--set", "distributed.nproc=4", "--set",
                   "train.steps=3", "--", "--model", str(tiny_llama), "--bin", str(data), "--bug", bug, *wrap)
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-2000:]
    audits = json.loads((out / "result.json").read_text())["audits"]
    assert audits["data_shards"]["measured"] and audits["data_shards"]["by"] == "forward inputs", audits["data_shards"]
    if code == 0:
        assert all(audit["passed"] for audit in audits.values()), {k: v["message"] for k, v in audits.items()}
        assert "other than torch's (seeded per rank by the code: not judged)" in audits["seeds"]["message"]
    else:
        assert failed_ranks(out) == {"audit.data_shards": [0, 1, 2, 3]}, failed_ranks(out)
        assert "drew the same batch at every step" in audits["data_shards"]["message"]


def test_a_trainer_on_a_stream_passes_under_accelerates_dispatch(tiny_llama, tmp_path):
    # transformers.Trainer on datasets' to_iterable_dataset(): accelerate's default dispatches (rank 0 reads every
    # rank's batch). The other ranks' missing DataLoader settings failed the environment audit (exit 1).
    out = tmp_path / "run"
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", steps=2,
                               script_args=("--stream", "dispatch")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    audits = json.loads((out / "result.json").read_text())["audits"]
    assert all(audit["passed"] for audit in audits.values()), {k: v["message"] for k, v in audits.items()}
    assert audits["data_shards"]["message"].startswith("not measured: only rank 0 fetched from a DataLoader")


def test_a_rank_that_logs_a_validation_loss_through_ddp_before_training_passes(tiny_llama, tmp_path):
    # Rank 0 evaluates one batch on the DDP model under no_grad before it trains. DDP's first forward broadcasts the
    # model's buffers (the Llama's rotary frequencies) with autograd on or off, and torch pairs rank 0's broadcast
    # with the others' first training forward's: the script runs under torchrun. The ranks compared their place
    # before DDP's forward, where the others' comparison met rank 0's broadcast, and the probe hung (exit 3).
    out = tmp_path / "run"
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=3,
                               script_args=("--look-first-rank", "0", "--look-first-through-ddp"),
                               extra=("--set", "distributed.timeout_s=60")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "sanity loss before training" in (out / "logs" / "rank-0.log").read_text()
    environment = json.loads((out / "result.json").read_text())["audits"]["environment"]
    assert environment["passed"] and environment["facts"]["train.forwards_in_step_0"] == "1", environment["message"]


def test_a_rank_that_looks_at_a_batch_before_training_passes_across_epochs_of_persistent_workers(tiny_llama, tmp_path):
    # One rank computes a sanity loss on its loader's first batch, in eval mode and with autograd on. It was failed
    # (exit 1) three ways: its peek read as an epoch repeating the order (a missing set_epoch), the peek's forward
    # gave the environment audit its eval mode and an extra forward, and (without workers) its iterator's seed draw
    # moved the torch RNG. The loader keeps its worker between epochs (persistent_workers), so one iterator object serves every epoch:
    # every epoch was recorded as epoch 0, and 5 steps over 2 batches per epoch failed as overlapping shards.
    out = tmp_path / "run"
    done = run_cli(*probe_args("ddp_tutorial", out, tiny_llama, tmp_path / "loss.jsonl", steps=5,
                               script_args=("--look-first-rank", "2", "--workers", "1", "--rows", "32", "--set-seed")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "sanity loss before training" in (out / "logs" / "rank-2.log").read_text()
    audits = json.loads((out / "result.json").read_text())["audits"]
    assert audits["data_shards"]["measured"] and "over 3 epochs, 100% coverage" in audits["data_shards"]["message"]
    # Without workers the peek's iterator draws a seed from torch's generator that the others do not: reported by the
    # seeds audit, not judged (test_audits.py); a persistent iterator draws it once, whoever made it first.
    assert audits["environment"]["passed"] and audits["seeds"]["passed"], audits["seeds"]["message"]
    # The rank also picked an example to log with random.choice under transformers.set_seed: python's state drew
    # apart under a seed every rank shares (it failed the seeds audit while python's seed could not be read back).
    assert "python 0-1,3|2" in audits["seeds"]["message"], audits["seeds"]["message"]

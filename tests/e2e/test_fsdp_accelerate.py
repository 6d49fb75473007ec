"""FSDP2 through accelerate, ``transformers.Trainer`` and TRL: their own sharding, accumulation and clipping, probed
unmodified.

accelerate keeps an FSDP plugin only for accelerator device types; on a CPU it drops it and trains DDP. The clients'
``--fsdp2`` (the test shim ``tests/clients/cpu_fsdp.py``) sets the two fields accelerate sets on a GPU host, so what
runs is accelerate's and the Trainer's own FSDP2 code over gloo: ``prepare``'s ``fully_shard`` per decoder layer,
gradient accumulation with a reduce-scatter every micro-batch (FSDP2 modules have no ``no_sync``), and
``clip_grad_norm_`` on DTensors. The same clients without ``--fsdp2`` train the same loop under DDP, rank by rank and
step by step.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.e2e.conftest import failed_ranks, read_rows, run_cli
from tests.e2e.test_script_mode import DATA, probe_args, tiny_llama  # noqa: F401 (tiny_llama is a fixture)

STEPS = 3
pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")
#: The Trainer clips at its default max_grad_norm=1; the accelerate loop clips when asked.
CLIP = {"hf_trainer": (), "accelerate_loop": ("--clip", "1")}
#: Each client in one mode. Both reduce-scatter every micro-batch under FSDP2: the accelerate loop's sketch mode adds
#: the micro-batches' sketches; the Trainer's exact mode keeps every micro-batch's slices (without that setting it is
#: refused: test_exact_mode_on_a_reduce_scatter_per_micro_batch_is_refused_with_the_setting_that_measures_it).
MODE = {"hf_trainer": ("--set", "metrics.direction=exact"), "accelerate_loop": ()}
KEEP = ("--set", "metrics.exact_keep_microbatches=true")


@pytest.fixture(scope="module", params=sorted(CLIP))
def pair(request, tiny_llama, tmp_path_factory):  # noqa: F811
    client, tmp = request.param, tmp_path_factory.mktemp(request.param)
    runs = {}
    for name, flags in (("ddp", ()), ("fsdp2", ("--fsdp2",))):
        out, log = tmp / name, tmp / f"{name}-loss.jsonl"
        extra = (*MODE[client], *(KEEP if flags and MODE[client] else ()))
        done = run_cli(*probe_args(client, out, tiny_llama, log, steps=STEPS, extra=extra, script_args=(*flags, *CLIP[client])))
        runs[name] = (out, log, done)
    return client, runs


def _by_step_rank(out) -> dict[tuple[int, int], dict]:
    return {(row["step"], row["rank"]): row for row in read_rows(out / "steps.jsonl")}


def test_the_fsdp2_run_passes_its_audits_and_measures_what_the_same_loop_under_ddp_does(pair):
    client, runs = pair
    for name, (out, _, done) in runs.items():
        assert done.returncode == 0, f"{client} {name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        result = json.loads((out / "result.json").read_text())
        assert result["status"] == "complete" and result["steps_completed"] == STEPS and result["loss_note"] is None
        assert all(entry["passed"] for entry in result["audits"].values()), {k: v["message"] for k, v in result["audits"].items()}
    out, log, _ = runs["fsdp2"]
    result = json.loads((out / "result.json").read_text())
    assert {rank["gradient_source"] for rank in result["environment"]["ranks"]} == {"reduce_scatter"}
    audits = result["audits"]
    assert audits["sharded_state"]["measured"] and not audits["param_equality"]["measured"]
    facts = audits["environment"]["facts"]
    assert facts["clip"] == "clip_grad_norm_ max_norm=1 norm_type=2" and facts["fsdp.reshard_after_forward"], facts
    # The same micro-batches, so the same losses. In sketch mode FSDP2's reduce-scatter per micro-batch leaves the
    # norms and cosines to the sketches (the sum of the micro-batches' sketches), within their bound of the DDP run's;
    # in exact mode (test_script_mode.py checks the DDP run's against a float64 reference) they are the DDP run's.
    fsdp, ddp = _by_step_rank(out), _by_step_rank(runs["ddp"][0])
    assert set(fsdp) == set(ddp) == {(s, r) for s in range(STEPS) for r in range(4)}
    bound = 1e-6 if MODE[client] else 4 * math.sqrt(2 / 4096)
    for key, row in fsdp.items():
        assert row["loss"] == pytest.approx(ddp[key]["loss"], rel=1e-6), key
        assert row["grad_norm"] == pytest.approx(ddp[key]["grad_norm"], rel=bound), key
        assert row["cosine_to_mean"] == pytest.approx(ddp[key]["cosine_to_mean"], abs=2 * bound), key
    if MODE[client]:
        pairwise = {run: {row["step"]: row["pairwise_cosine"] for row in read_rows(folder / "aggregates.jsonl")}
                    for run, folder in (("fsdp2", out), ("ddp", runs["ddp"][0]))}
        for step in range(STEPS):
            cells = zip(sum(pairwise["fsdp2"][step], []), sum(pairwise["ddp"][step], []), strict=True)
            assert max(abs(a - b) for a, b in cells) <= 1e-6, step
    # And the framework logs the same training loss under both.
    logged = [row["loss"] for row in read_rows(log)]
    assert logged and logged == pytest.approx([row["loss"] for row in read_rows(runs["ddp"][1])], rel=1e-5)


def _stopped(client: str, tmp_path, tiny_llama, *script_args: str) -> dict:  # noqa: F811
    out = tmp_path / "run"
    done = run_cli(*probe_args(client, out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS,
                               extra=("--set", "distributed.timeout_s=60"), script_args=("--fsdp2", *script_args)))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["steps_completed"] == 0 and result["failure"] is None
    assert failed_ranks(out) == {"audit.environment": result["stopped_early"]["ranks"]}
    return result["stopped_early"]


def test_exact_mode_on_a_reduce_scatter_per_micro_batch_is_refused_with_the_setting_that_measures_it(tiny_llama, tmp_path):  # noqa: F811
    # The Trainer's FSDP2 accumulation reduce-scatters each micro-batch; exact mode's Gram needs the cross terms
    # between them. The message named only a monitor argument, which a script-mode user cannot pass.
    out = tmp_path / "run"
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS,
                               extra=MODE["hf_trainer"], script_args=("--fsdp2",)))
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-2000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("healthcheck: error: exact mode (metrics.direction=exact) and an FSDP2 model that "
                            "reduce-scatters every micro-batch"), error
    assert "--set metrics.exact_keep_microbatches=true" in error, error
    assert json.loads((out / "result.json").read_text())["status"] == "incomplete"


def test_a_trainer_rank_that_shards_in_bf16_is_named_before_the_first_all_gather(tiny_llama, tmp_path):  # noqa: F811
    # TrainingArguments(bf16=True) on one rank: accelerate's FSDP2 plugin takes it as MixedPrecisionPolicy(param_dtype=
    # bfloat16), so that rank all-gathers half the bytes of the others.
    stopped = _stopped("hf_trainer", tmp_path, tiny_llama, "--bf16-rank", "1")
    assert stopped["step"] == 0 and stopped["check"] == "environment" and stopped["ranks"] == [1], stopped
    assert "fsdp.param_dtype differs: ranks 0, 2-3 None; rank 1 torch.bfloat16" in stopped["message"], stopped


def test_a_trainer_rank_with_its_own_accumulation_is_named_at_the_clip_instead_of_hanging(tiny_llama, tmp_path):  # noqa: F811
    # gradient_accumulation_steps 4 on rank 2, 2 elsewhere. The others clip after their 2nd reduce-scatter (the norm of
    # sharded gradients is an all-reduce) while rank 2 runs its 3rd forward: the probe ended in exit 3 after
    # distributed.timeout_s (300 s by default), the stacks saying only where each rank waited.
    stopped = _stopped("hf_trainer", tmp_path, tiny_llama, "--accum-rank", "2")
    assert stopped == {"step": 0, "check": "environment", "unavoidable": True, "ranks": [2],
                       "message": "train.before_first_update differs: ranks 0-1, 3 gradient clipping after 2 forwards; "
                                  "rank 2 forward 3 (gradient sync on)"}, stopped


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_an_accelerate_rank_with_its_own_accumulation_is_named_where_the_loops_collectives_part(layout, tiny_llama, tmp_path):  # noqa: F811
    # gradient_accumulation_steps 4 on rank 2, 2 elsewhere, in a loop that gathers each micro-batch's loss to log it.
    # DDP: the others' 2nd backward all-reduced while rank 2's (no_sync) did not, and its gather met their all-reduce:
    # hung until distributed.timeout_s (exit 3, 300 s by default). FSDP2: the others' first update met rank 2's gather
    # and gloo aborted on the sizes (exit 3, no rank named).
    out = tmp_path / "run"
    flags = ("--accum-rank", "2", *(("--fsdp2",) if layout == "fsdp2" else ()))
    done = run_cli(*probe_args("accelerate_loop", out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS,
                               extra=("--set", "distributed.timeout_s=60"), script_args=flags))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    stopped = json.loads((out / "result.json").read_text())["stopped_early"]
    assert failed_ranks(out) == {"audit.environment": [2]}, stopped
    where = ("forward 2 (gradient sync on); rank 2 forward 2 (gradient sync off)" if layout == "ddp" else
             "optimizer step after 2 forwards; rank 2 the script's torch.distributed.all_gather after 2 forwards")
    assert stopped["message"] == f"train.before_first_update differs: ranks 0-1, 3 {where}", stopped


def test_trl_on_fsdp2_names_a_rank_that_scales_its_loss(tiny_llama, tmp_path):  # noqa: F811
    # TRL's SFTTrainer on the same FSDP2 path; rank 0's compute_loss multiplies TRL's loss by 1.5 (a per-node branch).
    # SFTConfig's bf16 default is autocast under DDP and accelerate's MixedPrecisionPolicy under FSDP2.
    out = tmp_path / "run"
    done = run_cli(*probe_args("trl_sft", out, tiny_llama, tmp_path / "loss.jsonl", steps=6,
                               script_args=("--fsdp2", "--loss-scale-rank", "0")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_early"]["check"] == "loss_weight" and failed_ranks(out) == {"audit.loss_weight": [0]}, result["stopped_early"]
    assert "rank 0's loss enters its backward with 1.5x the weight per token of ranks 1-3's" in result["stopped_early"]["message"]
    assert "param_dtype=torch.bfloat16" in result["audits"]["environment"]["facts"]["fsdp.mp_policy"]
    # No autocast and fp32 parameters: the precision is read off the policy (it said "fp32" before).
    assert [rank["precision"] for rank in result["environment"]["ranks"]] == ["bfloat16 (FSDP2 param_dtype)"] * 4


def test_a_trainer_rank_with_neftune_on_fsdp2_is_named_by_its_argument_and_by_the_replay(tiny_llama, tmp_path):  # noqa: F811
    # neftune_noise_alpha on rank 2 alone adds noise to its input embeddings through a forward hook. Nothing replicated
    # differed under FSDP2 and the replay was not measured there: the probe passed. Every rank now replays one
    # micro-batch through the sharded model, and rank 2's hook makes its gradient differ; the Trainer's argument is
    # named at step 0 too (trainer_args.py), and the replay sends the reader to it, not to the device.
    out = tmp_path / "run"
    done = run_cli(*probe_args("hf_trainer", out, tiny_llama, tmp_path / "loss.jsonl", steps=STEPS, extra=("--no-fail-fast",),
                               script_args=("--fsdp2", "--neftune-rank", "2")))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.environment": [2], "audit.replay": [2]}
    audits = json.loads((out / "result.json").read_text())["audits"]
    assert "trainer.neftune_noise_alpha differs: ranks 0-1, 3 None; rank 2 5.0" in audits["environment"]["message"]
    message = audits["replay"]["message"]
    assert "rank 2 computed a different gradient at step 0" in message and "other settings (audit.environment)" in message, message
    assert "drain the node" not in message, message

"""A --script probe whose script fails, or cannot be probed: one line, the right exit code, no worker left."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.conftest import REPO, failed_ranks, run_cli

TINY = REPO / "tests" / "clients" / "tiny_ddp.py"


def probe(tmp_path, mode: str, *extra: str, script_args: tuple[str, ...] = ()):
    out = tmp_path / "run"
    done = run_cli("probe", "--script", str(TINY), "--out", str(out), "--audits-only", "--no-plots", "--set", "distributed.nproc=2",
                   "--set", "train.steps=5", "--set", "metrics.warmup_steps=1", *extra, "--", "--mode", mode, *script_args)
    return done, out


def no_workers_left() -> bool:
    return subprocess.run(["pgrep", "-f", str(TINY)], capture_output=True).returncode != 0


def error_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("healthcheck: error:")]
    assert len(lines) == 1, done.stderr[-2000:]
    return lines[0]


def test_a_script_with_a_custom_loss_passes_with_the_loss_not_measured(tmp_path):
    done, out = probe(tmp_path, "ok")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert "no loss was observed" in result["loss_note"] and "record_loss" in result["loss_note"]
    assert result["summary"]["loss_std"]["n"] == 0 and result["summary"]["grad_norm_cv"]["n"] > 0
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert all(r["loss"] is None and r["grad_norm"] > 0 for r in rows)
    assert result["audits"]["nonfinite"]["passed"]  # an unmeasured loss is not a NaN loss
    shards = result["audits"]["data_shards"]  # no DataLoader: judged on each step's forward inputs (random per rank)
    assert shards["passed"] and shards["by"] == "forward inputs", shards
    assert shards["message"].startswith("ranks 0-1 trained on different batches"), shards["message"]
    assert "n/a" in done.stdout and "loss not measured" in done.stdout


def test_a_compiled_ddp_model_is_measured(tmp_path):
    # torch.compile(DDP(model)): the monitor is made at the DDP module's first forward, from a pre-hook that the
    # compiled module's call runs; its gradients go through the monitor every step.
    done, out = probe(tmp_path, "compiled")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == list(range(5)) and all(r["grad_norm"] > 0 for r in rows), rows
    result = json.loads((out / "result.json").read_text())
    assert [rank["gradient_source"] for rank in result["environment"]["ranks"]] == ["comm_hook"] * 2


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("raise-at=3", "rank 1 failed at step 3: ValueError: bad batch at step 3"),
        # PyTorch's uneven-inputs recipe, rank 1 with 2 batches fewer: it waited in Join, shadowing DDP's all-reduces
        # but not the probe's collectives, and the others waited for it until distributed.timeout_s (300 s).
        ("join=1", "rank 1 failed at step 4: ScriptEnded: the script's loop ran out of inputs after 4 of the probe's 5 "
                   "optimizer steps and entered torch's Join (uneven inputs)"),
        # Rank 1 fails before it joins the process group: rank 0, waiting in the rendezvous inside C++, never ran the
        # Python handler of the elastic agent's SIGTERM, and the probe took 32 s to exit (measure/distributed.py).
        ("raise-before-init=1", "rank 1 failed in the script, before its first optimizer step: RuntimeError: this node's config is broken"),
        ("return-after=2", "the script returned after 2 of the probe's 5 optimizer steps"),
        ("never-step", "the script returned without stepping an optimizer"),
    ],
)
def test_a_script_that_fails_or_stops_early_is_exit_3_naming_it(tmp_path, mode, expected):
    # 6 script steps: join=1's rank 1 has 4; the others' 6 would be enough.
    done, out = probe(tmp_path, mode, "--set", "distributed.timeout_s=60", script_args=("--steps", "6"))
    assert done.returncode == 3, done.stderr[-2000:]
    assert expected in error_line(done)
    assert json.loads((out / "result.json").read_text())["status"] == "incomplete"
    assert no_workers_left()


def test_a_loop_inside_join_passes_while_every_rank_has_inputs(tmp_path):
    # Join makes every training forward all-reduce a count of the ranks still training, a collective the probe
    # compares at the first forward; rank 1's 8 batches outlast the probe's 5 steps.
    done, out = probe(tmp_path, "join=1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == list(range(5)) and all(r["grad_norm"] > 0 for r in rows), rows
    assert no_workers_left()


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # Data parallel by hand (dist.all_reduce on each .grad): it was told it was "a single-process script".
        ("no-ddp", "stepped an optimizer with 2 workers but no DistributedDataParallel or FSDP2 (fully_shard) model"),
        ("late-comm-hook", "registers its own DDP communication hook after the model's first forward"),
        ("module-forward", "stepped its optimizer before a forward through its DistributedDataParallel model"),
        ("spawn", "starts its own worker processes (torch.multiprocessing.spawn)"),
        # Compiled autograd's DDP: it crashed inside healthcheck (exit 3, "'tuple' object has no attribute 'buffer'").
        ("python-reducer", "reduces its gradients with DDP's Python reducer"),
    ],
)
def test_a_script_that_cannot_be_probed_is_exit_2_on_one_line(tmp_path, mode, expected):
    done, _ = probe(tmp_path, mode)
    assert done.returncode == 2, done.stderr[-2000:]
    assert expected in error_line(done)
    assert no_workers_left()


def test_a_script_that_exits_on_its_own_error_is_exit_3_with_the_line_it_wrote(tmp_path):
    # A typo in the script's arguments: argparse prints its usage and the error, and exits with status 2. The probe's
    # line said only "the script exited with status 2"; the reason was in each rank's log.
    done = run_cli("probe", "--script", str(TINY), "--out", str(tmp_path / "run"), "--audits-only", "--no-plots",
                   "--set", "distributed.nproc=2", "--set", "train.steps=3", "--", "--mode", "ok", "--stpes", "3")
    assert done.returncode == 3, done.stderr[-2000:]
    assert ("the script exited with status 2 after 0 of 3 optimizer steps; the last line it wrote to stderr: "
            "tiny_ddp.py: error: unrecognized arguments: --stpes 3") in error_line(done)
    assert no_workers_left()


def test_a_scripts_comm_hook_is_left_to_it_when_the_monitor_reads_grad(tmp_path):
    # The script registers its hook before its first forward (as accelerate does right after wrapping): under the
    # default local_from=auto the monitor, made at that forward, reads .grad on every rank and leaves DDP's one slot
    # to the script, on the host too.
    done, out = probe(tmp_path, "comm-hook")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert [rank["gradient_source"] for rank in result["environment"]["ranks"]] == ["grads", "grads"]
    assert "gradients from .grad" in done.stdout
    reduction = result["audits"]["reduction_numerics"]
    assert reduction["passed"] and reduction["checked_steps"], reduction  # the script's allreduce_hook: DDP's own sum
    # One rank with a comm hook the others have not: named at the model's first forward, before DDP reduces anything
    # (ddp_agreement.py). allreduce_hook reduces as DDP does, but a compressing hook (PowerSGD) on one rank would send
    # other collectives, and no monitor could tell the two apart before they met.
    done, out = probe(tmp_path / "one", "comm-hook=1", "--set", "distributed.nproc=3")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_early"]["check"] == "environment" and result["steps_completed"] == 0, result["stopped_early"]
    environment = result["audits"]["environment"]
    assert environment["ranks"] == [1], environment
    assert environment["message"] == "ddp.comm_hook differs: ranks 0, 2 none; rank 1 allreduce_hook", environment
    # Settings that need the slot the script took: exit 2, one line, naming the script's hook.
    for setting, needs in (("metrics.local_from=buckets", "local_from='buckets'"), ("metrics.direction=exact", "exact mode")):
        done, _ = probe(tmp_path / setting, "comm-hook", "--set", setting)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "already has a DDP comm hook (allreduce_hook)" in error_line(done) and needs in error_line(done)
        assert no_workers_left()
    # A compressing hook on every rank: an all-reduce lossy by design, judged against fp16's rounding instead of the
    # buckets' fp32 (judge/comm_hooks.py), so a device whose sums come back wrong is still named.
    done, out = probe(tmp_path / "fp16", "fp16-hook", "--set", "metrics.reduction_check_every=1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    audits = json.loads((out / "result.json").read_text())["audits"]
    reduction = audits["reduction_numerics"]
    assert audits["environment"]["passed"] and reduction["passed"], reduction
    assert "within rounding in fp16 (the script's fp16_compress_hook)" in reduction["message"], reduction
    assert reduction["max_rel_error"] > 1e-5, reduction  # the compression was real: far above fp32's rounding
    # Gradients ~2e-5, under fp16's normal range as most of a large model's are: they round off by up to 2^-25 each
    # whatever their size (12.9x the relative bound alone), and the floor that underflow can add joins the bound.
    done, out = probe(tmp_path / "fp16-small", "fp16-hook=1e-5", "--set", "metrics.reduction_check_every=1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    reduction = json.loads((out / "result.json").read_text())["audits"]["reduction_numerics"]
    assert reduction["passed"] and reduction["max_rel_error"] > 1e-2 and reduction["underflow_share"] > 0.9, reduction
    assert "fp16 underflow" in reduction["message"], reduction
    # An fp16 model: DDP divides its fp16 buckets by N in fp16, so the same floor joins the buckets' own bound (16.5x
    # the relative bound without it).
    done, out = probe(tmp_path / "half-small", "half=1e-5", "--set", "metrics.reduction_check_every=1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    reduction = json.loads((out / "result.json").read_text())["audits"]["reduction_numerics"]
    assert reduction["passed"] and reduction["max_rel_error"] > 1e-2, reduction
    done, out = probe(tmp_path / "fp16-off", "fp16-hook-off=1", "--set", "metrics.reduction_check_every=1")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    reduction = json.loads((out / "result.json").read_text())["audits"]["reduction_numerics"]
    assert reduction["ranks"] == [1] and "rounding in fp16 (the script's fp16_compress_hook)" in reduction["message"], reduction


def test_accumulation_without_no_sync_is_said_in_the_report(tmp_path):
    # Each micro-batch's backward all-reduced: the gradient read at the last reduction carries the earlier ones'
    # average (norms up to 20% and cosines to the mean up to 0.17 off a float64 reference of the ranks' own
    # step gradients, tests/e2e/with_gradient_reference.py). A valid script: it passes, and the report says so.
    done, out = probe(tmp_path, "accum-sync=2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    note = json.loads((out / "result.json").read_text())["gradient_note"]
    assert note.startswith("the script all-reduces each of its micro-batches (2 DDP reductions"), note
    assert "note: gradients: the script all-reduces" in (out / "report.md").read_text()
    done, out = probe(tmp_path / "ok", "ok")
    assert json.loads((out / "result.json").read_text())["gradient_note"] is None
    # The micro-batches before the last through model.module: DDP reduces the last alone, the gradient read is the
    # rank's own. The note said the script all-reduced each of them, and advised no_sync, until 2026-12-08.
    done, out = probe(tmp_path / "module", "accum-module=2")
    result = json.loads((out / "result.json").read_text())
    assert done.returncode == 0 and result["gradient_note"] is None, result["gradient_note"]
    facts = result["audits"]["environment"]["facts"]
    assert (facts["ddp.reductions_in_step_0"], facts["train.forwards_in_step_0"]) == ("1", "2"), facts


def test_a_gradient_source_the_scripts_model_cannot_take_is_exit_2(tmp_path):
    # With gradient_as_bucket_view, .grad is the bucket DDP averages. Known only once the script builds its DDP.
    done, _ = probe(tmp_path, "bucket-view", "--set", "metrics.local_from=grads")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert error_line(done) == ("healthcheck: error: metrics: local_from='grads' cannot run here: with "
                                "gradient_as_bucket_view, .grad is the bucket DDP is averaging")
    assert no_workers_left()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--script", "/no/such/train.py"], "script.path: /no/such/train.py: no such file"),
        (["--script", "tests"], "script.path: tests is a directory"),
        (["--script", str(TINY), "--set", "train.lr=0.1", "--set", "data.max_length=64"],
         "script: data.max_length, train.lr configure the built-in probe"),
        (["--set", "train.steps=3", "--", "--mode", "ok"], "script: give the script's path or its module (script.path or script.module)"),
        # The script's own arguments without the -- before them: argparse's "unrecognized arguments", and where they go.
        (["--script", str(TINY), "--mode", "ok"], "unrecognized arguments: --mode ok; a script's own arguments go after --"),
    ],
)
def test_bad_script_input_is_exit_2_before_any_worker_starts(tmp_path, args, expected):
    done = run_cli("probe", "--out", str(tmp_path / "run"), *args)
    assert done.returncode == 2, done.stderr[-1000:]
    assert expected in done.stderr
    assert not (tmp_path / "run" / "steps.jsonl").exists()


@pytest.mark.parametrize(
    ("name", "source", "expected"),
    [
        # A team's launch wrapper: it was started on every worker and failed there (exit 3, a SyntaxError).
        ("launch.sh", "#!/usr/bin/env bash\ntorchrun --nproc_per_node 8 train.py \"$@\"\n",
         "launch.sh is a shell script (#!/usr/bin/env bash), not Python: give the Python script it launches"),
        ("train.py", "import torch\ndef main(:\n    pass\n", "train.py is not Python this interpreter can run: SyntaxError"),
    ],
)
def test_a_script_that_is_not_python_is_exit_2_before_any_worker_starts(tmp_path, name, source, expected):
    script = tmp_path / name
    script.write_text(source)
    done = run_cli("probe", "--script", str(script), "--out", str(tmp_path / "run"), "--set", "distributed.nproc=2")
    assert done.returncode == 2, done.stderr[-1000:]
    line = error_line(done)
    assert expected in line and (name == "launch.sh" or line.endswith("(line 2)")), line
    assert not (tmp_path / "run").exists()


def test_script_arguments_go_only_to_commands_that_run_a_script(tmp_path):
    done = run_cli("report", str(tmp_path), "--", "--mode", "ok")
    assert done.returncode == 2 and "arguments after -- are a script's; report takes none" in done.stderr


def test_a_rank_whose_loss_never_reaches_its_gradient_is_named(tmp_path):
    # Rank 2 of 3 multiplies its loss by 0 (a per-node loss weight of 0): DDP's average hides its zero gradient, and
    # the script's MSE is no loss the probe captures, so every other audit passed.
    done, out = probe(tmp_path, "zero-loss=2", "--set", "distributed.nproc=3")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert failed_ranks(out) == {"audit.zero_gradients": [2]}

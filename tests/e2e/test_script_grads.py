"""The four third-party clients of :mod:`tests.e2e.test_script_mode` on the path a GPU's sketch mode takes by default:
``metrics.local_from=grads`` (:mod:`healthcheck.measure.local_grads`: no comm hook, the local gradient read from
``.grad`` by an autograd callback before DDP's finalize). CI has no GPU, so the path runs here on gloo with the
torch sketch: ``transformers.Trainer``, TRL and ``accelerate`` (gradient accumulation under ``no_sync``) each wrap,
step and clear their model their own way, and each must still hand the callbacks this rank's whole local gradient.

Checked against the float64 per-parameter reference of :mod:`tests.e2e.with_gradient_reference`: the norms exactly,
the sketched cosines to the mean within the sketch's bound; and the reduction check (every step here) measured and
passed, its local side read before the finalize.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import read_rows
from tests.e2e.test_script_mode import (  # noqa: F401 - tiny_llama is a fixture
    CLIENT_NAMES,
    DATA,
    STEPS,
    probe_args,
    reference_metrics,
    run_with_reference,
    tiny_llama,
)

pytestmark = pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")
SKETCH_DIM = 1024  # the bound below: |Δcos| std <= sqrt(2/p) ≈ 0.044 for the prime p <= 1024


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_a_client_on_the_grad_path_measures_its_local_gradients(client, tiny_llama, tmp_path):  # noqa: F811
    out, log, dump = tmp_path / "run", tmp_path / "own-loss.jsonl", tmp_path / "reference"
    extra = ("--set", "metrics.local_from=grads", "--set", f"metrics.sketch_dim={SKETCH_DIM}",
             "--set", "metrics.reduction_check_every=1")
    done = run_with_reference(dump, probe_args(client, out, tiny_llama, log, extra=extra))
    assert done.returncode == 0, f"{client}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out / "result.json").read_text())
    assert [rank["gradient_source"] for rank in result["environment"]["ranks"]] == ["grads"] * 4
    assert result["audits"]["environment"]["passed"]  # and so every rank's script left DDP's comm hook alone
    audits = result["audits"]
    assert all(entry["passed"] for entry in audits.values()), {k: v["message"] for k, v in audits.items()}
    reduction = audits["reduction_numerics"]
    assert reduction["checked_steps"] == list(range(STEPS)), reduction
    # Four ranks' different fp32 gradients round in the sum: a local side read after DDP's finalize (every rank's copy
    # the same average) would read 0.
    assert reduction["max_rel_error"] > 0, reduction
    rows = read_rows(out / "steps.jsonl")
    for step in range(STEPS):
        norms, to_mean, _ = reference_metrics(dump, step)
        by_rank = {r["rank"]: r for r in rows if r["step"] == step}
        for rank in range(4):
            assert by_rank[rank]["grad_norm"] == pytest.approx(float(norms[rank]), rel=1e-5), (client, step, rank)
            # 5 sigma of the sketch's bound: a sketch of the wrong gradient (the average, or one micro-batch) is off
            # by far more on these ranks, whose cosines to the mean are near 0.5.
            assert abs(by_rank[rank]["cosine_to_mean"] - float(to_mean[rank])) <= 0.22, (client, step, rank)


@pytest.mark.parametrize("hook", ["fp16", "power_sgd", "power_sgd+fp16@3"])
def test_accelerates_own_comm_hook_is_left_to_it_under_the_default(hook, tiny_llama, tmp_path):  # noqa: F811
    # DistributedDataParallelKwargs(comm_hook=...): accelerate registers torch's hook right after it wraps the model.
    # The monitor, made at the first forward, sees DDP's one slot taken and reads .grad on every rank under the
    # default local_from=auto, on the host too. The reduction check judges fp16 against fp16's rounding
    # (judge/comm_hooks.py), every step here. PowerSGD all-reduces exactly until start_powerSGD_iter (1,000 by
    # default: every step of a probe), so it is judged there; power_sgd+fp16@3 (comm_wrapper=FP16, logged under the
    # wrapper's name, its state saying PowerSGD; start 3) is judged on fp16's rounding for steps 0-2 only.
    out, log, dump = tmp_path / "run", tmp_path / "own-loss.jsonl", tmp_path / "reference"
    extra = ("--set", f"metrics.sketch_dim={SKETCH_DIM}", "--set", "metrics.reduction_check_every=1")
    name, _, start = hook.partition("@")
    name, _, wrapper = name.partition("+")
    script_args = ("--comm-hook", name, "--comm-wrapper", wrapper or "no") + (("--power-sgd-start", start) if start else ())
    args = probe_args("accelerate_loop", out, tiny_llama, log, extra=extra, script_args=script_args)
    done = run_with_reference(dump, args)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads((out / "result.json").read_text())
    assert [rank["gradient_source"] for rank in result["environment"]["ranks"]] == ["grads"] * 4
    audits = result["audits"]
    assert all(entry["passed"] for entry in audits.values()), {k: v["message"] for k, v in audits.items()}
    reduction = audits["reduction_numerics"]
    assert reduction["measured"], reduction
    if hook == "fp16":
        assert reduction["checked_steps"] == list(range(STEPS)) and reduction["wire"] == "fp16", reduction
        assert reduction["max_rel_error"] > 1e-5, reduction  # compressed: far above fp32's rounding
    elif hook == "power_sgd":
        assert reduction["checked_steps"] == list(range(STEPS)) and reduction["wire"] == "unknown", reduction
        assert reduction["message"].endswith("; powerSGD_hook still all-reduced exactly (before its start iteration)")
        assert reduction["max_rel_error"] < 1e-5, reduction  # an fp32 all-reduce
    else:
        assert reduction["checked_steps"] == [0, 1, 2] and reduction["wire"] == "fp16", reduction
        assert f"not the {STEPS - 3} after its start iteration, where it approximates" in reduction["message"], reduction
    phases = [row.get("comm_hook_exact") for row in read_rows(out / "aggregates.jsonl")]
    expected = {"fp16": None, "power_sgd": 1.0, "power_sgd+fp16@3": [1.0] * 3 + [0.0] * (STEPS - 3)}[hook]
    assert phases == (expected if isinstance(expected, list) else [expected] * STEPS), phases
    rows = read_rows(out / "steps.jsonl")
    for step in range(STEPS):  # the local gradients, before the hook compresses them
        norms, to_mean, _ = reference_metrics(dump, step)
        by_rank = {r["rank"]: r for r in rows if r["step"] == step}
        for rank in range(4):
            assert by_rank[rank]["grad_norm"] == pytest.approx(float(norms[rank]), rel=1e-5), (step, rank)
            assert abs(by_rank[rank]["cosine_to_mean"] - float(to_mean[rank])) <= 0.22, (step, rank)

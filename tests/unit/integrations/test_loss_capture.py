"""The loss capture, in one process: every source of a micro-batch's loss, and every case it refuses."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

from healthcheck import record_loss
from healthcheck.integrations.loss_capture import LossCapture


class Tiny(torch.nn.Module):
    """Returns logits, or a dict shaped like a Hugging Face or TRL output when asked."""

    def __init__(self, output: str = "logits"):
        super().__init__()
        self.linear = torch.nn.Linear(4, 5)
        self.output = output

    def forward(self, x, labels=None, num_items_in_batch=None):
        logits = self.linear(x)
        if self.output == "hf" and labels is not None:
            summed = F.cross_entropy(logits[:, :-1].reshape(-1, 5), labels[:, 1:].reshape(-1), reduction="sum")
            divisor = num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum()
            return {"loss": summed / divisor, "logits": logits}
        if self.output == "fused":
            log_probs = torch.log_softmax(logits, -1)[..., 0]
            return types.SimpleNamespace(loss=None, log_probs=log_probs[:, 1:], label_mask=labels[:, 1:] != -100)
        return logits


def batch(seed: int = 0, masked: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, 4, generator=generator)
    labels = torch.randint(0, 5, (2, 6), generator=generator)
    labels[:, :masked] = -100
    return x, labels


def step(capture: LossCapture, model: Tiny, losses: list, **forward) -> None:
    for x, labels in losses:
        out = model(x, labels=labels, **forward)
        if model.output == "logits":
            F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1))


def expected(model: Tiny, batches) -> tuple[float, int]:
    summed, tokens = 0.0, 0
    with torch.no_grad():
        for x, labels in batches:
            logits = model.linear(x)
            summed += float(F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1), reduction="sum"))
            tokens += int((labels != -100).sum())
    return summed / tokens, tokens


@pytest.mark.parametrize("masked", [0, 3])
def test_a_script_side_mean_cross_entropy_gives_the_token_weighted_step_loss(masked):
    model = Tiny()
    batches = [batch(0, masked), batch(1, masked)]
    with LossCapture() as capture:
        capture.watch(model)
        step(capture, model, batches)
        got = capture.take()
    want, tokens = expected(model, batches)
    assert got.tokens == tokens and got.loss == pytest.approx(want, rel=1e-6) and got.reason is None


def test_sum_and_none_reductions_and_an_all_ignored_micro_batch():
    model = Tiny()
    x, labels = batch(2)
    empty = torch.full_like(labels, -100)
    with LossCapture() as capture:
        capture.watch(model)
        out = model(x, labels=labels)
        F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1), reduction="none")
        out = model(x, labels=empty)
        F.cross_entropy(out.reshape(-1, 5), empty.reshape(-1))  # mean over no token: NaN, counts as 0
        got = capture.take()
    want, tokens = expected(model, [(x, labels)])
    assert got.tokens == tokens and got.loss == pytest.approx(want, rel=1e-6)


def test_a_hugging_face_model_given_num_items_in_batch_is_unscaled_exactly():
    model = Tiny("hf")
    batches = [batch(3, 2), batch(4, 1)]
    with LossCapture() as capture:
        capture.watch(model)
        # The Trainer passes the global count over every rank; outputs.loss is then S / N_global.
        step(capture, model, batches, num_items_in_batch=torch.tensor(977))
        got = capture.take()
    shifted = [(x[:, :-1], labels[:, 1:]) for x, labels in batches]
    with torch.no_grad():
        summed = sum(float(F.cross_entropy(model.linear(x).reshape(-1, 5), lab.reshape(-1), reduction="sum"))
                     for x, lab in shifted)
    tokens = sum(int((lab != -100).sum()) for _, lab in shifted)
    assert got.tokens == tokens and got.loss == pytest.approx(summed / tokens, rel=1e-6)


def test_a_fused_trl_output_is_read_from_its_log_probs():
    model = Tiny("fused")
    x, labels = batch(5, 2)
    with LossCapture() as capture:
        capture.watch(model)
        out = model(x, labels=labels)
        got = capture.take()
    mask = labels[:, 1:] != -100
    assert got.tokens == int(mask.sum())
    assert got.loss == pytest.approx(float(-(out.log_probs.detach() * mask).sum()) / int(mask.sum()), rel=1e-6)


def test_the_same_loss_computed_twice_counts_once_and_two_different_ones_are_refused():
    model = Tiny()
    x, labels = batch(6)
    with LossCapture() as capture:
        capture.watch(model)
        out = model(x, labels=labels)
        F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1))
        F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1), reduction="sum")  # same S and N
        assert capture.take().loss is not None
        out = model(x, labels=labels)
        F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1))
        F.cross_entropy(out.reshape(-1, 5), labels.roll(1).reshape(-1))
        refused = capture.take()
    assert refused.loss is None and "2 different cross-entropy losses" in refused.reason


@pytest.mark.parametrize("case", ["chunked", "chunked-mean", "logged", "auxiliary"])
def test_several_cross_entropies_are_told_apart_by_the_backward(case):
    # torchtune's CEWithChunkedOutputLoss: sums over slices of the sequence, over the micro-batch's token count (the
    # last chunk all padding); a loss over every token computed for a log; a second loss at half the weight.
    model = Tiny()
    x, labels = batch(9, 2)
    labels[:, -2:] = -100
    with LossCapture() as capture:
        capture.watch(model)
        logits, flat = model(x, labels=labels), labels
        tokens = (flat != -100).sum()
        if case.startswith("chunked"):
            mean = case == "chunked-mean"
            chunks = [F.cross_entropy(logits[:, i:i + 2].reshape(-1, 5), flat[:, i:i + 2].reshape(-1),
                                      reduction="mean" if mean else "sum") for i in (0, 2, 4)]
            counts = [(flat[:, i:i + 2] != -100).sum() for i in (0, 2, 4)]
            loss = sum(torch.nan_to_num(c) * (n if mean else 1) for c, n in zip(chunks, counts)) / tokens
        else:
            loss = F.cross_entropy(logits.reshape(-1, 5), flat.reshape(-1))
            other = F.cross_entropy(logits.reshape(-1, 5), labels.clamp(min=0).reshape(-1))  # every position counted
            if case == "auxiliary":
                loss = loss + 0.5 * other
        (2 * loss).backward()
        got = capture.take()
    if case == "auxiliary":
        assert got.loss is None and "2 different cross-entropy losses" in got.reason, got
    else:
        want, count = expected(model, [(x, labels)])
        assert got.tokens == count and got.loss == pytest.approx(want, rel=1e-6), got
        assert got.weight == pytest.approx(2.0, rel=1e-6), got


def test_a_forward_whose_loss_is_never_backwarded_is_no_micro_batch():
    # A validation loss computed between two updates without no_grad: left out, once another micro-batch trained.
    model = Tiny()
    (x, labels), (vx, vlabels) = batch(11), batch(12)
    with LossCapture() as capture:
        capture.watch(model)
        F.cross_entropy(model(vx, labels=vlabels).reshape(-1, 5), vlabels.reshape(-1))  # validation: no backward
        F.cross_entropy(model(x, labels=labels).reshape(-1, 5), labels.reshape(-1)).backward()
        got = capture.take()
        F.cross_entropy(model(vx, labels=vlabels).reshape(-1, 5), vlabels.reshape(-1))  # no micro-batch trained:
        unknown = capture.take()  # what was seen is still reported, its weight unknown
    want, tokens = expected(model, [(x, labels)])
    assert got.tokens == tokens and got.loss == pytest.approx(want, rel=1e-6) and got.weight == pytest.approx(1.0), got
    assert unknown.loss is not None and math.isnan(unknown.weight), unknown


@pytest.mark.parametrize(("dtype", "unit"), [(torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-8)])
def test_the_weight_says_the_rounding_it_was_read_to(dtype, unit):
    model = Tiny().to(dtype)
    x, labels = batch(10, 1)
    with LossCapture() as capture:
        capture.watch(model)
        out = model(x.to(dtype), labels=labels)
        F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1)).backward()
        got = capture.take()
    assert got.weight_rounding == unit and got.weight == pytest.approx(1.0, abs=4 * unit), got


@pytest.mark.parametrize("kind", ["weight", "soft", "none"])
def test_losses_without_a_per_token_meaning_are_not_measured(kind):
    model = Tiny()
    x, labels = batch(7)
    with LossCapture() as capture:
        capture.watch(model)
        out = model(x, labels=labels).reshape(-1, 5)
        if kind == "weight":
            F.cross_entropy(out, labels.reshape(-1), weight=torch.ones(5))
        elif kind == "soft":
            F.cross_entropy(out, torch.softmax(torch.randn(12, 5), -1))
        else:
            F.mse_loss(out, torch.zeros_like(out))
        got = capture.take()
    assert got.loss is None
    assert {"weight": "class weights", "soft": "soft", "none": "no loss was observed"}[kind] in got.reason


@pytest.mark.parametrize("source", ["cross_entropy", "fused"])
@pytest.mark.parametrize("objective", ["per-sequence mean", "dpo"])
def test_per_token_log_probs_are_a_loss_only_if_the_backward_gives_them_one_sign(source, objective):
    # A custom DPO takes its log-probs from a per-token cross-entropy; TRL's from its fused head. Per-sequence
    # means weigh tokens unevenly but all one way, so the token-weighted NLL is still the rank's loss.
    model = Tiny("fused" if source == "fused" else "logits")
    x, labels = batch(8, 2)
    with LossCapture() as capture:
        capture.watch(model)
        out = model(x, labels=labels)
        if source == "fused":
            logps, mask = out.log_probs, out.label_mask
        else:
            logps = -F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1), reduction="none").reshape(2, 6)
            mask = labels != -100
        per_sequence = (logps * mask).sum(dim=1)
        if objective == "dpo":  # sequence 0 chosen, sequence 1 rejected, against a reference at 0
            loss = -F.logsigmoid(0.1 * (per_sequence[0] - per_sequence[1]))
        else:
            loss = -(per_sequence / mask.sum(dim=1)).mean()
        loss.backward()
        got = capture.take()
    if objective == "dpo":
        assert got.loss is None and "a preference or RL objective, such as DPO's" in got.reason, got
    else:
        assert got.loss is not None and got.tokens == int(mask.sum()) and math.isfinite(got.weight), got


def test_record_loss_wins_and_is_a_no_op_outside_a_probe():
    record_loss(123.0)  # nothing active: nothing happens
    model = Tiny()
    x, labels = batch(8)
    with LossCapture() as capture:
        capture.watch(model)
        out = model(x, labels=labels)
        F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1))
        record_loss(torch.tensor(2.0), tokens=10)
        record_loss(4.0, tokens=30)
        got = capture.take()
    assert got.tokens == 40 and got.loss == pytest.approx((2.0 * 10 + 4.0 * 30) / 40)


def test_evaluation_forwards_are_ignored_and_the_original_cross_entropy_comes_back():
    original = F.cross_entropy
    model = Tiny()
    x, labels = batch(9)
    with LossCapture() as capture:
        assert F.cross_entropy is not original
        capture.watch(model)
        with torch.no_grad():
            F.cross_entropy(model(x).reshape(-1, 5), labels.reshape(-1))
        got = capture.take()
    assert got.loss is None and "no training forward" in got.reason
    assert F.cross_entropy is original
    assert math.isfinite(float(F.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]))))



class _Call(torch.nn.Module):
    """A wrapper module around the model, as DDP is: ``torch.compile(DDP(model))`` compiles through it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


@pytest.fixture(params=["after", "before"])
def torch_functions_listed(request):
    """When dynamo lists torch's functions: it builds the table once per process, by name, at its first compile.

    "after" the patch is what a probe meets (the patch is installed before the script runs): the patched
    ``F.cross_entropy`` is then listed as torch's own, evaluated on fake tensors while tracing and never called
    by the compiled code. "before" (something compiled earlier, as a Trainer callback may meet): dynamo traces
    the patch like any Python function.
    """
    table = torch._dynamo.trace_rules.get_torch_obj_rule_map
    torch._dynamo.reset()
    table.cache_clear()
    if request.param == "before":
        table()
    yield request.param
    torch._dynamo.reset()
    table.cache_clear()  # later compiles in this process list the original again


@pytest.mark.parametrize("compiled", ["the watched module", "a wrapper around it"])
def test_a_compiled_model_that_returns_its_loss_is_measured(compiled, torch_functions_listed):
    # DDP(torch.compile(model)) watches the compiled module; torch.compile(DDP(model)) compiles around the watched one.
    model = Tiny("hf")
    batches = [batch(11, 2), batch(12, 1)]
    with LossCapture() as capture:
        if compiled == "the watched module":
            call = torch.compile(model, backend="aot_eager")
            capture.watch(call)
        else:
            capture.watch(model)
            call = torch.compile(_Call(model), backend="aot_eager")
        got = []
        for x, labels in batches:  # the first step traces, the second runs the compiled code only
            call(x, labels=labels)["loss"].backward()
            got.append(capture.take())
    for (x, labels), step_loss in zip(batches, got, strict=True):
        with torch.no_grad():
            summed = float(F.cross_entropy(model.linear(x[:, :-1]).reshape(-1, 5), labels[:, 1:].reshape(-1), reduction="sum"))
        tokens = int((labels[:, 1:] != -100).sum())
        assert step_loss.reason is None and step_loss.tokens == tokens
        assert step_loss.loss == pytest.approx(summed / tokens, rel=1e-5)


def compiled_cross_entropy(model: Tiny):
    """The cross-entropy of ``model``'s logits in a compiled function: the capture sees the forward, not the loss."""
    return torch.compile(lambda x, labels: F.cross_entropy(model(x).reshape(-1, 5), labels.reshape(-1)), backend="aot_eager")


def test_a_cross_entropy_only_inside_compiled_code_is_not_measured_and_says_why(torch_functions_listed):
    model = Tiny()
    x, labels = batch(13)
    loss_of = compiled_cross_entropy(model)
    with LossCapture() as capture:
        capture.watch(model)
        got = []
        for _ in range(2):
            loss_of(x, labels).backward()
            got.append(capture.take())
    assert all(g.loss is None and "torch.compile" in g.reason and "record_loss" in g.reason for g in got)


def test_a_compiled_evaluation_does_not_explain_a_training_step_without_a_loss(torch_functions_listed):
    model = Tiny()
    x, labels = batch(14)
    evaluate = compiled_cross_entropy(model)
    with LossCapture() as capture:
        capture.watch(model)
        with torch.no_grad():
            evaluate(x, labels)
        model(x).sum().backward()  # a training step whose loss is no cross-entropy and is not recorded
        got = capture.take()
    assert got.loss is None and "torch.compile" not in got.reason and "record_loss" in got.reason


# --------------------------------------------------------------------------- the loss's settings (environment audit)


def settings_after(**cross_entropy) -> dict[str, str]:
    model = Tiny()
    x, labels = batch(4, masked=2)
    with LossCapture() as capture:
        capture.watch(model)
        with torch.no_grad():  # an evaluation call with other settings is not the training loss
            F.cross_entropy(model(x).reshape(-1, 5), labels.reshape(-1), label_smoothing=0.5)
        logits = model(x).reshape(-1, 5)
        # Nor is a loss computed only to be logged, though autograd records it: the backward never reaches it.
        F.cross_entropy(logits, labels.reshape(-1), reduction="none", label_smoothing=0.3)
        F.cross_entropy(logits, labels.reshape(-1), **cross_entropy).backward()
        return capture.loss_settings()


def test_the_training_cross_entropys_settings_are_facts_and_a_different_one_differs():
    plain = settings_after()
    assert plain == {"loss.cross_entropy": "in the backward", "loss.reduction": "mean", "loss.ignore_index": "-100",
                     "loss.label_smoothing": "0", "loss.weight": "none", "loss.targets": "class indices",
                     "loss.dtype": "float32", "loss.target_shift": "not measured",  # float inputs: no ids
                     "loss.graph": "LogSoftmax, NllLoss"}
    changed = {key for key, value in settings_after(label_smoothing=0.1).items() if plain[key] != value}
    # Label smoothing also adds its own term to the graph (the mean of -log p over the vocabulary).
    assert changed == {"loss.label_smoothing", "loss.graph"}
    weights = [settings_after(weight=torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0]))["loss.weight"] for _ in range(2)]
    assert weights[0] == weights[1] != "none"  # a digest: equal weights agree across ranks
    assert settings_after(weight=torch.ones(5))["loss.weight"] != weights[0]


def test_the_settings_are_read_once_and_no_trained_call_is_a_fact_too():
    model = Tiny()
    x, labels = batch(5)
    with LossCapture() as capture:
        capture.watch(model)
        model(x).square().mean().backward()  # a custom loss: no cross-entropy
        first = {"loss.cross_entropy": "none in the backward", "loss.target_shift": "not measured", "loss.graph": "Mean, Pow"}
        assert capture.loss_settings() == first
        F.cross_entropy(model(x).reshape(-1, 5), labels.reshape(-1), label_smoothing=0.2).backward()
        assert capture.loss_settings() == {**first, "loss.graph": "not measured"}  # recorded until read


@pytest.mark.parametrize("num_items", [None, 17])
def test_transformers_label_smoother_is_a_loss_source(num_items):
    # TrainingArguments(label_smoothing_factor=...) pops the labels, so the model computes no loss and no
    # cross-entropy runs: the Trainer's LabelSmoother is the loss. Its objective per token is
    # (1 - eps) * nll + eps * mean over the vocabulary of -log p, divided by num_items_in_batch or the label count.
    from transformers.trainer_pt_utils import LabelSmoother

    model, smoother, eps = Tiny(), LabelSmoother(epsilon=0.1), 0.1
    original = LabelSmoother.__call__
    x, labels = batch(6, masked=2)
    with LossCapture() as capture:
        capture.watch(model)
        logits = model(x)
        smoother({"logits": logits}, labels, shift_labels=True, num_items_in_batch=num_items).backward()
        got, settings = capture.take(), capture.loss_settings()
    assert LabelSmoother.__call__ is original  # put back when the last capture closes
    log_probs = torch.log_softmax(logits.detach()[:, :-1], -1)
    targets = labels[:, 1:]
    keep = targets != -100
    nll = -log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = (1 - eps) * nll - eps * log_probs.mean(-1)
    assert got.tokens == int(keep.sum()) and got.reason is None
    assert got.loss == pytest.approx(float(per_token[keep].mean()), rel=1e-5)
    assert settings["loss.reduction"] == "LabelSmoother" and settings["loss.label_smoothing"] == "0.1"

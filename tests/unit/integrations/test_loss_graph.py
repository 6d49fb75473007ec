"""What the first step's backwards compute above the model's outputs, as different loss code writes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from healthcheck.integrations.loss_graph import LossGraph


class LM(torch.nn.Module):
    """A causal LM of one layer that, given labels, computes its own loss as a Hugging Face model does."""

    def __init__(self, vocab: int = 11, reentrant: bool | None = None):
        super().__init__()
        self.embed, self.head, self.reentrant = torch.nn.Embedding(vocab, 6), torch.nn.Linear(6, vocab), reentrant

    def forward(self, input_ids, labels=None):
        hidden = self.embed(input_ids)
        if self.reentrant is None:
            logits = self.head(hidden)
        else:
            logits = checkpoint(self.head, hidden, use_reentrant=self.reentrant)
        loss = None if labels is None else F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return {"loss": loss, "logits": logits}


def graph_of(step, model: LM | None = None) -> str:
    """``loss.graph`` after ``step(model, ids)`` ran its backwards under a watched model."""
    model = model or LM()
    graph = LossGraph().start()
    handle = model.register_forward_hook(lambda module, args, output: graph.forward_output(output))
    try:
        step(model, torch.randint(0, 11, (3, 9), generator=torch.Generator().manual_seed(0)))
        return graph.facts()["loss.graph"]
    finally:
        handle.remove()
        graph.close()


def script_loss(model, ids):
    logits = model(ids)["logits"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def test_a_models_own_loss_backwarded_as_it_is_reads_the_models_output():
    assert graph_of(lambda model, ids: model(ids, labels=ids)["loss"].backward()) == "the model's output"


def test_a_loss_the_script_computes_reads_its_operations():
    assert graph_of(lambda model, ids: script_loss(model, ids).backward()) == "LogSoftmax, NllLoss"


def test_a_term_of_its_own_changes_the_graph():
    def z_loss(model, ids):
        logits = model(ids)["logits"]
        (script_loss(model, ids) + 1e-2 * torch.logsumexp(logits, -1).pow(2).mean()).backward()

    def l2_penalty(model, ids):
        (model(ids, labels=ids)["loss"] + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())).backward()

    assert {"Logsumexp", "Pow"} <= set(graph_of(z_loss).split(", "))
    assert set(graph_of(l2_penalty).split(", ")) == {"AccumulateGrad", "Add", "Mul", "Pow", "Sum"}


@pytest.mark.parametrize("documents", [1, 3])
def test_a_loss_looping_over_the_data_reads_the_same_for_any_count(documents):
    # A packed batch's per-document loss, looped in Python: as many operations as documents, one set of kinds.
    def per_document(model, ids):
        logits = model(ids)["logits"]
        parts = [F.cross_entropy(logits[i, :-1], ids[i, 1:]) for i in range(documents)]
        torch.stack(parts).mean().backward()

    assert graph_of(per_document) == "LogSoftmax, Mean, NllLoss"


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_inside_the_model_changes_nothing(reentrant):
    # Reentrant checkpointing calls torch.autograd.backward inside the backward: no root of the script's.
    step = lambda model, ids: script_loss(model, ids).backward()  # noqa: E731
    assert graph_of(step, LM(reentrant=reentrant)) == graph_of(step)


def test_a_scaled_loss_and_accumulation_read_as_the_loss_they_scale():
    # Micro-batches of two rows and of one: flatten copies the first's slice and views the second's, and neither shows.
    def accumulate(model, ids):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for half in ids.split(2):
            scaler.scale(script_loss(model, half) / 2).backward()

    assert graph_of(accumulate) == "Div, LogSoftmax, Mul, NllLoss"


def test_a_backward_that_reaches_no_output_is_left_out_and_backward_is_put_back():
    original = torch.autograd.backward

    def sanity_then_train(model, ids):
        other = torch.nn.Linear(2, 1)
        other(torch.ones(1, 2)).sum().backward()  # another model's sanity loss: no output of the watched one
        assert torch.autograd.backward is not original
        script_loss(model, ids).backward()

    assert graph_of(sanity_then_train) == "LogSoftmax, NllLoss"
    assert torch.autograd.backward is original
    assert graph_of(lambda model, ids: torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum().backward()) == "not measured"

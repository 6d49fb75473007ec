"""Which shift of the inputs a loss's targets are, as each way of writing a causal-LM loss hands them over."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from healthcheck.integrations.loss_capture import LossCapture
from healthcheck.integrations.target_shift import NOT_INPUTS, TargetShifts, target_shift


def _batch(seed: int = 0, rows: int = 3, width: int = 40, vocab: int = 50_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their labels: each row's prompt (a random length) and its padding masked."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, width), generator=generator)
    labels = ids.clone()
    for row in range(rows):
        prompt = int(torch.randint(2, 10, (), generator=generator))
        pad = int(torch.randint(0, 8, (), generator=generator))
        labels[row, :prompt] = -100
        if pad:
            ids[row, -pad:], labels[row, -pad:] = 0, -100
    return ids, labels


@pytest.mark.parametrize("seed", range(5))
def test_each_way_of_writing_the_causal_shift_reads_one(seed):
    ids, labels = _batch(seed)
    # A script's own shift of logits and labels (the DDP tutorial's).
    assert target_shift(ids, labels[:, 1:].reshape(-1)) == 1
    # transformers' ForCausalLMLoss: the labels padded by one ignored position, then shifted, logits whole.
    assert target_shift(ids, F.pad(labels, (0, 1), value=-100)[:, 1:].reshape(-1)) == 1
    # nanoGPT: y is the token stream one on from x, its last target past x's end.
    assert target_shift(ids[:, :-1], ids[:, 1:]) == 1


@pytest.mark.parametrize("shift", [-2, -1, 0, 2, 3])
def test_another_shift_is_read_as_itself(shift):
    ids, labels = _batch(7, width=60)
    target = torch.full_like(labels, -100)
    if shift >= 0:
        target[:, : labels.size(1) - shift] = labels[:, shift:]
    else:
        target[:, -shift:] = labels[:, :shift]
    assert target_shift(ids, target) == shift


def test_a_chunk_of_the_sequence_is_not_read():
    # torchtune's CEWithChunkedOutputLoss: the shifted sequence in slices. A chunk's offset in the sequence is unknown
    # (its own shift would count from its first column, and a rank's first counted target decides which chunk that
    # is), so no chunk is read, and a chunked loss is "not measured" on every rank alike.
    ids, labels = _batch(3, width=65)
    chunks = labels[:, 1:].chunk(4, dim=1)
    assert [target_shift(ids, chunk) for chunk in chunks] == [None] * 4
    shifts = TargetShifts()
    result = torch.randn(3, requires_grad=True).sum()
    for chunk in chunks:
        shifts.observe(ids, chunk, -100, result)
    result.backward()
    assert shifts.facts() == {"loss.target_shift": "not measured"}


def test_a_loss_that_also_predicts_the_token_after_next_reads_both():
    ids, labels = _batch(6)
    logits = torch.randn(*ids.shape, 8, requires_grad=True)
    shifts = TargetShifts()
    next_token, after_next = logits.sum() * 1.0, logits.sum() * 2.0
    shifts.observe(ids, labels[:, 1:], -100, next_token)
    shifts.observe(ids, labels[:, 2:], -100, after_next)
    (next_token + after_next).backward()
    assert shifts.facts() == {"loss.target_shift": "the inputs shifted by 1 and 2"}


def test_inputs_changed_after_the_labels_are_no_shift():
    ids, labels = _batch(1)
    noisy = ids.clone()
    noisy[1, 20] = 1  # one token masked after the labels were made
    assert target_shift(noisy, labels[:, 1:]) == NOT_INPUTS


def test_what_is_no_token_sequence_cannot_tell():
    ids, labels = _batch(2)
    assert target_shift(ids, torch.tensor([4, 0, 1])) is None  # a class per row
    assert target_shift(ids, labels[:, 1:].float()) is None  # soft targets
    assert target_shift(ids.float(), labels[:, 1:]) is None  # no token ids
    few = torch.full_like(labels, -100)
    few[0, 10:15] = labels[0, 10:15]  # 5 counted targets: too few to tell a shift from chance
    assert target_shift(ids, few) is None
    assert TargetShifts().facts() == {"loss.target_shift": "not measured"}


def test_only_a_loss_the_backward_reaches_counts():
    ids, labels = _batch(4)
    logits = torch.randn(*ids.shape, 8, requires_grad=True)
    shifts = TargetShifts()
    trained, logged = logits.sum() * 1.0, logits.sum() * 2.0
    shifts.observe(ids, labels[:, 1:], -100, trained)
    shifts.observe(ids, labels, -100, logged)  # a per-token loss for a log, on other targets, never backwarded
    trained.backward()
    assert shifts.facts() == {"loss.target_shift": "the inputs shifted by 1"}


class _CausalLM(torch.nn.Module):
    """A model that computes its loss from ``labels`` as a Hugging Face model does, shifting them ``shift`` times."""

    def __init__(self, vocab: int = 50_000, shift: int = 1):
        super().__init__()
        self.embed, self.shift = torch.nn.Embedding(vocab, 4), shift
        self.head = torch.nn.Linear(4, vocab)

    def forward(self, input_ids, labels):
        logits = self.head(self.embed(input_ids))
        target = F.pad(labels, (0, self.shift), value=-100)[:, self.shift:]
        return {"loss": F.cross_entropy(logits.flatten(0, 1), target.reshape(-1), ignore_index=-100), "logits": logits}


@pytest.mark.parametrize(("shift", "fact"), [(1, "the inputs shifted by 1"), (2, "the inputs shifted by 2")])
def test_the_capture_reads_the_shift_of_the_first_steps_trained_loss(shift, fact):
    ids, labels = _batch(5)
    model = _CausalLM(shift=shift)
    with LossCapture() as capture:
        capture.watch(model)
        model(input_ids=ids, labels=labels)["loss"].backward()
        facts = capture.loss_settings()
    assert facts["loss.target_shift"] == fact

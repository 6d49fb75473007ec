"""The training step's loss-side faults, on one process: the bitflip scales the loss and its gradient exactly."""

from __future__ import annotations

import contextlib

import pytest
import torch

from healthcheck.config import DataConfig, ModelConfig
from healthcheck.run.data import collate, prepare_samples
from healthcheck.run.faults import flip_float32_bit
from healthcheck.run.modeling import build_model, load_tokenizer
from healthcheck.run.trainer import backward_over_micro_batches


def one_step(flip_bit, micro_batches=1):
    """Loss and gradient of one step of the tiny GPT-2 (seeded, so dropout repeats from run to run)."""
    torch.manual_seed(0)
    config = ModelConfig()
    tokenizer = load_tokenizer(config)
    data = DataConfig(synthetic_samples=16)
    samples = prepare_samples(data, tokenizer)
    model = build_model(config, len(tokenizer), data.max_length)
    model.no_sync = contextlib.nullcontext  # what DDP's no_sync is to a single process
    micro = [collate(samples[2 * i : 2 * i + 2], tokenizer.pad_token_id) for i in range(micro_batches)]
    loss, tokens = backward_over_micro_batches(model, micro, torch.device("cpu"), precision="fp32", flip_bit=flip_bit)
    return float(loss), tokens, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_bit_28_multiplies_the_loss_and_every_gradient_element_by_exactly_2_to_the_32():
    loss, tokens, grad = one_step(None)
    flipped_loss, flipped_tokens, flipped_grad = one_step(28)
    assert flipped_tokens == tokens and 2 <= loss * tokens < 2**33  # the summed loss, where bit 28 is clear
    assert flipped_loss == loss * 2**32 and torch.equal(flipped_grad, grad * 2**32)
    assert float(flipped_grad.pow(2).sum()) < torch.finfo(torch.float32).max  # finite in the monitor's fp32 squares


def test_only_the_first_micro_batch_is_flipped():
    loss, _, _ = one_step(None, micro_batches=2)
    flipped_loss, _, _ = one_step(28, micro_batches=2)
    # Flipping both would give exactly 2^32; the first alone gives 2^32 times its share of the summed loss.
    assert 0.05 < flipped_loss / (loss * 2**32) < 0.95


@pytest.mark.parametrize(("value", "bit", "expected"), [(3.0, 28, 3.0 * 2**32), (3.0, 29, 3.0 * 2**64), (1.5, 28, 1.5 / 2**32)])
def test_an_exponent_flip_is_an_exact_power_of_two(value, bit, expected):
    assert flip_float32_bit(value, bit) == expected
    assert flip_float32_bit(-value, 31) == value  # the sign bit

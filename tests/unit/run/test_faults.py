"""The bad-device fault: matmul outputs scaled from a given step, in every forward (replays included)."""

from __future__ import annotations

import torch
from transformers.pytorch_utils import Conv1D

from healthcheck.config import FaultConfig
from healthcheck.run.faults import install_faults


def test_matmul_error_scales_linear_and_conv1d_outputs_from_its_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), Conv1D(3, 6))
    x = torch.randn(2, 4)
    reference = [model[0](x)]
    reference.append(model[2](model[1](reference[0])))
    marker: dict = {"step": None}
    install_faults(model, FaultConfig(matmul_error=1e-3, matmul_error_from_step=10), marker)
    assert torch.equal(model(x), reference[1])  # before the loop: no step yet
    marker["step"] = 9
    assert torch.equal(model(x), reference[1])
    marker["step"] = 10
    first = model[0](x)
    torch.testing.assert_close(first, reference[0] * 1.001, rtol=0, atol=0)
    out = model(x)
    assert not torch.equal(out, reference[1])
    torch.testing.assert_close(out, model[2](model[1](first)), rtol=0, atol=0)


def test_no_fault_registers_no_hook():
    model = torch.nn.Linear(2, 2)
    install_faults(model, FaultConfig(), {"step": 0})
    assert not model._forward_hooks

"""Deliberate faults for the fault-injection suite, applied to one rank through ``rank_overrides``.

They act on the training step itself (the gradient a rank hands to the all-reduce, its timing, its
loss), never on the metrics code, so the guard is tested on the same signals a real fault produces.
The loss-side faults (``nan_at_step``, ``bitflip_at_step``, ``train.loss_scale``) live in the trainer's
step; :func:`flip_float32_bit` is the bit flip they apply.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from typing import Optional

from healthcheck.config import FaultConfig


def install_faults(model, faults: FaultConfig, step_marker: Optional[dict[str, Optional[int]]] = None) -> None:
    """Register the gradient-side and device faults on ``model`` (a no-op when all are off).

    ``step_marker``: ``{"step": s}``, the step in progress (the training loop's), for faults that start
    at a step.
    """
    if faults.grad_noise_std > 0:
        std = faults.grad_noise_std
        for param in model.parameters():
            if param.requires_grad:
                param.register_hook(_noise_hook(std))
    if faults.matmul_error > 0:
        install_matmul_error(model, faults.matmul_error, faults.matmul_error_from_step, step_marker or {"step": 0})


def install_matmul_error(model, relative: float, from_step: int, step_marker: dict[str, Optional[int]]) -> int:
    """A bad device: every Linear (and transformers' Conv1D) output scaled by ``1 + relative`` from ``from_step``.

    Forward hooks on the modules themselves, so the error is in everything this rank computes, the
    replay audit's replays included (it is a property of the device, not of the training step), and in
    the local gradient it hands to the all-reduce. Returns the number of hooked modules.
    """
    import torch
    from transformers.pytorch_utils import Conv1D

    factor = 1.0 + relative

    def scale(module, inputs, output):
        step = step_marker.get("step")
        if step is None or step < from_step:
            return None
        return output * factor

    hooked = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]
    for module in hooked:
        module.register_forward_hook(scale)
    return len(hooked)


def at_step_start(faults: FaultConfig, step: int) -> None:
    """Process-level faults for the reliability tests: crash (exception or SIGKILL) or hang."""
    if faults.crash_at_step == step:
        if faults.crash_mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"injected crash at step {step}")
    if faults.hang_at_step == step:
        while True:  # a hung worker: only the watchdog or a timeout ends this
            time.sleep(3600)


def before_process_group(faults: FaultConfig, launch_attempt: int) -> None:
    """Faults that strike while a worker starts, before it has joined the process group."""
    if launch_attempt <= faults.startup_hang_launches:
        while True:  # what a worker deadlocked in start-up looks like to the launcher
            time.sleep(3600)


def flip_float32_bit(value: float, bit: int) -> float:
    """``value`` as an IEEE fp32 with one bit flipped (bit 31 is the sign, 30-23 the exponent, 22-0 the mantissa).

    The ``bitflip`` fault flips an exponent bit of the summed loss a rank backpropagates, so the step's loss
    and every element of its local gradient are scaled by the same power of two. Why the loss and not one
    gradient element: a gradient element of magnitude below 1 (every one in the probe's model) has exponent
    bits 29-23 that can only take it below 2 when flipped, which moves a gradient norm of ~2 by less than the
    ranks differ, while bit 30 multiplies it by 2^128, and its square overflows fp32: the non-finite audit's
    case. A summed loss in [2, 2^33) has bits 29-23 clear, and bit 28 multiplies it by exactly 2^32; the local
    gradient norm becomes ~1e10, whose square (~1e20) stays finite in the monitor's fp32 arithmetic::

        >>> flip_float32_bit(3.0, 28) == 3.0 * 2**32, flip_float32_bit(6e-3, 28) < 6e-3, flip_float32_bit(6e-3, 30) > 1e35
        (True, True, True)
        >>> flip_float32_bit(flip_float32_bit(3.0, 28), 28)
        3.0
    """
    (word,) = struct.unpack("<I", struct.pack("<f", value))
    return struct.unpack("<f", struct.pack("<I", word ^ (1 << bit)))[0]


class InjectedFault(RuntimeError):
    """Raised by ``faults.crash_at_step``."""


def _noise_hook(relative_std: float):
    # Parameter hooks run before DDP copies the gradient into its bucket, i.e. on the local
    # gradient before the all-reduce: what silent data corruption on one device looks like.
    def add_noise(grad):
        import torch

        rms = grad.float().pow(2).mean().sqrt()
        return grad + (relative_std * rms * torch.randn_like(grad, dtype=torch.float32)).to(grad.dtype)

    return add_noise

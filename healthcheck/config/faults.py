"""The fault-injection section: deliberate faults for the fault suite and the reliability tests, all off."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from healthcheck.config.section import Section


class FaultConfig(Section):
    """Deliberate faults for the fault-injection suite; all off by default. Usually set per rank."""

    grad_noise_std: float = Field(
        0.0, ge=0, description="Add Gaussian noise (std relative to each gradient's RMS) to the local gradient before the all-reduce."
    )
    step_sleep_ms: float = Field(0.0, ge=0, le=60_000, description="Sleep this long in every step's compute.")
    nan_at_step: Optional[int] = Field(None, ge=0, description="Make the local loss NaN at this step.")
    bitflip_at_step: Optional[int] = Field(None, ge=0, description="At this step, flip bitflip_bit of the loss this rank backpropagates.")
    bitflip_bit: int = Field(28, ge=23, le=30, description="fp32 exponent bit bitflip_at_step flips (28: x2^32 for a loss in [2, 2^33)).")
    crash_at_step: Optional[int] = Field(None, ge=0, description="Crash this rank at the start of this step (reliability tests).")
    crash_mode: Literal["exception", "sigkill"] = Field(
        "exception", description="How crash_at_step crashes: raise an exception, or SIGKILL the worker itself."
    )
    hang_at_step: Optional[int] = Field(None, ge=0, description="Sleep forever at the start of this step (a hung worker).")
    matmul_error: float = Field(
        0.0, ge=0, le=1, description="A bad device: scale every Linear/Conv1D output by 1 + this (relative error), replays included."
    )
    matmul_error_from_step: int = Field(0, ge=0, description="The step from which matmul_error applies.")
    startup_hang_launches: int = Field(
        0,
        ge=0,
        le=100,
        description="Sleep forever before joining the process group in the first N launches of the probe "
        "(tests the distributed.startup_timeout_s relaunch).",
    )

"""Synthetic RunResults for baseline/verdict/fuzz tests: clean runs drawn around typical values."""

from __future__ import annotations

import math
import random

from healthcheck.artifacts import Environment, MetricSummary, RankSummary, RunResult, Timing
from healthcheck.config import ProbeConfig
from healthcheck.judge.baseline import Baseline, fit_baseline

#: metric -> (typical value, run-to-run spread, "log": multiplicative spread / "lin": additive spread)
CLEAN = {
    "loss_std": (0.30, 0.04, "log"),
    "loss_range": (0.90, 0.05, "log"),
    "grad_norm_std": (0.20, 0.05, "log"),
    "grad_norm_cv": (0.15, 0.04, "log"),
    "cosine_mean": (0.30, 0.01, "lin"),
    "cosine_min": (0.15, 0.015, "lin"),
    "cosine_to_mean_min": (0.50, 0.01, "lin"),
    "gradient_diversity": (0.60, 0.03, "log"),
    "noise_scale": (40.0, 0.2, "log"),
    "loss_mean": (2.5, 0.02, "log"),
}

#: Every rank read the same batch: identical gradients, zero dispersion, diversity 1/world_size.
COLLAPSED = {
    "loss_std": 0.0, "loss_range": 0.0, "grad_norm_std": 0.0, "grad_norm_cv": 0.0, "cosine_mean": 1.0, "cosine_min": 1.0,
    "cosine_to_mean_min": 1.0, "gradient_diversity": 1 / 8, "noise_scale": 0.0, "loss_mean": 2.5,
}


def draw(rng: random.Random) -> dict[str, float]:
    """One clean run's window statistics."""
    return {m: c * math.exp(s * rng.gauss(0, 1)) if kind == "log" else c + s * rng.gauss(0, 1) for m, (c, s, kind) in CLEAN.items()}


def make_result(values: dict[str, float | None], *, seed: int = 42, status: str = "complete", world_size: int = 8,
                config: ProbeConfig | None = None, per_rank: list[RankSummary] | None = None,
                audits: dict | None = None) -> RunResult:
    """A RunResult whose every window statistic of metric m equals values[m]."""
    config = config or ProbeConfig(train={"seed": seed})
    environment = Environment(python="3.11", torch="2.13.0", transformers="4.50.0", healthcheck="0.1.0", platform="linux",
                              device_type="cpu", backend="gloo", world_size=world_size, nnodes=1)
    return RunResult(
        name=config.name, status=status, config=config, config_fingerprint=config.fingerprint(), environment=environment,
        timing=Timing(started_at=f"2025-01-01T00:00:{seed % 60:02d}Z"), steps_planned=60,
        steps_completed=60 if status == "complete" else 30, window_start_step=10, window_steps=50,
        summary={m: MetricSummary(median=v, p95=v, min=v, max=v, n=50) for m, v in values.items()},
        per_rank=per_rank or [], audits=audits or {},
    )


def clean_runs(k: int = 5, rng_seed: int = 0) -> list[RunResult]:
    rng = random.Random(rng_seed)
    return [make_result(draw(rng), seed=42 + i) for i in range(k)]


def fitted(k: int = 5) -> Baseline:
    return fit_baseline(clean_runs(k), reason="initial", approved_by="alice")

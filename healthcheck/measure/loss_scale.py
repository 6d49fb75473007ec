"""A step's gradient metrics in the units of the unscaled gradient, under fp16 mixed precision's loss scaling.

A ``GradScaler`` multiplies the loss, so every gradient DDP reduces, by its scale (2**16 to start, halved at each
overflow, doubled after a run of finite steps). The monitor measures those reduced gradients, so its norms came out
the scale times too large, and the scale moves between steps and runs: ``grad_norm_std`` is enveloped on its p95.
Where every rank's scale is the same (``grad_scale``, :mod:`healthcheck.integrations.script.step_facts`) the norms
are divided by it; cosines, the coefficient of variation, diversity and the noise scale are ratios and stay.
A rank with another scale weights its gradient differently in the all-reduce, so its numbers are left as the
reduction saw them (scaled): its norm then stands out, and the loss-weight audit names it where the loss is captured.
"""

from __future__ import annotations

import dataclasses
import math

from healthcheck.measure.metrics import StepMetrics


def unscaled(metrics: StepMetrics) -> StepMetrics:
    """``metrics`` with its gradient norms divided by the ranks' common loss scale (unchanged without one).

    >>> m = StepMetrics(step=0, direction="exact", world_size=2, buckets=1, per_rank_loss=[1.0, 1.0],
    ...     per_rank_tokens=None, per_rank_grad_norm=[2048.0, 4096.0], cosine_to_mean=[1.0, 1.0],
    ...     pairwise_cosine=[[1.0, 1.0], [1.0, 1.0]], loss_std=0.0, loss_range=0.0, grad_norm_std=1024.0,
    ...     grad_norm_cv=1 / 3, cosine_mean=1.0, cosine_min=1.0, mean_grad_norm=3072.0, gradient_diversity=0.5,
    ...     grad_sqnorm_est=2.0**20, trace_sigma_est=2.0**18, noise_scale=0.25, noise_scale_unit="batches",
    ...     nonfinite_ranks=[], loss_measured=True, per_rank_extras={"grad_scale": [1024.0, 1024.0]})
    >>> u = unscaled(m)
    >>> u.per_rank_grad_norm, u.grad_norm_std, u.mean_grad_norm, u.grad_sqnorm_est, u.noise_scale
    ([2.0, 4.0], 1.0, 3.0, 1.0, 0.25)
    >>> unscaled(dataclasses.replace(m, per_rank_extras={"grad_scale": [1024.0, 2048.0]})) == dataclasses.replace(
    ...     m, per_rank_extras={"grad_scale": [1024.0, 2048.0]})  # ranks disagree: as the reduction saw them
    True
    """
    scales = metrics.per_rank_extras.get("grad_scale") or []
    if not scales or len(set(scales)) != 1 or not (math.isfinite(scales[0]) and scales[0] > 0) or scales[0] == 1.0:
        return metrics
    scale = scales[0]
    return dataclasses.replace(
        metrics,
        per_rank_grad_norm=[g / scale for g in metrics.per_rank_grad_norm],
        grad_norm_std=metrics.grad_norm_std / scale,
        mean_grad_norm=metrics.mean_grad_norm / scale,
        grad_sqnorm_est=metrics.grad_sqnorm_est / scale**2,
        trace_sigma_est=metrics.trace_sigma_est / scale**2,
    )

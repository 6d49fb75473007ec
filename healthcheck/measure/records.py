"""The per-step records: one ``StepMetrics`` → ``steps.jsonl`` rows (per rank) and one ``aggregates.jsonl`` row.

Pure functions on ``StepMetrics.to_dict()``, shared by the probe's trainer (which writes them) and
the live-training callback (which logs the same aggregates), so the two can never drift apart.
"""

from __future__ import annotations

from typing import Any

from healthcheck.finite import finite_or_none


def rank_rows(step: int, data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rank: local loss, tokens, local gradient norm, cosine to the mean, timings."""
    world = len(data["per_rank_loss"])
    extras = data.get("per_rank_extras") or {}
    compute = extras.get("compute_ms") or [None] * world
    busy = extras.get("busy_ms") or [None] * world
    tokens = data.get("per_rank_tokens") or [None] * world
    rows = [
        {
            "step": step,
            "rank": rank,
            "loss": loss,
            "tokens": tokens[rank],
            "grad_norm": data["per_rank_grad_norm"][rank],
            "cosine_to_mean": data["cosine_to_mean"][rank],
            "compute_ms": compute[rank],
            "busy_ms": busy[rank],
        }
        for rank, loss in enumerate(data["per_rank_loss"])
    ]
    # runq_ms: the run-queue wait busy_ms left out (a CPU host); None where the rank shares cores with other
    # ranks and no clock was read, so busy_ms still holds it (measure/runqueue.py). loss_weight (script mode):
    # the weight of the rank's loss in its own backward (integrations/loss_weight.py), loss_weight_u the unit roundoff
    # of the dtype it was read in; lr (script mode): the learning rate of the optimizer's first parameter group as the
    # rank stepped, lr_groups a digest of every group's (a number equal on two ranks exactly when their rates are:
    # integrations/script/step_facts.py); grads_carried (script mode): 1 when the step's first backward found the last
    # step's gradients still in place (integrations/script/grad_start.py), 0 when cleared.
    # grad_scale (script mode): the GradScaler's scale the step's gradients carried (the norms are divided by it where
    # every rank's is the same: measure/loss_scale.py), scaler_skips the steps it skipped just before (an inf or NaN
    # gradient: no optimizer step). Each absent where not read.
    for key in ("runq_ms", "loss_weight", "loss_weight_u", "lr", "lr_groups", "grads_carried", "grad_scale", "scaler_skips"):
        values = extras.get(key)
        if values is not None:
            for row, value in zip(rows, values, strict=True):
                row[key] = finite_or_none(value)
    return rows


def aggregate_row(step: int, data: dict[str, Any], lr: float | None = None) -> dict[str, Any]:
    """The step's cross-rank aggregates (the names ``summary.METRICS`` summarises) and the pairwise matrix."""
    world = len(data["per_rank_loss"])
    tokens = data.get("per_rank_tokens") or [None] * world
    losses = [v for v in data["per_rank_loss"] if v is not None]
    norms = [v for v in data["per_rank_grad_norm"] if v is not None]
    cos_to_mean = [v for v in data["cosine_to_mean"] if v is not None]
    return {
        "step": step,
        "loss_mean": sum(losses) / len(losses) if losses else None,
        "loss_std": data["loss_std"],
        "loss_range": data["loss_range"],
        "grad_norm_mean": sum(norms) / len(norms) if norms else None,
        "grad_norm_std": data["grad_norm_std"],
        "grad_norm_cv": data["grad_norm_cv"],
        "cosine_mean": data["cosine_mean"],
        "cosine_min": data["cosine_min"],
        "cosine_to_mean_min": min(cos_to_mean) if cos_to_mean else None,
        "mean_grad_norm": data["mean_grad_norm"],
        "gradient_diversity": data["gradient_diversity"],
        "grad_sqnorm_est": data["grad_sqnorm_est"],
        "trace_sigma_est": data["trace_sigma_est"],
        "noise_scale": data["noise_scale"],
        "tokens_total": sum(t for t in tokens if t is not None),
        **_reduction_fields(data.get("per_rank_extras") or {}),
        "lr": finite_or_none(lr),
        "nonfinite_ranks": data["nonfinite_ranks"],
        "pairwise_cosine": data["pairwise_cosine"],
    }


def _reduction_fields(extras: dict) -> dict:
    """The reduction check's worst rank on the steps it ran (nothing on the others): max error and bound ratio, and
    that rank's fp16 underflow floor (in units of the same bound) where the pass counted it, and whether the script's
    comm hook was in its exact phase."""
    errors, ratios = extras.get("reduction_rel_error"), extras.get("reduction_bound_ratio")
    if errors is None or ratios is None:
        return {}
    finite = [r for r, (e, b) in enumerate(zip(errors, ratios, strict=True)) if e is not None and b is not None]
    if len(finite) < len(errors):  # a rank's local gradient was NaN/Inf: left to the non-finite audit
        return {"reduction_rel_error": None, "reduction_bound_ratio": None, "reduction_worst_rank": None}
    worst = max(finite, key=lambda r: ratios[r])
    row = {"reduction_rel_error": max(errors), "reduction_bound_ratio": ratios[worst], "reduction_worst_rank": worst}
    floors = extras.get("reduction_fp16_floor")
    if floors is not None:
        row["reduction_fp16_floor"] = floors[worst]
    # Whether the script's hook still all-reduced exactly (PowerSGD before its start iteration): exact only if on
    # every rank (measure/script_hook.py); absent for hooks without such a phase.
    phases = extras.get("comm_hook_exact")
    if phases is not None and all(finite_or_none(v) is not None for v in phases):
        row["comm_hook_exact"] = min(phases)
    return row

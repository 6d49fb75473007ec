"""A realistic fake run directory for report and plot tests: no torch, no workers, deterministic.

The default run mimics the paper's S1-2 setting: 8 ranks, 60 steps, 10 warmup steps, and rank 0
persistently off (higher loss, larger gradients, a gradient direction far from the others'), so its
cosine to the mean gradient and its pairwise cosines sit well below the other ranks'::

    from tests.fixtures_runs import write_fake_run
    result, verdict = write_fake_run(tmp_path)                     # FAIL, rank 0 off
    result, verdict = write_fake_run(tmp_path, outlier_rank=None)  # PASS

The per-rank z-scores are computed here, independently of the package, as ``healthcheck.judge.summary``
defines them (leave-one-out: each rank against the mean and population std of the *other* ranks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

import numpy as np

from healthcheck.artifacts import (
    AGGREGATES_FILE,
    STEPS_FILE,
    VERDICT_FILE,
    Environment,
    MetricSummary,
    RankInfo,
    RankSummary,
    RunResult,
    Timing,
    write_result,
)
from healthcheck.config import ProbeConfig
from healthcheck.finite import json_safe
from healthcheck.judge.findings import ConfigChange, Finding, Verdict

#: The envelopes the fake baseline holds, as (metric, statistic, lower, upper). A healthy run of
#: the generator below sits inside every one; the S1-2 run falls outside the cosine ones.
ENVELOPES = (
    ("cosine_mean", "median", 0.39, 0.46),
    ("cosine_to_mean_min", "median", 0.55, 0.70),
    ("loss_std", "p95", 0.0, 0.40),
    ("grad_norm_cv", "p95", 0.0, 0.20),
    ("loss_range", "p95", 0.0, 1.20),
)


def _leave_one_out_z(values: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    for r in range(len(values)):
        others = np.delete(values, r)
        out[r] = (values[r] - others.mean()) / others.std()
    return out


def _summary(values: list[float]) -> MetricSummary:
    arr = np.asarray(values, dtype=float)
    return MetricSummary(
        median=float(np.median(arr)),
        p95=float(np.percentile(arr, 95)),
        min=float(arr.min()),
        max=float(arr.max()),
        n=len(arr),
    )


def _margin(observed: float, lower: float, upper: float) -> float:
    half_width = (upper - lower) / 2
    return min(observed - lower, upper - observed) / half_width


def _verdict(summary: dict[str, MetricSummary], outlier_rank: Optional[int], ranks: int) -> Verdict:
    findings = []
    for metric, statistic, lower, upper in ENVELOPES:
        observed = getattr(summary[metric], statistic)
        passed = lower <= observed <= upper
        ranks = [outlier_rank] if not passed and outlier_rank is not None else []
        findings.append(
            Finding(
                check=f"envelope.{metric}",
                title=f"{metric} {statistic} within the baseline envelope",
                passed=passed,
                message=(
                    f"{metric} {statistic} {observed:.4g} is "
                    + ("inside" if passed else "outside")
                    + f" the baseline envelope [{lower:.4g}, {upper:.4g}]"
                ),
                metric=metric,
                statistic=statistic,
                observed=observed,
                lower=lower,
                upper=upper,
                margin=_margin(observed, lower, upper),
                ranks=ranks,
            )
        )
    findings.append(
        Finding(
            check="audit.param_equality",
            title="parameters identical on every rank after the last step",
            passed=True,
            message=f"all {ranks} ranks hold bit-identical parameters after the last step",
        )
    )
    seeds_differ = outlier_rank is not None
    findings.append(
        Finding(
            check="audit.seeds",
            title="every rank seeded alike",
            passed=not seeds_differ,
            message=(
                f"rank {outlier_rank} used seed 1041, the other ranks seed 42" if seeds_differ else "all ranks used seed 42"
            ),
            ranks=[outlier_rank] if seeds_differ else [],
        )
    )
    seed_change = (
        ConfigChange(path="seed_policy", old="shared", new="rank0_differs")
        if outlier_rank == 0
        else ConfigChange(path=f"rank_overrides.{outlier_rank}", old=None, new={"train": {"seed": 1041}})
    )
    diff = [
        seed_change,
        ConfigChange(path="train.lr", old=0.001, new=0.002),
    ]
    return Verdict.collect(findings, baseline_path="baselines/s1-2.json", config_diff=diff if seeds_differ else [])


def write_fake_run(
    run_dir: Path,
    *,
    judged: bool = True,
    outlier_rank: Optional[int] = 0,
    status: Literal["complete", "incomplete"] = "complete",
    ranks: int = 8,
    steps: int = 60,
    warmup: int = 10,
    seed: int = 0,
) -> tuple[RunResult, Optional[Verdict]]:
    """Write ``steps.jsonl``, ``aggregates.jsonl``, ``result.json`` (and ``verdict.json``) into ``run_dir``.

    ``judged``: judge the run against :data:`ENVELOPES` and write ``verdict.json`` (a complete run
    only). With ``outlier_rank=None`` every check passes; with an outlier the cosine envelopes and the
    seed audit fail. An ``incomplete`` run stops after 60% of the steps, its failure naming rank 3.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    steps_done = steps if status == "complete" else int(steps * 0.6)
    config = ProbeConfig(
        name="s1-2-probe",
        seed_policy="rank0_differs" if outlier_rank == 0 else "shared",
        train={"steps": steps},
        distributed={"nproc": ranks},
        metrics={"warmup_steps": warmup},
    )
    is_off = np.zeros(ranks, dtype=bool)
    if outlier_rank is not None:
        is_off[outlier_rank] = True

    step_rows, aggregate_rows = [], []
    window: dict[str, list[float]] = {}
    per_rank_values = {k: [[] for _ in range(ranks)] for k in ("loss", "grad_norm", "cosine_to_mean", "tokens", "compute_ms")}
    for step in range(steps_done):
        loss = 2.0 + 4.0 * np.exp(-step / 15) + rng.normal(0, 0.12, ranks) + 0.35 * is_off
        grad_norm = (0.5 + 1.5 * np.exp(-step / 30) + rng.normal(0, 0.05, ranks)) * np.where(is_off, 1.25, 1.0)
        cosine_to_mean = np.clip(rng.normal(0.62, 0.03, ranks) - 0.24 * is_off, -1, 1)
        tokens = rng.normal(400, 25, ranks).round()
        compute_ms = rng.normal(85, 4, ranks)
        pairwise = rng.normal(0.42, 0.02, (ranks, ranks)) - 0.27 * (is_off[:, None] | is_off[None, :])
        pairwise = (pairwise + pairwise.T) / 2
        np.fill_diagonal(pairwise, 1.0)
        off_diagonal = pairwise[~np.eye(ranks, dtype=bool)]
        for r in range(ranks):
            row = {
                "step": step,
                "rank": r,
                "loss": float(loss[r]),
                "tokens": float(tokens[r]),
                "grad_norm": float(grad_norm[r]),
                "cosine_to_mean": float(cosine_to_mean[r]),
                "compute_ms": float(compute_ms[r]),
            }
            step_rows.append(row)
            if step >= warmup:
                for key in per_rank_values:
                    per_rank_values[key][r].append(row[key])
        aggregates = {
            "step": step,
            "loss_mean": float(loss.mean()),
            "loss_std": float(loss.std()),
            "loss_range": float(np.ptp(loss)),
            "grad_norm_mean": float(grad_norm.mean()),
            "grad_norm_std": float(grad_norm.std()),
            "grad_norm_cv": float(grad_norm.std() / grad_norm.mean()),
            "cosine_mean": float(off_diagonal.mean()),
            "cosine_min": float(off_diagonal.min()),
            "cosine_to_mean_min": float(cosine_to_mean.min()),
            "gradient_diversity": float(1.0 / max(off_diagonal.mean(), 1e-3) / ranks),
            "noise_scale": float(rng.normal(120, 10)),
            "lr": 1e-3 * min(1.0, (step + 1) / 5),
            "nonfinite_ranks": [],
            "pairwise_cosine": pairwise.tolist(),
        }
        aggregate_rows.append(aggregates)
        if step >= warmup:
            for key, value in aggregates.items():
                if isinstance(value, float) and key != "lr":
                    window.setdefault(key, []).append(value)

    summary = {metric: _summary(values) for metric, values in window.items()}
    means = {key: np.array([np.mean(v) if v else np.nan for v in values]) for key, values in per_rank_values.items()}
    z = {key: _leave_one_out_z(values) for key, values in means.items() if key != "tokens"}
    per_rank = [
        RankSummary(
            rank=r,
            loss=float(means["loss"][r]),
            grad_norm=float(means["grad_norm"][r]),
            cosine_to_mean=float(means["cosine_to_mean"][r]),
            tokens=float(means["tokens"][r]),
            compute_ms=float(means["compute_ms"][r]),
            z_loss=float(z["loss"][r]),
            z_grad_norm=float(z["grad_norm"][r]),
            z_cosine_to_mean=float(z["cosine_to_mean"][r]),
            z_compute_ms=float(z["compute_ms"][r]),
        )
        for r in range(ranks)
    ]
    environment = Environment(
        python="3.11.7",
        torch="2.13.0",
        transformers="4.57.0",
        healthcheck="0.1.0",
        platform="Linux-x86_64",
        device_type="cpu",
        backend="gloo",
        world_size=ranks,
        nnodes=1,
        ranks=[
            RankInfo(
                rank=r, local_rank=r, node="ci-runner-1", device="cpu", device_name="x86_64 CPU",
                seed=1041 if is_off[r] else 42, python_seed=42, numpy_seed=42, torch_seed=42,
                sampler_seed=42, sampler_rank=r, sampler_replicas=ranks, precision="fp32",
            )
            for r in range(ranks)
        ],
    )
    result = RunResult(
        name=config.name,
        status=status,
        failure=None if status == "complete" else f"rank 3 exited with code 1 at step {steps_done}",
        config=config,
        config_fingerprint=config.fingerprint(),
        environment=environment,
        timing=Timing(started_at="2025-11-22T01:00:00Z", finished_at="2025-11-22T01:01:12Z", wall_s=72.4, train_s=51.0),
        steps_planned=steps,
        steps_completed=steps_done,
        window_start_step=warmup,
        window_steps=max(0, steps_done - warmup),
        summary=summary,
        per_rank=per_rank,
    )
    with open(run_dir / STEPS_FILE, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(json_safe(row)) + "\n" for row in step_rows)
    with open(run_dir / AGGREGATES_FILE, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(json_safe(row)) + "\n" for row in aggregate_rows)
    write_result(run_dir, result)
    verdict = _verdict(summary, outlier_rank, ranks) if judged and status == "complete" else None
    if verdict is not None:
        (run_dir / VERDICT_FILE).write_text(verdict.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return result, verdict

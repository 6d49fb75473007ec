"""``healthcheck baseline record``: K probes of one config with seeds seed, seed+1, … then a fit.

The spread across those runs is what the envelope bounds are fitted from (see :mod:`healthcheck.judge.envelope`).
"""

from __future__ import annotations

from pathlib import Path

from healthcheck.artifacts import RunResult, default_run_dir
from healthcheck.config import ProbeConfig
from healthcheck.errors import ProbeFailed


def seeded(config: ProbeConfig, seed: int) -> ProbeConfig:
    """The same probe with another base seed (the seed policy and overrides still apply on top)."""
    data = config.model_dump()
    data["train"]["seed"] = seed
    return ProbeConfig.model_validate(data)


def run_repeats(config: ProbeConfig, repeats: int, runs_root: Path, first_seed: int | None = None) -> tuple[list[RunResult], list[Path]]:
    """Run ``repeats`` probes, one per seed, each in its own run directory; print one line per run."""
    from healthcheck.run.probe import run_probe

    start = config.train.seed if first_seed is None else first_seed
    results, run_dirs = [], []
    for index in range(repeats):
        seed = start + index
        run_dir = default_run_dir(f"{config.name}-seed{seed}", runs_root)
        result, _ = run_probe(seeded(config, seed), run_dir)
        assert result is not None
        if result.status != "complete":
            raise ProbeFailed(f"baseline run {index + 1} (seed {seed}) {result.status}: {result.failure}; artifacts in {run_dir}")
        if result.stopped_early is not None:  # an envelope is never fitted from a truncated window
            stop = result.stopped_early
            raise ProbeFailed(f"baseline run {index + 1} (seed {seed}) {stop.headline()}: {stop.message}; artifacts in {run_dir}")
        print(f"  run {index + 1}/{repeats}: seed {seed} -> {run_dir} ({result.status})", flush=True)
        results.append(result)
        run_dirs.append(run_dir)
    return results, run_dirs


def record_baseline(config: ProbeConfig, repeats: int, *, runs_root: Path, reason: str, approved_by: str | None):
    from healthcheck.judge.baseline import fit_baseline

    print(f"recording baseline for probe {config.name!r}: {repeats} probes", flush=True)
    results, run_dirs = run_repeats(config, repeats, runs_root)
    return fit_baseline(results, reason=reason, approved_by=approved_by, name=config.name, run_ids=[d.name for d in run_dirs])

"""Baselines: the approved envelope per metric, fitted from K clean probe runs and kept as reviewable JSON.

Record one (the lead's CLI calls :func:`fit_baseline` / :func:`save_baseline`)::

    healthcheck baseline record --config probe.yaml --repeats 5   # seeds seed, seed+1, ..., seed+4

``baselines/<probe name>.json`` is a :class:`Baseline` (never a pickle). Saving replaces it atomically
under ``baselines/<name>.json.lock`` and first appends the version it replaces, as one compact JSON
line, to ``baselines/<name>.history.jsonl``, so ``tail -n 1`` of the history recovers the previous one.

How the bounds are derived
--------------------------
For each gated metric ``m`` (:data:`DEFAULT_METRICS`) take its window statistic ``S`` (the median or p95
over the post-warmup steps) from each of the K runs, and map it to the fitting scale: ``y = log S`` for
dispersions (positive, varying multiplicatively, and a collapse to 0 then lies at -inf, outside any
envelope), ``y = S`` for cosines. Then::

    c      = median(y)                                        robust to one odd run
    sigma  = max(1.4826 * MAD(y), sd(y), floor_m)
    floor_m = rel_floor_m                    on the log scale (log units ~ a fraction of the value)
            = max(abs_floor_m, rel_floor_m * |c|)  on the linear scale
    k      = t_{K-1}(1 - alpha / (2 M)) * sqrt(1 + pi / (2 K))
    lower, upper = inverse_scale(c - k * sigma), inverse_scale(c + k * sigma)

False alarms. For exchangeable normal ``y``, ``(y_new - mean) / (sd * sqrt(1 + 1/K))`` is Student-t with
K-1 degrees of freedom, so the t prediction interval misses a fresh clean run with probability exactly
alpha/M. The median centre has variance ~ pi sigma^2 / (2K) rather than sigma^2 / K, hence the pi/2.
Taking sigma >= sd(y) keeps that calibration; MAD and the floor only widen. (Monte Carlo, K=5, M=7:
realised per-metric rate 0.97e-3 against the 1.43e-3 target; with 0.5 sd in place of sd it is 3.6x
the target, so no fraction below 1 is used.) The floor exists because with K=3..5 the MAD, and even the
sd, can be ~0 by chance or by quantised metrics. Checking M metrics at alpha/M each, the union bound
(Bonferroni) gives P(any envelope fails on an unchanged config) <= alpha = 1% by default, whatever
the metrics' correlation. Assumptions: the runs differ only in ``train.seed`` on the same hardware
and software, and the statistics vary across seeds roughly normally on the chosen scale.

Bounds are two-sided on purpose: a run that is *too* consistent (cosine 1.0, zero dispersion: every
rank read the same data) is a regression just like one that diverges.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import filelock
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from healthcheck.artifacts import RunResult, load_result, utc_now, write_text_atomic
from healthcheck.config import format_validation_error
from healthcheck.errors import BaselineError

BASELINE_SCHEMA_VERSION = 1
DEFAULT_FALSE_ALARM_RATE = 0.01
MIN_RUNS = 3
#: 1 / Phi^-1(3/4): makes the MAD a consistent estimate of a normal sd.
MAD_TO_SD = 1.4826

Statistic = Literal["median", "p95", "min", "max"]


class _Model(BaseModel):
    # allow_inf_nan=False: json.loads accepts NaN/Infinity, which must not slip into a bound.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class MetricSpec(_Model):
    """How one metric is fitted and whether it gates the verdict."""

    gated: bool = Field(description="Whether fit_baseline gives it an envelope (and so whether it can fail a run).")
    statistic: Statistic = Field(description="Window statistic taken from RunResult.summary[metric].")
    scale: Literal["linear", "log"] = Field(description="Scale the spread is fitted on; log for positive dispersions.")
    # Floors on sigma, so K identical-looking runs still get a usable width: at K=5, M=7 the half-width
    # is ~9 sigma, i.e. at least +-9% for dispersions and +-0.045 for cosines.
    abs_floor: float = Field(1e-6, gt=0, description="Minimum sigma in metric units (linear scale).")
    rel_floor: float = Field(0.01, gt=0, description="Minimum sigma as a fraction of the value (log units on the log scale).")
    rank_z: Optional[str] = Field(None, description="RankSummary z-score field that attributes a failure to ranks.")
    title: str = Field(description="Short human name.")
    why: str = Field(description="Why it is (not) gated with this statistic.")


#: The default table: which metrics gate, by which window statistic, on which scale. Medians track the
#: level of a metric; p95 tracks intermittent spikes (one rank now and then far off).
DEFAULT_METRICS: dict[str, MetricSpec] = {
    "loss_std": MetricSpec(
        gated=True, statistic="median", scale="log", rank_z="z_loss", title="Cross-rank loss spread",
        why="Level of disagreement between ranks' losses; 0 when every rank reads the same batch.",
    ),
    "loss_range": MetricSpec(
        gated=True, statistic="p95", scale="log", rank_z="z_loss", title="Cross-rank loss range (spikes)",
        why="Catches a rank that is intermittently far off, which the median spread hides.",
    ),
    "grad_norm_std": MetricSpec(
        gated=True, statistic="p95", scale="log", rank_z="z_grad_norm", title="Cross-rank gradient-norm spread (spikes)",
        why="Spikes in gradient-norm disagreement (a bad batch or a loss-scale glitch on one rank).",
    ),
    "grad_norm_cv": MetricSpec(
        gated=True, statistic="median", scale="log", rank_z="z_grad_norm", title="Gradient-norm coefficient of variation",
        why="Scale-free level of gradient-norm disagreement; a loss-scale mismatch multiplies it.",
    ),
    "cosine_mean": MetricSpec(
        gated=True, statistic="median", scale="linear", abs_floor=0.005, rank_z="z_cosine_to_mean",
        title="Mean pairwise gradient cosine",
        why="Goes to 1.0 when ranks compute the same gradient (collapsed effective batch), down when they diverge.",
    ),
    "cosine_min": MetricSpec(
        gated=False, statistic="median", scale="linear", abs_floor=0.005, rank_z="z_cosine_to_mean",
        title="Lowest pairwise gradient cosine",
        why="Not gated: the same signal as cosine_to_mean_min, but a min over n(n-1)/2 pairs (noisier) that names a "
        "pair rather than a rank; gating it would also widen every envelope through the Bonferroni count.",
    ),
    "cosine_to_mean_min": MetricSpec(
        gated=True, statistic="median", scale="linear", abs_floor=0.005, rank_z="z_cosine_to_mean",
        title="Lowest rank cosine to the mean gradient",
        why="One rank drifting from the consensus (different seed, data or loss scale).",
    ),
    "gradient_diversity": MetricSpec(
        gated=True, statistic="median", scale="log", rank_z="z_cosine_to_mean", title="Gradient diversity",
        why="Falls to 1/N when all local gradients are equal.",
    ),
    "noise_scale": MetricSpec(
        gated=False, statistic="median", scale="linear", title="Gradient noise scale",
        why="Not gated: a ratio of two noisy estimates that goes negative or explodes when |G|^2 is small, and a "
        "function of the gradient dispersion the gated metrics already cover.",
    ),
    "loss_mean": MetricSpec(
        gated=False, statistic="median", scale="log", rank_z="z_loss", title="Mean loss",
        why="Not gated: it measures training progress, not consistency; it moves with legitimate model or data "
        "changes and barely moves when every rank reads the same data.",
    ),
}


class Envelope(_Model):
    """The approved range of one metric's window statistic."""

    statistic: Statistic = Field(description="Window statistic judged: median, p95, min or max.")
    scale: Literal["linear", "log"] = Field("linear", description="Scale the bounds were fitted on.")
    center: float = Field(description="Median of the fitting runs' values (metric units).")
    lower: float = Field(description="Lowest accepted value (metric units).")
    upper: float = Field(description="Highest accepted value (metric units).")
    sigma: Optional[float] = Field(None, ge=0, description="Fitted spread, in fitting-scale units.")
    k: Optional[float] = Field(None, ge=0, description="Half-width in sigmas: t-quantile x sqrt(1 + pi/(2K)).")
    values: list[float] = Field(default_factory=list, description="The statistic in each fitting run, by seed.")

    @model_validator(mode="after")
    def _ordered(self) -> "Envelope":
        if self.lower > self.upper:
            raise ValueError(f"lower {self.lower:g} is above upper {self.upper:g}")
        if not self.lower <= self.center <= self.upper:
            raise ValueError(f"center {self.center:g} is outside [lower {self.lower:g}, upper {self.upper:g}]")
        return self


class FittedRun(_Model):
    """One run a baseline was fitted from."""

    seed: int = Field(description="train.seed of the run.")
    run_id: Optional[str] = Field(None, description="Run directory name, when known.")
    started_at: str = Field(description="When the run started (UTC).")
    config_fingerprint: str = Field(description="The run's own config fingerprint.")


class Baseline(_Model):
    """``baselines/<name>.json``: what was approved, by whom, why, on what, and the envelopes."""

    schema_version: int = Field(BASELINE_SCHEMA_VERSION, description="Baseline file format version.")
    name: str = Field(description="Probe name.")
    created_at: str = Field(description="UTC time the baseline was fitted.")
    approved_by: str = Field(description="Who approved it.")
    reason: str = Field(description="Why it was recorded or changed.")
    healthcheck_version: str = Field(description="healthcheck version of the fitting runs.")
    torch_version: str = Field(description="torch version of the fitting runs.")
    transformers_version: str = Field(description="transformers version of the fitting runs.")
    device_type: str = Field(description="cpu, cuda or npu.")
    world_size: int = Field(ge=1, description="Workers in the fitting runs.")
    # A plain dict, not ProbeConfig: an old snapshot must stay loadable (and diffable) after the config
    # model gains or drops a field.
    config: dict[str, Any] = Field(description="The approved ProbeConfig dump (seed of the first run).")
    config_fingerprint: str = Field(description="ProbeConfig.fingerprint() of that snapshot.")
    runs: list[FittedRun] = Field(description="The runs the envelopes were fitted from.")
    false_alarm_rate: float = Field(DEFAULT_FALSE_ALARM_RATE, gt=0, lt=1, description="Target P(any envelope fails | unchanged config).")
    envelopes: dict[str, Envelope] = Field(min_length=1, description="Per gated metric.")

    def config_snapshot_baseline_path(self) -> Path:
        """Where the snapshot's config keeps its baseline: its ``baseline`` field, else ``baselines/<name>.json``."""
        return Path(self.config.get("baseline") or Path("baselines") / f"{self.name}.json")


# --------------------------------------------------------------------------- pure math


def student_t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer ``df``, by the exact finite series (A&S 26.7.3-4).

    >>> round(student_t_cdf(2.776445, 4), 6)
    0.975
    """
    theta = math.atan2(t, math.sqrt(df))
    cos2, sin = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:
        term = total = math.cos(theta) if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= 2 * j / (2 * j + 1) * cos2
            total += term
        two_sided = 2 / math.pi * (theta + sin * total)
    else:
        term = total = 1.0
        for j in range(1, df // 2):
            term *= (2 * j - 1) / (2 * j) * cos2
            total += term
        two_sided = sin * total
    return 0.5 + two_sided / 2


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with integer ``df`` >= 1 (bisection on the exact cdf).

    >>> round(t_quantile(0.975, 4), 3)
    2.776
    """
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"need 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    if df > 1000:  # the series has df/2 terms; Cornish-Fisher is within ~1e-7 out here
        z = statistics.NormalDist().inv_cdf(p)
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        low, high = high, high * 2
    for _ in range(200):
        mid = (low + high) / 2
        if student_t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def envelope_multiplier(n_runs: int, n_gated: int, false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE) -> float:
    """Half-width in sigmas: ``t_{K-1}(1 - alpha/(2M)) * sqrt(1 + pi/(2K))`` (see module docstring).

    >>> round(envelope_multiplier(5, 7), 2)
    8.99
    """
    quantile = t_quantile(1 - false_alarm_rate / (2 * n_gated), n_runs - 1)
    return quantile * math.sqrt(1 + math.pi / (2 * n_runs))


def robust_sigma(values: Sequence[float]) -> float:
    """``1.4826 * MAD``: a normal sd estimate that one wild value cannot inflate.

    >>> robust_sigma([1.0, 2.0, 3.0, 4.0, 100.0])
    1.4826
    """
    center = statistics.median(values)
    return MAD_TO_SD * statistics.median(abs(v - center) for v in values)


def fit_envelope(values: Sequence[float], spec: MetricSpec, multiplier: float) -> Envelope:
    """Fit one metric's two-sided envelope from its per-run values (module docstring has the formula).

    A log-scale metric falls back to the linear scale when a run's value is not positive or the log
    bounds overflow, so every finite input gets a finite two-sided envelope.
    """
    if len(values) < 2:
        raise ValueError("need at least two values")
    use_log = spec.scale == "log" and all(v > 0 for v in values)
    fitted = [math.log(v) for v in values] if use_log else list(values)
    center = statistics.median(fitted)
    floor = spec.rel_floor if use_log else max(spec.abs_floor, spec.rel_floor * abs(center))
    sigma = max(robust_sigma(fitted), statistics.stdev(fitted), floor)
    half = multiplier * sigma
    if use_log:
        # exp(log(x)) can round past x; pin the centre between the middle raw values it came from.
        mid = min(max(math.exp(center), statistics.median_low(values)), statistics.median_high(values))
        try:
            lower, upper = math.exp(center - half), math.exp(center + half)
        except OverflowError:
            return fit_envelope(values, spec.model_copy(update={"scale": "linear"}), multiplier)
        if lower < mid < upper and math.isfinite(upper):
            return Envelope(statistic=spec.statistic, scale="log", center=mid, lower=lower, upper=upper,
                            sigma=sigma, k=multiplier, values=list(values))
        return fit_envelope(values, spec.model_copy(update={"scale": "linear"}), multiplier)
    if not math.isfinite(center + half) or not math.isfinite(center - half):
        raise ValueError(f"values too large to fit: {list(values)}")
    return Envelope(statistic=spec.statistic, scale="linear", center=center, lower=center - half,
                    upper=center + half, sigma=sigma, k=multiplier, values=list(values))


# --------------------------------------------------------------------------- fitting from runs


def default_approver() -> str:
    """``git config user.name``, else ``$USER``, else ``unknown``: the default for ``approved_by``."""
    try:
        name = subprocess.run(["git", "config", "user.name"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        name = ""
    return name or os.environ.get("USER", "") or "unknown"


def _label(result: RunResult, index: int) -> str:
    return f"run {index + 1} ({result.name}, seed {result.config.train.seed}, started {result.timing.started_at})"


def _check_fittable(results: list[RunResult]) -> None:
    # verdict imports this module, so its config_diff is imported here, where it is needed.
    from healthcheck.verdict import config_diff

    if len(results) < MIN_RUNS:
        raise BaselineError(f"need at least {MIN_RUNS} complete runs to fit a baseline, got {len(results)} (use --repeats 5)")
    for index, result in enumerate(results):
        if result.status != "complete":
            raise BaselineError(f"{_label(result, index)} is {result.status}, not complete; fit only from finished runs")
        if result.environment is None:
            raise BaselineError(f"{_label(result, index)} has no environment record; cannot know its world size")
    first = results[0]
    reference = first.config.model_dump(mode="json")
    for index, result in enumerate(results[1:], start=1):
        changes = [c for c in config_diff(reference, result.config.model_dump(mode="json")) if c.path != "train.seed"]
        if changes:
            shown = ", ".join(f"{c.path}: {c.old!r} -> {c.new!r}" for c in changes[:3])
            raise BaselineError(f"{_label(result, index)}: config differs from run 1 beyond train.seed ({shown}); fit from runs of one config")
        env, env0 = result.environment, first.environment
        if (env.world_size, env.device_type) != (env0.world_size, env0.device_type):
            raise BaselineError(
                f"{_label(result, index)}: ran on world_size {env.world_size}/{env.device_type}, run 1 on "
                f"{env0.world_size}/{env0.device_type}; fit from runs of one layout"
            )
    seeds = [r.config.train.seed for r in results]
    if len(set(seeds)) != len(seeds):
        raise BaselineError(
            f"runs share a train.seed ({sorted(seeds)}); record with distinct seeds (seed, seed+1, ...) so the envelope sees seed-to-seed spread"
        )


def _metric_values(results: list[RunResult], metric: str, statistic: str) -> list[float]:
    values = []
    for index, result in enumerate(results):
        summary = result.summary.get(metric)
        value = getattr(summary, statistic) if summary is not None else None
        if value is None or not math.isfinite(value):
            raise BaselineError(f"{_label(result, index)}: summary.{metric}.{statistic} is {value}; cannot fit its envelope")
        values.append(float(value))
    return values


def fit_baseline(
    results: list[RunResult],
    *,
    reason: str,
    approved_by: Optional[str],
    name: Optional[str] = None,
    run_ids: Optional[Sequence[str]] = None,
    metrics: Optional[dict[str, MetricSpec]] = None,
    false_alarm_rate: float = DEFAULT_FALSE_ALARM_RATE,
) -> Baseline:
    """Fit every gated metric's envelope from K >= 3 complete runs of one config with distinct seeds.

    Args:
        results: The runs, in any order (sorted by seed here).
        reason: Why the baseline is recorded or changed (kept in the file for review).
        approved_by: Who approved it; None means :func:`default_approver`.
        name: Probe name; defaults to the runs' config name.
        run_ids: Run directory names, parallel to ``results``.
        metrics: Metric table; defaults to :data:`DEFAULT_METRICS`. Only ``gated`` entries are fitted.
        false_alarm_rate: Target probability that an unchanged config fails any envelope.

    Raises:
        BaselineError: Too few runs, an unfinished run, configs differing beyond ``train.seed``,
            mixed layouts, repeated seeds, or a gated metric missing from a run.
    """
    ids = list(run_ids) if run_ids is not None else [None] * len(results)
    if len(ids) != len(results):
        raise BaselineError(f"got {len(ids)} run ids for {len(results)} runs")
    _check_fittable(results)
    order = sorted(range(len(results)), key=lambda i: results[i].config.train.seed)
    results, ids = [results[i] for i in order], [ids[i] for i in order]
    gated = {m: s for m, s in (metrics or DEFAULT_METRICS).items() if s.gated}
    if not gated:
        raise BaselineError("the metric table gates no metric; nothing to fit")
    multiplier = envelope_multiplier(len(results), len(gated), false_alarm_rate)
    envelopes = {}
    for metric, spec in gated.items():
        try:
            envelopes[metric] = fit_envelope(_metric_values(results, metric, spec.statistic), spec, multiplier)
        except ValueError as exc:
            raise BaselineError(f"{metric}: {exc}") from None
    first, env = results[0], results[0].environment
    assert env is not None  # _check_fittable refused runs without one
    return Baseline(
        name=name or first.config.name,
        created_at=utc_now(),
        approved_by=approved_by or default_approver(),
        reason=reason,
        healthcheck_version=env.healthcheck,
        torch_version=env.torch,
        transformers_version=env.transformers,
        device_type=env.device_type,
        world_size=env.world_size,
        config=first.config.model_dump(mode="json"),
        config_fingerprint=first.config.fingerprint(),
        runs=[FittedRun(seed=r.config.train.seed, run_id=i, started_at=r.timing.started_at, config_fingerprint=r.config_fingerprint)
              for r, i in zip(results, ids)],
        false_alarm_rate=false_alarm_rate,
        envelopes=envelopes,
    )


def baseline_from_runs(run_dirs: list[Path], *, reason: str, approved_by: Optional[str]) -> Baseline:
    """Load ``RUN_DIR/result.json`` for each directory and fit (``healthcheck baseline update --from``)."""
    results = [load_result(Path(d)) for d in run_dirs]
    return fit_baseline(results, reason=reason, approved_by=approved_by, run_ids=[Path(d).name for d in run_dirs])


# --------------------------------------------------------------------------- persistence


def history_path(path: Path) -> Path:
    """``baselines/default.json`` -> ``baselines/default.history.jsonl``."""
    return path.with_name(path.stem + ".history.jsonl")


def save_baseline(baseline: Baseline, path: Path | str) -> None:
    """Write atomically under a file lock, first appending the replaced version to the history file."""
    path = Path(path)
    try:
        _save_locked(baseline, path)
    except OSError as exc:
        # Disk full or read-only: the temp file is removed and the old baseline was never touched.
        raise BaselineError(
            f"{path}: cannot write baseline ({exc.strerror or exc}); the previous baseline, if any, is unchanged"
        ) from None


def _save_locked(baseline: Baseline, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock"):
        if path.exists():
            old = path.read_text(encoding="utf-8")
            try:
                line = json.dumps(json.loads(old), separators=(",", ":"))
            except json.JSONDecodeError:
                line = json.dumps(old)  # a corrupt file is kept verbatim, as a JSON string
            # History first: a crash between the two steps duplicates a version, it never loses one.
            with open(history_path(path), "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        write_text_atomic(path, baseline.model_dump_json(indent=2) + "\n")


def record_command(config_hint: Optional[str] = None) -> str:
    """The exact command that records a baseline, shown whenever one is missing or unusable."""
    return f"healthcheck baseline record --config {config_hint or '<config>'} --repeats 5"


def load_baseline(path: Path | str, config_hint: Optional[str] = None) -> Baseline:
    """Read and validate a baseline, or raise a one-line :class:`BaselineError` (exit 2).

    Args:
        path: The baseline file.
        config_hint: Config path to show in the "record one with" command when the file is missing.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BaselineError(f"{path}: no baseline found; record one with: {record_command(config_hint)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BaselineError(f"{path}: cannot read baseline ({' '.join(str(exc).split())})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BaselineError(f"{path}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise BaselineError(f"{path}: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != BASELINE_SCHEMA_VERSION:
        raise BaselineError(
            f"{path}: schema_version: unknown baseline schema version {version!r} (this healthcheck reads "
            f"{BASELINE_SCHEMA_VERSION}); re-record with: {record_command(config_hint)}"
        )
    try:
        return Baseline.model_validate(data)
    except ValidationError as exc:
        raise BaselineError(format_validation_error(exc, str(path))) from None


# --------------------------------------------------------------------------- rendering


def render_baseline_text(baseline: Baseline, width: int = 110) -> str:
    """Plain text for ``healthcheck baseline show PATH``: provenance, then one row per envelope."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"baseline {baseline.name}", title_justify="left")
    for column in ("metric", "statistic", "scale", "lower", "center", "upper", "per-run values"):
        table.add_column(column, justify="right" if column in ("lower", "center", "upper") else "left")
    for metric, env in baseline.envelopes.items():
        values = ", ".join(f"{v:.4g}" for v in env.values)
        table.add_row(metric, env.statistic, env.scale, f"{env.lower:.4g}", f"{env.center:.4g}", f"{env.upper:.4g}", values)
    seeds = ", ".join(str(r.seed) for r in baseline.runs)
    header = (
        f"approved by {baseline.approved_by} at {baseline.created_at}: {baseline.reason}\n"
        f"healthcheck {baseline.healthcheck_version}, torch {baseline.torch_version}, "
        f"transformers {baseline.transformers_version}; {baseline.world_size} x {baseline.device_type}\n"
        f"config {baseline.config_fingerprint}; fitted from {len(baseline.runs)} runs (seeds {seeds})\n"
        f"false-alarm target {baseline.false_alarm_rate:.2%} for the whole verdict on an unchanged config\n"
    )
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(header, table, sep="\n", highlight=False)
    return console.file.getvalue()

"""The run directory and every typed record of a run: ``result.json``, and what crosses a process boundary.

Layout of ``runs/<name>-<UTC timestamp>/`` (or ``--out DIR``)::

    config.yaml          the resolved config, re-usable with --config
    steps.jsonl          one row per (sampled step, rank): loss, tokens, grad_norm, cosine_to_mean, compute_ms,
                         busy_ms and (DDP on a CPU host) runq_ms
    aggregates.jsonl     one row per sampled step: the dispersion/cosine aggregates and the pairwise matrix
    result.json          RunResult: config, environment, seeds per rank, timing, window summary, status
    verdict.json         the findings of the last judgement against a baseline (when there was one)
    errors/rank-<r>.json a failed worker's WorkerFailure (and its traceback beside it)

Between processes: each worker returns a :class:`WorkerReport` to the launcher (rank 0's carries the
gathered :class:`AuditEvidence`), and a worker that fails leaves a :class:`WorkerFailure`. Rows are
appended and flushed as the probe runs, so a crashed probe still leaves what it measured.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import ConfigDict, Field

from healthcheck.config import ProbeConfig
from healthcheck.errors import InvalidInput
from healthcheck.files import read_model_file, write_text_atomic
from healthcheck.typed import Record

RESULT_SCHEMA_VERSION = 1

STEPS_FILE = "steps.jsonl"
AGGREGATES_FILE = "aggregates.jsonl"
RESULT_FILE = "result.json"
CONFIG_FILE = "config.yaml"
VERDICT_FILE = "verdict.json"


class RankInfo(Record):
    """What one rank ran with: where it was, and the seeds it really used (set after init)."""

    rank: int = Field(description="Global rank.")
    local_rank: int = Field(description="Rank within its node.")
    node: str = Field(description="Hostname of the rank's node.")
    node_rank: int = Field(0, description="The launcher agent (node) that started this rank: torchrun's GROUP_RANK.")
    device: str = Field(description="torch device string, e.g. cpu or cuda:3.")
    device_name: str = Field(description="Human device name (GPU model or CPU).")
    # A --script probe cannot read back the seeds a script gave python and numpy: those are None there,
    # and the seeds audit compares the RNG states themselves instead.
    seed: Optional[int] = Field(None, description="Seed given to python, numpy and torch on this rank.")
    python_seed: Optional[int] = Field(None, description="Seed of python's random module.")
    numpy_seed: Optional[int] = Field(None, description="Seed of numpy's global RNG.")
    torch_seed: Optional[int] = Field(
        None, description="torch.initial_seed() read back after seeding (a script: at its first training forward)."
    )
    sampler_seed: Optional[int] = Field(None, description="The DistributedSampler's seed (data_seed, or the seed).")
    sampler_rank: Optional[int] = Field(None, description="The shard this rank's sampler reads (0 for every rank when replicated).")
    sampler_replicas: Optional[int] = Field(None, description="Shards the sampler splits the data into.")
    precision: str = Field(description="fp32, bf16 autocast (a script: its first training forward's autocast, else its parameters' dtype).")
    gradient_source: Optional[str] = Field(
        None,
        description="Where the monitor read this rank's local gradient: grads (.grad, before DDP's finalize), "
        "comm_hook (DDP's buckets) or reduce_scatter (FSDP2); the same on every rank. None: no monitor yet.",
    )
    versions: dict[str, str] = Field(default_factory=dict, description="python/torch/transformers/cuda versions on this rank.")
    env: dict[str, str] = Field(default_factory=dict, description="NCCL_*/HCCL_*/TORCH_* variables on this rank.")


class Environment(Record):
    python: str
    torch: str
    transformers: str
    healthcheck: str
    platform: str
    device_type: str = Field(description="cpu, cuda or npu.")
    device_reason: str = Field("", description="Why this device type was used (e.g. how device=auto resolved).")
    backend: str = Field(description="Process-group backend.")
    world_size: int
    nnodes: int = Field(description="Launcher agents (nodes) among the ranks, by node_rank.")
    ranks: list[RankInfo] = Field(default_factory=list)


class Timing(Record):
    started_at: str = Field(description="UTC ISO timestamp when the probe command started.")
    finished_at: Optional[str] = Field(None, description="UTC ISO timestamp when the result was written.")
    wall_s: Optional[float] = Field(None, description="Whole probe, start-up included.")
    startup_s: Optional[float] = Field(None, description="From command start to the first training step.")
    train_s: Optional[float] = Field(None, description="The training loop.")
    mean_step_ms: Optional[float] = Field(None, description="Mean wall time per optimizer step.")
    launch_attempts: int = Field(1, ge=1, description="Worker launches; 2 when the first stalled in start-up and the probe relaunched.")
    phases: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds per phase on rank 0: launch (command start to the worker running), rendezvous, "
        "build (data, model, monitor), start_checks, train, finish (the audits' gather).",
    )


class EarlyStop(Record):
    """Why a probe stopped before ``train.steps``: the first decisive failure, the same on every rank."""

    step: int = Field(description="The step whose evidence decided (0 for evidence known before the first step).")
    check: str = Field(description="The audit that decided: data_shards, seeds, environment, param_equality, nonfinite.")
    message: str = Field(description="The audit's one-line message.")
    unavoidable: bool = Field(
        False, description="The ranks could not train past it (a non-finite update, ranks that shard differently): "
        "--no-fail-fast stops there too."
    )
    ranks: list[int] = Field(default_factory=list, description="The ranks the decisive failure names.")

    def headline(self) -> str:
        """``stopped early at step S: <check>``.

        >>> EarlyStop(step=0, check="data_shards", message="ranks 0-7 read the same samples").headline()
        'stopped early at step 0: data_shards'
        """
        return f"stopped early at step {self.step}: {self.check}"


class FailFastPolicy(Record):
    """What the workers stop on (``healthcheck probe`` fails fast unless ``--no-fail-fast``).

    A decisive audit failure stops every rank at the same step, unless the baseline approves exactly
    that deviation (its ``audits`` signatures). A non-finite loss or gradient always stops the run:
    the update has already spread it to every rank.
    """

    enabled: bool = Field(True, description="Stop at the first decisive audit failure.")
    approved: dict[str, str] = Field(default_factory=dict, description="Baseline-approved audit signatures.")


class MetricSummary(Record):
    """One metric over the post-warmup window."""

    median: Optional[float] = None
    p95: Optional[float] = None
    min: Optional[float] = None
    max: Optional[float] = None
    n: int = 0


class RankSummary(Record):
    """One rank's means over the window, with z-scores against the other ranks (attribution)."""

    rank: int
    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    cosine_to_mean: Optional[float] = None
    tokens: Optional[float] = None
    compute_ms: Optional[float] = None
    z_loss: Optional[float] = None
    z_grad_norm: Optional[float] = None
    z_cosine_to_mean: Optional[float] = None
    z_compute_ms: Optional[float] = None


class Standout(Record):
    """One rank persistently off the others on one per-rank quantity (see ``attribution.find_standouts``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    metric: str = Field(description="loss, grad_norm, cosine_to_mean or compute_ms.")
    z: float = Field(description="Leave-one-out z-score of the rank's window mean against the other ranks.")
    same_side_steps: int = Field(description="Window steps in which the rank was off the same way.")
    window_steps: int = Field(description="Window steps compared.")

    def phrase(self) -> str:
        side = "higher" if self.z > 0 else "lower"
        evidence = f" ({side} in {self.same_side_steps}/{self.window_steps} steps)" if self.window_steps else ""
        return f"{self.metric} z={self.z:+.1f}{evidence}"


class NonFiniteEvent(Record):
    rank: int
    step: int
    what: str = Field(description="loss or gradient.")


class RunResult(Record):
    """``result.json``: everything needed to judge, compare and report a probe without re-running it."""

    schema_version: int = RESULT_SCHEMA_VERSION
    name: str
    status: Literal["complete", "incomplete", "interrupted", "running"] = Field(
        description="complete: all steps ran; incomplete: a worker crashed or hung; interrupted: Ctrl-C/SIGTERM."
    )
    failure: Optional[str] = Field(None, description="Why the probe did not complete (rank and step when known).")
    config: ProbeConfig
    config_fingerprint: str
    environment: Optional[Environment] = None
    timing: Timing
    steps_planned: int
    steps_completed: int = 0
    window_start_step: int = Field(0, description="First step counted in the summary (metrics.warmup_steps).")
    window_steps: int = Field(0, description="Sampled steps inside the window.")
    summary: dict[str, MetricSummary] = Field(default_factory=dict, description="Per metric, over the window.")
    per_rank: list[RankSummary] = Field(default_factory=list)
    standouts: list[Standout] = Field(
        default_factory=list, description="Ranks persistently off the others (|z| >= 3 and a sign test over the window)."
    )
    nonfinite: list[NonFiniteEvent] = Field(default_factory=list, description="First non-finite event per rank.")
    audits: dict[str, Any] = Field(default_factory=dict, description="Exact audit results, by audit name.")
    loss_note: Optional[str] = Field(
        None,
        description="Why the per-rank loss was not measured (a script whose loss healthcheck cannot see); "
        "None when it was. The gradient metrics and the audits do not depend on it.",
    )
    gradient_note: Optional[str] = Field(
        None,
        description="What the gradient metrics describe where it is not each rank's own step gradient (a script "
        "that all-reduces every micro-batch); None where it is.",
    )
    stopped_early: Optional[EarlyStop] = Field(
        None, description="Set when the probe stopped at a decisive failure before train.steps (fail fast)."
    )


# --------------------------------------------------------------------------- run directory


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def default_run_dir(name: str, root: Path = Path("runs")) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return root / f"{name}-{stamp}"


def prepare_run_dir(path: Path) -> Path:
    """Create the run directory and prove it is writable, or fail with exit 2 before any worker starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise InvalidInput(f"--out {path}: directory is not writable ({exc.strerror or exc})") from None
    try:
        # Claim the directory atomically: of two probes given the same --out, exactly one wins.
        with open(path / RESULT_FILE, "x", encoding="utf-8") as claim:
            claim.write("{}\n")
    except FileExistsError:
        raise InvalidInput(f"--out {path}: already holds a probe run; choose an empty directory") from None
    except OSError as exc:
        raise InvalidInput(f"--out {path}: directory is not writable ({exc.strerror or exc})") from None
    return path


def write_result(run_dir: Path, result: RunResult) -> None:
    write_text_atomic(run_dir / RESULT_FILE, result.model_dump_json(indent=2) + "\n")


def load_result(run_dir: Path) -> RunResult:
    """Read ``RUN_DIR/result.json`` or fail with a one-line error (exit 2)."""
    return read_model_file(Path(run_dir) / RESULT_FILE, RunResult, f"is {run_dir} a healthcheck run directory?")


# --------------------------------------------------------------------------- between processes


class SamplerPlan(Record):
    """How a DistributedSampler splits the data on one rank: enough to rebuild the order it yields."""

    seed: int
    num_replicas: int
    rank: int
    shuffle: bool
    drop_last: bool
    dataset_size: int = Field(ge=0)


class RankEvidence(Record):
    """One rank's audit evidence, gathered from every rank when the loop ends."""

    consumed: list[tuple[int, list[int]]] = Field(
        default_factory=list, description="(epoch, sample ids) of every micro-batch the rank trained on, in order."
    )
    rng: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="moment (rng_start, rng_after_first_step) -> generator -> state hash."
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Scalars the environment audit compares.")
    sampler: Optional[SamplerPlan] = Field(None, description="The DistributedSampler this rank read through, if any.")
    shard_source: str = Field("sampler", description="What sharded the data: sampler (a DistributedSampler), loader "
                              "(another sampler, e.g. accelerate's BatchSamplerShard), forward (no DataLoader: contents are the "
                              "inputs of each step's first forward) or none.")
    contents: list[tuple[int, list[int]]] = Field(default_factory=list, description="--script: (epoch, a 63-bit hash of each "
                                                  "sample) of every batch the training loader yielded (.sample_hashes).")
    loss_problem: Optional[str] = Field(None, description="Why this rank's loss was not measured at some step, if so.")
    dataset_size: Optional[int] = Field(None, ge=0, description="--script: samples in the training loader's dataset (None: no length).")
    dataset_digest: Optional[str] = Field(None, description="--script: length and a hash of 32 evenly spaced samples of that dataset.")
    batch_facts: dict[str, str] = Field(
        default_factory=dict,
        description="--script: what the training loader's collate_fn makes of the dataset's first, middle and last "
        "samples, per field of the batch (dtype, shape, hash); empty where it could not be made reproducibly.",
    )
    hints: dict[str, str] = Field(
        default_factory=dict,
        description="--script: the hooks on the model's modules at the first training forward (hooks.<type>), never "
        "judged: they only explain a replay difference (healthcheck.measure.module_hooks).",
    )


class ShardedEvidence(Record):
    """FSDP2's replacement for replica equality: what every rank must still agree on when parameters are sharded.

    Each list holds one entry per rank, in rank order.
    """

    plans: list[str] = Field(description="Digest of each rank's sharding plan (names, global shapes, dtypes, placements).")
    plan_tensors: int = Field(0, ge=0, description="Sharded parameter tensors in the plan.")
    pre_shard_names: list[str] = Field(default_factory=list, description="Parameters hashed before fully_shard, in order.")
    pre_shard_hashes: list[list[int]] = Field(
        default_factory=list, description="Bit hashes of each rank's own weights before fully_shard sliced them."
    )
    start_hashes: list[list[int]] = Field(default_factory=list, description="Full-parameter bit hashes after sharding.")
    end_hashes: list[list[int]] = Field(default_factory=list, description="Full-parameter bit hashes after the last step.")
    optimizer_checks: list[tuple[int, list[dict[str, Any]]]] = Field(
        default_factory=list, description="(step, each rank's optimizer settings and step count) at every check."
    )
    shard_index: list[int] = Field(
        default_factory=list,
        description="HSDP: each rank's coordinate on the mesh's shard dimension (ranks with the same one are replicas "
        "of one shard); empty on a one-dimensional mesh.",
    )
    end_local_hashes: list[list[int]] = Field(
        default_factory=list, description="HSDP: bit hashes of each rank's own shard of every parameter after the last step."
    )


class ReplayDifference(Record):
    """How far one rank's replayed gradient is from a rank of its device group's majority (exact, float64)."""

    rank: int = Field(description="The rank whose replay disagreed.")
    reference_rank: int = Field(description="The majority rank it was measured against.")
    max_abs: float = Field(description="Max |Δ| over every gradient element.")
    rel_l2: float = Field(description="‖Δ‖ / ‖g_reference‖ over the whole gradient.")
    first_tensor: str = Field("", description="The first parameter (in module order) whose gradient differs.")
    reproduced: bool = Field(description="Whether a second replay on this rank disagreed again (persistent, not transient).")
    repeat_rel_l2: float = Field(description="The second replay's relative L2 difference from the same reference.")


class ReplayRound(Record):
    """One replay: every rank computed the gradient of one micro-batch from the same parameters."""

    step: int = Field(description="Replayed before this training step, on the parameters it starts from.")
    source_rank: int = Field(description="The rank whose micro-batch every rank replayed (broadcast).")
    groups: list[list[int]] = Field(description="Ranks grouped by replayed gradient within each device group, largest first.")
    params_agree: bool = Field(True, description="Whether every rank replayed from bit-identical parameters.")
    differences: list[ReplayDifference] = Field(default_factory=list, description="One per rank outside its device group's majority.")
    no_majority: list[list[int]] = Field(default_factory=list, description="Device groups whose ranks split with no strict majority.")
    seconds: float = Field(0.0, description="Wall time of the round on rank 0 (replay, fingerprints, comparisons).")


class ReplayEvidence(Record):
    """The replay audit's evidence: how replays were compared, and every round (identical on every rank)."""

    mode: Literal["bitwise", "tolerance"] = Field(description="bitwise: equal bits required; tolerance: a measured relative L2 bound.")
    mode_reason: str = Field(description="Why this mode: what determinism the backend and settings give.")
    tolerance: float = Field(0.0, ge=0, description="Tolerance mode: the relative L2 bound, from repeat replays on each rank.")
    repeat_spread: list[float] = Field(default_factory=list, description="Tolerance mode: each rank's relative L2 between two repeats.")
    device_groups: list[list[int]] = Field(
        default_factory=list, description="Ranks grouped by device name; replays are compared within a group."
    )
    every: int = Field(0, ge=0, description="metrics.replay_every.")
    rounds: list[ReplayRound] = Field(default_factory=list)
    unavailable: Optional[str] = Field(None, description="Why no replay could run (no training forward before the first step; FSDP2).")


class AuditEvidence(Record):
    """Everything the exact audits need, as rank 0 holds it after the last step."""

    per_rank: list[RankEvidence] = Field(description="Each rank's evidence, in rank order.")
    param_checks: list[tuple[int, list[list[int]]]] = Field(
        default_factory=list, description="(step, hashes[rank][tensor]) of every parameter check."
    )
    param_names: list[str] = Field(default_factory=list, description="Parameter tensor names, in hash column order.")
    param_drift: list[tuple[int, list[float]]] = Field(
        default_factory=list, description="(step, each rank's relative distance from the mean parameters) where hashes differed."
    )
    plan_samples: int = Field(0, ge=0, description="Samples in the data set the shared shard plan splits.")
    sharded: Optional[ShardedEvidence] = Field(None, description="FSDP2 runs: the sharded-state evidence.")
    replay: Optional[ReplayEvidence] = Field(None, description="The replay audit's evidence (None when no replay ran).")
    scaler_overflows: list[tuple[int, list[int]]] = Field(
        default_factory=list,
        description="--script: (step, ranks whose local gradient was non-finite) of each step whose update every "
        "rank's GradScaler skipped in part (one of several optimizers): not measured, no row.",
    )


class WorkerReport(Record):
    """What rank 0's worker returns to the launcher: how the run went and the audit evidence."""

    evidence: AuditEvidence
    ranks: list[RankInfo] = Field(description="Every rank's RankInfo, gathered at start-up.")
    device_type: str
    device_reason: str = ""
    backend: str
    world_size: int
    startup_s: float = Field(description="From command start to the first training step.")
    train_s: float = Field(description="The training loop.")
    steps_completed: int
    stopped_early: Optional[EarlyStop] = Field(None, description="Why the loop stopped before train.steps, if it did.")
    phases: dict[str, float] = Field(default_factory=dict, description="Seconds per start-up and run phase (Timing.phases).")


class WorkerFailure(Record):
    """``errors/rank-<r>.json``: why one worker failed, for the launcher to name the rank and step."""

    rank: int
    step: Optional[int] = Field(None, description="The step in progress; None when it failed during start-up.")
    reason: str = Field(description="One line: the exception's type and message.")
    time: float = Field(description="time.time() when it failed; the earliest report is the likely cause.")
    exit_code: int = Field(3, description="2 when the worker rejected its input, else 3.")
    raised_in: Optional[str] = Field(
        None, description="``healthcheck/<module>.py:<line>`` where an unexpected error was raised by healthcheck's own "
        "code (a hook inside the script's training): a healthcheck bug, not the script's; None otherwise."
    )

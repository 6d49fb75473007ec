"""The run directory: its layout, the typed ``result.json`` and the ``*.jsonl`` step records.

Layout of ``runs/<name>-<UTC timestamp>/`` (or ``--out DIR``)::

    config.yaml        the resolved config, re-usable with --config
    steps.jsonl        one row per (sampled step, rank): loss, tokens, grad_norm, cosine_to_mean, compute_ms
    aggregates.jsonl   one row per sampled step: the dispersion/cosine aggregates and the pairwise matrix
    result.json        RunResult: config, environment, seeds per rank, timing, window summary, status
    verdict.json       the findings of the last judgement against a baseline (when there was one)

Rows are appended and flushed as the probe runs, so a crashed probe still leaves what it measured.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from healthcheck.config import ProbeConfig, format_validation_error
from healthcheck.errors import InvalidInput
from healthcheck.metrics import json_safe

RESULT_SCHEMA_VERSION = 1

STEPS_FILE = "steps.jsonl"
AGGREGATES_FILE = "aggregates.jsonl"
RESULT_FILE = "result.json"
CONFIG_FILE = "config.yaml"
VERDICT_FILE = "verdict.json"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RankInfo(_Model):
    """What one rank ran with: where it was, and the seeds it really used (set after init)."""

    rank: int = Field(description="Global rank.")
    local_rank: int = Field(description="Rank within its node.")
    node: str = Field(description="Hostname of the rank's node.")
    node_rank: int = Field(0, description="The launcher agent (node) that started this rank: torchrun's GROUP_RANK.")
    device: str = Field(description="torch device string, e.g. cpu or cuda:3.")
    device_name: str = Field(description="Human device name (GPU model or CPU).")
    seed: int = Field(description="Seed given to python, numpy and torch on this rank.")
    python_seed: int = Field(description="Seed of python's random module.")
    numpy_seed: int = Field(description="Seed of numpy's global RNG.")
    torch_seed: int = Field(description="torch.initial_seed() read back after seeding.")
    sampler_seed: int = Field(description="The DistributedSampler's seed (data_seed, or the seed).")
    sampler_rank: int = Field(description="The shard this rank's sampler reads (0 for every rank when replicated).")
    sampler_replicas: int = Field(description="Shards the sampler splits the data into.")
    precision: str = Field(description="fp32 or bf16 autocast, as this rank trained.")
    versions: dict[str, str] = Field(default_factory=dict, description="python/torch/transformers/cuda versions on this rank.")
    env: dict[str, str] = Field(default_factory=dict, description="NCCL_*/HCCL_*/TORCH_* variables on this rank.")


class Environment(_Model):
    python: str
    torch: str
    transformers: str
    healthcheck: str
    platform: str
    device_type: str = Field(description="cpu, cuda or npu.")
    backend: str = Field(description="Process-group backend.")
    world_size: int
    nnodes: int = Field(description="Launcher agents (nodes) among the ranks, by node_rank.")
    ranks: list[RankInfo] = Field(default_factory=list)


class Timing(_Model):
    started_at: str = Field(description="UTC ISO timestamp when the probe command started.")
    finished_at: Optional[str] = Field(None, description="UTC ISO timestamp when the result was written.")
    wall_s: Optional[float] = Field(None, description="Whole probe, start-up included.")
    startup_s: Optional[float] = Field(None, description="From command start to the first training step.")
    train_s: Optional[float] = Field(None, description="The training loop.")
    mean_step_ms: Optional[float] = Field(None, description="Mean wall time per optimizer step.")
    launch_attempts: int = Field(
        1, ge=1, description="Worker launches; 2 when the first stalled in start-up and the probe relaunched."
    )


class MetricSummary(_Model):
    """One metric over the post-warmup window."""

    median: Optional[float] = None
    p95: Optional[float] = None
    min: Optional[float] = None
    max: Optional[float] = None
    n: int = 0


class RankSummary(_Model):
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


class Standout(_Model):
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


class NonFiniteEvent(_Model):
    rank: int
    step: int
    what: str = Field(description="loss or gradient.")


class RunResult(_Model):
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


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_result(run_dir: Path, result: RunResult) -> None:
    write_text_atomic(run_dir / RESULT_FILE, result.model_dump_json(indent=2) + "\n")


def read_model_file(path: Path, model: type[BaseModel], missing: str):
    """Validate a JSON artifact as ``model``, or fail with one line naming the file (exit 2).

    ``missing`` says what a missing file means for this artifact.
    """
    try:
        return model.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise InvalidInput(f"{path}: not found; {missing}") from None
    except ValidationError as exc:
        raise InvalidInput(format_validation_error(exc, str(path))) from None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot read ({exc.strerror or exc})") from None


def load_result(run_dir: Path) -> RunResult:
    """Read ``RUN_DIR/result.json`` or fail with a one-line error (exit 2)."""
    return read_model_file(
        Path(run_dir) / RESULT_FILE, RunResult, f"is {run_dir} a healthcheck run directory?"
    )


class JsonlWriter:
    """Append-only JSON lines, flushed per row so a crash keeps every finished step."""

    def __init__(self, path: Path):
        self.path = path
        self._handle = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._handle.write(json.dumps(json_safe(row), separators=(",", ":")) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSON-lines file; a torn last line (crash mid-write) is skipped, not fatal."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue

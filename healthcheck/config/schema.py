"""The probe's typed configuration: the pydantic sections, and how a rank resolves its own config.

Defaults live here, once: ``ProbeConfig()`` *is* the embedded default probe (a tiny GPT-2 on built-in
synthetic alpaca data, 8 CPU workers). Errors name the file and the field::

    >>> from pydantic import ValidationError
    >>> from healthcheck.typed import format_validation_error
    >>> try:
    ...     ProbeConfig.model_validate({"train": {"steps": "many"}})
    ... except ValidationError as exc:
    ...     print(format_validation_error(exc, "probe.yaml"))
    probe.yaml: train.steps: Input should be a valid integer, unable to parse string as an integer (got 'many')
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, ValidationError, field_validator, model_validator

from healthcheck.config.faults import FaultConfig
from healthcheck.config.merging import deep_merge
from healthcheck.config.names import NAME_PATTERN, script_probe_name
from healthcheck.config.script import ScriptConfig
from healthcheck.config.section import Section as _Section
from healthcheck.typed import field_path

#: Offset added to rank 0's seed under ``seed_policy: rank0_differs``. With the default seed 42 rank 0
#: gets 1041, the value the S1-2 setting of arXiv 2602.14462 used.
RANK0_SEED_OFFSET = 999

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)



class ModelConfig(_Section):
    """Which causal LM to fine-tune."""

    name: str = Field(
        "tiny-gpt2",
        description=(
            "A built-in preset (tiny-gpt2, tiny-llama, small-gpt2, llama-1b; random init, no download), "
            "a local Hugging Face model directory (a path), or a hub id of the form org/name."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description=(
            "Dtype of the model weights (and so of the gradient buckets): float32 or bfloat16. float16 is refused: "
            "the probe's AdamW cannot train fp16 weights (for fp16 mixed precision, probe your own loop with --script)."
        ),
    )
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the model directory. Never turned on implicitly.")

    @field_validator("dtype")
    @classmethod
    def _trainable(cls, value: str) -> str:
        # AdamW keeps its state in the weights' dtype. In fp16 its eps (1e-8) and the square of any gradient under
        # 2.4e-4 are 0, so the first update divides by 0: the default probe went non-finite on every rank at step 1.
        # torch's GradScaler refuses fp16 gradients, and fp16 training is autocast over fp32 weights anyway.
        if value == "float16":
            raise ValueError(
                "float16 weights cannot train under the probe's AdamW (eps 1e-8 and small gradients' squares are 0 in "
                "fp16: the first update is inf); use bfloat16, or --script with your own fp16 mixed-precision loop"
            )
        return value


class DataConfig(_Section):
    """Where the instruction data comes from and how it becomes labelled token sequences."""

    source: Literal["synthetic", "json", "datasets"] = Field(
        "synthetic",
        description=(
            "synthetic: built-in deterministic alpaca-format data; json: an alpaca JSON list or JSONL file at "
            "`path`; datasets: `datasets.load_dataset` on a local parquet/JSON file or directory at `path`, "
            "or a hub dataset name."
        ),
    )
    path: Optional[str] = Field(None, description="File, directory or dataset name for source json/datasets.")
    split: str = Field("train", description="Dataset split for source datasets.")
    synthetic_samples: int = Field(4096, ge=16, description="Rows generated for source synthetic.")
    max_samples: Optional[int] = Field(None, ge=1, description="Use only the first N rows (None: all).")
    prompt_template: str = Field(ALPACA_PROMPT, description="Prompt for rows with an input; uses {instruction}, {input}.")
    prompt_template_no_input: str = Field(ALPACA_PROMPT_NO_INPUT, description="Prompt for rows with an empty input; uses {instruction}.")
    response_only_loss: bool = Field(True, description="Mask prompt and padding tokens to -100 so only response tokens carry loss.")
    max_length: int = Field(1024, ge=8, description="Truncate prompt+response to this many tokens.")
    sharding: Literal["distributed", "replicated"] = Field(
        "distributed",
        description="distributed: each rank reads its own shard (DistributedSampler); replicated: every rank "
        "reads the same samples (a collapsed effective batch; used to test the guard).",
    )

    @model_validator(mode="after")
    def _path_matches_source(self) -> "DataConfig":
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"path is required when source is {self.source!r}")
        return self

    @field_validator("prompt_template")
    @classmethod
    def _template_fields(cls, value: str) -> str:
        if "{instruction}" not in value:
            raise ValueError("must contain {instruction}")
        return value


class TrainConfig(_Section):
    """The training step under test."""

    steps: int = Field(60, ge=1, le=100_000, description="Optimizer steps in the probe.")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per rank per micro-step.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step (no_sync on all but the last).")
    lr: float = Field(1e-3, gt=0, le=10.0, description="AdamW peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    lr_warmup_steps: int = Field(5, ge=0, description="Linear learning-rate warmup steps.")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="Clip the all-reduced gradient norm (None: off).")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="fp32, or bf16 autocast for forward/backward.")
    seed: int = Field(42, ge=0, lt=2**32, description="Seed for python, numpy and torch (dropout, init).")
    data_seed: Optional[int] = Field(
        None, ge=0, lt=2**32, description="Sampler shuffle seed; None follows this rank's effective `seed`, as transformers' Trainer does."
    )
    shuffle: bool = Field(True, description="Shuffle the sampler order each epoch.")
    set_epoch: bool = Field(True, description="Call sampler.set_epoch at each epoch boundary (False reproduces the missing-set_epoch bug).")
    loss_scale: float = Field(
        1.0, gt=0, description="Multiply this rank's loss before backward (≠1 models a gradient-accumulation normalisation mismatch)."
    )


class DistributedConfig(_Section):
    """How the workers are laid out and talk to each other."""

    nproc: int = Field(8, description="Workers on this node when healthcheck launches them itself (>= 2).")
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="auto: cuda with one GPU per local worker, else cpu. npu is used only when asked for."
    )
    backend: Literal["auto", "gloo", "nccl", "hccl"] = Field("auto", description="auto maps cpu→gloo, cuda→nccl, npu→hccl.")
    timeout_s: float = Field(
        300.0, gt=0, le=86_400, description="Collective timeout, and the watchdog's limit on a probe making no progress."
    )
    startup_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="Limit from launch until every worker has joined the process group. A worker that misses it "
        "is stuck before training (nothing was measured yet), so the probe relaunches once, then fails with exit 3.",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: DistributedDataParallel replicas. fsdp: FSDP2 (fully_shard) on every transformer block "
        "and the root, as the torchtitan and accelerate recipes shard; its baseline is baselines/<name>-fsdp.json.",
    )
    replicas: int = Field(
        1,
        ge=1,
        description="fsdp only: HSDP, this many replicas of a shard group of world/replicas ranks (torchtitan's "
        "data_parallel_replicate_degree; FSDP2 within a node and replicas across nodes is the usual layout). "
        "Measured in sketch mode; its baseline is baselines/<name>-hsdp.json.",
    )
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size.")
    gradient_as_bucket_view: bool = Field(False, description="DDP gradient_as_bucket_view.")

    @field_validator("nproc")
    @classmethod
    def _at_least_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(f"must be >= 2 to measure worker consistency, got {value}")
        return value


class MetricsConfig(_Section):
    """What the monitor measures."""

    warmup_steps: int = Field(10, ge=0, description="Steps excluded from the window statistics.")
    every: int = Field(1, ge=1, description="Sample the metrics every k-th step.")
    direction: Literal["exact", "sketch"] = Field(
        "sketch",
        description="Pairwise cosine: exact Gram matrix, or a folded count sketch of p dims (p the largest "
        "prime <= sketch_dim that divides no tensor dimension).",
    )
    sketch_dim: int = Field(4096, ge=16, le=1 << 20, description="Sketch dimension k for direction=sketch.")
    local_from: Literal["auto", "buckets", "grads"] = Field(
        "auto", description="Where DDP's sketch mode reads each rank's local gradient: `buckets` (a comm hook per bucket), "
        "`grads` (.grad once a step, by an autograd callback before DDP's finalize; DDP keeps its own all-reduce; sketch "
        "mode) or `auto` (grads on CUDA where it can run, else buckets; every rank alike). FSDP2 takes auto.",
    )
    exact_keep_microbatches: bool = Field(
        False,
        description="FSDP2, direction=exact: keep every rank's slices of each micro-batch's reduce-scatter (one unsharded "
        "fp32 gradient per rank), so a loop that reduce-scatters every micro-batch of gradient accumulation (FSDP2's "
        "default, the Trainer's and accelerate's) is measured exactly. DDP ignores it.",
    )
    param_check_every: int = Field(
        10,
        ge=1,
        description="Hash every rank's parameters bit for bit after every k-th optimizer step (from step 0) "
        "and after the last one, and compare them (the param_equality audit).",
    )
    reduction_check_every: int = Field(
        10,
        ge=0,
        description="Compare the all-reduced gradient with a float64 mean of the gathered local gradients "
        "every k-th step (0: never); a multiple of `every`. Costs one chunked gather of the gradients per check.",
    )
    straggler_factor: float = Field(
        1.035,
        gt=1,
        description="The tolerance: a rank is a straggler when its step time divided by the other ranks' median "
        "is above this in significantly more than half the steps (straggler_max_p). A rank whose typical ratio is at "
        "most this is within tolerance. On GPUs, whose clocks differ by a few percent, 1.1 avoids flagging healthy "
        "devices.",
    )
    straggler_max_p: float = Field(
        1e-4,
        gt=0,
        lt=1,
        description="Persistence: a straggler must be above straggler_factor in so many steps that a rank "
        "within the tolerance does that with probability <= this (one-sided sign test): the false-alarm rate "
        "per rank, with independent steps.",
    )

    replay_every: int = Field(
        15,
        ge=0,
        description="The replay audit: before the first step and every k-th step, every rank computes the gradient of "
        "the same micro-batch from the same parameters, and a rank that disagrees is named (0: never). One extra "
        "forward and backward per replay.",
    )
    rank_outlier_max_p: float = Field(
        1e-6,
        gt=0,
        lt=1,
        description="The rank_outliers audit names a rank that holds the highest or lowest loss, "
        "gradient norm, cosine to the mean or token count in so many steps that ranks reading shards of one dataset "
        "would do so with probability <= this (binomial, 1/N per step); 8 x N x this bounds its false alarms.",
    )
    spike_max_p: float = Field(
        0.01, gt=0, lt=1, description="The spikes audit's false-alarm rate per clean probe (Bonferroni, Student t3 tails)."
    )

    @model_validator(mode="after")
    def _settings_fit(self) -> "MetricsConfig":
        # The reduction check rides on the monitor's per-step gather, which runs on sampled steps only.
        if self.reduction_check_every % self.every:
            raise ValueError(f"reduction_check_every: must be 0 or a multiple of every ({self.every}), got {self.reduction_check_every}")
        if self.exact_keep_microbatches and self.direction != "exact":
            raise ValueError("exact_keep_microbatches: applies to direction=exact (sketch mode adds the micro-batches' sketches)")
        return self


#: Sections a rank override may change; the layout (distributed) and measurement (metrics) are global.
OVERRIDABLE_SECTIONS = ("model", "data", "train", "faults")
#: What a --script probe can still apply: the script builds its own model, data, optimizer and DDP.
SCRIPT_FIELDS = {
    "train": ("steps", "seed"),
    "distributed": ("nproc", "device", "backend", "timeout_s", "startup_timeout_s"),
    "faults": (
        "grad_noise_std",
        "step_sleep_ms",
        "matmul_error",
        "matmul_error_from_step",
        "crash_at_step",
        "crash_mode",
        "hang_at_step",
        "startup_hang_launches",
    ),
}
#: Sections a --script probe ignores entirely.
BUILTIN_ONLY_SECTIONS = ("model", "data")


class ProbeConfig(_Section):
    """A whole probe. ``ProbeConfig()`` is the embedded default."""

    name: str = Field("default", pattern=NAME_PATTERN, description="Probe name: run directory and baseline file name.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The model under test.")
    data: DataConfig = Field(default_factory=DataConfig, description="The data pipeline under test.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The training step under test.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="Worker layout.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Measurement settings.")
    faults: FaultConfig = Field(default_factory=FaultConfig, description="Fault injection (off by default).")
    seed_policy: Literal["shared", "rank0_differs", "per_rank"] = Field(
        "shared",
        description="shared (S1-1): every rank uses train.seed; rank0_differs (S1-2): rank 0 uses "
        f"seed+{RANK0_SEED_OFFSET}; per_rank (S1-3): rank r uses seed+r.",
    )
    rank_overrides: dict[int, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per-rank partial config, e.g. {0: {train: {seed: 1041}}}; sections: " + ", ".join(OVERRIDABLE_SECTIONS) + ".",
    )
    baseline: Optional[str] = Field(None, description="Baseline file; None: baselines/<name>.json.")
    script: Optional[ScriptConfig] = Field(
        None, description="Probe this training script instead of the built-in trainer (None: the built-in probe)."
    )

    @model_validator(mode="after")
    def _check_script_mode(self) -> "ProbeConfig":
        if self.script is None:
            return self
        unusable = builtin_only_fields(self)
        if unusable:
            raise ValueError(
                f"script: {', '.join(unusable)} configure the built-in probe and cannot apply to a --script probe "
                "(the script builds its own model, data, optimizer and DDP); remove them"
            )
        if "name" not in self.model_fields_set:
            # Named for its script: its baseline (baselines/<name>.json) and run directories never take the built-in
            # probe's "default". Set past validate_assignment, which would run this validator again.
            self.__dict__["name"] = script_probe_name(self.script.path or str(self.script.module).replace(".", "/"))
        return self

    @model_validator(mode="after")
    def _check_replicas(self) -> "ProbeConfig":
        replicas = self.distributed.replicas
        if replicas > 1 and self.distributed.strategy != "fsdp":
            raise ValueError(f"distributed.replicas: {replicas} replicas is HSDP, a layout of distributed.strategy=fsdp")
        if replicas > 1 and self.metrics.direction != "sketch":
            raise ValueError("distributed.replicas: HSDP is measured in sketch mode (metrics.direction=sketch): the "
                             "cross-replica dot products of exact mode would need a gradient-sized exchange")
        if self.script is None and self.distributed.nproc % replicas:
            raise ValueError(f"distributed.replicas: {replicas} does not divide distributed.nproc={self.distributed.nproc}")
        return self

    @model_validator(mode="after")
    def _check_local_from(self) -> "ProbeConfig":
        # What the config decides; a --script probe's own model may still refuse it (exit 2 when the script builds it).
        chosen, problem = self.metrics.local_from, ""
        if chosen != "auto" and self.distributed.strategy == "fsdp":
            problem = "chooses how DDP is read; distributed.strategy=fsdp takes 'auto'"
        elif chosen == "grads" and self.metrics.direction != "sketch":
            problem = "is for sketch mode; metrics.direction=exact reads each bucket in the comm hook"
        elif chosen == "grads" and self.script is None and self.distributed.gradient_as_bucket_view:
            problem = "cannot read .grad with distributed.gradient_as_bucket_view (it is the bucket DDP averages)"
        if problem:
            raise ValueError(f"metrics.local_from: {chosen!r} {problem}")
        return self

    @model_validator(mode="after")
    def _check_rank_overrides(self) -> "ProbeConfig":
        for rank, override in self.rank_overrides.items():
            if rank < 0 or rank >= self.distributed.nproc:
                raise ValueError(f"rank_overrides: rank {rank} is outside the world (nproc={self.distributed.nproc})")
            bad = sorted(map(str, set(override) - set(OVERRIDABLE_SECTIONS)))
            if bad:
                raise ValueError(
                    f"rank_overrides.{rank}: cannot override {field_path(bad).replace('.', ', ')} "
                    f"(allowed: {', '.join(OVERRIDABLE_SECTIONS)})"
                )
            _validate_override(self, rank, override)
        return self

    def baseline_path(self) -> Path:
        """``baseline``, else ``baselines/<name>.json`` (``<name>-fsdp.json`` when sharded: other envelopes)."""
        if self.baseline:
            return Path(self.baseline)
        suffix = {"ddp": ""}.get(self.distributed.strategy, "-hsdp" if self.distributed.replicas > 1 else "-fsdp")
        return Path("baselines") / f"{self.name}{suffix}.json"

    def fingerprint(self) -> str:
        """Short stable hash of the resolved config (for baselines and reports)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def builtin_only_fields(config: ProbeConfig) -> list[str]:
    """The fields a --script probe cannot apply that ``config`` sets away from their defaults.

    Compared by value, not by what the file spelled out, so a full ``config show`` dump or a
    ``result.json`` snapshot (every field present, unused ones at their defaults) still loads.

    >>> builtin_only_fields(ProbeConfig(train={"lr": 0.1, "steps": 5}, data={"max_length": 64}))
    ['data.max_length', 'train.lr']
    """
    default = ProbeConfig()
    out = []
    for section in ("model", "data", "train", "distributed", "faults"):
        current, reference = getattr(config, section), getattr(default, section)
        allowed = () if section in BUILTIN_ONLY_SECTIONS else SCRIPT_FIELDS[section]
        out += [
            f"{section}.{name}"
            for name in type(current).model_fields
            if name not in allowed and getattr(current, name) != getattr(reference, name)
        ]
    if config.seed_policy != default.seed_policy:
        out.append("seed_policy")
    for rank, override in sorted(config.rank_overrides.items()):
        out += [f"rank_overrides.{rank}.{section}" for section in sorted(map(str, override)) if section != "faults"]
        out += [
            f"rank_overrides.{rank}.faults.{name}"
            for name in sorted(map(str, override.get("faults") or {}))
            if name not in SCRIPT_FIELDS["faults"]
        ]
    return sorted(out)


def _validate_override(config: ProbeConfig, rank: int, override: dict[str, Any]) -> None:
    merged = deep_merge(config.model_dump(exclude={"rank_overrides"}), override)
    try:
        ProbeConfig.model_validate(merged)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = field_path(first["loc"])
        msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
        raise ValueError(f"rank_overrides.{rank}.{loc}: {msg}") from None

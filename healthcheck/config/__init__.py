"""The probe's configuration: typed sections (:mod:`.schema`), how a file becomes one (:mod:`.loading`)
and how a rank resolves its own (:mod:`.per_rank`)."""

from healthcheck.config.loading import apply_set, dump_yaml, json_schema, load_config, parse_set, read_yaml_mapping
from healthcheck.config.per_rank import effective_seed, resolve_for_rank
from healthcheck.config.schema import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    NAME_PATTERN,
    OVERRIDABLE_SECTIONS,
    RANK0_SEED_OFFSET,
    DataConfig,
    DistributedConfig,
    FaultConfig,
    MetricsConfig,
    ModelConfig,
    ProbeConfig,
    ScriptConfig,
    TrainConfig,
    builtin_only_fields,
    deep_merge,
)

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "NAME_PATTERN",
    "OVERRIDABLE_SECTIONS",
    "RANK0_SEED_OFFSET",
    "DataConfig",
    "DistributedConfig",
    "FaultConfig",
    "MetricsConfig",
    "ModelConfig",
    "ProbeConfig",
    "ScriptConfig",
    "TrainConfig",
    "builtin_only_fields",
    "apply_set",
    "deep_merge",
    "dump_yaml",
    "effective_seed",
    "json_schema",
    "load_config",
    "parse_set",
    "read_yaml_mapping",
    "resolve_for_rank",
]

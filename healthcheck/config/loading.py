"""Loading a probe config: the YAML file (or the embedded default), ``--set`` overrides, one validation.

>>> load_config(None, ["train.steps=20"]).train.steps
20
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from healthcheck.config.schema import ProbeConfig
from healthcheck.errors import ConfigError, one_line
from healthcheck.files import read_text
from healthcheck.typed import format_validation_error


def parse_set(expr: str) -> tuple[list[str], Any]:
    """Split ``--set a.b.c=value`` into its key path and YAML-parsed value.

    >>> parse_set("train.steps=20")
    (['train', 'steps'], 20)
    >>> parse_set("rank_overrides={0: {train: {lr: 0.01}}}")
    (['rank_overrides'], {0: {'train': {'lr': 0.01}}})
    """
    key, sep, raw = expr.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"--set {expr}: expected key.path=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {expr}: value is not valid YAML ({one_line(exc)})") from None
    return key.strip().split("."), value


def apply_set(data: dict[str, Any], expr: str) -> dict[str, Any]:
    """Apply one ``--set`` to a raw config mapping (validation happens afterwards, on the whole)."""
    path, value = parse_set(expr)
    node = data
    for part in path[:-1]:
        key: Any = int(part) if part.isdigit() else part
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {expr}: {part} is not a section")
        node = child
    last: Any = int(path[-1]) if path[-1].isdigit() else path[-1]
    node[last] = value
    return data


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Load a YAML file safely (no object tags) and insist on a mapping at the top."""
    text = read_text(path, missing=f"{path}: config file not found", unreadable=f"{path}: cannot read config", error=ConfigError)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({one_line(exc)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections at the top level, got {type(data).__name__}")
    return data


def load_config(
    path: str | Path | None = None,
    sets: list[str] | tuple[str, ...] = (),
    *,
    script: Optional[str] = None,
    script_args: Optional[list[str]] = None,
    module: bool = False,
) -> ProbeConfig:
    """Load the config file (or the embedded default), apply ``--set`` overrides, then ``--script PATH`` (a module's
    name with ``module``: ``--script NAME -m``) and the script's arguments (what follows ``--``), and validate once."""
    source = str(path) if path else "default config"
    data = read_yaml_mapping(Path(path)) if path else {}
    for expr in sets:
        data = apply_set(data, expr)
    if sets:
        source += " (with --set " + ", ".join(sets) + ")"
    if script is not None or script_args is not None:
        section = data.get("script")
        section = dict(section) if isinstance(section, dict) else {}
        if script is not None:
            section.pop("module" if not module else "path", None)  # the command line's choice replaces the file's
            section["module" if module else "path"] = script
            source += f" (with --script {script}{' -m' if module else ''})"
        if script_args is not None:
            section["args"] = list(script_args)
        data["script"] = section
    try:
        return ProbeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
    except (TypeError, ValueError, RecursionError) as exc:  # e.g. non-string mapping keys from odd YAML
        raise ConfigError(f"{source}: {one_line(exc)}") from None


def dump_yaml(config: ProbeConfig) -> str:
    """The fully resolved config as YAML that ``--config`` accepts back."""
    # python mode keeps rank_overrides keys as ints (json mode would quote them).
    return yaml.safe_dump(config.model_dump(), sort_keys=False, allow_unicode=True, width=100)


def json_schema() -> dict[str, Any]:
    """The config's JSON Schema (``healthcheck config schema``), for editor autocompletion."""
    return ProbeConfig.model_json_schema()

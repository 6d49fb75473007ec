"""The two pydantic bases every persisted or inter-process record derives from, and the one
formatter that turns a validation error into one line.

``Record`` refuses unknown keys (a typo in a hand-edited file is an error, not a silent default);
``FiniteRecord`` also refuses NaN and ±Inf, which ``json.loads`` accepts and which must never
slip into a bound or a fitted value.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from pydantic import BaseModel, ConfigDict, ValidationError


class Record(BaseModel):
    """A typed record: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")


class FiniteRecord(BaseModel):
    """A typed record whose floats must be finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line: ``source: field.path: message (got value)`` for each error, joined by ``; ``.

    >>> class Train(Record):
    ...     steps: int
    >>> try:
    ...     Train.model_validate({"steps": "many"})
    ... except ValidationError as exc:
    ...     print(format_validation_error(exc, "probe.yaml"))
    probe.yaml: steps: Input should be a valid integer, unable to parse string as an integer (got 'many')
    """
    parts = []
    for err in exc.errors():
        loc = field_path(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = "" if err["type"] in ("extra_forbidden", "missing", "value_error") else f" (got {_short(err.get('input'))})"
        # Model-level validators already put the field path at the front of their message.
        parts.append(f"{loc}: {msg}{got}" if loc else f"{msg}{got}")
    return f"{source}: " + "; ".join(parts)


def field_path(parts: Iterable[Any]) -> str:
    """Dotted path of a field; odd keys (empty, spaces, newlines) are quoted so the line stays readable.

    >>> field_path(("train", "steps")), field_path(("rank_overrides", 0, "my key"))
    ('train.steps', "rank_overrides.0.'my key'")
    """
    return ".".join(str(p) if re.fullmatch(r"[\w-]+", str(p)) else repr(p) for p in parts)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

"""Small helpers for numbers that come from JSON or from a step: finiteness and JSON safety.

Two distinct ideas, two names: :func:`is_finite_number` asks a question of one value;
:func:`finite_values` filters a sequence.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping


def is_finite_number(value: Any) -> bool:
    """True for an int or float that is neither NaN nor infinite (False for None, bools count as ints).

    >>> [is_finite_number(v) for v in (1, 2.5, float("nan"), None, "3")]
    [True, True, False, False, False]
    """
    return isinstance(value, (int, float)) and math.isfinite(value)


def finite_values(values: Iterable[Any]) -> list[float]:
    """The finite numbers of ``values``, in order, as floats (None, NaN, ±Inf and non-numbers dropped).

    >>> finite_values([1, None, float("inf"), 2.5])
    [1.0, 2.5]
    """
    return [float(value) for value in values if is_finite_number(value)]


def finite_or_none(value: Any) -> Any:
    """``value`` when it is a finite number, else None (for JSON rows).

    >>> finite_or_none(float("nan")) is None, finite_or_none(3)
    (True, 3)
    """
    return value if is_finite_number(value) else None


def json_safe(value: Any) -> Any:
    """Replace NaN/Inf floats by None, recursively through dicts, lists and tuples.

    >>> json_safe({"a": [1.0, float("nan")], "b": float("inf"), "c": "x"})
    {'a': [1.0, None], 'b': None, 'c': 'x'}
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value

"""Merging a partial config (a rank override, a ``--set``) into a whole one, as plain dictionaries."""

from __future__ import annotations

import copy
from typing import Any


def deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``patch`` merged in, recursively.

    >>> deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}})
    {'a': {'b': 1, 'c': 3}}
    """
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out

"""Probe names: what a probe's run directories and its baseline file are called."""

from __future__ import annotations

import re
from pathlib import Path

#: A probe name: a file name on every platform, without a leading dot or dash.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


def script_probe_name(path: str) -> str:
    """A script probe's default name: its file's stem, in the characters a probe name allows.

    >>> script_probe_name("jobs/train sft.py"), script_probe_name("./-.py")
    ('train_sft', 'script')
    """
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(path).stem).lstrip("._-")[:100]
    return stem if re.match(NAME_PATTERN, stem) else "script"

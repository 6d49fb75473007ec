"""Per-node settings for the clients: ``--override R:KEY=VALUE`` sets rank R's training arguments' KEY.

A launch config or a node-local file that differs on one node reaches its ranks this way: the script is the same,
one attribute of its ``TrainingArguments`` (or TRL's ``SFTConfig``) is not. VALUE is a Python literal, else a string.
Knows nothing about healthcheck.
"""

import ast
import os


def this_rank(spec):
    """The VALUE of an ``R:VALUE`` spec whose R is this process's ``RANK``; None for another rank's, or no spec."""
    if spec is None:
        return None
    rank, value = spec.split(":", 1)
    return value if int(rank) == int(os.environ.get("RANK", 0)) else None


def apply_overrides(training_args, overrides):
    """Set each ``R:KEY=VALUE`` of ``overrides`` whose R is this process's ``RANK`` on ``training_args``."""
    for override in overrides:
        setting = this_rank(override)
        if setting is None:
            continue
        key, value = setting.split("=", 1)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        setattr(training_args, key, value)

"""Per-node settings for the clients: ``--override R:KEY=VALUE`` sets rank R's training arguments' KEY.

A launch config or a node-local file that differs on one node reaches its ranks this way: the script is the same,
one attribute of its ``TrainingArguments`` (or TRL's ``SFTConfig``) is not. VALUE is a Python literal, else a string.
Knows nothing about healthcheck.
"""

import ast
import os


def apply_overrides(training_args, overrides):
    """Set each ``R:KEY=VALUE`` of ``overrides`` whose R is this process's ``RANK`` on ``training_args``."""
    for override in overrides:
        rank, setting = override.split(":", 1)
        key, value = setting.split("=", 1)
        if int(rank) == int(os.environ.get("RANK", 0)):
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                pass
            setattr(training_args, key, value)

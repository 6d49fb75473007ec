"""What explains a ``param_equality`` failure, read from the other audits: a setting that acts after DDP's all-reduce.

DDP hands every rank the same averaged gradient, so parameters part only where something after it differs: the
optimizer and its groups, the clip, the Trainer's schedule, or what the first update started from (a resumed
optimizer's state, parameters loaded after the wrap). The environment audit names those settings exactly; with
``--no-fail-fast`` it no longer stops the run, and ``param_equality`` said only "a rank-local optimizer or
learning-rate difference". It now points at the settings.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from healthcheck.judge.audit_outcome import AuditOutcome, ranks_phrase

#: Environment facts that act on the update after the gradient all-reduce (prefixes).
AFTER_THE_REDUCTION = ("optimizer", "model.parameters", "clip", "trainer.")


def explained_by_settings(params: AuditOutcome, environment: Optional[AuditOutcome]) -> AuditOutcome:
    """``param_equality`` with the environment's differing settings that act after the all-reduce, where the ranks
    whose parameters differ are among the ranks it names.

    >>> params = AuditOutcome(False, "rank 1's parameters differ", "x", (1,))
    >>> env = AuditOutcome(False, "...", "y", (1,), {"differing": ["model.dropout", "optimizer.state"]})
    >>> explained_by_settings(params, env).message
    "rank 1's parameters differ; rank 1 also differs in optimizer.state (audit.environment), which explains it"
    """
    if params.passed or not params.ranks or environment is None or environment.passed:
        return params
    if not set(params.ranks) <= set(environment.ranks):
        return params
    settings = [key for key in environment.details.get("differing", []) if key.startswith(AFTER_THE_REDUCTION)]
    if not settings:
        return params
    shown = ", ".join(settings[:4]) + (f" and {len(settings) - 4} more" if len(settings) > 4 else "")
    verb = "differs" if len(params.ranks) == 1 else "differ"
    return dataclasses.replace(
        params, message=f"{params.message}; {ranks_phrase(params.ranks)} also {verb} in {shown} (audit.environment), which explains it"
    )

"""healthcheck inside someone else's training: the ``transformers.Trainer`` callback.

``HealthcheckCallback`` is imported on first use, so ``python -m healthcheck.integrations openmetrics``
(a GitLab metrics step) never imports torch or transformers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HealthcheckCallback"]


def __getattr__(name: str) -> Any:
    if name == "HealthcheckCallback":
        from healthcheck.integrations.callback import HealthcheckCallback

        return HealthcheckCallback
    raise AttributeError(f"module 'healthcheck.integrations' has no attribute {name!r}")

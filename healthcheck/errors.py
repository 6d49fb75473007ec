"""Exit codes and the exceptions that map onto them.

Every failure a user can cause or meet ends in exactly one of these codes; the CLI turns the
exception into a one-line message (:func:`one_line`) and never shows a traceback for them.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes, documented in the README and in ``healthcheck --help``."""

    PASS = 0  #: every check passed
    INCONSISTENT = 1  #: silent inconsistency detected: an envelope violated or an audit failed
    INVALID_INPUT = 2  #: bad config, bad/corrupt/missing baseline, unwritable output
    PROBE_FAILED = 3  #: the probe could not finish: a worker crashed, hung or was interrupted


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) collapsed to one space.

    CI log readers grep for the one ``healthcheck: error:`` line, and user text (a YAML error, a
    script's exception) can carry newlines.

    >>> one_line("a\\n  b\\tc ")
    'a b c'
    """
    return " ".join(str(text).split())


class HealthcheckError(Exception):
    """Base class: an error with a one-line message and an exit code."""

    exit_code: ExitCode = ExitCode.INVALID_INPUT

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidInput(HealthcheckError):
    """Bad config, baseline, path or argument (exit 2)."""

    exit_code = ExitCode.INVALID_INPUT


class ConfigError(InvalidInput):
    """A config file or ``--set`` value failed validation; the message names file and field."""


class BaselineError(InvalidInput):
    """A baseline is missing, corrupt, or does not apply to this probe."""


class ProbeFailed(HealthcheckError):
    """The probe did not finish (exit 3): crash, hang, timeout or interrupt.

    Args:
        message: One line naming the rank and step when known.
        signals: ``rank -> signal number`` for workers the launcher saw die by a signal (they
            leave no report of their own).
    """

    exit_code = ExitCode.PROBE_FAILED

    def __init__(self, message: str, signals: dict[int, int] | None = None):
        super().__init__(message)
        self.signals: dict[int, int] = dict(signals or {})

"""The installed package's version, read from its metadata (never a literal that drifts)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("healthcheck")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

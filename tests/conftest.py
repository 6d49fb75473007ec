"""Project-wide test settings: hypothesis's profile, and one tier marker per test, taken from where it lives.

``tests/unit`` (and the package's doctests) is ``unit``, ``tests/multiprocess`` is ``multiprocess``,
``tests/e2e`` is ``e2e``; a test that declares another tier's marker is an error, so
``pytest -m unit`` always means the same files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Property tests assert properties, not speed: hypothesis's default 200 ms per-example deadline is a
# timing assertion that flakes on a loaded 2-core CI machine, so it is off everywhere.
settings.register_profile("healthcheck", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("healthcheck")

TIERS = ("unit", "multiprocess", "e2e")
TESTS = Path(__file__).resolve().parent


def tier_of(path: Path) -> str:
    """The tier a collected file belongs to: its folder under tests/, or unit for the package's doctests."""
    try:
        return path.resolve().relative_to(TESTS).parts[0]
    except ValueError:
        return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(Path(str(item.path)))
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/unit, tests/multiprocess or tests/e2e")
        declared = {marker.name for marker in item.iter_markers() if marker.name in TIERS}
        if declared - {tier}:
            raise pytest.UsageError(f"{item.nodeid}: marked {sorted(declared)} but lives in tests/{tier}")
        item.add_marker(getattr(pytest.mark, tier))

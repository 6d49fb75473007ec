"""Project-wide test settings."""

from hypothesis import HealthCheck, settings

# Property tests assert properties, not speed: hypothesis's default 200 ms per-example deadline is a
# timing assertion that flakes on a loaded 2-core CI machine, so it is off everywhere.
settings.register_profile("healthcheck", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("healthcheck")

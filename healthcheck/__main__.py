"""``python -m healthcheck`` (what torchrun runs: ``torchrun ... -m healthcheck probe --config X``)."""

from healthcheck.cli import run

run()

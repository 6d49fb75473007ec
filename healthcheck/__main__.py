"""``python -m healthcheck`` (what torchrun runs: ``torchrun ... -m healthcheck probe --config X``)."""

import sys

from healthcheck.cli import main

sys.exit(main())

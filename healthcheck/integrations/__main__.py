"""``python -m healthcheck.integrations openmetrics RUN_DIR [--output FILE]`` (kept for the CI templates)."""

import sys

from healthcheck.outputs.openmetrics import main

sys.exit(main())

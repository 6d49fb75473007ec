"""The OpenMetrics export is written by prometheus_client and stays light: no torch, no transformers.

The families, labels and ``# EOF`` are checked against prometheus_client's own parser and GitLab's
reading in ``tests/unit/test_ci_templates.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

from prometheus_client.openmetrics import parser

from healthcheck.outputs import openmetrics
from tests.fixtures_runs import write_fake_run

PROBE = r"""
import runpy, sys
sys.argv = ["healthcheck.integrations", "openmetrics", sys.argv[1]]
try:
    runpy.run_module("healthcheck.integrations", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}), file=sys.stderr)
"""


def test_the_export_command_imports_neither_torch_nor_transformers(tmp_path):
    write_fake_run(tmp_path)
    done = subprocess.run([sys.executable, "-c", "import json\n" + PROBE, str(tmp_path)], capture_output=True, text=True, check=True)
    assert json.loads(done.stderr.splitlines()[-1]) == {"code": 0, "heavy": []}
    assert done.stdout.endswith("# EOF\n")


def test_label_values_and_help_text_are_escaped_by_the_library(tmp_path):
    result, _ = write_fake_run(tmp_path)
    name = 'probe "a"\\b\nc'
    text = openmetrics.openmetrics_from_result(result.model_copy(update={"name": name}))
    families = list(parser.text_string_to_metric_families(text))
    assert {sample.labels["probe"] for family in families for sample in family.samples} == {name}
    assert not hasattr(openmetrics, "escape_text") and not hasattr(openmetrics, "format_openmetrics_value")

"""The README's commands for probing a script run as written (only /tmp/ paths move into the test's folder)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO, SHARED_DATA, run_cli

SECTION = "## Probe your own training script"


def readme_commands(section: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    body = text[text.index(section):]
    body = body[: body.index("\n## ", 1)]
    block = re.search(r"```bash\n(.*?)```", body, re.S)
    assert block, f"no bash block in {section!r}"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.skipif(not (SHARED_DATA / "gsm8k_alpaca.json").exists(), reason="../shared/data is not beside this checkout")
def test_the_script_mode_commands_of_the_readme_run(tmp_path):
    commands = readme_commands(SECTION)
    assert len(commands) == 2
    for line in commands:
        argv = [word.replace("/tmp/", f"{tmp_path}/") for word in shlex.split(line)]
        if argv[0] == "python3":
            done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
        else:
            assert argv[0] == "healthcheck"
            done = run_cli(*argv[1:])
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
    result = json.loads((tmp_path / "probe-script" / "result.json").read_text())
    assert result["status"] == "complete" and result["steps_completed"] == 8
    assert (tmp_path / "probe-script" / "logs" / "rank-0.log").exists()

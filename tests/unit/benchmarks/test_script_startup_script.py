"""``benchmarks/script_startup.py``: each arm's command differs from the default by exactly what it measures."""

from __future__ import annotations

from pathlib import Path

import healthcheck.run.probe as probe
from tests.benchmark_scripts import loaded_script


def test_each_arm_changes_one_thing():
    with loaded_script("script_startup") as module:
        args = ("hf_trainer", 4, 4, Path("/m"), Path("/d.json"), Path("/tmp/x/run"))
        default, no_preload, no_plots, teardown = (module.probe_command(arm, *args) for arm in module.ARMS)
    assert default[1:3] == ["-m", "healthcheck"] and "--no-plots" not in default
    assert no_plots == [*default[:9], "--no-plots", *default[9:]], no_plots
    assert no_preload[1:3] == ["-c", module.NO_PRELOAD] and no_preload[3:] == default[3:]
    assert teardown[1:3] == ["-c", module.TEARDOWN] and teardown[3:] == default[3:]
    assert "run(" in module.NO_PRELOAD and "main(" in module.TEARDOWN  # only the teardown arm pays the teardown


def test_the_no_preload_arm_replaces_the_name_the_launcher_calls():
    # warm_parent_caches looks preload_script_imports up in its module at call time, so the arm's patch reaches it;
    # a rename would leave the arm measuring the default.
    assert callable(probe.preload_script_imports)
    assert "preload_script_imports" in probe.warm_parent_caches.__code__.co_names

"""The one compiled piece: the host's sketch pass (healthcheck/measure/_host_fold.c). Everything else is in
pyproject.toml. ``optional=True``: where no C compiler is found the install still succeeds, and the monitor
uses its numpy pass instead (healthcheck.measure.host_pass.compiled() tells which one runs)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("healthcheck.measure._host_fold", ["healthcheck/measure/_host_fold.c"], optional=True)])

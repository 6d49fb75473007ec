"""The compiled pieces, two small C extensions; everything else is in pyproject.toml.

- ``healthcheck/measure/_host_fold.c``: the DDP hook's pass over a host bucket (sketch, ‖g‖², division);
- ``healthcheck/measure/_fence.c``: a memory fence for the shared-memory exchange of a step's rows.

``optional=True``: where no C compiler is found the install still succeeds, and the monitor uses its numpy pass
and the all-gather instead (``healthcheck.measure.host_pass.compiled()`` and ``shared_rows.available()`` say which
run)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("healthcheck.measure._host_fold", ["healthcheck/measure/_host_fold.c"], optional=True),
        Extension("healthcheck.measure._fence", ["healthcheck/measure/_fence.c"], optional=True),
    ]
)

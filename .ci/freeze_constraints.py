"""Print .ci/constraints.txt: the installed version of every package healthcheck's [test] extra pulls in.

Run it after the suite passed on newer releases (``python3 -m pip install -U -e '.[test]'``, then ``python3 -m pytest
-q``): ``python3 .ci/freeze_constraints.py > .ci/constraints.txt``. It walks the installed requirement tree from
healthcheck (markers evaluated for this interpreter, extras followed), so packages the machine has for other reasons
are left out. torch is left out (the install commands pin it first, and its CPU wheel's local version would not
match the CUDA one), and so is setuptools (the build backend, which pip installs in an isolated build environment).
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = """\
# The versions of the test dependencies, and of everything they pull in, that the suite last passed with: the
# README's test command (and .ci/run) installs the [test] extra under these constraints, so a release of
# transformers, TRL, accelerate, ruff or mypy between two runs cannot fail a CI run of unchanged code
# (accelerate 1.16 changed how every model is clipped). torch is pinned by the command itself.
#
# To move to newer releases: python3 -m pip install -U -e '.[test]', run the suite, then
#   python3 .ci/freeze_constraints.py > .ci/constraints.txt
"""
LEFT_OUT = {"healthcheck", "torch", "setuptools"}


def installed_tree(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Each installed distribution ``root[extras]`` requires, directly or not, by canonical name: its version."""
    found: dict[str, str] = {}
    todo = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # an optional requirement this machine does not have
            continue
        key = canonicalize_name(dist.metadata["Name"])
        if key in found and not wanted:
            continue
        found[key] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in ("", *wanted)):
                if canonicalize_name(requirement.name) not in found or requirement.extras:
                    todo.append((requirement.name, tuple(sorted(requirement.extras))))
    return found


def main() -> int:
    tree = installed_tree("healthcheck", ("test",))
    sys.stdout.write(HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(tree.items()) if name not in LEFT_OUT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The package's shape: imports point one way through the layers the README states, no module imports
another that imports it back (in-function imports included), and no module outgrows ~400 lines.

Layers, lowest first (a module may import its own layer and the ones before it)::

    foundations (errors, ranks, finite, typed, version) → files → config → artifacts → measure
    → judge → outputs → integrations → run → gate → cli

``healthcheck/__init__.py`` is the public facade: nothing inside the package imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "healthcheck"
LAYERS: list[tuple[str, ...]] = [
    ("healthcheck.errors", "healthcheck.ranks", "healthcheck.finite", "healthcheck.typed", "healthcheck.version"),
    ("healthcheck.files",),
    ("healthcheck.config",),
    ("healthcheck.artifacts",),
    ("healthcheck.measure",),
    ("healthcheck.judge",),
    ("healthcheck.outputs",),
    ("healthcheck.integrations",),
    ("healthcheck.run",),
    ("healthcheck.gate",),
    ("healthcheck.cli", "healthcheck.__main__"),
]
MAX_LINES = 420


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
            return index
    raise AssertionError(f"{name} belongs to no layer; add it to LAYERS and the README")


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every healthcheck module ``path`` imports, at any depth (module level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import name` imports pkg.name when that is a module.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.startswith("healthcheck"))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = set(modules())
    return {name: imports_of(path, known) - {name} for name, path in modules().items()}


def test_every_module_has_a_layer():
    for name in modules():
        if name != "healthcheck":
            layer_of(name)


def test_imports_point_down_the_layers(graph):
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in graph.items() if name != "healthcheck"
        for target in targets if target != "healthcheck" and layer_of(target) > layer_of(name)
    ]
    assert not upward, "\n".join(upward)


def test_nothing_inside_imports_the_facade(graph):
    assert [name for name, targets in graph.items() if "healthcheck" in targets and name != "healthcheck"] == []


def test_no_import_cycles(graph):
    # Tarjan's strongly connected components over the module graph (package __init__ edges included).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert cycles == [], cycles


def test_no_module_over_the_size_limit():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, long


def test_the_tree_names_every_stage():
    for subpackage in ("config", "measure", "judge", "outputs", "integrations", "run"):
        init = PACKAGE / subpackage / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), f"{subpackage} needs a docstring"


def test_the_layering_test_sees_a_violation(tmp_path):
    # The checker itself can fail: an upward import in a throwaway module is caught.
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from healthcheck.cli import main\n")
    assert imports_of(fake, {"healthcheck.cli"}) == {"healthcheck.cli"}

"""The package's import layers, read off its source with ``ast`` (docs/design.md, "Layers").

Value types at the bottom, then the core, the collectives, the backends, the API and the
package's exports. A module imports only its own layer or lower ones; the backends import neither
the API nor each other; a function-local import never runs back up (the lazy imports point down
or within a backend: ``ns.shard``'s of the distributed backend, so a process using only simulated
meshes never loads torch.distributed, and the simulated compile path's, so an eager-only process
never loads Dynamo). Imports under ``if TYPE_CHECKING:`` are for annotations and do not count.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "named_spmd"

LAYERS = {
    0: {
        "_errors",
        "_types",
        "_spec",
        "_mesh",
        "_layout",
        "_torch_private",
        "_debug",
        "_capabilities",
    },
    1: {
        "_tree",
        "_accounting",
        "_context",
        "_calls",
        "_masked_fill",
        "_check",
        "_partial",
        "_blocks",
        "_block_rules",
        "_operands",
        "_donation",
    },
    2: {
        "_collectives",
        "_autodiff",
        "_stamps",
        "_tracking",
        "_traced",
        "_plan",
        "_replay",
        "random",
    },
    3: {"backends"},
    4: {
        "_api",
        "_call",
        "_call_checks",
        "_out_problems",
        "_compile",
        "_display",
        "_views",
        "_shard",
        "parallel",
    },
    5: {""},  # named_spmd/__init__.py: the public exports
}
LAYER_OF = {top: layer for layer, tops in LAYERS.items() for top in tops}

#: Backend groups: the modules of one backend may import each other, never another group's.
#: ``backends/__init__`` (the interface and registry) is imported by the API, never by a backend.
BACKEND_GROUPS = {
    "simulated": lambda name: name.startswith("backends.simulated"),
    "distributed": lambda name: (
        name in ("backends.distributed",) or name.startswith("backends._dist_")
    ),
    "abstract": lambda name: name == "backends.abstract",
}


def module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    """``named_spmd/backends/simulated/_plan.py`` -> ``backends.simulated._plan``."""
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_of(name: str) -> str:
    return name.split(".")[0]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> list[tuple[str, int, bool]]:
    """(imported package module, line, inside a function) for every package import that runs."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other, in_function)
                continue
            local = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.ImportFrom) and child.level:
                base = package[: len(package) - (child.level - 1)]
                if child.module:
                    found.append((".".join([*base, child.module]), child.lineno, in_function))
                else:  # from . import a, b: each name is a module of that package
                    for alias in child.names:
                        found.append((".".join([*base, alias.name]), child.lineno, in_function))
            elif isinstance(child, ast.Import | ast.ImportFrom):
                module = child.module if isinstance(child, ast.ImportFrom) else None
                names = [module] if module else [a.name for a in child.names]  # type: ignore[union-attr]
                for n in names:
                    if n and n.startswith("named_spmd"):
                        target = n.removeprefix("named_spmd").lstrip(".")
                        found.append((target, child.lineno, in_function))
            visit(child, local)

    visit(ast.parse(path.read_text()), False)
    return found


def layer_violations(package: pathlib.Path = PACKAGE) -> list[str]:
    """Every import that breaks the layering, as ``file:line: importer -> imported (why)``."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        importer = module_name(path, package)
        for imported, line, in_function in imports_of(path, package):
            where = (
                f"{path.relative_to(package.parent)}:{line}: {importer or '__init__'} -> {imported}"
            )
            problems.extend(f"{where} ({why})" for why in _why_not(importer, imported, in_function))
    return problems


def _why_not(importer: str, imported: str, in_function: bool) -> list[str]:
    if top_of(imported) not in LAYER_OF:
        return [f"{top_of(imported)!r} is in no layer: add it to LAYERS"]
    mine, theirs = LAYER_OF[top_of(importer)], LAYER_OF[top_of(imported)]
    reasons = []
    if theirs > mine:
        reasons.append(f"layer {mine} imports layer {theirs}" + (" in a function" * in_function))
    if top_of(importer) == "backends" and importer != "backends":
        if imported == "backends":
            reasons.append("a backend imports the registry (the API picks backends)")
        group = _group(importer)
        other = _group(imported) if top_of(imported) == "backends" else None
        if other is not None and other != group:
            reasons.append(f"backend {group!r} imports backend {other!r}")
    return reasons


def _group(name: str) -> str | None:
    return next((g for g, member in BACKEND_GROUPS.items() if member(name)), None)


def test_every_module_is_in_a_layer():
    tops = {top_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert tops - set(LAYER_OF) == set()
    backends = [module_name(p) for p in (PACKAGE / "backends").rglob("*.py")]
    assert [b for b in backends if b != "backends" and _group(b) is None] == []


def test_imports_follow_the_layers():
    assert layer_violations() == []


def test_the_only_function_local_package_imports_point_down():
    local = [
        (module_name(path), imported)
        for path in sorted(PACKAGE.rglob("*.py"))
        for imported, _, in_function in imports_of(path)
        if in_function
    ]
    # ns.shard loads the distributed backend only for a real mesh (make_mesh asks the
    # registry, which loads it by name); the API and the simulated backend load the compile
    # paths (which import Dynamo) only when Dynamo traces
    assert set(local) <= {
        ("_shard", "backends._dist_shard"),
        ("backends.simulated", "backends.simulated._traced"),
        ("_api", "_traced"),
    }


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        ("_types.py", "from . import _display", "layer 0 imports layer 4"),
        ("_mesh.py", "from .backends import distributed", "layer 0 imports layer 3"),
        ("backends/abstract.py", "from .._api import spmd_map", "layer 3 imports layer 4"),
        ("backends/abstract.py", "from .simulated import _plan", "imports backend 'simulated'"),
        ("_tracking.py", "from ._collectives import psum", None),  # down a layer: allowed
        (
            "_context.py",
            "def f():\n    from ._collectives import psum",
            "layer 1 imports layer 2 in a function",
        ),
    ],
)
def test_the_scan_catches_a_broken_layer(tmp_path, module, line, expected):
    """The scan, run on a copy of the package with one import added, reports exactly it."""
    import shutil

    copy = tmp_path / "named_spmd"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    target.write_text(target.read_text() + "\n" + line + "\n")
    found = layer_violations(copy)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found

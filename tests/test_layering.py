"""The core knows no AD library: every fact about one lives in its adapter.

``abstractdiff/`` must not import an AD library, must not branch on a library's name,
and must not import from ``adapters/``.  Two exceptions: the registry's table of built-in
backends (``_registry._BUILTIN``), which says which adapter module serves which library
name, and the portable translations (``abstractdiff/portable/<library>.py``), each of which
knows its own library only: its numpy compatibility, as data outside the adapters.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "abstractdiff"
LIBRARIES = (
    "torch", "jax", "jaxlib", "tensorflow", "tf", "keras", "tf_keras", "autograd", "mlx", "paddle", "pytensor",
)


#: A portable table's module -> the libraries it may name (its own).
_PORTABLE_OWN = {"torch": {"torch"}, "jax": {"jax", "jaxlib"}, "tensorflow": {"tensorflow", "tf"},
                 "autograd": {"autograd"}, "mlx": {"mlx"}, "paddle": {"paddle"}, "pytensor": {"pytensor"},
                 "numpy": set()}


def _own_libraries(path: Path) -> set[str]:
    """The libraries ``path`` may name: its own, for a portable table; none elsewhere."""
    if path.parent.name == "portable" and path.parent.parent == CORE and path.stem in _PORTABLE_OWN:
        return _PORTABLE_OWN[path.stem]
    return set()


def _core_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (they may talk about libraries)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _builtin_table(tree: ast.AST, path: Path) -> set[int]:
    """ids of the nodes inside ``_BUILTIN = {...}`` of the registry: the allowed exception."""
    if path.name != "_registry.py":
        return set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "_BUILTIN" for t in targets):
            return {id(n) for n in ast.walk(node)}
    raise AssertionError("the registry has no _BUILTIN table")


def _names_library(text: str, own: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
    head = text.partition(".")[0]
    if head in own:
        return False
    return text in LIBRARIES or head in LIBRARIES and "." in text and " " not in text


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_names_no_ad_library(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    allowed = _docstrings(tree) | _builtin_table(tree, path)
    own = _own_libraries(path)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.partition(".")[0] in set(LIBRARIES) - own]
            problems += [f"line {node.lineno}: import {name}" for name in names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and module.partition(".")[0] in set(LIBRARIES) - own:
                problems.append(f"line {node.lineno}: from {module} import ...")
            if "adapters" in module.split("."):
                problems.append(f"line {node.lineno}: imports from adapters/ ({'.' * node.level}{module})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed:
            if _names_library(node.value, own):
                problems.append(f"line {node.lineno}: the string {node.value!r} names an AD library")
    assert not problems, f"{path.relative_to(CORE.parent)} knows an AD library (make it a hook of the adapter):\n" + (
        "\n".join(problems)
    )


def test_the_check_finds_what_it_forbids(tmp_path: Path) -> None:
    """The rule above is not vacuous: each forbidden form is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nfrom jax import numpy\nfrom .adapters.implicit import Implicit\n"
        "def f(a):\n    return type(a).__module__ == 'tensorflow'\n"
    )
    tree = ast.parse(bad.read_text())
    forms = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(forms) == 3
    assert any(isinstance(n, ast.Constant) and _names_library(n.value) for n in ast.walk(tree))
    assert not _names_library("a torch tensor that does not require grad")  # prose in a message is fine


# ------------------------------------------------------------------ import cycles
def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations, never executed."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package at ``root`` it imports, at module level or inside
    functions alike (a function-level import is a cycle deferred, not removed)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files]
                deps.update(subs)  # `from . import portable` imports the submodule
                if target in files and len(subs) < len(node.names):
                    deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_core() -> None:
    """abstractdiff/ is layered: no module imports one that imports it back, inside functions included."""
    cycles = import_cycles(import_graph(CORE))
    detail = "\n".join(
        " <-> ".join(c) + "\n" + "\n".join(
            f"    {m} imports {sorted(d for d in import_graph(CORE)[m] if d in c)}" for m in c
        ) for c in cycles
    )
    assert not cycles, f"import cycles in abstractdiff/:\n{detail}"


def test_the_cycle_check_finds_a_deferred_cycle(tmp_path: Path) -> None:
    """A cycle closed by an import inside a function is still a cycle; TYPE_CHECKING imports are not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n")
    (pkg / "b.py").write_text("def g():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert import_cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


# ------------------------------------------------------------------ the package boundary
#: The features built on the core: they import the public API (``abstractdiff``,
#: ``abstractdiff.protocol``), the internal API (``abstractdiff.core``) and each other, never
#: a private module of the core.
FEATURES = ("_sparse", "_sparsity", "_coloring", "_train", "_compiled_step", "_checkpoint", "_checkpoint_format",
            "_distributed", "_atomic", "parity", "callbacks", "cli", "optim", "testing")
ALLOWED_FROM_FEATURES = {"abstractdiff", "abstractdiff.core", "abstractdiff.protocol"}


def _feature_of(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[0] == "abstractdiff" and parts[1] in FEATURES


def boundary_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} imports {d}" for m in sorted(graph) if _feature_of(m)
            for d in sorted(graph[m]) if not (_feature_of(d) or d in ALLOWED_FROM_FEATURES)]


def test_features_use_the_public_api_and_core_only() -> None:
    """Sparse AD, training, testing and the CLI reach the core through abstractdiff.core."""
    problems = boundary_violations(import_graph(CORE))
    assert not problems, "a feature imports a private module of the core (export it from abstractdiff/core.py):\n" + \
        "\n".join(problems)


def test_the_boundary_check_finds_a_private_import() -> None:
    graph = {"abstractdiff._train": {"abstractdiff._tree", "abstractdiff.core", "abstractdiff.optim._state"},
             "abstractdiff._tree": {"abstractdiff._cache"}}
    assert boundary_violations(graph) == ["abstractdiff._train imports abstractdiff._tree"]

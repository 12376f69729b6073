"""The core knows no AD library: every fact about one lives in its adapter.

``abstractdiff/`` must not import an AD library, must not branch on a library's name,
and must not import from ``adapters/``.  The one exception is the registry's table of
built-in backends (``_registry._BUILTIN``), which says which adapter module serves which
library name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "abstractdiff"
LIBRARIES = (
    "torch", "jax", "jaxlib", "tensorflow", "tf", "keras", "tf_keras", "autograd", "mlx", "paddle", "pytensor",
)


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


def _names_library(text: str) -> bool:
    return text in LIBRARIES or text.partition(".")[0] in LIBRARIES and "." in text and " " not in text


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_module_names_no_ad_library(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    allowed = _docstrings(tree) | _builtin_table(tree, path)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.partition(".")[0] in LIBRARIES]
            problems += [f"line {node.lineno}: import {name}" for name in names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and module.partition(".")[0] in LIBRARIES:
                problems.append(f"line {node.lineno}: from {module} import ...")
            if "adapters" in module.split("."):
                problems.append(f"line {node.lineno}: imports from adapters/ ({'.' * node.level}{module})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed:
            if _names_library(node.value):
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

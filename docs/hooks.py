"""mkdocs hook: generate the backend matrix of ``docs/backends.md`` from the code.

Nothing in the matrix is typed by hand.  At build time this hook reads:

* the registry's built-in table (``abstractdiff._registry._BUILTIN``): names, adapter
  classes, pip extras;
* each adapter class's source (parsed with ``ast``, so that no AD library is imported
  and the docs build where a library is missing): which operators it computes natively
  (its ``fast_routes`` and primitives, or for an older ``ad.Backend`` subclass its ``flat_*``
  overrides), and its ``__init__`` options;
* the conformance suite's strict-xfail table (``XFAILS`` in
  ``conformance_tests/test_conformance.py``): the known gaps.

``backends.md`` holds markers (``<!-- matrix:operators -->`` ...) that are replaced.

It also holds :class:`DoctestExamples`, a Griffe extension (``mkdocs.yml`` loads it
for mkdocstrings) that reads the project's ``Example:`` docstring sections as Google
"Examples" sections, so doctests render as code rather than as markdown text.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.abstractdiff")

ROOT = Path(__file__).resolve().parent.parent
XFAILS_FILE = ROOT / "conformance_tests" / "test_conformance.py"

# Operator columns: (heading, flat method whose override makes the operator native).
OPERATOR_COLUMNS = (
    ("gradient, value_and_gradient", "flat_value_and_gradient"),
    ("pullback, value_and_pullback", "flat_value_and_pullback"),
    ("pushforward, value_and_pushforward", "flat_value_and_pushforward"),
    ("derivative, value_and_derivative", "flat_value_and_derivative"),
    ("second_derivative", "flat_second_derivative"),
    ("value_derivative_and_second_derivative", "flat_value_derivative_and_second_derivative"),
    ("jacobian, value_and_jacobian", "flat_jacobian"),
    ("hessian", "flat_hessian"),
    ("hessian of a pytree", "flat_hessian_blocks"),
    ("value_gradient_and_hessian", "flat_value_gradient_and_hessian"),
    ("hvp", "flat_hvp"),
    ("gradient_and_hvp", "flat_gradient_and_hvp"),
    ("prepare_*", "flat_prepare_value_and_gradient"),
)


# ---------------------------------------------------------------- reading the code
def _class_node(target: str) -> tuple[ast.ClassDef, ast.Module, Path]:
    module_name, _, class_name = target.partition(":")
    spec = importlib.util.find_spec(module_name)  # locates the file; imports only parent packages
    if spec is None or spec.origin is None:
        raise RuntimeError(f"docs/hooks.py: cannot find the source of {module_name}")
    path = Path(spec.origin)
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return node, tree, path
    raise RuntimeError(f"docs/hooks.py: no class {class_name} in {path}")


def _methods(cls: ast.ClassDef) -> set[str]:
    """The class's methods; for an adapter of the protocol (``abstractdiff.protocol.Adapter``),
    also the core's ``flat_*`` names its primitives and ``fast_routes`` stand for."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if not any(isinstance(b, ast.Name) and b.id == "Adapter" for b in cls.bases):
        return names
    from abstractdiff.protocol import PER_CALL_ROUTES, PRIMITIVES

    routes = set(_class_constant(cls, "fast_routes") or {})
    routes |= {PER_CALL_ROUTES[op] for op in routes if op in PER_CALL_ROUTES}  # written once, serving both
    primitives = {m for m in PRIMITIVES[:2] if m in names}
    return names | {f"flat_{m}" for m in primitives} | {f"flat_{op}" for op in routes}


def _class_constant(cls: ast.ClassDef, name: str) -> Any:
    for n in cls.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return ast.literal_eval(n.value)
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name and n.value:
            return ast.literal_eval(n.value)
    return None


def _defines(tree: ast.Module, name: str) -> bool:
    """Whether the module assigns ``name`` at its top level (the implicit backend's refusals)."""
    return any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
               for n in tree.body)


def _passes_on(func: ast.FunctionDef, kwarg: str) -> bool:
    """Whether ``**kwarg`` holds real options (forwarded as ``g(**kwarg)`` or stored),
    rather than a catch-all that only exists to reject unknown options clearly."""
    for n in ast.walk(func):
        if isinstance(n, ast.keyword) and n.arg is None and isinstance(n.value, ast.Name) and n.value.id == kwarg:
            return True
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id == kwarg:
            return True
    return False


def _options(cls: ast.ClassDef) -> list[str]:
    """``name=default`` for every option of ``__init__`` (``inner`` for the implicit adapter)."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return ["device=None"]
    a = init.args
    out: list[str] = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, default in zip(positional, defaults):
        if arg.arg == "self":
            continue
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.vararg is not None:
        out.append(f"*{a.vararg.arg}")
    if a.kwarg is not None and _passes_on(init, a.kwarg.arg):
        out.append(f"**{a.kwarg.arg}")
    return out


def adapters() -> list[dict[str, Any]]:
    """One record per built-in backend, read from the registry table and the adapter sources."""
    from abstractdiff import _registry
    from abstractdiff._operator_table import operators_where

    records = []
    for name, entry in _registry._BUILTIN.items():
        if not isinstance(entry.target, str):
            continue
        cls, tree, path = _class_node(entry.target)
        records.append(
            {
                "name": name,
                "target": entry.target,
                "class": cls.name,
                "file": path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name,
                "methods": _methods(cls),
                "options": _options(cls),
                "extra": entry.extra or _class_constant(cls, "extra"),
                "requires": entry.requires,
                "refused": operators_where(implicit=False) if _defines(tree, "_EXPLICIT_ONLY") else (),
            }
        )
    return records


def known_gaps() -> dict[tuple[str, str, str], str]:
    """The conformance suite's strict-xfail table."""
    spec = importlib.util.spec_from_file_location("_abstractdiff_docs_conformance", XFAILS_FILE)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"docs/hooks.py: cannot load {XFAILS_FILE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = getattr(module, "XFAILS", None)
    if not isinstance(table, dict):
        raise RuntimeError(f"docs/hooks.py: {XFAILS_FILE} has no XFAILS dict; update the hook")
    return dict(table)


# ---------------------------------------------------------------- rendering
def _operator_cell(op: str, flat: str | None, methods: set[str]) -> str:
    rev = "flat_value_and_pullback" in methods
    fwd = "flat_value_and_pushforward" in methods
    if flat is not None and flat in methods:
        return "**native**"
    if op == "gradient_and_hvp":
        return "derived: gradient, then hvp"
    if op.startswith("gradient"):
        return "derived: pullback seeded with 1" if rev else "derived: one pushforward per input element"
    if op.startswith("pullback"):
        return "derived: from the forward-mode jacobian"
    if op.startswith("pushforward"):
        return "derived: from the reverse-mode jacobian"
    if op.startswith("derivative"):
        return "derived: one pushforward" if fwd else "derived: jacobian"
    if op == "second_derivative":
        return "derived: pushforward of the pushforward" if fwd else "derived: jacobian of the jacobian"
    if op == "value_derivative_and_second_derivative":
        return "derived: value_and_derivative, then second_derivative"
    if op.startswith("jacobian"):
        if rev and fwd:
            return "derived: pullbacks per output or pushforwards per input, whichever are fewer"
        return "derived: one pullback per output element" if rev else "derived: one pushforward per input element"
    if op == "hessian":
        return "derived: jacobian of the gradient"
    if op == "hessian of a pytree":
        return "derived: hessian of the concatenated leaves, split into blocks"
    if op == "value_gradient_and_hessian":
        return "derived: value_and_gradient, then hessian"
    if op == "hvp":
        return "derived: forward over reverse" if fwd else "derived: reverse over reverse"

    if op == "prepare_*":
        return "generic (cached flat function)"
    return "derived"


def _code(text: str) -> str:
    return f"`{text}`"


def operators_table(records: list[dict[str, Any]]) -> str:
    explicit = [r for r in records if r["name"] != "implicit"]
    head = "| backend | " + " | ".join(h for h, _ in OPERATOR_COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(OPERATOR_COLUMNS) + 1)]
    for r in explicit:
        cells = [_operator_cell(h, flat, r["methods"]) for h, flat in OPERATOR_COLUMNS]
        lines.append(f"| {_code(r['name'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def options_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | adapter class | options (defaults) | devices | primitives | install |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        m = r["methods"]
        if r["name"] == "implicit":
            devices = "those of the inner backend"
            prims = "uses the inner backend's"
        else:
            devices = "cpu and the accelerators the library sees" if "devices" in m else "cpu only"
            primitives = (("reverse", "flat_value_and_pullback"), ("forward", "flat_value_and_pushforward"))
            prims = ", ".join(label for label, meth in primitives if meth in m)
        install = f"`pip install 'abstractdiff[{r['extra']}]'`" if r["extra"] else "included"
        options = ", ".join(_code(o) for o in r["options"])
        lines.append(
            f"| {_code(r['name'])} | {_code(r['target'].replace(':', '.'))} | {options} | {devices} | {prims} | "
            f"{install} |"
        )
    return "\n".join(lines)


def implicit_table(records: list[dict[str, Any]]) -> str:
    r = next((r for r in records if r["name"] == "implicit"), None)
    if r is None:
        return "The implicit adapter is not registered."
    from abstractdiff.testing import OPERATORS

    supported = [op for op in OPERATORS if op not in r["refused"]]
    supported += [f"value_and_{op}" for op in ("pullback",) if op in supported]
    return (
        "| | operators |\n|---|---|\n"
        f"| supported (results are `ad.Grads`) | {', '.join(_code(o) for o in supported)} |\n"
        f"| explicit mode only (`ModeMismatchError` says so) | {', '.join(_code(o) for o in r['refused'])} |"
    )


def gaps_table(gaps: dict[tuple[str, str, str], str]) -> str:
    if not gaps:
        return (
            "**None.** The conformance suite's strict-xfail table (`XFAILS` in "
            "`conformance_tests/test_conformance.py`) is empty: every backend passes every "
            "scenario and operator it is run on. A gap found later is added there with its "
            "reason and appears here."
        )
    lines = ["| backend | scenario | operator | reason |", "|---|---|---|---|"]
    for (backend, scenario, operator), reason in sorted(gaps.items()):
        lines.append(f"| {_code(backend)} | {_code(scenario)} | {_code(operator)} | {reason} |")
    return "\n".join(lines)


def generate() -> dict[str, str]:
    records = adapters()
    return {
        "<!-- matrix:operators -->": operators_table(records),
        "<!-- matrix:options -->": options_table(records),
        "<!-- matrix:implicit -->": implicit_table(records),
        "<!-- matrix:gaps -->": gaps_table(known_gaps()),
    }


# ---------------------------------------------------------------- griffe extension
_EXAMPLE_HEADING = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.M)

try:
    from griffe import Extension as _GriffeExtension
except ImportError:  # mkdocstrings not installed: the hook itself still works
    _GriffeExtension = object  # type: ignore[assignment,misc]


class DoctestExamples(_GriffeExtension):  # type: ignore[misc,valid-type]
    """``Example:`` (an admonition for Griffe's Google parser) read as ``Examples:``."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        doc = getattr(obj, "docstring", None)
        if doc is not None and "Example:" in doc.value:
            doc.value = _EXAMPLE_HEADING.sub(r"\g<indent>Examples:", doc.value)


# ---------------------------------------------------------------- mkdocs events
def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != "backends.md":
        return markdown
    for marker, text in generate().items():
        if marker not in markdown:
            raise RuntimeError(f"docs/backends.md lost its marker {marker}; the hook fills it in")
        markdown = markdown.replace(marker, text)
    return markdown

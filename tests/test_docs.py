"""The documentation: every code example runs, every public name is on the API page,
and ``mkdocs build --strict`` succeeds (a broken link or any warning fails it).

Each page's ```python blocks run in order, in one namespace, in a fresh interpreter
(so a page cannot lean on another page's imports or registered backends), from a
temporary directory (examples may write files).  A traceback names the page and line.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import abstractdiff as ad

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXCLUDED = (DOCS / "dev",)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def pages() -> list[Path]:
    found = [ROOT / "README.md"]
    for path in sorted(DOCS.rglob("*.md")):
        if not any(path.is_relative_to(d) for d in EXCLUDED):
            found.append(path)
    return found


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line number, source)`` of every ```python block of a markdown file."""
    return blocks_in(path.read_text())


def blocks_in(text: str) -> list[tuple[int, str]]:
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group("lang").strip().split(" ")[0] not in ("python", "py"):
            continue
        line = text.count("\n", 0, m.start("body")) + 1
        blocks.append((line, textwrap.dedent(m.group("body"))))
    return blocks


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


_RUNNER = """
import sys
namespace = {"__name__": "__main__"}
for where, source in BLOCKS:
    exec(compile(source, where, "exec"), namespace)

# Every adapter a page defines must pass the whole conformance grid, explicit and implicit:
# an example adapter in the docs is a promise to whoever copies it.
import abstractdiff as ad
from abstractdiff import testing

for obj in list(namespace.values()):
    if isinstance(obj, type) and issubclass(obj, ad.Backend) and obj.__module__ == "__main__":
        backend = obj()
        for target in (backend, ad.Implicit(backend)):
            report = testing.check_backend(target)
            if not report.ok:
                print(f"the example adapter {obj.__name__} fails the conformance grid:\\n{report}", file=sys.stderr)
                sys.exit(1)
        print(f"example adapter {obj.__name__}: conformance grid passed", file=sys.stderr)
"""

_PAGES_WITH_CODE = [p for p in pages() if python_blocks(p)]


@pytest.mark.parametrize("page", _PAGES_WITH_CODE, ids=_rel)
def test_examples_run(page: Path, tmp_path: Path) -> None:
    blocks = [(f"{_rel(page)}:{line}", source) for line, source in python_blocks(page)]
    script = tmp_path / "examples.py"
    script.write_text(f"BLOCKS = {blocks!r}\n{_RUNNER}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"an example of {_rel(page)} failed:\n{proc.stderr[-6000:]}"
    for name in re.findall(r"^class (\w+)\(", page.read_text(), re.M):
        assert f"example adapter {name}: conformance grid passed" in proc.stderr, f"{name} was not checked"


def test_adapter_guide_lists_every_hook() -> None:
    """docs/guide/adapters.md documents exactly the hooks of abstractdiff._hooks.HOOKS."""
    from abstractdiff._hooks import HOOKS

    text = (DOCS / "guide" / "adapters.md").read_text()
    first_cells = re.findall(r"^\| ([^|]+) \|", text, re.M)
    documented = {name for cell in first_cells for name in re.findall(r"`(\w+)", cell)} - {"method", "hook"}
    hooks = {h for group in HOOKS.values() for h in group}
    assert not hooks - documented, f"hooks missing from docs/guide/adapters.md: {sorted(hooks - documented)}"
    unknown = {name for name in documented if not hasattr(ad.Backend, name)}
    assert not unknown, f"docs/guide/adapters.md documents hooks that do not exist: {sorted(unknown)}"


def test_block_extraction() -> None:
    text = "intro\n```python\nx = 1\n```\n\n```sh\nmake demo\n```\n  ```python\n  y = 2\n  ```\n"
    assert blocks_in(text) == [(3, "x = 1\n"), (10, "y = 2\n")]


# ------------------------------------------------------------------ docstrings
# `make test` runs `--doctest-modules abstractdiff`, which does not reach the adapters
# (installed as abstractdiff.adapters from adapters/): run their examples here.
@pytest.mark.parametrize("module", ["abstractdiff.adapters.implicit", "abstractdiff.adapters.finite_differences"])
def test_adapter_docstring_examples_run(module: str) -> None:
    import doctest

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {module} failed (see the output above)"


# ------------------------------------------------------------------ API page
def _api_objects() -> dict[int, str]:
    """``id(object) -> identifier`` for every ``::: identifier`` entry of docs/api.md."""
    found = {}
    for ident in re.findall(r"^:::\s*([\w.]+)", (DOCS / "api.md").read_text(), re.M):
        module_path, _, name = ident.rpartition(".")
        if module_path.split(".")[0] == "adapters":  # mkdocstrings reads adapters/ from the source tree
            module_path = "abstractdiff." + module_path
        obj = getattr(importlib.import_module(module_path), name)
        found[id(obj)] = ident
    return found


def _public() -> list[tuple[str, object]]:
    out = [(f"abstractdiff.{n}", getattr(ad, n)) for n in ad.__all__ if n not in ("optim", "testing")]
    out += [(f"abstractdiff.optim.{n}", getattr(ad.optim, n)) for n in ad.optim.__all__]
    out += [(f"abstractdiff.optim.schedules.{n}", getattr(ad.optim.schedules, n))
            for n in ad.optim.schedules.__all__ if n != "Schedule"]
    out += [(f"abstractdiff.testing.{n}", getattr(ad.testing, n)) for n in ad.testing.__all__]
    return out


def test_every_public_name_is_on_the_api_page() -> None:
    documented = _api_objects()
    missing = [name for name, obj in _public() if id(obj) not in documented]
    assert not missing, f"public names missing from docs/api.md (add a '::: path' entry): {missing}"


def test_public_functions_have_a_signature_line_and_an_example() -> None:
    """Each public function's docstring shows how it is called (``name(...)``) and a
    doctest example (run by ``--doctest-modules``)."""
    import inspect

    lacking = []
    for qualified, obj in _public():
        if not inspect.isfunction(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        name = qualified.rpartition(".")[2]
        if f"{name}(" not in doc or ">>>" not in doc:
            lacking.append(qualified)
    assert not lacking, f"public functions without a signature line or an example in their docstring: {lacking}"


def test_api_page_lists_only_real_objects() -> None:
    # _api_objects raises AttributeError/ImportError for an entry that does not exist.
    assert len(_api_objects()) >= len(ad.__all__) - 2


# ------------------------------------------------------------------ the backend matrix
def _hooks():
    spec = importlib.util.spec_from_file_location("_abstractdiff_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_backend_matrix_reads_the_adapters_right() -> None:
    """The hook reads the adapters' source without importing them; check what it reads
    against the imported classes wherever the library is installed."""
    import inspect

    from abstractdiff import _registry
    from abstractdiff.protocol import PER_CALL_ROUTES

    records = {r["name"]: r for r in _hooks().adapters()}
    assert set(records) == set(_registry._BUILTIN)
    for name in ad.available_backends():
        if name not in records:
            continue
        module_name, _, attr = records[name]["target"].partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
        flat = {m for m in vars(cls) if m.startswith("flat_")}
        routes = getattr(cls, "fast_routes", None)
        if "Adapter" in [base.__name__ for base in cls.__bases__]:  # of the protocol: its routes and primitives
            flat |= {f"flat_{op}" for op in routes}
            flat |= {f"flat_{PER_CALL_ROUTES[op]}" for op in routes if op in PER_CALL_ROUTES}  # written once
            flat |= {f"flat_{m}" for m in ("value_and_pullback", "value_and_pushforward") if m in vars(cls)}
        assert flat == {m for m in records[name]["methods"] if m.startswith("flat_")}, name
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        read = [o.split("=")[0].lstrip("*") for o in records[name]["options"]]
        assert set(read) <= set(params), (name, read, params)
    assert "flat_prepare_value_and_gradient" in records["jax"]["methods"]  # a fast route of the protocol
    assert "hvp" in records["implicit"]["refused"]


def test_backend_matrix_lists_known_gaps() -> None:
    hooks = _hooks()
    assert "None" in hooks.gaps_table({})
    table = hooks.gaps_table({("torch@gpu", "mlp_loss", "hessian"): "a reason"})
    assert "`torch@gpu`" in table and "a reason" in table


# ------------------------------------------------------------------ the site
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install 'abstractdiff[docs]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install 'abstractdiff[docs]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1"),
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert (tmp_path / "site" / "backends" / "index.html").exists()
    html = (tmp_path / "site" / "backends" / "index.html").read_text()
    assert "matrix:" not in html, "a backend-matrix marker was not filled in by docs/hooks.py"


def test_example_usage_lines_parse() -> None:
    """Every `python examples/X.py ...` line of an example's docstring is accepted by its parser."""
    import shlex

    spec = importlib.util.spec_from_file_location("digits_example", ROOT / "examples" / "digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = [ln.split("#")[0].strip() for ln in module.__doc__.splitlines() if "python examples/digits.py" in ln]
    assert lines
    for line in lines:
        argv = shlex.split(line)[2:]
        module.build_parser().parse_args(argv)  # SystemExit (a test failure) on an unknown flag


def test_step_info_is_exported() -> None:
    from abstractdiff._train import StepInfo

    assert ad.StepInfo is StepInfo and "StepInfo" in ad.__all__

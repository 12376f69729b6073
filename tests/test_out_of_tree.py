"""An out-of-tree adapter gets the whole of abstractdiff from one module.

``tests/outoftree`` is a separate distribution, ``abstractdiff-minitape``: ``minitape``,
a small numpy-based array library with its own tape-based reverse mode that the core
has never heard of, and ``abstractdiff_minitape``, its adapter (one module), registered
through the ``abstractdiff.backends`` entry point of its ``pyproject.toml``.  Nothing is
installed: each check runs in a subprocess with ``tests/outoftree`` on ``PYTHONPATH``
beside a temporary directory holding the ``*.dist-info`` that ``pip install`` would
write (generated from that ``pyproject.toml``).

The in-process feature checks live in ``tests/outoftree/outoftree_checks.py`` and run
in one subprocess; each of its sections is one test here.  ``abstractdiff check`` and
the packaged conformance suite run in subprocesses of their own.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTOFTREE = ROOT / "tests" / "outoftree"
ENTRY_POINT = ("abstractdiff.backends", "minitape", "abstractdiff_minitape:MinitapeBackend")
TIMEOUT = 600


def _pyproject() -> dict:
    with open(OUTOFTREE / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the distribution's metadata, as ``pip install tests/outoftree`` writes it."""
    project = _pyproject()["project"]
    root = tmp_path_factory.mktemp("site")
    dist = project["name"].replace("-", "_")
    info = root / f"{dist}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n", encoding="utf-8"
    )
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    packages = _pyproject()["tool"]["setuptools"]["packages"]
    (info / "top_level.txt").write_text("\n".join(packages) + "\n", encoding="utf-8")
    return root


def _env(*paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("ABSTRACTDIFF_BACKENDS", None)  # the suite's backend selection must not leak in
    return env


def _run(site: Path, *args: str, installed: bool = True) -> subprocess.CompletedProcess:
    """``python *args`` in a user's project directory (not this repository, not ``site``)."""
    project = site.parent / f"{site.name}-project"
    project.mkdir(exist_ok=True)
    env = _env(site, OUTOFTREE) if installed else _env(OUTOFTREE)
    return subprocess.run([sys.executable, *args], cwd=project, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


@pytest.fixture(scope="module")
def results(site: Path) -> dict[str, str]:
    """Every section of ``outoftree_checks.py``, run once in a fresh process: name -> "ok" or traceback."""
    out = site / "results.json"
    done = _run(site, str(OUTOFTREE / "outoftree_checks.py"), str(out))
    if not out.exists():
        pytest.fail(f"the feature checks did not run:\n{done.stdout}\n{done.stderr}")
    return json.loads(out.read_text(encoding="utf-8"))


def _section(results: dict[str, str], name: str) -> None:
    assert name in results, f"section {name!r} did not run"
    assert results[name] == "ok", f"section {name!r} failed:\n{results[name]}"


# ------------------------------------------------------------------ packaging
def test_pyproject_declares_the_entry_point_that_is_installed(site: Path) -> None:
    config = _pyproject()
    group, name, value = ENTRY_POINT
    assert config["project"]["entry-points"] == {group: {name: value}}
    assert sorted(config["tool"]["setuptools"]["packages"]) == ["abstractdiff_minitape", "minitape"]
    # what the tests install is what pyproject.toml declares, read back as importlib sees it
    (info,) = site.glob("*.dist-info")
    dist = importlib.metadata.Distribution.at(info)
    assert dist.metadata["Name"] == config["project"]["name"] == "abstractdiff-minitape"
    assert [(ep.group, ep.name, ep.value) for ep in dist.entry_points] == [ENTRY_POINT]
    parsed = configparser.ConfigParser(delimiters=("=",))
    parsed.read(info / "entry_points.txt", encoding="utf-8")
    assert dict(parsed[group]) == {name: value}


def test_the_adapter_is_one_module_using_public_names_only() -> None:
    package = OUTOFTREE / "abstractdiff_minitape"
    assert sorted(p.name for p in package.iterdir() if p.suffix == ".py") == ["__init__.py"]
    tree = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
    core = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            core += [a.name for a in node.names if a.name.partition(".")[0] == "abstractdiff"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").partition(".")[0] == "abstractdiff":
            core.append(node.module)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ad":
            assert not node.attr.startswith("_"), f"the adapter uses the private ad.{node.attr}"
    assert core == ["abstractdiff"], f"the adapter imports {core}; it needs only the public package"


def test_the_core_never_names_minitape() -> None:
    named = []
    for folder in ("abstractdiff", "adapters"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                if "minitape" in path.read_text(encoding="utf-8", errors="replace").lower():
                    named.append(str(path.relative_to(ROOT)))
    assert not named, f"the core names minitape in {named}"


def test_the_backend_comes_only_from_the_entry_point(site: Path, results: dict[str, str]) -> None:
    code = (
        "import abstractdiff as ad, minitape\n"
        "assert 'minitape' not in ad.registered_backends()\n"
        "try:\n    ad.backend('minitape')\n"
        "except ad.UnknownBackendError as err:\n    print('unknown:', err)\n"
    )
    done = _run(site, "-c", code, installed=False)  # the packages importable, the metadata absent
    assert done.returncode == 0, done.stdout + done.stderr
    assert "unknown: no backend named 'minitape'" in done.stdout
    _section(results, "entry_point")  # with the metadata: found, and it is the adapter's class


# ------------------------------------------------------------------ features (one subprocess)
def test_minitape_dispatches_through_autoray_and_differentiates_twice(results: dict[str, str]) -> None:
    _section(results, "library")


def test_every_default_scenario_and_operator_passes_check_backend(results: dict[str, str]) -> None:
    _section(results, "conformance")


def test_every_operator_and_prepared_operator(results: dict[str, str]) -> None:
    _section(results, "operators")


def test_to_numpy_on_arrays_parameters_and_trees(results: dict[str, str]) -> None:
    _section(results, "to_numpy")


def test_implicit_mode_with_minitape_parameters_and_modules(results: dict[str, str]) -> None:
    _section(results, "implicit")


def test_optimisers_explicit_and_implicit(results: dict[str, str]) -> None:
    _section(results, "optimisers")


def test_train_explicit_and_implicit(results: dict[str, str]) -> None:
    _section(results, "training")


def test_checkpoints_round_trip(results: dict[str, str]) -> None:
    _section(results, "checkpoints")


def test_objects_are_recognised_before_the_backend_is_created(results: dict[str, str]) -> None:
    """In a fresh process, the core finds minitape's objects without ad.backend('minitape') first:
    the entry point's distribution ships the minitape package."""
    _section(results, "before_backend_created")


# ------------------------------------------------------------------ the command line and the packaged suite
def test_abstractdiff_check_passes_with_training_parity(site: Path) -> None:
    report = site / "check.json"
    done = _run(site, "-m", "abstractdiff.cli", "check", "--backend", "minitape", "--no-progress",
                "--json", str(report))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert out.rstrip().splitlines()[-1].startswith("PASS:"), out
    for row in ("minitape float64", "implicit(minitape) float64", "minitape float32", "implicit(minitape) float32"):
        line = next((ln for ln in out.splitlines() if ln.startswith(row + " ")), None)
        assert line is not None and "ok" in line and "FAIL" not in line and "ERROR" not in line, (row, out)
    for mode in ("explicit", "implicit"):
        for dtype in ("float64", "float32"):
            row = rf"^\s+minitape\s+{mode}\s+cpu\s+{dtype}\s+ok\s+max rel diff"
            assert re.search(row, out, re.M), (mode, dtype, out)
    data = json.loads(report.read_text(encoding="utf-8"))
    assert data["ok"] and data["backends"] == ["minitape"]
    parity = data["training_parity"]["results"]
    runs = {(r["mode"], r["dtype"]): r["status"] for r in parity if r["backend"] == "minitape"}
    assert runs == {(m, d): "pass" for m in ("explicit", "implicit") for d in ("float64", "float32")}, runs


def test_packaged_conformance_suite_passes(site: Path) -> None:
    done = _run(site, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-rfEs", "--pyargs",
                "abstractdiff.testing.suite", "--ad-backend", "minitape")
    last = done.stdout.rstrip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in last and "failed" not in last, done.stdout

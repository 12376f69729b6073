"""An out-of-tree adapter author runs the packaged suite with one command.

    pytest --pyargs abstractdiff.testing.suite --ad-backend NAME

The adapter here lives in a temporary directory, outside the package, and registers
through an ``abstractdiff.backends`` entry point (a ``*.dist-info/entry_points.txt`` on
``sys.path``, as ``pip install`` would write it) or through a plugin module calling
``ad.register_backend`` (``-p module``).  The suite must pass for a correct adapter and
fail, naming scenario and operator, for a broken one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ADAPTER = '''
from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend


class MyBackend(FiniteDifferencesBackend):
    name = "myad"


class MyBrokenBackend(MyBackend):
    """Reverse mode off by 0.1%."""

    def flat_value_and_gradient(self, fn, xs, data):
        y, aux, grads = super().flat_value_and_gradient(fn, xs, data)
        return y, aux, [g * 1.001 for g in grads]
'''

REGISTER = '''
import abstractdiff as ad

ad.register_backend("myad_plugin", "myad:MyBackend")
'''


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("third_party")
    (root / "myad.py").write_text(textwrap.dedent(ADAPTER))
    (root / "myad_register.py").write_text(textwrap.dedent(REGISTER))
    info = root / "myad-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myad\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[abstractdiff.backends]\nmyad = myad:MyBackend\nmyad_broken = myad:MyBrokenBackend\n"
    )
    return root


def run_suite(site: Path, *options: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("ABSTRACTDIFF_BACKENDS", None)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rfEs", "--pyargs",
               "abstractdiff.testing.suite", *options]
    # run from the temporary directory: the author's project, not this repository
    return subprocess.run(command, cwd=site, env=env, capture_output=True, text=True, timeout=600)


def test_correct_adapter_passes_through_its_entry_point(site: Path) -> None:
    result = run_suite(site, "--ad-backend", "myad")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "abstractdiff backends (asked for, must load): myad" in result.stdout
    assert "failed" not in result.stdout.splitlines()[-1]
    assert "passed" in result.stdout.splitlines()[-1]
    assert "myad: no GPU here" in result.stdout  # skipped with the reason, not silently


def test_broken_adapter_fails_naming_scenario_and_operator(site: Path) -> None:
    result = run_suite(site, "--ad-backend", "myad_broken", "-k", "float64")  # one dtype names the failure
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "FAILED" in out and "test_scenarios[myad_broken-cpu-float64]" in out
    assert "myad [cpu] sum_squares[float64] gradient (float64): gradient: max relative error 1.00e-03" in out


def test_adapter_registered_by_a_plugin_module(site: Path) -> None:
    result = run_suite(site, "-p", "myad_register", "--ad-backend", "myad_plugin", "-k", "float64")
    assert result.returncode == 0, result.stdout + result.stderr


def test_requested_backend_that_cannot_load_fails_the_run(site: Path) -> None:
    result = run_suite(site, "--ad-backend", "no_such_backend", "-k", "loads")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no backend named 'no_such_backend'" in result.stdout

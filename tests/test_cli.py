"""``abstractdiff check`` on the finite-differences backend (no AD library needed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend

import abstractdiff as ad
from abstractdiff import cli

FAST = ["--backend", "finite_differences", "--jobs", "1", "--no-progress"]


class OffByATenthPercent(FiniteDifferencesBackend):
    name = "broken_fd"

    def flat_value_and_gradient(self, fn, xs, data):
        y, aux, grads = super().flat_value_and_gradient(fn, xs, data)
        return y, aux, [g * 1.001 for g in grads]


def test_check_passes_and_writes_json(capsys, tmp_path):
    path = tmp_path / "report.json"
    assert cli.main(["check", *FAST, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("backend "))
    for column in ("gradient", "value_grad", "pullback", "pushforward", "derivative", "jacobian", "hessian", "hvp",
                   "prepared", "time"):
        assert column in header
    fd64 = next(line for line in lines if line.startswith("finite_differences float64 "))
    assert fd64.count("ok ") == 16 and "FAIL" not in fd64  # 14 operators, numpy inputs, prepared
    assert any(line.startswith("implicit(finite_differences) float32 ") for line in lines)
    assert "finite_differences   gpu vs cpu: skipped: no GPU here (its devices: cpu)" in out
    assert "float64: 1 of 1 pairs agree" in out  # explicit vs implicit
    assert "training parity" in out
    assert lines[-1].startswith("PASS: 4 backend x device x dtype runs")

    data = json.loads(path.read_text())
    assert data["ok"] is True and data["failures"] == [] and data["problems"] == []
    assert data["backends"] == ["finite_differences"] and data["dtypes"] == ["float64", "float32"]
    assert {r["backend"] for r in data["reports"]} == {"finite_differences", "implicit(finite_differences)"}
    first = data["reports"][0]["results"][0]
    assert set(first) >= {"scenario", "operator", "ok", "max_error", "rtol", "seconds", "dtype"}
    assert data["devices"] == [{"backend": "finite_differences", "skipped": "no GPU here (its devices: cpu)"}]
    assert data["agreement"][0]["ok"] is True
    assert data["training_parity"] is None or "ok" in data["training_parity"]


def test_broken_backend_exits_1_and_names_scenario_and_operator(capsys, tmp_path, clean_registry):
    ad.register_backend("broken_fd", OffByATenthPercent)
    path = tmp_path / "broken.json"
    argv = ["check", "--backend", "broken_fd", "--jobs", "1", "--no-progress", "--no-training", "--dtype", "float64",
            "--scenario", "sum_squares", "--json", str(path)]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("broken_fd float64 "))
    assert "FAIL 1.0e-03" in row
    assert "broken_fd [cpu] sum_squares[float64] gradient (float64): gradient: max relative error 1.00e-03" in out
    assert out.splitlines()[-1].startswith("FAIL: ")
    data = json.loads(path.read_text())
    assert data["ok"] is False
    assert any("sum_squares[float64] value_and_gradient" in f for f in data["failures"])


def test_requested_backend_that_cannot_load_fails(capsys):
    assert cli.main(["check", "--backend", "no_such_backend", "--jobs", "1", "--no-progress", "--no-training"]) == 1
    out = capsys.readouterr().out
    assert "no_such_backend: cannot load: UnknownBackendError: no backend named 'no_such_backend'" in out


def test_dtype_device_and_scenario_options(capsys):
    argv = [*FAST, "--dtype", "float32", "--device", "cpu", "--scenario", "rosenbrock", "--no-implicit",
            "--no-training"]
    assert cli.main(["check", *argv]) == 0
    out = capsys.readouterr().out
    assert "finite_differences float32 " in out and "finite_differences float64 " not in out
    assert "implicit(" not in out
    assert "skipped: --device cpu" in out
    assert "training parity: skipped (--no-training)" in out
    assert "PASS: 1 backend x device x dtype runs, 10 checks" in out  # 8 operators + numpy inputs + prepared


def test_progress_goes_to_stderr(capsys):
    assert cli.main(["check", "--backend", "finite_differences", "--jobs", "1", "--scenario", "sum_squares",
                     "--no-training"]) == 0
    captured = capsys.readouterr()
    assert "/8" in captured.err  # tqdm's bar or the plain "[n/8] label" line: 2 dtypes x 2 modes x (cpu, gpu)
    assert "\r" not in captured.out


def test_plain_progress_without_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    progress = cli._Progress(total=2, enabled=True)
    progress.update("torch cpu float64")
    progress.close()
    assert "[1/2] torch cpu float64" in capsys.readouterr().err


def test_missing_parity_module_is_reported(capsys, monkeypatch):
    monkeypatch.setattr(cli, "PARITY_MODULE", "abstractdiff._no_parity_here")
    assert cli.main(["check", *FAST, "--scenario", "sum_squares", "--no-implicit"]) == 0
    assert "training parity: not available (abstractdiff._no_parity_here is not installed)" in capsys.readouterr().out


def test_worker_processes(capsys):
    argv = ["check", "--backend", "finite_differences", "--jobs", "2", "--no-progress", "--no-training",
            "--scenario", "rosenbrock"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "finite_differences float64 " in out and "finite_differences float32 " in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "--scenario", "nope"], "unknown scenario(s) nope"),
        (["check", "--jobs", "0"], "--jobs must be at least 1"),
        (["check", "--dtype", "float16"], "invalid choice"),
        (["check", "--device", "tpu"], "invalid choice"),
    ],
)
def test_bad_options(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_console_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "abstractdiff.cli", "check", *FAST, "--scenario", "sum_squares", "--no-training"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout


def test_importing_the_harness_and_cli_loads_no_ad_library():
    code = ("import sys, abstractdiff.testing, abstractdiff.testing.suite, abstractdiff.cli; "
            "from abstractdiff import testing; testing.default_scenarios(); "
            "print(sorted(m for m in ('torch', 'jax', 'tensorflow', 'autograd') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

"""Keras 3 models in implicit mode on each Keras backend: ``ad.Implicit(<its backend>)``.

Keras selects its backend when it is imported, so each backend's checks run in their own
process (tests/keras_worker.py with ``KERAS_BACKEND`` set), all three at once; the worker
prints its measurements as JSON and these tests assert on them.  A backend whose library
(or Keras) is not installed is skipped, with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("keras_worker.py")
EXAMPLE = ROOT / "examples" / "keras_three_backends.py"
BACKENDS = ("tensorflow", "torch", "jax")


def _missing(backend: str) -> str | None:
    for module in ("keras", backend):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install {module})"
    return None


def _env(backend: str) -> dict[str, str]:
    return dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3",
                OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, dict]:
    """Every installed backend's worker, launched together: ``{backend: results}``, or the
    worker's stderr under ``"error"`` when it failed.  Under pytest-xdist the workers run
    once per session, not once per xdist process (pytest-xdist's documented file-lock recipe)."""
    if getattr(request.config, "workerinput", None) is None or importlib.util.find_spec("filelock") is None:
        return _launch()
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "keras_worker_results.json"
    with FileLock(f"{shared}.lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(_launch()))
        return json.loads(shared.read_text())


def _launch() -> dict[str, dict]:
    procs = {
        b: subprocess.Popen([sys.executable, str(WORKER)], env=_env(b), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
        for b in BACKENDS if _missing(b) is None
    }
    results = {}
    for b, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += "\n(timed out after 240 s)"
        lines = out.strip().splitlines()
        results[b] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": err[-6000:]}
    return results


@pytest.fixture(params=BACKENDS)
def run(request, runs) -> dict:
    reason = _missing(request.param)
    if reason is not None:
        pytest.skip(reason)
    result = runs[request.param]
    assert "error" not in result, f"the {request.param} worker failed:\n{result.get('error')}"
    assert result["backend"] == request.param
    return result


def test_gradient_equals_central_differences(run) -> None:
    g = run["gradient"]
    assert g["n_params"] == 4  # two Dense layers: kernels and biases
    assert g["value_err"] < 1e-5
    assert g["grad_err"] <= 1e-4 * max(g["grad_scale"], 1.0)  # float32 AD vs float64 differences
    assert g["pullback_err"] <= 1e-6
    assert g["aliases"], "a gradient is found by the Keras variable and by the tensor it wraps"
    assert g["grad_untouched"], "implicit mode must not accumulate into .grad"


def test_train_step_equals_keras_sgd_train_on_batch(run) -> None:
    assert run["sgd"]["same_model"]
    assert run["sgd"]["max_diff"] <= 1e-5


def test_batchnorm_moving_statistics_are_state_not_parameters(run) -> None:
    bn = run["sgd_batchnorm"]
    assert bn["frozen"] == 2 and bn["state_size"] == 6  # moving mean and variance are not trained
    assert bn["moving_changed"] > 1e-4  # ... but updated by the forward pass in training mode
    assert bn["max_diff"] <= 1e-5  # every weight, moving statistics included, as Keras's own step


def test_train_decreases_the_loss(run) -> None:
    losses = run["train"]["losses"]
    assert run["train"]["steps"] == 12
    assert losses[-1] < 0.5 * losses[0], losses


def test_checkpoint_round_trip(run) -> None:
    c = run["checkpoint"]
    assert c["same_model"] and c["moving_nonzero"]
    assert c["loaded_diff"] == 0.0  # every variable, BatchNormalization's statistics too
    assert c["next_step_diff"] == 0.0  # the optimiser state came back too


def test_another_backend_is_refused_naming_the_right_one(run) -> None:
    m = run["mismatch"]
    if "skipped" in m:
        pytest.skip(m["skipped"])
    assert m["error"] == "ModeMismatchError"
    assert f"ad.Implicit('{run['backend']}')" in m["message"]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("keras_three_backends_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_the_same_on_every_backend(example, runs) -> None:
    """The example's training ran in each worker: the curves agree as the example requires."""
    curves = {b: r["example"] for b, r in runs.items() if "error" not in r}
    if len(curves) < 2:
        pytest.skip("needs keras and two of tensorflow, torch, jax")
    assert all(len(c) == 8 for c in curves.values())  # 2 epochs of 4 batches
    assert example.largest_difference(curves) <= example.RTOL


def test_example_main_runs_a_backend_in_a_subprocess(example, capsys) -> None:
    if _missing("torch") is not None:
        pytest.skip(_missing("torch"))
    assert example.main(["--backends", "torch", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torch       loss ") and "passed" in out


def test_example_fails_when_the_curves_disagree(example) -> None:
    same = {"torch": [1.0, 0.5], "jax": [1.0, 0.5 + 1e-7]}
    assert example.largest_difference(same) < example.RTOL
    assert example.largest_difference({"torch": [1.0, 0.5], "jax": [1.0, 0.6]}) > example.RTOL

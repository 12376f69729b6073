"""MLX: second derivatives through a dense-solve ``ad.custom_root``, compiled and not.

MLX's LUF kernel (behind ``mx.linalg.solve``) records its LU output's size in bytes where MLX
counts elements; a compiled solve of a 1x1 float64 system fused a kernel that wrote past the
buffer and corrupted the heap (segfaults, ``corrupted size vs. prev_size``), which is the
scalar ``custom_root(..., solve="dense")`` under ``compile=True``.  The portable solve routes
1x1 systems around it (abstractdiff/portable/mlx.py).  A crash kills the process, so the
cases run in a subprocess, several times each: a crash fails the test, not the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad

pytest.importorskip("mlx.core")

# Prints one JSON line: {name: [value of each repetition]}.
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import abstractdiff as ad
    from autoray import numpy as anp

    REPEAT = int(sys.argv[1])

    # the guide's ridge regression (docs/guide/custom-derivatives.md): a 3x3 system
    def ridge_optimality(w, lam, X, y):
        return X.T @ (X @ w - y) + lam * w

    @ad.custom_root(ridge_optimality, solve="dense")
    def ridge(init, lam, X, y):
        w, lam, X, y = ad.stop_gradient((init, lam, X, y))
        hessian = X.T @ X + lam * anp.eye(X.shape[1], like=X)
        for _ in range(2):
            w = w - anp.linalg.solve(hessian, ridge_optimality(w, lam, X, y))
        return w

    def validation_loss(lam, X, y, Xv, yv):
        w = ridge(anp.zeros_like(X[0]), lam, X, y)
        return anp.sum((Xv @ w - yv) ** 2)

    rng = np.random.default_rng(1)
    X, Xv = rng.normal(size=(20, 3)), rng.normal(size=(10, 3))
    w_true = np.array([1.0, -2.0, 0.5])
    y, yv = X @ w_true + rng.normal(size=20), Xv @ w_true + rng.normal(size=10)

    # one weight: every linear system (the solver's, the implicit function theorem's) is 1x1
    X1, y1 = X[:, :1], y

    def one_weight(lam, X1, y1):
        lam = anp.reshape(lam, (1,))
        return anp.sum(ridge(anp.zeros_like(lam), lam, X1, y1))

    # compiled: the 1x1 systems that crashed (each new compiled MLX kernel costs a C++ compile on
    # a cold cache, so the guide's 3x3 case, which did not crash, runs eagerly only)
    runs = {
        "guide": lambda b: ad.second_derivative(b, validation_loss, np.array(2.0), X, y, Xv, yv),
        "one_weight": lambda b: ad.second_derivative(b, one_weight, np.array(0.7), X1, y1),
        "solve_1x1": lambda b: ad.gradient(
            b, lambda a, rhs: anp.sum(anp.linalg.solve(a, rhs)), np.array([[0.8]]), np.array([[1.5]])),
    }
    out = {}
    for compile in (False, True):
        b = ad.backend("mlx", compile=compile)
        for name, run in runs.items():
            if compile and name == "guide":
                continue
            out[f"{name} compile={compile}"] = [float(np.sum(ad.to_numpy(run(b)))) for _ in range(REPEAT)]
    print(json.dumps(out))
    """
)


def _closed_forms() -> dict[str, float]:
    rng = np.random.default_rng(1)
    X, Xv = rng.normal(size=(20, 3)), rng.normal(size=(10, 3))
    w_true = np.array([1.0, -2.0, 0.5])
    y, yv = X @ w_true + rng.normal(size=20), Xv @ w_true + rng.normal(size=10)
    # L(lam) = |Xv w - yv|^2, w = A^-1 X^T y, A = X^T X + lam I: w' = -A^-1 w, w'' = -2 A^-1 w'
    A = X.T @ X + 2.0 * np.eye(3)
    w = np.linalg.solve(A, X.T @ y)
    dw = -np.linalg.solve(A, w)
    d2w = -2 * np.linalg.solve(A, dw)
    guide = 2 * (Xv @ dw) @ (Xv @ dw) + 2 * (Xv @ w - yv) @ (Xv @ d2w)
    # one weight: w = s / (q + lam), w'' = 2 s / (q + lam)^3
    q, s = X[:, 0] @ X[:, 0], X[:, 0] @ y
    # d/da sum(b / a) = -b / a^2
    return {"guide": guide, "one_weight": 2 * s / (q + 0.7) ** 3, "solve_1x1": -1.5 / 0.8**2}


def test_second_derivative_through_dense_custom_root_is_right_and_does_not_crash() -> None:
    assert _closed_forms()["guide"] == pytest.approx(0.669573, abs=1e-6)  # the guide's number
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, "5"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert proc.returncode == 0, f"the subprocess died (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = _closed_forms()
    assert len(got) == 2 * len(expected) - 1
    for name, values in got.items():
        assert values == pytest.approx([expected[name.split()[0]]] * len(values), rel=1e-7), name


@pytest.mark.parametrize("compile", [False, True])
def test_stop_gradient_of_mlx_and_numpy_leaves_together(compile: bool) -> None:
    # a solver stopping (init, lam, X, y) where X and y are numpy constants: the numpy leaves
    # are constants already and come back as they are (MLX's stop_gradient refused them: TypeError)
    C = np.array([2.0, 3.0])

    def f(x):
        x_stopped, c = ad.stop_gradient((x, C))
        assert c is C
        return anp.sum(x * x * x_stopped + c)

    x = np.array([1.0, 2.0])
    g = ad.gradient(ad.backend("mlx", compile=compile), f, x)
    np.testing.assert_allclose(ad.to_numpy(g), 2 * x * x)  # d/dx x^2 * stop(x) = 2 x * x

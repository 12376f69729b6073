"""ad.jacobian_operator and ad.hessian_operator: scipy LinearOperators on every backend,
against dense Jacobians and Hessians, in scipy's own solvers."""

from __future__ import annotations

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff._registry import unavailable_reason

scipy_linalg = pytest.importorskip("scipy.sparse.linalg")
from scipy.optimize import minimize  # noqa: E402

BACKENDS = ("autograd", "finite_differences", "jax", "mlx", "paddle", "pytensor", "tensorflow", "torch")
RNG = np.random.default_rng(7)
_M = RNG.normal(size=(5, 5))
A = _M @ _M.T + 5 * np.eye(5)
X0 = np.linspace(-1.0, 1.0, 5)
HESSIAN = A - np.diag(np.sin(X0))  # of 0.5 x^T A x + sum(sin x)


def _backend(name: str) -> ad.Backend:
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return ad.backend(name)


def _objective(b: ad.Backend):
    a = b.from_numpy(A)

    def f(x):
        return 0.5 * anp.sum(x * anp.tensordot(a, x, axes=1)) + anp.sum(anp.sin(x))

    return f


def _tol(b: ad.Backend) -> float:
    return 1e-5 if b.name == "finite_differences" else 1e-10


@pytest.mark.parametrize("name", BACKENDS)
def test_the_hessian_operator_is_the_dense_hessian(name: str) -> None:
    b = _backend(name)
    H = ad.hessian_operator(b, _objective(b), b.from_numpy(X0))
    assert H.shape == (5, 5) and H.dtype == np.float64
    np.testing.assert_allclose(H @ np.eye(5), HESSIAN, rtol=_tol(b), atol=_tol(b))
    np.testing.assert_allclose(H.rmatvec(X0), HESSIAN @ X0, rtol=_tol(b), atol=_tol(b))


@pytest.mark.parametrize("name", BACKENDS)
def test_the_jacobian_operator_is_the_dense_jacobian_both_ways(name: str) -> None:
    b = _backend(name)
    a = b.from_numpy(A[:3])
    J = ad.jacobian_operator(b, lambda x: anp.tensordot(a, x, axes=1) ** 2, b.from_numpy(X0))
    dense = 2 * np.diag(A[:3] @ X0) @ A[:3]
    assert J.shape == (3, 5)
    t = _tol(b)
    np.testing.assert_allclose(J @ X0, dense @ X0, rtol=t, atol=t)  # pushforward
    np.testing.assert_allclose(J.T @ np.ones(3), dense.T @ np.ones(3), rtol=t, atol=t)  # pullback
    np.testing.assert_allclose(J @ np.eye(5), dense, rtol=t, atol=t)  # matmat: one batched pushforward


@pytest.mark.parametrize("name", ["jax", "torch", "autograd", "tensorflow"])
def test_minres_gives_the_newton_step_and_eigsh_the_largest_eigenvalue(name: str) -> None:
    b = _backend(name)
    f = _objective(b)
    x = b.from_numpy(X0)
    H = ad.hessian_operator(b, f, x)
    g = np.asarray(ad.to_numpy(ad.gradient(b, f, x)))
    step, info = scipy_linalg.minres(H, -g, rtol=1e-12)
    assert info == 0
    np.testing.assert_allclose(step, np.linalg.solve(HESSIAN, -g), rtol=1e-8, atol=1e-10)
    largest = scipy_linalg.eigsh(H, k=1, which="LA", return_eigenvectors=False)[0]
    assert largest == pytest.approx(np.linalg.eigvalsh(HESSIAN).max(), rel=1e-10)
    cg_step, info = scipy_linalg.cg(H, -g, rtol=1e-12)
    np.testing.assert_allclose(cg_step, step, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_least_squares_and_gmres_on_the_jacobian(name: str) -> None:
    b = _backend(name)
    a = b.from_numpy(A)
    J = ad.jacobian_operator(b, lambda x: anp.tensordot(a, x, axes=1), b.from_numpy(X0))  # J = A
    rhs = A @ X0
    np.testing.assert_allclose(scipy_linalg.lsqr(J, rhs, atol=1e-14, btol=1e-14)[0], X0, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(scipy_linalg.gmres(J, rhs, rtol=1e-13)[0], X0, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("method", ["trust-krylov", "Newton-CG"])
@pytest.mark.parametrize("name", ["jax", "torch", "autograd"])
def test_scipy_minimize_with_hessp(name: str, method: str) -> None:
    b = _backend(name)
    f = _objective(b)

    def value(x):
        return float(ad.to_numpy(f(b.from_numpy(x))))

    def jac(x):
        return np.asarray(ad.to_numpy(ad.gradient(b, f, b.from_numpy(x))))

    def hessp(x, p):
        return ad.hessian_operator(b, f, b.from_numpy(x)) @ p

    result = minimize(value, X0, jac=jac, hessp=hessp, method=method, options={"gtol": 1e-10})
    assert result.success, result.message
    np.testing.assert_allclose(jac(result.x), np.zeros(5), atol=1e-8)


def test_a_pytree_x_is_raveled_in_pytree_order() -> None:
    b = _backend("jax")

    def f(p):
        return anp.sum(p["a"] ** 2) * anp.sum(p["b"]) + 0 * p["n"]

    p = {"a": np.array([1.0, 2.0]), "b": np.array([3.0]), "n": 4}
    H = ad.hessian_operator(b, f, p)
    dense = np.asarray(ad.to_numpy(ad.hessian(b, lambda v: f({"a": v[:2], "b": v[2:], "n": 4}),
                                              np.array([1.0, 2.0, 3.0]))))
    np.testing.assert_allclose(H @ np.eye(3), dense, rtol=1e-12)


def test_each_product_is_one_prepared_call_without_a_new_trace() -> None:
    b = _backend("jax")
    H = ad.hessian_operator(b, _objective(b), b.from_numpy(X0))
    H @ X0  # the first call compiles
    traced = b.adapter.trace_count
    for k in range(5):
        H @ np.eye(5)[k]
    assert b.adapter.trace_count == traced


def test_float32_x_gives_a_float32_operator() -> None:
    b = _backend("torch")
    a = b.from_numpy(A.astype(np.float32))
    x = b.from_numpy(X0.astype(np.float32))
    H = ad.hessian_operator(b, lambda x: 0.5 * anp.sum(x * anp.tensordot(a, x, axes=1)), x)
    assert H.dtype == np.float32 and (H @ X0.astype(np.float32)).dtype == np.float32
    np.testing.assert_allclose(H @ np.eye(5, dtype=np.float32), A, rtol=1e-5)


def test_bad_vectors_and_inputs_are_clear_errors() -> None:
    b = _backend("finite_differences")
    H = ad.hessian_operator(b, lambda x: (x**2).sum(), np.ones(3))
    with pytest.raises(ValueError):  # scipy checks a vector's shape against the operator's
        H @ np.ones(4)
    with pytest.raises(ad.ShapeMismatchError, match="size 4 for an operator on x of size 3"):
        H._matvec(np.ones(4))
    with pytest.raises(ad.NonDifferentiableInputError, match="no floating-point leaf"):
        ad.jacobian_operator(b, lambda n: np.ones(2) * n, 3)

"""Issue 45, items 7 and 9: scipy operators keep the point they were made at, and ad.Sparse
through a custom rule gives the rule's derivative.

* ``ad.jacobian_operator`` / ``ad.hessian_operator`` after the caller writes into ``x`` (or an
  argument) in place: every product (``J @ v``, ``J.T @ u``, ``J @ M``, ``H @ v``) is the
  derivative at the point the operator was made at, against closed forms.  A pytree output is
  a clear error naming the operator.
* ``ad.jacobian(ad.Sparse(b), g, x)`` / ``ad.hessian(ad.Sparse(b), g, x)`` through
  ``ad.custom_vjp``, ``ad.custom_jvp``, ``ad.custom_root`` and ``ad.stop_gradient`` whose rule
  mixes entries ``f`` keeps apart (or ``f`` has no derivative at all: a straight-through
  estimator over ``floor``), against the rule's closed-form derivative and the dense operator.
  ``finite_differences`` ignores rules by design, so the rule tests run on the exact backends.
"""

from __future__ import annotations

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff._registry import unavailable_reason

pytest.importorskip("scipy.sparse.linalg")

#: every backend that differentiates arrays ("implicit" wraps another backend, for variables)
BACKENDS = [n for n in ad.available_backends() if n != "implicit"]
#: those that honour custom rules (finite differences differentiate f itself, by design)
EXACT = [n for n in BACKENDS if n != "finite_differences"]

X0 = np.array([0.5, 1.0, 1.5, 2.0])
W0 = np.array([2.0, -1.0, 0.5, 3.0])
ONES = np.ones((4, 4))
EYE = np.eye(4)


def _backend(name: str) -> ad.Backend:
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return ad.backend(name)


def _tol(name: str) -> float:
    return 1e-5 if name == "finite_differences" else 1e-9


def _close(got: object, want: np.ndarray, name: str) -> None:
    got = got.toarray() if hasattr(got, "toarray") else np.asarray(ad.to_numpy(got))
    np.testing.assert_allclose(got, want, rtol=_tol(name), atol=_tol(name))


# ------------------------------------------------------------------ item 7: operators keep their point
@pytest.mark.parametrize("name", BACKENDS)
def test_jacobian_operator_is_the_jacobian_where_it_was_made_after_in_place_writes(name: str) -> None:
    b = _backend(name)
    x, w = X0.copy(), W0.copy()
    J = ad.jacobian_operator(b, lambda x, w: x**3 * w, x, w)
    x[...], w[...] = 7.0, -4.0  # the caller reuses its buffers
    dense = np.diag(3 * X0**2 * W0)  # at the point the operator was made at
    v, u = np.array([1.0, -2.0, 0.5, 3.0]), np.array([0.5, 1.0, -1.0, 2.0])
    _close(J @ v, dense @ v, name)  # pushforward (linearised on first use)
    _close(J.T @ u, dense.T @ u, name)  # pullback
    _close(J @ EYE, dense, name)  # matmat: one batched pushforward
    assert np.all(x == 7.0) and np.all(w == -4.0)  # and the caller's arrays are as the caller left them
    assert np.array_equal(v, [1.0, -2.0, 0.5, 3.0]) and np.array_equal(u, [0.5, 1.0, -1.0, 2.0])


@pytest.mark.parametrize("name", BACKENDS)
def test_hessian_operator_is_the_hessian_where_it_was_made_after_in_place_writes(name: str) -> None:
    b = _backend(name)
    x, w = X0.copy(), W0.copy()
    H = ad.hessian_operator(b, lambda x, w: anp.sum(w * x**4), x, w)
    x[...], w[...] = 7.0, -4.0
    dense = np.diag(12 * X0**2 * W0)
    v = np.array([1.0, -2.0, 0.5, 3.0])
    _close(H @ v, dense @ v, name)
    _close(H.T @ v, dense @ v, name)
    _close(H @ EYE, dense, name)
    assert np.all(x == 7.0) and np.all(w == -4.0)


@pytest.mark.parametrize("name", BACKENDS)
def test_operators_on_a_native_x_written_in_place_keep_their_point(name: str) -> None:
    b = _backend(name)
    x = b.from_numpy(X0.copy())
    try:
        x[...] = x  # does this library's array take in-place writes at all?
    except (TypeError, ValueError, NotImplementedError):
        pytest.skip(f"{name}'s arrays are immutable: nothing can change behind the operator")
    J = ad.jacobian_operator(b, lambda x: x**3, x)
    H = ad.hessian_operator(b, lambda x: anp.sum(x**4), x)
    x[...] = 2.0
    v = np.array([1.0, -2.0, 0.5, 3.0])
    _close(J @ v, 3 * X0**2 * v, name)
    _close(J.T @ v, 3 * X0**2 * v, name)
    _close(H @ v, 12 * X0**2 * v, name)
    np.testing.assert_allclose(np.asarray(ad.to_numpy(x)), 2.0)


@pytest.mark.parametrize("name", BACKENDS)
def test_operators_on_a_pytree_x_keep_their_point(name: str) -> None:
    b = _backend(name)
    p = {"a": X0[:3].copy(), "b": np.array([0.5]), "n": 3}
    J = ad.jacobian_operator(b, lambda p: p["a"] * p["b"] * p["n"], p)
    H = ad.hessian_operator(b, lambda p: anp.sum(p["a"] ** 2 * p["b"]) * p["n"], p)
    p["a"][...], p["b"][...] = 9.0, 4.0  # written in place
    p["n"] = 100  # and the container itself changed
    a, s = X0[:3], 0.5
    jac = np.concatenate([3 * s * np.eye(3), 3 * a[:, None]], axis=1)  # over (a, b) raveled
    _close(J @ np.eye(4), jac, name)
    _close(J.T @ np.ones(3), jac.T @ np.ones(3), name)
    hess = np.zeros((4, 4))
    hess[:3, :3] = 6 * s * np.eye(3)
    hess[:3, 3] = hess[3, :3] = 6 * a
    _close(H @ np.eye(4), hess, name)


@pytest.mark.parametrize("name", BACKENDS)
def test_jacobian_operator_of_a_pytree_output_is_a_clear_error(name: str) -> None:
    # f returns one array for every operator of abstractdiff; the operator's message says how
    # a pytree output fits (the scipy guide said it would take one)
    b = _backend(name)
    with pytest.raises(ad.InvalidOutputError, match=r"ad\.jacobian_operator.*concatenate its raveled leaves"):
        ad.jacobian_operator(b, lambda x: {"s": anp.sum(x), "c": x**2}, b.from_numpy(X0))


# ------------------------------------------------------------------ item 9: ad.Sparse through custom rules
@ad.custom_vjp
def mixed(x):
    """Elementwise in value (a diagonal f), but its rule mixes every entry: J = I + 1 1^T."""
    return x * 1.0


mixed.defvjp(lambda x: (x * 1.0, None), lambda _, ct: (ct + anp.sum(ct),))


@ad.custom_jvp
def mixed_forward(x):
    return x * 1.0


@mixed_forward.defjvp
def _mixed_forward_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x * 1.0, t + anp.sum(t)


@ad.custom_vjp
def straight_through(x):
    """floor in value (no derivative: an empty pattern), the identity in reverse mode."""
    return anp.floor(x)


straight_through.defvjp(lambda x: (anp.floor(x), None), lambda _, ct: (ct,))


@ad.custom_vjp
def coupled_cube(x):
    """x**3 in value; its rule's gradient of the sum is 3 x**2 + sum(x): H = diag(6 x) + 1 1^T."""
    return x**3


coupled_cube.defvjp(lambda x: (x**3, x), lambda x, ct: (3 * x**2 * ct + anp.sum(ct * x),))


def _sparse_and_dense_jacobian(b: ad.Backend, g, x, mode: str, want: np.ndarray, name: str) -> None:
    _close(ad.jacobian(ad.Sparse(b, mode=mode), g, x), want, name)
    _close(ad.jacobian(b, g, x), want, name)  # the dense operator agrees: the rule's derivative


@pytest.mark.parametrize("mode", ["auto", "reverse"])
@pytest.mark.parametrize("name", EXACT)
def test_sparse_jacobian_through_a_custom_vjp_that_mixes_entries(name: str, mode: str) -> None:
    b = _backend(name)
    _sparse_and_dense_jacobian(b, lambda x: 2.0 * mixed(x), b.from_numpy(X0), mode, 2 * (EYE + ONES), name)


@pytest.mark.parametrize("name", EXACT)
def test_sparse_jacobian_through_a_custom_jvp_that_mixes_entries(name: str) -> None:
    b = _backend(name)
    x = b.from_numpy(X0)
    _close(ad.jacobian(ad.Sparse(b, mode="forward"), mixed_forward, x), EYE + ONES, name)
    _close(ad.pushforward(b, mixed_forward, x)(b.from_numpy(EYE[0])), (EYE + ONES)[:, 0], name)


@pytest.mark.parametrize("name", EXACT)
def test_sparse_jacobian_of_a_straight_through_estimator_is_not_zero(name: str) -> None:
    # floor's pattern is empty: with f's pattern the sparse Jacobian was a silent zero matrix
    b = _backend(name)
    _sparse_and_dense_jacobian(b, lambda x: straight_through(x) * W0.sum(), b.from_numpy(X0), "auto",
                               W0.sum() * EYE, name)


@pytest.mark.parametrize("name", EXACT)
def test_sparse_hessian_through_a_rule_whose_gradient_couples_entries(name: str) -> None:
    b = _backend(name)
    want = np.diag(6 * X0) + ONES
    x = b.from_numpy(X0)
    _close(ad.hessian(ad.Sparse(b), lambda x: anp.sum(coupled_cube(x)), x), want, name)
    _close(ad.hessian(ad.Sparse(b, mode="reverse"), lambda x: anp.sum(coupled_cube(x)), x), want, name)


@pytest.mark.parametrize("name", EXACT)
def test_sparse_hessian_through_a_mixing_custom_vjp_is_the_dense_one(name: str) -> None:
    # The second derivative through mixed's output differentiates its rule again (2 J^T J) or its
    # fwd (2 J^T, jax's own custom_vjp): whichever the backend gives densely, the sparse
    # Hessian is it, never the diagonal that f's pattern kept; either way it is dense here
    b = _backend(name)
    x = b.from_numpy(X0)
    dense = np.asarray(ad.to_numpy(ad.hessian(b, lambda x: anp.sum(mixed(x) ** 2), x)))
    assert np.count_nonzero(dense) == dense.size
    _close(ad.hessian(ad.Sparse(b, mode="reverse"), lambda x: anp.sum(mixed(x) ** 2), x), dense, name)


@pytest.mark.parametrize("name", EXACT)
def test_sparse_derivatives_through_stop_gradient(name: str) -> None:
    b = _backend(name)
    x = b.from_numpy(X0)
    _close(ad.jacobian(ad.Sparse(b), lambda x: x[1:] ** 2 * ad.stop_gradient(x[:-1]), x),
           np.diag(2 * X0[1:] * X0[:-1], k=1)[:-1], name)
    _close(ad.hessian(ad.Sparse(b), lambda x: anp.sum(x**2 * ad.stop_gradient(x)), x), np.diag(2 * X0), name)


@pytest.mark.parametrize("name", EXACT)
def test_sparse_jacobian_through_custom_root(name: str) -> None:
    # the implicit rule is a custom function too: its block, its derivative (reverse mode)
    b = _backend(name)

    @ad.custom_root(lambda x, a: x**2 - a)
    def root(x0, a):
        return anp.sqrt(a) + 0.0 * x0

    def g(a):
        return root(anp.ones_like(a), a)[1:] * a[:-1]

    a0 = X0 + 1.0
    want = np.zeros((3, 4))
    rows = np.arange(3)
    want[rows, rows] = np.sqrt(a0[1:])  # d/da_i of sqrt(a_{i+1}) a_i
    want[rows, rows + 1] = a0[:-1] / (2 * np.sqrt(a0[1:]))  # d/da_{i+1}
    _close(ad.jacobian(ad.Sparse(b, mode="reverse"), g, b.from_numpy(a0)), want, name)


def test_prepared_sparse_jacobian_keeps_the_rules_mode_across_calls() -> None:
    # mode="auto" colors for pushforwards, which a reverse-only rule refuses on jax: the plan
    # takes the rule's mode, as the dense Jacobian does, and keeps it for later calls
    b = _backend("jax")
    prepared = ad.prepare_jacobian(ad.Sparse(b), lambda x: 2.0 * mixed(x), b.from_numpy(X0))
    for k in range(3):
        _close(prepared(b.from_numpy(X0 + k)), 2 * (EYE + ONES), "jax")


def test_detected_patterns_through_a_custom_function_hold_the_rules_entries() -> None:
    # no AD library: the tracer gives a custom function a dense block (its rule may mix entries),
    # a tracer its f reads from a closure keeps its own dependencies, stop_gradient keeps x's
    x = np.arange(1.0, 6.0)
    np.testing.assert_array_equal(ad.jacobian_sparsity(lambda x: mixed(x[:3]), x).toarray(),
                                  np.hstack([np.ones((3, 3), bool), np.zeros((3, 2), bool)]))
    h = ad.hessian_sparsity(lambda x: anp.sum(coupled_cube(x[1:3])) + x[4] ** 2, x).toarray()
    want = np.zeros((5, 5), bool)
    want[1:3, 1:3] = want[4, 4] = True
    np.testing.assert_array_equal(h, want)

    def closing(x):
        scale = x[4] * 3.0

        @ad.custom_vjp
        def scaled(a):
            return a * scale

        scaled.defvjp(lambda a: (a * scale, None), lambda _, ct: (ct,))
        return scaled(x[:2])

    np.testing.assert_array_equal(ad.jacobian_sparsity(closing, x).toarray(),
                                  [[1, 1, 0, 0, 1], [1, 1, 0, 0, 1]])

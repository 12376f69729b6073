"""The finite-differences oracle: accuracy per dtype, and compute_dtype for float32 code."""

from __future__ import annotations

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad

FD = "finite_differences"

X64 = np.array([-0.9, -0.2, 0.4, 1.3])


def f(x):
    return anp.sum(anp.sin(x) * anp.exp(x))


def grad_f(x):
    return (np.cos(x) + np.sin(x)) * np.exp(x)


def hess_diag(x):
    return 2 * np.cos(x) * np.exp(x)


def rel_err(actual, expected):
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def test_float64_first_order_is_accurate_to_1e_9():
    b = ad.backend("finite_differences")
    assert rel_err(ad.gradient(b, f, X64), grad_f(X64)) < 1e-9
    jvp = ad.pushforward(b, lambda x: anp.sin(x) * x, X64)
    assert rel_err(jvp(np.ones(4)), np.cos(X64) * X64 + np.sin(X64)) < 1e-9


@pytest.mark.parametrize("operator", ["gradient", "jacobian", "pushforward", "pullback", "hessian", "hvp"])
def test_compute_dtype_gives_float32_results_at_float32_accuracy(operator):
    plain = ad.backend("finite_differences")
    wide = ad.backend("finite_differences", compute_dtype="float64")
    x = X64.astype(np.float32)
    vec = lambda x: anp.sin(x) * x  # noqa: E731
    dvec = np.diag(np.cos(X64) * X64 + np.sin(X64))
    run = {
        "gradient": (lambda b: ad.gradient(b, f, x), grad_f(X64)),
        "jacobian": (lambda b: ad.jacobian(b, vec, x), dvec),
        "pushforward": (lambda b: ad.pushforward(b, vec, x)(np.ones(4, np.float32)), dvec.sum(axis=1)),
        "pullback": (lambda b: ad.pullback(b, vec, x)(np.ones(4, np.float32)), dvec.sum(axis=0)),
        "hessian": (lambda b: np.diag(ad.hessian(b, f, x)), hess_diag(X64)),
        "hvp": (lambda b: ad.hvp(b, f, x, np.ones(4, np.float32)), hess_diag(X64)),
    }[operator]
    compute, expected = run
    wide_result, plain_result = compute(wide), compute(plain)
    assert wide_result.dtype == np.float32 and plain_result.dtype == np.float32
    # float32 rounding of the result (~6e-8) plus float64 differencing error; second order
    # differences nested twice are a little worse.
    assert rel_err(wide_result, expected) < (1e-6 if operator not in ("hessian", "hvp") else 1e-5)
    assert rel_err(wide_result, expected) < rel_err(plain_result, expected)


def test_compute_dtype_value_keeps_the_input_dtype():
    wide = ad.backend("finite_differences", compute_dtype="float64")
    y, g = ad.value_and_gradient(wide, f, X64.astype(np.float32))
    assert y.dtype == np.float32 and g.dtype == np.float32
    y64, _ = ad.value_and_gradient(wide, f, X64)
    assert y64.dtype == np.float64


@pytest.mark.parametrize("bad", ["int32", "not-a-dtype", 3])
def test_compute_dtype_must_be_a_float_dtype(bad):
    with pytest.raises(ValueError, match="compute_dtype must be a float dtype"):
        ad.backend("finite_differences", compute_dtype=bad)


# ------------------------------------------------------------- never silently wrong
def test_f_that_writes_into_its_input_changes_neither_the_caller_nor_the_point():
    def f(x):
        x *= 2  # writes into its input
        return anp.sum(x**2)

    x = np.array([1.0, 2.0])
    np.testing.assert_allclose(ad.gradient(FD, f, x), 8 * np.array([1.0, 2.0]), rtol=1e-8)
    np.testing.assert_allclose(ad.hessian(FD, f, x), 8 * np.eye(2), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(x, [1.0, 2.0])


def test_a_nan_in_x_is_a_clear_error_not_all_nan():
    with pytest.raises(ad.NonFiniteInputError, match="NaN or inf") as err:
        ad.gradient(FD, lambda x: anp.sum(x**2), np.array([1.0, np.nan, 3.0]))
    assert isinstance(err.value, ValueError)


def test_a_step_the_dtype_cannot_resolve_is_refused():
    with pytest.raises(ad.InvalidArgumentError, match="below what float64 can resolve"):
        ad.gradient(ad.backend(FD, step=1e-30), lambda x: anp.sum(x**2), np.ones(2))
    with pytest.raises(ad.InvalidArgumentError, match="below what float32 can resolve"):
        ad.gradient(ad.backend(FD, step=1e-9), lambda x: anp.sum(x**2), np.ones(2, dtype=np.float32))
    g = ad.gradient(ad.backend(FD, step=1e-3), lambda x: anp.sum(x**2), np.ones(2, dtype=np.float32))
    np.testing.assert_allclose(g, [2.0, 2.0], rtol=1e-3)


def test_bfloat16_is_differenced_in_float32_and_returned_in_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([1.0, 2.0]).astype(ml_dtypes.bfloat16)
    y, g = ad.value_and_gradient(FD, lambda x: anp.sum(x**2), x)
    assert g.dtype == ml_dtypes.bfloat16 and y.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(g.astype(np.float32), [2.0, 4.0], rtol=1e-2)


def test_the_backend_holds_an_adapter_and_subclasses_still_override_one_operator():
    """FiniteDifferencesBackend is the core's holder of FiniteDifferencesAdapter; code that
    subclasses it (the checkers' deliberately wrong backends, the testing guide) keeps working:
    the subclass's methods and traits win, super() reaches the adapter's, and it is a backend of
    its own (equality, caches)."""
    from abstractdiff.adapters.finite_differences import FiniteDifferencesAdapter, FiniteDifferencesBackend

    from abstractdiff._backend import AdapterBackend

    b = ad.backend(FD)
    assert isinstance(b, FiniteDifferencesBackend) and isinstance(b, AdapterBackend)
    assert isinstance(b.adapter, FiniteDifferencesAdapter) and not isinstance(b.adapter, ad.Backend)
    assert b.name == FD and b.approximate is True

    class Doubled(FiniteDifferencesBackend):
        name = "doubled_fd"

        def flat_value_and_gradient(self, fn, xs, data):
            y, aux, grads = super().flat_value_and_gradient(fn, xs, data)
            return y, aux, [2 * g for g in grads]

    d = Doubled()
    assert d.name == "doubled_fd" and repr(d).startswith("Doubled(device='cpu'")
    assert d != FiniteDifferencesBackend() and d.cache_key != FiniteDifferencesBackend().cache_key
    assert FiniteDifferencesBackend() == FiniteDifferencesBackend()
    np.testing.assert_allclose(ad.gradient(d, f, X64), 2 * grad_f(X64), rtol=1e-9)
    np.testing.assert_allclose(ad.gradient(b, f, X64), grad_f(X64), rtol=1e-9)  # no cache shared with d
    # the adapter's second-order routes go through the holder's gradient, a subclass's too
    np.testing.assert_allclose(np.diag(ad.hessian(d, f, X64)), 2 * hess_diag(X64), rtol=1e-5)
    assert FiniteDifferencesBackend(compute_dtype=np.float64).options["compute_dtype"] == "float64"

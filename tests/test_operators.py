"""Every operator on the finite-differences backend against analytic derivatives.

Each operator is called three ways (``ad.op(b, ...)``, ``b.op(...)`` and
``ad.op("finite_differences", ...)``), in float64 and float32; results must be numpy
arrays of the input's dtype.  The last tests build toy backends that implement only one
primitive, so the core's derivations (gradient from a pullback or from pushforwards,
jacobian, hessian, hvp, pullback from forward mode, pushforward from reverse mode) are
checked too: the finite-differences adapter overrides most of them.
"""

from __future__ import annotations

import numpy as np
import pytest
from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend

import abstractdiff as ad

STYLES = ["function", "method", "name"]
DTYPES = [np.float64, np.float32]

# Relative tolerances against analytic values, per dtype and derivative order.  Measured
# errors of the finite-differences backend: first order ~2e-12 (float64) and ~2e-5
# (float32); second order (differences of differences) ~2e-9 and ~2e-4.
RTOL = {
    (np.float64, 1): 1e-9,
    (np.float32, 1): 1e-4,
    (np.float64, 2): 1e-6,
    (np.float32, 2): 2e-3,
}

X = np.array([0.7, -1.3, 0.4])


def f_scalar(x):
    return np.sum(np.sin(x) * x**2) + x[0] * x[1] * x[2]


def grad_scalar(x):
    g = np.cos(x) * x**2 + 2 * x * np.sin(x)
    return g + np.array([x[1] * x[2], x[0] * x[2], x[0] * x[1]])


def hess_scalar(x):
    h = np.diag(-np.sin(x) * x**2 + 4 * x * np.cos(x) + 2 * np.sin(x))
    h[0, 1] = h[1, 0] = x[2]
    h[0, 2] = h[2, 0] = x[1]
    h[1, 2] = h[2, 1] = x[0]
    return h


def f_vector(x):
    return np.stack([x[0] * x[1], np.exp(x[2]), np.sin(x[0]) * x[2], x[1] ** 2])


def jac_vector(x):
    x = x.astype(np.float64)
    return np.array(
        [
            [x[1], x[0], 0.0],
            [0.0, 0.0, np.exp(x[2])],
            [np.cos(x[0]) * x[2], 0.0, np.sin(x[0])],
            [0.0, 2 * x[1], 0.0],
        ]
    )


def f_curve(t):
    return np.stack([np.sin(t), t**3])


def call(style, b, op, *args, **kwargs):
    if style == "method":
        return getattr(b, op)(*args, **kwargs)
    target = b if style == "function" else b.name
    return getattr(ad, op)(target, *args, **kwargs)


def check(actual, expected, dtype, order=1):
    """``actual`` is a numpy array of ``dtype`` and matches ``expected`` (float64 analytic)."""
    assert isinstance(actual, np.ndarray), type(actual)
    assert actual.dtype == dtype, f"dtype {actual.dtype}, expected {np.dtype(dtype)}"
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    rtol = RTOL[(dtype, order)]
    atol = rtol * float(np.max(np.abs(expected), initial=0.0))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


@pytest.fixture(params=DTYPES, ids=["float64", "float32"])
def dtype(request):
    return request.param


@pytest.fixture
def x(dtype):
    return X.astype(dtype)


@pytest.mark.parametrize("style", STYLES)
def test_gradient(fd, style, x, dtype):
    check(call(style, fd, "gradient", f_scalar, x), grad_scalar(X), dtype)


@pytest.mark.parametrize("style", STYLES)
def test_value_and_gradient(fd, style, x, dtype):
    y, g = call(style, fd, "value_and_gradient", f_scalar, x)
    check(np.asarray(y), f_scalar(x.astype(np.float64)), dtype)
    assert np.shape(y) == ()
    check(g, grad_scalar(X), dtype)


def with_aux(x):
    return f_scalar(x), {"norm": np.sum(x**2), "tag": "aux"}


@pytest.mark.parametrize("style", STYLES)
def test_value_and_gradient_has_aux(fd, style, x, dtype):
    (y, aux), g = call(style, fd, "value_and_gradient", with_aux, x, has_aux=True)
    check(np.asarray(y), f_scalar(X), dtype)
    check(g, grad_scalar(X), dtype)
    assert aux["tag"] == "aux"
    np.testing.assert_allclose(aux["norm"], np.sum(X**2), rtol=1e-6)


@pytest.mark.parametrize("style", STYLES)
def test_gradient_has_aux(fd, style, x, dtype):
    g, aux = call(style, fd, "gradient", with_aux, x, has_aux=True)
    check(g, grad_scalar(X), dtype)
    assert aux["tag"] == "aux"


@pytest.mark.parametrize("style", STYLES)
def test_pullback(fd, style, x, dtype):
    dy = np.array([1.0, -2.0, 0.5, 3.0], dtype=dtype)
    vjp = call(style, fd, "pullback", f_vector, x)
    check(vjp(dy), dy.astype(np.float64) @ jac_vector(X), dtype)
    # A second cotangent reuses the pullback.
    check(vjp(np.eye(4, dtype=dtype)[1]), jac_vector(X)[1], dtype)


@pytest.mark.parametrize("style", STYLES)
def test_value_and_pullback(fd, style, x, dtype):
    y, vjp = call(style, fd, "value_and_pullback", f_vector, x)
    check(y, f_vector(X), dtype)
    dy = np.array([0.0, 1.0, 1.0, -1.0], dtype=dtype)
    check(vjp(dy), dy.astype(np.float64) @ jac_vector(X), dtype)


@pytest.mark.parametrize("style", STYLES)
def test_pushforward(fd, style, x, dtype):
    dx = np.array([0.3, -1.0, 2.0], dtype=dtype)
    jvp = call(style, fd, "pushforward", f_vector, x)
    check(jvp(dx), jac_vector(X) @ dx.astype(np.float64), dtype)
    check(jvp(np.eye(3, dtype=dtype)[2]), jac_vector(X)[:, 2], dtype)


@pytest.mark.parametrize("style", STYLES)
def test_value_and_pushforward(fd, style, x, dtype):
    y, jvp = call(style, fd, "value_and_pushforward", f_vector, x)
    check(y, f_vector(X), dtype)
    dx = np.array([1.0, 1.0, -0.5], dtype=dtype)
    check(jvp(dx), jac_vector(X) @ dx.astype(np.float64), dtype)


@pytest.mark.parametrize("style", STYLES)
def test_derivative(fd, style, dtype):
    t = np.asarray(0.8, dtype=dtype)
    check(call(style, fd, "derivative", f_curve, t), [np.cos(0.8), 3 * 0.8**2], dtype)
    # A scalar output gives a scalar derivative.
    check(call(style, fd, "derivative", np.sin, t), np.cos(0.8), dtype)


def test_derivative_of_python_float(fd):
    d = ad.derivative(fd, lambda t: t**3 - 2 * t, 1.5)
    check(np.asarray(d), 3 * 1.5**2 - 2, np.float64)


@pytest.mark.parametrize("style", STYLES)
def test_jacobian(fd, style, x, dtype):
    check(call(style, fd, "jacobian", f_vector, x), jac_vector(X), dtype)


def test_jacobian_of_matrix_input_and_output(fd):
    a = np.arange(6.0).reshape(2, 3) / 7 + 0.1
    j = ad.jacobian(fd, lambda m: m.T**2, a)  # y.shape + x.shape = (3, 2) + (2, 3)
    expected = np.zeros((3, 2, 2, 3))
    for i in range(2):
        for k in range(3):
            expected[k, i, i, k] = 2 * a[i, k]
    check(j, expected, np.float64)


@pytest.mark.parametrize("style", STYLES)
def test_hessian(fd, style, x, dtype):
    check(call(style, fd, "hessian", f_scalar, x), hess_scalar(X), dtype, order=2)


def test_hessian_of_matrix_input(fd):
    a = np.array([[0.5, -1.0], [2.0, 0.3]])
    h = ad.hessian(fd, lambda m: np.sum(m**3), a)
    expected = np.diag((6 * a).reshape(-1)).reshape(2, 2, 2, 2)
    check(h, expected, np.float64, order=2)


@pytest.mark.parametrize("style", STYLES)
def test_hvp(fd, style, x, dtype):
    v = np.array([1.0, -2.0, 0.5], dtype=dtype)
    check(call(style, fd, "hvp", f_scalar, x, v), hess_scalar(X) @ v.astype(np.float64), dtype, order=2)


def test_custom_step_is_used():
    # The option sets the first (largest) step of the stencil: f is evaluated that far from x.
    # Richardson extrapolation over the smaller steps makes both accurate on a quintic.
    def displacements(b):
        seen = []

        def f(x):
            seen.append(float(x[0]))
            return np.sum(x**5)

        g = float(b.gradient(f, np.array([1.0]))[0])
        return g, max(abs(v - 1.0) for v in seen)

    coarse = ad.backend("finite_differences", step=0.3)
    fine = ad.backend("finite_differences")
    g_coarse, far_coarse = displacements(coarse)
    g_fine, far_fine = displacements(fine)
    assert abs(g_fine - 5.0) < 1e-9 and abs(g_coarse - 5.0) < 1e-6
    assert far_coarse == pytest.approx(2 * 0.3) and far_fine < 0.01
    assert coarse.step == 0.3 and coarse.options["step"] == 0.3


# ------------------------------------------------------------------------------------------
# The core's derived operators, from one primitive at a time.


class ReverseOnly(ad.Backend):
    """Only ``flat_value_and_pullback`` (delegated to finite differences)."""

    name = "reverse_only"

    def __init__(self, **options):
        super().__init__(**options)
        self._fd = FiniteDifferencesBackend()

    def flat_value_and_pullback(self, fn, xs, data):
        return self._fd.flat_value_and_pullback(fn, xs, data)


class ForwardOnly(ad.Backend):
    """Only ``flat_value_and_pushforward`` (delegated to finite differences)."""

    name = "forward_only"

    def __init__(self, **options):
        super().__init__(**options)
        self._fd = FiniteDifferencesBackend()

    def flat_value_and_pushforward(self, fn, xs, data):
        return self._fd.flat_value_and_pushforward(fn, xs, data)


@pytest.fixture(params=[ReverseOnly, ForwardOnly], ids=["reverse_only", "forward_only"])
def one_primitive(request):
    return request.param()


def test_one_primitive_backends_implement_one_mode():
    assert ReverseOnly().has_reverse and not ReverseOnly().has_forward
    assert ForwardOnly().has_forward and not ForwardOnly().has_reverse


def test_derived_first_order_operators(one_primitive):
    b = one_primitive
    check(ad.gradient(b, f_scalar, X), grad_scalar(X), np.float64)
    y, g = ad.value_and_gradient(b, f_scalar, X)
    check(np.asarray(y), f_scalar(X), np.float64)
    check(g, grad_scalar(X), np.float64)
    check(ad.jacobian(b, f_vector, X), jac_vector(X), np.float64)
    dy = np.array([1.0, -2.0, 0.5, 3.0])
    y, vjp = ad.value_and_pullback(b, f_vector, X)
    check(y, f_vector(X), np.float64)
    check(vjp(dy), dy @ jac_vector(X), np.float64)
    dx = np.array([0.3, -1.0, 2.0])
    y, jvp = ad.value_and_pushforward(b, f_vector, X)
    check(jvp(dx), jac_vector(X) @ dx, np.float64)
    check(ad.derivative(b, f_curve, np.asarray(0.8)), [np.cos(0.8), 3 * 0.8**2], np.float64)


def test_derived_first_order_operators_on_a_pytree(one_primitive):
    x = {"a": np.array([0.5, -1.0]), "b": np.asarray(2.0), "n": np.array([3])}

    def f(t):
        return np.sum(t["a"] ** 2) * t["b"] + t["n"][0] * t["b"]

    g = ad.gradient(one_primitive, f, x)
    check(g["a"], 2 * x["a"] * 2.0, np.float64)
    check(g["b"], np.sum(x["a"] ** 2) + 3, np.float64)
    assert g["n"] is None


def test_derived_second_order_operators(one_primitive):
    b = one_primitive
    check(ad.hessian(b, f_scalar, X), hess_scalar(X), np.float64, order=2)
    v = np.array([1.0, -2.0, 0.5])
    check(ad.hvp(b, f_scalar, X, v), hess_scalar(X) @ v, np.float64, order=2)


def test_derived_hvp_on_a_pytree(one_primitive):
    # Several leaves: reverse-over-reverse (GradientDotTangent) for either primitive.
    x = {"a": np.array([0.5, -1.0]), "b": np.asarray(2.0)}
    v = {"a": np.array([1.0, 0.0]), "b": np.asarray(1.0)}

    def f(t):
        return np.sum(t["a"] ** 3) * t["b"]

    hv = ad.hvp(one_primitive, f, x, v)
    # H = [[diag(6 a b), 3 a^2], [3 a^2^T, 0]]
    a, bb = x["a"], 2.0
    check(hv["a"], 6 * a * bb * v["a"] + 3 * a**2 * 1.0, np.float64, order=2)
    check(hv["b"], np.sum(3 * a**2 * v["a"]), np.float64, order=2)


def test_derived_gradient_rejects_non_scalar(one_primitive):
    with pytest.raises(ad.NonScalarOutputError, match=r"\(4,\)"):
        ad.gradient(one_primitive, f_vector, X)


def test_backend_without_primitive_says_so():
    class Nothing(ad.Backend):
        name = "nothing"

    with pytest.raises(NotImplementedError, match="no forward mode"):
        ad.gradient(Nothing(), f_scalar, X)

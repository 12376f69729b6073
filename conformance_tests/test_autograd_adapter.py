"""The autograd adapter: every operator against analytic derivatives and finite differences,
plus autograd's own pitfalls (containers, ArrayBox-only numpy, CPU only, dtype upcasts, nesting)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("autograd")

import autoray  # noqa: E402
from abstractdiff.adapters.autograd import AutogradAdapter  # noqa: E402
from autograd.numpy.numpy_boxes import ArrayBox  # noqa: E402
from autoray import numpy as anp  # noqa: E402

import abstractdiff as ad  # noqa: E402

DTYPES = [np.float32, np.float64]
# Against analytic derivatives (computed in float64).  Finite differences are accurate to
# ~1e-10 (float64) / ~1e-5 (float32) relative at first order and a little worse at second.
RTOL = {np.float32: 1e-4, np.float64: 1e-9}
FD_RTOL = {
    1: {np.float32: 1e-4, np.float64: 1e-9},
    2: {np.float32: 1e-3, np.float64: 1e-8},
}


@pytest.fixture(scope="module")
def b() -> ad.Backend:
    return ad.backend("autograd")


@pytest.fixture(scope="module")
def fd():
    return ad.backend("finite_differences")


def assert_close(actual, expected, rtol: float, dtype=None) -> None:
    """Leaf-wise allclose with atol = rtol * max|expected|; checks the dtype of float leaves."""
    a_leaves, e_leaves = ad.to_numpy(_leaves(actual)), ad.to_numpy(_leaves(expected))
    assert len(a_leaves) == len(e_leaves)
    for a, e in zip(a_leaves, e_leaves):
        if e is None:
            assert a is None
            continue
        assert isinstance(a, np.ndarray), type(a)
        if dtype is not None:
            assert a.dtype == dtype, (a.dtype, dtype)
        e = np.asarray(e, dtype=np.float64)
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * max(1.0, float(np.max(np.abs(e), initial=0.0))))


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree, none_is_leaf=True)


# ------------------------------------------------------------------ scenarios
def sin_sum(x):
    return anp.sum(anp.sin(x) * x)


def least_squares(w, a, t):
    r = a @ w - t
    return 0.5 * anp.sum(r * r)


def logsumexp(x):
    m = anp.max(x)
    return m + anp.log(anp.sum(anp.exp(x - m)))


def tree_fn(x):
    a, b_ = x["w"]
    # x["i"] is an int64 array: mixing it in upcasts float32 inside numpy.
    return anp.sum(a ** x["n"] * b_) + anp.sum(x["i"] * a)


def vector_fn(x):
    return anp.sin(x) * anp.sum(x)


def curve(t):
    return anp.stack([anp.sin(t), t * t, anp.exp(t) * t])


def with_aux(x):
    return sin_sum(x), {"sq": x * x, "n": 3}


def hvp_fn(x):
    return anp.sum(x["a"] ** 2 * x["b"]) + anp.sum(anp.sin(x["b"]))


X = np.linspace(0.1, 1.3, 5)
RNG = np.random.default_rng(0)
A, T, W = RNG.normal(size=(4, 3)), RNG.normal(size=4), RNG.normal(size=3)
P = np.array([0.3, -1.2, 0.8, 2.0])
TREE_A, TREE_B = np.array([0.5, 1.5, -0.7]), np.array([1.1, 0.4, 2.0])


def _tree(dtype):
    return {"w": (TREE_A.astype(dtype), TREE_B.astype(dtype)), "n": 2, "u": np.ones(2, dtype), "i": np.arange(3)}


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


# Scalar scenarios: (f, x(dtype), args(dtype), gradient, hessian), analytic in float64.
SCALAR = {
    "sin_sum": (
        sin_sum,
        lambda d: X.astype(d),
        lambda d: (),
        np.sin(X) + X * np.cos(X),
        np.diag(2 * np.cos(X) - X * np.sin(X)),
    ),
    "least_squares_data_args": (
        least_squares,
        lambda d: W.astype(d),
        lambda d: (A.astype(d), T.astype(d)),
        A.T @ (A @ W - T),
        A.T @ A,
    ),
    "logsumexp": (
        logsumexp,
        lambda d: P.astype(d),
        lambda d: (),
        _softmax(P),
        np.diag(_softmax(P)) - np.outer(_softmax(P), _softmax(P)),
    ),
}


# ---------------------------------------------------------- every operator
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", list(SCALAR))
def test_gradient_and_hessian(b, fd, scenario, dtype):
    f, x, args, grad, hess = SCALAR[scenario]
    g = ad.gradient(b, f, x(dtype), *args(dtype))
    assert_close(g, grad, RTOL[dtype], dtype)
    assert_close(g, ad.gradient(fd, f, x(dtype), *args(dtype)), FD_RTOL[1][dtype], dtype)
    h = ad.hessian(b, f, x(dtype), *args(dtype))
    assert_close(h, hess, RTOL[dtype], dtype)
    assert_close(h, ad.hessian(fd, f, x(dtype), *args(dtype)), FD_RTOL[2][dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_of_pytree_with_int_leaves_and_unconnected_leaf(b, fd, dtype):
    x = _tree(dtype)
    a, b_, i = TREE_A, TREE_B, np.arange(3)
    expected = {"w": (2 * a * b_ + i, a**2), "n": None, "u": np.zeros(2), "i": None}
    y, g = ad.value_and_gradient(b, tree_fn, x)
    assert_close(y, np.sum(a**2 * b_) + np.sum(i * a), RTOL[dtype])
    assert_close(g, expected, RTOL[dtype], dtype)
    assert_close(g, ad.gradient(fd, tree_fn, x), FD_RTOL[1][dtype], dtype)
    assert isinstance(g["w"], tuple) and g["n"] is None and g["i"] is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_and_gradient_and_gradient_with_aux(b, dtype):
    x = X.astype(dtype)
    (y, aux), g = ad.value_and_gradient(b, with_aux, x, has_aux=True)
    assert_close(y, np.sum(np.sin(X) * X), RTOL[dtype], dtype)
    assert_close(g, np.sin(X) + X * np.cos(X), RTOL[dtype], dtype)
    # aux comes back as it was computed, unboxed: plain numpy, static leaves untouched.
    assert type(aux["sq"]) is np.ndarray and aux["n"] == 3
    assert_close(aux["sq"], X * X, RTOL[dtype], dtype)
    g2, aux2 = ad.gradient(b, with_aux, x, has_aux=True)
    assert_close(g2, g, 0.0, dtype)
    assert type(aux2["sq"]) is np.ndarray


@pytest.mark.parametrize("dtype", DTYPES)
def test_pullback_and_value_and_pullback(b, fd, dtype):
    x, dy = X.astype(dtype), np.linspace(-1.0, 1.0, X.size).astype(dtype)
    jac = np.diag(np.cos(X) * X.sum()) + np.outer(np.sin(X), np.ones_like(X))
    y, vjp = ad.value_and_pullback(b, vector_fn, x)
    assert_close(y, np.sin(X) * X.sum(), RTOL[dtype], dtype)
    assert_close(vjp(dy), dy.astype(np.float64) @ jac, RTOL[dtype], dtype)
    assert_close(ad.pullback(b, vector_fn, x)(dy), ad.pullback(fd, vector_fn, x)(dy), FD_RTOL[1][dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pushforward_and_value_and_pushforward(b, fd, dtype):
    x, dx = X.astype(dtype), np.linspace(-1.0, 1.0, X.size).astype(dtype)
    jac = np.diag(np.cos(X) * X.sum()) + np.outer(np.sin(X), np.ones_like(X))
    y, jvp = ad.value_and_pushforward(b, vector_fn, x)
    assert_close(y, np.sin(X) * X.sum(), RTOL[dtype], dtype)
    assert_close(jvp(dx), jac @ dx.astype(np.float64), RTOL[dtype], dtype)
    assert_close(ad.pushforward(b, vector_fn, x)(dx), ad.pushforward(fd, vector_fn, x)(dx), FD_RTOL[1][dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pushforward_on_pytree_with_data_args(b, fd, dtype):
    # Forward mode through a dict of leaves, with matmul data passed as args.
    x = {"w": W.astype(dtype), "s": dtype(2.0)}
    f = lambda x, a: (a @ x["w"]) * x["s"]  # noqa: E731
    dx = {"w": np.ones(3, dtype), "s": dtype(0.5)}
    expected = A @ np.ones(3) * 2.0 + (A @ W) * 0.5
    assert_close(ad.pushforward(b, f, x, A.astype(dtype))(dx), expected, RTOL[dtype], dtype)
    assert_close(
        ad.pushforward(b, f, x, A.astype(dtype))(dx), ad.pushforward(fd, f, x, A.astype(dtype))(dx), FD_RTOL[1][dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_derivative(b, fd, dtype):
    t = np.asarray(0.7, dtype=dtype)
    expected = [np.cos(0.7), 1.4, np.exp(0.7) * 1.7]
    assert_close(ad.derivative(b, curve, t), np.array(expected), RTOL[dtype], dtype)
    assert_close(ad.derivative(b, curve, t), ad.derivative(fd, curve, t), FD_RTOL[1][dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jacobian(b, fd, dtype):
    x = X.astype(dtype)
    jac = np.diag(np.cos(X) * X.sum()) + np.outer(np.sin(X), np.ones_like(X))
    assert_close(ad.jacobian(b, vector_fn, x), jac, RTOL[dtype], dtype)
    assert_close(ad.jacobian(b, vector_fn, x), ad.jacobian(fd, vector_fn, x), FD_RTOL[1][dtype], dtype)
    # Several leaves and a residual with data args: J_w = A, J_t = -I.
    both = ad.jacobian(
        b, lambda p, a: a @ p["w"] - p["t"], {"w": W.astype(dtype), "t": T.astype(dtype)}, A.astype(dtype)
    )
    assert_close(both, {"w": A, "t": -np.eye(4)}, RTOL[dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hvp_on_pytree(b, fd, dtype):
    a, b_ = TREE_A, TREE_B
    va, vb = np.array([1.0, -2.0, 0.5]), np.array([0.3, 0.0, -1.0])
    x = {"a": a.astype(dtype), "b": b_.astype(dtype)}
    v = {"a": va.astype(dtype), "b": vb.astype(dtype)}
    expected = {"a": 2 * b_ * va + 2 * a * vb, "b": 2 * a * va - np.sin(b_) * vb}
    hv = ad.hvp(b, hvp_fn, x, v)
    assert_close(hv, expected, RTOL[dtype], dtype)
    assert_close(hv, ad.hvp(fd, hvp_fn, x, v), FD_RTOL[2][dtype], dtype)


# ---------------------------------------------------------- autograd pitfalls
@pytest.mark.parametrize("container", [list, tuple])
def test_list_and_tuple_inputs(b, container):
    x = container([X, np.float64(2.0), 3])
    g = ad.gradient(b, lambda x: anp.sum(anp.sin(x[0])) * x[1] * x[2], x)
    assert type(g) is container
    assert_close(g, container([np.cos(X) * 6.0, np.sum(np.sin(X)) * 3.0, None]), RTOL[np.float64])


def test_float32_stays_float32_when_numpy_upcasts(b):
    # float64 constants upcast float32 inside numpy; gradients still match the leaf.
    x = X.astype(np.float32)
    g = ad.gradient(b, lambda x: anp.sum(x * np.ones(X.size)), x)
    assert g.dtype == np.float32
    assert ad.hessian(b, lambda x: anp.sum(x**2 * np.ones(X.size)), x).dtype == np.float32
    assert ad.gradient(b, lambda x: anp.sum(x * x), X).dtype == np.float64


def test_plain_numpy_conversion_error_gets_a_hint(b):
    def f(x):
        return np.sum(np.array(x, dtype=np.float64))

    with pytest.raises(ValueError, match="setting an array element") as info:
        ad.gradient(b, f, X)
    assert any("autoray" in note and "autograd.numpy" in note for note in info.value.__notes__)


def test_in_place_assignment_error_gets_a_hint(b):
    def f(x):
        x[0] = 1.0
        return anp.sum(x)

    x = X.copy()
    with pytest.raises(TypeError, match="item assignment") as info:
        ad.gradient(b, f, x)
    assert any("in-place" in note for note in info.value.__notes__)
    np.testing.assert_array_equal(x, X)


def test_numpy_ufuncs_on_boxes_work(b):
    # autograd's ArrayBox implements __array_ufunc__: plain np.sin is differentiated.
    assert_close(ad.gradient(b, lambda x: np.sum(np.sin(x)), X), np.cos(X), RTOL[np.float64])


def test_numpy_where_is_numpys_and_where_on_boxes_differentiates(b):
    # A comparison of boxes is a plain numpy mask, so autoray's default dispatch would send
    # where(x > 0, x, -x) to numpy; the autograd table's dispatcher routes it to autograd
    # without touching numpy's own where (numpy users in the process see numpy's).
    assert autoray.get_lib_fn("numpy", "where") is np.where
    mask, a, c = np.array([True, False, True]), np.arange(3.0), -np.ones(3)
    out = autoray.do("where", mask, a, c)
    assert type(out) is np.ndarray and out.dtype == np.float64
    np.testing.assert_array_equal(out, np.where(mask, a, c))
    assert autoray.infer_backend(autoray.do("where", mask)[0]) == "numpy"  # where(condition) alone
    x = np.array([0.5, -1.2, 2.0, -0.3])
    for dtype in DTYPES:
        # exp of where's result: an object array of boxes (numpy's where) has no exp
        g = ad.gradient(b, lambda x: anp.sum(anp.exp(autoray.do("where", x > 0, x, -x))), x.astype(dtype))
        assert_close(g, np.sign(x) * np.exp(np.abs(x)), RTOL[dtype], dtype)


@pytest.mark.parametrize("exc", [KeyError("mine"), ValueError("mine"), NotImplementedError("mine")])
def test_user_exception_propagates_unchanged(b, exc):
    def f(x):
        raise exc

    for call in (
        lambda: ad.gradient(b, f, X),
        lambda: ad.pushforward(b, f, X)(X),
        lambda: ad.hessian(b, f, X),
        lambda: ad.hvp(b, f, X, X),
    ):
        with pytest.raises(type(exc)) as info:
            call()
        assert info.value is exc
        assert not getattr(exc, "__notes__", None)


def test_unconnected_output_gives_zeros_without_warning(b):
    const = lambda x: anp.sum(anp.ones(3))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(ad.gradient(b, const, X), np.zeros(X.size), 0.0, np.float64)
        assert_close(ad.jacobian(b, lambda x: anp.ones(2), X), np.zeros((2, X.size)), 0.0, np.float64)
        assert_close(ad.pushforward(b, lambda x: anp.ones(2), X)(X), np.zeros(2), 0.0, np.float64)
        assert_close(ad.hessian(b, const, X), np.zeros((X.size, X.size)), 0.0, np.float64)
        assert_close(ad.hvp(b, const, X, X), np.zeros(X.size), 0.0, np.float64)


def test_pushforward_without_jvp_rule_falls_back_to_reverse(b, fd):
    # autograd defines no JVP for numpy.linalg; d det(X)[V] = det(X) tr(X^-1 V).
    m = np.array([[2.0, 0.3], [0.1, 1.5]])
    v = np.array([[1.0, -0.5], [0.2, 0.7]])
    expected = np.linalg.det(m) * np.trace(np.linalg.solve(m, v))
    assert_close(ad.pushforward(b, lambda m: anp.linalg.det(m), m)(v), expected, RTOL[np.float64], np.float64)
    assert_close(ad.pushforward(b, lambda m: anp.linalg.det(m), m)(v), ad.pushforward(fd, anp.linalg.det, m)(v), 1e-8)


@pytest.mark.parametrize("operator", ["gradient", "value_and_gradient", "hessian", "hvp"])
def test_non_scalar_output_raises(b, operator):
    args = (X,) if operator == "hvp" else ()
    with pytest.raises(ad.NonScalarOutputError, match=r"shape \(5,\)"):
        getattr(ad, operator)(b, lambda x: x * 2.0, X, *args)


def test_bad_inputs_and_outputs(b):
    with pytest.raises(ad.NonDifferentiableInputError):
        ad.gradient(b, lambda x: anp.sum(x), np.arange(3))
    with pytest.raises(ad.InvalidOutputError, match="str"):
        ad.gradient(b, lambda x: "loss", X)


def test_inputs_are_not_mutated(b):
    x = {"a": X.copy(), "b": X.astype(np.float32)}
    ad.hvp(b, lambda x: anp.sum(x["a"] ** 3) + anp.sum(x["b"] ** 2), x, {"a": X, "b": X.astype(np.float32)})
    ad.jacobian(b, lambda x: x["a"] * 2.0, x)
    np.testing.assert_array_equal(x["a"], X)
    np.testing.assert_array_equal(x["b"], X.astype(np.float32))


# ---------------------------------------------------------- nested use
def test_nested_gradient_of_gradient(b):
    def outer(x):
        return anp.sum(ad.gradient(b, lambda z: anp.sum(anp.sin(z)), x) * x)

    assert_close(ad.gradient(b, outer, X), np.cos(X) - X * np.sin(X), RTOL[np.float64], np.float64)


def test_nested_hvp_by_gradient_of_gradient_dot_v(b):
    v = np.linspace(1.0, -1.0, X.size)

    def grad_dot_v(x, v):
        return anp.sum(ad.gradient(b, sin_sum, x) * v)

    expected = (2 * np.cos(X) - X * np.sin(X)) * v
    assert_close(ad.gradient(b, grad_dot_v, X, v), expected, RTOL[np.float64], np.float64)
    assert_close(ad.hvp(b, sin_sum, X, v), expected, RTOL[np.float64], np.float64)


def test_nested_pushforward_and_value_and_gradient_inside_gradient(b):
    v = np.linspace(1.0, -1.0, X.size)

    def outer(x, v):
        y, g = ad.value_and_gradient(b, sin_sum, x)
        return anp.sum(ad.pushforward(b, anp.sin, x)(v)) + y

    expected = -np.sin(X) * v + np.sin(X) + X * np.cos(X)
    assert_close(ad.gradient(b, outer, X, v), expected, RTOL[np.float64], np.float64)


def test_nested_aux_keeps_the_outer_trace_and_nested_jacobian_hessian(b):
    def outer(x):
        # aux is unboxed for the inner trace only: it must stay differentiable outside.
        g, aux = ad.gradient(b, lambda z: (anp.sum(z**2), z * 3.0), x, has_aux=True)
        return anp.sum(g * aux)  # 6 x^2

    assert_close(ad.gradient(b, outer, X), 12.0 * X, RTOL[np.float64], np.float64)
    jac_sum = lambda x: anp.sum(ad.jacobian(b, lambda z: anp.sin(z) * z, x))  # noqa: E731
    assert_close(ad.gradient(b, jac_sum, X), 2 * np.cos(X) - X * np.sin(X), RTOL[np.float64], np.float64)
    hess_trace = lambda x: anp.sum(anp.diag(ad.hessian(b, sin_sum, x)))  # noqa: E731
    assert_close(ad.gradient(b, hess_trace, X), -3 * np.sin(X) - X * np.cos(X), RTOL[np.float64], np.float64)


# ---------------------------------------------------------- backend object
def test_one_trace_per_call(b):
    # autograd has no compiled cache: each call traces f exactly once, never twice.
    before = b.trace_count
    ad.gradient(b, sin_sum, X)
    ad.value_and_gradient(b, sin_sum, X)
    assert b.trace_count - before == 2


def test_arrays_and_is_native(b):
    assert b.is_native(X) and not b.is_native([1.0]) and not b.is_native(1.0)
    seen = []
    ad.gradient(b, lambda x: seen.append(b.is_native(x) and isinstance(x, ArrayBox)) or anp.sum(x), X)
    assert seen == [True]
    assert b.asarray(X.astype(np.float32)).dtype == np.float32
    assert b.asarray(X).dtype == np.float64
    assert b.asarray(X, "float32").dtype == np.float32
    assert autoray.infer_backend(ad.gradient(b, sin_sum, X)) == "numpy"


def test_registry_and_options():
    b = ad.backend("autograd")
    # the core's backend holding the adapter: not a subclass of ad.Backend itself
    assert isinstance(b, ad.Backend) and isinstance(b.adapter, AutogradAdapter)
    assert not issubclass(AutogradAdapter, ad.Backend)
    assert b.name == "autograd" and b.extra == "autograd"
    assert b.devices() == ["cpu"] and b.device == "cpu"
    assert ad.backend("autograd", device="cpu").options == {"device": "cpu"}
    with pytest.raises(TypeError, match="nothing to compile"):
        ad.backend("autograd", compile=True)


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:1", "tpu"])
def test_device_that_does_not_exist(device):
    with pytest.raises(ad.DeviceError, match="autograd backend: device .* not available.*available devices: cpu"):
        ad.backend("autograd", device=device)


@pytest.mark.gpu
def test_gpu_cpu_parity():
    pytest.skip("autograd runs on the CPU only (numpy arrays): there is no GPU result to compare")

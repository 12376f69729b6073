"""The PyTensor adapter: every operator against analytic derivatives, and PyTensor's pitfalls
(symbolic tracing, one compilation per input signature, float32 under Python float constants,
unconnected inputs, control flow on symbolic values, shared variables in implicit mode).

Most tests compile with ``mode="FAST_COMPILE"``: PyTensor 3's default mode JIT-compiles
with Numba, seconds per new graph on a machine whose Numba cache is cold.  The tests of
the default mode are few and small.
"""

from __future__ import annotations

import os

import numpy as np
import optree
import pytest

pytensor = pytest.importorskip("pytensor", reason="PyTensor is not installed (pip install 'abstractdiff[pytensor]')")

import pytensor.tensor as pt  # noqa: E402
from abstractdiff.adapters.pytensor import PyTensorAdapter  # noqa: E402
from autoray import numpy as anp  # noqa: E402

import abstractdiff as ad  # noqa: E402
from abstractdiff import optim  # noqa: E402
from abstractdiff._backend import AdapterBackend  # noqa: E402

DTYPES = ["float32", "float64"]
RTOL = {"float32": 1e-4, "float64": 1e-9}


@pytest.fixture(scope="module")
def b() -> ad.Backend:
    return ad.backend("pytensor", mode="FAST_COMPILE")


def fresh() -> ad.Backend:
    """A backend of its own (its counters start at zero); FAST_COMPILE, as the module's.
    ``ad.backend`` shares one instance per options: the core's holder is made directly."""
    return AdapterBackend(PyTensorAdapter, mode="FAST_COMPILE")


def assert_close(actual, expected, rtol: float, dtype: str | None = None) -> None:
    """Leaf-wise: numpy results (not symbolic), the dtype, and values with atol = rtol * max|expected|."""
    a_leaves = optree.tree_leaves(actual, none_is_leaf=True)
    e_leaves = optree.tree_leaves(expected, none_is_leaf=True)
    assert len(a_leaves) == len(e_leaves)
    for a, e in zip(a_leaves, e_leaves):
        if e is None:
            assert a is None
            continue
        assert type(a) is np.ndarray, type(a)
        if dtype is not None:
            assert a.dtype == np.dtype(dtype), (a.dtype, dtype)
        e = np.asarray(e, dtype=np.float64)
        assert a.shape == e.shape
        scale = float(np.max(np.abs(e), initial=0.0)) or 1.0
        np.testing.assert_allclose(a.astype(np.float64), e, rtol=rtol, atol=rtol * scale)


def point(n: int, dtype: str, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1.0, 1.0, n).astype(dtype)


def f64(*arrays):
    return [np.asarray(v, dtype=np.float64) for v in arrays]


# ------------------------------------------------------------------ scenarios
def sin_sum(x):
    return anp.sum(anp.sin(x) * x)


def logsumexp(x):
    m = anp.max(x)
    return m + anp.log(anp.sum(anp.exp(x - m)))


def least_squares(w, a, t):
    r = a @ w - t
    return 0.5 * anp.sum(r * r)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _lsq_data(dtype, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(6, 4)).astype(dtype), rng.normal(size=6).astype(dtype)


SCALAR = {
    "sin_sum": (sin_sum, lambda dt: (point(5, dt), ()), lambda x: np.cos(x) * x + np.sin(x),
                lambda x: np.diag(2 * np.cos(x) - np.sin(x) * x)),
    "logsumexp": (logsumexp, lambda dt: (point(5, dt), ()), _softmax,
                  lambda x: np.diag(_softmax(x)) - np.outer(_softmax(x), _softmax(x))),
    "least_squares": (least_squares, lambda dt: (point(4, dt), _lsq_data(dt)), lambda w, a, t: a.T @ (a @ w - t),
                      lambda w, a, t: a.T @ a),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SCALAR))
def test_gradient_hessian_and_hvp(b, name, dtype):
    f, make, grad, hess = SCALAR[name]
    x, args = make(dtype)
    x0 = x.copy()
    assert_close(ad.gradient(b, f, x, *args), grad(*f64(x, *args)), RTOL[dtype], dtype)
    assert_close(ad.hessian(b, f, x, *args), hess(*f64(x, *args)), RTOL[dtype], dtype)
    v = point(x.size, dtype, seed=5)
    assert_close(ad.hvp(b, f, x, v, *args), hess(*f64(x, *args)) @ v.astype(np.float64), RTOL[dtype], dtype)
    np.testing.assert_array_equal(x, x0)  # the caller's input is left alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_and_gradient_with_aux(b, dtype):
    w, (a, t) = point(4, dtype), _lsq_data(dtype)
    r = a.astype(np.float64) @ w.astype(np.float64) - t

    def with_aux(w, a, t):
        res = a @ w - t
        return 0.5 * anp.sum(res * res), {"residual": res, "n": 6, "tag": "lsq", "const": np.arange(2), "none": None}

    (y, aux), g = ad.value_and_gradient(b, with_aux, w, a, t, has_aux=True)
    assert_close(y, 0.5 * r @ r, RTOL[dtype], dtype)
    assert_close(g, a.T @ r, RTOL[dtype], dtype)
    assert_close(aux["residual"], r, RTOL[dtype], dtype)  # computed from x: a compiled extra output
    # the other aux leaves come back as they were, not as arrays
    assert aux["n"] == 6 and type(aux["n"]) is int and aux["tag"] == "lsq" and aux["none"] is None
    np.testing.assert_array_equal(aux["const"], np.arange(2))
    g2, aux2 = ad.gradient(b, with_aux, w, a, t, has_aux=True)
    assert_close(g2, a.T @ r, RTOL[dtype], dtype)
    assert aux2["tag"] == "lsq"


def tree_f(x, scale):
    # "k" (an int) and "idx" (an int array) are not differentiated; "unused" does not
    # affect the output and must get zeros
    w, (bias, k, idx, _unused) = x["w"], x["rest"]
    return anp.sum(anp.sin(w) * bias[0]) * k + anp.sum(w[idx] ** 2) * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_pytree_with_int_and_unconnected_leaves(b, dtype):
    w, bias, unused = point(3, dtype), point(2, dtype, seed=2), point(2, dtype, seed=3)
    x = {"w": w, "rest": (bias, 3, np.array([0, 2]), unused)}
    g = ad.gradient(b, tree_f, x, np.asarray(1.5, dtype=dtype))
    wd, bd = f64(w, bias)
    expected = {
        "w": 3 * np.cos(wd) * bd[0] + 1.5 * 2 * wd * np.array([1.0, 0.0, 1.0]),
        "rest": (np.array([3 * np.sin(wd).sum(), 0.0]), None, None, np.zeros(2)),
    }
    assert_close(g, expected, RTOL[dtype], dtype)


def vector_f(x):
    return anp.sin(x) * x[0]


def vector_jacobian(x):
    j = np.diag(np.cos(x) * x[0])
    j[:, 0] += np.sin(x)
    return j


@pytest.mark.parametrize("dtype", DTYPES)
def test_pullback_pushforward_and_derivative(b, dtype):
    x, dy, dx = point(4, dtype), point(4, dtype, seed=1), point(4, dtype, seed=2)
    jac = vector_jacobian(x.astype(np.float64))
    y, vjp = ad.value_and_pullback(b, vector_f, x)
    assert_close(y, np.sin(x.astype(np.float64)) * float(x[0]), RTOL[dtype], dtype)
    assert_close(vjp(dy), dy.astype(np.float64) @ jac, RTOL[dtype], dtype)
    assert_close(vjp(2 * dy), 2 * dy.astype(np.float64) @ jac, RTOL[dtype], dtype)  # called again
    y2, jvp = ad.value_and_pushforward(b, vector_f, x)
    assert_close(y2, y, RTOL[dtype], dtype)
    assert_close(jvp(dx), jac @ dx.astype(np.float64), RTOL[dtype], dtype)
    c = np.arange(1.0, 4.0).astype(dtype)
    t = np.asarray(0.7, dtype=dtype)
    assert_close(ad.derivative(b, lambda t, c: anp.sin(t * c), t, c), c * np.cos(0.7 * c.astype(np.float64)),
                 RTOL[dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jacobian_square_tall_wide_and_matrix(b, dtype):
    x = point(4, dtype)
    u = x.astype(np.float64)
    assert_close(ad.jacobian(b, vector_f, x), vector_jacobian(u), RTOL[dtype], dtype)
    tall = ad.jacobian(b, lambda x: anp.concatenate([anp.sin(x), x**2]), x)
    assert_close(tall, np.concatenate([np.diag(np.cos(u)), np.diag(2 * u)]), RTOL[dtype], dtype)
    wide = ad.jacobian(b, lambda x: anp.sum(anp.reshape(x, (2, 2)) ** 2, axis=1), x)
    assert_close(wide, np.kron(np.eye(2), np.ones((1, 2))) * 2 * u, RTOL[dtype], dtype)
    m = ad.jacobian(b, lambda x: anp.reshape(x, (2, 2)) * 3.0, x)
    assert_close(m, 3 * np.eye(4).reshape(2, 2, 4), RTOL[dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hvp_on_a_pytree(b, dtype):
    def f(x):
        return anp.sum(x["a"] ** 2 * x["b"][0]) + anp.sum(anp.sin(x["b"]))

    x = {"a": point(3, dtype), "b": point(2, dtype, seed=1)}
    v = {"a": point(3, dtype, seed=2), "b": point(2, dtype, seed=3)}
    a, bb, va, vb = f64(x["a"], x["b"], v["a"], v["b"])
    expected = {"a": 2 * bb[0] * va + 2 * a * vb[0], "b": np.array([2 * a @ va, 0.0]) - np.sin(bb) * vb}
    assert_close(ad.hvp(b, f, x, v), expected, RTOL[dtype], dtype)


def test_hessian_of_prod_with_a_zero(b):
    # PyTensor's prod has no second derivative; the adapter's autoray translation has
    x = np.array([2.0, 0.0, 3.0, -1.0])
    h = ad.hessian(b, lambda x: anp.prod(x), x)
    expected = np.array([[0.0, -3.0, 0.0, 0.0], [-3.0, 0.0, -2.0, 6.0], [0.0, -2.0, 0.0, 0.0], [0.0, 6.0, 0.0, 0.0]])
    assert_close(h, expected, 1e-12, "float64")
    assert_close(ad.gradient(b, lambda x: anp.prod(x), x), np.array([0.0, -6.0, 0.0, 0.0]), 1e-12, "float64")


# ------------------------------------------------------------ float32 pitfall
def constants_f(x):
    # 0.1 and 0.3 are not float32 numbers: PyTensor makes them float64 constants
    return anp.sum(0.1 * x**2 + anp.sin(0.3 * x)) + np.float64(0.5)


def test_python_float_constants_do_not_upcast_float32(b):
    x = point(3, "float32")
    y, g = ad.value_and_gradient(b, constants_f, x)
    assert y.dtype == np.float32 and g.dtype == np.float32
    u = x.astype(np.float64)
    assert_close(g, 0.2 * u + 0.3 * np.cos(0.3 * u), 1e-5, "float32")
    assert ad.hessian(b, constants_f, x).dtype == np.float32
    assert ad.hvp(b, constants_f, x, x).dtype == np.float32
    vec = lambda x: 0.1 * x + np.float64(1.0)  # noqa: E731
    assert ad.jacobian(b, vec, x).dtype == np.float32
    assert ad.pushforward(b, vec, x)(x).dtype == np.float32
    y, vjp = ad.value_and_pullback(b, vec, x)
    assert y.dtype == np.float32 and vjp(x).dtype == np.float32
    (_, aux), _ = ad.value_and_gradient(b, lambda x: (anp.sum(x), 0.1 * x), x, has_aux=True)
    assert aux.dtype == np.float32  # aux computed from x too
    # float64 stays float64, exactly
    x64 = np.array([0.1, 0.2, 0.3]) + 1e-12
    np.testing.assert_allclose(ad.gradient(b, sin_sum, x64), np.cos(x64) * x64 + np.sin(x64), rtol=1e-14)


def test_default_mode_keeps_float32():
    # PyTensor's own default mode (Numba in PyTensor 3): one small graph, float32 kept
    b = ad.backend("pytensor")
    assert b.mode is None
    x = point(3, "float32")
    g = ad.gradient(b, constants_f, x)
    assert type(g) is np.ndarray and g.dtype == np.float32
    u = x.astype(np.float64)
    np.testing.assert_allclose(g, 0.2 * u + 0.3 * np.cos(0.3 * u), rtol=1e-5)


# ------------------------------------------------------------ unconnected inputs
def test_unconnected_inputs_get_zeros_everywhere(b):
    def f(x):
        return anp.tanh(x["used"]) * 2.0

    def scalar(x):
        return anp.sum(f(x))

    x = {"used": point(3, "float64"), "unused": point(2, "float64", seed=1)}
    v = {"used": point(3, "float64", seed=2), "unused": point(2, "float64", seed=3)}
    g = ad.gradient(b, scalar, x)
    assert g["unused"] is not None and np.array_equal(g["unused"], np.zeros(2))
    assert np.array_equal(ad.jacobian(b, f, x)["unused"], np.zeros((3, 2)))
    assert np.array_equal(ad.pullback(b, f, x)(np.ones(3))["unused"], np.zeros(2))
    assert np.array_equal(ad.hvp(b, scalar, x, v)["unused"], np.zeros(2))
    jvp = ad.pushforward(b, f, x)
    assert np.array_equal(jvp({"used": np.zeros(3), "unused": np.ones(2)}), np.zeros(3))
    # f that uses none of x: a constant output, zeros for everything
    const = lambda x: np.float64(3.0) + 0.0 * anp.sum(x["used"][:0])  # noqa: E731
    assert np.array_equal(ad.gradient(b, const, x)["used"], np.zeros(3))
    assert np.array_equal(ad.gradient(b, lambda x: np.float64(3.0), x)["unused"], np.zeros(2))
    assert np.array_equal(ad.hessian(b, lambda x: anp.sum(x * 2.0), np.ones(2)), np.zeros((2, 2)))


# ------------------------------------------------------------ compilation caching
def test_one_compilation_per_signature():
    b = fresh()

    def loss(w, a, t):
        return least_squares(w, a, t)

    w, (a, t) = point(4, "float32"), _lsq_data("float32")
    operators = [
        lambda: ad.value_and_gradient(b, loss, w, a, t),
        lambda: ad.gradient(b, loss, w, a, t),
        lambda: ad.hessian(b, loss, w, a, t),
        lambda: ad.hvp(b, loss, w, w, a, t),
        lambda: ad.jacobian(b, loss, w, a, t),
        lambda: ad.pullback(b, loss, w, a, t)(np.float32(1.0)),
        lambda: ad.pushforward(b, loss, w, a, t)(w),
        lambda: ad.prepare_gradient(b, loss, w, a, t)(w, a, t),
    ]
    for op in operators:
        op()
        compiled, traced = b.compilations, b.trace_count
        op()
        assert (b.compilations, b.trace_count) == (compiled, traced)
    compiled, traced = b.compilations, b.trace_count
    # new data of the same signature: symbolic inputs, no recompilation and no retrace
    for seed in range(3):
        a2, t2 = _lsq_data("float32", seed=seed + 10)
        y, g = ad.value_and_gradient(b, loss, point(4, "float32", seed=seed), a2, t2)
        assert_close(g, a2.T @ (a2 @ point(4, "float32", seed=seed) - t2), 1e-4, "float32")
    assert (b.compilations, b.trace_count) == (compiled, traced)
    # a new dtype, or a new shape, compiles once
    ad.gradient(b, loss, point(4, "float64"), *_lsq_data("float64"))
    ad.gradient(b, loss, point(4, "float64", seed=3), *_lsq_data("float64", seed=3))
    assert b.compilations == compiled + 1
    a3 = np.ones((7, 4), dtype="float32")
    ad.gradient(b, loss, w, a3, np.ones(7, dtype="float32"))
    ad.gradient(b, loss, w, 2 * a3, np.ones(7, dtype="float32"))
    assert b.compilations == compiled + 2


SCALE = 2.0


def test_static_arguments_and_globals_are_part_of_the_trace(monkeypatch):
    b = fresh()

    def f(x, power):  # power: a Python int, static (closed over, part of the plan)
        return anp.sum(x**power) * SCALE

    x = np.array([1.0, 2.0])
    assert_close(ad.gradient(b, f, x, 2), 2.0 * 2 * x, 1e-12, "float64")
    assert_close(ad.gradient(b, f, x, 3), 2.0 * 3 * x**2, 1e-12, "float64")
    # a global the compiled graph froze as a constant: the core keys plans on its value
    monkeypatch.setitem(globals(), "SCALE", 5.0)
    assert_close(ad.gradient(b, f, x, 2), 5.0 * 2 * x, 1e-12, "float64")
    assert b.compilations == 3


def test_artefacts_are_not_shared_between_modes():
    fast, default = fresh(), ad.backend("pytensor")
    assert fast != default and fast.options == {"device": "cpu", "mode": "FAST_COMPILE"}
    x = point(3, "float64")
    g1 = ad.gradient(fast, sin_sum, x)
    g2 = ad.gradient(default, sin_sum, x)
    np.testing.assert_allclose(g1, g2, rtol=1e-13)
    assert fast.compilations == 1


# ------------------------------------------------------------ errors
def branchy(x):
    if anp.sum(x) > 0:
        return anp.sum(x**2)
    return -anp.sum(x)


@pytest.mark.parametrize("operator", [ad.gradient, ad.jacobian, ad.hessian, ad.pullback])
def test_python_control_flow_on_symbolic_values(b, operator):
    with pytest.raises(ad.TracedControlFlowError, match="where") as info:
        operator(b, branchy, np.ones(3))
    assert "boolean" in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)


def test_shapes_as_python_ints_and_static_flags(b):
    def by_shape(x):
        return anp.sum(x[: int(x.shape[0]) - 1] ** 2)

    with pytest.raises(ad.TracedControlFlowError, match=r"autoray\.shape"):
        ad.gradient(b, by_shape, np.ones(3))
    import autoray

    def static_shape(x):  # autoray.shape is static on PyTensor
        n = autoray.shape(x)[0]
        return anp.sum(x[: n - 1] ** 2)

    assert_close(ad.gradient(b, static_shape, np.ones(3)), np.array([2.0, 2.0, 0.0]), 1e-12, "float64")

    def flagged(x, positive):  # a Python bool argument is static: the branch is taken at trace time
        return anp.sum(x**2) if positive else -anp.sum(x)

    assert_close(ad.gradient(b, flagged, np.ones(2), True), np.array([2.0, 2.0]), 1e-12, "float64")
    assert_close(ad.gradient(b, flagged, np.ones(2), False), np.array([-1.0, -1.0]), 1e-12, "float64")


def test_numpy_calls_on_symbolic_values_get_a_hint(b):
    with pytest.raises(ValueError) as info:
        ad.gradient(b, lambda x: anp.sum(np.array(x, dtype=float)), np.ones(2))
    assert "autoray" in "".join(getattr(info.value, "__notes__", []))


@pytest.mark.parametrize("operator", ["gradient", "jacobian", "hessian", "pushforward", "pullback", "hvp"])
def test_user_exception_propagates_unchanged(b, operator):
    class Boom(RuntimeError):
        pass

    def f(x):
        raise Boom("from f")

    call = {
        "gradient": lambda: ad.gradient(b, f, np.ones(2)),
        "jacobian": lambda: ad.jacobian(b, f, np.ones(2)),
        "hessian": lambda: ad.hessian(b, f, np.ones(2)),
        "pushforward": lambda: ad.pushforward(b, f, np.ones(2)),
        "pullback": lambda: ad.pullback(b, f, np.ones(2)),
        "hvp": lambda: ad.hvp(b, f, np.ones(2), np.ones(2)),
    }[operator]
    with pytest.raises(Boom, match="from f"):
        call()


def test_non_scalar_output(b):
    for op in (ad.gradient, ad.value_and_gradient, ad.hessian):
        with pytest.raises(ad.NonScalarOutputError, match=r"shape \(3,\)"):
            op(b, lambda x: x * 2, np.ones(3))
    with pytest.raises(ad.NonScalarOutputError, match="hvp"):
        ad.hvp(b, lambda x: x * 2, np.ones(3), np.ones(3))


def test_bad_options_and_inputs(b):
    with pytest.raises(ad.InvalidArgumentError, match="FAST_COMPILE"):
        ad.backend("pytensor", mode="FAST")
    with pytest.raises(ad.InvalidArgumentError, match="another library"):
        ad.backend("pytensor", mode="JAX")
    with pytest.raises(TypeError, match="mode"):
        ad.backend("pytensor", mode=3)
    with pytest.raises(ad.NonDifferentiableInputError):
        ad.gradient(b, lambda x: anp.sum(x), np.arange(3))
    with pytest.raises(ad.InvalidOutputError, match="str"):
        ad.gradient(b, lambda x: "nope", np.ones(3))


# ------------------------------------------------------------ arrays and devices
def test_arrays_and_conversions(b):
    x = np.ones(2)
    sym = pt.tensor(dtype="float32", shape=(2,))
    shared = pytensor.shared(np.arange(3.0))
    assert b.is_native(x) and b.is_native(sym) and not b.is_native(shared)
    assert b.asarray(x) is x
    assert b.asarray([1.0, 2.0], "float32").dtype == np.float32
    np.testing.assert_array_equal(ad.to_numpy({"s": shared, "c": pt.constant(np.ones(2))})["s"], np.arange(3.0))
    with pytest.raises(TypeError, match="symbolic"):
        b.to_numpy(sym)
    assert b.cast(x, "float32").dtype == np.float32 and b.cast(sym, "float64").dtype == "float64"
    # another byte order is converted (compiled functions trust their inputs' types)
    swapped = np.array([0.5, 1.5], dtype=">f8")
    assert_close(ad.gradient(b, sin_sum, swapped), np.cos([0.5, 1.5]) * [0.5, 1.5] + np.sin([0.5, 1.5]),
                 1e-12, "float64")
    # inputs with other strides, and read-only ones, give the same results
    a = np.arange(12.0).reshape(4, 3) / 10
    ro = a[::-1].copy()
    ro.flags.writeable = False
    for data in (a[::-1], np.asfortranarray(a[::-1]), ro):
        assert_close(ad.gradient(b, least_squares, np.ones(3), data, np.ones(4)),
                     ad.gradient(b, least_squares, np.ones(3), np.ascontiguousarray(a[::-1]), np.ones(4)),
                     1e-12, "float64")


def test_devices():
    b = ad.backend("pytensor")
    assert isinstance(b, ad.Backend) and isinstance(b.adapter, PyTensorAdapter)
    assert not issubclass(PyTensorAdapter, ad.Backend)
    assert b.devices() == ["cpu"] and b.device == "cpu"
    assert ad.backend("pytensor", device="CPU").device == "cpu"
    assert ad.backend("pytensor", device="cpu:0").device == "cpu"
    for name in ("cuda", "gpu", "cuda:0", "gpu:1"):
        with pytest.raises(ad.DeviceError, match=r"pytensor backend: device .* not available.*available devices: cpu"):
            ad.backend("pytensor", device=name)


def test_global_settings_untouched(b):
    before = (pytensor.config.floatX, pytensor.config.mode, pytensor.config.cast_policy)
    x32 = point(3, "float32")
    ad.gradient(b, constants_f, x32)
    ad.hessian(b, constants_f, x32)
    vs = ad.variables([x32], b)
    ad.gradient(ad.Implicit(b), lambda: anp.sum(vs[0] ** 2), ad.Params(vs))
    assert (pytensor.config.floatX, pytensor.config.mode, pytensor.config.cast_policy) == before


# ------------------------------------------------------------ nested use
def test_nested_gradient_inside_a_trace(b):
    seen = []

    def inner(z):
        return anp.sum(anp.sin(z) ** 2)

    def outer(x):
        seen.append(b.is_native(x) and not isinstance(x, np.ndarray))
        return anp.sum(ad.gradient(b, inner, x))  # sum of sin(2x)

    x = point(4, "float64")
    assert_close(ad.gradient(b, outer, x), 2 * np.cos(2 * x), 1e-10, "float64")
    assert seen and all(seen)  # symbolic inputs, seen as native, never converted
    assert_close(ad.hessian(b, outer, x), np.diag(-4 * np.sin(2 * x)), 1e-10, "float64")
    inner_jac = lambda x: anp.sum(ad.jacobian(b, lambda z: anp.sin(z) * z, x))  # noqa: E731
    assert_close(ad.gradient(b, inner_jac, x), 2 * np.cos(x) - x * np.sin(x), 1e-10, "float64")


def test_nested_pullback_inside_a_trace(b):
    x = point(4, "float64")
    g = ad.gradient(b, lambda x: anp.sum(ad.pullback(b, anp.sin, x)(np.ones(4))), x)
    assert_close(g, -np.sin(x), 1e-10, "float64")


# ------------------------------------------------------------ implicit mode
def test_variables_are_shared_variables(b):
    vs = ad.variables({"w": point(3, "float32"), "n": 3, "idx": np.array([0, 1])}, b)
    assert isinstance(vs["w"], pytensor.compile.sharedvalue.SharedVariable)
    assert vs["w"].type.shape == (3,) and vs["w"].dtype == "float32"
    assert vs["n"] == 3 and type(vs["idx"]) is np.ndarray
    assert b.is_variable(vs["w"]) and ad.Params(vs).kind == "pytensor"
    assert len(ad.Params([pytensor.shared(np.arange(3))])) == 0  # integer variables are data, as in explicit mode
    with pytest.raises(ad.NonDifferentiableInputError, match="not a tensor"):
        ad.Params([pytensor.shared(np.random.default_rng(0))])


@pytest.mark.parametrize("dtype", DTYPES)
def test_implicit_gradient_pullback_and_aux(b, dtype):
    imp = ad.Implicit(b)
    w = pytensor.shared(point(4, dtype), name="w")  # a user's own shared variables, no static shape
    unused = pytensor.shared(point(2, dtype, seed=1))
    a, t = _lsq_data(dtype)

    def loss(a, t):
        r = pt.dot(a, w) - t  # PyTensor code reading the shared variable directly
        return 0.5 * pt.sum(r**2)

    params = ad.Params({"w": w, "unused": unused})
    wv = w.get_value().astype(np.float64)
    r = a.astype(np.float64) @ wv - t
    y, gs = ad.value_and_gradient(imp, loss, params, a, t)
    assert_close(y, 0.5 * r @ r, RTOL[dtype], dtype)
    assert_close(gs[w], a.T @ r, RTOL[dtype], dtype)
    assert_close(gs[unused], np.zeros(2), RTOL[dtype], dtype)  # zeros, not None
    (y2, aux), gs2 = ad.value_and_gradient(imp, lambda a, t: (loss(a, t), {"w": w * 0.1, "k": 1}), params, a, t,
                                           has_aux=True)
    assert_close(aux["w"], 0.1 * wv, RTOL[dtype], dtype) and aux["k"] == 1
    y3, vjp = ad.value_and_pullback(imp, loss, params, a, t)
    assert_close(vjp(np.asarray(2.0, dtype=dtype))[w], 2 * a.T @ r, RTOL[dtype], dtype)
    assert_close(ad.prepare_gradient(imp, loss, params, a, t)(params, a, t)[w], a.T @ r, RTOL[dtype], dtype)
    np.testing.assert_array_equal(w.get_value(), wv.astype(dtype))  # values read, never written


def test_implicit_compiles_once_and_reads_current_values():
    b = fresh()
    imp = ad.Implicit(b)
    w = ad.variables(np.array([1.0, 2.0]), b)

    def f(scale):
        return anp.sum(w**2) * scale

    params = ad.Params([w])
    assert_close(ad.gradient(imp, f, params, np.asarray(3.0))[w], np.array([6.0, 12.0]), 1e-12, "float64")
    compiled = b.compilations
    w.set_value(np.array([-1.0, 0.5]))  # read at run time: no recompilation
    assert_close(ad.gradient(imp, f, params, np.asarray(2.0))[w], np.array([-4.0, 2.0]), 1e-12, "float64")
    assert b.compilations == compiled
    other = ad.variables(np.array([1.0, 2.0]), b)  # other variables: a graph of their own
    ad.gradient(imp, lambda s: anp.sum(other**2) * s, ad.Params([other]), np.asarray(1.0))
    assert b.compilations == compiled + 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_both_modes_keeps_dtype(b, dtype):
    def loss(model, x, y):
        return anp.mean((x @ model["w"] + model["b"] - y) ** 2)

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 3)).astype(dtype), rng.normal(size=(8, 1)).astype(dtype)) for _ in range(3)]
    init = {"w": np.zeros((3, 1), dtype=dtype), "b": np.zeros(1, dtype=dtype)}
    rule = optim.Adam(lr=0.05)
    state, model = ad.train(loss, dict(init), batches, optim.setup(rule, init), backend=b, epochs=2,
                            progress=False)
    assert all(type(v) is np.ndarray and v.dtype == np.dtype(dtype) for v in model.values())

    variables = ad.variables(init, b)
    istate = optim.setup(rule, variables)
    istate, variables = ad.train(loss, variables, batches, istate, backend=ad.Implicit(b), epochs=2, progress=False)
    got = {k: v.get_value() for k, v in variables.items()}
    assert all(v.dtype == np.dtype(dtype) for v in got.values())
    for k in init:
        np.testing.assert_allclose(got[k], model[k], rtol=1e-5 if dtype == "float32" else 1e-12)
    # optimiser updates on PyTensor values keep their dtype
    state2, model2 = optim.update(optim.setup(optim.Momentum(), init), init, {k: np.ones_like(v) for k, v in
                                                                            init.items()})
    assert all(v.dtype == np.dtype(dtype) for v in model2.values())


def test_checkpoint_round_trip_explicit_and_implicit(b, tmp_path):
    init = {"w": point(3, "float32"), "b": np.zeros(1, dtype="float32")}
    rule = optim.Adam(lr=0.1)

    def loss(model, x):
        return anp.sum((model["w"] * x + model["b"]) ** 2)

    x = np.ones(3, dtype="float32")
    state, model = ad.train(loss, dict(init), [(x,)], optim.setup(rule, init), backend=b, progress=False)
    path = os.fspath(tmp_path / "explicit.npz")
    ad.save_checkpoint(path, state, model)
    like = (optim.setup(rule, init), {k: np.zeros_like(v) for k, v in init.items()})
    state2, model2 = ad.load_checkpoint(path, like=like)
    assert state2.step == state.step == 1
    for k in init:
        np.testing.assert_array_equal(model2[k], model[k])

    variables = ad.variables(init, b)
    istate, variables = ad.train(loss, variables, [(x,)], optim.setup(rule, variables), backend=ad.Implicit(b),
                                 progress=False)
    path = os.fspath(tmp_path / "implicit.npz")
    ad.save_checkpoint(path, istate, variables)
    fresh_vars = ad.variables({k: np.zeros_like(v) for k, v in init.items()}, b)
    istate2, restored = ad.load_checkpoint(path, like=(optim.setup(rule, fresh_vars), fresh_vars))
    assert restored is fresh_vars and istate2.step == 1
    for k in init:
        got = restored[k].get_value()
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, variables[k].get_value())
    with pytest.raises(TypeError, match="float64"):
        b.write(restored["w"], np.zeros(3))  # a shared variable keeps its dtype

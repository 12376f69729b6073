"""The jax adapter: every operator against analytic derivatives and finite differences,
plus jax's pitfalls (scoped x64, retracing, control flow under jit, nested tracers, devices)."""

from __future__ import annotations

import math

import numpy as np
import optree
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from abstractdiff.adapters.jax import JaxAdapter  # noqa: E402
from autoray import numpy as anp  # noqa: E402

import abstractdiff as ad  # noqa: E402

DTYPES = ["float32", "float64"]
# Against analytic derivatives (computed in float64).  Finite differences are accurate to
# ~1e-10 (float64) / ~1e-5 (float32) relative at first order and worse at second order.
RTOL = {"float32": 1e-4, "float64": 1e-9}
FD_RTOL = {1: {"float32": 2e-3, "float64": 1e-8}, 2: {"float32": 2e-2, "float64": 1e-6}}
GPU_RTOL = {"float32": 1e-5, "float64": 1e-10}


@pytest.fixture(scope="module")
def b() -> ad.Backend:
    return ad.backend("jax")


@pytest.fixture(scope="module")
def fd():
    return ad.backend("finite_differences")


def leaves(tree):
    return optree.tree_leaves(tree, none_is_leaf=True)


def assert_close(actual, expected, rtol: float, dtype: str | None = None) -> None:
    """Leaf-wise comparison with atol = rtol * max|expected|; checks native type and dtype."""
    a_leaves, e_leaves = leaves(actual), leaves(expected)
    assert len(a_leaves) == len(e_leaves)
    for a, e in zip(a_leaves, e_leaves):
        if e is None:
            assert a is None
            continue
        assert isinstance(a, jax.Array), type(a)
        if dtype is not None:
            assert str(a.dtype) == dtype
        a, e = np.asarray(a), np.asarray(ad.to_numpy(e), dtype=np.float64)
        assert a.shape == e.shape
        scale = float(np.max(np.abs(e), initial=0.0)) or 1.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def point(n: int, dtype: str, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1.0, 1.0, n).astype(dtype)


# ------------------------------------------------------------------ scenarios
# Each: f, x (and args) builder, analytic gradient and Hessian in float64.
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


def _lsq_data(dtype):
    rng = np.random.default_rng(1)
    return rng.normal(size=(6, 4)).astype(dtype), rng.normal(size=6).astype(dtype)


SCALAR = {
    "sin_sum": (
        sin_sum,
        lambda dt: (point(5, dt), ()),
        lambda x: np.cos(x) * x + np.sin(x),
        lambda x: np.diag(2 * np.cos(x) - np.sin(x) * x),
    ),
    "logsumexp": (
        logsumexp,
        lambda dt: (point(5, dt), ()),
        _softmax,
        lambda x: np.diag(_softmax(x)) - np.outer(_softmax(x), _softmax(x)),
    ),
    "least_squares": (
        least_squares,
        lambda dt: (point(4, dt), _lsq_data(dt)),
        lambda w, a, t: a.T @ (a @ w - t),
        lambda w, a, t: a.T @ a,
    ),
}


def f64(*arrays):
    return [np.asarray(v, dtype=np.float64) for v in arrays]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(SCALAR))
def test_gradient_and_hessian(b, fd, name, dtype):
    f, make, grad, hess = SCALAR[name]
    x, args = make(dtype)
    x0 = x.copy()
    g = ad.gradient(b, f, x, *args)
    assert_close(g, grad(*f64(x, *args)), RTOL[dtype], dtype)
    assert_close(g, ad.gradient(fd, f, x, *args), FD_RTOL[1][dtype], dtype)
    h = ad.hessian(b, f, x, *args)
    assert_close(h, hess(*f64(x, *args)), RTOL[dtype], dtype)
    assert_close(h, ad.hessian(fd, f, x, *args), FD_RTOL[2][dtype], dtype)
    v = point(x.size, dtype, seed=5)
    assert_close(ad.hvp(b, f, x, v, *args), hess(*f64(x, *args)) @ v.astype(np.float64), RTOL[dtype], dtype)
    np.testing.assert_array_equal(x, x0)  # the caller's input is left alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_and_gradient_with_and_without_aux(b, dtype):
    w, (a, t) = point(4, dtype), _lsq_data(dtype)
    r = a.astype(np.float64) @ w.astype(np.float64) - t
    y, g = ad.value_and_gradient(b, least_squares, w, a, t)
    assert_close(y, 0.5 * r @ r, RTOL[dtype], dtype)
    assert_close(g, a.T @ r, RTOL[dtype], dtype)

    def with_aux(w, a, t):
        res = a @ w - t
        return 0.5 * anp.sum(res * res), {"residual": res, "n": 6, "tag": "lsq", "const": np.arange(2)}

    (y2, aux), g2 = ad.value_and_gradient(b, with_aux, w, a, t, has_aux=True)
    assert_close(y2, 0.5 * r @ r, RTOL[dtype], dtype)
    assert_close(g2, a.T @ r, RTOL[dtype], dtype)
    assert_close(aux["residual"], r, RTOL[dtype], dtype)
    # Non-array aux leaves come back as they were, not as jax arrays.
    assert aux["n"] == 6 and type(aux["n"]) is int and aux["tag"] == "lsq"
    np.testing.assert_array_equal(aux["const"], np.arange(2))
    g3, aux3 = ad.gradient(b, with_aux, w, a, t, has_aux=True)
    assert_close(g3, a.T @ r, RTOL[dtype], dtype)
    assert aux3["n"] == 6 and aux3["tag"] == "lsq"


def tree_f(x, scale):
    # "k" (an int) and "idx" (an int array) are not differentiated; "unused" does not
    # affect the output and must get zeros.
    w, (bias, k, idx, _unused) = x["w"], x["rest"]
    return anp.sum(anp.sin(w) * bias[0]) * k + anp.sum(w[idx] ** 2) * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_pytree_with_int_and_unconnected_leaves(b, fd, dtype):
    w, bias, unused = point(3, dtype), point(2, dtype, seed=2), point(2, dtype, seed=3)
    x = {"w": w, "rest": (bias, 3, np.array([0, 2]), unused)}
    g = ad.gradient(b, tree_f, x, np.asarray(1.5, dtype=dtype))
    wd, bd = f64(w, bias)
    gw = 3 * np.cos(wd) * bd[0] + 1.5 * 2 * wd * np.array([1.0, 0.0, 1.0])
    gb = np.array([3 * np.sin(wd).sum(), 0.0])
    expected = {"w": gw, "rest": (gb, None, None, np.zeros(2))}
    assert_close(g, expected, RTOL[dtype], dtype)
    assert_close(g, ad.gradient(fd, tree_f, x, np.asarray(1.5, dtype=dtype)), FD_RTOL[1][dtype], dtype)
    np.testing.assert_array_equal(np.asarray(g["rest"][3]), 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hvp_on_a_pytree(b, fd, dtype):
    def f(x):
        return anp.sum(x["a"] ** 2 * x["b"][0]) + anp.sum(anp.sin(x["b"]))

    x = {"a": point(3, dtype), "b": point(2, dtype, seed=1)}
    v = {"a": point(3, dtype, seed=2), "b": point(2, dtype, seed=3)}
    a, bb, va, vb = f64(x["a"], x["b"], v["a"], v["b"])
    expected = {
        "a": 2 * bb[0] * va + 2 * a * vb[0],
        "b": np.array([2 * a @ va, 0.0]) - np.sin(bb) * vb,
    }
    assert_close(ad.hvp(b, f, x, v), expected, RTOL[dtype], dtype)
    assert_close(ad.hvp(b, f, x, v), ad.hvp(fd, f, x, v), FD_RTOL[2][dtype], dtype)


def vector_f(x):
    return anp.sin(x) * x[0]


def vector_jacobian(x):
    j = np.diag(np.cos(x) * x[0])
    j[:, 0] += np.sin(x)
    return j


def tall_f(x):  # more outputs than inputs: the jacobian takes the forward route
    return anp.concatenate([anp.sin(x), x**2, x * x[0]])


def tall_jacobian(x):
    first = np.eye(len(x))[0]
    return np.concatenate([np.diag(np.cos(x)), np.diag(2 * x), x[0] * np.eye(len(x)) + np.outer(x, first)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["square", "tall", "wide"])
def test_jacobian(b, fd, shape, dtype):
    x = point(4, dtype)
    f, expected = {
        "square": (vector_f, vector_jacobian),
        "tall": (tall_f, tall_jacobian),
        "wide": (
            lambda x: anp.sum(anp.reshape(x, (2, 2)) ** 2, axis=1),
            lambda x: np.kron(np.eye(2), np.ones((1, 2))) * 2 * x,
        ),
    }[shape]
    j = ad.jacobian(b, f, x)
    assert_close(j, expected(x.astype(np.float64)), RTOL[dtype], dtype)
    assert_close(j, ad.jacobian(fd, f, x), FD_RTOL[1][dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pullback_and_pushforward(b, fd, dtype):
    x, dy, dx = point(4, dtype), point(4, dtype, seed=1), point(4, dtype, seed=2)
    jac = vector_jacobian(x.astype(np.float64))
    y, vjp = ad.value_and_pullback(b, vector_f, x)
    assert_close(y, np.sin(x.astype(np.float64)) * float(x[0]), RTOL[dtype], dtype)
    # The closures run after the operator returned, outside any x64 scope of the caller.
    assert_close(vjp(dy), dy.astype(np.float64) @ jac, RTOL[dtype], dtype)
    assert_close(vjp(b.asarray(dy)), dy.astype(np.float64) @ jac, RTOL[dtype], dtype)  # a native cotangent
    assert_close(ad.pullback(b, vector_f, x)(dy), ad.pullback(fd, vector_f, x)(dy), FD_RTOL[1][dtype], dtype)
    y2, jvp = ad.value_and_pushforward(b, vector_f, x)
    assert_close(y2, y, RTOL[dtype], dtype)
    assert_close(jvp(dx), jac @ dx.astype(np.float64), RTOL[dtype], dtype)
    assert_close(ad.pushforward(b, vector_f, x)(dx), ad.pushforward(fd, vector_f, x)(dx), FD_RTOL[1][dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_derivative(b, fd, dtype):
    def f(t):
        return anp.sin(t * np.arange(1.0, 4.0).astype(dtype))

    t = np.asarray(0.7, dtype=dtype)
    expected = np.arange(1.0, 4.0) * np.cos(0.7 * np.arange(1.0, 4.0))
    assert_close(ad.derivative(b, f, t), expected, RTOL[dtype], dtype)
    assert_close(ad.derivative(b, f, t), ad.derivative(fd, f, t), FD_RTOL[1][dtype], dtype)


# ------------------------------------------------------------------ x64
@pytest.mark.parametrize("compile", [True, False])
def test_float64_is_scoped_and_global_x64_untouched(compile):
    b = ad.backend("jax", compile=compile)
    before = bool(jax.config.jax_enable_x64)
    x = point(3, "float64")
    outputs = [
        ad.gradient(b, sin_sum, x),
        ad.value_and_gradient(b, sin_sum, x)[0],
        ad.hessian(b, sin_sum, x),
        ad.hvp(b, sin_sum, x, x),
        ad.jacobian(b, vector_f, x),
        ad.pullback(b, vector_f, x)(x),
        ad.pushforward(b, vector_f, x)(x),
        ad.derivative(b, lambda t: anp.sin(t), np.asarray(0.3)),
        b.asarray(x),
        b.zeros_like(b.asarray(x)),
        b.ones_like(b.asarray(x)),
    ]
    assert [str(o.dtype) for o in outputs] == ["float64"] * len(outputs)
    assert bool(jax.config.jax_enable_x64) == before
    # A native float64 array, made by the user under their own x64 scope, works too.
    with jax.enable_x64(True):
        native = jnp.asarray(x)
    assert str(ad.gradient(b, sin_sum, native).dtype) == "float64"
    assert bool(jax.config.jax_enable_x64) == before


@pytest.mark.parametrize("compile", [True, False])
def test_returned_closures_keep_the_x64_scope(compile):
    # Outside an x64 scope jax would turn a numpy float64 cotangent into float32, which
    # the float64 vjp/jvp then rejects: the closures must carry the scope with them.
    b = ad.backend("jax", compile=compile)
    fn, xs, data = b.flatten(vector_f, point(3, "float64"), ())
    _, _, vjp = b.flat_value_and_pullback(fn, xs, data)
    _, _, jvp = b.flat_value_and_pushforward(fn, xs, data)
    assert [str(g.dtype) for g in vjp(np.ones(3))] == ["float64"]
    assert str(jvp([np.ones(3)]).dtype) == "float64"


def test_flat_operators_accept_plain_callables(b):
    # A flat function without .cache (an adapter built on this one) runs un-jitted, aux as is.
    def plain(xs, data):
        return anp.sum(xs[0] ** 2 * data[0]), {"n": 3}

    xs, data = [b.asarray(point(3, "float32"))], [b.asarray(np.full(3, 2.0, dtype="float32"))]
    y, aux, grads = b.flat_value_and_gradient(plain, xs, data)
    assert aux == {"n": 3}
    assert_close(grads, [4 * np.asarray(xs[0], dtype=np.float64)], RTOL["float32"], "float32")


def test_float64_result_is_exact_to_float64_precision(b):
    # Truncation to float32 anywhere would leave errors of ~1e-8.
    x = np.array([0.1, 0.2, 0.3]) + 1e-12
    g = np.asarray(ad.gradient(b, sin_sum, x))
    np.testing.assert_allclose(g, np.cos(x) * x + np.sin(x), rtol=1e-14)


# ------------------------------------------------------------------ caching
def test_second_call_does_not_retrace():
    b = ad.backend("jax")

    def loss(w, a, t):
        return least_squares(w, a, t)

    w, (a, t) = point(4, "float32"), _lsq_data("float32")
    operators = [
        lambda: ad.value_and_gradient(b, loss, w, a, t),
        lambda: ad.hessian(b, loss, w, a, t),
        lambda: ad.hvp(b, loss, w, w, a, t),
        lambda: ad.jacobian(b, loss, w, a, t),
        lambda: ad.pullback(b, loss, w, a, t)(np.float32(1.0)),
        lambda: ad.pushforward(b, loss, w, a, t)(w),
    ]
    for op in operators:
        op()
        traced = b.trace_count
        op()
        assert b.trace_count == traced
    traced = b.trace_count
    # New data values of the same shapes are traced arguments: no retrace either.
    for seed in range(3):
        rng = np.random.default_rng(seed)
        ad.value_and_gradient(
            b, loss, rng.normal(size=4).astype("float32"), rng.normal(size=(6, 4)).astype("float32"), t
        )
    assert b.trace_count == traced
    # A new shape or dtype does retrace, once.
    ad.gradient(b, loss, point(4, "float64"), *_lsq_data("float64"))
    ad.gradient(b, loss, point(4, "float64"), *_lsq_data("float64"))
    assert b.trace_count == traced + 1


SCALE = 2.0


def scaled_sin_sum(x, s=1.0):
    return SCALE * anp.sum(anp.sin(x) * x) * math.copysign(1.0, s)


def test_unprepared_calls_on_jax_arrays_take_jit_alone_and_see_every_change(monkeypatch):
    """The hot call: jit's dispatch for the whole unprepared operator, guarded by the
    captures; shapes, dtypes, structures and static values of every kind still right."""
    global SCALE
    b = ad.backend("jax")
    x = jnp.asarray(point(4, "float32"))
    flattened = []
    monkeypatch.setattr(type(b), "flatten", lambda self, *a: flattened.append(1) or ad.Backend.flatten(self, *a))

    def want(x, s=1.0):
        x = np.asarray(x, dtype=np.float64)
        return SCALE * (np.cos(x) * x + np.sin(x)) * math.copysign(1.0, s)

    ad.gradient(b, scaled_sin_sum, x)
    traced = b.trace_count
    flattened.clear()
    for _ in range(3):
        assert_close(ad.gradient(b, scaled_sin_sum, x + 1), want(x + 1), RTOL["float32"], "float32")
    assert b.trace_count == traced and not flattened  # no retrace, no flattening: jit's dispatch alone
    try:
        SCALE = 3.0
        assert_close(ad.gradient(b, scaled_sin_sum, x), want(x), RTOL["float32"], "float32")
        assert b.trace_count == traced + 1  # a changed global: traced again
    finally:
        SCALE = 2.0
    with jax.enable_x64(True):
        wide = jnp.asarray(point(4, "float64"))
    cases = [(x, 1.0), (x[:3], 1.0), (x, -0.0), (x, 0.0), (wide, 1.0), (wide, -0.0), (x[:3], 0.0)]
    for _ in range(2):  # every form once, then again (from the caches: no new traces)
        for v, s in cases:
            assert_close(ad.gradient(b, scaled_sin_sum, v, s), want(v, s), RTOL[str(v.dtype)], str(v.dtype))
        traced = b.trace_count
    assert b.trace_count == traced
    tree = {"a": x, "b": x[:2]}
    g = ad.gradient(b, lambda t: scaled_sin_sum(t["a"]) + anp.sum(t["b"] ** 2), tree)
    assert_close(g, {"a": want(x), "b": 2 * np.asarray(x[:2], np.float64)}, RTOL["float32"], "float32")
    # numpy int64 data (int32 in jax without x64), aux and hvp through their hot calls too
    for _ in range(3):
        idx = np.array([0, 2])
        (y, aux), g = ad.value_and_gradient(b, lambda x, i: (anp.sum(x[i] ** 2), {"n": 2}), x, idx, has_aux=True)
        assert aux == {"n": 2}
        assert_close(g, np.asarray(x, np.float64) * [2, 0, 2, 0], RTOL["float32"], "float32")
        assert_close(ad.hvp(b, lambda x: anp.sum(x**3), x, x), 6 * np.asarray(x, np.float64) ** 2,
                     RTOL["float32"], "float32")


def test_compile_false_runs_unjitted():
    b = ad.backend("jax", compile=False)
    assert b.options == {"device": "cpu", "compile": False}
    x = point(3, "float32")
    ad.gradient(b, sin_sum, x)
    traced = b.trace_count
    ad.gradient(b, sin_sum, x)
    assert b.trace_count == traced + 1  # every call runs f: nothing is compiled
    assert_close(ad.gradient(b, sin_sum, x), np.cos(x) * x + np.sin(x), RTOL["float32"], "float32")


# ------------------------------------------------------------------ errors
def branchy(x):
    if anp.sum(x) > 0:
        return anp.sum(x**2)
    return -anp.sum(x)


def test_control_flow_under_jit_raises_and_compile_false_fixes_it(b):
    x = np.array([1.0, 2.0, 3.0])
    with pytest.raises(ad.TracedControlFlowError, match=r"compile=False") as info:
        ad.gradient(b, branchy, x)
    assert "jnp.where" in str(info.value)
    assert isinstance(info.value.__cause__, jax.errors.ConcretizationTypeError)
    eager = ad.backend("jax", compile=False)
    assert_close(ad.gradient(eager, branchy, x), 2 * x, RTOL["float64"], "float64")
    assert_close(ad.gradient(eager, branchy, -x), -np.ones(3), RTOL["float64"], "float64")
    assert_close(ad.hessian(eager, branchy, x), 2 * np.eye(3), RTOL["float64"], "float64")


def test_float_of_traced_value_fails_even_without_jit_with_honest_message():
    def f(x):
        return anp.sum(x) * (2.0 if float(anp.sum(x)) > 0 else 1.0)

    with pytest.raises(ad.TracedControlFlowError, match=r"jnp.where") as info:
        ad.gradient(ad.backend("jax", compile=False), f, np.ones(2))
    assert "compile=False (ad.backend" not in str(info.value)  # not a fix that would work


def test_int_of_traced_value_under_jit(b):
    with pytest.raises(ad.TracedControlFlowError, match="compile=False"):
        ad.gradient(b, lambda x: anp.sum(x[: int(anp.sum(x))]), np.ones(3))


@pytest.mark.parametrize("compile", [True, False])
def test_user_exception_propagates_unchanged(compile):
    class Boom(RuntimeError):
        pass

    def f(x):
        raise Boom("from f")

    b = ad.backend("jax", compile=compile)
    for op in (ad.gradient, ad.hessian, ad.jacobian, ad.pullback, ad.pushforward):
        with pytest.raises(Boom, match="from f"):
            op(b, f, np.ones(2))


def test_non_scalar_output(b):
    for op in (ad.gradient, ad.value_and_gradient, ad.hessian):
        with pytest.raises(ad.NonScalarOutputError, match=r"shape \(3,\)"):
            op(b, lambda x: x * 2, np.ones(3))
    with pytest.raises(ad.NonScalarOutputError, match="hvp"):
        ad.hvp(b, lambda x: x * 2, np.ones(3), np.ones(3))


def test_bad_inputs_and_outputs(b):
    with pytest.raises(ad.NonDifferentiableInputError):
        ad.gradient(b, lambda x: anp.sum(x), np.arange(3))
    with pytest.raises(ad.InvalidOutputError, match="str"):
        ad.gradient(b, lambda x: "nope", np.ones(3))
    with pytest.raises(TypeError, match="compile must be True or False"):
        ad.backend("jax", compile="yes")


def test_backend_holds_the_adapter_and_reuses_traces_follows_compile():
    compiled, eager = ad.backend("jax"), ad.backend("jax", compile=False)
    assert isinstance(compiled.adapter, JaxAdapter) and compiled.adapter.backend is compiled
    assert compiled.reuses_traces and not eager.reuses_traces  # a trace is reused only when jitted
    assert compiled.compile and not eager.compile  # the adapter's option, read through the holder


# ------------------------------------------------------------------ devices
def test_devices(b):
    names = b.devices()
    assert names[0] == "cpu"
    assert b.normalise_device(None) == "cpu" and b.normalise_device("CPU") == "cpu"
    assert b.device == "cpu"
    assert list(b.asarray(np.ones(2)).devices())[0].platform == "cpu"
    with pytest.raises(ad.DeviceError, match=r"available devices: cpu") as info:
        ad.backend("jax", device="cuda:7")
    assert "cuda:7" in str(info.value)
    with pytest.raises(ad.DeviceError, match="cpu"):
        ad.backend("jax", device="quantum")
    if "cuda:0" not in names:
        with pytest.raises(ad.DeviceError, match="'gpu'"):
            ad.backend("jax", device="gpu")


# ------------------------------------------------------------------ nesting
def test_nested_gradient_matches_second_derivative(b):
    seen = []

    def inner(z):
        return anp.sum(anp.sin(z) ** 2)

    def outer(x):
        seen.append(b.is_native(x))
        return anp.sum(ad.gradient(b, inner, x))  # sum of sin(2x)

    x = point(4, "float64")
    assert_close(ad.gradient(b, outer, x), 2 * np.cos(2 * x), RTOL["float64"], "float64")
    assert seen and all(seen)  # the tracers were seen as native, not converted
    assert_close(ad.hessian(b, inner, x), np.diag(2 * np.cos(2 * x)), RTOL["float64"], "float64")
    # Nested inside a raw jax transform as well.
    assert_close(
        jax.jit(jax.grad(outer))(jnp.asarray(point(4, "float32"))),
        2 * np.cos(2 * point(4, "float32").astype(np.float64)),
        RTOL["float32"],
        "float32",
    )


# ------------------------------------------------------------------ GPU parity
def _gpu_or_skip() -> str:
    gpus = [d for d in ad.backend("jax").devices() if d.startswith("cuda")]
    if not gpus:
        pytest.skip(f"no GPU visible to jax here (jax devices: {jax.devices()})")
    return gpus[0]


def _product(b):
    """``(x, y) -> x[:2] * y`` on the custom-function hook: two inputs of different sizes (3, 2),
    so the linear solves are padded, with numpy values and jax rules."""
    vjps = (lambda c, x, y: jnp.pad(c * y, (0, 1)), lambda c, x, y: c * x[:2])
    jvps = (lambda t, x, y: t[:2] * y, lambda t, x, y: x[:2] * t)
    return b.custom_function(lambda x, y: x[:2] * y, vjps, jvps, (2, "float32"))


def test_custom_function_reverse_forward_jit_vmap_and_refused_second_order(b):
    """jacrev, jacfwd (the solves and their transposes), under jit and vmap; a second derivative
    raises (jax would take the rules' inputs as constants: a silent zero), in a kernel-free wording."""
    f = _product(b)
    x, y = jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([4.0, 5.0])
    want = (np.array([[4.0, 0, 0], [0, 5.0, 0]]), np.diag([1.0, 2.0]))
    for op in (jax.jacrev, jax.jacfwd):
        for got, expected in zip(jax.jit(op(f, argnums=(0, 1)))(x, y), want):
            np.testing.assert_allclose(got, expected)
    grads = jax.vmap(jax.grad(lambda x, y: jnp.sum(f(x, y)), argnums=1), in_axes=(None, 0))(x, jnp.stack([y, 2 * y]))
    np.testing.assert_allclose(grads, [[1.0, 2.0], [1.0, 2.0]])
    with pytest.raises(ad.CompositionError, match="second derivative through a custom function"):
        jax.hessian(lambda x: jnp.sum(f(x, y)))(x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_cpu_for_every_operator(dtype):
    device = _gpu_or_skip()
    gpu, cpu = ad.backend("jax", device="gpu"), ad.backend("jax")
    assert gpu.device == device
    w, (a, t) = point(4, dtype), _lsq_data(dtype)
    v = point(4, dtype, seed=7)
    ops = {
        "gradient": lambda be: ad.gradient(be, least_squares, w, a, t),
        "value_and_gradient": lambda be: ad.value_and_gradient(be, least_squares, w, a, t),
        "pullback": lambda be: ad.pullback(be, vector_f, w)(v),
        "pushforward": lambda be: ad.pushforward(be, vector_f, w)(v),
        "derivative": lambda be: ad.derivative(be, lambda s: anp.sin(s * w), np.asarray(0.3, dtype=dtype)),
        "jacobian": lambda be: ad.jacobian(be, tall_f, w),
        "hessian": lambda be: ad.hessian(be, logsumexp, w),
        "hvp": lambda be: ad.hvp(be, least_squares, w, v, a, t),
    }
    for name, op in ops.items():
        on_gpu, on_cpu = op(gpu), op(cpu)
        for leaf in leaves(on_gpu):
            assert list(leaf.devices())[0].platform == "gpu", name
        assert_close(on_gpu, ad.to_numpy(on_cpu), GPU_RTOL[dtype], dtype)

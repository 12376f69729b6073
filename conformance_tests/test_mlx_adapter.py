"""The MLX adapter: every operator against analytic derivatives, in float32 and float64, and
MLX's pitfalls (lazy evaluation, float64 conversions and precision, in-place updates,
missing JVP rules, compiled traces, modules without variables, devices)."""

from __future__ import annotations

import warnings

import numpy as np
import optree
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'abstractdiff[mlx]'")

import mlx.nn as nn  # noqa: E402
from abstractdiff.adapters.mlx import MLXAdapter, MLXParameter  # noqa: E402
from autoray import do  # noqa: E402
from autoray import numpy as anp  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import abstractdiff as ad  # noqa: E402
from abstractdiff import optim  # noqa: E402

DTYPES = ["float32", "float64"]
RTOL = {"float32": 1e-4, "float64": 1e-12}


@pytest.fixture(scope="module")
def b() -> ad.Backend:
    return ad.backend("mlx")


@pytest.fixture(scope="module")
def compiled() -> ad.Backend:
    return ad.backend("mlx", compile=True)


def assert_close(actual, expected, dtype: str, rtol: float | None = None) -> None:
    """Leaf-wise: an MLX array of ``dtype``, close to ``expected`` (atol = rtol * max|expected|)."""
    got, want = optree.tree_leaves(actual, none_is_leaf=True), optree.tree_leaves(expected, none_is_leaf=True)
    assert len(got) == len(want)
    rtol = RTOL[dtype] if rtol is None else rtol
    for a, e in zip(got, want):
        if e is None:
            assert a is None
            continue
        assert isinstance(a, mx.array), type(a)
        assert a.dtype == getattr(mx, dtype), (a.dtype, dtype)
        e = np.asarray(e, dtype=np.float64)
        scale = float(np.max(np.abs(e), initial=0.0)) or 1.0
        np.testing.assert_allclose(np.asarray(a, dtype=np.float64), e, rtol=rtol, atol=rtol * scale)


def point(n: int, dtype: str, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1.0, 1.0, n).astype(dtype)


def f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def sin_sum(x):  # sin, cos and their derivatives: MLX's own kernels are float32-accurate
    return anp.sum(anp.sin(x) * x**2)


def sin_sum_grad(x):
    return 2 * x * np.sin(x) + x**2 * np.cos(x)


def sin_sum_hess(x):
    return np.diag(2 * np.sin(x) + 4 * x * np.cos(x) - x**2 * np.sin(x))


def least_squares(w, a, t):
    r = a @ w - t
    return 0.5 * anp.sum(r * r)


def lsq_data(dtype):
    rng = np.random.default_rng(1)
    return rng.normal(size=(6, 4)).astype(dtype), rng.normal(size=6).astype(dtype)


def vector_f(x):
    return anp.exp(x) * x[0]


def vector_jacobian(x):
    j = np.diag(np.exp(x) * x[0])
    j[:, 0] += np.exp(x)
    return j


def tall_f(x):  # more outputs than inputs: the forward route
    return anp.concatenate([anp.cos(x), x**2])


def tall_jacobian(x):
    return np.concatenate([np.diag(-np.sin(x)), np.diag(2 * x)])


# ------------------------------------------------------------------ operators
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_operator_against_analytic_values(b, dtype):
    x = point(4, dtype)
    v = point(4, dtype, seed=2)
    (xd, vd) = f64(x, v)
    x0 = x.copy()
    assert_close(ad.gradient(b, sin_sum, x), sin_sum_grad(xd), dtype)
    y, g = ad.value_and_gradient(b, sin_sum, x)
    assert_close((y, g), (np.sum(np.sin(xd) * xd**2), sin_sum_grad(xd)), dtype)
    assert_close(ad.hessian(b, sin_sum, x), sin_sum_hess(xd), dtype)
    assert_close(ad.hvp(b, sin_sum, x, v), sin_sum_hess(xd) @ vd, dtype)
    assert_close(ad.jacobian(b, vector_f, x), vector_jacobian(xd), dtype)
    assert_close(ad.jacobian(b, tall_f, x), tall_jacobian(xd), dtype)
    y, vjp = ad.value_and_pullback(b, vector_f, x)
    assert_close(y, np.exp(xd) * xd[0], dtype)
    assert_close(vjp(v), vd @ vector_jacobian(xd), dtype)
    assert_close(vjp(b.asarray(v)), vd @ vector_jacobian(xd), dtype)  # a native cotangent
    y, jvp = ad.value_and_pushforward(b, vector_f, x)
    assert_close(jvp(v), vector_jacobian(xd) @ vd, dtype)
    t = np.asarray(0.7, dtype=dtype)
    k = np.arange(1.0, 4.0)
    assert_close(ad.derivative(b, lambda t: anp.sin(t * k.astype(dtype)), t), k * np.cos(0.7 * k), dtype,
                 rtol=1e-6 if dtype == "float32" else None)
    np.testing.assert_array_equal(x, x0)  # the caller's input is left alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_data_arguments_aux_and_prepared_operators(b, dtype):
    w, (a, t) = point(4, dtype), lsq_data(dtype)
    wd, ad_, td = f64(w, a, t)
    r = ad_ @ wd - td

    def with_aux(w, a, t):
        res = a @ w - t
        return 0.5 * anp.sum(res * res), {"residual": res, "n": 6, "tag": "lsq", "const": np.arange(2)}

    (y, aux), g = ad.value_and_gradient(b, with_aux, w, a, t, has_aux=True)
    assert_close((y, g, aux["residual"]), (0.5 * r @ r, ad_.T @ r, r), dtype)
    assert aux["n"] == 6 and type(aux["n"]) is int and aux["tag"] == "lsq"  # non-array aux as it was
    np.testing.assert_array_equal(aux["const"], np.arange(2))
    prepared = ad.prepare_gradient(b, least_squares, w, a, t)
    assert_close(prepared(w, a, t), ad_.T @ r, dtype)
    assert_close(ad.hvp(b, least_squares, w, w, a, t), ad_.T @ ad_ @ wd, dtype)
    with pytest.raises(ad.ShapeMismatchError):
        prepared(point(5, dtype), a[:, :1].repeat(5, 1), t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pytree_static_integer_and_unconnected_leaves(b, dtype):
    def f(x, scale):
        w, (bias, k, idx, _unused) = x["w"], x["rest"]
        return anp.sum(anp.tanh(w) * bias[0]) * k + anp.sum(w[idx] ** 2) * scale

    w, bias, unused = point(3, dtype), point(2, dtype, seed=2), point(2, dtype, seed=3)
    x = {"w": w, "rest": (bias, 3, np.array([0, 2]), unused)}
    g = ad.gradient(b, f, x, np.asarray(1.5, dtype=dtype))
    wd, bd = f64(w, bias)
    gw = 3 * (1 - np.tanh(wd) ** 2) * bd[0] + 3.0 * wd * np.array([1.0, 0.0, 1.0])
    expected = {"w": gw, "rest": (np.array([3 * np.tanh(wd).sum(), 0.0]), None, None, np.zeros(2))}
    assert_close(g, expected, dtype)


# ------------------------------------------------------------------ laziness
def _evaluated(a) -> bool:
    # MLX refuses to size an array it has not computed yet
    try:
        mx.get_array_buffer_size(a)
    except ValueError:
        return False
    return True


def test_the_laziness_probe_sees_unevaluated_arrays():
    lazy = mx.sin(mx.ones(3)) * 2
    assert not _evaluated(lazy)
    mx.eval(lazy)
    assert _evaluated(lazy)


def test_results_are_evaluated_before_they_are_returned(b, compiled):
    w, (a, t) = point(4, "float32"), lsq_data("float32")
    lazy_w = mx.array(w) * 1.0  # a lazy input is computed too (no chain of graphs across steps)
    outputs = [
        *ad.value_and_gradient(b, least_squares, lazy_w, a, t),
        ad.hessian(b, least_squares, w, a, t),
        ad.hvp(b, least_squares, w, w, a, t),
        ad.jacobian(b, vector_f, w),
        ad.pullback(b, vector_f, w)(w),
        ad.pushforward(b, vector_f, w)(w),
        *ad.value_and_pullback(b, vector_f, w)[:1],
        *ad.value_and_gradient(compiled, least_squares, w, a, t),  # the compiled route too
    ]
    assert all(isinstance(o, mx.array) and _evaluated(o) for o in outputs)
    assert _evaluated(lazy_w)


def test_implicit_results_are_evaluated(b):
    model = nn.Linear(3, 2)
    x = mx.ones((4, 3))
    y, gs = ad.value_and_gradient(ad.Implicit(b), lambda x: (model(x) ** 2).mean(), ad.Params(model), x)
    assert _evaluated(y) and all(_evaluated(g) for g in gs.values())


# ------------------------------------------------------------------ float64
def test_numpy_float64_stays_float64(b):
    # mx.array(a) makes a float64 numpy array float32: the adapter names the dtype
    assert mx.array(np.ones(2)).dtype == mx.float32
    for dtype in ("float64", "float32", "int64", "int32", "bool"):
        assert b.asarray(np.ones(2, dtype=dtype)).dtype == getattr(mx, dtype if dtype != "bool" else "bool_")
    assert b.asarray(0.5).dtype == mx.float64  # a Python float is float64, as in numpy
    assert b.cast(b.asarray(np.ones(2)), "float32").dtype == mx.float32
    with pytest.raises(ad.ArgumentTypeError, match="complex128"):
        b.asarray(np.ones(2, dtype=np.complex128))


def test_float64_is_exact_where_mlx_kernels_are_not(b):
    # MLX's CPU sin/cos/exp/erf are float32-accurate polynomials, float64 arrays included;
    # the autoray translations of this adapter compute them to float64 precision.  If this
    # first assertion fails, MLX fixed its kernels and the translations can go.
    x = np.linspace(-3.0, 3.0, 101)
    native_error = np.max(np.abs(np.asarray(mx.sin(mx.array(x, dtype=mx.float64))) - np.sin(x)))
    assert native_error > 1e-12, "MLX's float64 sin is exact now: drop the translations of sin/cos/exp/erf"
    xm = b.asarray(x)
    for ours, reference in ((anp.sin, np.sin), (anp.cos, np.cos), (anp.exp, np.exp), (anp.tan, np.tan)):
        np.testing.assert_allclose(np.asarray(ours(xm)), reference(x), rtol=1e-15, atol=1e-15)
    from scipy.special import erf

    np.testing.assert_allclose(np.asarray(do("scipy.special.erf", xm)), erf(x), rtol=1e-14, atol=1e-16)
    # and their derivatives, of every order
    x4 = x[::25]
    assert_close(ad.gradient(b, lambda x: anp.sum(anp.exp(x) + anp.cos(x)), x4), np.exp(x4) - np.sin(x4), "float64")
    assert_close(ad.hessian(b, sin_sum, x4), sin_sum_hess(x4), "float64")
    assert_close(ad.gradient(b, lambda x: anp.sum(do("scipy.special.erf", x)), x4),
                 2 / np.sqrt(np.pi) * np.exp(-(x4**2)), "float64")
    assert_close(ad.gradient(b, lambda x: anp.sum(anp.tan(x)), x4 / 3), 1 / np.cos(x4 / 3) ** 2, "float64")


def test_optimiser_updates_keep_dtype(b):
    for dtype in DTYPES:
        model = {"w": b.asarray(point(3, dtype)), "b": b.asarray(np.zeros((), dtype=dtype))}
        rule = optim.chain(optim.ClipNorm(1.0), optim.Adam(0.1))
        state = optim.setup(rule, model)
        grads = {"w": b.asarray(point(3, dtype, seed=1)), "b": b.asarray(np.ones((), dtype=dtype))}
        state, new = optim.update(state, model, grads)
        assert {k: v.dtype for k, v in new.items()} == {"w": getattr(mx, dtype), "b": getattr(mx, dtype)}
        moments = [a for a in optree.tree_leaves(state.tree) if isinstance(a, mx.array)]
        assert moments and all(a.dtype == getattr(mx, dtype) for a in moments)


# ------------------------------------------------------------------ other pitfalls
def test_in_place_update_after_the_call_does_not_move_the_point(b):
    # mx arrays take in-place updates (x[0] = ...): the pullback keeps the point it was made at
    x = b.asarray(np.array([0.5, 1.0]))
    vjp = ad.pullback(b, vector_f, x)
    jvp = ad.pushforward(b, vector_f, x)
    x[0] = 3.0
    xd = np.array([0.5, 1.0])
    assert_close(vjp(np.ones(2)), np.ones(2) @ vector_jacobian(xd), "float64")
    assert_close(jvp(np.ones(2)), vector_jacobian(xd) @ np.ones(2), "float64")


def test_missing_jvp_rules_fall_back_to_reverse_mode(b):
    # MLX has no JVP for cumprod (prod's derivative) nor for scatter (indexing's): forward
    # routes run reverse-over-reverse there instead
    x = np.array([0.5, 1.5, 2.0])
    assert_close(ad.hessian(b, lambda x: anp.prod(x), x), np.array([[0, 2, 1.5], [2, 0, 0.5], [1.5, 0.5, 0]]),
                 "float64")
    v = np.array([1.0, -1.0, 2.0])
    assert_close(ad.hvp(b, lambda x, i: anp.sum(anp.take(x, i) ** 3), x, v, np.array([0, 0, 2])),
                 np.array([12 * 0.5, 0.0, 6 * 2.0]) * v, "float64")
    assert_close(ad.pushforward(b, lambda x: mx.cumprod(x), x)(v), np.array([1.0, 1.5 - 0.5, 3.0 - 1.0 + 1.5]),
                 "float64")
    assert_close(ad.jacobian(b, lambda x: anp.concatenate([mx.cumprod(x), x]), x[:2]),
                 np.array([[1, 0], [1.5, 0.5], [1, 0], [0, 1]]), "float64")


def test_indices_computed_from_traced_values(b):
    # MLX refuses to differentiate a gather through indices that depend on x; integers
    # carry no derivative, and autoray's argmax/argsort/take_along_axis on mlx say so
    x = np.array([[0.3, 0.9, 0.1], [0.8, 0.2, 0.5]])

    def f(x):
        return anp.sum(do("take_along_axis", x, do("expand_dims", do("argmax", x, axis=1), 1), axis=1) ** 2)

    assert_close(ad.gradient(b, f, x), np.array([[0, 1.8, 0], [1.6, 0, 0]]), "float64")


def test_numpy_on_the_left_raises_a_python_number_is_a_constant(b):
    w = np.array([1.0, 2.0])
    with pytest.raises(ad.InvalidOutputError, match="numpy on the left"):  # numpy converted x: no derivative
        ad.gradient(b, lambda x: (w * x).sum(), np.ones(2))
    with pytest.raises(ad.InvalidOutputError, match="like=x"):
        ad.jacobian(b, lambda x: anp.concatenate([w, x]), np.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Python number is a constant, without a warning
        g = ad.gradient(b, lambda x: 3.0, np.ones(2))
    assert_close(g, np.zeros(2), "float64")


def cube(x):
    return anp.sum(x**3)


@pytest.mark.parametrize("compile", [False, True])
def test_nested_operators_keep_the_outer_graph(compile):
    # Inside an outer transform MLX detaches what it evaluates: an inner operator must not
    # evaluate there, or the outer derivative silently becomes zero
    b = ad.backend("mlx", compile=compile)
    x = np.array([0.5, 2.0, -1.0], dtype="float32")
    hessian = np.diag(6.0 * x)
    assert_close(ad.gradient(b, lambda x: anp.sum(ad.gradient(b, cube, x)), x), hessian.sum(0), "float32")
    assert_close(ad.jacobian(b, lambda x: ad.gradient(b, cube, x), x), hessian, "float32")
    outer = mx.grad(lambda x: ad.gradient(b, cube, x).sum())  # the user's own transform
    assert_close(outer(b.asarray(x)), hessian.sum(0), "float32")


def test_user_exceptions_and_bad_outputs(b):
    class Boom(RuntimeError):
        pass

    def boom(x):
        raise Boom("from f")

    for op in (ad.gradient, ad.hessian, ad.jacobian, ad.pullback, ad.pushforward):
        with pytest.raises(Boom, match="from f"):
            op(b, boom, np.ones(2))
    for op in (ad.gradient, ad.value_and_gradient, ad.hessian):
        with pytest.raises(ad.NonScalarOutputError, match=r"shape \(3,\)"):
            op(b, lambda x: x * 2, np.ones(3))
    with pytest.raises(ad.InvalidOutputError, match="complex"):
        ad.gradient(b, lambda x: anp.sum(x).astype(mx.complex64), np.ones(2))
    with pytest.raises(ad.NonDifferentiableInputError):
        ad.gradient(b, lambda x: anp.sum(x), np.arange(3))
    with pytest.raises(ad.ArgumentTypeError, match="compile must be True or False"):
        ad.backend("mlx", compile="yes")


# ------------------------------------------------------------------ compiled route
def test_compiled_route_traces_once_per_signature():
    b = ad.backend("mlx", compile=True)
    assert isinstance(b.adapter, MLXAdapter)
    assert b.reuses_traces and not ad.backend("mlx").reuses_traces

    def loss(w, a, t):
        return least_squares(w, a, t)

    w, (a, t) = point(4, "float32"), lsq_data("float32")
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
        op()  # MLX traces the first compiled function of a process once more, on its second call
        traced = b.trace_count
        op()
        assert b.trace_count == traced
    traced = b.trace_count
    for seed in range(3):  # new data values of the same shapes: no retrace
        rng = np.random.default_rng(seed)
        ad.value_and_gradient(b, loss, rng.normal(size=4).astype("float32"),
                              rng.normal(size=(6, 4)).astype("float32"), t)
    assert b.trace_count == traced
    ad.gradient(b, loss, point(4, "float64"), *lsq_data("float64"))  # a new dtype: one trace
    ad.gradient(b, loss, point(4, "float64"), *lsq_data("float64"))
    assert b.trace_count == traced + 1
    eager = ad.backend("mlx")
    before = eager.trace_count
    ad.gradient(eager, loss, w, a, t)
    ad.gradient(eager, loss, w, a, t)
    assert eager.trace_count == before + 2  # nothing compiled: f runs every call


def branchy(x):
    if anp.sum(x) > 0:
        return anp.sum(x**2)
    return -anp.sum(x)


def test_control_flow_fails_compiled_and_works_eagerly(b, compiled):
    x = np.array([1.0, 2.0, 3.0])
    for op in (ad.gradient, ad.hessian):
        with pytest.raises(ad.TracedControlFlowError, match=r"compile=False"):
            op(compiled, branchy, x)
    assert_close(ad.gradient(b, branchy, x), 2 * x, "float64")
    assert_close(ad.gradient(b, branchy, -x), -np.ones(3), "float64")
    # the vmap of jacobians and Hessians runs over the basis, not over x: branches work there too
    assert_close(ad.hessian(b, branchy, x), 2 * np.eye(3), "float64")
    assert_close(ad.jacobian(b, lambda x: x**2 if anp.sum(x) > 0 else -x, x), np.diag(2 * x), "float64")


def test_compiled_trace_follows_captured_values(compiled):
    # a compiled trace freezes what f reads from closures: the core keys plans on them
    x = np.array([1.0, 2.0], dtype="float32")
    factor = 3.0
    assert_close(ad.gradient(compiled, lambda x: cube(x) * factor, x), 9.0 * x**2, "float32")
    factor = 5.0
    assert_close(ad.gradient(compiled, lambda x: cube(x) * factor, x), 15.0 * x**2, "float32")


# ------------------------------------------------------------------ devices
def test_devices_and_global_settings_untouched():
    b = ad.backend("mlx")
    assert b.devices()[0] == "cpu" and b.device == "cpu"
    assert all(d.startswith(("cuda:", "mps:")) for d in b.devices()[1:])  # the core's canonical names
    for spelling in (None, "cpu", "CPU", "cpu:0"):
        assert b.normalise_device(spelling) == "cpu"
    default_device, default_stream = mx.default_device(), mx.default_stream(mx.default_device())
    if len(b.devices()) == 1:
        for spelling in ("gpu", "cuda", "cuda:0", "metal", "mps", "gpu:1"):
            with pytest.raises(ad.DeviceError, match="no GPU") as info:
                ad.backend("mlx", device=spelling)
            assert "available devices: cpu" in str(info.value)
    with pytest.raises(ad.DeviceError, match="quantum"):
        ad.backend("mlx", device="quantum")
    ad.hessian(b, sin_sum, point(3, "float64"))
    ad.gradient(ad.backend("mlx", compile=True), cube, point(3, "float32"))
    assert mx.default_device() == default_device and mx.default_stream(default_device) == default_stream
    assert mx.array(np.ones(1)).dtype == mx.float32  # MLX's default float is still its own


@pytest.mark.parametrize(("cuda", "metal", "expected"), [
    (True, False, ["cpu", "cuda:0", "cuda:1"]),  # mlx[cuda] on two NVIDIA GPUs
    (False, True, ["cpu", "mps:0"]),  # macOS's mlx on Apple's Metal GPU
    (False, False, ["cpu"]),
])
def test_gpus_get_the_cores_canonical_names(monkeypatch, b, cuda, metal, expected):
    # MLX calls either GPU mx.gpu; the name says which, so that "cuda:0" means the same on every backend
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
    monkeypatch.setattr(mx, "device_count", lambda device: 2)
    assert b.devices() == expected
    if len(expected) > 1:
        assert b.normalise_device("gpu") == expected[1]  # the first GPU, whichever kind it is
    for name in expected[1:]:  # "gpu:1" and "metal" spell them too
        assert b.normalise_device(name.replace("cuda", "gpu").replace("mps", "metal")) == name


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gradient", "jacobian", "hessian"])
def test_gpu_matches_cpu(op):
    gpus = [d for d in ad.backend("mlx").devices() if d != "cpu"]
    if not gpus:
        pytest.skip(f"no GPU visible to MLX here (devices: {ad.backend('mlx').devices()})")
    gpu, cpu = ad.backend("mlx", device="gpu"), ad.backend("mlx")
    x = point(4, "float32")  # Metal has no float64
    f = sin_sum if op != "jacobian" else vector_f
    assert_close(getattr(ad, op)(gpu, f, x), np.asarray(getattr(ad, op)(cpu, f, x)), "float32", rtol=1e-5)


# ------------------------------------------------------------------ implicit mode
class MLP(nn.Module):
    def __init__(self, shared: nn.Module | None = None):
        super().__init__()
        self.hidden = nn.Linear(3, 4)
        self.out = nn.Linear(4, 1)
        self.scale = mx.array(1.5)
        self.blocks = [shared or nn.Linear(1, 1)]
        self.again = self.blocks[0]  # a submodule reached twice: its parameters count once

    def __call__(self, x):
        return self.again(self.out(mx.tanh(self.hidden(x)))) * self.scale


def test_params_of_a_module_are_stable_and_skip_frozen(b):
    model = MLP()
    model.out.freeze()
    ps = ad.Params(model)
    assert ps.frozen == 2 and len(ps) == 5  # hidden.weight/bias, scale, blocks.0.weight/bias
    assert all(isinstance(p, MLXParameter) for p in ps)
    assert [p.name for p in ps] == ["hidden.weight", "hidden.bias", "scale", "blocks.0.weight", "blocks.0.bias"]
    again = ad.Params(model)
    assert all(p is q for p, q in zip(ps, again))  # the same variables every time
    assert "2 non-trainable" in repr(ps)
    assert ps[0].shape == (4, 3) and ps[0].dtype == mx.float32
    np.testing.assert_array_equal(np.asarray(ps[0]), np.asarray(model.hidden.weight))


def test_implicit_gradient_matches_mlx_value_and_grad(b):
    model = MLP()
    model.out.freeze()
    x, t = mx.array(point(15, "float32").reshape(5, 3)), mx.zeros((5, 1))

    def loss(x, t):
        return ((model(x) - t) ** 2).mean()

    arrays_before = [model.hidden.weight, model.scale]
    ps = ad.Params(model)
    implicit = ad.Implicit(b)
    y, gs = ad.value_and_gradient(implicit, loss, ps, x, t)
    assert model.hidden.weight is arrays_before[0] and model.scale is arrays_before[1]  # put back
    value, native = nn.value_and_grad(model, loss)(x, t)  # (which leaves its traced arrays in the model)
    assert_close(y, np.asarray(value), "float32")
    flat = dict(tree_flatten(native))
    for p in ps:
        # MLX's own route splits a submodule reached twice ("blocks.0" is "again") between
        # its two names; one parameter gets the whole derivative
        twin = flat.get(p.name.replace("blocks.0", "again"), 0) if p.name.startswith("blocks.0") else 0
        assert_close(gs[p], np.asarray(flat[p.name] + twin), "float32")
    (y2, aux), gs2 = ad.value_and_gradient(implicit, lambda x, t: (loss(x, t), {"n": 1}), ps, x, t, has_aux=True)
    assert aux == {"n": 1}
    y3, vjp = ad.value_and_pullback(implicit, loss, ps, x, t)
    assert all(np.allclose(np.asarray(vjp(2.0)[p]), 2 * np.asarray(gs[p])) for p in ps)
    with pytest.raises(ad.ModeMismatchError):
        ad.gradient(b, loss, ps, x, t)


def test_implicit_restores_the_module_when_f_fails(b):
    model = nn.Linear(2, 1)
    weight = model.weight

    def failing():
        model(mx.ones((1, 2)))
        raise ValueError("from f")

    with pytest.raises(ValueError, match="from f"):
        ad.gradient(ad.Implicit(b), failing, ad.Params(model))
    assert model.weight is weight


def test_variables_are_boxes_of_mlx_arrays(b, compiled):
    vs = ad.variables({"w": np.ones(3, dtype="float32"), "n": 2}, "mlx")
    assert isinstance(vs["w"], ad.Variable) and isinstance(vs["w"].value, mx.array) and vs["n"] == 2
    assert vs["w"].value.dtype == mx.float32
    for be in (b, compiled):  # the core's swap route, compiled or not
        gs = ad.gradient(ad.Implicit(be), lambda: cube(vs["w"].value), ad.Params(vs))
        assert_close(gs[vs["w"]], 3 * np.ones(3), "float32")


def test_parameter_writes_are_checked(b):
    model = nn.Linear(2, 1)
    (p, _bias) = ad.Params(model)
    p.value = mx.zeros((1, 2))
    assert np.asarray(model.weight).tolist() == [[0.0, 0.0]]
    with pytest.raises(ad.ShapeMismatchError):
        p.value = mx.zeros((2, 2))
    with pytest.raises(ad.ArgumentTypeError, match="float64"):
        optim.write(p, mx.zeros((1, 2), dtype=mx.float64))
    model.weight = mx.ones((1, 2))  # the parameter follows the module's current array
    assert np.asarray(optim.read(p)).tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_an_mlx_module_and_a_pytree(b, dtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype(dtype)
    y = (x @ np.array([[1.0], [-2.0], [0.5]]) + 0.3).astype(dtype)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]

    model = nn.Linear(3, 1)
    model.set_dtype(getattr(mx, dtype))
    model.freeze(keys=["bias"])
    bias = model.bias
    state = optim.setup(optim.Adam(lr=0.1), model)
    losses = []
    state, model = ad.train(lambda m, x, y: ((m(x) - y) ** 2).mean(), model, batches, state,
                            backend=ad.Implicit(b), epochs=10, progress=False,
                            callbacks=[lambda info: losses.append(info.loss)])
    assert losses[-1] < 0.5 * losses[0] and model.weight.dtype == getattr(mx, dtype)
    assert model.bias is bias  # frozen: not trained

    def mse(m, x, y):
        return anp.mean((x @ m["w"] + m["b"] - y) ** 2)

    tree = {"w": np.zeros((3, 1), dtype=dtype), "b": np.zeros(1, dtype=dtype)}
    state = optim.setup(optim.Adam(lr=0.1), tree)
    state, tree = ad.train(mse, tree, batches, state, backend=b, epochs=20, progress=False)
    assert tree["w"].dtype == getattr(mx, dtype) and float(mse(tree, b.asarray(x), b.asarray(y))) < 0.1


def test_checkpoints_round_trip_explicit_and_implicit(b, tmp_path):
    tree = {"w": b.asarray(point(3, "float64")), "n": 3}
    state = optim.setup(optim.Adam(0.1), tree)
    state, tree = optim.update(state, tree, {"w": b.asarray(np.ones(3)), "n": None})
    ad.save_checkpoint(tmp_path / "explicit.ckpt", state, tree)
    like = optim.setup(optim.Adam(0.1), {"w": b.asarray(np.zeros(3)), "n": 3})
    state2, tree2 = ad.load_checkpoint(tmp_path / "explicit.ckpt", like=(like, {"w": b.asarray(np.zeros(3)), "n": 3}))
    assert isinstance(tree2["w"], mx.array) and tree2["w"].dtype == mx.float64 and state2.step == 1
    np.testing.assert_array_equal(np.asarray(tree2["w"]), np.asarray(tree["w"]))

    model = MLP()
    model.out.freeze()
    state = optim.setup(optim.Descent(0.1), model)
    ad.save_checkpoint(tmp_path / "implicit.ckpt", state, model)
    saved = {name: np.asarray(p) for name, p in b.model_state(model)}
    assert "out.weight" in saved  # frozen parameters are saved too
    other = MLP()
    ad.load_checkpoint(tmp_path / "implicit.ckpt", like=(optim.setup(optim.Descent(0.1), other), other))
    for name, p in b.model_state(other):
        np.testing.assert_array_equal(np.asarray(p), saved[name])
        assert isinstance(p.value, mx.array)


def test_to_numpy_on_arrays_parameters_grads_and_bfloat16(b):
    model = nn.Linear(2, 1)
    ps = ad.Params(model)
    gs = ad.gradient(ad.Implicit(b), lambda: (model(mx.ones((1, 2))) ** 2).sum(), ps)
    out = ad.to_numpy({"a": b.asarray(np.arange(3.0)), "p": ps[0], "g": gs})
    assert isinstance(out["a"], np.ndarray) and out["a"].dtype == np.float64
    assert isinstance(out["p"], np.ndarray) and out["p"].shape == (1, 2)
    assert all(isinstance(v, np.ndarray) for v in out["g"].values())
    half = ad.to_numpy(mx.array([1.5, 2.0], dtype=mx.bfloat16))
    assert half.dtype.name in ("bfloat16", "float32") and half.tolist() == [1.5, 2.0]


# ------------------------------------------------------------------ translations
def test_linear_algebra_derivatives_match_finite_differences(b):
    # MLX has no derivative for inv, solve, cholesky, eigh: the adapter's translations add
    # them (first and second order, eigenvectors included)
    fd = ad.backend("finite_differences")
    a = np.array([[2.0, 0.3, -0.2], [0.1, 1.5, 0.4], [-0.3, 0.2, 1.8]])
    rhs = np.array([0.5, -1.0, 2.0])
    weights = np.random.default_rng(3).uniform(0.5, 2.0, (3, 3))  # not r_i + c_j: sum(V**2 w) would be constant

    def functions(x):
        spd = x @ do("transpose", x) + 3.0 * do("eye", 3, like=x)
        _, vectors = do("linalg.eigh", x + do("transpose", x))
        return [
            anp.sum(do("linalg.inv", x) * weights),
            anp.sum(do("linalg.solve", x, do("asarray", rhs, like=x, dtype=x.dtype)) ** 2),
            anp.sum(do("linalg.cholesky", spd) * weights),
            anp.sum(vectors**2 * weights),  # squared: eigenvectors have a sign freedom
        ]

    for k in range(4):
        f = lambda x, k=k: functions(x)[k]  # noqa: E731
        assert_close(ad.gradient(b, f, a), ad.gradient(fd, f, a), "float64", rtol=1e-7)
        # second order: against central differences of the (checked) exact gradient
        step = 1e-6
        slope = (np.asarray(ad.gradient(b, f, a + step * weights)) - np.asarray(ad.gradient(b, f, a - step * weights)))
        assert_close(ad.hvp(b, f, a, weights), slope / (2 * step), "float64", rtol=1e-8)

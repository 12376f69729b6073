"""The tensorflow adapter: every operator against analytic derivatives and finite
differences, the tensorflow pitfalls (unconnected None, float32 Python floats, one-shot
tapes, retracing), error mapping, nested use, devices and GPU/CPU parity."""

from __future__ import annotations

import numpy as np
import optree
import pytest

tf = pytest.importorskip("tensorflow")

from autoray import numpy as anp  # noqa: E402

import abstractdiff as ad  # noqa: E402

TF = ad.backend("tensorflow")
EAGER = ad.backend("tensorflow", compile=False)
FD = ad.backend("finite_differences")
DTYPES = [np.float32, np.float64]
RTOL = {np.float32: 1e-4, np.float64: 1e-9}
# finite differences are themselves accurate to ~1e-5 (float32) / ~1e-10 (float64), and
# their nested (second-order) stencils to less
FD_RTOL = {np.float32: 1e-3, np.float64: 1e-7}
FD_RTOL2 = {np.float32: 2e-2, np.float64: 1e-5}
HAS_GPU = "cuda:0" in TF.devices()


def close(actual, expected, dtype, rtol=None):
    """Trees equal in structure, float leaves of ``dtype`` and within tolerance."""
    rtol = RTOL[dtype] if rtol is None else rtol
    got, want = ad.to_numpy(actual), ad.to_numpy(expected)
    leaves_got, tree_got = optree.tree_flatten(got, none_is_leaf=True)
    leaves_want, tree_want = optree.tree_flatten(want, none_is_leaf=True)
    assert tree_got == tree_want
    for g, w in zip(leaves_got, leaves_want):
        if w is None:
            assert g is None
            continue
        g, w = np.asarray(g), np.asarray(w, dtype=np.float64)
        assert g.dtype == dtype, f"dtype {g.dtype}, expected {np.dtype(dtype)}"
        assert g.shape == w.shape
        atol = rtol * max(float(np.max(np.abs(w), initial=0.0)), 1e-30)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


# ------------------------------------------------------------------ scenarios
# Each: f, x(dtype), extra args, analytic gradient, analytic hessian (None: not one leaf).


def sin_x(dtype):
    x = np.linspace(-1.2, 1.7, 5).astype(dtype)
    xd = x.astype(np.float64)
    grad = np.sin(xd) + xd * np.cos(xd)
    hess = np.diag(2 * np.cos(xd) - xd * np.sin(xd))
    return (lambda x: anp.sum(anp.sin(x) * x)), x, (), grad, hess


def least_squares(dtype):
    rng = np.random.default_rng(0)
    a, b, w = rng.normal(size=(4, 3)), rng.normal(size=4), rng.normal(size=3)
    a, b, w = a.astype(dtype), b.astype(dtype), w.astype(dtype)
    ad_, bd, wd = a.astype(np.float64), b.astype(np.float64), w.astype(np.float64)
    grad = ad_.T @ (ad_ @ wd - bd)
    return (lambda w, a, b: 0.5 * anp.sum((anp.matmul(a, w) - b) ** 2)), w, (a, b), grad, ad_.T @ ad_


def logsumexp(dtype):
    x = np.array([0.3, -1.1, 2.0, 0.5], dtype=dtype)
    p = np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum()
    return (lambda x: anp.log(anp.sum(anp.exp(x)))), x, (), p, np.diag(p) - np.outer(p, p)


def tree(dtype):
    # int-array leaf (data), Python int (static), unconnected float leaf, nested tuple
    w = np.array([0.5, -1.5, 2.0], dtype=dtype)
    s = np.asarray(1.5, dtype=dtype)
    idx = np.array([0, 2, 2])
    x = {"w": w, "pair": (s, idx), "k": 2, "unused": np.ones(2, dtype=dtype)}

    def f(x):
        s, idx = x["pair"]
        return s * anp.sum(anp.take(x["w"], idx) ** x["k"])

    wd, sd = w.astype(np.float64), float(s)
    counts = np.bincount(idx, minlength=3)
    grad = {"w": sd * 2 * wd * counts, "pair": (np.sum(wd[idx] ** 2), None), "k": None, "unused": np.zeros(2)}
    return f, x, (), grad, None


SCALAR = [sin_x, least_squares, logsumexp, tree]
ONE_LEAF = [sin_x, least_squares, logsumexp]


def vector_fn(dtype):
    """``tanh(A w)``: J = diag(1 - tanh^2) A."""
    a = np.array([[1.0, -2.0, 0.5], [0.3, 0.2, -1.0]], dtype=dtype)
    w = np.array([0.4, -0.3, 0.9], dtype=dtype)
    t = np.tanh(a.astype(np.float64) @ w.astype(np.float64))
    return (lambda w, a: anp.tanh(anp.matmul(a, w))), w, a, t, (1 - t**2)[:, None] * a.astype(np.float64)


# ------------------------------------------------------------------ operators
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", SCALAR)
def test_gradient(scenario, dtype):
    f, x, args, grad, _ = scenario(dtype)
    close(ad.gradient(TF, f, x, *args), grad, dtype)
    close(ad.gradient(TF, f, x, *args), ad.gradient(FD, f, x, *args), dtype, FD_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_and_gradient_with_and_without_aux(dtype):
    f, x, args, grad, _ = least_squares(dtype)
    y, g = ad.value_and_gradient(TF, f, x, *args)
    close(y, ad.value_and_gradient(FD, f, x, *args)[0], dtype)
    close(g, grad, dtype)

    marker = object()

    def with_aux(w, a, b):
        r = anp.matmul(a, w) - b
        return 0.5 * anp.sum(r**2), {"residual": r, "step": 3, "tag": "ls", "obj": marker}

    (y2, aux), g2 = ad.value_and_gradient(TF, with_aux, x, *args, has_aux=True)
    close(y2, y, dtype)
    close(g2, grad, dtype)
    # aux comes back as it was returned: arrays as tensors, other leaves untouched
    assert aux["step"] == 3 and aux["tag"] == "ls" and aux["obj"] is marker
    assert isinstance(aux["residual"], tf.Tensor)
    close(aux["residual"], args[0].astype(np.float64) @ x - args[1], dtype)
    g3, aux3 = ad.gradient(TF, with_aux, x, *args, has_aux=True)
    close(g3, grad, dtype)
    assert aux3["obj"] is marker


@pytest.mark.parametrize("dtype", DTYPES)
def test_pullback_and_value_and_pullback(dtype):
    f, w, a, value, jac = vector_fn(dtype)
    dy = np.array([0.7, -1.3], dtype=dtype)
    y, vjp = ad.value_and_pullback(TF, f, w, a)
    close(y, value, dtype)
    close(vjp(dy), dy.astype(np.float64) @ jac, dtype)
    close(ad.pullback(TF, f, w, a)(dy), ad.pullback(FD, f, w, a)(dy), dtype, FD_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_pushforward_and_value_and_pushforward(dtype):
    f, w, a, value, jac = vector_fn(dtype)
    dx = np.array([1.0, 0.5, -2.0], dtype=dtype)
    y, jvp = ad.value_and_pushforward(TF, f, w, a)
    close(y, value, dtype)
    close(jvp(dx), jac @ dx.astype(np.float64), dtype)
    close(ad.pushforward(TF, f, w, a)(dx), ad.pushforward(FD, f, w, a)(dx), dtype, FD_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_derivative(dtype):
    def f(t):
        return anp.stack([anp.sin(t), t**3])

    t = np.asarray(0.8, dtype=dtype)
    close(ad.derivative(TF, f, t), np.array([np.cos(0.8), 3 * 0.8**2]), dtype)
    close(ad.derivative(TF, f, t), ad.derivative(FD, f, t), dtype, FD_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_jacobian(dtype):
    f, w, a, _, jac = vector_fn(dtype)
    close(ad.jacobian(TF, f, w, a), jac, dtype)
    close(ad.jacobian(TF, f, w, a), ad.jacobian(FD, f, w, a), dtype, FD_RTOL[dtype])
    # a tree input: one block per float leaf, None for the int leaf
    x = {"w": w, "n": 2, "s": np.asarray(2.0, dtype=dtype)}
    jt = ad.jacobian(TF, lambda x, a: x["s"] * f(x["w"], a), x, a)
    close(jt, {"w": 2 * jac, "n": None, "s": np.tanh(a.astype(np.float64) @ w.astype(np.float64))}, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", ONE_LEAF)
def test_hessian(scenario, dtype):
    f, x, args, _, hess = scenario(dtype)
    close(ad.hessian(TF, f, x, *args), hess, dtype)
    close(ad.hessian(TF, f, x, *args), ad.hessian(FD, f, x, *args), dtype, FD_RTOL2[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_hvp(dtype):
    f, x, args, _, hess = logsumexp(dtype)
    v = np.array([1.0, -0.5, 0.25, 2.0], dtype=dtype)
    close(ad.hvp(TF, f, x, v, *args), hess @ v.astype(np.float64), dtype)
    close(ad.hvp(TF, f, x, v, *args), ad.hvp(FD, f, x, v, *args), dtype, FD_RTOL2[dtype])
    # a pytree x: v shaped like x, zeros for the unconnected leaf
    f, x, _, _, _ = tree(dtype)
    vt = {"w": np.array([1.0, 2.0, -1.0], dtype=dtype), "pair": (np.asarray(0.5, dtype=dtype), None), "k": None,
          "unused": np.ones(2, dtype=dtype)}
    w, s, idx = x["w"].astype(np.float64), 1.5, x["pair"][1]
    counts = np.bincount(idx, minlength=3)
    hw = 2 * s * counts * vt["w"] + 2 * w * counts * 0.5  # d/dw (s 2 w c) . v + d/ds ...
    hs = np.sum(2 * w * counts * vt["w"])
    close(ad.hvp(TF, f, x, vt), {"w": hw, "pair": (hs, None), "k": None, "unused": np.zeros(2)}, dtype)


def test_every_operator_eager_matches_compiled():
    f, x, args, grad, hess = sin_x(np.float64)
    v = np.linspace(1.0, 2.0, 5)
    dtype = np.float64
    close(ad.gradient(EAGER, f, x, *args), grad, dtype)
    close(ad.hessian(EAGER, f, x), hess, dtype)
    close(ad.hvp(EAGER, f, x, v), hess @ v, dtype)
    vf, w, a, value, jac = vector_fn(dtype)
    close(ad.jacobian(EAGER, vf, w, a), jac, dtype)
    close(ad.pushforward(EAGER, vf, w, a)(np.ones(3)), jac @ np.ones(3), dtype)
    close(ad.pullback(EAGER, vf, w, a)(np.ones(2)), np.ones(2) @ jac, dtype)
    f, x, args, grad, _ = tree(dtype)
    close(ad.gradient(EAGER, f, x), grad, dtype)
    assert EAGER.trace_count == 0  # eager means no tf.function at all


# ------------------------------------------------------------------ pitfalls
@pytest.mark.parametrize("backend", [TF, EAGER], ids=["compiled", "eager"])
def test_unconnected_leaf_is_zeros_not_none(backend):
    x = {"used": np.array([1.0, 2.0], dtype=np.float32), "unused": np.array([3.0, 4.0, 5.0])}
    g = ad.gradient(backend, lambda x: anp.sum(x["used"] ** 2), x)
    assert g["unused"] is not None
    np.testing.assert_array_equal(ad.to_numpy(g["unused"]), np.zeros(3))
    assert g["unused"].dtype == tf.float64 and g["used"].dtype == tf.float32
    # a constant function: every leaf unconnected
    g0 = ad.gradient(backend, lambda x: anp.sum(x["used"] * 0.0) + 1.0, x)
    np.testing.assert_array_equal(ad.to_numpy(g0["used"]), np.zeros(2))
    # second order and jacobians of functions with no curvature / no dependence
    w = np.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(ad.to_numpy(ad.hessian(backend, lambda x: anp.sum(3.0 * x), w)), np.zeros((3, 3)))
    np.testing.assert_array_equal(ad.to_numpy(ad.hvp(backend, lambda x: anp.sum(3.0 * x), w, w)), np.zeros(3))
    jac = ad.jacobian(backend, lambda x: anp.sum(x["used"]) * anp.ones(2), x)
    np.testing.assert_array_equal(ad.to_numpy(jac["unused"]), np.zeros((2, 3)))


@pytest.mark.parametrize("backend", [TF, EAGER], ids=["compiled", "eager"])
def test_python_float_gives_float64(backend):
    y, g = ad.value_and_gradient(backend, lambda t: t**3, 2.0)
    assert g.dtype == tf.float64 and y.dtype == tf.float64
    assert float(g) == 12.0
    d = ad.derivative(backend, lambda t: anp.sin(t), 0.5)
    assert d.dtype == tf.float64 and abs(float(d) - np.cos(0.5)) < 1e-15


@pytest.mark.parametrize("backend", [TF, EAGER], ids=["compiled", "eager"])
def test_pullback_can_be_called_many_times(backend):
    # a non-persistent tape answers once: the closure must answer every time
    f, w, a, _, jac = vector_fn(np.float64)
    vjp = ad.pullback(backend, f, w, a)
    for dy in (np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([2.0, -3.0]), np.array([1.0, 0.0])):
        close(vjp(dy), dy @ jac, np.float64)
    jvp = ad.pushforward(backend, f, w, a)
    for dx in np.eye(3):
        close(jvp(dx), jac @ dx, np.float64)


def test_repeated_calls_do_not_retrace():
    backend = ad.backend("tensorflow")
    f, x, args, _, _ = least_squares(np.float64)
    vf, w, a, _, _ = vector_fn(np.float64)

    def every_operator(x, w):
        ad.value_and_gradient(backend, f, x, *args)
        ad.pullback(backend, vf, w, a)(np.ones(2))
        ad.pushforward(backend, vf, w, a)(np.ones(3))
        ad.jacobian(backend, vf, w, a)
        ad.hessian(backend, f, x, *args)
        ad.hvp(backend, f, x, x, *args)

    every_operator(x, w)
    before = backend.trace_count
    for _ in range(3):
        every_operator(x + 1.0, w * 2.0)  # new values, same shapes and dtypes
    assert backend.trace_count == before
    every_operator(x.astype(np.float32), w.astype(np.float32))  # a new dtype does retrace
    assert backend.trace_count > before


def test_inputs_not_mutated_and_variables_accepted():
    x = np.array([1.0, 2.0, 3.0])
    copy = x.copy()
    ad.gradient(TF, lambda x: anp.sum(x**2), x)
    np.testing.assert_array_equal(x, copy)
    v = tf.Variable([1.0, 2.0])
    g = ad.gradient(TF, lambda v: anp.sum(v**3), v)
    close(g, np.array([3.0, 12.0]), np.float32)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("backend", [TF, EAGER], ids=["compiled", "eager"])
@pytest.mark.parametrize("operator", ["gradient", "hessian", "hvp"])
def test_non_scalar_output(backend, operator):
    x = np.array([1.0, 2.0])
    extra = (x,) if operator == "hvp" else ()
    with pytest.raises(ad.NonScalarOutputError, match="scalar"):
        getattr(ad, operator)(backend, lambda x: x * 2, x, *extra)


def branchy(x):
    if anp.sum(x) > 0:  # Python control flow on a traced value
        return anp.sum(x**2)
    return anp.sum(x)


@pytest.mark.parametrize("operator", ["gradient", "jacobian", "pullback"])
def test_traced_control_flow_says_compile_false(operator):
    x = np.array([1.0, 2.0])
    with pytest.raises(ad.TracedControlFlowError, match=r"compile=False.*where") as info:
        getattr(ad, operator)(TF, branchy, x)
    assert isinstance(info.value.__cause__, tf.errors.OperatorNotAllowedInGraphError)
    # the advice works: eager runs the branch
    close(ad.gradient(EAGER, branchy, x), 2 * x, np.float64)


def test_numpy_call_on_traced_value_is_mapped():
    with pytest.raises(ad.TracedControlFlowError, match="compile=False"):
        ad.gradient(TF, lambda x: anp.sum(x) * float(np.asarray(x)[0]), np.array([1.0, 2.0]))


class UserError(Exception):
    pass


@pytest.mark.parametrize("backend", [TF, EAGER], ids=["compiled", "eager"])
@pytest.mark.parametrize("operator", ["gradient", "jacobian", "hessian", "pushforward", "pullback", "hvp"])
def test_user_exception_propagates_unchanged(backend, operator):
    def f(x):
        raise UserError("raised by f")

    x = np.array([1.0, 2.0])
    extra = (x,) if operator == "hvp" else ()
    with pytest.raises(UserError, match="raised by f"):
        getattr(ad, operator)(backend, f, x, *extra)
    # a TypeError of the user's own is not mistaken for a tracing error
    with pytest.raises(TypeError, match="mine") as info:
        ad.gradient(backend, lambda x: (_ for _ in ()).throw(TypeError("mine")), x)
    assert not isinstance(info.value, ad.TracedControlFlowError)


def test_bad_inputs_and_outputs():
    with pytest.raises(ad.NonDifferentiableInputError):
        ad.gradient(TF, lambda n: anp.sum(n), np.array([1, 2]))
    with pytest.raises(ad.InvalidOutputError, match="str"):
        ad.gradient(TF, lambda x: "loss", np.array([1.0]))
    with pytest.raises(TypeError, match="compile"):
        ad.backend("tensorflow", compile="yes")


def test_missing_device_lists_available_ones():
    missing = f"cuda:{len(TF.devices()) + 3}"
    with pytest.raises(ad.DeviceError, match="available devices: cpu") as info:
        ad.backend("tensorflow", device=missing)
    assert missing in str(info.value)
    with pytest.raises(ad.DeviceError, match="gpu:N"):
        ad.backend("tensorflow", device="tpu")
    with pytest.raises(ad.DeviceError, match="available devices"):
        ad.backend("tensorflow", device="cpu:1")
    if not HAS_GPU:
        for spelling in ("gpu", "cuda", "cuda:1"):
            with pytest.raises(ad.DeviceError, match="available devices: cpu"):
                ad.backend("tensorflow", device=spelling)


# ------------------------------------------------------------------ arrays and devices
def test_devices_and_normalisation():
    devices = TF.devices()
    assert devices[0] == "cpu"
    for spelling in (None, "cpu", "CPU", "cpu:0"):
        assert TF.normalise_device(spelling) == "cpu"
    assert TF.tf_device == "/CPU:0"
    if HAS_GPU:
        # TensorFlow's own spellings name the same GPU as the canonical "cuda:0"
        for spelling in ("gpu", "cuda", "cuda:0", "GPU:0", "/GPU:0", "/device:GPU:0"):
            assert TF.normalise_device(spelling) == "cuda:0"


def test_is_native_and_asarray():
    assert TF.is_native(tf.constant(1.0)) and TF.is_native(tf.Variable(1.0))
    assert not TF.is_native(np.ones(2)) and not TF.is_native(1.0)
    seen = []

    @tf.function
    def traced(x):
        seen.append(TF.is_native(x))
        return x

    traced(tf.constant(1.0))
    assert seen == [True]  # symbolic tensors are native: nested use must not convert them
    for dtype in ("float32", "float64", "int64"):
        t = TF.asarray(np.zeros(2, dtype=dtype))
        assert isinstance(t, tf.Tensor) and t.dtype.name == dtype
    assert TF.asarray(np.zeros(2), dtype="float32").dtype == tf.float32


# ------------------------------------------------------------------ nested use
@pytest.mark.parametrize("backend", [TF, EAGER], ids=["compiled", "eager"])
def test_nested_gradient(backend):
    # d/dx sum(d/dz sum(sin(z)^2)) = d/dx sum(sin 2x) = 2 cos 2x
    def inner(z):
        return anp.sum(anp.sin(z) ** 2)

    def outer(x):
        return anp.sum(ad.gradient(backend, inner, x))

    x = np.array([0.3, -0.7, 1.1])
    close(ad.gradient(backend, outer, x), 2 * np.cos(2 * x), np.float64)
    close(ad.hvp(backend, outer, x, np.ones(3)), -4 * np.sin(2 * x), np.float64)
    close(ad.jacobian(backend, lambda x: ad.gradient(backend, inner, x), x), np.diag(2 * np.cos(2 * x)), np.float64)


@pytest.mark.parametrize("backend", [TF, EAGER], ids=["compiled", "eager"])
def test_nested_in_users_tape_and_tf_function(backend):
    x = tf.constant([0.3, -0.7])

    def inner(z):
        return anp.sum(anp.sin(z) ** 2)

    with tf.GradientTape() as tape:
        tape.watch(x)
        g = ad.gradient(backend, inner, x)
    close(tape.gradient(g, x), 2 * np.cos(2 * x.numpy()), np.float32)

    @tf.function
    def user(x):
        with tf.GradientTape() as t:
            t.watch(x)
            y = tf.reduce_sum(ad.gradient(backend, inner, x))
        return t.gradient(y, x)

    close(user(x), 2 * np.cos(2 * x.numpy()), np.float32)


# ------------------------------------------------------------------ composition
def _product():
    """``(x, y) -> x[:2] * y`` on the custom-function hook: two inputs of different sizes (3, 2),
    with a numpy value and TensorFlow rules."""
    vjps = (lambda c, x, y: tf.pad(c * y, [[0, 1]]), lambda c, x, y: c * x[:2])
    return TF.custom_function(lambda x, y: x[:2] * y, vjps, (), (2, "float64"))


def test_custom_function_reverse_forward_and_refusals():
    """Reverse mode eagerly and in tf.function, forward mode eagerly (through the gradient's
    double backward), and the refusals: a second derivative, and forward mode in a graph."""
    f = _product()
    x, y = tf.constant([1.0, 2.0, 3.0], tf.float64), tf.constant([4.0, 5.0], tf.float64)

    def gradients(x, y):
        with tf.GradientTape() as tape:
            tape.watch([x, y])
            z = tf.reduce_sum(f(x, y))
        return tape.gradient(z, [x, y])

    for run in (gradients, tf.function(gradients)):
        gx, gy = run(x, y)
        np.testing.assert_allclose(gx, [4.0, 5.0, 0.0])
        np.testing.assert_allclose(gy, [1.0, 2.0])

    def jvp(x, y):
        with tf.autodiff.ForwardAccumulator([x, y], [tf.ones_like(x), 2 * tf.ones_like(y)]) as acc:
            z = f(x, y)
        return acc.jvp(z)

    np.testing.assert_allclose(jvp(x, y), [4.0 + 2.0, 5.0 + 4.0])
    with pytest.raises(Exception, match="forward mode inside tf.function") as info:
        tf.function(jvp)(x, y)
    assert "a custom function" in str(info.value)
    with tf.GradientTape() as outer:
        outer.watch(x)
        _, gy = gradients(x, y)  # x * 1 (the cotangent of y): its gradient in x would be a second one
    with pytest.raises(ad.CompositionError, match="second derivatives are not supported") as info:
        outer.gradient(gy, x)
    assert info.value.eager_would_work is False


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU visible to tensorflow (tf.config.list_logical_devices)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_cpu(dtype):
    gpu = ad.backend("tensorflow", device="gpu")
    assert gpu.device == "cuda:0" and gpu.tf_device == "/GPU:0"
    rtol = {np.float32: 1e-5, np.float64: 1e-10}[dtype]
    f, x, args, _, _ = least_squares(dtype)
    vf, w, a, _, _ = vector_fn(dtype)
    ft, xt, _, _, _ = tree(dtype)
    v = np.ones_like(x)
    t = np.asarray(0.8, dtype=dtype)
    cases = {
        "gradient": lambda b: ad.gradient(b, f, x, *args),
        "value_and_gradient": lambda b: ad.value_and_gradient(b, f, x, *args),
        "tree gradient": lambda b: ad.gradient(b, ft, xt),
        "pullback": lambda b: ad.pullback(b, vf, w, a)(np.ones(2, dtype=dtype)),
        "pushforward": lambda b: ad.pushforward(b, vf, w, a)(np.ones(3, dtype=dtype)),
        "derivative": lambda b: ad.derivative(b, lambda t: anp.stack([anp.sin(t), t**3]), t),
        "jacobian": lambda b: ad.jacobian(b, vf, w, a),
        "hessian": lambda b: ad.hessian(b, f, x, *args),
        "hvp": lambda b: ad.hvp(b, f, x, v, *args),
    }
    for name, run in cases.items():
        on_gpu, on_cpu = run(gpu), run(TF)
        first = optree.tree_leaves(on_gpu)[0]
        assert "GPU" in first.device, f"{name} ran on {first.device}"
        close(on_gpu, on_cpu, dtype, rtol)

"""The paddle adapter: every operator against analytic derivatives and finite differences,
plus paddle's own pitfalls (stop_gradient and .grad left alone, paddle's global mode,
to_static traces and float64, ops without second derivatives, import after TensorFlow,
numpy conversions that detach, in-place writes, devices, implicit mode with paddle.nn.Layer)."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import optree
import pytest

# The adapter, not paddle: importing paddle directly after TensorFlow (another test module
# may have imported it) crashes the process; the adapter imports it safely.
adapter = pytest.importorskip("abstractdiff.adapters.paddle", reason="paddle is not installed (pip install "
                              "'abstractdiff[paddle]')")
paddle = adapter.paddle
PaddleAdapter = adapter.PaddleAdapter

import autoray  # noqa: E402
from autoray import numpy as anp  # noqa: E402

import abstractdiff as ad  # noqa: E402
from abstractdiff import optim  # noqa: E402
from abstractdiff._backend import AdapterBackend  # noqa: E402

DTYPES = [np.float32, np.float64]
RTOL = {np.float32: 1e-4, np.float64: 1e-9}
FD_RTOL = {1: {np.float32: 1e-4, np.float64: 1e-8}, 2: {np.float32: 1e-3, np.float64: 1e-7}}


@pytest.fixture(scope="module")
def b() -> ad.Backend:
    return ad.backend("paddle")


def fresh(**options) -> ad.Backend:
    """A backend of its own (its trace count starts at zero): ``ad.backend`` shares one
    instance per options, so the core's holder is made directly."""
    return AdapterBackend(PaddleAdapter, **options)


@pytest.fixture(scope="module")
def fd():
    return ad.backend("finite_differences")


def assert_close(actual, expected, rtol: float, dtype=None) -> None:
    """Leaf-wise allclose (atol = rtol * max|expected|); paddle leaves checked for their dtype."""
    a_leaves = optree.tree_leaves(actual, none_is_leaf=True)
    e_leaves = optree.tree_leaves(expected, none_is_leaf=True)
    assert len(a_leaves) == len(e_leaves)
    for a, e in zip(a_leaves, e_leaves):
        if e is None:
            assert a is None
            continue
        e = np.asarray(ad.to_numpy(e), dtype=np.float64)
        if isinstance(a, paddle.Tensor):
            a = a.numpy()
        if dtype is not None:
            assert a.dtype == dtype, (a.dtype, dtype)
        assert a.shape == e.shape, (a.shape, e.shape)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * max(1.0, float(np.max(np.abs(e), initial=0.0))))


def is_paddle(tree) -> bool:
    return all(isinstance(v, paddle.Tensor) for v in optree.tree_leaves(tree))


def tensor(values, stop_gradient: bool = True, dtype: str = "float64"):
    t = paddle.to_tensor(np.asarray(values, dtype=dtype))
    t.stop_gradient = stop_gradient
    return t


# ------------------------------------------------------------------ functions
X = np.array([0.3, -1.2, 2.0, 0.7])


def sin_x(x):
    return anp.sum(anp.sin(x) * x)


def sin_x_grad(x):
    return np.sin(x) + x * np.cos(x)


def sin_x_hess(x):
    return np.diag(2 * np.cos(x) - x * np.sin(x))


def vec(x):  # R^4 -> R^4: J = s diag(cos x) + 2 sin(x) x^T, s = sum(x^2)
    return anp.sin(x) * anp.sum(x**2)


def vec_jac(x):
    return np.diag(np.cos(x)) * np.sum(x**2) + 2 * np.outer(np.sin(x), x)


def wide(x):  # R^4 -> R^16: more outputs than inputs, the Jacobian by pushforwards
    return anp.reshape(x[:, None] * x[None, :], (-1,))


def wide_jac(x):
    n = x.size
    eye = np.eye(n)
    return (eye[:, None, :] * x[None, :, None] + x[:, None, None] * eye[None, :, :]).reshape(n * n, n)


def tree_f(x):  # an int leaf (n: data), an unconnected float leaf (u), a scalar leaf in a tuple (s)
    n = autoray.do("astype", x["n"], autoray.get_dtype_name(x["w"]))  # paddle refuses float * int tensors
    return anp.sum(x["w"] ** 2 * n) + x["s"][0] * anp.sum(x["w"])


def tree_x(dtype):
    return {"w": X.astype(dtype), "n": np.array([1, 2, 3, 4]), "u": np.ones(2, dtype=dtype),
            "s": (np.asarray(1.5, dtype=dtype),)}


def tree_grad(x):
    w, n, s = x["w"].astype(np.float64), x["n"], float(x["s"][0])
    return {"w": 2 * w * n + s, "n": None, "u": np.zeros(2), "s": (np.asarray(w.sum()),)}


RNG = np.random.default_rng(0)
W0, A0, B0 = RNG.normal(size=(3, 2)), RNG.normal(size=(5, 3)), RNG.normal(size=2)


def layer(W, A, bias):  # data passed as args
    return anp.sum(anp.tanh(A @ W + bias))


def layer_grad(W, A, bias):
    return A.T @ (1 - np.tanh(A @ W + bias) ** 2)


# ------------------------------------------------------------------ every operator, both dtypes
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_and_value(b, fd, dtype):
    x = X.astype(dtype)
    y, g = ad.value_and_gradient(b, sin_x, x)
    assert is_paddle((y, g)) and y.dtype == g.dtype == getattr(paddle, np.dtype(dtype).name)
    assert y.stop_gradient and g.stop_gradient  # plain values, no graph kept alive
    assert_close(y, np.sum(np.sin(X) * X), RTOL[dtype])
    assert_close(g, sin_x_grad(X), RTOL[dtype], dtype)
    assert_close(ad.gradient(b, sin_x, x), ad.gradient(fd, sin_x, x), FD_RTOL[1][dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_has_aux_tree_and_data(b, fd, dtype):
    def f(x):
        return sin_x(x), {"double": 2 * x, "tag": "aux", "n": 3}

    (y, aux), g = ad.value_and_gradient(b, f, X.astype(dtype), has_aux=True)
    assert_close(g, sin_x_grad(X), RTOL[dtype], dtype)
    assert aux["tag"] == "aux" and aux["n"] == 3 and aux["double"].stop_gradient
    assert_close(aux["double"], 2 * X, RTOL[dtype], dtype)
    x = tree_x(dtype)
    g = ad.gradient(b, tree_f, x)
    assert g["n"] is None and isinstance(g["u"], paddle.Tensor) and not bool(paddle.any(g["u"] != 0))
    assert_close(g, tree_grad(x), RTOL[dtype], dtype)
    W, A, bias = W0.astype(dtype), A0.astype(dtype), B0.astype(dtype)
    assert_close(ad.gradient(b, layer, W, A, bias), layer_grad(W0, A0, B0), RTOL[dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pullback_and_pushforward(b, fd, dtype):
    x, t = X.astype(dtype), np.array([1.0, -2.0, 0.5, 3.0], dtype=dtype)
    y, vjp = ad.value_and_pullback(b, vec, x)
    assert_close(y, np.sin(X) * np.sum(X**2), RTOL[dtype], dtype)
    assert_close(vjp(t), t.astype(np.float64) @ vec_jac(X), RTOL[dtype], dtype)
    assert_close(vjp(t), t.astype(np.float64) @ vec_jac(X), RTOL[dtype], dtype)  # a pullback runs again
    y, jvp = ad.value_and_pushforward(b, vec, x)
    assert_close(jvp(t), vec_jac(X) @ t.astype(np.float64), RTOL[dtype], dtype)
    assert_close(jvp(2 * t), 2 * vec_jac(X) @ t.astype(np.float64), RTOL[dtype], dtype)
    assert_close(ad.pushforward(b, vec, x)(t), ad.pushforward(fd, vec, x)(t), FD_RTOL[1][dtype], dtype)
    tx = tree_x(dtype)
    dx = {"w": np.ones(4, dtype=dtype), "n": None, "u": np.ones(2, dtype=dtype), "s": (np.asarray(2.0, dtype=dtype),)}
    expected = np.sum(tree_grad(tx)["w"]) + float(tree_grad(tx)["s"][0]) * 2.0
    assert_close(ad.pushforward(b, tree_f, tx)(dx), expected, RTOL[dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_derivative_and_jacobian(b, fd, dtype):
    t = np.asarray(0.8, dtype=dtype)
    d = ad.derivative(b, lambda t: anp.sin(t) * t**2, t)
    assert_close(d, np.cos(0.8) * 0.64 + 2 * 0.8 * np.sin(0.8), RTOL[dtype], dtype)
    x = X.astype(dtype)
    assert_close(ad.jacobian(b, vec, x), vec_jac(X), RTOL[dtype], dtype)  # rows by pullbacks
    assert_close(ad.jacobian(b, wide, x), wide_jac(X), RTOL[dtype], dtype)  # columns by pushforwards
    J = ad.jacobian(b, lambda x, A: A @ x["w"] * x["s"] + anp.sum(x["u"]),
                    {"w": W0[:, 0].astype(dtype), "s": np.asarray(0.5, dtype=dtype), "u": np.ones(2, dtype=dtype),
                     "k": 3}, A0.astype(dtype))
    assert J["k"] is None
    assert_close(J, {"k": None, "s": A0 @ W0[:, 0], "u": np.ones((5, 2)), "w": A0 * 0.5}, RTOL[dtype], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hessian_and_hvp(b, fd, dtype):
    x, v = X.astype(dtype), np.array([1.0, 0.5, -1.0, 2.0], dtype=dtype)
    assert_close(ad.hessian(b, sin_x, x), sin_x_hess(X), RTOL[dtype], dtype)
    assert_close(ad.hvp(b, sin_x, x, v), sin_x_hess(X) @ v.astype(np.float64), RTOL[dtype], dtype)
    W = W0.astype(dtype)
    Hw = ad.hessian(b, layer, W, A0.astype(dtype), B0.astype(dtype))
    assert tuple(Hw.shape) == (3, 2, 3, 2)
    assert_close(Hw, ad.hessian(fd, layer, W, A0.astype(dtype), B0.astype(dtype)), FD_RTOL[2][dtype], dtype)
    tx = tree_x(dtype)
    tv = {"w": np.ones(4, dtype=dtype), "n": None, "u": np.ones(2, dtype=dtype), "s": (np.asarray(1.0, dtype=dtype),)}
    expected = {"w": 2.0 * tx["n"] + 1.0, "n": None, "u": np.zeros(2), "s": (np.asarray(4.0),)}
    assert_close(ad.hvp(b, tree_f, tx, tv), expected, RTOL[dtype], dtype)
    assert_close(ad.hessian(b, lambda x: anp.sum(3.0 * x), x), np.zeros((4, 4)), RTOL[dtype], dtype)  # linear


@pytest.mark.parametrize("dtype", DTYPES)
def test_paddle_tensors_as_inputs_keep_their_dtype(b, dtype):
    name = np.dtype(dtype).name
    x = paddle.to_tensor(X.astype(dtype))
    g = ad.gradient(b, sin_x, x)  # a paddle float tensor is differentiated, not taken for data
    assert g.dtype == getattr(paddle, name)
    assert_close(g, sin_x_grad(X), RTOL[dtype], dtype)
    assert b.asarray(np.ones(2, dtype=dtype)).dtype == getattr(paddle, name)
    assert paddle.get_default_dtype() == "float32"  # never set_default_dtype


# ------------------------------------------------------------------ the caller's tensors
def test_stop_gradient_and_grad_of_the_callers_tensors_left_alone(b):
    frozen, trainable = tensor(X), tensor(X, stop_gradient=False)
    param = paddle.create_parameter([4], "float64", default_initializer=paddle.nn.initializer.Assign(X))
    ops = (
        lambda t: ad.gradient(b, sin_x, t),
        lambda t: ad.value_and_pullback(b, vec, t)[1](np.ones(4)),
        lambda t: ad.pushforward(b, vec, t)(np.ones(4)),
        lambda t: ad.jacobian(b, vec, t),
        lambda t: ad.hessian(b, sin_x, t),
        lambda t: ad.hvp(b, sin_x, t, np.ones(4)),
    )
    for t in (frozen, trainable, param):
        before = t.numpy().copy()
        with paddle.no_grad():  # plain values come back, whatever the caller's flags
            for op in ops:
                assert all(v.stop_gradient for v in optree.tree_leaves(op(t)))
        assert t.grad is None, "an operator wrote .grad"
        np.testing.assert_array_equal(t.numpy(), before)
    assert frozen.stop_gradient and not trainable.stop_gradient and not param.stop_gradient
    assert_close(ad.gradient(b, sin_x, trainable), sin_x_grad(X), 1e-12)


def test_nested_gradients(b):
    def inner_sum(x):
        return anp.sum(ad.gradient(b, sin_x, x))

    third = np.diag(-3 * np.sin(X) - X * np.cos(X))  # d2/dx2 of sum(sin x + x cos x)
    assert_close(ad.gradient(b, inner_sum, X), 2 * np.cos(X) - X * np.sin(X), 1e-9)
    assert_close(ad.hessian(b, inner_sum, X), third, 1e-9)
    assert_close(ad.hvp(b, inner_sum, X, np.ones(4)), third @ np.ones(4), 1e-9)
    assert_close(ad.jacobian(b, lambda x: ad.gradient(b, sin_x, x), X), sin_x_hess(X), 1e-9)



def test_nested_through_data_of_the_inner_call(b):
    # d/da of sum(grad_x (a sum(x^2) / 2)) = sum(x): the outer derivative flows through data of
    # the inner call.  paddle 3.3's double grad of pow wants the gradient of the inner x, which
    # the outer call does not ask for ("DX can not be nullptr"): the adapter asks for it too.
    def outer(a, x):
        return anp.sum(ad.gradient(b, lambda x, a: a * anp.sum(x**2) / 2, x, a))

    assert_close(ad.gradient(b, outer, np.asarray(3.0), X), np.sum(X), 1e-9)
    assert_close(ad.derivative(b, lambda a: outer(a, X), np.asarray(3.0)), np.sum(X), 1e-9)
    inner_jvp = lambda a, f: ad.pushforward(b, f, X, a)(np.ones(4))  # noqa: E731
    assert_close(ad.derivative(b, lambda a: inner_jvp(a, lambda x, a: a * anp.sum(x * x * x)), np.asarray(2.0)),
                 np.sum(3 * X**2), 1e-9)
    # the same with x**3 reaches a paddle kernel that fails: the error says how to avoid it
    with pytest.raises((ValueError, RuntimeError)) as info:
        ad.derivative(b, lambda a: inner_jvp(a, lambda x, a: a * anp.sum(x**3)), np.asarray(2.0))
    assert any("x * x * x" in note for note in info.value.__notes__)


def test_the_users_own_paddle_grad_through_an_operator(b):
    x = tensor(X, stop_gradient=False)
    g = ad.gradient(b, sin_x, x)  # x is in the user's graph: the gradient stays differentiable
    assert not g.stop_gradient
    (second,) = paddle.grad(g.sum(), x)
    assert_close(second, 2 * np.cos(X) - X * np.sin(X), 1e-9)
    assert x.grad is None


def test_same_tensor_twice_gets_partial_derivatives(b):
    for t in (tensor(X), tensor(X, stop_gradient=False)):
        g = ad.gradient(b, lambda p: anp.sum(p[0] * 2.0 + p[1] ** 2), (t, t))
        assert_close(g, (2.0 * np.ones(4), 2 * X), 1e-12)


def test_pullback_keeps_its_point_after_in_place_writes(b):
    # paddle's inplace-version check misses set_value: without a snapshot the pullback
    # would silently use the new values
    x = tensor([1.0, 2.0])
    _, vjp = ad.value_and_pullback(b, lambda x: x**3, x)
    jvp = ad.pushforward(b, lambda x: x**3, x)
    x.set_value(np.array([5.0, 5.0]))
    assert_close(vjp(np.ones(2)), np.array([3.0, 12.0]), 1e-12)
    assert_close(jvp(np.ones(2)), np.array([3.0, 12.0]), 1e-12)
    data = tensor([1.0, 10.0])
    _, vjp = ad.value_and_pullback(b, lambda x, d: d * x**2, np.array([1.0, 2.0]), data)
    data[0] = 0.0
    assert_close(vjp(np.ones(2)), np.array([2.0, 40.0]), 1e-12)


def test_numpy_conversion_of_traced_tensors_raises(b):
    # paddle hands a tensor to numpy even while it is differentiated: np.concatenate detaches it,
    # and the core refuses the numpy result (its one numpy-output policy)
    data = np.array([1.0, 2.0])
    with pytest.raises(ad.InvalidOutputError, match="numpy converted them.*like=x"):
        ad.jacobian(b, lambda x: anp.concatenate([data, x]), np.array([3.0, 4.0]))
    J = ad.jacobian(b, lambda x: autoray.do("concatenate", [data, x], like=x), np.array([3.0, 4.0]))
    assert_close(J, np.vstack([np.zeros((2, 2)), np.eye(2)]), 1e-12)
    assert not bool(paddle.any(ad.gradient(b, lambda x: 3.0, X) != 0))  # a Python number is a constant


def test_errors(b):
    with pytest.raises(TypeError, match="complex"):  # paddle's complex dtypes are recognised
        ad.gradient(b, lambda x: anp.sum(x) * (1 + 1j), np.ones(2))
    with pytest.raises(ad.NonScalarOutputError, match=r"shape \(4,\)"):
        ad.gradient(b, vec, X)
    with pytest.raises(ad.NonScalarOutputError):
        ad.hvp(b, vec, X, X)
    with pytest.raises(ad.NonDifferentiableInputError, match="no floating-point leaf"):
        ad.gradient(b, lambda x: anp.sum(x), paddle.arange(3))

    class UserError(Exception):
        pass

    def failing(x):
        raise UserError("raised by f")

    for op in (ad.gradient, ad.jacobian, ad.hessian, lambda b, f, x: ad.pushforward(b, f, x)(x)):
        with pytest.raises(UserError, match="raised by f"):
            op(b, failing, X)


# ------------------------------------------------------------------ second derivatives
def test_translated_reductions_have_second_derivatives(b, fd):
    # paddle 3.3 has no double grad for max, min, prod, logsumexp or softmax: the adapter's
    # autoray translations are built from ops that have one
    m = np.array([[0.3, 1.4, -0.2], [0.9, -0.5, 0.6]])
    for f in (
        lambda x: anp.sum(anp.max(x, axis=1) ** 2) + anp.min(x) ** 3,
        lambda x: anp.sum(anp.prod(1.0 + 0.5 * x, axis=0)) + anp.prod(x),
        lambda x: autoray.do("logsumexp", x * x, axis=1, keepdims=True).sum(),
        lambda x: anp.sum(autoray.do("scipy.special.softmax", x, axis=0) * x),
        lambda x: anp.sum(anp.std(x, axis=1)) + anp.sum(anp.var(x, axis=0, ddof=1) * x[0]),
    ):
        assert_close(ad.hessian(b, f, m), ad.hessian(fd, f, m), 1e-6)
        assert_close(ad.pushforward(b, f, m)(m), ad.pushforward(fd, f, m)(m), 1e-8)
    assert_close(anp.max(b.asarray(m), axis=0, keepdims=True), np.max(m, axis=0, keepdims=True), 0)
    assert_close(anp.prod(b.asarray(m)), np.prod(m), 1e-15)
    assert_close(anp.std(b.asarray(m)), np.std(m), 1e-15)  # numpy's ddof=0, paddle's is 1


def test_missing_second_derivative_is_explained_and_forward_mode_still_works(b, fd):
    x = np.array([[1.0, 3.0, 2.0], [0.5, -1.0, 4.0]])

    def f(x):
        return paddle.nn.functional.softmax(x, axis=1) * x  # paddle's own softmax: no double grad

    with pytest.raises(RuntimeError, match="doesn't have any grad op") as info:
        ad.hessian(b, lambda x: paddle.sum(f(x)), x)
    assert any("autoray" in note for note in info.value.__notes__)
    # first-order forward mode falls back to the Jacobian built by pullbacks
    t = np.linspace(-1.0, 1.0, 6).reshape(2, 3)
    J = ad.to_numpy(ad.jacobian(b, f, x)).reshape(6, 6)
    assert_close(ad.pushforward(b, f, x)(t), (J @ t.ravel()).reshape(2, 3), 1e-12)
    assert_close(J, ad.to_numpy(ad.jacobian(fd, lambda x: ad.to_numpy(f(paddle.to_tensor(x))), x)).reshape(6, 6),
                 1e-8)


def test_qr_gradient_through_one_factor_does_not_crash(b):
    # paddle 3.3's QR gradient segfaults unless both factors are used; the translation ties them
    a = np.array([[1.0, 0.2, -0.3], [0.4, 1.5, 0.1], [-0.2, 0.3, 0.9], [0.6, -0.5, 0.7]])
    g = ad.gradient(b, lambda a: anp.sum(anp.abs(anp.diagonal(autoray.do("linalg.qr", a)[1]))), a)
    ref = ad.gradient("finite_differences", lambda a: np.sum(np.abs(np.diagonal(np.linalg.qr(a)[1]))), a)
    assert_close(g, ref, 1e-7)


# ------------------------------------------------------------------ paddle's global state
def test_static_mode_of_the_user_is_left_as_it_is(b):
    x = np.array([0.5, 1.0])
    paddle.enable_static()
    try:
        assert not paddle.in_dynamic_mode()
        g = ad.gradient(b, sin_x, x)
        h = ad.hessian(b, sin_x, x)
        jvp = ad.pushforward(b, vec, x)
        assert not paddle.in_dynamic_mode()
        d = jvp(np.ones(2))  # a returned closure too
        vs = ad.variables({"w": x}, "paddle")
        gs = ad.gradient(ad.Implicit("paddle"), lambda: sin_x(vs["w"]), ad.Params(vs))
        state = optim.setup(optim.Adam(0.1), {"w": x})
        state, model = optim.update(state, {"w": b.asarray(x)}, {"w": g})
        assert not paddle.in_dynamic_mode()
    finally:
        paddle.disable_static()
    assert paddle.in_dynamic_mode()
    assert_close(g, sin_x_grad(x), 1e-12)
    assert_close(h, sin_x_hess(x), 1e-12)
    assert_close(d, np.sum(vec_jac(x), axis=1), 1e-12)
    assert_close(gs[vs["w"]], sin_x_grad(x), 1e-12)
    assert model["w"].dtype == paddle.float64


def test_globals_untouched(b):
    place, dtype = paddle.get_device(), paddle.get_default_dtype()
    with paddle.no_grad():
        ad.gradient(b, sin_x, X)
        assert not paddle.is_grad_enabled()
    assert paddle.is_grad_enabled() and paddle.in_dynamic_mode()
    assert (paddle.get_device(), paddle.get_default_dtype()) == (place, dtype)


# ------------------------------------------------------------------ compile=True (paddle.jit.to_static)
def paddle_loss(x, a):  # in a file: to_static converts Python source
    return paddle.sum(paddle.sin(a @ x["w"]) * x["s"])


def portable_loss(x, a):
    return anp.sum(anp.tanh(a @ x) ** 2)


SCALE = 2.0


@pytest.fixture(autouse=True)
def _no_interactive_value(monkeypatch):
    # paddle's to_static compares each function it converts with every value of builtins
    # (its is_builtin check); an array left in builtins._ by an interactive display (a
    # doctest run earlier in this process, or a REPL) makes that comparison raise, and
    # to_static gives up (the adapter then runs f eagerly, with a warning)
    monkeypatch.setattr(builtins, "_", None, raising=False)
# paddle's own warning while it builds a program's backward (pir_partial_program), not ours
TO_STATIC_NOISE = "ignore:Tensor do not have 'place' interface:UserWarning"


def scaled(x):
    return SCALE * anp.sum(x**2)


@pytest.mark.filterwarnings(TO_STATIC_NOISE)
def test_compile_traces_once_per_signature():
    c, eager = fresh(compile=True), fresh()
    assert c.reuses_traces and not eager.reuses_traces
    a = A0.astype(np.float32)
    x = {"w": W0[:, 0].astype(np.float32), "s": np.asarray(1.5, dtype=np.float32)}
    g = ad.gradient(c, paddle_loss, x, a)
    assert c.trace_count == 1 and paddle.in_dynamic_mode()  # to_static leaves dynamic mode on
    assert_close(g, ad.gradient(eager, paddle_loss, x, a), 1e-5, np.float32)
    for k in range(3):  # new values of the same shapes: no new trace
        x2 = {"w": W0[:, k % 2].astype(np.float32) + k, "s": np.asarray(0.5 * k, dtype=np.float32)}
        assert_close(ad.gradient(c, paddle_loss, x2, a + k), ad.gradient(eager, paddle_loss, x2, a + k), 1e-5)
    vjp = ad.pullback(c, paddle_loss, x, a)
    assert_close(vjp(1.0), g, 1e-6)
    assert c.trace_count == 1
    ad.gradient(c, paddle_loss, x, np.ones((7, 3), dtype=np.float32))  # a new shape: traced again
    assert c.trace_count == 2
    v = np.ones(3, dtype=np.float32)  # backend-neutral code compiles too (autoray runs as Python)
    assert_close(ad.gradient(c, portable_loss, v, a), ad.gradient(eager, portable_loss, v, a), 1e-5, np.float32)
    assert c.trace_count == 3


@pytest.mark.filterwarnings(TO_STATIC_NOISE)
def test_compile_keeps_float64_exact_and_second_order_right():
    c = fresh(compile=True)
    x64 = np.array([0.1, 0.2, 0.7])
    # to_static holds Python scalars as float32 (x * 0.1 differs by ~1e-8): float64 runs eagerly
    np.testing.assert_array_equal(ad.to_numpy(ad.gradient(c, scaled, x64 / 3)),
                                  ad.to_numpy(ad.gradient(fresh(), scaled, x64 / 3)))
    assert c.trace_count == 0
    # a to_static program's gradient is not differentiable (it would give zeros): second order runs eagerly
    x32 = x64.astype(np.float32)
    assert_close(ad.hessian(c, portable_loss, x32, A0.astype(np.float32)),
                 ad.hessian(fresh(), portable_loss, x32, A0.astype(np.float32)), 1e-5, np.float32)
    assert_close(ad.pushforward(c, portable_loss, x32, A0.astype(np.float32))(np.ones(3, dtype=np.float32)),
                 np.sum(ad.to_numpy(ad.gradient(fresh(), portable_loss, x32, A0.astype(np.float32)))), 1e-5)


@pytest.mark.filterwarnings(TO_STATIC_NOISE)
def test_compile_sees_a_changed_global_and_falls_back_for_lambdas():
    global SCALE
    c = fresh(compile=True)
    x = np.array([1.0, 2.0], dtype=np.float32)
    try:
        assert_close(ad.gradient(c, scaled, x), 4 * x, 1e-6)
        traces = c.trace_count
        assert_close(ad.gradient(c, scaled, x), 4 * x, 1e-6)
        assert c.trace_count == traces
        SCALE = 5.0
        assert_close(ad.gradient(c, scaled, x), 10 * x, 1e-6)
        assert c.trace_count == traces + 1
    finally:
        SCALE = 2.0
    f = lambda x: anp.sum(x**3)  # noqa: E731  paddle cannot convert a lambda
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        assert_close(ad.gradient(c, f, x), 3 * x**2, 1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the eager fallback is remembered
        assert_close(ad.gradient(c, f, x), 3 * x**2, 1e-6)


COMPILED = fresh(compile=True)


def grad_norm(x, a):  # an operator inside a function to_static converts
    return anp.sum(ad.gradient(COMPILED, portable_loss, x, a) ** 2)


@pytest.mark.filterwarnings(TO_STATIC_NOISE)
def test_compile_with_an_operator_inside_runs_eagerly():
    # the inner operator refuses to add ops to the program being built (a broken program made
    # paddle 3.3 abort the process when destroying it): f runs eagerly, with the reason
    x, a = np.array([0.1, 0.2, 0.7], dtype=np.float32), A0.astype(np.float32)
    with pytest.warns(RuntimeWarning, match="outside the converted function"):
        g = ad.gradient(COMPILED, grad_norm, x, a)
    eager = fresh()
    assert_close(g, ad.gradient(eager, lambda x, a: anp.sum(ad.gradient(eager, portable_loss, x, a) ** 2), x, a),
                 1e-5, np.float32)


def test_compile_option_validated():
    with pytest.raises(TypeError, match="compile must be"):
        ad.backend("paddle", compile="yes")  # type: ignore[arg-type]
    compiled = ad.backend("paddle", compile=True)
    assert compiled.options == {"device": "cpu", "compile": True}
    assert isinstance(compiled.adapter, PaddleAdapter) and compiled.adapter.backend is compiled
    assert not issubclass(PaddleAdapter, ad.Backend)
    assert compiled.reuses_traces and compiled.compile and not ad.backend("paddle").reuses_traces


# ------------------------------------------------------------------ devices
def test_devices():
    b = ad.backend("paddle")
    assert b.devices()[0] == "cpu" and b.device == "cpu" and ad.backend("paddle", device="CPU").device == "cpu"
    assert b.asarray(np.ones(2)).place.is_cpu_place()
    with pytest.raises(ad.DeviceError, match=r"'gpu:7'.*available devices: cpu"):
        ad.backend("paddle", device="gpu:7")
    with pytest.raises(ad.DeviceError, match="'tpu'"):
        ad.backend("paddle", device="tpu")
    if len(b.devices()) == 1:  # a CPU build, or no CUDA device
        for spelling in ("cuda", "gpu", "gpu:0"):
            with pytest.raises(ad.DeviceError, match="has no GPU it can use"):
                ad.backend("paddle", device=spelling)
    else:  # the core's canonical name for an NVIDIA GPU, which the adapter makes a CUDAPlace
        assert b.devices()[1] == "cuda:0"
        for spelling in ("cuda", "gpu", "gpu:0", "cuda:0"):
            gpu = ad.backend("paddle", device=spelling)
            assert gpu.device == "cuda:0" and gpu.place.is_gpu_place()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_cpu(dtype):
    gpus = [d for d in ad.backend("paddle").devices() if d != "cpu"]
    if not gpus:
        pytest.skip("no GPU visible to paddle here (a CPU build, or no CUDA device)")
    gpu, cpu = ad.backend("paddle", device=gpus[0]), ad.backend("paddle")
    x = X.astype(dtype)
    for op in (lambda b: ad.gradient(b, sin_x, x), lambda b: ad.hessian(b, sin_x, x),
               lambda b: ad.pushforward(b, vec, x)(np.ones(4, dtype=dtype))):
        on_gpu = op(gpu)
        assert on_gpu.place.is_gpu_place()
        assert_close(on_gpu, op(cpu), {np.float32: 1e-5, np.float64: 1e-10}[dtype], dtype)


# ------------------------------------------------------------------ implicit mode and training
def make_net(dtype: str = "float32"):
    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(3, 4), paddle.nn.Tanh(), paddle.nn.Linear(4, 1))
    net.to(dtype=dtype)  # the layer's dtype, without paddle.set_default_dtype
    net[2].bias.stop_gradient = True  # frozen
    return net


def test_implicit_with_a_layer():
    net = make_net()
    ps = ad.Params(net)
    assert len(ps) == 3 and "1 non-trainable" in repr(ps)
    x, y = RNG.normal(size=(5, 3)).astype(np.float32), np.ones((5, 1), dtype=np.float32)

    def loss(x, y):
        return paddle.mean((net(x) - y) ** 2)

    value, gs = ad.value_and_gradient(ad.Implicit("paddle"), loss, ps, x, y)
    weights = [p for p in net.parameters() if not p.stop_gradient]

    def explicit(ws, x, y):
        h = paddle.tanh(x @ ws[0] + ws[1])
        return paddle.mean((h @ ws[2] + net[2].bias - y) ** 2)

    want = ad.gradient("paddle", explicit, [w.detach() for w in weights], x, y)
    for w, g in zip(weights, want):
        assert_close(gs[w], g, 1e-6, np.float32)
    assert all(p.grad is None for p in net.parameters())  # never .backward()
    vjp = ad.pullback(ad.Implicit("paddle"), loss, ps, x, y)
    assert_close(vjp(np.asarray(2.0, dtype=np.float32))[weights[0]], 2 * ad.to_numpy(want[0]), 1e-6)
    gs64 = ad.gradient(ad.Implicit("paddle"), loss, ps, x.astype(np.float64), y.astype(np.float64))
    assert gs64[weights[0]].dtype == paddle.float32  # float64 data fitted to the layer's float32


def test_variables_and_their_checks(b):
    vs = ad.variables({"w": np.ones(2, dtype=np.float32), "n": np.arange(2)}, "paddle")
    assert isinstance(vs["w"], paddle.base.framework.EagerParamBase) and not vs["w"].stop_gradient
    assert vs["w"].dtype == paddle.float32
    gs = ad.gradient(ad.Implicit("paddle"), lambda: paddle.sum(vs["w"] ** 2), ad.Params(vs["w"]))
    assert_close(gs[vs["w"]], np.array([2.0, 2.0]), 1e-6, np.float32)
    with pytest.raises(ad.ModeMismatchError, match="stop_gradient=True"):
        ad.Params([tensor([1.0])])
    with pytest.raises(ad.ModeMismatchError, match="not a leaf"):
        ad.Params([tensor([1.0], stop_gradient=False) * 2])
    with pytest.raises(ad.ModeMismatchError, match="ad.Implicit"):
        ad.gradient(b, lambda: 1.0, ad.Params(vs["w"]))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_training_both_modes_keeps_dtype(b, dtype):
    data = [(RNG.normal(size=(4, 3)).astype(dtype), RNG.normal(size=(4, 1)).astype(dtype))] * 3
    model = {"w": np.full((3, 1), 0.5, dtype=dtype), "b": np.zeros(1, dtype=dtype)}
    state = optim.setup(optim.Adam(0.05), model)
    state, model = ad.train(lambda m, x, y: anp.mean((x @ m["w"] + m["b"] - y) ** 2), model, data, state,
                            backend=b, progress=False)
    assert is_paddle(model) and model["w"].dtype == getattr(paddle, dtype)
    net = make_net(dtype)
    frozen = net[2].bias.numpy().copy()
    state = optim.setup(optim.Adam(0.05), net)
    before = net[0].weight.numpy().copy()
    state, net2 = ad.train(lambda m, x, y: paddle.mean((m(x) - y) ** 2), net, data, state,
                           backend=ad.Implicit("paddle"), progress=False)
    assert net2 is net and not np.array_equal(net[0].weight.numpy(), before)
    np.testing.assert_array_equal(net[2].bias.numpy(), frozen)
    assert all(p.dtype == getattr(paddle, dtype) for p in net.parameters())


def test_to_numpy_and_checkpoints(b, tmp_path):
    assert isinstance(ad.to_numpy(b.asarray(X)), np.ndarray)
    half = ad.to_numpy(paddle.to_tensor(np.array([1.5, -2.0], dtype=np.float32)).astype("bfloat16"))
    assert half.dtype.name == "bfloat16" or half.dtype == np.float32  # never paddle's raw uint16
    np.testing.assert_array_equal(np.asarray(half, dtype=np.float32), [1.5, -2.0])
    # explicit model
    model = {"w": b.asarray(np.ones((3, 1))), "b": b.asarray(np.zeros(1))}
    state = optim.setup(optim.Adam(0.1), model)
    state, model = optim.update(state, model, {"w": b.asarray(np.full((3, 1), 0.5)), "b": b.asarray(np.ones(1))})
    ad.save_checkpoint(tmp_path / "explicit.npz", state, model)
    _, loaded = ad.load_checkpoint(tmp_path / "explicit.npz", like=(state, model))
    assert is_paddle(loaded) and loaded["w"].dtype == paddle.float64
    np.testing.assert_array_equal(loaded["w"].numpy(), model["w"].numpy())
    # a layer, frozen parameter included
    net = make_net()
    state = optim.setup(optim.Momentum(0.1), net)
    x, y = np.ones((2, 3), dtype=np.float32), np.zeros((2, 1), dtype=np.float32)
    state, net = ad.train_step(lambda m, x, y: paddle.mean((m(x) - y) ** 2), net, (x, y), state,
                               backend=ad.Implicit("paddle"))[:2]
    ad.save_checkpoint(tmp_path / "net.npz", state, net)
    other = make_net()
    other[0].weight.set_value(paddle.zeros([3, 4]))
    _, loaded = ad.load_checkpoint(tmp_path / "net.npz", like=(optim.setup(optim.Momentum(0.1), other), other))
    assert loaded is other
    for p, q in zip(net.parameters(), other.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy())
    assert not other[0].weight.stop_gradient and other[2].bias.stop_gradient


# ------------------------------------------------------------------ import after TensorFlow
@pytest.mark.skipif(not hasattr(os, "RTLD_DEEPBIND"), reason="RTLD_DEEPBIND is a glibc flag")
def test_backend_created_after_tensorflow_is_imported():
    pytest.importorskip("tensorflow", reason="tensorflow is not installed")
    # `import tensorflow; import paddle` segfaults in libpaddle here; the adapter imports
    # paddle with RTLD_DEEPBIND when TensorFlow is loaded, and restores the flags
    code = textwrap.dedent(
        """
        import sys, numpy as np
        import tensorflow as tf
        import abstractdiff as ad
        flags = sys.getdlopenflags()
        b = ad.backend("paddle")
        assert sys.getdlopenflags() == flags
        g = ad.gradient(b, lambda x: (x ** 3).sum(), np.array([1.0, 2.0]))
        print(ad.to_numpy(g).tolist(), float(tf.reduce_sum(tf.ones(3))))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "[3.0, 12.0] 3.0"


_STATIC_MODE_CHUNKS = """
import numpy as np, paddle
import abstractdiff as ad
from autoray import numpy as anp
x = np.array([0.5, 1.0, 2.0])
for b in (ad.backend("paddle", chunk_size=2), ad.backend("paddle")):  # chunked, and in one chunk
    paddle.enable_static()
    try:
        J = ad.jacobian(b, lambda x: anp.sin(x) * anp.sum(x**2), x)
        H = ad.hessian(b, lambda x: anp.sum(anp.sin(x) * x), x)
        assert not paddle.in_dynamic_mode()
    finally:
        paddle.disable_static()
    np.testing.assert_allclose(J.numpy(), np.diag(np.cos(x)) * np.sum(x**2) + 2 * np.outer(np.sin(x), x), rtol=1e-12)
    np.testing.assert_allclose(H.numpy(), np.diag(2 * np.cos(x) - x * np.sin(x)), rtol=1e-12)
print("ok")
"""


def test_the_cores_chunks_run_in_dynamic_mode_under_a_users_static_mode():
    """The core's Jacobian (with chunk_size set, in chunks) slices and joins paddle tensors: inside
    the adapter's scope (dynamic mode), or paddle 3.3 crashes the process under the user's
    static mode.  In a subprocess, because the failure is a segfault."""
    proc = subprocess.run([sys.executable, "-c", _STATIC_MODE_CHUNKS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]

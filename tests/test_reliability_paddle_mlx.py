"""Issue 24, the paddle and MLX adapters: derivatives paddle or MLX gets wrong, or cannot take,
and their raw errors where abstractdiff knows the fix.

References are jax's derivatives of the same autoray function (``ad.backend("jax")``), or
analytic ones; cotangents are nonlinear (``sum(sin(X))``), so that a wrong adjoint cannot hide
behind a linear functional.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad

RTOL = {np.float32: 2e-4, np.float64: 1e-9}


def assert_close(actual, expected, rtol: float) -> None:
    a = np.asarray(ad.to_numpy(actual), dtype=np.float64)
    e = np.asarray(ad.to_numpy(expected), dtype=np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    np.testing.assert_allclose(a, e, rtol=0, atol=rtol * max(1.0, float(np.max(np.abs(e), initial=0.0))))


def lower_matrix(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.tril(rng.normal(size=(n, n))) + 3.0 * np.eye(n)


def general_matrix(n: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, n)) + n * np.eye(n)


@pytest.fixture(scope="module")
def jx():
    pytest.importorskip("jax")
    return ad.backend("jax")


# ----------------------------------------------------------------------------- paddle
@pytest.fixture(scope="module")
def pd():
    # the adapter first: it imports paddle safely after TensorFlow
    pytest.importorskip("abstractdiff.adapters.paddle", reason="paddle is not installed")
    return ad.backend("paddle")


def solve_triangular(a, b, **kwargs):
    import autoray

    return autoray.do("scipy.linalg.solve_triangular", a, b, **kwargs)


@pytest.mark.parametrize("n", [3, 6])
def test_paddle_solve_triangular_gradient_with_a_constant_right_hand_side(pd, jx, n):
    # paddle's own gradient with respect to the matrix was wrong (by 100% and more) whenever the
    # right-hand side is constant data, as in a GP likelihood, and changed from call to call
    a, y = lower_matrix(n), np.linspace(-1.0, 2.0, 2 * n).reshape(n, 2)

    def loss(a, y):
        return anp.sum(anp.sin(solve_triangular(a, y, lower=True)))

    expected = ad.gradient(jx, loss, a, y)
    for _ in range(3):
        assert_close(ad.gradient(pd, loss, a, y), expected, 1e-10)


@pytest.mark.parametrize("n", [3, 6])
@pytest.mark.parametrize("options", [{"lower": True}, {"lower": False}, {"lower": True, "trans": "T"},
                                     {"lower": True, "unit_diagonal": True}])
def test_paddle_solve_triangular_gradients_in_both_operands_and_second_order(pd, jx, n, options):
    a = lower_matrix(n) if options["lower"] else lower_matrix(n).T
    x = {"a": a, "b": np.linspace(-1.0, 2.0, n)}  # a vector right-hand side

    def loss(t):
        return anp.sum(anp.sin(solve_triangular(t["a"], t["b"], **options)) ** 2)

    g, ref = ad.gradient(pd, loss, x), ad.gradient(jx, loss, x)
    for k in x:
        assert_close(g[k], ref[k], 1e-10)
    only_a = lambda a: loss({"a": a, "b": x["b"]})  # noqa: E731
    t = np.cos(np.arange(n * n)).reshape(n, n)
    assert_close(ad.hvp(pd, only_a, a, t), ad.hvp(jx, only_a, a, t), 1e-9)
    assert_close(ad.pushforward(pd, only_a, a)(np.ones_like(a)), ad.pushforward(jx, only_a, a)(np.ones_like(a)),
                 1e-10)


def test_paddle_gp_likelihood_gradient(pd, jx):
    # the new user's case: a Gaussian-process negative log likelihood through Cholesky
    t = np.linspace(0.0, 3.0, 6)
    y = np.sin(t)

    def nll(p, t, y):
        d = t[:, None] - t[None, :]
        k = p[0] ** 2 * anp.exp(-0.5 * d * d / p[1] ** 2) + 0.1 * anp.eye(6, like=p)
        chol = anp.linalg.cholesky(k)
        alpha = solve_triangular(chol, y, lower=True)
        return 0.5 * anp.sum(alpha * alpha) + anp.sum(anp.log(anp.diagonal(chol)))

    p = np.array([1.3, 0.7])
    assert_close(ad.gradient(pd, nll, p, t, y), ad.gradient(jx, nll, p, t, y), 1e-9)


@pytest.mark.parametrize("n", [3, 6])
@pytest.mark.parametrize("column", [True, False])
def test_paddle_solve_with_a_constant_right_hand_side(pd, jx, n, column):
    # paddle's gradient of linalg.solve crashed the process (a segfault) with an (n, 1) or
    # any constant right-hand side
    a, rhs = general_matrix(n), np.linspace(-1.0, 1.0, n)
    rhs = rhs[:, None] if column else rhs

    def loss(a, b):
        return anp.sum(anp.sin(anp.linalg.solve(a, b)))

    assert_close(ad.gradient(pd, loss, a, rhs), ad.gradient(jx, loss, a, rhs), 1e-10)
    both = lambda t: loss(t["a"], t["b"])  # noqa: E731
    g, ref = ad.gradient(pd, both, {"a": a, "b": rhs}), ad.gradient(jx, both, {"a": a, "b": rhs})
    assert_close(g["a"], ref["a"], 1e-10)
    assert_close(g["b"], ref["b"], 1e-10)
    assert_close(ad.hessian(pd, loss, a, rhs), ad.hessian(jx, loss, a, rhs), 1e-9)


def test_paddle_hessian_and_hvp_through_concatenate_with_a_constant(pd):
    # paddle raised a raw SystemError ("Unable to fill empty grad inputs")
    x = np.array([1.0, 2.0, 3.0])

    def f(x):
        return anp.sum(anp.concatenate([x, np.array([1.0, 2.0])]) ** 3) + anp.sum(anp.stack([x, x * 0 + 1.0]) ** 3)

    h = np.diag(12.0 * x)
    assert_close(ad.hessian(pd, f, x), h, 1e-12)
    assert_close(ad.hvp(pd, f, x, np.ones(3)), h @ np.ones(3), 1e-12)
    assert_close(ad.gradient(pd, f, x), 6.0 * x**2, 1e-12)
    # the paddle function itself gives an abstractdiff error naming the fix
    paddle = sys.modules["paddle"]
    with pytest.raises(ad.CompositionError, match="autoray's concatenate") as info:
        ad.hessian(pd, lambda x: paddle.sum(paddle.concat([x, paddle.ones([2], dtype=x.dtype)]) ** 3), x)
    assert "Unable to fill empty grad inputs" in str(info.value.__cause__)


@pytest.mark.parametrize("width", [1, (1, 2), (2,), ((1, 2),), ((0, 1), (2, 0))])
def test_paddle_pad_takes_numpy_widths(pd, width):
    m = np.arange(6.0).reshape(2, 3) + 1.0
    f = lambda x: anp.pad(x, width) ** 3  # noqa: E731
    assert_close(f(pd.asarray(m)), np.pad(m, width) ** 3, 0)
    v = np.array([1.0, -2.0, 3.0])
    assert_close(anp.pad(pd.asarray(v), (1, 2), constant_values=5.0), np.pad(v, (1, 2), constant_values=5.0), 0)
    assert_close(ad.gradient(pd, lambda x: anp.sum(f(x)), m), 3 * m**2, 1e-12)
    assert_close(ad.hessian(pd, lambda x: anp.sum(f(x)), m), np.diag(6 * m.ravel()).reshape(2, 3, 2, 3), 1e-12)


@pytest.mark.parametrize("name", ["diagonal", "diagonal-offset", "diagonal-axes", "trace", "diag-vector",
                                  "diag-matrix", "tril", "triu"])
def test_paddle_diagonal_trace_diag_and_triangles_have_second_derivatives(pd, jx, name):
    # paddle's own diagonal_grad, trace_grad, diag_grad, tril_grad and triu_grad have no grad op
    m, t, v = np.arange(1.0, 13.0).reshape(3, 4) / 5, np.arange(24.0).reshape(2, 3, 4) / 10, np.array([0.5, -1.0, 2.0])
    f, x = {
        "diagonal": (lambda a: anp.sum(anp.diagonal(a) ** 3), m),
        "diagonal-offset": (lambda a: anp.sum(anp.diagonal(a, offset=-1) ** 3), m),
        "diagonal-axes": (lambda a: anp.sum(anp.diagonal(a, 1, 0, 2) ** 3), t),
        "trace": (lambda a: anp.trace(a, offset=1) ** 3, m),
        "diag-vector": (lambda v: anp.sum(anp.sin(anp.diag(v, -2))) + anp.sum(anp.diag(v) ** 3), v),
        "diag-matrix": (lambda a: anp.sum(anp.diag(a, 1) ** 3), m),
        "tril": (lambda a: anp.sum(anp.tril(a, 1) ** 3), t),
        "triu": (lambda a: anp.sum(anp.triu(a, -1) ** 3), m),
    }[name]
    assert_close(f(pd.asarray(x)), f(x), 1e-14)
    assert_close(ad.hessian(pd, f, x), ad.hessian(jx, f, x), 1e-12)


@pytest.mark.parametrize("name", ["inv", "slogdet", "det", "cholesky"])
def test_paddle_linear_algebra_has_second_derivatives(pd, jx, name):
    # paddle's inverse_grad, slogdet_grad, det_grad and cholesky_grad have no grad op
    n = 4
    a = general_matrix(n)
    f = {
        "inv": lambda a: anp.sum(anp.sin(anp.linalg.inv(a))),
        "slogdet": lambda a: anp.linalg.slogdet(a)[1] * anp.sum(anp.sin(a)),
        "det": lambda a: anp.sin(anp.linalg.det(a) / 50.0),
        "cholesky": lambda a: anp.sum(anp.sin(anp.linalg.cholesky(a @ a.T + anp.eye(n, like=a)))),
    }[name]
    t = np.cos(np.arange(n * n)).reshape(n, n)
    assert_close(f(pd.asarray(a)), f(a), 1e-13)
    assert_close(ad.gradient(pd, f, a), ad.gradient(jx, f, a), 1e-11)
    assert_close(ad.hvp(pd, f, a, t), ad.hvp(jx, f, a, t), 1e-10)
    assert_close(ad.pushforward(pd, f, a)(t), ad.pushforward(jx, f, a)(t), 1e-11)


def test_paddle_missing_second_derivative_is_an_abstractdiff_error(pd):
    paddle = sys.modules["paddle"]
    x = np.array([1.0, 2.0, 3.0])
    with pytest.raises(ad.CompositionError, match="diagonal_grad") as info:
        ad.hessian(pd, lambda x: paddle.sum(paddle.diagonal(paddle.outer(x, x)) ** 2), x)
    message = str(info.value)
    assert 'ad.SecondOrder("finite_differences", b)' in message and "portable" in message
    assert "doesn't have any grad op" in str(info.value.__cause__)
    # and the fix it names works
    so = ad.SecondOrder("finite_differences", pd)
    h = ad.hessian(so, lambda x: paddle.sum(paddle.diagonal(paddle.outer(x, x)) ** 2), x)
    assert_close(h, np.diag(12.0 * x**2), 1e-5)


def test_paddle_float16_on_the_cpu_is_a_clear_error(pd):
    x = np.array([0.5, 1.0], dtype=np.float16)
    with pytest.raises(ad.ArgumentTypeError, match=r"float16 kernel of sin on the CPU.*float32") as info:
        ad.gradient(pd, lambda x: anp.sum(anp.sin(x)), x)
    assert "is not registered" in str(info.value.__cause__)


# ------------------------------------------------------------------------------- MLX
@pytest.fixture(scope="module")
def mlx():
    pytest.importorskip("mlx.core", reason="mlx is not installed")
    return ad.backend("mlx")


@pytest.fixture
def no_hang():
    """Fail, rather than hang the suite, if the test runs for more than 60 s."""

    def expired(*_):
        raise TimeoutError("the test hung")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mlx_gradient_of_an_empty_x_never_reaches_mlx(mlx, monkeypatch, no_hang, compile, dtype):
    # mx.value_and_grad over a zero-size array can loop forever in MLX's reduction kernel
    # (anp.var's gradient, now and then): a zero-size x has an empty derivative, known
    # without MLX
    import mlx.core as mx

    b = ad.backend("mlx", compile=compile)
    x = np.zeros((0, 3), dtype)

    def refuse(*args, **kwargs):
        raise AssertionError("mx.value_and_grad was called on a zero-size x")

    monkeypatch.setattr(mx, "value_and_grad", refuse)
    y, g = ad.value_and_gradient(b, lambda x, c: anp.sum(x * x) + c, x, np.asarray(2.0, dtype))
    assert float(y) == 2.0 and g.shape == (0, 3) and g.dtype == b.asarray(x).dtype
    with pytest.raises(ad.NonScalarOutputError):
        ad.gradient(b, lambda x: x * 2, x)
    prepared = ad.prepare_gradient(b, lambda x: anp.sum(anp.var(x, axis=0)), x)
    assert prepared(x).shape == (0, 3)
    # a pytree with an empty leaf: the other leaves are differentiated as usual
    monkeypatch.undo()
    y, g = ad.value_and_gradient(b, lambda t: anp.sum(t["a"] * t["a"]) + anp.sum(t["b"] ** 3),
                                 {"a": np.zeros(0, dtype), "b": np.array([1.0, 2.0], dtype)})
    assert float(y) == 9.0 and g["a"].shape == (0,)
    assert_close(g["b"], [3.0, 12.0], RTOL[dtype])


def test_mlx_zero_size_numpy_input_does_not_hang_mlx(mlx):
    # MLX's reduction kernels looped forever, in most runs, over a zero-size array imported from
    # numpy (mx.array(np.zeros((0, 3)))): a hang cannot be interrupted in-process, so a child runs it
    code = (
        "import numpy as np, mlx.core as mx, abstractdiff as ad\n"
        "from autoray import numpy as anp\n"
        "b = ad.backend('mlx')\n"
        "for dtype in ('float32', 'float64'):\n"
        "    for _ in range(5):\n"
        "        x = np.zeros((0, 3), dtype)\n"
        "        v = mx.var(b.asarray(x), axis=0)\n"
        "        mx.eval(v)\n"
        "        assert np.isnan(np.array(v)).all()\n"
        "        y, g = ad.value_and_gradient(b, lambda x: anp.sum(anp.var(x, axis=0) * 0.0), x)\n"
        "        assert g.shape == (0, 3)\n"
        "print('done')\n"
    )
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired:
        pytest.fail("MLX hung on a zero-size array made from numpy")
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-2000:]


def test_mlx_empty_x_other_operators(mlx, no_hang):
    x = np.zeros(0)
    assert ad.pullback(mlx, lambda x: anp.var(x) * x, x)(np.zeros(0)).shape == (0,)
    assert ad.jacobian(mlx, lambda x: x * 2, x).shape == (0, 0)
    assert ad.hessian(mlx, lambda x: anp.var(x) + anp.sum(x), x).shape == (0, 0)


@pytest.mark.parametrize("view", ["reversed", "transposed", "strided"])
def test_mlx_takes_negative_stride_and_non_contiguous_numpy_input(mlx, view):
    base = np.arange(12.0).reshape(3, 4)
    x = {"reversed": base[::-1, ::-1], "transposed": base.T, "strided": base[:, ::2]}[view]
    before = x.copy()
    g = ad.gradient(mlx, lambda x: anp.sum(x**3), x)
    assert_close(g, 3 * x**2, 1e-12)
    assert_close(mlx.asarray(x), x, 0)
    np.testing.assert_array_equal(x, before)  # the caller's array, untouched


@pytest.mark.parametrize("n", [4, 6])
def test_mlx_slogdet_and_det_gradients(mlx, jx, n):
    a = general_matrix(n)

    def logdet(a):
        return anp.linalg.slogdet(a)[1] + anp.sum(anp.sin(a))

    def det(a):
        return anp.sin(anp.linalg.det(a) / 100.0)

    for f in (logdet, det):
        assert_close(f(mlx.asarray(a)), f(a), 1e-12)  # numpy's value
        assert_close(ad.gradient(mlx, f, a), ad.gradient(jx, f, a), 1e-10)
        t = np.cos(np.arange(n * n)).reshape(n, n)
        assert_close(ad.hvp(mlx, f, a, t), ad.hvp(jx, f, a, t), 1e-9)
        assert_close(ad.pushforward(mlx, f, a)(np.eye(n)), ad.pushforward(jx, f, a)(np.eye(n)), 1e-10)
    # float32, and the sign of slogdet
    s, _ = anp.linalg.slogdet(mlx.asarray(-a))
    assert float(s) == np.linalg.slogdet(-a)[0]
    assert_close(ad.gradient(mlx, logdet, a.astype(np.float32)), ad.gradient(jx, logdet, a), 1e-4)


def test_mlx_missing_vjp_is_an_abstractdiff_error(mlx):
    import mlx.core as mx

    a = general_matrix(3)
    with pytest.raises(ad.CompositionError, match="QRF") as info:
        ad.gradient(mlx, lambda a: mx.sum(mx.linalg.qr(a, stream=mx.cpu)[1]), a)
    message = str(info.value)
    assert "finite_differences" in message and "portable" in message
    assert "Not implemented" in str(info.value.__cause__)
    # the same through a prepared operator and a pullback
    with pytest.raises(ad.CompositionError, match="QRF"):
        ad.pullback(mlx, lambda a: mx.linalg.qr(a, stream=mx.cpu)[1], a)(np.ones((3, 3)))

"""TensorFlow's loop hooks (issue 45, round 4): a carry that starts as a Python number takes the
dtype the step gives it, as in jax (it was converted to float32 and met float64 tensors), and
forward mode vectorised by pfor (ad.Sparse's products) goes through nested loops (pfor failed on
the inner loop's gradient: "Required handle data not set").  Each result against jax's own
loops (``jax.lax``) in float64."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
jax = pytest.importorskip("jax")
pytest.importorskip("autoray")
import jax.numpy as jnp  # noqa: E402
from autoray import numpy as anp  # noqa: E402

import abstractdiff as ad  # noqa: E402
from abstractdiff._registry import unavailable_reason  # noqa: E402

if unavailable_reason("tensorflow") is not None:
    pytest.skip(unavailable_reason("tensorflow"), allow_module_level=True)

X = np.array([0.8, 0.7, -0.6])
V = np.array([1.0, 0.5, -2.0])
#: compiled (tf.function, the loop a tf.while_loop) and eager (the core's Python loop)
OPTIONS = [{}, {"compile": False}]


def _numpy(value):
    return np.asarray(value.toarray() if hasattr(value, "toarray") else ad.to_numpy(value))


def _jax(f, *args):
    with jax.enable_x64(True):
        return np.asarray(f(*(jnp.asarray(a) for a in args)))


# --------------------------------------------------- a carry that starts as a Python float
def fori_float(np_, fori):
    """The oracle's ``fori_float`` block: a pytree carry whose first leaf starts as ``0.0``."""

    def body(i, carry):
        c, u = carry
        return c * 0.5 + np_.mean(np_.sin(u)), u * np_.cos(c)

    def f(v):
        c, u = fori(0, 3, body, (0.0, v))
        return u + 0.25 * c

    return f


def scan_float(np_, scan, n):
    """A scan from ``0.0`` recording its incoming carry: ``ys[0]`` is that float."""

    def f(x):
        c, ys = scan(lambda c, xi: (c + np_.sin(xi), c), 0.0, x[:n])
        return 0.5 * np_.sum(ys) + c * x

    return f


def while_float(np_, while_loop):
    def f(x):
        c, _, u = while_loop(lambda s: s[1] < 3, lambda s: (s[0] * 0.5 + np_.sum(np_.sin(s[2])), s[1] + 1,
                                                            s[2] * 1.1), (0.0, 0, x))
        return c + u

    return f


def _total(f, np_):
    return lambda x: np_.sum(f(x))


@pytest.mark.parametrize("options", OPTIONS, ids=["compiled", "eager"])
def test_fori_loop_from_a_python_float_matches_jax(options):
    b = ad.backend("tensorflow", **options)
    f, ref = fori_float(anp, ad.fori_loop), fori_float(jnp, jax.lax.fori_loop)
    J = _jax(jax.jacfwd(ref), X)
    x0 = np.array(-0.2)  # the saved oracle case: a scalar, pulled back
    np.testing.assert_allclose(_numpy(ad.pullback(b, f, x0)(np.array(1.0))), _jax(jax.grad(ref), x0), rtol=1e-10)
    np.testing.assert_allclose(_numpy(ad.jacobian(b, f, X)), J, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_numpy(ad.prepare_jacobian(b, f, X)(X)), J, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_numpy(ad.pushforward(b, f, X)(V)), J @ V, rtol=1e-10, atol=1e-12)
    # the value keeps float64: the loop did not round the carry through float32
    assert _numpy(f(tf.constant(X))).dtype == np.float64


def test_fori_loop_from_a_python_float_second_order():
    b = ad.backend("tensorflow")
    f, ref = _total(fori_float(anp, ad.fori_loop), anp), _total(fori_float(jnp, jax.lax.fori_loop), jnp)
    H = _jax(jax.hessian(ref), X)
    np.testing.assert_allclose(_numpy(ad.hvp(b, f, X, V)), H @ V, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_numpy(ad.prepare_hvp(b, f, X, V)(X, V)), H @ V, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [1, 3])
def test_scan_from_a_python_float_recording_it(n):
    b = ad.backend("tensorflow")
    f, ref = scan_float(anp, ad.scan, n), scan_float(jnp, jax.lax.scan, n)
    J = _jax(jax.jacfwd(ref), X)
    np.testing.assert_allclose(_numpy(ad.jacobian(b, f, X)), J, rtol=1e-10, atol=1e-12)


def test_while_loop_from_a_python_float():
    b = ad.backend("tensorflow")
    f, ref = while_float(anp, ad.while_loop), while_float(jnp, jax.lax.while_loop)
    J = _jax(jax.jacfwd(ref), X)
    np.testing.assert_allclose(_numpy(ad.jacobian(b, f, X)), J, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_numpy(ad.pushforward(b, f, X)(V)), J @ V, rtol=1e-10, atol=1e-12)


def test_the_dtype_probe_runs_nothing():
    """The step traced to find a Python float's dtype is never run: a stateful op in the body
    (a variable's update) runs once per step, as it does without a float."""
    b = ad.backend("tensorflow")
    count = tf.Variable(0.0, dtype=tf.float64)

    def f(x):
        def body(i, carry):
            c, u = carry
            count.assign_add(1.0)
            return c + anp.sum(u), u * 0.5

        return ad.fori_loop(0, 3, body, (0.0, x))[0]

    g = _numpy(ad.gradient(b, f, X))
    np.testing.assert_allclose(g, np.full(3, 1.0 + 0.5 + 0.25))  # d/dx of sum(x) + sum(x / 2) + sum(x / 4)
    assert float(count.numpy()) == 3.0


# ---------------------------------------------- forward mode vectorised through nested loops
def nested(np_, fori, inner_loop):
    """The oracle's ``fori_array`` block inside a two-step fori_loop (its ``loop="fori"``), or
    (``inner_loop="while"``) a while_loop inside the fori_loop."""

    def body(i, carry):
        c, u = carry
        return c * 0.5 + np_.mean(np_.sin(u)), u * np_.cos(c)

    def inner(v):
        if inner_loop == "while":
            u, _ = inner_loop_fn(lambda s: s[1] < 2, lambda s: (s[0] * np_.cos(s[0]), s[1] + 1), (v, 0))
            return u
        c, u = fori(0, 3, body, (np_.zeros_like(np_.sum(v)), v))
        return u + 0.25 * c

    inner_loop_fn = {"while": ad.while_loop if np_ is anp else jax.lax.while_loop}.get(inner_loop)
    return lambda x: fori(0, 2, lambda i, v: 0.5 * (v + inner(v)), x)


@pytest.mark.parametrize("inner_loop", ["fori", "while"])
def test_sparse_jacobian_through_nested_loops(inner_loop):
    """The saved oracle case (dense probe, mode auto: forward for a square Jacobian); with an
    inner while_loop, the outer fori_loop runs as a Python loop instead."""
    f, ref = nested(anp, ad.fori_loop, inner_loop), nested(jnp, jax.lax.fori_loop, inner_loop)
    J = _jax(jax.jacfwd(ref), X)
    b = ad.Sparse(ad.backend("tensorflow"), sparsity="dense-probe", mode="auto")
    np.testing.assert_allclose(_numpy(ad.jacobian(b, f, X)), J, rtol=1e-10, atol=1e-12)


def test_sparse_jacobian_through_a_while_loop_in_a_while_loop_is_refused_clearly():
    """Neither loop can run as a Python loop in a graph (a while_loop needs its condition's
    value), and pfor cannot vectorise the pair: a clear refusal, where eager mode works."""

    def f(x):
        def outer(s):
            u, _ = ad.while_loop(lambda t: t[1] < 2, lambda t: (t[0] * anp.cos(t[0]), t[1] + 1), (s[0], 0))
            return 0.5 * (s[0] + u), s[1] + 1

        return ad.while_loop(lambda s: s[1] < 2, outer, (x, 0))[0]

    b = ad.Sparse(ad.backend("tensorflow"), sparsity="dense-probe", mode="forward")
    with pytest.raises(ad.LoopDerivativeError, match="ad.while_loop inside another while loop.*compile=False"):
        ad.jacobian(b, f, X)
    eager = ad.Sparse(ad.backend("tensorflow", compile=False), sparsity="dense-probe", mode="forward")
    ref = _jax(jax.jacfwd(lambda x: jax.lax.while_loop(
        lambda s: s[1] < 2,
        lambda s: (0.5 * (s[0] + jax.lax.while_loop(lambda t: t[1] < 2, lambda t: (t[0] * jnp.cos(t[0]), t[1] + 1),
                                                    (s[0], 0))[0]), s[1] + 1),
        (x, 0))[0]), X)
    np.testing.assert_allclose(_numpy(ad.jacobian(eager, f, X)), ref, rtol=1e-10, atol=1e-12)

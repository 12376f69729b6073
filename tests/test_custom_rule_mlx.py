"""The mlx adapter's ``custom_rule`` hook (ad.stop_gradient's rule included): MLX's transforms and the
operators, eager and compiled, call the rule (deliberately wrong: d/dx is 3xy, not 2xy,
so that a test tells the rule from a derivative of its value), in reverse and forward mode,
under mx.vmap and to second order; a rule without a vjp refuses reverse mode with its error."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'abstractdiff[mlx]'")

import abstractdiff as ad  # noqa: E402
from abstractdiff._errors import AbstractDiffError  # noqa: E402

from ._fake_rule import FakeRule  # noqa: E402


class TwoOutputs(FakeRule):
    """``x -> (sum(x), x * x)`` with backward ``5 * ct0 + 7 * ct1 * x`` (true: ``ct0 + 2 * ct1 * x``)."""

    def value(self, x):
        return (self.sum(x), x * x)

    def forward(self, x):
        return self.value(x), x

    def backward(self, x, cotangents):
        ct0, ct1 = cotangents
        return (5 * ct0 + 7 * ct1 * x,)


X = np.array([1.0, 2.0, 3.0])
Y = 2.0
T = np.array([0.5, -1.0, 2.0])


def arrays(dtype=mx.float64):
    return mx.array(X, dtype=dtype), mx.array(Y, dtype=dtype)


def close(got, want, rtol=1e-12):
    np.testing.assert_allclose(np.array(got), want, rtol=rtol, atol=rtol)


def made(kind, compile=False):
    b = ad.backend("mlx", compile=compile)
    rule = FakeRule(mx, kind)
    return b, b.adapter.custom_rule(rule), rule


# ------------------------------------------------------------------- MLX's own transforms
@pytest.mark.parametrize("dtype", [mx.float64, mx.float32])
def test_value_and_native_derivatives_are_the_rules(dtype):
    x, y = arrays(dtype)
    t = mx.array(T, dtype=dtype)
    rtol = 1e-12 if dtype == mx.float64 else 1e-6
    _, h, rule = made("vjp")
    out = h(x, y)
    assert isinstance(out, tuple) and len(out) == 1 and out[0].dtype == dtype
    close(out[0], 14 * Y, rtol)
    assert rule.calls["forward"] == 0  # the value is rule.value alone
    gx, gy = mx.grad(lambda x, y: h(x, y)[0], argnums=(0, 1))(x, y)
    close(gx, 3 * X * Y, rtol)
    close(gy, 14.0, rtol)
    assert gx.dtype == dtype and rule.calls["backward"] == 1
    close(mx.vjp(h, [x, y], [mx.array(2.0, dtype=dtype)])[1][0], 6 * X * Y, rtol)
    # forward mode of a vjp-only rule: the transpose of its backward (t -> J t), never rule.value's
    close(mx.jvp(lambda x: h(x, y)[0], [x], [t])[1][0], 3 * Y * X @ T, rtol)
    _, hj, rule = made("jvp")
    close(mx.jvp(hj, [x, y], [t, mx.array(1.0, dtype=dtype)])[1][0], 3 * Y * X @ T + 14, rtol)
    assert rule.calls["jvp"] == 1


def test_native_compile_and_second_order():
    x, y = arrays()
    t = mx.array(T)
    _, h, _ = made("vjp")
    f = lambda x: h(x, y)[0]  # noqa: E731
    close(mx.compile(mx.grad(f))(x), 3 * X * Y)
    close(mx.compile(lambda x, t: mx.jvp(f, [x], [t])[1][0])(x, t), 3 * Y * X @ T)
    # the backward's dependence on x through the residuals is differentiated: 3y I, not 2y I
    close(mx.grad(lambda x: mx.grad(f)(x) @ t)(x), 3 * Y * T)
    close(mx.jvp(mx.grad(f), [x], [t])[1][0], 3 * Y * T)
    # forward mode of the backward's transpose, differentiated again in either mode
    close(mx.grad(lambda x: mx.jvp(f, [x], [t])[1][0])(x), 3 * Y * T)
    close(mx.jvp(lambda x: mx.jvp(f, [x], [t])[1][0], [x], [t])[1][0], 3 * Y * T @ T)
    _, hj, _ = made("jvp")
    fj = lambda x: hj(x, y)[0]  # noqa: E731
    close(mx.compile(lambda x, t: mx.jvp(fj, [x], [t])[1][0])(x, t), 3 * Y * X @ T)
    # forward over forward differentiates the jvp rule: d/dx of 3y <x, t> along t
    close(mx.jvp(lambda x: mx.jvp(fj, [x], [t])[1][0], [x], [t])[1][0], 3 * Y * T @ T)


def test_native_vmap():
    x, y = arrays()
    xs = mx.stack([x, 2 * x])
    _, h, _ = made("vjp")
    f = lambda x: h(x, y)[0]  # noqa: E731
    want = 3 * Y * np.stack([X, 2 * X])
    close(mx.vmap(mx.grad(f))(xs), want)
    # the vmapped function keeps the rule for a derivative taken outside the vmap
    close(mx.grad(lambda xs: mx.vmap(f)(xs).sum())(xs), want)
    close(mx.grad(lambda xs: mx.vmap(mx.vmap(f))(xs).sum())(mx.stack([xs, xs])), np.stack([want, want]))
    close(mx.grad(lambda xs: mx.vmap(f, in_axes=1)(xs).sum())(xs.T), want.T)
    # an unbatched input's cotangent is summed over the batch
    close(mx.grad(lambda x: mx.vmap(lambda y: h(x, y)[0])(mx.array([1.0, 2.0], dtype=mx.float64)).sum())(x), 9 * X)
    close(mx.vmap(lambda x: mx.jvp(f, [x], [mx.array(T)])[1][0])(xs), 3 * Y * np.stack([X, 2 * X]) @ T)
    hessians = mx.vmap(lambda x: mx.vmap(lambda v: mx.vjp(mx.grad(f), [x], [v])[1][0])(mx.eye(3, dtype=mx.float64)))(xs)
    close(hessians, np.stack([3 * Y * np.eye(3)] * 2))
    _, hj, _ = made("jvp")
    tangents = mx.ones((2, 3), dtype=mx.float64)
    close(mx.jvp(mx.vmap(lambda x: hj(x, y)[0]), [xs], [tangents])[1][0], 3 * Y * np.stack([X, 2 * X]).sum(1))


def test_outputs_without_a_cotangent_get_zeros():
    x = mx.array(X)
    h = ad.backend("mlx").adapter.custom_rule(TwoOutputs(mx))
    a, b = h(x)
    close(a, 6.0)
    close(b, X * X)
    close(mx.grad(lambda x: h(x)[0])(x), 5 * np.ones(3))
    close(mx.grad(lambda x: h(x)[1].sum())(x), 7 * X)
    close(mx.jvp(h, [x], [mx.array(T)])[1][1], 7 * X * T)


# ------------------------------------------------------------------------ the operators
@pytest.mark.parametrize("compile", [False, True])
def test_operators_use_the_vjp_rule(compile):
    b, h, rule = made("vjp", compile)
    x, y = arrays()
    f = lambda x: h(x, y)[0]  # noqa: E731
    close(ad.gradient(b, f, x), 3 * X * Y)
    close(ad.pullback(b, f, x)(mx.array(2.0, dtype=mx.float64)), 6 * X * Y)
    close(ad.jacobian(b, f, x), 3 * X * Y)
    # more outputs than inputs: the Jacobian runs in forward mode, one jvp per input element
    close(ad.jacobian(b, lambda s: h(s * x, y)[0] * mx.arange(1, 5, dtype=mx.float64), mx.ones((1,), mx.float64)),
          3 * Y * 14 * np.arange(1, 5)[:, None])
    close(ad.pushforward(b, f, x)(mx.array(T)), 3 * Y * X @ T)
    grad = ad.prepare_gradient(b, f, x)
    close(grad(x), 3 * X * Y)
    calls = rule.calls["backward"]
    close(grad(2 * x), 6 * X * Y)
    if compile:  # the rule ran while mx.compile traced, once
        assert rule.calls["backward"] == calls
    close(ad.hessian(b, f, x), 3 * Y * np.eye(3))
    close(ad.hvp(b, f, x, mx.array(T)), 3 * Y * T)


@pytest.mark.parametrize("compile", [False, True])
def test_a_jvp_rule_gives_forward_mode_and_refuses_reverse_mode(compile):
    b, h, _ = made("jvp", compile)
    x, y = arrays()
    f = lambda x: h(x, y)[0]  # noqa: E731
    close(ad.pushforward(b, f, x)(mx.array(T)), 3 * Y * X @ T)
    close(ad.jacobian(b, lambda s: h(s * x, y)[0] * mx.arange(1, 5, dtype=mx.float64), mx.ones((1,), mx.float64)),
          3 * Y * 14 * np.arange(1, 5)[:, None])
    for operator in (
        lambda: ad.gradient(b, f, x),
        lambda: ad.pullback(b, f, x)(mx.array(1.0, dtype=mx.float64)),
        lambda: ad.jacobian(b, f, x),
        lambda: ad.prepare_gradient(b, f, x)(x),
        lambda: ad.hessian(b, f, x),
        lambda: ad.hvp(b, f, x, mx.array(T)),
    ):
        with pytest.raises(AbstractDiffError, match="reverse mode needs custom_vjp"):
            operator()


@pytest.mark.parametrize("compile", [False, True])
def test_float32(compile):
    b, h, _ = made("vjp", compile)
    x, y = arrays(mx.float32)
    g = ad.gradient(b, lambda x: h(x, y)[0], x)
    assert g.dtype == mx.float32
    close(g, 3 * X * Y, 1e-6)
    close(ad.hessian(b, lambda x: h(x, y)[0], x), 3 * Y * np.eye(3), 1e-6)


# ---------------------------------------------------------------------------- stop_gradient
@pytest.mark.parametrize("compile", [False, True])
def test_stop_gradient_in_every_mode_and_order(compile):
    b = ad.backend("mlx", compile=compile)
    stop = ad.stop_gradient
    x, t = mx.array(X, dtype=mx.float64), mx.array(T, dtype=mx.float64)
    f = lambda x: (stop(x) * x).sum()  # noqa: E731
    close(f(x), X @ X)
    close(ad.gradient(b, f, x), X)
    close(ad.pushforward(b, f, x)(t), X @ T)
    # the gradient, stop(x), is a constant: the Hessian is 0 (jax's too), not I
    close(ad.hessian(b, f, x), np.zeros((3, 3)))
    close(mx.jvp(f, [x], [t])[1][0], X @ T)
    # sum(stop(x) x**2): gradient 2 stop(x) x, Hessian 2 diag(x) (6 diag(x) were stop ignored)
    g = lambda x: (stop(x) * x * x).sum()  # noqa: E731
    close(ad.gradient(b, g, x), 2 * X * X)
    close(ad.hessian(b, g, x), 2 * np.diag(X))
    close(ad.hvp(b, g, x, t), 2 * X * T)
    close(mx.jvp(mx.grad(g), [x], [t])[1][0], 2 * X * T)
    close(mx.grad(lambda x: mx.grad(g)(x) @ t)(x), 2 * X * T)

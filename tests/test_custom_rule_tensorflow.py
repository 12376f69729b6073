"""The TensorFlow adapter's ``custom_rule`` hook (ad.stop_gradient's rule included), with a stand-in rule.

``FakeRule`` (tests/_fake_rule.py, a stand-in for the core's ``Rule``) is for
``g(x, y) = (sum(x**2) * y,)`` with deliberately wrong rules: the backward gives d/dx = 3xy
(true: 2xy) and the jvp ``3y <x, tx> + sum(x**2) ty``, so a result that follows the rule
cannot come from differentiating the value; under the rule the Hessian in x is ``3y I``.
"""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._errors import AbstractDiffError

tf = pytest.importorskip("tensorflow")


from ._fake_rule import FakeRule  # noqa: E402

NO_VJP = "fake_g: reverse mode needs custom_vjp"
X = np.array([1.0, 2.0, -0.5])
T = np.array([0.3, -1.0, 2.0])
Y = 2.0


@pytest.fixture(params=[True, False], ids=["compiled", "eager"])
def b(request):
    return ad.backend("tensorflow", compile=request.param)


def _rule(kind):
    return FakeRule(tf, kind, sum_=tf.reduce_sum)


def _setup(b, kind, dtype=np.float64):
    rule = _rule(kind)
    h = b.adapter.custom_rule(rule)
    x, t = X.astype(dtype), T.astype(dtype)
    y = tf.constant(Y, dtype)
    return rule, h, x, t, y


def _close(got, want, dtype=np.float64):
    got = np.asarray(ad.to_numpy(got))
    assert got.dtype == np.dtype(dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _stack2(h, y):
    # a vector output: the rule at x and at 2x, whose rows are 3xy and 2 * 3(2x)y
    return lambda x: tf.stack([h(x, y)[0], h(2 * x, y)[0]])


# ------------------------------------------------------------------ value
@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_value_on_plain_tensors_runs_the_value_only(b, kind):
    rule, h, x, _, y = _setup(b, kind)
    (out,) = h(tf.constant(x), y)
    _close(out, np.sum(X**2) * Y)
    assert rule.calls == {"forward": 0, "backward": 0, "jvp": 0}  # no tape: no residuals


# ------------------------------------------------------------------ reverse mode, vjp rule
def test_native_tape_gradient_follows_the_rule(b):
    rule, h, x, _, y = _setup(b, "vjp")
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch([xt, y])
        (out,) = h(xt, y)
    gx, gy = tape.gradient(out, [xt, y])
    _close(gx, 3 * X * Y)  # the rule's 3xy, not the true 2xy
    _close(gy, np.sum(X**2))
    assert rule.calls["backward"] == 1


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_reverse_operators_follow_the_rule(b, dtype):
    _, h, x, _, y = _setup(b, "vjp", dtype)
    f = lambda x: h(x, y)[0]  # noqa: E731
    _close(ad.gradient(b, f, x), 3 * X * Y, dtype)
    _close(ad.pullback(b, f, x)(np.asarray(2.0, dtype)), 6 * X * Y, dtype)
    _close(ad.jacobian(b, _stack2(h, y), x), np.stack([3 * X * Y, 12 * X * Y]), dtype)
    _close(ad.prepare_gradient(b, f, x)(x), 3 * X * Y, dtype)


def test_batched_pullback_uses_the_rule(b):
    _, h, x, _, y = _setup(b, "vjp")
    dys = ad.pullback(b, _stack2(h, y), x)(ad.Batch(np.array([1.0, 0.0]), np.array([0.0, 1.0])))
    _close(dys.stack(), np.stack([3 * X * Y, 12 * X * Y]))


def test_user_tf_function_under_a_tape_and_tf_gradients_use_the_rule(b):
    # a tf.function called under an eager tape is differentiated symbolically (the graph's
    # gradient registry, not the tape), and so is tf.gradients
    _, h, x, _, y = _setup(b, "vjp")
    xt = tf.constant(x)
    f = tf.function(lambda x: h(x, y)[0])
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out = f(xt)
    _close(tape.gradient(out, xt), 3 * X * Y)
    _close(tf.function(lambda x: tf.gradients(h(x, y)[0], x)[0])(xt), 3 * X * Y)


# ------------------------------------------------------------------ forward mode
def test_pushforward_of_a_vjp_rule_transposes_the_backward(b):
    # ForwardAccumulator's double vjp: the linearisation the vjp rule gives, not the value's
    _, h, x, t, y = _setup(b, "vjp")
    _close(ad.pushforward(b, lambda x: h(x, y)[0], x)(t), 3 * Y * X @ T)
    dys = ad.pushforward(b, _stack2(h, y), x)(ad.Batch(t, 2 * t))
    _close(dys.stack(), [[3 * Y * X @ T, 12 * Y * X @ T], [6 * Y * X @ T, 24 * Y * X @ T]])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_pushforward_of_a_jvp_rule_uses_it(b, dtype):
    rule, h, x, t, y = _setup(b, "jvp", dtype)
    _close(ad.pushforward(b, lambda x: h(x, y)[0], x)(t), 3 * Y * X @ T, dtype)
    assert rule.calls["jvp"] >= 1
    dys = ad.pushforward(b, _stack2(h, y), x)(ad.Batch(t, 2 * t))  # pfor over the tangents
    _close(dys.stack(), [[3 * Y * X @ T, 12 * Y * X @ T], [6 * Y * X @ T, 24 * Y * X @ T]], dtype)


def test_native_accumulator_with_both_tangents_and_forward_over_forward():
    b = ad.backend("tensorflow")
    _, h, x, t, y = _setup(b, "jvp")
    xt, tt, ty = tf.constant(x), tf.constant(t), tf.constant(0.5, tf.float64)
    with tf.autodiff.ForwardAccumulator([xt, y], [tt, ty]) as acc:
        (out,) = h(xt, y)
    _close(acc.jvp(out), 3 * Y * X @ T + np.sum(X**2) * 0.5)
    with tf.autodiff.ForwardAccumulator(xt, tt) as outer:
        with tf.autodiff.ForwardAccumulator(xt, tt) as inner:
            (out,) = h(xt, y)
        d = inner.jvp(out)
    _close(outer.jvp(d), 3 * Y * T @ T)  # d/dx of the rule's 3y<x, t> along t


def test_a_jvp_rule_inside_a_user_tf_function_under_an_accumulator_refuses():
    # TensorFlow's forward mode through a tf.function call transposes the function's symbolic
    # gradient: a jvp rule is not reached there, and the refusal is the rule's, never a zero
    _, h, x, t, y = _setup(ad.backend("tensorflow"), "jvp")
    f, xt = tf.function(lambda x: h(x, y)[0]), tf.constant(x)
    with pytest.raises(AbstractDiffError, match=NO_VJP):
        with tf.autodiff.ForwardAccumulator(xt, tf.constant(t)):
            f(xt)


# ------------------------------------------------------------------ reverse mode, jvp rule
def test_reverse_mode_of_a_jvp_rule_raises_the_rules_error(b):
    _, h, x, t, y = _setup(b, "jvp")
    f = lambda x: h(x, y)[0]  # noqa: E731
    for call in (
        lambda: ad.gradient(b, f, x),
        lambda: ad.pullback(b, f, x)(np.asarray(1.0)),
        lambda: ad.jacobian(b, _stack2(h, y), x),
        lambda: ad.hessian(b, f, x),
        lambda: ad.hvp(b, f, x, t),
    ):
        with pytest.raises(AbstractDiffError, match=NO_VJP):
            call()


# ------------------------------------------------------------------ second order
def test_second_order_through_the_vjp_rule(b):
    # the residual sum(x**2) is recorded, so the derivative of the backward 3 ct x y is 3y I
    _, h, x, t, y = _setup(b, "vjp")
    f = lambda x: h(x, y)[0]  # noqa: E731
    _close(ad.hessian(b, f, x), 3 * Y * np.eye(3))
    _close(ad.hvp(b, f, x, t), 3 * Y * T)  # forward over reverse
    _close(ad.prepare_hessian(b, f, x)(x), 3 * Y * np.eye(3))
    _close(ad.pushforward(b, lambda x: ad.gradient(b, f, x), x)(t), 3 * Y * T)  # nested operators
    _close(ad.jacobian(b, lambda x: ad.gradient(b, f, x), x), 3 * Y * np.eye(3))


def test_second_order_through_a_user_tf_function():
    _, h, x, _, y = _setup(ad.backend("tensorflow"), "vjp")
    xt = tf.constant(x)
    f = tf.function(lambda x: h(x, y)[0])
    with tf.GradientTape() as outer:
        outer.watch(xt)
        with tf.GradientTape() as inner:
            inner.watch(xt)
            out = f(xt)
        g = inner.gradient(out, xt)
    _close(outer.jacobian(g, xt), 3 * Y * np.eye(3))


# ------------------------------------------------------------------ errors
def test_an_error_of_the_backward_reaches_the_user_as_itself(b):
    class Failing(FakeRule):
        def backward(self, residuals, cotangents):
            raise AbstractDiffError("fake_g: the backward gave a cotangent of shape (2,) for x of shape (3,)")

    h = b.adapter.custom_rule(Failing(tf, "vjp", sum_=tf.reduce_sum))
    y = tf.constant(Y, tf.float64)
    message = r"^fake_g: the backward gave a cotangent of shape \(2,\) for x of shape \(3,\)$"
    with pytest.raises(AbstractDiffError, match=message):
        ad.gradient(b, lambda x: h(x, y)[0], X)


# ------------------------------------------------------------------ stop_gradient
def test_stop_gradient_in_every_mode(b):
    # jax semantics: sg(x) has no derivative in any order, so the gradient of sum(sg(x) x),
    # sg(x), has none either: its Hessian is 0 (jax.hessian agrees), not I
    stop = ad.stop_gradient
    f = lambda x: tf.reduce_sum(stop(x) * x)  # noqa: E731
    _close(ad.gradient(b, f, X), X)
    _close(ad.pushforward(b, f, X)(T), X @ T)
    _close(ad.hessian(b, f, X), np.zeros((3, 3)))
    _close(ad.jacobian(b, lambda x: stop(x) * x, X), np.diag(X))
    # sum(sg(x) x**2): gradient 2 sg(x) x, Hessian 2 diag(x) (without the stop: 6 diag(x))
    g = lambda x: tf.reduce_sum(stop(x) * x**2)  # noqa: E731
    _close(ad.hessian(b, g, X), 2 * np.diag(X))
    _close(ad.hvp(b, g, X, T), 2 * X * T)
    _close(ad.pushforward(b, lambda x: ad.gradient(b, g, x), X)(T), 2 * X * T)  # forward over reverse

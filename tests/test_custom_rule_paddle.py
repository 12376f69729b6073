"""The paddle adapter's ``custom_rule`` hook (ad.stop_gradient's rule included) (PyLayer), checked with a
stand-in for the core's rule object whose derivatives are deliberately wrong: d/dx of
``sum(x**2) * y`` is ``3xy`` under the rule (``2xy`` truly), so a result shows which was used.

paddle's forward mode is the double-vjp trick: a custom_vjp rule gives it by differentiating its
backward, a custom_jvp rule through its jvp (a ``_Closure`` at the zero cotangent); reverse mode through a custom_jvp
rule refuses.  Second order runs the rule's backward again, recorded.
"""

from __future__ import annotations

import builtins
import warnings

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._errors import AbstractDiffError

pytest.importorskip("abstractdiff.adapters.paddle", reason="paddle is not installed")
import paddle  # noqa: E402  (after the adapter, which imports it safely after TensorFlow)
from abstractdiff.adapters.paddle import PaddleAdapter  # noqa: E402

from abstractdiff._backend import AdapterBackend  # noqa: E402

from ._fake_rule import FakeRule  # noqa: E402


class TwoOutputs(FakeRule):
    """``(sum(x**2) * y, x * y)``: the second output's rule is the true one."""

    def value(self, x, y):
        return (self.sum(x * x) * y, x * y)

    def forward(self, x, y):
        (s_y,), res = super().forward(x, y)
        return (s_y, x * y), res

    def backward(self, residuals, cotangents):
        x, y, _ = residuals
        gx, gy = super().backward(residuals, cotangents[:1])
        return gx + cotangents[1] * y, gy + self.sum(cotangents[1] * x)


RTOL = {"float32": 1e-5, "float64": 1e-12}
X0, Y0 = np.array([1.0, 2.0, 3.0]), 2.0


@pytest.fixture(scope="module")
def b():
    return ad.backend("paddle")


def close(actual, expected, dtype="float64"):
    tol = RTOL[dtype]
    np.testing.assert_allclose(np.asarray(ad.to_numpy(actual), np.float64), expected, rtol=tol, atol=tol)


def setup(b, kind, dtype="float64", rule_class=FakeRule):
    rule = rule_class(paddle, kind)
    h = b.adapter.custom_rule(rule)
    x, y = paddle.to_tensor(X0, dtype=dtype), paddle.to_tensor(Y0, dtype=dtype)
    return rule, h, x, y


def refused(kind):
    return pytest.raises(AbstractDiffError, match=f"reverse mode needs custom_{kind}")


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_value_is_the_rules_and_costs_no_pylayer(b, kind):
    rule, h, x, y = setup(b, kind)
    (out,) = h(x, y)
    close(out, 28.0)
    assert out.stop_gradient and rule.calls == {"forward": 0, "backward": 0, "jvp": 0}
    with paddle.no_grad():
        xs = x.detach()
        xs.stop_gradient = False
        assert h(xs, y)[0].stop_gradient


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_native_gradient_uses_the_rule(b, dtype):
    rule, h, x, y = setup(b, "vjp", dtype)
    x.stop_gradient = y.stop_gradient = False
    (out,) = h(x, y)
    gx, gy = paddle.grad([out], [x, y], create_graph=True)
    close(gx, 3 * Y0 * X0, dtype)  # the rule's 3xy, not 2xy
    close(gy, np.sum(X0**2), dtype)
    assert gx.dtype == x.dtype
    (hx,) = paddle.grad([gx.sum()], [x])  # the rule's backward differentiated: 3y per element
    close(hx, 3 * Y0 * np.ones(3), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reverse_operators_use_the_vjp_rule(b, dtype):
    rule, h, x, y = setup(b, "vjp", dtype)
    f = lambda x: h(x, y)[0]  # noqa: E731
    expected = 3 * Y0 * X0
    close(ad.gradient(b, f, x), expected, dtype)
    close(ad.pullback(b, f, x)(paddle.to_tensor(2.0, dtype=dtype)), 2 * expected, dtype)
    close(ad.jacobian(b, f, x), expected, dtype)
    prepared = ad.prepare_gradient(b, f, x)
    close(prepared(x), expected, dtype)
    close(prepared(x + 1), 3 * Y0 * (X0 + 1), dtype)
    close(ad.gradient(b, lambda y: h(x, y)[0], y), np.sum(X0**2), dtype)
    assert rule.calls["backward"] >= 6


def test_second_order_differentiates_the_backward(b):
    rule, h, x, y = setup(b, "vjp")
    f = lambda x: h(x, y)[0]  # noqa: E731
    close(ad.hessian(b, f, x), 3 * Y0 * np.eye(3))  # true Hessian: 2y I
    close(ad.hvp(b, f, x, paddle.to_tensor([1.0, 0.0, 2.0], dtype="float64")), 3 * Y0 * np.array([1.0, 0.0, 2.0]))
    # d/dy of the x-gradient 3xy is 3x: the residuals' dependence on y is recorded (y passed to
    # the inner operator: one closed over is a constant to it, a plain function's too)
    close(ad.jacobian(b, lambda y: ad.gradient(b, lambda x, y: h(x, y)[0], x, y), y), 3 * X0)
    # grad of grad, nested: d/dx sum(3xy) = 3y
    close(ad.gradient(b, lambda x: ad.gradient(b, f, x).sum(), x), 3 * Y0 * np.ones(3))


def test_forward_mode_of_a_vjp_rule_is_its_backward_differentiated(b):
    rule, h, x, y = setup(b, "vjp")
    t = paddle.to_tensor([1.0, 0.0, -1.0], dtype="float64")
    close(ad.pushforward(b, lambda x: h(x, y)[0], x)(t), 3 * Y0 * np.dot(X0, [1.0, 0.0, -1.0]))
    both = ad.pushforward(b, lambda xy: h(*xy)[0], (x, y))((t, paddle.to_tensor(1.0, dtype="float64")))
    close(both, 3 * Y0 * np.dot(X0, [1.0, 0.0, -1.0]) + np.sum(X0**2))


def test_jvp_rule_forward_mode_uses_it_and_reverse_mode_refuses(b):
    rule, h, x, y = setup(b, "jvp")
    f = lambda x: h(x, y)[0]  # noqa: E731
    t = paddle.to_tensor([1.0, 0.0, -1.0], dtype="float64")
    close(ad.pushforward(b, f, x)(t), 3 * Y0 * np.dot(X0, [1.0, 0.0, -1.0]))
    assert rule.calls["jvp"] == 1
    both = ad.pushforward(b, lambda xy: h(*xy)[0], (x, y))((t, paddle.to_tensor(1.0, dtype="float64")))
    close(both, 3 * Y0 * np.dot(X0, [1.0, 0.0, -1.0]) + np.sum(X0**2))
    # reverse over forward differentiates the jvp rule: d/dx <3y x, t> = 3y t
    close(ad.gradient(b, lambda x: ad.pushforward(b, f, x)(t), x), 3 * Y0 * np.array([1.0, 0.0, -1.0]))
    for reverse in (lambda: ad.gradient(b, f, x), lambda: ad.pullback(b, f, x)(1.0), lambda: ad.hessian(b, f, x),
                    lambda: ad.hvp(b, f, x, t), lambda: ad.prepare_gradient(b, f, x)(x)):
        with refused("vjp"):
            reverse()


def test_outputs_without_a_cotangent_get_zeros(b):
    rule, h, x, y = setup(b, "vjp", rule_class=TwoOutputs)
    close(ad.gradient(b, lambda x: h(x, y)[1].sum(), x), Y0 * np.ones(3))
    close(ad.gradient(b, lambda x: h(x, y)[0], x), 3 * Y0 * X0)
    close(ad.gradient(b, lambda x: h(x, y)[0] + h(x, y)[1].sum(), x), 3 * Y0 * X0 + Y0)


def test_mixed_dtypes_keep_theirs(b):
    rule = FakeRule(paddle, "vjp")
    h = b.adapter.custom_rule(rule)
    x, y = paddle.to_tensor(X0, dtype="float32"), paddle.to_tensor(Y0, dtype="float64")
    gx, gy = ad.gradient(b, lambda xy: h(*xy)[0].astype("float64"), (x, y))
    assert gx.dtype == paddle.float32 and gy.dtype == paddle.float64
    close(gx, 3 * Y0 * X0, "float32")
    close(gy, np.sum(X0**2))


def test_an_error_of_the_rule_reaches_the_user_as_itself(b):
    class Failing(FakeRule):
        def backward(self, residuals, cotangents):
            raise AbstractDiffError("fake_g: this cotangent is not allowed")

    h = b.adapter.custom_rule(Failing(paddle))
    x, y = paddle.to_tensor(X0), paddle.to_tensor(Y0, dtype="float64")
    with pytest.raises(AbstractDiffError, match="this cotangent is not allowed"):
        ad.gradient(b, lambda x: h(x, y)[0], x)
    with pytest.raises(AbstractDiffError, match="this cotangent is not allowed"):
        ad.pushforward(b, lambda x: h(x, y)[0], x)(x)


def rule_loss(x, h, y):  # in a file: paddle.jit.to_static converts Python source (not a lambda)
    return h(x, y)[0] * 1.0


def pair_loss(xy, h):
    return h(*xy)[0]


@pytest.fixture
def compiled(monkeypatch):
    # an array in builtins._ (an interactive display) makes to_static give up (see the adapter's tests)
    monkeypatch.setattr(builtins, "_", None, raising=False)
    return AdapterBackend(PaddleAdapter, compile=True)


@pytest.mark.filterwarnings("ignore:Tensor do not have 'place' interface:UserWarning")
def test_compiled_gradient_uses_the_rule_in_the_program(compiled):
    rule, h, x, y = setup(compiled, "vjp", "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no eager fallback
        close(ad.gradient(compiled, rule_loss, x, h, y), 3 * Y0 * X0, "float32")
        close(ad.gradient(compiled, rule_loss, x + 1, h, y), 3 * Y0 * (X0 + 1), "float32")
        gx, gy = ad.gradient(compiled, pair_loss, (x, y), h)
    assert compiled.adapter.trace_count >= 1
    close(gx, 3 * Y0 * X0, "float32")
    close(gy, np.sum(X0**2), "float32")
    close(ad.hessian(compiled, rule_loss, x, h, y), 3 * Y0 * np.eye(3), "float32")  # eagerly
    jvp_rule, jvp_h, _, _ = setup(compiled, "jvp", "float32")
    with refused("vjp"):
        ad.gradient(compiled, rule_loss, x, jvp_h, y)
    close(ad.pushforward(compiled, rule_loss, x, jvp_h, y)(paddle.ones([3])), 3 * Y0 * X0.sum(), "float32")


def test_stop_gradient(b):
    x = paddle.to_tensor(X0)
    sg = ad.stop_gradient
    f = lambda x: (sg(x) * x).sum()  # noqa: E731
    close(ad.gradient(b, f, x), X0)
    close(ad.pushforward(b, f, x)(paddle.ones([3], dtype="float64")), X0.sum())
    close(ad.hessian(b, f, x), np.zeros((3, 3)))  # the gradient is stop_gradient(x): no derivative
    close(ad.hessian(b, lambda x: (sg(x) * x * x).sum(), x), 2 * np.diag(X0))
    close(sg(x), X0)
    assert sg(2.0) == 2.0

"""The autograd adapter's ``custom_rule`` hook (ad.stop_gradient's rule included), checked without the core's
custom-derivative module: ``FakeRule`` stands in for its rule object.

FakeRule's ``g(x, y) = (sum(x**2) * y,)`` has deliberately wrong rules (d/dx is 3xy, not 2xy;
the Hessian in x is 3y I, not 2y I), so every check below tells the rule from autograd's own
derivative of the value.
"""

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._errors import AbstractDiffError

autograd = pytest.importorskip("autograd")
anp = pytest.importorskip("autograd.numpy")

# "Output seems independent of input" would mean a derivative that ignores the rule
pytestmark = pytest.mark.filterwarnings("error")

NO_VJP = "reverse mode needs custom_vjp"


from ._fake_rule import FakeRule  # noqa: E402


class TwoOutputs(FakeRule):
    """``(x * y, sum(x))`` with the true vjp; records the cotangents it was given."""

    def __init__(self):
        super().__init__(anp, "vjp")
        self.seen = []

    def value(self, x, y):
        return (x * y, anp.sum(x))

    def forward(self, x, y):
        return self.value(x, y), (x, y)

    def backward(self, residuals, cotangents):
        self.seen.append(cotangents)
        x, y = residuals
        c0, c1 = cotangents
        return (c0 * y + c1, anp.sum(c0 * x))


class Refusing(FakeRule):
    def backward(self, residuals, cotangents):
        raise AbstractDiffError("refused by the rule")


@pytest.fixture
def b():
    return ad.backend("autograd")


def setup(b, kind="vjp", dtype=np.float64):
    rule = FakeRule(anp, kind)
    x, y = np.array([1.0, 2.0, 3.0], dtype=dtype), np.array(2.0, dtype=dtype)
    return rule, b.adapter.custom_rule(rule), x, y


def test_value_on_plain_arrays_runs_the_value_only(b):
    rule, h, x, y = setup(b)
    (out,) = h(x, y)
    assert out == pytest.approx(28.0)
    assert rule.calls == {"forward": 0, "backward": 0, "jvp": 0}


def test_native_gradient_uses_the_rule(b):
    rule, h, x, y = setup(b)
    np.testing.assert_allclose(autograd.grad(lambda x: h(x, y)[0])(x), 3 * x * y)
    np.testing.assert_allclose(autograd.grad(lambda y: h(x, y)[0])(y), 14.0)
    # one trace, one forward: the residuals of the primitive's own forward are reused
    rule.calls["forward"] = 0
    autograd.grad(lambda x: h(x, y)[0])(x)
    assert rule.calls["forward"] == 1


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_native_forward_mode_uses_the_rule(b, kind):
    # custom_jvp: the jvp rule; custom_vjp: the transpose of the backward (also 3xy)
    rule, h, x, y = setup(b, kind)
    t = np.array([1.0, 0.0, 1.0])
    _, dy = autograd.make_jvp(lambda x: h(x, y)[0])(x)(t)
    assert dy == pytest.approx(3 * 2.0 * (1.0 + 3.0))


def test_reverse_operators_use_the_rule(b):
    _, h, x, y = setup(b)
    f = lambda x: h(x, y)[0]  # noqa: E731
    np.testing.assert_allclose(ad.gradient(b, f, x), 3 * x * y)
    np.testing.assert_allclose(ad.pullback(b, f, x)(np.array(2.0)), 2 * 3 * x * y)
    np.testing.assert_allclose(ad.prepare_gradient(b, f, x)(x), 3 * x * y)
    # J of h(x, y)[0] * x: x (3xy)^T + s I
    np.testing.assert_allclose(ad.jacobian(b, lambda x: h(x, y)[0] * x, x), np.outer(x, 3 * x * y) + 28.0 * np.eye(3))


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_pushforward_uses_the_rule(b, kind):
    _, h, x, y = setup(b, kind)
    t = np.array([1.0, 1.0, 1.0])
    assert ad.pushforward(b, lambda x: h(x, y)[0], x)(t) == pytest.approx(3 * 2.0 * 6.0)


@pytest.mark.parametrize("backend", [{}, {"chunk_size": 2}], ids=["autograd_hessian", "core_chunks"])
def test_hessian_differentiates_the_backward(b, backend):
    _, h, x, y = setup(b)
    b = ad.backend("autograd", **backend)
    np.testing.assert_allclose(ad.hessian(b, lambda x: h(x, y)[0], x), 3 * 2.0 * np.eye(3))
    v = np.array([1.0, -1.0, 2.0])
    np.testing.assert_allclose(ad.hvp(b, lambda x: h(x, y)[0], x, v), 6.0 * v)


def test_second_order_in_y_through_the_residuals(b):
    # d/dy of the x-cotangent 3xy is 3x: the residual y is recorded for the outer trace
    _, h, x, y = setup(b)
    mixed = autograd.grad(lambda y: anp.sum(autograd.grad(lambda x: h(x, y)[0])(x)))(y)
    assert mixed == pytest.approx(3 * 6.0)


def test_forward_over_reverse(b):
    _, h, x, y = setup(b)
    v = np.array([1.0, 0.0, 2.0])
    hv = ad.hvp(ad.SecondOrder("autograd", "autograd"), lambda x: h(x, y)[0], x, v)
    np.testing.assert_allclose(hv, 6.0 * v)


def test_forward_over_forward_with_the_jvp_rule(b):
    _, h, x, y = setup(b, "jvp")
    e = np.array([1.0, 0.0, 0.0])
    inner = lambda x: autograd.make_jvp(lambda x: h(x, y)[0])(x)(e)[1]  # noqa: E731
    assert autograd.make_jvp(inner)(x)(e)[1] == pytest.approx(6.0)


def test_float32(b):
    _, h, x, y = setup(b, dtype=np.float32)
    g = ad.gradient(b, lambda x: h(x, y)[0], x)
    assert g.dtype == np.float32
    np.testing.assert_allclose(g, 3 * x * y, rtol=1e-6)
    np.testing.assert_allclose(ad.hessian(b, lambda x: h(x, y)[0], x), 6.0 * np.eye(3), rtol=1e-6)


@pytest.mark.parametrize(
    "op",
    [
        lambda b, f, x: ad.gradient(b, f, x),
        lambda b, f, x: ad.pullback(b, f, x)(np.array(1.0)),
        lambda b, f, x: ad.jacobian(b, f, x),
        lambda b, f, x: ad.hessian(b, f, x),
        lambda b, f, x: ad.hvp(b, f, x, x),
        lambda b, f, x: autograd.grad(f)(x),
    ],
    ids=["gradient", "pullback", "jacobian", "hessian", "hvp", "native_grad"],
)
def test_jvp_rule_refuses_reverse_mode(b, op):
    _, h, x, y = setup(b, "jvp")
    with pytest.raises(AbstractDiffError, match=NO_VJP):
        op(b, lambda x: h(x, y)[0], x)


def test_unused_outputs_get_zero_cotangents(b):
    rule = TwoOutputs()
    h = b.adapter.custom_rule(rule)
    x, y = np.array([1.0, 2.0]), np.array(3.0)
    np.testing.assert_allclose(ad.gradient(b, lambda x: h(x, y)[1], x), [1.0, 1.0])
    np.testing.assert_allclose(ad.gradient(b, lambda x: anp.sum(h(x, y)[0]), x), [3.0, 3.0])
    np.testing.assert_allclose(rule.seen[0][0], [0.0, 0.0])  # output 0 got no cotangent
    assert rule.seen[1][1] == 0.0
    # the transposed backward sums both outputs' tangents
    _, dy = autograd.make_jvp(lambda x: h(x, y)[0] + h(x, y)[1])(x)(np.array([1.0, -1.0]))
    np.testing.assert_allclose(dy, [3.0, -3.0])


def test_errors_of_the_rule_reach_the_user(b):
    h = b.adapter.custom_rule(Refusing(anp))
    x, y = np.array([1.0, 2.0]), np.array(3.0)
    with pytest.raises(AbstractDiffError, match="refused by the rule"):
        ad.gradient(b, lambda x: h(x, y)[0], x)
    with pytest.raises(AbstractDiffError, match="refused by the rule"):
        ad.pushforward(b, lambda x: h(x, y)[0], x)(x)


def test_stop_gradient(b):
    sg = ad.stop_gradient
    x = np.array([1.0, 2.0, 3.0])
    assert sg(x) is x
    np.testing.assert_allclose(ad.gradient(b, lambda x: anp.sum(sg(x) * x), x), x)
    np.testing.assert_allclose(ad.pushforward(b, lambda x: sg(x) * x, x)(np.ones(3)), x)
    # the gradient sg(x) is constant: a zero Hessian; 0.5 sum(sg(x) x^2) has Hessian diag(x)
    np.testing.assert_allclose(ad.hessian(b, lambda x: anp.sum(sg(x) * x), x), np.zeros((3, 3)))
    np.testing.assert_allclose(ad.hessian(b, lambda x: 0.5 * anp.sum(sg(x) * x * x), x), np.diag(x))
    np.testing.assert_allclose(ad.hvp(b, lambda x: 0.5 * anp.sum(sg(x) * x * x), x, np.ones(3)), x)
    # forward over forward
    e = np.array([1.0, 0.0, 0.0])
    inner = lambda x: autograd.make_jvp(lambda x: anp.sum(sg(x) * x * x))(x)(e)[1]  # noqa: E731
    assert autograd.make_jvp(inner)(x)(e)[1] == pytest.approx(2.0)

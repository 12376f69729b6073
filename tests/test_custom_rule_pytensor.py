"""The PyTensor adapter's ``custom_rule`` hook (ad.stop_gradient's rule included), checked without the core's
custom-derivative module: ``FakeRule`` stands in for its rule object.

FakeRule's ``g(x, y) = (sum(x**2) * y,)`` has deliberately wrong rules (d/dx is 3xy, not 2xy;
the Hessian in x is 3y I, not 2y I), so every check below tells the rule from PyTensor's own
derivative of the value.  The rule's functions are written with ``pytensor.tensor``: they build
graphs on the symbolic inputs PyTensor traces with.
"""

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._errors import AbstractDiffError

pytest.importorskip("pytensor", reason="PyTensor is not installed (pip install 'abstractdiff[pytensor]')")
import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.gradient import NullTypeGradError, hessian, pushforward  # noqa: E402

# a deprecation or an "input not part of the graph" warning would mean a derivative that ignores the rule
pytestmark = pytest.mark.filterwarnings("error")

KINDS = ("vjp", "jvp")


from ._fake_rule import FakeRule  # noqa: E402

X = np.array([1.0, 2.0, 3.0])
Y = np.array(2.0)
E0 = np.array([1.0, 0.0, 0.0])
RULE_GRAD = 3 * X * Y  # the rule's d/dx; the value's own would be 2 * X * Y
RULE_HESSIAN = 3 * Y * np.eye(3)


@pytest.fixture
def b():
    return ad.backend("pytensor", mode="FAST_COMPILE")


def _rule(b, kind):
    rule = FakeRule(pt, kind)
    return rule, b.adapter.custom_rule(rule)


@pytest.mark.parametrize("kind", KINDS)
def test_value_on_numpy_and_symbolic_inputs(b, kind):
    _, h = _rule(b, kind)
    (out,) = h(X, Y)  # plain arrays: numbers back, no graph
    assert isinstance(out, np.ndarray) and out == pytest.approx(28.0)
    x = pt.dvector("x")
    (z,) = h(x, Y)  # a symbolic input, a numpy one closed over
    assert z.eval({x: X}) == pytest.approx(28.0)


@pytest.mark.parametrize("kind", KINDS)
def test_native_derivatives_use_the_rule(b, kind):
    rule, h = _rule(b, kind)
    x, y, t = pt.dvector("x"), pt.dscalar("y"), pt.dvector("t")
    (z,) = h(x, y)
    gx = pytensor.grad(z, x)
    outs = [gx, pytensor.grad(z, y), hessian(z, x)]
    for use_op in (False, True):  # forward mode by two pullbacks, and by the Op's R-op
        outs += [pushforward(z, x, t, use_op_pushforward=use_op), pushforward(z, y, t.sum(), use_op_pushforward=use_op),
                 pushforward(gx, x, t, use_op_pushforward=use_op)]  # forward over reverse
    gx_, gy_, hx, *pf = pytensor.function([x, y, t], outs, mode="FAST_COMPILE")(X, Y, E0)
    np.testing.assert_allclose(gx_, RULE_GRAD)
    assert gy_ == pytest.approx(14.0)
    np.testing.assert_allclose(hx, RULE_HESSIAN)
    for jx, jy, hv in (pf[:3], pf[3:]):
        assert jx == pytest.approx(6.0) and jy == pytest.approx(14.0)
        np.testing.assert_allclose(hv, RULE_HESSIAN @ E0)
    assert rule.calls["backward" if kind == "vjp" else "jvp"] > 0  # the other rule is never asked
    assert rule.calls["jvp" if kind == "vjp" else "backward"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_operators_use_the_rule(b, kind):
    # kind "jvp" in reverse mode: the transposed jvp rule; kind "vjp" in forward mode: two vjps
    _, h = _rule(b, kind)

    def f(x):
        return h(x, Y)[0]

    np.testing.assert_allclose(ad.gradient(b, f, X), RULE_GRAD)
    np.testing.assert_allclose(ad.pullback(b, f, X)(np.array(2.0)), 2 * RULE_GRAD)
    np.testing.assert_allclose(ad.jacobian(b, lambda x: h(x, Y)[0] * x, X), 28.0 * np.eye(3) + np.outer(X, RULE_GRAD))
    assert ad.pushforward(b, f, X)(E0) == pytest.approx(RULE_GRAD @ E0)
    np.testing.assert_allclose(ad.prepare_gradient(b, f, X)(X + 1), 3 * (X + 1) * Y)
    np.testing.assert_allclose(ad.hessian(b, f, X), RULE_HESSIAN)
    np.testing.assert_allclose(ad.hvp(b, f, X, E0), RULE_HESSIAN @ E0)
    # y as data (a placeholder of its own), and differentiated
    np.testing.assert_allclose(ad.gradient(b, lambda x, y: h(x, y)[0], X, Y), RULE_GRAD)
    assert ad.gradient(b, lambda y, x: h(x, y)[0], Y, X) == pytest.approx(14.0)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_nested_and_implicit(kind):
    b = ad.backend("pytensor", mode="FAST_COMPILE", chunk_size=2)  # Jacobians from chunks of pullbacks
    _, h = _rule(b, kind)
    np.testing.assert_allclose(ad.jacobian(b, lambda x: h(x, Y)[0] * x, X), 28.0 * np.eye(3) + np.outer(X, RULE_GRAD))
    np.testing.assert_allclose(ad.hessian(b, lambda x: h(x, Y)[0], X), RULE_HESSIAN)
    # an operator inside a function PyTensor traces: its graph built into the outer one
    inner = ad.backend("pytensor", mode="FAST_COMPILE")
    np.testing.assert_allclose(ad.gradient(inner, lambda x: ad.gradient(inner, lambda u: h(u, Y)[0], x).sum(), X),
                               RULE_HESSIAN.sum(axis=0))
    w = ad.variables(X, "pytensor")  # a shared variable
    grads = ad.gradient(ad.Implicit("pytensor"), lambda: h(w, Y)[0], ad.Params([w]))
    np.testing.assert_allclose(grads[w], RULE_GRAD)


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_default_mode_and_float32(kind):
    b = ad.backend("pytensor")  # PyTensor's configured default (Numba in PyTensor 3): the inlined graph compiled
    _, h = _rule(b, kind)
    np.testing.assert_allclose(ad.gradient(b, lambda x: h(x, Y)[0], X), RULE_GRAD)
    np.testing.assert_allclose(ad.hessian(b, lambda x: h(x, Y)[0], X), RULE_HESSIAN)
    x32, y32 = X.astype(np.float32), Y.astype(np.float32)
    g = ad.gradient(b, lambda x: h(x, y32)[0], x32)
    assert g.dtype == np.float32
    np.testing.assert_allclose(g, 3 * x32 * y32, rtol=1e-6)
    assert ad.pushforward(b, lambda x: h(x, y32)[0], x32)(E0.astype(np.float32)) == pytest.approx(6.0)


class _TwoOutputs:
    name, has_vjp, has_jvp, stops_gradient, takes_derivatives = "two", True, False, False, False

    def value(self, x):
        return (x * 2, pt.sum(x))

    def forward(self, x):
        return self.value(x), ()

    def backward(self, residuals, cotangents):
        return (5 * cotangents[0] + 7 * cotangents[1],)

    def with_inputs(self, inputs):
        return self


def test_an_output_without_cotangent_gets_zeros(b):
    h = b.adapter.custom_rule(_TwoOutputs())
    np.testing.assert_allclose(ad.gradient(b, lambda x: h(x)[0].sum(), X), [5.0] * 3)
    np.testing.assert_allclose(ad.gradient(b, lambda x: h(x)[1], X), [7.0] * 3)
    np.testing.assert_allclose(ad.pushforward(b, lambda x: h(x)[0], X)(E0), 5 * E0)


def test_an_error_of_the_rule_reaches_the_caller(b):
    class Refuses(_TwoOutputs):
        def backward(self, residuals, cotangents):
            raise AbstractDiffError("two: refused")

    h = b.adapter.custom_rule(Refuses())
    with pytest.raises(AbstractDiffError, match="two: refused") as info:
        ad.gradient(b, lambda x: h(x)[1], X)
    assert type(info.value) is AbstractDiffError


def test_a_value_the_rule_closes_over_has_no_derivative(b):
    s = pytensor.shared(np.array(3.0))

    class Reads(_TwoOutputs):
        def value(self, x):
            return (pt.sum(x * s),)

        def backward(self, residuals, cotangents):
            return (5 * cotangents[0] * pt.ones((3,)),)

    h = b.adapter.custom_rule(Reads())
    np.testing.assert_allclose(ad.gradient(b, lambda x: h(x)[0], X), [5.0] * 3)  # the rule's, s left alone
    with pytest.raises(NullTypeGradError, match="no derivative for"):  # never a silent zero for s
        ad.gradient(ad.Implicit("pytensor", mode="FAST_COMPILE"), lambda: h(pt.as_tensor(X))[0], ad.Params([s]))
    x = pt.dvector("x")
    (z,) = h(x)
    assert pushforward(z, x, pt.ones(3), use_op_pushforward=True).eval({x: X}, on_unused_input="ignore") == 15.0
    for use_op in (False, True):  # the R-op too: PyTensor's gives s zeros when not asked, refused when asked
        with pytest.raises(NullTypeGradError, match="no derivative for"):
            pushforward(z, s, pt.as_tensor(1.0), use_op_pushforward=use_op)


# ------------------------------------------------------------------ stop_gradient
def test_stop_gradient_in_every_mode_and_order(b):
    sg = ad.stop_gradient

    def f(x):
        return (sg(x) * x).sum()

    np.testing.assert_allclose(ad.gradient(b, f, X), X)
    assert ad.pushforward(b, f, X)(E0) == pytest.approx(X @ E0)
    np.testing.assert_allclose(ad.hessian(b, f, X), np.zeros((3, 3)))  # jax's: the gradient sg(x) is stopped too
    np.testing.assert_allclose(ad.gradient(b, lambda x: sg(x).sum(), X), np.zeros(3))
    assert sg(X) is X  # numpy arrays have no derivative to stop


def test_stop_gradient_r_op_keeps_shape_and_dtype(b):
    # PyTensor's zero_grad gives a float64 zeros(1) as its R-op; disconnected_grad's has none
    sg = ad.stop_gradient
    x, t = pt.fscalar("x"), pt.fscalar("t")
    for use_op in (False, True):
        jv = pushforward(sg(x) * x, x, t, use_op_pushforward=use_op, disconnected_outputs="ignore")
        assert jv.type.shape == () and jv.dtype == "float32"
        assert jv.eval({x: np.float32(2.0), t: np.float32(1.0)}) == pytest.approx(2.0)
    gx = pytensor.grad((sg(x) * x), x)
    assert pytensor.grad(gx, x, disconnected_inputs="ignore").eval({x: np.float32(2.0)}, on_unused_input="ignore") == 0


def test_through_the_core_when_it_is_there(b):
    # ad.stop_gradient reaches the hook as a rule with stops_gradient set: disconnected_grad per input
    pytest.importorskip("abstractdiff._custom")

    @ad.custom_jvp
    def g(x, y):
        return pt.sum(x * x) * y

    @g.defjvp
    def _(primals, tangents):
        (x, y), (tx, ty) = primals, tangents
        return g(x, y), 3 * y * pt.sum(x * tx) + pt.sum(x * x) * ty

    np.testing.assert_allclose(ad.gradient(b, lambda x: g(x, Y), X), RULE_GRAD)
    np.testing.assert_allclose(ad.hessian(b, lambda x: g(x, Y), X), RULE_HESSIAN)

    def f(x):
        return (ad.stop_gradient(x) * x).sum()

    np.testing.assert_allclose(ad.gradient(b, f, X), X)
    assert ad.pushforward(b, f, X)(E0) == pytest.approx(1.0)
    np.testing.assert_allclose(ad.hessian(b, f, X), np.zeros((3, 3)))

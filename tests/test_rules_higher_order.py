"""Second and third order through ``ad.custom_vjp`` / ``ad.custom_jvp`` rules on torch, mlx and
paddle, ``ad.scan`` stacking a Python float with arrays, and rules that return numpy arrays
(issue 45, items 4 to 6).

Oracles are closed forms of what the rule says, which is jax's semantics (checked against
``jax.custom_vjp``/``jax.custom_jvp`` when the tests were written): a second derivative
differentiates ``bwd`` or the jvp rule.  The rules are deliberately not ``f``'s derivative
(``sin`` with the rule ``2 cos``), so a result that differentiates ``f`` itself is caught.
Every case must be right, or raise ``ad.CustomRuleError``: never a zero.
"""

from __future__ import annotations

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad

#: The backends whose adapters these items are about, where installed.
RULE_BACKENDS = [b for b in ("torch", "mlx", "paddle") if b in ad.available_backends()]
X0 = np.array(0.7)
XV = np.array([0.7, -0.4, 1.3])
W = np.array([1.0, 2.0, -0.5])
V = np.array([0.3, -1.0, 0.6])
C = np.array([1.0, 2.0, 3.0])


# ------------------------------------------------------------------ the rules
def vjp_rule():
    """``sin`` whose reverse rule says its derivative is ``2 cos``."""
    g = ad.custom_vjp(lambda x: anp.sin(x))
    g.defvjp(lambda x: (anp.sin(x), x), lambda r, ct: (2 * anp.cos(r) * ct,))
    return g


def jvp_rule():
    """``sin`` whose forward rule says its derivative is ``2 cos``."""
    g = ad.custom_jvp(lambda x: anp.sin(x))
    g.defjvp(lambda p, t: (anp.sin(p[0]), 2 * anp.cos(p[0]) * t[0]))
    return g


def nested_jvp_rule():
    """The same, its jvp rule calling another custom function (as custom_root's rules do)."""
    inner = ad.custom_jvp(lambda x: 2 * anp.cos(x))
    inner.defjvp(lambda p, t: (2 * anp.cos(p[0]), -2 * anp.sin(p[0]) * t[0]))
    g = ad.custom_jvp(lambda x: anp.sin(x))
    g.defjvp(lambda p, t: (anp.sin(p[0]), inner(p[0]) * t[0]))
    return g


RULES = {"custom_vjp": vjp_rule, "custom_jvp": jvp_rule, "nested custom_jvp": nested_jvp_rule}
# the rule's derivatives: d/dx of 2 cos, and again
D1, D2, D3 = (lambda x: 2 * np.cos(x)), (lambda x: -2 * np.sin(x)), (lambda x: -2 * np.cos(x))


def modes(b: str, g):
    """``{mode: (thunk, expected)}``: second and third order in every mode, through ``g``."""
    arr = ad.backend(b).asarray
    S = lambda x: 2.0 * g(x)  # noqa: E731  a scalar of a scalar
    F = lambda x, w: anp.sum(g(x) * w)  # noqa: E731  a scalar of a vector
    G = lambda x: g(x * arr(C))  # noqa: E731  a vector of a scalar (a forward Jacobian)
    so = ad.SecondOrder(b, b)
    H = np.diag(W * D2(XV))
    return {
        "second_derivative": (lambda: ad.second_derivative(b, S, X0), 2 * D2(X0)),
        "derivative of derivative": (lambda: ad.derivative(b, lambda x: ad.derivative(b, S, x), X0), 2 * D2(X0)),
        "SecondOrder second_derivative": (lambda: ad.second_derivative(so, S, X0), 2 * D2(X0)),
        "hvp": (lambda: ad.hvp(b, F, XV, V, W), H @ V),
        "hessian": (lambda: ad.hessian(b, F, XV, W), H),
        "SecondOrder hvp": (lambda: ad.hvp(so, F, XV, V, W), H @ V),
        "gradient of gradient": (
            lambda: ad.gradient(b, lambda x, w: anp.sum(ad.gradient(b, F, x, w) * arr(V)), XV, W), H @ V),
        "derivative of jacobian": (lambda: ad.derivative(b, lambda x: ad.jacobian(b, G, x), X0), C**2 * D2(X0 * C)),
        "third: derivative of second_derivative": (
            lambda: ad.derivative(b, lambda x: ad.second_derivative(b, S, x), X0), 2 * D3(X0)),
        "third: jacobian of second_derivative": (
            lambda: ad.jacobian(b, lambda x: ad.second_derivative(b, G, x), X0), C**3 * D3(X0 * C)),
        "third: gradient of hvp": (
            lambda: ad.gradient(b, lambda x, w: anp.sum(ad.hvp(b, F, x, arr(V), w)), XV, W), W * D3(XV) * V),
    }


def numpy_of(a) -> np.ndarray:
    return np.asarray(a.tolist() if hasattr(a, "tolist") else a, dtype=float)


# ------------------------------------------------------------------ item 4
@pytest.mark.parametrize("b", RULE_BACKENDS)
def test_second_derivative_through_an_exact_custom_jvp(b):
    # the reproducer: torch gave 0.0 (torch.func runs an autograd.Function's jvp with
    # the outer forward level switched off)
    cube = ad.custom_jvp(lambda x: x**3)
    cube.defjvp(lambda p, t: (cube(p[0]), 3 * p[0] ** 2 * t[0]))
    assert float(ad.second_derivative(b, cube, np.array(1.5))) == pytest.approx(9.0)
    # and the third, a derivative of that (written as a product: paddle 3.3's kernels of pow have
    # no third derivative in this nesting, with or without a rule)
    product = ad.custom_jvp(lambda x: x * x * x)
    product.defjvp(lambda p, t: (product(p[0]), 3 * p[0] * p[0] * t[0]))
    third = ad.derivative(b, lambda x: ad.second_derivative(b, product, x), np.array(1.5))
    assert float(third) == pytest.approx(6.0)


@pytest.mark.parametrize("b", RULE_BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_every_mode_through_a_rule_is_right_or_refused(b, rule):
    wrong, refused = [], []
    for mode, (thunk, want) in modes(b, RULES[rule]()).items():
        try:
            got = numpy_of(thunk())
        except ad.CustomRuleError:
            refused.append(mode)
            continue
        if got.shape != np.shape(want) or not np.allclose(got, want, rtol=1e-4, atol=1e-6):
            wrong.append(f"{mode}: {got.tolist()}, expected {np.round(want, 6).tolist()}")
    assert not wrong, f"{b}, {rule}: silently wrong: {wrong}"
    # the modes each rule has are used, never refused: forward over forward through a jvp rule
    # on every backend, reverse over reverse through a vjp rule, and forward over anything
    # through a vjp rule where the library derives forward mode from it (mlx, paddle)
    forward = {"second_derivative", "derivative of derivative", "SecondOrder second_derivative",
               "third: derivative of second_derivative"}
    reverse = {"hvp", "hessian", "gradient of gradient", "third: gradient of hvp"}
    must = forward if rule != "custom_vjp" else reverse | (forward if b in ("mlx", "paddle") else set())
    assert not must & set(refused), f"{b}, {rule}: refused {sorted(must & set(refused))}"


def test_torch_refuses_a_jvp_rule_where_a_vmap_stands_between_two_forward_levels():
    pytest.importorskip("torch")
    g = jvp_rule()

    def G(x):
        return g(x * ad.backend("torch").asarray(C))

    # a forward Jacobian (a torch.func.vmap of jvp) inside two forward-mode derivatives: torch.func
    # would run the rule with the outer tangents off (the result was silently zero)
    with pytest.raises(ad.CustomRuleError, match="forward mode inside another forward-mode derivative"):
        ad.derivative("torch", lambda x: ad.derivative("torch", lambda z: ad.jacobian("torch", G, z), x), X0)


def test_torch_vjp_rule_under_nested_torch_func_levels():
    pytest.importorskip("torch")
    g = vjp_rule()

    def G(x):
        return g(x * ad.backend("torch").asarray(C))

    # the Jacobian of a Jacobian: the outer level's context had no residuals (a TypeError on None)
    got = numpy_of(ad.jacobian("torch", lambda x: ad.jacobian("torch", G, x), X0))
    np.testing.assert_allclose(got, C**2 * D2(X0 * C), rtol=1e-6)
    # forward mode through a custom_vjp inside a vmap: the rule's refusal, not torch's AssertionError
    with pytest.raises(ad.CustomRuleError, match="no forward-mode rule"):
        ad.derivative("torch", lambda x: ad.jacobian("torch", G, x), X0)


# ------------------------------------------------------------------ item 5
SCAN_BACKENDS = [b for b in ad.available_backends() if b != "implicit"]
XS = np.array([1.0, 2.0, 3.0, 4.0])


def recorded(a, xs=XS):
    # ys records the incoming carry, from 0.0: step 0's y is a Python float, the others arrays
    carry, ys = ad.scan(lambda c, x: (c + a * x, c), 0.0, xs)
    # carry = 10 a and ys_i = a * (x_0 + ... + x_{i-1}), whose squares sum to 46 a^2: mlx and
    # paddle gave the carry's 10 alone (ys stacked by numpy, as constants), torch raised
    return carry + anp.sum(ys * ys)


@pytest.mark.parametrize("b", SCAN_BACKENDS)
def test_scan_stacks_a_python_float_with_arrays(b):
    a = np.array(1.7)
    rtol = 1e-5 if b != "finite_differences" else 1e-6
    assert float(ad.gradient(b, recorded, a)) == pytest.approx(10 + 92 * 1.7, rel=rtol)
    assert float(ad.derivative(b, recorded, a)) == pytest.approx(10 + 92 * 1.7, rel=rtol)


@pytest.mark.parametrize("b", RULE_BACKENDS)
def test_scan_stacks_a_python_float_with_arrays_of_xs(b):
    # xs a differentiated argument too: d/dxs_j of sum_i (a * prefix_i)^2, second order in a
    def f(a, xs):
        return recorded(a, xs)

    a = 1.7
    prefix = np.concatenate([[0.0], np.cumsum(XS)[:-1]])
    want_xs = np.array([a + 2 * a**2 * prefix[j + 1:].sum() for j in range(4)])
    np.testing.assert_allclose(numpy_of(ad.gradient(b, lambda x: f(a, x), XS)), want_xs, rtol=1e-6)
    assert float(ad.second_derivative(b, f, np.array(a), XS)) == pytest.approx(92.0)
    # float32: the float is made the arrays' dtype, not float64 (or torch's default)
    ys = ad.scan(lambda c, x: (c + x, c), 0.0, ad.backend(b).asarray(XS.astype(np.float32)))[1]
    assert ad.backend(b).to_numpy(ys).dtype == np.float32


# ------------------------------------------------------------------ item 6
def numpy_bwd():
    """A rule whose bwd computes in numpy and returns numpy cotangents."""
    g = ad.custom_vjp(lambda x: anp.sin(x))
    g.defvjp(lambda x: (anp.sin(x), x), lambda r, ct: (2 * np.cos(ad.to_numpy(r)) * ad.to_numpy(ct),))
    return g


def numpy_constant_bwd():
    g = ad.custom_vjp(lambda x: anp.sin(x))
    g.defvjp(lambda x: (anp.sin(x), x), lambda r, ct: (np.full(XV.shape, 3.0),))
    return g


def numpy_jvp():
    g = ad.custom_jvp(lambda x: anp.sin(x))
    g.defjvp(lambda p, t: (anp.sin(p[0]), 2 * np.cos(ad.to_numpy(p[0])) * ad.to_numpy(t[0])))
    return g


@pytest.mark.parametrize("b", RULE_BACKENDS)
def test_a_rule_returning_numpy_is_refused(b):
    # mlx silently ignored such a bwd (the gradient was the cotangent, 1.0); torch and paddle raised
    # their own errors.  Converted, the numpy value would be a constant, and a second derivative
    # would silently drop whatever it was computed from: refused in every mode.
    for g in (numpy_bwd(), numpy_constant_bwd()):
        def f(x, g=g):
            return anp.sum(g(x))

        with pytest.raises(ad.CustomRuleError, match="numpy"):
            ad.gradient(b, f, XV)
        with pytest.raises(ad.CustomRuleError, match="numpy"):
            ad.hvp(b, f, XV, V)
    h = numpy_jvp()
    with pytest.raises(ad.CustomRuleError, match="numpy"):
        ad.derivative(b, lambda s: anp.sum(h(s * ad.backend(b).asarray(XV))), np.array(1.0))

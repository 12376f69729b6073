"""Derivatives of derivatives on torch and mlx where an inner transform meets arrays of an
outer one (issue 45): against closed forms and jax.

* torch: a custom rule whose backward takes a pullback in every input (custom_root's) under
  torch.func's Hessian met the wrappers of a torch.func level that had ended (an INTERNAL
  ASSERT in torch's engine).
* mlx: MLX 0.32's inner transforms clear the "traced" mark of the outer arrays they close over;
  the adapter then evaluated them (detached from the outer graph) or differentiated a value it
  had computed before: derivatives through an operator's non-differentiated arguments, and
  third derivatives through a rule that takes derivatives, came out silently 0.
"""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._custom import current_backend
from abstractdiff._registry import unavailable_reason


def _backend(name: str) -> ad.Backend:
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return ad.backend(name)


# ------------------------------------------------------------------------------- torch
def test_torch_hessian_through_a_rule_whose_backward_takes_a_pullback_in_every_input() -> None:
    torch = pytest.importorskip("torch")
    b = _backend("torch")

    def g(x, w):
        return torch.sin(x * w)

    @ad.custom_vjp
    def f(x, w):
        return g(x, w)

    f.defvjp(lambda x, w: (f(x, w), (x, w)),
             lambda res, ct: ad.pullback(current_backend(), lambda z: g(*z), res)(ct))
    x = torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    got = ad.hessian(b, lambda z: torch.sum(f(*z) ** 2 * z[1]), (x, w))
    want = torch.func.hessian(lambda x, w: torch.sum(g(x, w) ** 2 * w), argnums=(0, 1))(x, w)
    for got_row, want_row in zip(got, want):
        for a, e in zip(got_row, want_row):
            torch.testing.assert_close(a, e)


# --------------------------------------------------------------------------------- mlx
def _closed_form_grad(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    # d/dw sum_i d/dx_i sum_j sin(w_j x_j) w_j = d/dw sum_i cos(w_i x_i) w_i^2
    return -np.sin(w * x) * x * w**2 + 2 * w * np.cos(w * x)


def test_mlx_gradient_through_a_pushforward_in_its_data() -> None:
    """mx.grad and ad.gradient of ad.pushforward in a non-differentiated argument (was 0)."""
    mx = pytest.importorskip("mlx.core")
    b = _backend("mlx")
    x, w = np.array([1.0, 2.0]), np.array([0.5, -1.0])
    xm, wm = mx.array(x), mx.array(w)

    def f(x, w):
        return mx.sum(mx.sin(w * x) * w)

    def inner(w):
        return mx.sum(ad.pushforward(b, f, xm, w)(mx.ones_like(xm)))

    want = _closed_form_grad(w, x)
    np.testing.assert_allclose(np.array(mx.grad(inner)(wm)), want, rtol=1e-5)
    np.testing.assert_allclose(np.array(ad.gradient(b, inner, wm)), want, rtol=1e-5)


def test_mlx_derivative_of_a_derivative_of_a_closure() -> None:
    """d/ds d/dt sum sin(w t s) s, the inner function closing over s (was 0)."""
    mx = pytest.importorskip("mlx.core")
    b = _backend("mlx")
    w, s, t = np.array([0.5, -1.0]), 0.7, 1.5
    wm = mx.array(w)
    got = ad.derivative(b, lambda s: ad.derivative(b, lambda t: mx.sum(mx.sin(wm * t * s) * s), mx.array(t)),
                        mx.array(s))
    # d/dt = sum w s^2 cos(w t s); d/ds = sum 2 w s cos(w t s) - w^2 t s^2 sin(w t s)
    want = np.sum(2 * w * s * np.cos(w * t * s) - w**2 * t * s**2 * np.sin(w * t * s))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_mlx_third_derivative_through_a_rule_that_takes_derivatives() -> None:
    """x* = sqrt(a) from a custom_jvp rule written with pushforwards (custom_root's shape):
    d3/da3, forward over forward over forward (was 0)."""
    mx = pytest.importorskip("mlx.core")
    b = _backend("mlx")

    def residual(x, a):
        return x**2 - a

    @ad.custom_jvp
    def attached(x, a):
        return x

    def jvp(primals, tangents):
        x, a = primals
        x = attached(x, a)  # x* depends on a inside the rule too: a higher order needs it
        rhs = ad.pushforward(current_backend(), lambda a, x: residual(x, a), a, x)(tangents[1])
        dfdx = ad.pushforward(current_backend(), residual, x, a)(mx.ones_like(x))
        return x, -rhs / dfdx

    attached.defjvp(jvp)

    def sqrt(a):
        return attached(mx.stop_gradient(a) ** 0.5, a)

    a = mx.array(4.0, dtype=mx.float32)
    np.testing.assert_allclose(float(ad.second_derivative(b, sqrt, a)), -0.25 * 4.0**-1.5, rtol=1e-5)
    got = ad.derivative(b, lambda a: ad.second_derivative(b, sqrt, a), a)
    np.testing.assert_allclose(float(got), 0.375 * 4.0**-2.5, rtol=1e-5)

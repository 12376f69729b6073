"""The finite-differences oracle on inputs a plain stencil gets wrong (issue 24, item 3).

Every result is checked against the analytic derivative: any memory layout of ``x``
(transposed, reversed, broadcast), steps relative to each element (log at 1e-300, sin at 1e8),
and a clear error, never a number, where no step gives an accurate derivative.
"""

from __future__ import annotations

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad

FD = "finite_differences"
BASE = np.linspace(0.1, 1.2, 6).reshape(2, 3)


def layouts(dtype: type) -> dict[str, np.ndarray]:
    """The same kind of values in every non-C layout numpy makes (views of a base array)."""
    base = BASE.astype(dtype)
    return {
        "transposed": base.T,
        "transposed_reversed": base.T[::-1],
        "reversed_transposed": base[::-1].T,
        "fortran": np.asfortranarray(base),
        "broadcast": np.broadcast_to(base[0], (2, 3)),  # zero strides, read-only
    }


# dtype -> (first order, second order) relative tolerance against the analytic derivative
RTOL = {np.float64: (1e-9, 1e-5), np.float32: (2e-3, 5e-2)}


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("layout", list(layouts(np.float64)))
def test_every_layout_of_x_gives_the_analytic_derivatives(layout, dtype):
    x = layouts(dtype)[layout]
    before = np.array(x, copy=True)
    w = np.arange(1.0, 1.0 + x.size).reshape(x.shape).astype(dtype)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    first, second = RTOL[dtype]

    def f(x):
        return anp.sum(anp.sin(x) * w)

    np.testing.assert_allclose(ad.gradient(FD, f, x), np.cos(x64) * w64, rtol=first, atol=first)
    jac = ad.jacobian(FD, lambda x: anp.sin(x) * w, x)
    np.testing.assert_allclose(jac.reshape(x.size, x.size), np.diag((np.cos(x64) * w64).ravel()),
                               rtol=first, atol=first)
    vjp = ad.pullback(FD, lambda x: anp.sin(x) * w, x)
    np.testing.assert_allclose(vjp(np.ones_like(x)), np.cos(x64) * w64, rtol=first, atol=first)
    hess = ad.hessian(FD, f, x).reshape(x.size, x.size)
    np.testing.assert_allclose(hess, np.diag((-np.sin(x64) * w64).ravel()), rtol=second, atol=second)
    np.testing.assert_array_equal(x, before)  # the caller's array is left as it was


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_log_near_zero_takes_a_step_inside_its_domain(dtype):
    # A step of eps**(1/5) * max(|x|, 1) ~ 1e-3 crosses zero, where log is NaN.
    tiny = 1e-300 if dtype is np.float64 else 1e-30
    x = np.array([tiny, 1e-10, 1e-3, 1.0], dtype=dtype)
    expected = 1.0 / x.astype(np.float64)
    rtol = RTOL[dtype][0]
    np.testing.assert_allclose(ad.gradient(FD, lambda x: anp.sum(anp.log(x)), x), expected, rtol=rtol)
    np.testing.assert_allclose(ad.derivative(FD, np.log, x[0]), expected[0], rtol=rtol)
    np.testing.assert_allclose(ad.pushforward(FD, anp.log, x[:1])(np.ones(1, dtype)), expected[:1], rtol=rtol)
    # second order, nested differences: d2/dx2 log x = -1/x**2 (at 1e-10: 1/tiny**2 overflows)
    np.testing.assert_allclose(ad.second_derivative(FD, np.log, x[1]), -expected[1] ** 2, rtol=RTOL[dtype][1])


def test_sin_at_1e8_takes_a_step_below_its_period():
    # A step relative to |x| alone (~1e5) spans thousands of periods: cos(1e8) ~ -0.36, not 2e-7.
    x = np.array([1e8, 0.5, 3e11])
    expected = np.cos(x)
    # the steps either side round to x's spacing (1.5e-8 at 1e8): rtol well above 1e-9
    np.testing.assert_allclose(ad.gradient(FD, lambda x: anp.sum(anp.sin(x)), x), expected, rtol=1e-7)
    np.testing.assert_allclose(ad.derivative(FD, np.sin, 1e8), np.cos(1e8), rtol=1e-7)
    # one step for every element: small enough for sin at 0.5, resolved at 3e9 (not at 3e11)
    near = np.array([1e8, 0.5, 3e9])
    np.testing.assert_allclose(ad.pushforward(FD, anp.sin, near)(np.ones(3)), np.cos(near), rtol=1e-7)
    np.testing.assert_allclose(ad.jacobian(FD, anp.sin, x), np.diag(expected), rtol=1e-7, atol=1e-9)


def test_a_jump_is_refused_naming_the_element_not_returned_as_a_huge_number():
    x = np.array([0.5, 1.0, 1.5])
    with pytest.raises(ad.InvalidArgumentError, match=r"element \(1,\) \(value 1\).*exact AD backend"):
        ad.gradient(FD, lambda x: anp.sum(anp.floor(x) + 0.1 * x), x)


def test_a_domain_edge_is_refused_not_returned_as_nan():
    # sqrt is finite at 0 and NaN at every x - h: its derivative there does not exist
    with pytest.raises(ad.NonFiniteInputError, match=r"element \(0,\) \(value 0\).*edge of f's domain"):
        ad.gradient(FD, lambda x: anp.sum(anp.sqrt(x)), np.array([0.0, 1.0]))


def test_float32_sin_at_1e8_is_refused():
    # float32 spaces 1e8 by 8: no step below sin's period exists, so no accurate derivative
    with pytest.raises(ad.AbstractDiffError, match="no step giving an accurate derivative"):
        ad.gradient(FD, lambda x: anp.sum(anp.sin(x)), np.array([1e8], dtype=np.float32))


@pytest.mark.parametrize("power", [3, 5])
def test_a_zero_derivative_at_a_flat_point_is_accepted(power):
    # Guard against over-refusal: D(h) ~ h**2 (x**3) or h**4 (x**5) converges to the exact 0.
    g = ad.gradient(FD, lambda x: anp.sum(x**power + x), np.array([0.0, 1.0]))
    np.testing.assert_allclose(g, [1.0, power + 1.0], rtol=1e-9, atol=1e-9)


def test_a_smooth_function_costs_four_evaluations_per_element():
    # Guard on the oracle's cost: the common case decides on the first two levels.
    calls = []

    def f(x):
        calls.append(1)
        return anp.sum(anp.sin(x) * anp.exp(x))

    x = np.array([-0.9, -0.2, 0.4, 1.3])
    ad.gradient(FD, f, x)
    assert len(calls) <= 4 * x.size + 1


def test_hvp_steps_suit_every_element_the_tangent_moves():
    # One step for the tangent: relative to max|x| (10 here) it is far too large for x = -1.
    x = np.array([-10.24, 6.5, -1.0, 4.7], dtype=np.float32)

    def f(x):
        return anp.sum(anp.log(1 + x**2))

    x64 = x.astype(np.float64)
    expected = 2 * (1 - x64**2) / (1 + x64**2) ** 2  # the Hessian is diagonal
    hv = ad.hvp(FD, f, x, np.ones(4, np.float32))
    np.testing.assert_allclose(hv, expected, rtol=0, atol=RTOL[np.float32][1] * np.max(np.abs(expected)))


def test_a_tiny_tangent_is_differentiated_along_its_direction():
    # Guard: a tangent whose squared norm underflows still has a direction.
    x, v = np.array([0.3, 1.0]), np.array([1e-170, 2e-170])
    np.testing.assert_allclose(ad.pushforward(FD, anp.sin, x)(v), np.cos(x) * v, rtol=1e-8)
    np.testing.assert_allclose(ad.hvp(FD, lambda x: anp.sum(anp.sin(x) ** 2), x, v), 2 * np.cos(2 * x) * v,
                               rtol=1e-5)


def test_a_flat_point_among_other_outputs_is_not_refused():
    # Guard: d/dx x**3 sin(x) = 0 at a tiny x; other outputs of the Jacobian column are far larger.
    x = np.array([1e-183, 0.3])
    J = ad.jacobian(FD, lambda x: anp.stack([anp.sum(x**3 * anp.sin(x)), 1e3 * x[0] ** 3 + x[1]]), x)
    np.testing.assert_allclose(J, [[0.0, 3 * 0.09 * np.sin(0.3) + 0.027 * np.cos(0.3)], [0.0, 1.0]], atol=1e-9)

"""A complex-step adapter, written as a new user would, against the documented protocol only.

The complex step is forward mode without a tape: ``f'(x) t = Im f(x + i h t) / h``, exact to
rounding for a holomorphic ``f`` (no cancellation, so ``h`` can be tiny).  It needs two things
of the protocol, both public (``docs/guide/adapters.md``, "Adapters that are not tape
libraries"): the unchecked call of the flat function, ``fn.call_unchecked(xs, data)``, because
the checked call refuses complex outputs; and ``approximate`` declared per order, because its
second derivatives are differences of its exact first ones: ``approximate = (False, True)``.
"""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import testing
from abstractdiff._hooks import approximates

#: numpy's complex linear algebra is not holomorphic (a complex Cholesky factor or log|det|
#: uses conjugates), so the complex step is wrong there: the method's limit, not the protocol's.
NOT_HOLOMORPHIC = {"cholesky_sin", "slogdet_spd"}


class ComplexStep(ad.Backend):
    """Forward mode by the complex step; second derivatives by central differences of it."""

    name = "complex_step"
    approximate = (False, True)  # exact first derivatives; second ones by differences of them

    def flat_value_and_pushforward(self, fn, xs, data):
        y, aux = fn(xs, data)
        y = np.asarray(y)
        unchecked = getattr(fn, "call_unchecked", None)
        if unchecked is None:  # the core's gradient function (a second derivative): central differences
            def jvp(ts):
                scale = max(1.0, *(float(np.max(np.abs(x), initial=0.0)) for x in xs))
                h = float(np.finfo(y.dtype).eps) ** (1 / 3) * scale
                plus, _ = fn([x + h * t for x, t in zip(xs, ts)], data)
                minus, _ = fn([x - h * t for x, t in zip(xs, ts)], data)
                return np.asarray((plus - minus) / (2 * h), dtype=y.dtype)

            return y, aux, jvp

        def jvp(ts):
            h = 1e-20 if y.dtype == np.float64 else 1e-10
            complex_y, _ = unchecked([x + 1j * h * t for x, t in zip(xs, ts)], data)
            return np.asarray(np.imag(complex_y) / h, dtype=y.dtype)

        return y, aux, jvp


def holomorphic_scenarios():
    return [s for s in testing.default_scenarios() if s.name not in NOT_HOLOMORPHIC]


def test_the_complex_step_adapter_passes_the_grid():
    report = testing.check_backend(ComplexStep(), holomorphic_scenarios())
    assert report.ok, str(report)


def test_first_derivatives_are_held_to_exact_tolerances_second_ones_to_approximate():
    b = ComplexStep()
    assert not approximates(b, 1) and approximates(b, 2) and approximates(b, 3)
    assert testing.is_approximate(b)  # at some order

    class Exact(ad.Backend):
        name = "exact"

    fd = ad.backend("finite_differences")
    for dtype in ("float64", "float32"):
        assert testing.default_rtol(b, dtype, "gradient") == testing.default_rtol(Exact(), dtype, "gradient")
        assert testing.default_rtol(b, dtype, "hessian") == testing.default_rtol(fd, dtype, "hessian")


def test_first_derivatives_are_exact_to_rounding():
    b = ComplexStep()
    x = np.linspace(0.1, 2.0, 7)
    g = ad.gradient(b, lambda x: np.sum(np.sin(x) * np.exp(x)), x)
    np.testing.assert_allclose(g, np.cos(x) * np.exp(x) + np.sin(x) * np.exp(x), rtol=1e-14)


def test_the_checked_call_still_refuses_complex_outputs():
    """call_unchecked is the adapter's tool; users' complex outputs are refused as before."""
    with pytest.raises(ad.InvalidOutputError, match="complex"):
        ad.gradient(ComplexStep(), lambda x: np.sum(x) * 1j, np.ones(3))


@pytest.mark.parametrize("declared, order, expected", [
    (True, 1, True), (False, 2, False), ((False, True), 1, False), ((False, True), 2, True),
    ((False, True), 5, True), ((True,), 2, True), ((), 1, False), ((False, True), None, True),
])
def test_approximate_per_order(declared, order, expected):
    class Declared:
        approximate = declared

    assert approximates(Declared(), order) is expected

"""The portable table's checks mean what its marks say, and the linear-algebra scenarios' references are right.

The table's checks (``conformance_tests/test_portable.py``) once differentiated only the
linear functional ``sum(w * f(x))`` at 3x3: a derivative that is right for that one
cotangent only (paddle's triangular solve) or at 3x3 only (MLX's det) passed as ✓.  These
tests feed :func:`observe` derivatives that are wrong in exactly those ways, through
autograd primitives, and check the level it reports.
"""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff.testing import default_scenarios
from abstractdiff.testing._portable import PORTABLE, Portable

autograd = pytest.importorskip("autograd")
from autograd.extend import defvjp, primitive  # noqa: E402

from conformance_tests import test_portable as table  # noqa: E402

X3 = (np.arange(9.0).reshape(3, 3) + 1.0) / 10.0
X6 = (np.arange(36.0).reshape(6, 6) + 1.0) / 40.0


def _entry(monkeypatch: pytest.MonkeyPatch, fn, call: str, resized: bool = False) -> Portable:
    """A table entry ``call`` of x that runs ``fn`` (cached as the call's function), the reference 2x."""
    from abstractdiff.testing import _portable

    monkeypatch.setitem(_portable._FUNCTIONS, call, fn)
    entry = Portable(call, "elementwise", call, lambda x: 2.0 * x, (("x", X3),),
                     resized=(("x", X6),) if resized else ())
    monkeypatch.setitem(table._ENTRIES, entry.id, entry)
    for cached in (table._function, table._loss, table._scalar, table._reference_gradient, table._reference_hvp,
                   table._reference_pushforward):
        cached.cache_clear()  # the ids are new, but keep the caches honest for the next test
    return entry


def test_a_derivative_right_only_for_the_linear_cotangent_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    # The vjp ignores its cotangent and returns 2 * w: exactly right for sum(w * f(x)), the old
    # check's functional, and wrong for any other cotangent (as paddle's triangular solve was).
    weights = table._weights(X3.shape, "float64")

    @primitive
    def double(x):
        return 2.0 * x

    defvjp(double, lambda ans, x: lambda g: 2.0 * weights)
    entry = _entry(monkeypatch, double, "double_linear_only(x)")
    b = ad.backend("autograd")
    old_check = ad.gradient(b, lambda x: autograd.numpy.sum(weights * double(x)), X3)
    np.testing.assert_allclose(old_check, 2.0 * weights)  # what the old check saw: a ✓
    for dtype in ("float64", "float32"):  # float64 sees it in forward mode first, float32 in the gradient
        level, why = table.observe(b, entry, dtype)
        assert level == "✗" and "against finite differences" in why, why


def test_a_derivative_wrong_past_3x3_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    @primitive
    def double(x):
        return 2.0 * x

    defvjp(double, lambda ans, x: lambda g: 2.0 * g if len(x) <= 3 else 0.0 * g)
    entry = _entry(monkeypatch, double, "double_small_only(x)", resized=True)
    level, why = table.observe(ad.backend("autograd"), entry, "float64")
    assert level == "✗" and "at n = 6" in why, why


def test_a_second_derivative_that_raises_is_first_order(monkeypatch: pytest.MonkeyPatch) -> None:
    @primitive
    def slope(x):  # no vjp: differentiating the gradient with respect to x raises
        return 2.0 * np.ones_like(x)

    @primitive
    def double(x):
        return 2.0 * x

    # linear in g, so forward mode (autograd's is the vjp of the vjp, in g) still works
    defvjp(double, lambda ans, x: lambda g: g * slope(x))
    entry = _entry(monkeypatch, double, "double_first_order(x)")
    level, why = table.observe(ad.backend("autograd"), entry, "float64")
    assert level == "first order", why
    assert table.LEVELS.index("first order") < table.LEVELS.index("✓")


def test_a_gradient_that_raises_is_value_only(monkeypatch: pytest.MonkeyPatch) -> None:
    @primitive
    def double(x):
        return 2.0 * x

    entry = _entry(monkeypatch, double, "double_no_vjp(x)")
    level, why = table.observe(ad.backend("autograd"), entry, "float64")
    assert level == "value only", why


def test_a_wrong_second_derivative_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    # f(x) = x**2 / 2 + x (so the reference value is not 2x: override it), with a gradient that is
    # right but whose own derivative is off by a factor 2.
    @primitive
    def grad_of(x, g):
        return g * (x + 1.0)

    defvjp(grad_of, lambda ans, x, g: lambda h: h * g * 2.0, lambda ans, x, g: lambda h: h * (x + 1.0))

    @primitive
    def f(x):
        return 0.5 * x**2 + x

    defvjp(f, lambda ans, x: lambda g: grad_of(x, g))
    entry = _entry(monkeypatch, f, "half_square_wrong_hessian(x)")
    entry = Portable(entry.name, entry.category, entry.call, lambda x: 0.5 * x**2 + x, entry.wrt)
    monkeypatch.setitem(table._ENTRIES, entry.id, entry)
    level, why = table.observe(ad.backend("autograd"), entry, "float64")
    assert level == "✗" and "Hessian-vector product" in why, why


def test_every_matrix_function_has_a_second_point_at_n_6() -> None:
    square = {"linalg.inv", "linalg.solve", "linalg.solve-column", "linalg.solve_triangular",
              "scipy.linalg.solve_triangular", "linalg.cholesky", "linalg.det", "linalg.slogdet", "linalg.eigh",
              "linalg.eigvalsh", "trace"}
    by_id = {p.id: p for p in PORTABLE}
    for name in square:
        wrt, _ = by_id[name].inputs("float64", 1)
        assert wrt[0].shape == (6, 6), name
        np.testing.assert_allclose(by_id[name].expected("float64", 1), by_id[name].expected("float32", 1),
                                   rtol=1e-5, atol=1e-6)
    assert {"copy", "pad-flat", "pad-pair"} <= set(by_id)


# ------------------------------------------------------------------ the linear-algebra scenarios
LINEAR_ALGEBRA = ["cholesky_sin", "triangular_solve_squares", "slogdet_spd"]


@pytest.mark.parametrize("name", LINEAR_ALGEBRA)
def test_linear_algebra_scenarios_are_default_and_past_3x3(name: str) -> None:
    (s,) = default_scenarios("float64", names=[name])
    leaves = [np.asarray(a) for a in (s.x.values() if isinstance(s.x, dict) else [s.x])]
    assert min(a.shape[0] for a in leaves) >= 4
    assert {"gradient", "pullback", "hvp"} <= set(s.operators)


@pytest.mark.parametrize("name", LINEAR_ALGEBRA)
def test_linear_algebra_references_match_finite_differences(name: str) -> None:
    (s,) = default_scenarios("float64", names=[name])
    g = ad.to_numpy(ad.gradient("finite_differences", s.f, s.x, *s.args))
    for got, want in zip(_leaves(g), _leaves(s.gradient)):
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)
    h = ad.to_numpy(ad.hvp("finite_differences", s.f, s.x, s.tangent, *s.args))
    for got, want in zip(_leaves(h), _leaves(s.reference("hvp"))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", LINEAR_ALGEBRA)
def test_linear_algebra_references_match_jax(name: str) -> None:
    pytest.importorskip("jax")
    (s,) = default_scenarios("float64", names=[name])
    g, h = ad.to_numpy(ad.gradient_and_hvp("jax", s.f, s.x, s.tangent, *s.args))
    for got, want in zip(_leaves(g) + _leaves(h), _leaves(s.gradient) + _leaves(s.reference("hvp"))):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def _leaves(tree) -> list[np.ndarray]:
    import optree

    return [np.asarray(a) for a in optree.tree_leaves(tree)]

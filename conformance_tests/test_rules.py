"""The "rule used" family (:mod:`abstractdiff.testing._rules`) on every exact backend, in
every mode: explicit and prepared (``check_backend`` runs both), implicit
(``ad.Implicit``), compiled (the backend's other compile setting), batched (``ad.Batch``
of pullbacks and pushforwards) and second order (the Hessian operators of the family,
and ``ad.SecondOrder``).  The references are the rules', mostly unlike the true
derivatives, so a backend that ignored a rule fails; finite differences must ignore rules,
and is checked to give the true derivatives instead.
"""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import testing
from abstractdiff.testing import _grid
from abstractdiff.testing._rules import rule_scenarios

EXACT = ("autograd", "jax", "mlx", "paddle", "pytensor", "tensorflow", "torch")
#: The setting other than the default: compiled where the default is eager, and the reverse.
OTHER_COMPILE = {
    "jax": {"compile": False}, "tensorflow": {"compile": False}, "torch": {"compile": True},
    "mlx": {"compile": True}, "paddle": {"compile": True}, "pytensor": {"mode": "FAST_COMPILE"},
}
DTYPES = ("float64", "float32")


def _backend(name: str, implicit: bool = False, **options: object) -> ad.Backend:
    b = _grid.load(_grid.Case(name, "cpu", "float64", bool(_grid.requested_backends()), implicit))
    return ad.backend(name, **options) if options else b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", EXACT)
def test_rules_explicit_and_prepared(name: str, dtype: str) -> None:
    report = testing.check_backend(_backend(name), rule_scenarios(dtype))
    assert report.ok, report


@pytest.mark.parametrize("name", EXACT)
def test_rules_implicit(name: str) -> None:
    report = testing.check_backend(_backend(name, implicit=True), rule_scenarios("float64"))
    assert report.ok, report


@pytest.mark.parametrize("name", [n for n in EXACT if n in OTHER_COMPILE])
def test_rules_other_compile_setting(name: str) -> None:
    _backend(name)  # skips (or fails, when asked for) where the library is missing
    report = testing.check_backend(ad.backend(name, **OTHER_COMPILE[name]), rule_scenarios("float64"))
    assert report.ok, report


def _native(b: ad.Backend, a: np.ndarray) -> object:
    return b.from_numpy(a)


@pytest.mark.parametrize("name", EXACT)
def test_rules_batched(name: str) -> None:
    b = _backend(name)
    square, sine = (s for s in rule_scenarios("float64") if s.name in ("rule_square", "rule_jvp"))
    x = _native(b, square.x)
    basis = [_native(b, e) for e in np.eye(square.x.size)]
    rows = ad.pullback(b, lambda x: square.f(x) * np.float64(1.0), x)(ad.Batch(_native(b, np.array(1.0)),
                                                                       _native(b, np.array(2.0))))
    np.testing.assert_allclose(ad.to_numpy(rows.stack()), np.stack([square.gradient, 2 * square.gradient]),
                               rtol=1e-10)
    xs = _native(b, sine.x)
    cols = ad.pushforward(b, sine.f, xs)(ad.Batch(*[_native(b, e) for e in np.eye(sine.x.size)]))
    np.testing.assert_allclose(ad.to_numpy(cols.stack()), sine.jacobian.T, rtol=1e-10)
    assert len(basis) == square.x.size


@pytest.mark.parametrize("name", EXACT)
def test_rules_second_order_over_the_same_backend(name: str) -> None:
    b = _backend(name)
    square = next(s for s in rule_scenarios("float64") if s.name == "rule_square")
    h = ad.hessian(ad.SecondOrder(b, b), square.f, _native(b, square.x))
    np.testing.assert_allclose(ad.to_numpy(h), square.hessian, rtol=1e-10)


def test_finite_differences_ignores_rules_and_gives_the_true_derivative() -> None:
    fd = ad.backend("finite_differences")
    square, pytree, _, sine, stopped, ridge = rule_scenarios("float64")
    x = square.x
    np.testing.assert_allclose(ad.gradient(fd, square.f, x), x + 1, rtol=1e-6)  # d(x**2/2 + x): x + 1, not 1.5x + 1
    np.testing.assert_allclose(ad.jacobian(fd, sine.f, sine.x), np.diag(np.cos(sine.x)), rtol=1e-6)
    g = ad.gradient(fd, pytree.f, pytree.x)
    np.testing.assert_allclose(g["y"], pytree.x["c"] * pytree.x["p"]["w"], rtol=1e-6)  # ct w, not 3 ct w
    # stop_gradient cannot be honoured numerically: refused, in the ridge solver too
    for s in (stopped, ridge):
        with pytest.raises(ad.CustomRuleError, match="finite_differences"):
            ad.gradient(fd, s.f, s.x, *s.args)
    report = testing.check_backend(fd, [square])
    assert not report.ok  # the rule family cannot be passed by an oracle that ignores rules

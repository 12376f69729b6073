"""check_backend catches wrong adapters: each defect is reported with scenario and operator.

The broken backends are the finite-differences backend with one defect each, registered
by name as a third-party adapter would be.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff import _registry, testing
from abstractdiff.testing import _grid


class ScaledGradient(FiniteDifferencesBackend):
    """Every reverse-mode result off by 0.1%."""

    def flat_value_and_gradient(self, fn, xs, data):
        y, aux, grads = super().flat_value_and_gradient(fn, xs, data)
        return y, aux, [g * 1.001 for g in grads]

    def flat_value_and_pullback(self, fn, xs, data):
        y, aux, vjp = super().flat_value_and_pullback(fn, xs, data)
        return y, aux, lambda dy: [g * 1.001 for g in vjp(dy)]


class NoneForUnconnected(FiniteDifferencesBackend):
    """TensorFlow's default: None instead of zeros for a leaf the output does not depend on."""

    def complete(self, grads, xs):
        return [None if g is None or not np.any(g) else g for g in grads]


class Downcast(FiniteDifferencesBackend):
    """Gradients silently computed in float32 (jax without x64)."""

    def flat_value_and_gradient(self, fn, xs, data):
        y, aux, grads = super().flat_value_and_gradient(fn, xs, data)
        return y, aux, [g.astype(np.float32) for g in grads]


class MutatesInputs(FiniteDifferencesBackend):
    """Writes into the caller's array after differentiating."""

    def flat_value_and_gradient(self, fn, xs, data):
        out = super().flat_value_and_gradient(fn, xs, data)
        xs[0] *= 2.0
        return out


BROKEN = {
    "broken_scaled": ScaledGradient,
    "broken_none": NoneForUnconnected,
    "broken_downcast": Downcast,
    "broken_mutates": MutatesInputs,
}


@pytest.fixture
def broken():
    saved, instances = dict(_registry._registry), dict(_registry._instances)
    for name, cls in BROKEN.items():
        ad.register_backend(name, cls)
    yield
    _registry._registry.clear()
    _registry._registry.update(saved)
    _registry._instances.clear()
    _registry._instances.update(instances)


def _scenarios():
    # float64: the oracle's float32 tolerance (2e-3) is looser than a 0.1% defect
    return testing.default_scenarios("float64")


def _find(report, scenario, operator):
    return [f for f in report.failures if f.scenario == scenario and f.operator == operator]


def test_correct_backend_passes():
    report = testing.check_backend("finite_differences", _scenarios())
    assert report.ok, str(report)
    assert report.failures == []
    ops = {r.operator for r in report.results}
    assert set(testing.OPERATORS) <= ops and "numpy_inputs" in ops
    assert all(r.max_error is not None and r.max_error < 1e-6 and r.seconds >= 0 for r in report.results)


def test_gradient_off_by_a_tenth_of_a_percent(broken):
    report = testing.check_backend("broken_scaled", _scenarios())
    assert not report.ok
    for op in ("gradient", "value_and_gradient", "pullback"):
        (failure,) = _find(report, "sum_squares[float64]", op)
        assert "max relative error 1.00e-03 exceeds rtol" in failure.message
        text = str(failure)
        assert text.startswith("finite_differences [cpu] sum_squares[float64] " + op + " (float64): ")
    # pushforward is forward mode, untouched by the defect: it must not be blamed
    assert not _find(report, "sum_squares[float64]", "pushforward")


def test_none_for_unconnected_leaf(broken):
    report = testing.check_backend("broken_none", _scenarios())
    failures = _find(report, "pytree_mixed[float64]", "gradient")
    assert any("gradient['unused']: got None for a float leaf" in f.message for f in failures), failures
    assert _find(report, "unconnected_vector[float64]", "pullback")
    assert _find(report, "unconnected_vector[float64]", "jacobian")
    assert not _find(report, "sum_squares[float64]", "gradient")


def test_float64_downcast(broken):
    report = testing.check_backend("broken_downcast", _scenarios())
    (failure,) = _find(report, "rosenbrock[float64]", "gradient")
    assert failure.message == "gradient: dtype float32, expected float64 (the input's dtype)"
    assert failure.dtype == "float64"
    messages = [f.message for f in _find(report, "pytree_mixed[float64]", "value_and_gradient")]
    assert "gradient['a']: dtype float32, expected float64 (the input's dtype)" in messages


def test_inputs_mutated(broken):
    scenarios = _scenarios()
    before = {s.id: np.copy(s.x) for s in scenarios if isinstance(s.x, np.ndarray)}
    report = testing.check_backend("broken_mutates", scenarios)
    failures = _find(report, "sum_squares[float64]", "gradient")
    assert any("input [0] was modified in place" in f.message for f in failures), failures
    assert any(f.operator == "numpy_inputs" and "modified in place" in f.message for f in report.failures)
    # the harness hands the backend copies: the shared scenarios stay intact
    assert all(np.array_equal(s.x, before[s.id]) for s in scenarios if s.id in before)


def test_exception_is_recorded_not_raised(broken):
    class Raises(FiniteDifferencesBackend):
        def flat_value_and_pushforward(self, fn, xs, data):
            raise RuntimeError("no forward mode today\nsecond line")

    report = testing.check_backend(Raises(), testing.default_scenarios("float64", ["rosenbrock"]))
    (failure,) = _find(report, "rosenbrock[float64]", "pushforward")
    assert failure.message == "raised RuntimeError: no forward mode today"


def test_report_table_and_json(broken):
    report = testing.check_backend("broken_scaled", testing.default_scenarios("float64", ["sum_squares"]))
    text = str(report)
    assert "sum_squares[float64]" in text and "FAIL 1.0e-03" in text and "ok " in text
    assert "failures:" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["backend"] == "finite_differences"
    assert {r["operator"] for r in data["results"]} >= {"gradient", "hessian", "hvp"}
    summary = report.by_operator()
    assert summary["gradient"]["ok"] is False and summary["pushforward"]["ok"] is True


def test_assert_backend_raises_with_the_report(broken):
    scen = testing.default_scenarios("float64", ["sum_squares"])
    assert testing.assert_backend("finite_differences", scen).ok
    with pytest.raises(AssertionError, match=r"conformance failure\(s\)[\s\S]*sum_squares\[float64\] gradient"):
        testing.assert_backend("broken_scaled", scen)


def test_compare_backends_names_the_pair_that_disagrees(broken):
    scen = testing.default_scenarios("float64", ["mlp_loss"])
    good = testing.compare_backends(["finite_differences", FiniteDifferencesBackend(step=1e-4)], scen)
    assert good.ok, str(good)
    bad = testing.compare_backends(["finite_differences", "broken_scaled"], scen)
    assert not bad.ok
    failing = {(f.backend, f.scenario, f.operator) for f in bad.failures}
    assert ("finite_differences vs finite_differences", "mlp_loss[float64]", "gradient") in failing
    assert all(f.operator != "pushforward" for f in bad.failures)


def test_compare_backends_bad_arguments():
    with pytest.raises(ValueError, match="at least two backends"):
        testing.compare_backends(["finite_differences"])
    report = testing.check_backend("finite_differences", testing.default_scenarios("float64", ["sum_squares"]))
    with pytest.raises(ValueError, match="one report per backend"):
        testing.compare_backends(["finite_differences", "finite_differences"], reports=[report])


def test_custom_scenario_and_its_errors():
    s = testing.Scenario("cube", lambda x: anp.sum(x**3), np.array([1.0, -2.0], dtype=np.float32),
                         value=-7.0, gradient=np.array([3.0, 12.0]), hessian=np.diag([6.0, -12.0]),
                         tangent=np.array([1.0, 1.0], dtype=np.float32))
    assert s.dtype == "float32" and s.operators == ("gradient", "value_and_gradient", "pullback", "pushforward",
                                                   "hessian", "value_gradient_and_hessian", "hvp",
                                                   "gradient_and_hvp")
    np.testing.assert_allclose(s.reference("hvp"), [6.0, -12.0])
    assert testing.check_backend("finite_differences", [s]).ok
    wrong = testing.Scenario("cube", s.f, s.x, value=-7.0, gradient=np.array([3.0, 12.5]))
    assert not testing.check_backend("finite_differences", [wrong]).ok
    with pytest.raises(ValueError, match="no float array leaf"):
        testing.Scenario("ints", s.f, np.array([1, 2]))
    with pytest.raises(ValueError, match="mix dtypes"):
        testing.Scenario("mixed", s.f, (np.ones(2), np.ones(2, dtype=np.float32)))
    with pytest.raises(ValueError, match="unknown operators"):
        testing.Scenario("x", s.f, s.x, gradient=s.gradient, operators=["grad"])
    with pytest.raises(ValueError, match="no reference result"):
        testing.Scenario("x", s.f, s.x, gradient=s.gradient, operators=["jacobian"])
    with pytest.raises(TypeError, match="must be callable"):
        testing.Scenario("x", 3, s.x)


def test_default_scenarios_selection():
    names = testing.scenario_names()
    assert {"mlp_loss", "pytree_mixed", "logsumexp", "rosenbrock", "unconnected_vector"} <= set(names)
    both = testing.default_scenarios()
    assert len(both) == 2 * len(names) and {s.dtype for s in both} == {"float32", "float64"}
    assert testing.default_scenarios("float32")[0] is testing.default_scenarios("float32")[0]
    with pytest.raises(ValueError, match="unsupported scenario dtype"):
        testing.default_scenarios("float16")
    with pytest.raises(ValueError, match="unknown scenario names"):
        testing.default_scenarios(names=["nope"])


def test_strict_xfail_table():
    report = testing.check_backend("finite_differences", testing.default_scenarios("float64", ["sum_squares"]))
    # a listed gap that passes is an error: the table must be kept honest
    with pytest.raises(pytest.fail.Exception, match="XPASS"):
        _grid.assert_report(report, {("finite_differences", "sum_squares", "gradient"): "pretend gap"})
    bad = testing.check_backend(ScaledGradient(), testing.default_scenarios("float64", ["sum_squares"]))
    with pytest.raises(pytest.fail.Exception, match="conformance failure"):
        _grid.assert_report(bad)
    xfails = {("finite_differences", "sum_squares[float64]", op): "known" for op in
              ("gradient", "value_and_gradient", "pullback", "hessian", "value_gradient_and_hessian", "hvp",
               "gradient_and_hvp", "numpy_inputs", "prepared")}
    with pytest.raises(pytest.xfail.Exception, match="sum_squares gradient: known"):
        _grid.assert_report(bad, xfails)


class DriftingPrepared(FiniteDifferencesBackend):
    """A prepared gradient 1% off the unprepared one (a stale preparation, say)."""

    def prepare(self, operator, f, x, args=(), **kw):
        prepared = super().prepare(operator, f, x, args, **kw)
        if operator != "gradient":
            return prepared
        return lambda *a: prepared(*a) * 1.01


def test_a_prepared_operator_that_drifts_from_the_unprepared_one_is_reported():
    report = testing.check_backend(DriftingPrepared(), testing.default_scenarios("float64", ["sum_squares"]))
    failures = [f for f in report.failures if f.operator == "prepared"]
    assert failures and all(f.message.startswith("gradient") for f in failures), report
    assert any("prepared and unprepared must agree" in f.message for f in failures), report
    assert all(f.operator == "prepared" for f in report.failures)  # the unprepared operators pass


# ------------------------------------------------------------- the switching family
class CachesByFunctionAlone(FiniteDifferencesBackend):
    """Keeps one route per function object, forgetting dtype and shape: the route remembers
    the gradient dtype of the first call and casts every later gradient to it."""

    def flat_value_and_gradient(self, fn, xs, data):
        y, aux, grads = super().flat_value_and_gradient(fn, xs, data)
        f = getattr(fn, "f", None)
        if f is None:  # the core's own wrapper (a Hessian's gradient function), made per call: its
            return y, aux, grads  # id is soon another's, which would make the bug strike at random
        first = self.__dict__.setdefault("_routes", {}).setdefault(id(f), grads[0].dtype)
        return y, aux, [g.astype(first) for g in grads]


def test_a_backend_caching_by_function_alone_passes_the_grid_but_not_the_switching_family():
    b = CachesByFunctionAlone()
    grid = testing.check_backend(b, testing.default_scenarios())  # one function per dtype: no switch
    assert grid.ok, grid
    report = testing.check_backend(b, testing.default_scenarios("float64", ["sum_squares"]), switching=True)
    failures = [str(f) for f in report.failures]
    assert failures and all("switching_" in f for f in failures), report
    assert any("@1[float32]" in f and "dtype float64, expected float32" in f for f in failures), failures


def test_the_switching_family_shares_one_function_per_family_and_changes_dtype_then_shape():
    for family in testing.switching_scenarios():
        assert len({id(step.f) for step in family.steps}) == 1
        dtypes = [step.dtype for step in family.steps]
        assert dtypes[:3] == ["float64", "float32", "float64"]
    sizes = [np.size(step.x) for step in testing.switching_scenarios()[0].steps]
    assert sizes[-1] != sizes[0]
    fd = testing.check_backend("finite_differences", [], switching=True)
    assert fd.ok and {r.name.split("@")[0] for r in fd.results} == {f.name for f in testing.switching_scenarios()}

"""Every default scenario and operator on every backend, device, dtype and mode.

One test per (backend, device, dtype): compiling backends (jax, tensorflow) compile each
new function, so the scenarios run together inside one test, and a failure lists every
(scenario, operator) that went wrong with the report table.
"""

from __future__ import annotations

import pytest

from abstractdiff.testing import _grid, compare_reports

#: Known gaps: (backend label, scenario name, operator) -> reason.  Applied strictly: a
#: listed gap that passes fails the run, so a fix is noticed and the entry removed.
#: The label is "torch", "implicit(torch)", or "torch@gpu" for GPU-only gaps; the
#: scenario is a base name ("mlp_loss") or one dtype of it ("mlp_loss[float32]").
XFAILS: dict[tuple[str, str, str], str] = {}


def test_backend_loads(request: pytest.FixtureRequest, ad_backend_name: str) -> None:
    """A backend asked for in ABSTRACTDIFF_BACKENDS must load; nothing is skipped silently."""
    required = _grid.backend_names(request.config)[1]
    assert _grid.load(_grid.Case(ad_backend_name, "cpu", "float64", required)).name


def test_explicit(ad_case: _grid.Case) -> None:
    """Analytic references; on a GPU also the CPU results (float32 rtol 1e-5, float64 1e-10)."""
    b = _grid.load(ad_case)
    report = _grid.report_for(b, ad_case.dtype)
    _grid.assert_report(report, XFAILS)
    if ad_case.device != "cpu":
        cpu_case = _grid.Case(ad_case.backend, "cpu", ad_case.dtype, ad_case.required)
        cpu = _grid.report_for(_grid.load(cpu_case), ad_case.dtype)
        _grid.assert_report(_grid.device_comparison(cpu, report), XFAILS)


def test_implicit(ad_implicit_case: _grid.Case) -> None:
    """The scenarios through ad.Implicit(backend), with x turned into variables."""
    report = _grid.report_for(_grid.load(ad_implicit_case), ad_implicit_case.dtype)
    _grid.assert_report(report, XFAILS)


#: Scenarios every pair is compared on at least (all of them where this process already
#: ran a backend's full report): each result is also checked against the analytic one.
AGREEMENT_SCENARIOS = ("mlp_loss", "pytree_mixed", "unconnected_vector", "logsumexp", "scalar_to_vector")


def test_backends_agree(request: pytest.FixtureRequest, ad_dtype: str) -> None:
    """compare_backends across every available backend, explicit and implicit, on the CPU."""
    names, required = _grid.backend_names(request.config)
    reports = []
    for implicit in (False, True):
        for name in names:
            case = _grid.Case(name, "cpu", ad_dtype, required, implicit)
            try:
                reports.append(_grid.cached_report(_grid.load(case), ad_dtype, AGREEMENT_SCENARIOS))
            except pytest.skip.Exception:
                continue  # reported by test_explicit / test_implicit for that case
    if len(reports) < 2:
        pytest.skip(f"needs two backends to compare, found {[r.backend for r in reports]}")
    _grid.assert_report(compare_reports(reports), XFAILS)


#: Agreement with the finite-differences oracle (differences taken in float64, results in
#: the scenario's dtype), per dtype: first order at the figures the adapters promise,
#: second order at what nested differences reach (about 1e-8 to 1e-7 relative).
ORACLE_RTOL = {"float64": 1e-9, "float32": 1e-4}
ORACLE_RTOL_SECOND_ORDER = {"float64": 1e-6, "float32": 1e-4}


def test_backends_match_the_finite_difference_oracle(request: pytest.FixtureRequest, ad_dtype: str) -> None:
    """Each exact backend (explicit and implicit) against finite differences evaluated in float64."""
    import abstractdiff as ad
    from abstractdiff.testing import is_approximate
    from abstractdiff.testing._check import SECOND_ORDER

    oracle = ad.backend("finite_differences", compute_dtype="float64")
    oracle_report = _grid.report_for(oracle, ad_dtype)
    _grid.assert_report(oracle_report, XFAILS)
    names, required = _grid.backend_names(request.config)
    compared = []
    for implicit in (False, True):
        for name in names:
            case = _grid.Case(name, "cpu", ad_dtype, required, implicit)
            try:
                b = _grid.load(case)
            except pytest.skip.Exception:
                continue  # reported by test_explicit / test_implicit for that case
            if is_approximate(b):
                continue
            report = _grid.cached_report(b, ad_dtype, AGREEMENT_SCENARIOS)
            for rtol, second_order in ((ORACLE_RTOL, False), (ORACLE_RTOL_SECOND_ORDER, True)):
                agreement = compare_reports([oracle_report, report], rtol=rtol)
                agreement.results = [r for r in agreement.results if (r.operator in SECOND_ORDER) == second_order]
                _grid.assert_report(agreement, XFAILS)
            compared.append(report.backend)
    if not compared:
        pytest.skip("no exact backend available to compare with the finite-differences oracle")

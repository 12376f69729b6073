"""Reusable conformance harness: scenarios with analytic results, backend checks, comparisons.

A library author proves a function differentiates the same on every backend; an
adapter author proves the adapter is right::

    from abstractdiff import testing
    report = testing.check_backend("torch")        # every default scenario and operator
    print(report)                                   # scenario x operator table
    assert report.ok, report.failures
    testing.compare_backends(["torch", "jax"]).ok   # pairwise agreement

A third-party adapter runs the packaged suite with
``pytest --pyargs abstractdiff.testing.suite --ad-backend NAME``.

Importing this module imports no AD library; a backend's library is loaded when the
backend is created.
"""

from __future__ import annotations

from ._check import (
    Failure,
    Report,
    Result,
    assert_backend,
    backend_label,
    check_backend,
    compare_backends,
    compare_reports,
    default_rtol,
    is_approximate,
)
from ._loops import loop_scenarios
from ._rules import rule_scenarios
from ._scenarios import OPERATORS, Scenario, Switching, default_scenarios, scenario_names, switching_scenarios

__all__ = [
    "OPERATORS",
    "Failure",
    "Report",
    "Result",
    "Scenario",
    "Switching",
    "assert_backend",
    "backend_label",
    "check_backend",
    "compare_backends",
    "compare_reports",
    "default_rtol",
    "default_scenarios",
    "is_approximate",
    "loop_scenarios",
    "rule_scenarios",
    "scenario_names",
    "switching_scenarios",
]

"""The default scenarios' second-order operators through ``ad.SecondOrder(outer, inner)``.

Every same-library pair of the available backends and finite differences over each of
them, in float64 and float32, checked by the conformance harness (values against the
analytic references, dtypes, array types, inputs left intact, prepared forms).
"""

from __future__ import annotations

import pytest

import abstractdiff as ad
from abstractdiff.testing import _grid, check_backend, default_scenarios
from abstractdiff.testing._scenarios import OPERATORS, SECOND_ORDER

EXACT = ("torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor")
FD = "finite_differences"
PAIRS = [(n, n) for n in EXACT] + [(FD, n) for n in (*EXACT, FD)]

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-over-{p[1]}")
def test_second_order_scenarios(pair: tuple[str, str], dtype: str) -> None:
    outer, inner = (_grid.load(_grid.Case(name, "cpu", dtype)) for name in pair)
    operators = [op for op in OPERATORS if op in SECOND_ORDER]
    report = check_backend(ad.SecondOrder(outer, inner), default_scenarios(dtype), operators=operators, switching=False)
    assert report.results, "no scenario has a second-order reference"
    _grid.assert_report(report)

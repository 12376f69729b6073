"""The conformance suite as a pytest module, for adapter authors.

Run it against your backend (registered through the ``abstractdiff.backends`` entry
point, or by a ``conftest.py`` calling ``ad.register_backend``)::

    pytest --pyargs abstractdiff.testing.suite --ad-backend NAME

It runs every default scenario and operator on NAME in float64 and float32, on the CPU
and on a GPU where the backend reports one (compared with the CPU results), through
``ad.Implicit(NAME)``, the custom-rule and loop families, and checks agreement with the
finite-differences oracle.
Without ``--ad-backend`` it tests every available backend.
"""

from __future__ import annotations

from typing import Any

from abstractdiff.testing import _grid


def pytest_generate_tests(metafunc: Any) -> None:
    config = metafunc.config
    if "case" in metafunc.fixturenames:
        implicit = metafunc.function.__name__ == "test_implicit"
        metafunc.parametrize("case", _grid.gen_params(config, implicit=implicit))
    if "agree_case" in metafunc.fixturenames:
        params = _grid.gen_params(config, devices=("cpu",))
        metafunc.parametrize("agree_case", [p for p in params if p.values[0].backend != "finite_differences"])
    if "loop_case" in metafunc.fixturenames:
        metafunc.parametrize("loop_case", _grid.gen_params(config, devices=("cpu",)))
    if "backend_name" in metafunc.fixturenames:
        names, _ = _grid.backend_names(config)
        metafunc.parametrize("backend_name", names)


def test_backend_loads(backend_name: str) -> None:
    """A backend asked for must load (nothing is skipped silently); others report why not."""
    _grid.load(_grid.Case(backend_name, "cpu", "float64", required=bool(_grid.requested_backends())))


def test_scenarios(case: _grid.Case) -> None:
    """Every scenario and operator against the analytic results (GPU: also against the CPU)."""
    b = _grid.load(case)
    report = _grid.report_for(b, case.dtype)
    _grid.assert_report(report)
    if case.device != "cpu":
        cpu = _grid.report_for(_grid.load(_grid.Case(case.backend, "cpu", case.dtype, case.required)), case.dtype)
        _grid.assert_report(_grid.device_comparison(cpu, report))


def test_implicit(case: _grid.Case) -> None:
    """The same scenarios through ``ad.Implicit(backend)``: x becomes variables."""
    _grid.assert_report(_grid.report_for(_grid.load(case), case.dtype))


def test_custom_rules(agree_case: _grid.Case) -> None:
    """The "rule used" family (``testing.rule_scenarios``): ``ad.custom_vjp``, ``ad.custom_jvp``,
    ``ad.stop_gradient`` and ``ad.custom_root`` through the adapter's ``custom_rule`` hook."""
    import pytest

    from abstractdiff.core import approximates
    from abstractdiff.testing import check_backend, rule_scenarios

    b = _grid.load(agree_case)
    if approximates(b) or not getattr(b, "has_custom_rule", False):
        pytest.skip(f"{agree_case.backend}: no custom_rule hook (or a numerical backend, which ignores rules)")
    _grid.assert_report(check_backend(b, rule_scenarios(agree_case.dtype)))


def test_loops(loop_case: _grid.Case) -> None:
    """The loop family (``testing.loop_scenarios``): ``ad.fori_loop`` and ``ad.scan`` on the
    adapter's ``loops`` hook (the library's loop primitive) or as Python loops, to second order."""
    from abstractdiff.testing import check_backend, loop_scenarios

    _grid.assert_report(check_backend(_grid.load(loop_case), loop_scenarios(loop_case.dtype)))


def test_agrees_with_finite_differences(agree_case: _grid.Case) -> None:
    """Pairwise agreement with the finite-differences oracle (``testing.compare_backends``)."""
    from abstractdiff.testing import compare_backends

    b = _grid.load(agree_case)
    fd = _grid.load(_grid.Case("finite_differences", "cpu", agree_case.dtype))
    reports = [_grid.report_for(b, agree_case.dtype), _grid.report_for(fd, agree_case.dtype)]
    _grid.assert_report(compare_backends([b, fd], reports=reports))

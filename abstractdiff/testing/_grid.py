"""The test grid shared by ``conformance_tests/`` and the packaged suite.

One parametrisation helper (:func:`gen_params`, autoray's ``gen_params`` style) builds
backend x device x dtype cases.  Backends come from ``--ad-backend`` / the
``ABSTRACTDIFF_BACKENDS`` environment variable (comma-separated), else every available
backend.  A backend that was asked for but cannot load *fails*; one that was not asked
for is skipped with the reason; nothing is skipped silently.  pytest is imported only
by the functions that need it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..core import Backend, BackendUnavailableError, Memo, UnknownBackendError
from ._check import Report, backend_label, check_backend, compare_reports
from ._scenarios import DTYPES, default_scenarios

ENV = "ABSTRACTDIFF_BACKENDS"
DEVICES = ("cpu", "gpu")
#: GPU results against CPU results, per dtype (last-bit differences only).
DEVICE_RTOL = {"float32": 1e-5, "float64": 1e-10}

# (label, device, dtype) -> Report, so that a later test in the same process (the
# cross-backend comparison, a GPU-vs-CPU check) reuses results instead of recomputing.
_REPORTS: Memo = Memo(name="testing: grid reports", keyed_on="backend label, device, dtype, scenarios")


@dataclass(frozen=True)
class Case:
    """One cell of the grid."""

    backend: str
    device: str
    dtype: str
    required: bool = False  # asked for explicitly: failing to load fails the run
    implicit: bool = False  # run through ad.Implicit(backend)

    @property
    def id(self) -> str:
        name = f"implicit({self.backend})" if self.implicit else self.backend
        return f"{name}-{self.device}-{self.dtype}"


def requested_backends(config: Any = None) -> list[str]:
    """Backends asked for with ``--ad-backend`` or ``ABSTRACTDIFF_BACKENDS``, in order."""
    names: list[str] = []
    if config is not None:
        try:
            names += list(config.getoption("ad_backend") or [])
        except ValueError:  # the plugin is not loaded (-p no:abstractdiff)
            pass
    names += [n.strip() for n in os.environ.get(ENV, "").split(",")]
    out: list[str] = []
    for n in names:
        if n and n not in out:
            out.append(n)
    return out


def backend_names(config: Any = None) -> tuple[list[str], bool]:
    """``(names, required)``: the explicit backends to test and whether they were asked for."""
    from ..core import installed_backends

    requested = requested_backends(config)
    if requested:
        return [n for n in requested if n != "implicit"], True
    # Backends registered at run time (by a test, a doctest) join only when asked for.
    return [n for n in installed_backends() if n != "implicit"], False


def gen_params(
    config: Any = None, *, devices: tuple[str, ...] = DEVICES, dtypes: tuple[str, ...] = DTYPES,
    implicit: bool = False,
) -> list[Any]:
    """``pytest.param(Case)`` for every backend x device x dtype, ids like ``torch-cpu-float32``."""
    import pytest

    names, required = backend_names(config)
    cases = [Case(n, d, t, required, implicit) for n in names for d in devices for t in dtypes]
    return [pytest.param(c, id=c.id) for c in cases]


def load(case: Case) -> Backend:
    """The backend of ``case`` on its device: skips (not asked for) or fails (asked for) when it cannot load."""
    import pytest

    import abstractdiff as ad

    try:
        b = ad.backend(case.backend)
    except UnknownBackendError as err:
        pytest.fail(str(err), pytrace=False)
    except (BackendUnavailableError, ImportError) as err:
        if case.required:
            pytest.fail(f"backend {case.backend!r} was asked for (--ad-backend / {ENV}) but cannot load: {err}",
                        pytrace=False)
        pytest.skip(f"backend {case.backend!r} is not available here: {err}")
    if case.device != "cpu":
        accelerators = [d for d in b.devices() if d != "cpu"]
        if not accelerators:
            pytest.skip(f"{case.backend}: no GPU here (its devices: {', '.join(b.devices())})")
        b = ad.backend(case.backend, device=accelerators[0])
    if case.implicit:
        from ..core import Implicit

        b = Implicit(b)
    return b


def report_for(b: Backend, dtype: str, names: tuple[str, ...] | None = None) -> Report:
    """``check_backend`` on the default scenarios of ``dtype`` (or those ``names``), cached per process."""
    # repr(b) carries every option (device, compile, compute_dtype...): two backends of one
    # name with different options must not share a report.
    key = (backend_label(b), repr(b), dtype, names)
    if key not in _REPORTS:
        # the switching family crosses dtypes: it runs with the float64 report of the full grid
        switching = dtype == "float64" and names is None and not b.implicit
        _REPORTS[key] = check_backend(b, default_scenarios(dtype, names), switching=switching)
    return _REPORTS[key]


def cached_report(b: Backend, dtype: str, names: tuple[str, ...]) -> Report:
    """The full report if this process already has it, else one on the scenarios ``names`` only."""
    full = _REPORTS.get((backend_label(b), repr(b), dtype, None))
    return full if full is not None else report_for(b, dtype, names)


def _xfail_reason(
    report_label: str, device: str, result: Any, xfails: Mapping[tuple[str, str, str], str]
) -> str | None:
    kind = "cpu" if device == "cpu" else "gpu"
    for backend in (f"{report_label}@{kind}", report_label):
        for scen in (result.scenario, result.name):
            reason = xfails.get((backend, scen, result.operator))
            if reason is not None:
                return reason
    return None


def assert_report(report: Report, xfails: Mapping[tuple[str, str, str], str] | None = None) -> None:
    """Fail on unexpected failures and on fixed known gaps (strict xfail); xfail on known gaps only."""
    import pytest

    xfails = xfails or {}
    expected, unexpected, fixed = [], [], []
    for r in report.results:
        comparison = " vs " in r.backend
        reason = None
        for part in r.backend.split(" vs "):
            reason = reason or _xfail_reason(part.split("@")[0], report.device, r, xfails)
        if reason is None:
            if not r.ok:
                unexpected.append(r)
        elif not r.ok:
            expected.append((r, reason))
        elif not comparison:  # a pair may agree even where one side has a known gap
            fixed.append((r, reason))
    if unexpected:
        lines = [f for r in unexpected for f in r.failures()]
        pytest.fail(f"{len(lines)} conformance failure(s):\n" + "\n".join(f"  {f}" for f in lines)
                    + f"\n\n{report}", pytrace=False)
    if fixed:
        pytest.fail("XPASS(strict): known gaps that now pass; remove them from XFAILS:\n"
                    + "\n".join(f"  ({r.backend!r}, {r.name!r}, {r.operator!r}): {why}" for r, why in fixed),
                    pytrace=False)
    if expected:
        pytest.xfail("; ".join(sorted({f"{r.name} {r.operator}: {why}" for r, why in expected})))


def device_comparison(cpu: Report, gpu: Report) -> Report:
    """GPU results against CPU results with :data:`DEVICE_RTOL`."""
    return compare_reports([cpu, gpu], rtol=DEVICE_RTOL, title=f"{gpu.backend}: {gpu.device} vs cpu")

"""The conformance grid: backend x device x dtype, from one parametrisation helper.

Backends: ``ABSTRACTDIFF_BACKENDS=torch,jax`` (or ``--ad-backend NAME``) selects them and
makes each one required (one that cannot load fails the run); by default every
available backend runs and an unavailable one is skipped with the reason.  Devices: cpu,
and gpu where the backend sees one (skipped with the reason otherwise).
"""

from __future__ import annotations

from typing import Any

from abstractdiff.testing._grid import backend_names, gen_params


def pytest_generate_tests(metafunc: Any) -> None:
    config = metafunc.config
    if "ad_case" in metafunc.fixturenames:
        metafunc.parametrize("ad_case", gen_params(config))
    if "ad_implicit_case" in metafunc.fixturenames:
        metafunc.parametrize("ad_implicit_case", gen_params(config, implicit=True))
    if "ad_backend_name" in metafunc.fixturenames:
        metafunc.parametrize("ad_backend_name", backend_names(config)[0])
    if "ad_dtype" in metafunc.fixturenames:
        metafunc.parametrize("ad_dtype", ["float64", "float32"])

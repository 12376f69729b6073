"""pytest plugin (entry point ``pytest11``): options for the abstractdiff conformance suite.

``--ad-backend NAME`` (repeatable) selects the backends to test; the
``ABSTRACTDIFF_BACKENDS`` environment variable (comma-separated) does the same.  A
selected backend that cannot load fails the run.  An adapter author runs the packaged
suite on their backend with::

    pytest --pyargs abstractdiff.testing.suite --ad-backend NAME

(the backend registered by an ``abstractdiff.backends`` entry point, or by a
``conftest.py`` that calls ``ad.register_backend``).
"""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("abstractdiff")
    group.addoption(
        "--ad-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the abstractdiff conformance suite on this backend (repeatable; also "
        "ABSTRACTDIFF_BACKENDS=a,b). A selected backend that cannot load fails the run.",
    )


def pytest_report_header(config: Any) -> list[str]:
    from ._grid import ENV, requested_backends

    names = requested_backends(config)
    if names:
        return [f"abstractdiff backends (asked for, must load): {', '.join(names)}"]
    return [f"abstractdiff backends: every available one (select with --ad-backend NAME or {ENV})"]

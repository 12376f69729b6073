"""pytest plugin (entry point ``pytest11``): ``--ad-backend NAME`` selects backends to test."""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("abstractdiff")
    group.addoption(
        "--ad-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the abstractdiff conformance suite on this backend (repeatable)",
    )

"""Fixtures shared by the core unit tests (no AD library needed)."""

from __future__ import annotations

import pytest

import abstractdiff as ad
from abstractdiff import _registry


@pytest.fixture
def fd() -> ad.Backend:
    return ad.backend("finite_differences")


@pytest.fixture
def clean_registry():
    """Undo every registration a test makes (names and shared instances)."""
    saved_registry = dict(_registry._registry)
    saved_instances = dict(_registry._instances)
    yield _registry
    _registry._registry.clear()
    _registry._registry.update(saved_registry)
    _registry._instances.clear()
    _registry._instances.update(saved_instances)

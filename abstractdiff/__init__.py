"""abstractdiff: one interface to every Python automatic-differentiation library.

>>> import abstractdiff as ad, numpy as np
>>> b = ad.backend("finite_differences")
>>> np.round(ad.gradient(b, lambda x: (x**2).sum(), np.array([1.0, 2.0])), 6)
array([2., 4.])

Importing this package imports no AD library: each adapter loads its library when its
backend is first created.
"""

from __future__ import annotations

from ._backend import Backend
from ._convert import to_numpy
from ._errors import (
    AbstractDiffError,
    BackendUnavailableError,
    CheckpointError,
    DeviceError,
    InvalidOutputError,
    ModeMismatchError,
    NonDifferentiableInputError,
    NonFiniteError,
    NonScalarOutputError,
    ShapeMismatchError,
    TracedControlFlowError,
    UnknownBackendError,
)
from ._operators import (
    derivative,
    gradient,
    hessian,
    hvp,
    jacobian,
    pullback,
    pushforward,
    value_and_gradient,
    value_and_pullback,
    value_and_pushforward,
)
from ._registry import available_backends, backend, register_backend, registered_backends

__version__ = "0.1.0"

__all__ = [
    "AbstractDiffError",
    "Backend",
    "BackendUnavailableError",
    "CheckpointError",
    "DeviceError",
    "InvalidOutputError",
    "ModeMismatchError",
    "NonDifferentiableInputError",
    "NonFiniteError",
    "NonScalarOutputError",
    "ShapeMismatchError",
    "TracedControlFlowError",
    "UnknownBackendError",
    "available_backends",
    "backend",
    "derivative",
    "gradient",
    "hessian",
    "hvp",
    "jacobian",
    "pullback",
    "pushforward",
    "register_backend",
    "registered_backends",
    "to_numpy",
    "value_and_gradient",
    "value_and_pullback",
    "value_and_pushforward",
]

"""abstractdiff: one interface to every Python automatic-differentiation library.

>>> import abstractdiff as ad, numpy as np
>>> b = ad.backend("finite_differences")
>>> np.round(ad.gradient(b, lambda x: (x**2).sum(), np.array([1.0, 2.0])), 6)
array([2., 4.])

Importing this package imports no AD library: each adapter loads its library when its
backend is first created.
"""

from __future__ import annotations

from . import _operators, _prepare
from ._backend import Backend
from ._batch import Batch
from ._cache import CacheInfo, cache_info, clear_caches
from ._compose import differentiate_with
from ._convert import to_numpy
from ._errors import (
    AbstractDiffError,
    ArgumentTypeError,
    BackendUnavailableError,
    CheckpointError,
    CollectedError,
    CompositionError,
    CustomRuleError,
    DeviceError,
    DistributedError,
    FiniteDifferenceAccuracyError,
    InvalidArgumentError,
    InvalidOutputError,
    LoopDerivativeError,
    ModeMismatchError,
    NonDifferentiableInputError,
    NonFiniteError,
    NonFiniteInputError,
    NonScalarOutputError,
    ShapeMismatchError,
    SparsityDetectionError,
    SparsityPatternError,
    TracedControlFlowError,
    UnknownBackendError,
    UnknownVariableError,
)

# the operators and their prepare_ twins: __all__ takes their names from the operator table
from ._operators import (  # noqa: F401 (in __all__ through the module's)
    derivative,
    gradient,
    gradient_and_hvp,
    hessian,
    hvp,
    jacobian,
    pullback,
    pushforward,
    second_derivative,
    value_and_derivative,
    value_and_gradient,
    value_and_jacobian,
    value_and_pullback,
    value_and_pushforward,
    value_derivative_and_second_derivative,
    value_gradient_and_hessian,
)
from ._prepare import (  # noqa: F401 (as above; already imported by the backend module)
    prepare_derivative,
    prepare_gradient,
    prepare_gradient_and_hvp,
    prepare_hessian,
    prepare_hvp,
    prepare_jacobian,
    prepare_pullback,
    prepare_pushforward,
    prepare_second_derivative,
    prepare_value_and_derivative,
    prepare_value_and_gradient,
    prepare_value_and_jacobian,
    prepare_value_and_pullback,
    prepare_value_and_pushforward,
    prepare_value_derivative_and_second_derivative,
    prepare_value_gradient_and_hessian,
)
from ._registry import available_backends, backend, register_backend, registered_backends
from ._scope import scope
from ._tree import register_pytree_node

__version__ = "0.1.0"

# Features in their own modules, loaded on first attribute access so that importing
# abstractdiff stays cheap (see benchmarks/import_time.py).
_LAZY = {
    "Params": "abstractdiff._implicit",
    "Grads": "abstractdiff._implicit",
    "Variable": "abstractdiff._implicit",
    "variables": "abstractdiff._implicit",
    "Implicit": "abstractdiff._implicit_backend",
    "SecondOrder": "abstractdiff._second_order",
    "Sparse": "abstractdiff._sparse",
    "jacobian_sparsity": "abstractdiff._sparsity",
    "hessian_sparsity": "abstractdiff._sparsity",
    "train_step": "abstractdiff._train",
    "train": "abstractdiff._train",
    "save_checkpoint": "abstractdiff._checkpoint",
    "load_checkpoint": "abstractdiff._checkpoint",
    "StepInfo": "abstractdiff._train",
    "EpochInfo": "abstractdiff._train",
    "History": "abstractdiff._train",
    "TrainResult": "abstractdiff._train",
    "CompileFallbackWarning": "abstractdiff._compiled_step",
    "Callback": "abstractdiff.callbacks",
    "EarlyStopping": "abstractdiff.callbacks",
    "Checkpoint": "abstractdiff.callbacks",
    "DataParallel": "abstractdiff._distributed",
    "custom_vjp": "abstractdiff._custom",
    "custom_jvp": "abstractdiff._custom",
    "stop_gradient": "abstractdiff._custom",
    "custom_root": "abstractdiff._implicit_diff",
    "custom_fixed_point": "abstractdiff._implicit_diff",
    "jacobian_operator": "abstractdiff._linear_operator",
    "hessian_operator": "abstractdiff._linear_operator",
    "fori_loop": "abstractdiff._loops",
    "scan": "abstractdiff._loops",
    "while_loop": "abstractdiff._loops",
}
_SUBMODULES = ("optim", "testing", "callbacks")


def __getattr__(name: str):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"abstractdiff.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'abstractdiff' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))

__all__ = [
    "AbstractDiffError",
    "scope",
    "ArgumentTypeError",
    "Batch",
    "DataParallel",
    "FiniteDifferenceAccuracyError",
    "InvalidArgumentError",
    "UnknownVariableError",
    "Grads",
    "Implicit",
    "SecondOrder",
    "Sparse",
    "jacobian_sparsity",
    "hessian_sparsity",
    "jacobian_operator",
    "hessian_operator",
    "Params",
    "Variable",
    "load_checkpoint",
    "optim",
    "StepInfo",
    "EpochInfo",
    "History",
    "TrainResult",
    "CompileFallbackWarning",
    "Callback",
    "EarlyStopping",
    "Checkpoint",
    "save_checkpoint",
    "testing",
    "train",
    "train_step",
    "variables",
    "Backend",
    "BackendUnavailableError",
    "CheckpointError",
    "CollectedError",
    "CompositionError",
    "CustomRuleError",
    "custom_fixed_point",
    "custom_jvp",
    "custom_root",
    "custom_vjp",
    "DeviceError",
    "DistributedError",
    "InvalidOutputError",
    "LoopDerivativeError",
    "fori_loop",
    "scan",
    "while_loop",
    "ModeMismatchError",
    "NonDifferentiableInputError",
    "NonFiniteError",
    "NonFiniteInputError",
    "NonScalarOutputError",
    "ShapeMismatchError",
    "SparsityDetectionError",
    "SparsityPatternError",
    "stop_gradient",
    "TracedControlFlowError",
    "UnknownBackendError",
    "available_backends",
    "backend",
    "CacheInfo",
    "cache_info",
    "clear_caches",
    "differentiate_with",
    "register_backend",
    "register_pytree_node",
    "registered_backends",
    "to_numpy",
    *_operators.__all__,
    *_prepare.__all__,
]

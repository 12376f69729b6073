"""The internal API abstractdiff's features build on: the one module that sparse AD
(``_sparse``, ``_sparsity``, ``_coloring``), training (``train_step``, ``train``, ``optim``,
checkpoints, ``DataParallel``, ``parity``, callbacks), ``testing`` and the CLI import
besides the public API.  Everything else in the package's private modules is the core's
own business and may change without touching a feature; ``tests/test_layering.py`` checks
that no feature reaches past this module.

What it offers, by subject:

* **arrays**: ``ar`` (autoray's ``do`` for a library's arrays), ``shape_of``, ``size_of``,
  ``dtype_name``, ``is_array``, ``is_float_dtype``, ``is_float_leaf``, ``content_of``,
  ``to_numpy``;
* **pytrees**: ``pytree`` (flattening with paths, optree's namespace),
  ``register_pytree_node``;
* **the flat function and its plans**: ``FlatFunction`` (``f(x, *args)`` as
  ``fn(xs, data)``), ``PlanCache``, ``artefacts``, ``GradientFunction``, ``PackedInput``,
  ``function_identity``, ``weak_callable``;
* **preparation**: ``prepare`` (the module of ``prepare_*``), ``Preparation`` and the
  Jacobian and Hessian preparations the sparse ones extend;
* **caches**: ``LRU``, ``WeakLRU``, ``Memo`` (every cache registered: ``ad.cache_info()``),
  ``value_key`` (the one keying policy), ``captures`` and ``CaptureWatch`` (values ``f``
  reads from globals and closures);
* **backends and variables**: ``Backend``, ``backend``, ``backend_for``,
  ``available_backends``, ``installed_backends``, ``unavailable_reason``, ``Implicit``,
  ``HOOKS``, ``approximates``, ``forwarded`` (a combinator's method that calls its inner
  backend's), ``scope``, ``Params``, ``Grads``, ``variables``, ``current_values``,
  ``model_variables``, ``model_state_variables``, ``variable_owner``,
  ``is_library_variable``, ``is_variable_or_model``;
* **the operator table**: ``OPERATORS``, ``operators_where``;
* **errors**: the public exception classes (also ``ad.<name>``).
"""

from __future__ import annotations

from . import _prepare as prepare
from . import _pytree as pytree
from ._arrays import ar, dtype_name, shape_of, size_of
from ._backend import Backend
from ._cache import LRU, Memo, WeakLRU, value_key
from ._captures import CaptureWatch, captures
from ._convert import content_of, to_numpy
from ._derived import GradientFunction, PackedInput
from ._errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    CheckpointError,
    CollectedError,
    CustomRuleError,
    DistributedError,
    InvalidArgumentError,
    ModeMismatchError,
    NonFiniteError,
    NonScalarOutputError,
    ShapeMismatchError,
    SparsityDetectionError,
    SparsityPatternError,
    UnknownBackendError,
    UnknownVariableError,
)
from ._hooks import HOOKS, approximates
from ._implicit import (
    Grads,
    Params,
    current_values,
    is_library_variable,
    is_variable_or_model,
    model_state_variables,
    model_variables,
    variable_owner,
    variables,
)
from ._implicit_backend import Implicit
from ._operator_table import OPERATORS, operators_where
from ._prepare import HessianPrep, JacobianPrep, Preparation, PreparedHessian, PreparedJacobian
from ._registry import available_backends, backend, backend_for, installed_backends, unavailable_reason
from ._scope import scope
from ._second_order import _forwarded as forwarded
from ._tree import FlatFunction, PlanCache, artefacts, is_array, is_float_dtype, is_float_leaf, register_pytree_node
from ._tree import _function_identity as function_identity
from ._tree import _weak_callable as weak_callable

__all__ = [
    "HOOKS", "LRU", "OPERATORS", "ArgumentTypeError", "Backend", "BackendUnavailableError", "CaptureWatch",
    "CheckpointError", "CollectedError", "CustomRuleError", "DistributedError", "FlatFunction", "GradientFunction",
    "Grads", "HessianPrep", "Implicit", "InvalidArgumentError", "JacobianPrep", "Memo", "ModeMismatchError",
    "NonFiniteError", "NonScalarOutputError", "PackedInput", "Params", "PlanCache", "Preparation", "PreparedHessian",
    "PreparedJacobian", "ShapeMismatchError", "SparsityDetectionError", "SparsityPatternError", "UnknownBackendError",
    "UnknownVariableError", "WeakLRU", "approximates", "ar", "artefacts", "available_backends", "backend",
    "backend_for", "captures", "content_of", "current_values", "dtype_name", "forwarded", "function_identity",
    "installed_backends", "is_array", "is_float_dtype", "is_float_leaf", "is_library_variable",
    "is_variable_or_model", "model_state_variables", "model_variables", "operators_where", "prepare", "pytree",
    "register_pytree_node", "scope", "shape_of", "size_of", "to_numpy", "unavailable_reason", "value_key",
    "variable_owner", "variables", "weak_callable",
]

"""Conversion of any backend's arrays (and variables) back to numpy."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _pytree as pytree

__all__ = ["to_numpy"]


def _leaf_to_numpy(a: Any) -> Any:
    if type(a) is np.ndarray:
        return a
    if isinstance(a, np.generic):
        return np.asarray(a)
    boxed = getattr(a, "_abstractdiff_variable_value", None)  # ad.Variable
    if boxed is not None:
        return _leaf_to_numpy(boxed())
    from ._registry import backend_for

    owner = backend_for(a)  # the adapter of a's library knows how (torch detaches, ...)
    if owner is not None:
        # arrays and variables; a model (an nn.Module) is left as it is, like any other object
        return owner.to_numpy(a) if owner.is_native(a) or owner.is_variable(a) else a
    if isinstance(a, np.ndarray) or hasattr(a, "__array__") or (hasattr(a, "shape") and hasattr(a, "dtype")):
        return np.asarray(a)
    return a  # ints, strings and other static leaves are left as they are


def to_numpy(tree: Any) -> Any:
    """Convert every array (or variable) leaf of ``tree`` to a numpy array.

    ``to_numpy(tree) -> tree`` of the same structure.  Each leaf is converted by the
    adapter of its library (found by its type: torch tensors, also ones that require
    grad or live on a GPU, jax arrays, tensorflow tensors and variables, autograd values,
    a third-party adapter's arrays), ``ad.Variable`` boxes by their value, numpy as it
    is; non-array leaves (ints, strings, None) are returned unchanged.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> ad.to_numpy({"w": np.ones(2), "n": 3})
        {'w': array([1., 1.]), 'n': 3}
    """
    return pytree.tree_map(_leaf_to_numpy, tree)


def content_of(a: Any) -> np.ndarray | None:
    """``a``'s values as a numpy array, for keying a cache on them (:func:`abstractdiff._cache.value_key`'s
    ``native``), or ``None`` when ``a`` is no array or has no concrete values (a jax tracer
    inside ``jit``, a symbolic PyTensor variable): the caller then keys it by identity."""
    if isinstance(a, (np.ndarray, np.generic)):
        return np.asarray(a)
    try:
        out = _leaf_to_numpy(a)
    except Exception:  # a traced value: no concrete content to key on
        return None
    return out if isinstance(out, np.ndarray) else None

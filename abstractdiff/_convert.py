"""Conversion of any backend's arrays (and variables) back to numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
import optree

__all__ = ["to_numpy"]


def _leaf_to_numpy(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, np.generic):
        return np.asarray(a)
    boxed = getattr(a, "_abstractdiff_variable_value", None)  # ad.Variable
    if boxed is not None:
        return _leaf_to_numpy(boxed())
    module = type(a).__module__.partition(".")[0]
    if module == "torch":
        a = a.detach().cpu()
        if a.dtype == _torch_bfloat16(a):
            # numpy has no bfloat16 of its own: ml_dtypes' (shipped with jax and
            # tensorflow) keeps the dtype; without it, widen to float32 exactly.
            try:
                import ml_dtypes
            except ImportError:
                return a.float().numpy()
            return a.float().numpy().astype(ml_dtypes.bfloat16)
        return a.numpy()
    if module == "autograd":  # ArrayBox: unwrap to the primal value
        while hasattr(a, "_value"):
            a = a._value
        return np.asarray(a)
    if hasattr(a, "numpy") and module in ("tensorflow", "keras", "tf_keras"):
        return np.asarray(a.numpy())
    if hasattr(a, "__array__") or (hasattr(a, "shape") and hasattr(a, "dtype")):
        return np.asarray(a)
    return a  # ints, strings and other static leaves are left as they are


def _torch_bfloat16(t: Any) -> Any:
    import torch  # already imported: t is a torch tensor

    return torch.bfloat16


def to_numpy(tree: Any) -> Any:
    """Convert every array (or variable) leaf of ``tree`` to a numpy array.

    ``to_numpy(tree) -> tree`` of the same structure. Works on torch tensors (also ones
    that require grad, and on GPU), jax arrays, tensorflow tensors and variables,
    autograd values, ``ad.Variable`` boxes and plain numpy; non-array leaves (ints,
    strings, None) are returned unchanged.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> ad.to_numpy({"w": np.ones(2), "n": 3})
        {'w': array([1., 1.]), 'n': 3}
    """
    return optree.tree_map(_leaf_to_numpy, tree)

"""Small array helpers the core uses on any library's arrays (duck-typed, via autoray)."""

from __future__ import annotations

import math
from typing import Any

from ._errors import NonScalarOutputError


def ar() -> Any:
    """autoray, imported on first use: it costs ~90 ms to import, abstractdiff must not."""
    import autoray

    return autoray


def shape_of(a: Any) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in a.shape)
    except TypeError:  # a symbolic shape (PyTensor's x.shape is a graph): the static one autoray reads
        return tuple(int(d) for d in ar().shape(a))


def size_of(a: Any) -> int:
    return math.prod(shape_of(a))


def dtype_name(a: Any) -> str:
    return ar().get_dtype_name(a)


def signature(*groups: Any) -> tuple:
    """``((shape, dtype), ...)`` of every array of ``groups``, in order: what a library's trace
    of a function depends on (the key of its compiled variants)."""
    return tuple((tuple(a.shape), a.dtype) for group in groups for a in group)


def bfloat16_numpy(widened: Any) -> Any:
    """bfloat16 values read out as float32 numpy, in ml_dtypes' bfloat16 where it is installed
    (numpy has no bfloat16 of its own; jax and tensorflow ship ml_dtypes), else left float32,
    which holds them exactly."""
    try:
        import ml_dtypes
    except ImportError:
        return widened
    return widened.astype(ml_dtypes.bfloat16)


def check_scalar(y: Any, operator: str = "gradient") -> None:
    if y.shape == ():  # the common case, cheaply (library shape objects compare to ())
        return
    shape = shape_of(y)
    if shape != ():
        raise NonScalarOutputError(
            f"{operator} needs f to return a scalar (shape ()), but f returned an array of "
            f"shape {shape}; reduce it to a scalar (e.g. .sum()), or use jacobian, pullback "
            f"or pushforward for vector-valued functions"
        )

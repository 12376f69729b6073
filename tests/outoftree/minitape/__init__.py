"""minitape: a small array library with its own tape-based reverse mode.

An out-of-tree test library for abstractdiff: the core has never heard of it.  Arrays
wrap numpy arrays; operations on arrays that require grad are recorded, and
:func:`grad` differentiates them, also a second time (every derivative rule is written
with minitape operations).  Module-level functions mirror numpy's names, so
``autoray.do("sum", a)`` dispatches here.

    >>> import minitape as mt
    >>> x = mt.Array([1.0, 2.0], requires_grad=True)
    >>> y = mt.sum(x ** 3)
    >>> (g,) = mt.grad(y, [x], create_graph=True)
    >>> g
    minitape.Array([ 3., 12.], dtype=float64, requires_grad=True)
    >>> mt.grad(mt.sum(g), [x])[0]        # second derivative: 6 x
    minitape.Array([ 6., 12.], dtype=float64)
"""

from __future__ import annotations

import numpy as _np

from ._core import (
    Array,
    abs,
    absolute,
    add,
    all,
    amax,
    any,
    arange,
    array,
    asarray,
    astype,
    broadcast_to,
    clip,
    concatenate,
    cos,
    divide,
    dot,
    enable_grad,
    exp,
    expand_dims,
    eye,
    full,
    grad,
    is_grad_enabled,
    isfinite,
    log,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    multiply,
    ndim,
    negative,
    no_grad,
    ones,
    ones_like,
    outer,
    power,
    prod,
    reshape,
    shape,
    sign,
    sin,
    size,
    sqrt,
    squeeze,
    stack,
    subtract,
    sum,
    swapaxes,
    take,
    tanh,
    to_numpy,
    transpose,
    where,
    zeros,
    zeros_like,
)
from ._nn import MLP, Linear, Module, Parameter

__version__ = "0.1"

# dtypes by name, as numpy spells them (autoray's astype looks them up here)
float16, float32, float64 = _np.dtype("float16"), _np.dtype("float32"), _np.dtype("float64")
int32, int64, bool_ = _np.dtype("int32"), _np.dtype("int64"), _np.dtype("bool")

__all__ = [
    "MLP", "Array", "Linear", "Module", "Parameter", "abs", "absolute", "add", "all", "amax", "any", "arange",
    "array", "asarray", "astype", "broadcast_to", "clip", "concatenate", "cos", "divide", "dot", "enable_grad",
    "exp", "expand_dims", "eye", "full", "grad", "is_grad_enabled", "isfinite", "log", "matmul", "max", "maximum",
    "mean", "min", "minimum", "multiply", "ndim", "negative", "no_grad", "ones", "ones_like", "outer", "power",
    "prod", "reshape", "shape", "sign", "sin", "size", "sqrt", "squeeze", "stack", "subtract", "sum", "swapaxes",
    "take", "tanh", "to_numpy", "transpose", "where", "zeros", "zeros_like",
]


def _register_with_autoray() -> None:
    """autoray finds most functions as attributes of this module by their numpy names;
    its composed functions (``astype``, ``to_numpy``...) get minitape's own versions."""
    try:
        import autoray
    except ImportError:  # pragma: no cover - autoray is optional for minitape itself
        return
    for name in ("astype", "to_numpy", "shape", "ndim", "size"):
        autoray.register_function("minitape", name, globals()[name])


_register_with_autoray()

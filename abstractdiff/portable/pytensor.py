"""PyTensor's translations of numpy/scipy calls (docs/guide/portable.md): the calls
``pytensor.tensor`` lacks or takes differently, each taking numpy's/scipy's arguments and
built from PyTensor ops that PyTensor differentiates (twice, for the Hessian) and that keep
the dtype.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .._errors import InvalidArgumentError
from . import Table


def translations() -> Table:
    import pytensor.tensor as pt  # imported here: importing this module imports nothing heavy
    from pytensor.tensor import special

    def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
        if b is not None or return_sign:
            raise NotImplementedError("logsumexp's b= and return_sign= are not supported on PyTensor tensors")
        return pt.logsumexp(a, axis=axis, keepdims=keepdims)

    def log_softmax(x, axis=None):
        return x - pt.logsumexp(x, axis=axis, keepdims=True)

    def softmax(x, axis=None):
        return pt.exp(log_softmax(x, axis=axis))

    def xlogy(x, y):
        zero = pt.eq(x, 0)
        return pt.switch(zero, pt.zeros_like(x), x * pt.log(pt.switch(zero, pt.ones_like(y), y)))

    def unary(op: Callable) -> Callable:
        def numpy_like(x):
            return op(x)

        return numpy_like

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        return pt.linalg.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit_diagonal)

    def norm(x, ord=None, axis=None, keepdims=False):
        # pytensor's norm over an axis differentiates through a complex abs, which its grad
        # refuses: the 2-norm (Frobenius for matrices) of real arrays as sqrt(sum(x**2))
        x = pt.as_tensor_variable(x)
        vector = axis is None and x.ndim == 1 or isinstance(axis, int) or axis is not None and len(axis) == 1
        if x.dtype.startswith("float") and (ord is None or ord == "fro" and not vector or ord == 2 and vector):
            return pt.sqrt(pt.sum(x * x, axis=axis, keepdims=keepdims))
        return pt.linalg.norm(x, ord=ord, axis=axis, keepdims=keepdims)

    def prod(a, axis=None, dtype=None, out=None, keepdims=False):
        # pytensor's prod has no second derivative (its gradient op has none): a balanced
        # tree of products over the (static) reduced size, exact with zeros, any order
        if dtype is not None or out is not None:
            raise NotImplementedError("prod's dtype= and out= are not supported on PyTensor tensors")
        a = pt.as_tensor_variable(a)
        axes = tuple(range(a.ndim)) if axis is None else (axis,) if isinstance(axis, int) else tuple(axis)
        axes = tuple(ax % a.ndim for ax in axes) if a.ndim else ()
        sizes = [a.type.shape[ax] for ax in axes]
        if any(n is None for n in sizes):  # a size known only at run time
            return pt.prod(a, axis=axis, keepdims=keepdims)
        n = int(np.prod(sizes))
        rest = [a.type.shape[d] for d in range(a.ndim) if d not in axes]
        flat = pt.moveaxis(a, axes, tuple(range(len(axes)))).reshape((n, *rest)) if axes else a[None]
        while n > 1:
            half, odd = divmod(n, 2)
            paired = flat[:half] * flat[half : 2 * half]
            flat = pt.concatenate([paired, flat[2 * half :]]) if odd else paired
            n = half + odd
        result = flat[0] if n == 1 else pt.ones(rest, dtype=a.dtype)
        return pt.expand_dims(result, axes) if keepdims else result

    def split(ary, indices_or_sections, axis=0):
        size = ary.type.shape[axis]
        if isinstance(indices_or_sections, int):
            if size is None or size % indices_or_sections:
                raise InvalidArgumentError(
                    f"array split does not result in an equal division ({size} by {indices_or_sections})"
                )
            step = size // indices_or_sections
            bounds = list(range(0, size + 1, step))
        else:
            bounds = [0, *indices_or_sections, size]
        axis = axis % ary.ndim
        return [ary[(slice(None),) * axis + (slice(lo, hi),)] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def asarray(a, dtype=None, order=None):
        a = pt.as_tensor_variable(a)
        return a if dtype is None else a.astype(dtype)

    def hypot(x1, x2):
        return pt.sqrt(x1 * x1 + x2 * x2)

    def kron(a, b):
        return pt.linalg.kron(a, b)

    def ravel(a, order="C"):
        return pt.flatten(a)

    def copy(a, order="K", subok=False):
        # pytensor.tensor has no copy; a graph's values are never written in place, so the
        # identity is a copy (and differentiable)
        return pt.as_tensor_variable(a).copy()

    functions = {
        "scipy.special.logsumexp": logsumexp,
        "scipy.special.erf": unary(pt.erf),
        "scipy.special.erfc": unary(pt.erfc),
        "scipy.special.expit": unary(pt.sigmoid),
        "scipy.special.logit": unary(special.logit),
        "scipy.special.gammaln": unary(pt.gammaln),
        "scipy.special.digamma": unary(pt.digamma),
        "scipy.special.xlogy": xlogy,
        "scipy.special.softmax": softmax,
        "scipy.special.log_softmax": log_softmax,
        "scipy.linalg.solve_triangular": solve_triangular,
        "linalg.norm": norm,
        "prod": prod,
        "split": split,
        "asarray": asarray,
        "hypot": hypot,
        "kron": kron,
        "ravel": ravel,
        "copy": copy,
    }
    return Table("pytensor", functions=functions)

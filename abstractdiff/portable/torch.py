"""PyTorch's translations of numpy/scipy calls (docs/guide/portable.md): names torch lacks or
takes differently (``dim`` for ``axis``, ``correction=1`` for ``ddof=0``, ``upper=`` for
``lower=``, scipy's functions in ``torch.special``, a Python scalar where torch wants a
tensor), and two of autoray's own translations that lose a derivative or misread numpy's
arguments (``copy``, ``pad``).  Each takes numpy's/scipy's arguments and is built from
differentiable torch ops that keep dtype and device.
"""

from __future__ import annotations

from typing import Any, Callable

from . import Table


def translations() -> Table:
    import numpy as np
    import torch  # imported here: importing this module imports nothing heavy

    def like(value: Any, ref: torch.Tensor) -> torch.Tensor:
        """A Python or numpy scalar as a tensor of ``ref``'s dtype and device (numpy's weak scalars)."""
        if isinstance(value, torch.Tensor):
            return value
        return torch.as_tensor(value, dtype=ref.dtype, device=ref.device)

    def logsumexp(a, axis=None, keepdims=False):
        if axis is None:
            out = torch.logsumexp(a.reshape(-1), 0)
            return out.reshape((1,) * a.ndim) if keepdims else out
        return torch.logsumexp(a, dim=axis, keepdim=keepdims)

    def log_softmax(x, axis=None):
        return x - logsumexp(x, axis=axis, keepdims=True)

    def softmax(x, axis=None):
        return torch.exp(log_softmax(x, axis=axis))

    def moment(op: Callable) -> Callable:
        # numpy's ddof=0 by default; torch.std/var default to correction=1.
        def numpy_like(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
            if dtype is not None or out is not None:
                raise NotImplementedError("dtype= and out= are not supported on torch tensors")
            return op(a, dim=axis, correction=ddof, keepdim=keepdims)

        return numpy_like

    def roll(a, shift, axis=None):
        if axis is None:
            return torch.roll(a, shifts=shift)
        return torch.roll(a, shifts=shift, dims=axis)

    def dot(a, b):
        # numpy.dot: a product with a 0-d array, else a sum over a's last axis and b's
        # second-to-last (its only one for a vector); torch.dot takes vectors only.
        b = like(b, a)
        if a.ndim == 0 or b.ndim == 0:
            return a * b
        return torch.tensordot(a, b, dims=([a.ndim - 1], [max(b.ndim - 2, 0)]))

    def repeat(a, repeats, axis=None):
        if not isinstance(repeats, int):
            repeats = torch.as_tensor(repeats, device=a.device)
        return torch.repeat_interleave(a, repeats, dim=axis)

    def scalar_second(op: Callable) -> Callable:
        # numpy takes a Python scalar second argument (np.maximum(x, 0.0)); torch wants a tensor.
        def numpy_like(x1, x2, *args, **kwargs):
            return op(x1, like(x2, x1), *args, **kwargs)

        return numpy_like

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        if trans in (1, "T"):
            a, lower = a.mT, not lower
        elif trans in (2, "C"):
            a, lower = a.mH, not lower
        vector = b.ndim == 1  # scipy takes a vector right-hand side, torch a matrix
        x = torch.linalg.solve_triangular(a, b.unsqueeze(-1) if vector else b, upper=not lower,
                                          unitriangular=unit_diagonal)
        return x.squeeze(-1) if vector else x

    def unary(op: Callable) -> Callable:
        # a function of this module (the portable table's test finds its translations by
        # __module__), calling torch.special's builtin
        def numpy_like(x):
            return op(x)

        return numpy_like

    def copy(a, order="K", subok=False):
        # autoray's own torch copy is detach().clone(): a derivative through it would be
        # silently zero.  clone() is differentiable, and a copy all the same.
        return a.clone()

    def pad(array, pad_width, mode="constant", constant_values=0):
        # numpy's widths: an int, one (before, after) pair for every axis, or a pair per axis
        # (np.pad broadcasts them to (ndim, 2)); torch wants them flat, last axis first.
        # autoray's own translation reads a flat pair (1, 2) as two pairs and fails.
        if mode != "constant":
            raise NotImplementedError(f"pad mode={mode!r} is not supported on torch tensors (only 'constant')")
        widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64), (array.ndim, 2))
        flat = tuple(int(w) for pair in widths[::-1] for w in pair)
        return torch.nn.functional.pad(array, flat, mode="constant", value=constant_values)

    def logit(x):
        return torch.special.logit(x)

    def xlogy(x, y):
        return torch.special.xlogy(x, like(y, x))

    functions = {
        "logsumexp": logsumexp,
        "scipy.special.logsumexp": logsumexp,
        "std": moment(torch.std),
        "var": moment(torch.var),
        "roll": roll,
        "copy": copy,
        "pad": pad,
        "dot": dot,
        "repeat": repeat,
        "linalg.solve_triangular": solve_triangular,
        "scipy.linalg.solve_triangular": solve_triangular,
        "scipy.special.erf": unary(torch.special.erf),
        "scipy.special.erfc": unary(torch.special.erfc),
        "scipy.special.expit": unary(torch.special.expit),
        "scipy.special.logit": logit,
        "scipy.special.gammaln": unary(torch.special.gammaln),
        "scipy.special.digamma": unary(torch.special.digamma),
        "scipy.special.xlogy": xlogy,
        "scipy.special.softmax": softmax,
        "scipy.special.log_softmax": log_softmax,
    }
    # wrappers of autoray's own function of that name
    wrapped = {name: scalar_second for name in ("maximum", "minimum", "logaddexp", "logaddexp2", "arctan2", "hypot")}
    return Table("torch", functions=functions, wrapped=wrapped)

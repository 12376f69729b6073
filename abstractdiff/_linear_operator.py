"""Matrix-free derivatives for scipy: ``ad.jacobian_operator`` and ``ad.hessian_operator``.

AbstractDifferentiation.jl's ``lazy_jacobian``/``lazy_hessian`` as
``scipy.sparse.linalg.LinearOperator`` objects, for scipy's Krylov solvers (``cg``,
``minres``, ``gmres``, ``lsqr``), ``eigsh`` and the trust-region optimisers
(``minimize(..., method="trust-krylov", hessp=...)``), on any backend.  The operator acts
on the float leaves of ``x`` raveled and concatenated in pytree order (and, for a Jacobian,
on the entries of ``f``'s one output array): numpy vectors cross, in ``x``'s float dtype.

An operator is the derivative at the point it was made at: it copies the arrays of ``x``
and ``args`` when it is made (:func:`_own`), so a later in-place write by the caller
(``x[...] = 2.0``) changes neither direction.  The derivative is linearised once (the
pullback when the operator is made, the pushforward or the prepared Hessian-vector product on
first use, all at that copy); each product is then one call of it, and ``matmat`` one batched
call (``ad.Batch``) where the operator is a Jacobian.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import _pytree as pytree
from ._backend import Backend
from ._batch import Batch
from ._convert import to_numpy
from ._errors import InvalidOutputError, NonDifferentiableInputError, ShapeMismatchError
from ._registry import backend as _get_backend
from ._tree import is_float_leaf

__all__ = ["hessian_operator", "jacobian_operator"]


def _own(tree: Any) -> Any:
    """``tree`` with each array leaf copied (containers rebuilt): the operator's own point.

    The pushforward and the Hessian-vector products are linearised lazily and take the point on
    each call, and numpy, torch, paddle, MLX and autograd arrays take in-place writes: without
    a copy, ``J @ v`` after the caller's ``x[...] = 2.0`` was the derivative at the new point
    and ``J.T @ u`` at the old one.  A copy, never a write into the caller's arrays; an object
    that is not an array (an options object, a model) is kept as it is."""
    import autoray

    def leaf(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.copy()
        if isinstance(v, (bool, int, float, complex, str, bytes, type(None), np.generic)):
            return v  # immutable
        if hasattr(v, "shape") and hasattr(v, "dtype"):  # another library's array (a tf.Variable too)
            try:
                return autoray.do("copy", v)
            except (AttributeError, ImportError, NotImplementedError, TypeError):
                return v  # a library autoray has no copy for: its arrays are kept as passed
        return v

    return pytree.tree_map(leaf, tree)


class _Raveled:
    """The float leaves of a pytree as one numpy vector, and a vector back as native leaves."""

    def __init__(self, b: Backend, tree: Any, what: str):
        self.b = b
        self.leaves, self.treedef = pytree.tree_flatten(tree)
        self.index = [i for i, a in enumerate(self.leaves) if is_float_leaf(a)]
        if not self.index:
            raise NonDifferentiableInputError(f"{what} has no floating-point leaf for a linear operator to act on")
        arrays = [np.asarray(to_numpy(self.leaves[i])) for i in self.index]
        self.shapes = [a.shape for a in arrays]
        self.sizes = [a.size for a in arrays]
        self.size = sum(self.sizes)
        self.dtype = np.result_type(*[a.dtype for a in arrays])
        self.dtypes = [a.dtype for a in arrays]
        self.what = what

    def ravel(self, tree: Any) -> np.ndarray:
        """A native pytree shaped like this one, as one vector (None leaves: zeros)."""
        leaves = self.treedef.flatten_up_to(tree)
        parts = [np.zeros(size, self.dtype) if leaves[i] is None
                 else np.asarray(to_numpy(leaves[i]), self.dtype).ravel() for i, size in zip(self.index, self.sizes)]
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return out if out.flags.writeable else out.copy()  # scipy's solvers write into products (gmres)

    def unravel(self, v: Any) -> Any:
        """Vector ``v`` as a pytree shaped like this one, in the backend's arrays (constants kept)."""
        v = np.asarray(v).reshape(-1)
        if v.size != self.size:
            raise ShapeMismatchError(f"a vector of size {v.size} for an operator on {self.what} of size {self.size}")
        leaves, start = list(self.leaves), 0
        for i, shape, size, dtype in zip(self.index, self.shapes, self.sizes, self.dtypes):
            leaves[i] = self.b.from_numpy(np.ascontiguousarray(v[start:start + size].reshape(shape), dtype=dtype))
            start += size
        return pytree.tree_unflatten(self.treedef, leaves)


def _linear_operator(shape: tuple[int, int], dtype: Any, matvec: Callable, rmatvec: Callable,
                     matmat: Callable | None = None) -> Any:
    from scipy.sparse.linalg import LinearOperator

    class _Operator(LinearOperator):
        def _matvec(self, v: Any) -> np.ndarray:
            return matvec(v)

        def _rmatvec(self, v: Any) -> np.ndarray:
            return rmatvec(v)

        def _matmat(self, m: Any) -> np.ndarray:
            m = np.asarray(m)
            if matmat is None or m.shape[1] == 0:
                return np.stack([matvec(m[:, k]) for k in range(m.shape[1])], axis=1)
            return matmat(m)

    return _Operator(dtype=dtype, shape=shape)


def jacobian_operator(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """The Jacobian of ``f`` at ``x`` as a ``scipy.sparse.linalg.LinearOperator``.

    ``jacobian_operator(b, f, x, *args) -> LinearOperator`` of shape ``(y.size, x.size)``
    over the float leaves of ``y = f(x, *args)`` and of ``x``, raveled in pytree order:
    ``matvec`` is the pushforward, ``rmatvec`` the pullback, ``matmat`` one batched
    pushforward (``ad.Batch``).  Vectors are numpy, in ``x``'s float dtype.  ``f`` returns one
    array (for a pytree, concatenate its raveled leaves in ``f``).  The operator is the
    Jacobian at ``x`` as it was when the operator was made: it keeps its own copy of the arrays
    of ``x`` and ``args``, so later in-place writes to them change neither direction.  The
    pullback is linearised when the operator is made, the pushforward on the first ``matvec``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> J = ad.jacobian_operator("finite_differences", lambda x: 3 * x, np.ones(2))
        >>> J.shape, np.round(J @ np.array([1.0, 0.0]), 6)
        ((2, 2), array([3., 0.]))
    """
    from ._operators import pushforward, value_and_pullback

    b = _get_backend(b) if isinstance(b, str) else b
    x, args = _own(x), _own(args)  # both directions at this point, whatever the caller writes later
    try:
        y, vjp = value_and_pullback(b, f, x, *args)
    except InvalidOutputError as e:
        # The operator's rows are the entries of one output array, as for ad.jacobian; say how
        # a pytree output fits (the scipy guide once promised pytree outputs).
        raise InvalidOutputError(
            f"ad.jacobian_operator: {e}. The operator's rows are the entries of f's one output array; "
            f"for a pytree output, concatenate its raveled leaves in f "
            f"(anp.concatenate([anp.reshape(v, (-1,)) for v in leaves]))"
        ) from e
    inputs = _Raveled(b, x, "x")
    outputs = _Raveled(b, y, "f's output")
    dtype = np.result_type(inputs.dtype, outputs.dtype)
    jvp: list = []  # the pushforward, linearised on first use

    def pushed() -> Callable[[Any], Any]:
        if not jvp:
            jvp.append(pushforward(b, f, x, *args))
        return jvp[0]

    def matvec(v: Any) -> np.ndarray:
        return outputs.ravel(pushed()(inputs.unravel(v))).astype(dtype, copy=False)

    def rmatvec(u: Any) -> np.ndarray:
        return inputs.ravel(vjp(outputs.unravel(u))).astype(dtype, copy=False)

    def matmat(m: np.ndarray) -> np.ndarray:
        columns = pushed()(Batch(*[inputs.unravel(m[:, k]) for k in range(m.shape[1])]))
        return np.stack([outputs.ravel(c) for c in columns], axis=1).astype(dtype, copy=False)

    return _linear_operator((outputs.size, inputs.size), dtype, matvec, rmatvec, matmat)


def hessian_operator(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """The Hessian of a scalar ``f`` at ``x`` as a ``scipy.sparse.linalg.LinearOperator``.

    ``hessian_operator(b, f, x, *args) -> LinearOperator`` of shape ``(x.size, x.size)``
    over the float leaves of ``x`` raveled in pytree order; ``matvec`` and ``rmatvec``
    (the Hessian is symmetric) are one call each of the prepared Hessian-vector product,
    prepared when the operator is made.  It is the Hessian at ``x`` as it was when the operator
    was made (its own copy of the arrays of ``x`` and ``args``).  For ``minres``, ``cg``,
    ``eigsh`` and ``scipy.optimize.minimize(..., hessp=lambda x, p: ...)``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> H = ad.hessian_operator("finite_differences", lambda x: (x**3).sum(), np.array([1.0, 2.0]))
        >>> np.round(H @ np.array([1.0, 1.0]), 4)
        array([ 6., 12.])
    """
    from ._prepare import prepare_hvp

    b = _get_backend(b) if isinstance(b, str) else b
    x, args = _own(x), _own(args)  # each product at this point, whatever the caller writes later
    inputs = _Raveled(b, x, "x")
    prepared = prepare_hvp(b, f, x, inputs.unravel(np.zeros(inputs.size)), *args)

    def matvec(v: Any) -> np.ndarray:
        return inputs.ravel(prepared(x, inputs.unravel(v), *args)).astype(inputs.dtype, copy=False)

    return _linear_operator((inputs.size, inputs.size), inputs.dtype, matvec, matvec)

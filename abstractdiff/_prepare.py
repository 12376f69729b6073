"""Prepared operators: do the per-function work once, then call many times.

``prepare_gradient(b, f, x, *args)`` flattens ``f(x, *args)``, classifies its leaves,
builds the flat function and asks the adapter for its fastest callable (a jitted
``value_and_grad``, a ``tf.function``...) once.  Each call then only flattens the new
inputs, checks that structure, shapes and dtypes still match the preparation (raising
:class:`~abstractdiff.ShapeMismatchError` otherwise: never silently wrong) and runs.
"""

from __future__ import annotations

from typing import Any, Callable

import optree

from ._backend import Backend, check_scalar, dtype_name, shape_of
from ._errors import ShapeMismatchError
from ._registry import backend as _get_backend
from ._tree import FlatFunction, _static_key, is_array

__all__ = ["prepare_gradient", "prepare_pullback", "prepare_value_and_gradient"]


def _signature(leaf: Any) -> tuple[Any, ...]:
    return (shape_of(leaf), dtype_name(leaf))


class _Prepared:
    """Common part of the prepared operators: the input check and conversion."""

    operator = "operator"

    def __init__(self, b: Backend | str, f: Callable[..., Any], x: Any, args: tuple, has_aux: bool = False):
        self.backend = b if isinstance(b, Backend) else _get_backend(b)
        self.has_aux = has_aux
        fn, xs, data = self.backend.flatten(f, x, args, has_aux)
        self.fn: FlatFunction = fn
        self.f = f  # fn holds f weakly (so the plan cache can drop it); the prepared operator keeps it
        self.n_x = fn.n_x_leaves
        self.diff_index = fn.diff_index
        self.data_index = fn.data_index
        leaves = optree.tree_leaves(x) + optree.tree_leaves(args)
        dynamic = set(fn.diff_index) | set(fn.data_index)
        # Static leaves are compared by the plan cache's key: exact bits for floats (-0.0 is
        # not 0.0), identity for unhashable objects.
        self.static = [(i, leaf, _static_key(leaf)) for i, leaf in enumerate(leaves) if i not in dynamic]
        self.x_signature = [_signature(v) for v in xs]
        self.data_signature = [_signature(v) for v in data]
        # The backend's own shape and dtype objects, compared as they are on the hot path;
        # the normalised signatures above only decide (and explain) a mismatch.
        self.x_raw = [(v.shape, v.dtype) for v in xs]
        self.data_raw = [(v.shape, v.dtype) for v in data]
        self._setup(xs, data)

    def _setup(self, xs: list, data: list) -> None:  # pragma: no cover - overridden
        pass

    def _mismatch(self, what: str, expected: Any, got: Any) -> ShapeMismatchError:
        return ShapeMismatchError(
            f"prepared {self.operator} was prepared for {what} {expected}, but was called with "
            f"{got}; prepare again for the new inputs (or call the unprepared operator)"
        )

    def _where(self, i: int) -> str:
        return f"x leaf {i}" if i < self.n_x else f"argument leaf {i - self.n_x}"

    def _checked(self, leaves: list, index: tuple, raw: list, signature: list) -> list:
        out = []
        convert = self.backend.convert
        for i, (shape, dtype), sig in zip(index, raw, signature):
            leaf = leaves[i]
            try:
                same = leaf.shape == shape and leaf.dtype == dtype
            except Exception:  # a Python float, or dtypes of two libraries that do not compare
                same = False
            if not same:
                if is_array(leaf):
                    got = _signature(leaf)
                elif isinstance(leaf, float):  # differentiated as a float64 scalar
                    got = ((), "float64")
                else:
                    got = type(leaf).__name__
                if got != sig:
                    raise self._mismatch(f"{self._where(i)} of shape/dtype", sig, got)
            out.append(convert(leaf))
        return out

    def _inputs(self, x: Any, args: tuple) -> tuple[list, list]:
        fn = self.fn
        leaves, x_treedef = optree.tree_flatten(x)
        if x_treedef != fn.x_treedef:
            raise self._mismatch("x of structure", fn.x_treedef, x_treedef)
        a_leaves, a_treedef = optree.tree_flatten(args)
        if a_treedef != fn.args_treedef:
            raise self._mismatch("args of structure", fn.args_treedef, a_treedef)
        if a_leaves:
            leaves = leaves + a_leaves
        xs = self._checked(leaves, self.diff_index, self.x_raw, self.x_signature)
        data = self._checked(leaves, self.data_index, self.data_raw, self.data_signature)
        for i, value, key in self.static:
            leaf = leaves[i]
            if leaf is not value and _static_key(leaf) != key:
                raise self._mismatch(f"static {self._where(i)} =", repr(value), repr(leaf))
        return xs, data


class PreparedValueAndGradient(_Prepared):
    """``vg(x, *args) -> (y, g)`` (``((y, aux), g)`` with ``has_aux``)."""

    operator = "value_and_gradient"

    def _setup(self, xs: list, data: list) -> None:
        self._run = self.backend.flat_prepare_value_and_gradient(self.fn, xs, data)

    def __call__(self, x: Any, *args: Any) -> tuple[Any, Any]:
        xs, data = self._inputs(x, args)
        y, aux, grads = self._run(xs, data)
        check_scalar(y)
        g = self.fn.unflatten_x(self.backend.complete(grads, xs))
        return ((y, aux), g) if self.has_aux else (y, g)


class PreparedGradient(PreparedValueAndGradient):
    """``g(x, *args) -> gradient`` (``(gradient, aux)`` with ``has_aux``)."""

    operator = "gradient"

    def __call__(self, x: Any, *args: Any) -> Any:
        value, g = super().__call__(x, *args)
        return (g, value[1]) if self.has_aux else g


class PreparedPullback(_Prepared):
    """``pb(x, *args) -> (y, vjp)`` with ``vjp(dy) -> dx``."""

    operator = "pullback"

    def __call__(self, x: Any, *args: Any) -> tuple[Any, Callable]:
        xs, data = self._inputs(x, args)
        b, fn = self.backend, self.fn
        if b.has_reverse:
            y, _, vjp = b.flat_value_and_pullback(fn, xs, data)
        else:
            y, _, vjp = b._pullback_from_forward(fn, xs, data)

        def pullback(dy: Any) -> Any:
            return fn.unflatten_x(b.complete(vjp(b.cotangent(dy, y)), xs))

        return y, pullback


def prepare_value_and_gradient(
    b: Backend | str, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False
) -> PreparedValueAndGradient:
    """Prepare ``value_and_gradient`` of ``f`` for inputs shaped like ``(x, *args)``.

    ``prepare_value_and_gradient(b, f, x, *args, has_aux=False) -> vg`` with
    ``vg(x, *args) -> (y, g)``.  All per-function work (flattening plans, tracing and
    compilation on compiled backends) happens here; each call checks that structure,
    shapes and dtypes still match and raises :class:`~abstractdiff.ShapeMismatchError`
    when they do not.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> vg = ad.prepare_value_and_gradient("finite_differences", lambda w, a: (a * w**2).sum(), np.ones(2), 3.0)
        >>> y, g = vg(np.array([1.0, 2.0]), 3.0)
        >>> float(y), np.round(g, 6)
        (15.0, array([ 6., 12.]))
    """
    return PreparedValueAndGradient(b, f, x, args, has_aux)


def prepare_gradient(
    b: Backend | str, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False
) -> PreparedGradient:
    """Prepare ``gradient`` of ``f``: ``prepare_gradient(b, f, x, *args) -> g`` with ``g(x, *args) -> gradient``.

    See :func:`prepare_value_and_gradient` for what is checked on each call.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> grad = ad.prepare_gradient("finite_differences", lambda w: (w**2).sum(), np.ones(2))
        >>> np.round(grad(np.array([1.0, -3.0])), 6)
        array([ 2., -6.])
    """
    return PreparedGradient(b, f, x, args, has_aux)


def prepare_pullback(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> PreparedPullback:
    """Prepare ``value_and_pullback``: ``prepare_pullback(b, f, x, *args) -> pb`` with ``pb(x, *args) -> (y, vjp)``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> pb = ad.prepare_pullback("finite_differences", lambda w: 2 * w, np.ones(2))
        >>> y, vjp = pb(np.array([1.0, 2.0]))
        >>> np.round(vjp(np.array([1.0, 1.0])), 6)
        array([2., 2.])
    """
    return PreparedPullback(b, f, x, args)


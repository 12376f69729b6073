"""Loops that compile once: ``ad.fori_loop``, ``ad.scan`` and ``ad.while_loop``.

A Python ``for`` loop in ``f`` is unrolled by every library that traces ``f`` (``jax.jit``,
``tf.function``, a PyTensor graph): a 60-step integrator becomes 60 copies of its step, and
its Jacobian graph takes minutes to compile.  These three functions are written once, here,
with ``jax.lax``'s semantics; the library of the values they are given runs them on its own
loop primitive (the adapter's ``loops`` hook object, see ``docs/guide/adapters.md``), traced
once whatever the number of steps.  Where the library has no loop primitive (eager
libraries: torch, autograd, paddle, MLX, finite differences) or the values are plain numpy,
they run as a Python loop, which those libraries differentiate as they run it.

The library is picked from the loop's carry and ``xs`` (not from values the body reads by
closure), by the type of their leaves (:func:`abstractdiff._registry.backend_for`), so this
module names no library.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import numpy as np

from ._arrays import dtype_name, shape_of
from ._errors import ArgumentTypeError, InvalidArgumentError, ShapeMismatchError
from ._pytree import tree_flatten, tree_unflatten
from ._registry import backend_for

__all__ = ["fori_loop", "scan", "while_loop"]


def _hook(leaves: list, name: str) -> Callable[..., Any] | None:
    """The ``name`` loop hook of the first leaf's library that has a ``loops`` hook object."""
    for leaf in leaves:
        owner = backend_for(leaf)
        if owner is not None:
            return getattr(getattr(owner, "loops", None), name, None)
    return None


def _flat(fn: Callable[..., Any], treedef: Any, what: str) -> Callable[..., list]:
    """``fn`` on the flat leaves of a carry of structure ``treedef``, checking it keeps it."""

    def flat(*args: Any) -> list:
        *head, leaves = args
        out, outdef = tree_flatten(fn(*head, tree_unflatten(treedef, leaves)))
        if outdef != treedef:
            raise ShapeMismatchError(f"{what} returned a carry of structure {outdef}, not init's {treedef}")
        return out

    return flat


def _bound(value: Any, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(
            f"fori_loop's {what} bound must be a Python int, got {type(value).__name__}: a static bound is "
            f"what lets reverse mode differentiate the loop; for a traced bound use ad.while_loop"
        ) from None


def fori_loop(lower: int, upper: int, body: Callable[[Any, Any], Any], init: Any) -> Any:
    """``body`` applied for ``i`` from ``lower`` to ``upper - 1``, compiled once: ``jax.lax.fori_loop``.

    ``fori_loop(lower, upper, body, init) -> carry`` with ``body(i, carry) -> carry``; the carry
    is any pytree of arrays, the same structure, shapes and dtypes after each step.  The bounds
    are Python ints, so every library differentiates the loop in both modes, to any order.
    ``i`` is the library's integer scalar inside a compiled loop (a Python int in a Python loop):
    cast it (``ad.scan`` over an array of times is often clearer).

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> ad.fori_loop(0, 3, lambda i, x: 2 * x, np.ones(2))
        array([8., 8.])
    """
    lower, upper = _bound(lower, "lower"), _bound(upper, "upper")
    if upper <= lower:
        return init
    leaves, treedef = tree_flatten(init)
    flat = _flat(body, treedef, "fori_loop's body")
    hook = _hook(leaves, "fori_loop")
    out = NotImplemented if hook is None else hook(lower, upper, flat, leaves)
    if out is NotImplemented:
        out = leaves
        for i in range(lower, upper):
            out = flat(i, out)
    return tree_unflatten(treedef, out)


def _steps(leaves: list, length: int | None) -> int:
    sizes = {shape_of(leaf)[0] for leaf in leaves}
    if length is not None:
        sizes.add(_bound(length, "length"))
    if len(sizes) != 1:
        why = "pass length= when xs is None" if not sizes else f"xs' leading axes and length disagree: {sorted(sizes)}"
        raise InvalidArgumentError(f"ad.scan cannot tell the number of steps: {why}")
    return sizes.pop()


def _stack(values: list) -> Any:
    """One step's ``y`` leaves of every step, stacked by the library that differentiates them.

    A step may give a Python number or a numpy array where the other steps give the library's
    arrays (a scan recording its incoming carry from an ``init`` of ``0.0``: step 0's ``y`` is
    that float).  autoray would pick numpy from the first value, and numpy would convert the
    library's arrays, dropping their derivative (or fail on them); such constants are made
    the library's arrays instead, in the dtype and on the device of the first array of it.
    """
    import autoray

    like = next((v for v in values if backend_for(v) is not None), None)
    if like is None:  # numpy (and Python numbers) throughout
        return autoray.do("stack", values, axis=0)
    owner = backend_for(like)
    values = [v if backend_for(v) is owner else _constant_like(owner, v, like) for v in values]
    return autoray.do("stack", values, axis=0, like=like)


def _constant_like(owner: Any, v: Any, like: Any) -> Any:
    """The constant ``v`` (a Python number, a numpy array) as an array of ``like``'s library,
    dtype and device."""
    if np.ndim(v) == 0:
        if tuple(shape_of(like)) != ():
            return v  # shapes differ: the library's stack says so (zeros_like would broadcast)
        # the library's own arithmetic on zeros of like keeps like's dtype and device, and
        # works on a traced like (inside jax.jit, tf.function, mx.compile)
        return owner.zeros_like(like) + np.asarray(v).item()
    dtype = dtype_name(like)
    try:
        return owner.asarray_like(np.asarray(v, dtype=dtype), like)
    except TypeError:  # a dtype numpy has no name for (bfloat16): the library casts
        return owner.cast(owner.asarray_like(np.asarray(v), like), dtype)


def scan(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any = None, length: int | None = None) -> tuple:
    """A loop over the leading axis of ``xs`` carrying state, compiled once: ``jax.lax.scan``.

    ``scan(f, init, xs=None, length=None) -> (carry, ys)`` with ``f(carry, x) -> (carry, y)``:
    ``x`` is one slice of ``xs`` (a pytree: each leaf sliced along its leading axis; ``None``
    with ``length`` steps), ``ys`` the ``y`` of every step stacked along a new leading axis
    (``y`` may be ``None``).  The carry keeps its structure, shapes and dtypes.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> total, running = ad.scan(lambda c, x: (c + x, c + x), 0.0, np.array([1.0, 2.0, 3.0]))
        >>> float(total), running
        (6.0, array([1., 3., 6.]))
    """
    carry, carrydef = tree_flatten(init)
    xleaves, xdef = tree_flatten(xs)
    n = _steps(xleaves, length)
    ydefs: list = []

    def flat(c: list, x: list) -> tuple[list, list]:
        out = f(tree_unflatten(carrydef, c), tree_unflatten(xdef, x))
        if not isinstance(out, tuple) or len(out) != 2:
            raise InvalidArgumentError(f"ad.scan's f must return a pair (carry, y), got {type(out).__name__}")
        new, newdef = tree_flatten(out[0])
        if newdef != carrydef:
            raise ShapeMismatchError(f"ad.scan's f returned a carry of structure {newdef}, not init's {carrydef}")
        y, ydef = tree_flatten(out[1])
        ydefs[:] = [ydef]
        return new, y

    hook = _hook(carry + xleaves, "scan")
    result = NotImplemented if hook is None else hook(flat, carry, xleaves, n)
    if result is NotImplemented:
        if n == 0:
            raise InvalidArgumentError("ad.scan needs at least one step where it runs as a Python loop")
        steps = []
        for i in range(n):
            carry, y = flat(carry, [leaf[i] for leaf in xleaves])
            steps.append(y)
        result = carry, [_stack(list(column)) for column in zip(*steps)]
    carry, ys = result
    return tree_unflatten(carrydef, carry), tree_unflatten(ydefs[0], ys)


def while_loop(cond: Callable[[Any], Any], body: Callable[[Any], Any], init: Any) -> Any:
    """``body`` applied while ``cond`` holds, compiled once: ``jax.lax.while_loop``.

    ``while_loop(cond, body, init) -> carry`` with ``cond(carry) -> bool scalar`` and
    ``body(carry) -> carry``.  Forward mode differentiates it everywhere; reverse mode only
    where the library can reverse a loop of unknown length (not jax: there it raises
    :class:`~abstractdiff.LoopDerivativeError`; use :func:`fori_loop` with a bound).  PyTensor's
    scan needs a number of steps: on symbolic PyTensor values it raises
    :class:`~abstractdiff.InvalidArgumentError`.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> ad.while_loop(lambda x: x.sum() < 10, lambda x: 2 * x, np.ones(2))
        array([8., 8.])
    """
    leaves, treedef = tree_flatten(init)
    flat_cond = lambda c: cond(tree_unflatten(treedef, c))  # noqa: E731
    flat_body = _flat(body, treedef, "while_loop's body")
    hook = _hook(leaves, "while_loop")
    out = NotImplemented if hook is None else hook(flat_cond, flat_body, leaves)
    if out is NotImplemented:
        out = leaves
        while bool(flat_cond(out)):
            out = flat_body(out)
    return tree_unflatten(treedef, out)

"""minitape's array type and its tape: reverse mode that can differentiate itself.

An :class:`Array` holds a numpy array in ``.data``.  An operation on arrays that require
grad records, on its result, one *edge* per differentiable operand: ``(operand, vjp)``
with ``vjp(g)`` the operand's cotangent.  Every ``vjp`` is written with minitape
operations, so running the backward pass while recording (``create_graph=True``)
records the gradient's own graph: gradients of gradients (Hessians) come for free.

:func:`grad` is the only entry point of reverse mode (PyTorch's ``autograd.grad``).
Integer and boolean arrays never require grad: they are data.
"""

from __future__ import annotations

import builtins
import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

__all__ = ["Array", "grad", "no_grad", "is_grad_enabled", "enable_grad"]


class _Mode(threading.local):
    def __init__(self) -> None:
        self.enabled = True


_mode = _Mode()


def is_grad_enabled() -> bool:
    """Whether operations on arrays that require grad are being recorded."""
    return _mode.enabled


@contextlib.contextmanager
def _set_grad(enabled: bool) -> Iterator[None]:
    old, _mode.enabled = _mode.enabled, enabled
    try:
        yield
    finally:
        _mode.enabled = old


def no_grad() -> contextlib.AbstractContextManager[None]:
    """A context in which nothing is recorded (optimiser updates, evaluation)."""
    return _set_grad(False)


def enable_grad() -> contextlib.AbstractContextManager[None]:
    """A context in which operations are recorded again."""
    return _set_grad(True)


def _is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating)


def raw(a: Any) -> Any:
    """The numpy value of an :class:`Array`; anything else as it is."""
    return a.data if isinstance(a, Array) else a


class Array:
    """An n-dimensional array: numpy underneath, with minitape's reverse mode on top.

    ``Array(data, dtype=None, requires_grad=False)``; ``data`` is anything
    ``numpy.asarray`` accepts.  Only float arrays can require grad.
    """

    __slots__ = ("data", "requires_grad", "_edges", "__weakref__")
    # numpy must hand mixed expressions (ndarray * Array) to Array's reflected operators
    __array_ufunc__ = None

    def __init__(self, data: Any, dtype: Any = None, requires_grad: bool = False):
        data = np.array(raw(data), dtype=dtype)  # a copy: an Array owns its data
        if requires_grad and not _is_float(data.dtype):
            raise TypeError(f"only float arrays can require grad, not {data.dtype}")
        self.data = data
        self.requires_grad = bool(requires_grad)
        self._edges: tuple = ()

    @classmethod
    def _wrap(cls, data: Any) -> Array:
        out = cls.__new__(cls)
        out.data = np.asarray(data)  # ufuncs on 0-d arrays return numpy scalars
        out.requires_grad = False
        out._edges = ()
        return out

    # ------------------------------------------------------------- attributes
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def T(self) -> Array:  # noqa: N802 (numpy's name)
        return transpose(self)

    @property
    def is_leaf(self) -> bool:
        return not self._edges

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[Array]:
        for i in range(len(self)):
            yield self[i]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        a = self.data if dtype is None else self.data.astype(dtype, copy=False)
        return a.copy() if copy else a

    def __float__(self) -> float:
        return float(self.data)

    def __int__(self) -> int:
        return int(self.data)

    def __bool__(self) -> bool:
        return bool(self.data)

    def item(self) -> Any:
        return self.data.item()

    def tolist(self) -> Any:
        return self.data.tolist()

    def numpy(self) -> np.ndarray:
        """A copy of the value as a numpy array, outside any graph."""
        return self.data.copy()

    def detach(self) -> Array:
        """The same values (shared), recording nothing."""
        return Array._wrap(self.data)

    def requires_grad_(self, flag: bool = True) -> Array:
        """Mark this array as a leaf to differentiate with respect to; returns it."""
        if flag and not _is_float(self.dtype):
            raise TypeError(f"only float arrays can require grad, not {self.dtype}")
        self.requires_grad = bool(flag)
        return self

    def view(self) -> Array:
        """The same values as a new node of the graph, connected to this one (an identity
        operation): a distinct input to differentiate with respect to."""
        return record(self.data, (self, lambda g: g))

    def __repr__(self) -> str:
        body = np.array2string(self.data, separator=", ", prefix="minitape.Array(")
        flag = ", requires_grad=True" if self.requires_grad else ""
        return f"minitape.Array({body}, dtype={self.dtype}{flag})"

    __hash__ = object.__hash__  # by identity, as torch tensors (== is elementwise)

    # ------------------------------------------------------------- arithmetic
    def __add__(self, other: Any) -> Array:
        return add(self, other)

    def __radd__(self, other: Any) -> Array:
        return add(other, self)

    def __sub__(self, other: Any) -> Array:
        return subtract(self, other)

    def __rsub__(self, other: Any) -> Array:
        return subtract(other, self)

    def __mul__(self, other: Any) -> Array:
        return multiply(self, other)

    def __rmul__(self, other: Any) -> Array:
        return multiply(other, self)

    def __truediv__(self, other: Any) -> Array:
        return divide(self, other)

    def __rtruediv__(self, other: Any) -> Array:
        return divide(other, self)

    def __pow__(self, other: Any) -> Array:
        return power(self, other)

    def __rpow__(self, other: Any) -> Array:
        return power(other, self)

    def __matmul__(self, other: Any) -> Array:
        return matmul(self, other)

    def __rmatmul__(self, other: Any) -> Array:
        return matmul(other, self)

    def __neg__(self) -> Array:
        return negative(self)

    def __pos__(self) -> Array:
        return self

    def __abs__(self) -> Array:
        return absolute(self)

    # comparisons: boolean arrays, never recorded
    def __lt__(self, other: Any) -> Array:
        return Array._wrap(self.data < raw(other))

    def __le__(self, other: Any) -> Array:
        return Array._wrap(self.data <= raw(other))

    def __gt__(self, other: Any) -> Array:
        return Array._wrap(self.data > raw(other))

    def __ge__(self, other: Any) -> Array:
        return Array._wrap(self.data >= raw(other))

    def __eq__(self, other: Any) -> Array:  # type: ignore[override]
        return Array._wrap(self.data == raw(other))

    def __ne__(self, other: Any) -> Array:  # type: ignore[override]
        return Array._wrap(self.data != raw(other))

    def __getitem__(self, key: Any) -> Array:
        return getitem(self, key)

    # ------------------------------------------------------------- methods
    def reshape(self, *shape: Any) -> Array:
        return reshape(self, shape[0] if len(shape) == 1 else shape)

    def transpose(self, *axes: Any) -> Array:
        return transpose(self, (axes[0] if len(axes) == 1 else axes) or None)

    def astype(self, dtype: Any, copy: bool = True) -> Array:
        return astype(self, dtype)

    def sum(self, axis: Any = None, keepdims: bool = False) -> Array:
        return sum(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> Array:
        return mean(self, axis=axis, keepdims=keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> Array:
        return max(self, axis=axis, keepdims=keepdims)

    def prod(self, axis: Any = None, keepdims: bool = False) -> Array:
        return prod(self, axis=axis, keepdims=keepdims)


# ------------------------------------------------------------------ recording
Vjp = Callable[["Array"], "Array"]


def record(data: Any, *edges: tuple[Any, Vjp]) -> Array:
    """An Array of ``data`` that remembers ``(operand, vjp)`` for the operands requiring grad."""
    out = Array._wrap(data)
    if _mode.enabled:
        live = tuple((a, fn) for a, fn in edges if isinstance(a, Array) and a.requires_grad)
        if live:
            out.requires_grad = True
            out._edges = live
    return out


def _topological(y: Array) -> list[Array]:
    """Every array ``y`` was computed from, parents before children (iterative DFS)."""
    order: list[Array] = []
    seen: set[int] = set()
    stack: list[tuple[Array, bool]] = [(y, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((parent, False) for parent, _ in node._edges if id(parent) not in seen)
    return order


def grad(
    y: Array, xs: Sequence[Array], dy: Any = None, *, create_graph: bool = False
) -> list[Array | None]:
    """``[d<dy, y>/dx for x in xs]``: reverse mode from ``y`` to ``xs``.

    ``dy`` defaults to ones (so a scalar ``y`` gives its gradient).  ``None`` for an ``x``
    that ``y`` does not depend on.  With ``create_graph=True`` the backward pass is
    recorded, so the result can be differentiated again.  The graph is kept: ``grad``
    may be called again on the same ``y``.
    """
    dy = ones_like(y) if dy is None else asarray(dy)
    if dy.shape != y.shape:
        raise ValueError(f"cotangent shape {dy.shape} does not match output shape {y.shape}")
    targets = {id(x) for x in xs}
    if not y.requires_grad:
        return [None] * len(xs)
    order = _topological(y)
    # a node matters if some x is among its ancestors (or is the node itself)
    relevant: dict[int, bool] = {}
    for node in order:
        relevant[id(node)] = id(node) in targets or builtins.any(relevant.get(id(p), False) for p, _ in node._edges)
    found: dict[int, Array] = {}
    cotangents: dict[int, Array] = {id(y): dy}
    with _set_grad(create_graph):
        for node in reversed(order):
            g = cotangents.pop(id(node), None)
            if g is None or not relevant[id(node)]:
                continue
            if id(node) in targets:
                found[id(node)] = g
            for parent, vjp in node._edges:
                if not relevant[id(parent)]:
                    continue
                c = vjp(g)
                if c.dtype != parent.dtype:  # numpy promotion must never widen a gradient
                    c = astype(c, parent.dtype)
                old = cotangents.get(id(parent))
                cotangents[id(parent)] = c if old is None else old + c
    return [found.get(id(x)) for x in xs]


# ------------------------------------------------------------------ helpers
def asarray(a: Any, dtype: Any = None) -> Array:
    """``a`` as an Array: an Array passes through (cast if ``dtype`` differs), anything else
    is converted (a list of Arrays is stacked, differentiably)."""
    if isinstance(a, Array):
        return a if dtype is None or a.dtype == np.dtype(dtype) else astype(a, dtype)
    if isinstance(a, (list, tuple)) and builtins.any(isinstance(v, Array) for v in a):
        return asarray(stack([asarray(v) for v in a]), dtype)
    return Array._wrap(np.asarray(a, dtype=dtype))


def unbroadcast(g: Array, shape: tuple[int, ...]) -> Array:
    """Sum ``g`` down to ``shape`` (the cotangent of a broadcast operand)."""
    if g.shape == tuple(shape):
        return g
    extra = g.ndim - len(shape)
    if extra:
        g = sum(g, axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return sum(g, axis=axes, keepdims=True) if axes else g


def _shape_of(a: Any) -> tuple[int, ...]:
    return np.shape(raw(a))


def _unary(fn: Callable[[np.ndarray], np.ndarray], x: Any, vjp: Callable[[Array, Array, Array], Array]) -> Array:
    x = asarray(x)
    y = record(fn(x.data))
    if _mode.enabled and x.requires_grad:
        y.requires_grad, y._edges = True, ((x, lambda g: vjp(g, x, y)),)
    return y


# ------------------------------------------------------------------ elementwise
def add(a: Any, b: Any) -> Array:
    sa, sb = _shape_of(a), _shape_of(b)
    return record(np.add(raw(a), raw(b)), (a, lambda g: unbroadcast(g, sa)), (b, lambda g: unbroadcast(g, sb)))


def subtract(a: Any, b: Any) -> Array:
    sa, sb = _shape_of(a), _shape_of(b)
    return record(np.subtract(raw(a), raw(b)), (a, lambda g: unbroadcast(g, sa)),
                  (b, lambda g: unbroadcast(negative(g), sb)))


def multiply(a: Any, b: Any) -> Array:
    sa, sb = _shape_of(a), _shape_of(b)
    return record(np.multiply(raw(a), raw(b)), (a, lambda g: unbroadcast(g * b, sa)),
                  (b, lambda g: unbroadcast(g * a, sb)))


def divide(a: Any, b: Any) -> Array:
    sa, sb = _shape_of(a), _shape_of(b)
    return record(np.divide(raw(a), raw(b)), (a, lambda g: unbroadcast(g / b, sa)),
                  (b, lambda g: unbroadcast(negative(g * a) / (b * b), sb)))


def power(a: Any, b: Any) -> Array:
    sa, sb = _shape_of(a), _shape_of(b)
    out = np.power(raw(a), raw(b))

    def d_base(g: Array) -> Array:
        return unbroadcast(g * b * power(a, b - 1), sa)

    def d_exponent(g: Array) -> Array:
        return unbroadcast(g * power(a, b) * log(a), sb)

    return record(out, (a, d_base), (b, d_exponent))


def negative(x: Any) -> Array:
    return _unary(np.negative, x, lambda g, x, y: negative(g))


def exp(x: Any) -> Array:
    return _unary(np.exp, x, lambda g, x, y: g * y)


def log(x: Any) -> Array:
    return _unary(np.log, x, lambda g, x, y: g / x)


def sin(x: Any) -> Array:
    return _unary(np.sin, x, lambda g, x, y: g * cos(x))


def cos(x: Any) -> Array:
    return _unary(np.cos, x, lambda g, x, y: negative(g * sin(x)))


def tanh(x: Any) -> Array:
    return _unary(np.tanh, x, lambda g, x, y: g * (1 - y * y))


def sqrt(x: Any) -> Array:
    return _unary(np.sqrt, x, lambda g, x, y: g / (2 * y))


def absolute(x: Any) -> Array:
    return _unary(np.abs, x, lambda g, x, y: g * np.sign(x.data))


abs = absolute  # noqa: A001 (numpy's name)


def sign(x: Any) -> Array:
    return Array._wrap(np.sign(raw(x)))


def maximum(a: Any, b: Any) -> Array:
    sa, sb = _shape_of(a), _shape_of(b)
    take_a = np.asarray(raw(a) >= raw(b))
    return record(np.maximum(raw(a), raw(b)), (a, lambda g: unbroadcast(where(take_a, g, 0.0), sa)),
                  (b, lambda g: unbroadcast(where(take_a, 0.0, g), sb)))


def minimum(a: Any, b: Any) -> Array:
    return negative(maximum(negative(a), negative(b)))


def clip(x: Any, lo: Any = None, hi: Any = None) -> Array:
    x = asarray(x)
    inside = np.ones(x.shape, dtype=bool)
    if lo is not None:
        inside &= x.data >= raw(lo)
    if hi is not None:
        inside &= x.data <= raw(hi)
    return record(np.clip(x.data, raw(lo), raw(hi)), (x, lambda g: where(inside, g, 0.0)))


def where(condition: Any, a: Any, b: Any) -> Array:
    c = np.asarray(raw(condition), dtype=bool)
    sa, sb = _shape_of(a), _shape_of(b)
    out = np.where(c, raw(a), raw(b))
    return record(out, (a, lambda g: unbroadcast(where(c, g, 0.0), sa)),
                  (b, lambda g: unbroadcast(where(c, 0.0, g), sb)))


def astype(x: Any, dtype: Any) -> Array:
    x = asarray(x)
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    src = x.dtype
    edges = ((x, lambda g: astype(g, src)),) if _is_float(dtype) else ()
    return record(x.data.astype(dtype), *edges)


# ------------------------------------------------------------------ reductions
def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(sorted(int(a) % ndim for a in axes)) if ndim else ()


def _expand(g: Array, axes: tuple[int, ...], keepdims: bool) -> Array:
    """``g`` with the reduced ``axes`` back as size-1 dimensions."""
    if keepdims or not axes:
        return g
    shape = list(g.shape)
    for a in axes:
        shape.insert(a, 1)
    return reshape(g, tuple(shape))


def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Array:  # noqa: A001 (numpy's name)
    x = asarray(x)
    axes = _axes(axis, x.ndim)
    shape = x.shape
    return record(np.sum(x.data, axis=axes, keepdims=keepdims),
                  (x, lambda g: broadcast_to(_expand(g, axes, keepdims), shape)))


def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Array:
    x = asarray(x)
    axes = _axes(axis, x.ndim)
    n = int(np.prod([x.shape[a] for a in axes]))
    return sum(x, axis=axes, keepdims=keepdims) / n


def max(x: Any, axis: Any = None, keepdims: bool = False) -> Array:  # noqa: A001 (numpy's name)
    x = asarray(x)
    axes = _axes(axis, x.ndim)
    m = np.max(x.data, axis=axes, keepdims=True)
    hit = (x.data == m).astype(x.dtype)
    share = hit / np.sum(hit, axis=axes, keepdims=True)  # ties share the gradient
    shape = x.shape
    return record(m if keepdims else np.squeeze(m, axis=axes),
                  (x, lambda g: broadcast_to(_expand(g, axes, keepdims), shape) * share))


amax = max


def min(x: Any, axis: Any = None, keepdims: bool = False) -> Array:  # noqa: A001 (numpy's name)
    return negative(max(negative(x), axis=axis, keepdims=keepdims))


def prod(x: Any, axis: Any = None, keepdims: bool = False) -> Array:
    x = asarray(x)
    axes = _axes(axis, x.ndim)
    y = record(np.prod(x.data, axis=axes, keepdims=keepdims))
    shape = x.shape
    if _mode.enabled and x.requires_grad:  # d prod / d x_i = prod / x_i (x_i != 0)
        y.requires_grad = True
        y._edges = ((x, lambda g: broadcast_to(_expand(g * y, axes, keepdims), shape) / x),)
    return y


def broadcast_to(x: Any, shape: tuple[int, ...]) -> Array:
    x = asarray(x)
    shape = tuple(shape)
    src = x.shape
    return record(np.broadcast_to(x.data, shape), (x, lambda g: unbroadcast(g, src)))


# ------------------------------------------------------------------ shapes
def reshape(x: Any, shape: Any) -> Array:
    x = asarray(x)
    src = x.shape
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return record(np.reshape(x.data, shape), (x, lambda g: reshape(g, src)))


def transpose(x: Any, axes: Any = None) -> Array:
    x = asarray(x)
    axes = tuple(reversed(range(x.ndim))) if axes is None else tuple(axes)
    back = tuple(np.argsort(axes))
    return record(np.transpose(x.data, axes), (x, lambda g: transpose(g, back)))


def swapaxes(x: Any, a: int, b: int) -> Array:
    axes = list(range(asarray(x).ndim))
    axes[a], axes[b] = axes[b], axes[a]
    return transpose(x, axes)


def expand_dims(x: Any, axis: int) -> Array:
    x = asarray(x)
    return reshape(x, np.expand_dims(x.data, axis).shape)


def squeeze(x: Any, axis: Any = None) -> Array:
    x = asarray(x)
    return reshape(x, np.squeeze(x.data, axis).shape)


def _key(key: Any) -> Any:
    """An index with Arrays replaced by their numpy values."""
    if isinstance(key, tuple):
        return tuple(_key(k) for k in key)
    if isinstance(key, (Array, list)):
        return np.asarray(raw(key))
    return key


def _has_integer_array(key: Any) -> bool:
    """Whether ``key`` holds an integer index array (whose indices may repeat)."""
    parts = key if isinstance(key, tuple) else (key,)
    return builtins.any(isinstance(k, np.ndarray) and np.issubdtype(k.dtype, np.integer) for k in parts)


def getitem(x: Any, key: Any) -> Array:
    x = asarray(x)
    key = _key(key)
    shape = x.shape
    return record(x.data[key], (x, lambda g: _scatter_add(g, key, shape)))


def _scatter_add(g: Array, key: Any, shape: tuple[int, ...]) -> Array:
    """Zeros of ``shape`` with ``g`` added at ``key`` (repeated indices add up)."""
    out = np.zeros(shape, dtype=g.dtype)
    if _has_integer_array(key):
        np.add.at(out, key, g.data)
    else:  # slices, ints, None, boolean masks: no element is hit twice
        out[key] += g.data
    return record(out, (g, lambda gg: getitem(gg, key)))


def take(x: Any, indices: Any, axis: int | None = None) -> Array:
    x = asarray(x)
    if axis is None:
        return getitem(reshape(x, (-1,)), indices)
    axis = int(axis) % x.ndim
    return getitem(x, (slice(None),) * axis + (np.asarray(raw(indices)),))


def stack(arrays: Sequence[Any], axis: int = 0) -> Array:
    arrays = [asarray(a) for a in arrays]
    out = np.stack([a.data for a in arrays], axis=axis)
    axis = axis % out.ndim

    def part(i: int) -> Vjp:
        return lambda g: getitem(g, (slice(None),) * axis + (i,))

    return record(out, *((a, part(i)) for i, a in enumerate(arrays)))


def concatenate(arrays: Sequence[Any], axis: int = 0) -> Array:
    arrays = [asarray(a) for a in arrays]
    out = np.concatenate([a.data for a in arrays], axis=axis)
    axis = axis % out.ndim
    bounds = np.cumsum([0] + [a.shape[axis] for a in arrays])

    def part(i: int) -> Vjp:
        return lambda g: getitem(g, (slice(None),) * axis + (slice(int(bounds[i]), int(bounds[i + 1])),))

    return record(out, *((a, part(i)) for i, a in enumerate(arrays)))


# ------------------------------------------------------------------ linear algebra
def matmul(a: Any, b: Any) -> Array:
    a, b = asarray(a), asarray(b)
    out = np.matmul(a.data, b.data)

    def d_a(g: Array) -> Array:
        if b.ndim == 1:  # y[..., i] = sum_k a[..., i, k] b[k]
            return unbroadcast(expand_dims(g, -1) * b, a.shape) if a.ndim > 1 else g * b
        if a.ndim == 1:  # y[..., j] = sum_k a[k] b[..., k, j]
            return unbroadcast(matmul(b, expand_dims(g, -1))[..., 0], a.shape)
        return unbroadcast(matmul(g, swapaxes(b, -1, -2)), a.shape)

    def d_b(g: Array) -> Array:
        if a.ndim == 1:
            return unbroadcast(expand_dims(a, -1) * expand_dims(g, -2), b.shape) if b.ndim > 1 else g * a
        if b.ndim == 1:
            return unbroadcast(matmul(swapaxes(a, -1, -2), expand_dims(g, -1))[..., 0], b.shape)
        return unbroadcast(matmul(swapaxes(a, -1, -2), g), b.shape)

    return record(out, (a, d_a), (b, d_b))


def dot(a: Any, b: Any) -> Array:
    return matmul(a, b)


def outer(a: Any, b: Any) -> Array:
    return multiply(expand_dims(reshape(a, (-1,)), -1), reshape(b, (-1,)))


# ------------------------------------------------------------------ creation
def array(data: Any, dtype: Any = None) -> Array:
    """A new Array (a copy)."""
    return Array(raw(data), dtype=dtype)


def zeros(shape: Any, dtype: Any = "float64") -> Array:
    return Array._wrap(np.zeros(shape, dtype=dtype))


def ones(shape: Any, dtype: Any = "float64") -> Array:
    return Array._wrap(np.ones(shape, dtype=dtype))


def full(shape: Any, value: Any, dtype: Any = None) -> Array:
    return Array._wrap(np.full(shape, value, dtype=dtype))


def eye(n: int, m: int | None = None, dtype: Any = "float64") -> Array:
    return Array._wrap(np.eye(n, m, dtype=dtype))


def arange(*args: Any, dtype: Any = None) -> Array:
    return Array._wrap(np.arange(*args, dtype=dtype))


def zeros_like(x: Any, dtype: Any = None) -> Array:
    return Array._wrap(np.zeros_like(raw(x), dtype=dtype))


def ones_like(x: Any, dtype: Any = None) -> Array:
    return Array._wrap(np.ones_like(raw(x), dtype=dtype))


def to_numpy(x: Any) -> np.ndarray:
    """The value of ``x`` as a numpy array (a copy), outside any graph."""
    return np.array(raw(x))


def shape(x: Any) -> tuple[int, ...]:
    return _shape_of(x)


def ndim(x: Any) -> int:
    return len(_shape_of(x))


def size(x: Any) -> int:
    return int(np.prod(_shape_of(x)))


def isfinite(x: Any) -> Array:
    return Array._wrap(np.isfinite(raw(x)))


def all(x: Any) -> Array:  # noqa: A001 (numpy's name)
    return Array._wrap(np.all(raw(x)))


def any(x: Any) -> Array:  # noqa: A001 (numpy's name)
    return Array._wrap(np.any(raw(x)))

"""Sparsity detection: which outputs depend on which inputs, without derivatives.

``jacobian_sparsity(f, x)`` and ``hessian_sparsity(f, x)`` run ``f`` once on *tracers*:
arrays that carry, next to their numpy values, a boolean dependency matrix (one row per
element, one column per input element: scipy CSR).  Every numpy operation a tracer meets
(through ``__array_ufunc__`` / ``__array_function__``, so ``np.sin(x)``,
``autoray.do("sin", x)`` and ``x.sum()`` alike) combines its operands' rows by a rule:

* elementwise ufuncs: the union of the operands' rows (after broadcasting);
* reductions (``sum``, ``prod``, ``max``, ``mean``, ``norm``...): the union along the axes;
* contractions (``matmul``, ``dot``, ``einsum``...): the union over the contracted index;
* moves (indexing, ``reshape``, ``transpose``, ``concatenate``, ``roll``, ``pad``...): the
  operation itself applied to an array of element numbers says where each element came from;
* writes (``out[i] = ...``) into a tracer (``np.zeros_like(x)``, ``np.zeros(n, like=x)``, a
  copy of ``x``), also through its views (``out[1:]``, ``out.T``, ``np.split``): a view's
  values share memory with its base's as numpy's do, and its dependency rows follow them.
  A traced value written into a plain numpy array (``out = np.zeros(n)``) would lose its
  dependencies inside numpy, so that raises :class:`~abstractdiff.SparsityDetectionError`;
* piecewise constant operations (``round``, ``floor``, comparisons) depend on nothing.

For Hessians (SparseConnectivityTracer.jl's global Hessian tracer), each nonlinear
operation also records the pairs of inputs it makes interact: ``a * b`` the pairs
``deps(a) x deps(b)``, ``sin(a)`` the pairs ``deps(a) x deps(a)``; linear operations record
none.  The Hessian pattern is the union of the recorded pairs, restricted to the inputs
the output depends on.

A custom function (``ad.custom_vjp``, ``ad.custom_jvp``, and what is built on them:
``ad.custom_root``, ``ad.custom_fixed_point``) is differentiated by its rule, not by ``f``,
and a rule may mix entries that ``f`` keeps apart (a ``bwd`` of ``ct + ct.sum()`` over an
elementwise ``f``, a straight-through estimator over ``round``): its outputs depend on all
its inputs, a dense block (:func:`through_custom_function`), and for a Hessian all those
inputs interact.  ``f`` runs on the values only, for the outputs' values and shapes.

Both patterns are *conservative*: never a missing nonzero, possibly a structural zero (a
constant is treated as nonzero, a ``where`` depends on both branches).  Values never
steer the result: control flow on a traced value, and operations without a rule, raise
:class:`~abstractdiff.SparsityDetectionError` naming the operation.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .core import SparsityDetectionError, pytree

__all__ = ["hessian_sparsity", "jacobian_sparsity", "through_custom_function"]

_ADVICE = "pass the pattern yourself: ad.Sparse(backend, sparsity=pattern)"
#: numpy converts a traced value when it is written into a numpy array: the dependencies
#: would be lost, so the conversion refuses, and names the write as the likely cause.
_CONVERSION = (
    "sparsity detection cannot convert a traced value to a numpy array: writing it into a numpy "
    "array (out = np.zeros(n); out[i] = x[i] * 2) would lose which inputs it depends on, and "
    "np.asarray(x), float(x) or if/while on it would fix the pattern at one point. Create the "
    "output from x instead (out = np.zeros_like(x, shape=n) or np.zeros(n, like=x); writes into it, "
    f"also through views such as out[1:], are traced), build it with np.stack or np.concatenate, or {_ADVICE}"
)


def _sp() -> Any:
    import scipy.sparse

    return scipy.sparse


def unsupported(what: str) -> SparsityDetectionError:
    return SparsityDetectionError(f"sparsity detection does not support {what}; {_ADVICE}")


# ------------------------------------------------------------------ the trace
class _Trace:
    """One detection run: the number of inputs and, for Hessians, the recorded pairs."""

    def __init__(self, n: int, second_order: bool):
        self.n = n
        self.second_order = second_order
        self._pairs: list = []

    def empty(self, rows: int) -> Any:
        return _sp().csr_matrix((rows, self.n), dtype=bool)

    def pairs(self, a: Any, b: Any | None = None) -> None:
        """Record ``a.T @ b`` (and its transpose): row ``k`` of ``a`` interacts with row ``k`` of ``b``."""
        if not self.second_order or a is None:
            return
        p = a.T @ (a if b is None else b)
        if p.nnz:
            self._pairs.append(p)
            if len(self._pairs) > 64:  # keep the list short
                self._pairs = [_union(self._pairs)]

    def hessian(self) -> Any:
        h = _union(self._pairs) if self._pairs else _sp().csr_matrix((self.n, self.n), dtype=bool)
        return (h + h.T).tocsr()


def _union(ms: list) -> Any:
    total = ms[0]
    for m in ms[1:]:
        total = total + m
    return total


def _select(deps: Any, idx: np.ndarray, rows_in: int) -> Any:
    """Rows ``idx - 1`` of ``deps`` (``0``: a constant element, an empty row): one sparse product."""
    sp = _sp()
    flat = np.asarray(idx, dtype=np.int64).ravel()
    keep = flat > 0
    sel = sp.csr_matrix(
        (np.ones(int(keep.sum()), dtype=bool), (np.nonzero(keep)[0], flat[keep] - 1)),
        shape=(flat.size, rows_in),
    )
    return (sel @ deps).tocsr()


def _numbers(shape: tuple, offset: int = 0) -> np.ndarray:
    """Element numbers ``offset + 1 ...`` shaped ``shape`` (``0`` is kept for constants)."""
    return np.arange(offset + 1, offset + 1 + math.prod(shape), dtype=np.int64).reshape(shape)


# ------------------------------------------------------------------ the tracer
class Tracer:
    """An array of values that also carries, per element, the set of inputs it depends on."""

    __slots__ = ("value", "_deps", "trace", "_base", "_index", "_seen", "_writes")
    __array_priority__ = 1000

    def __init__(self, value: Any, deps: Any, trace: _Trace):
        self.value = np.asarray(value)
        self._deps = deps  # CSR (value.size, n) bool, or None: depends on nothing
        self.trace = trace
        # a view (basic indexing, reshape, transpose...) shares its values' memory with its
        # base, as numpy's views do, so writes through either reach the other's values; the
        # dependency rows follow: _base is the array that owns the memory, _index the flat
        # position there of each element, _seen the base's write count when _deps was read
        self._base: Tracer | None = None
        self._index: np.ndarray | None = None
        self._seen = 0
        self._writes = 0  # writes into this array (and its views), for an owner of memory

    @property
    def deps(self) -> Any:
        base = self._base
        if base is not None and self._seen != base._writes:  # the base was written since
            rows = base.deps
            self._deps = None if rows is None or self.dtype.kind not in "fc" else _select(rows, self._index + 1,
                                                                                          base.size)
            self._seen = base._writes
        return self._deps

    @deps.setter
    def deps(self, deps: Any) -> None:
        self._deps = deps

    # ---- array attributes
    shape = property(lambda self: self.value.shape)
    ndim = property(lambda self: self.value.ndim)
    size = property(lambda self: self.value.size)
    dtype = property(lambda self: self.value.dtype)
    T = property(lambda self: np.transpose(self))
    real = property(lambda self: self)
    imag = property(lambda self: np.zeros_like(self))

    def __len__(self) -> int:
        return len(self.value)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        nnz = 0 if self.deps is None else self.deps.nnz
        return f"Tracer(shape={self.shape}, dtype={self.dtype}, dependencies={nnz})"

    # ---- what cannot be traced
    def _control_flow(self, *_: Any) -> Any:
        raise SparsityDetectionError(
            "sparsity detection cannot follow Python control flow or conversions on a traced value "
            "(if/while on an array, float(x), int(x), x.item(), np.asarray(x)): the pattern would hold "
            f"at one point only. Write branches with where (np.where, autoray.do('where', ...)), or {_ADVICE}"
        )

    __bool__ = __float__ = __int__ = __index__ = __complex__ = item = tolist = _control_flow

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise SparsityDetectionError(_CONVERSION)

    # ---- numpy protocols
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is not None or "where" in kwargs:
            raise unsupported(f"numpy.{ufunc.__name__} with out= or where=")
        kwargs.pop("out", None)
        if method == "__call__" and ufunc is np.matmul:
            return _matmul(*inputs, **kwargs)
        if method == "__call__":
            return _elementwise(self.trace, ufunc, inputs, kwargs)
        if method in ("reduce", "accumulate") and len(inputs) == 1:
            rule = _UFUNC_REDUCTIONS.get(ufunc.__name__)
            if rule is not None:
                axis = kwargs.pop("axis", 0)
                if method == "reduce":
                    return _reduction(inputs[0], lambda v: ufunc.reduce(v, axis=axis, **kwargs), axis,
                                      kwargs.get("keepdims", False), rule)
                return _accumulate(inputs[0], lambda v: ufunc.accumulate(v, axis=axis, **kwargs), axis, rule)
        raise unsupported(f"numpy.{ufunc.__name__}.{method}")

    def __array_function__(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        name = func.__name__
        if name in _CREATIONS:  # np.zeros(n, like=x): a constant tracer, so writes into it are traced
            if _traced(args) or _traced(kwargs):
                raise unsupported(f"numpy.{name} with a traced argument")
            return Tracer(func(*args, **kwargs), None, self.trace)
        rule = _FUNCTIONS.get(name)
        if rule is None and name in _MOVES:
            rule = _move(func)
        if rule is None:
            module = getattr(func, "__module__", "numpy") or "numpy"
            raise unsupported(f"{module}.{name}")
        return rule(*args, **kwargs)

    # ---- methods (numpy's, routed through the rules)
    def __getitem__(self, key: Any) -> Tracer:
        if any(isinstance(k, Tracer) for k in (key if isinstance(key, tuple) else (key,))):
            raise unsupported("indexing with a traced array (the elements picked would depend on values)")
        out = _moved(self.trace, [self], lambda vs: vs[0][key], [self.value.dtype])
        if isinstance(out, Tracer):
            _mark_view(out, self, lambda numbers: numbers[key])
        return out

    def __setitem__(self, key: Any, item: Any) -> None:
        if any(isinstance(k, Tracer) for k in (key if isinstance(key, tuple) else (key,))):
            raise unsupported("assigning with a traced index")
        item = _lift(item, self.trace)
        where = _numbers(self.shape)
        where[key] = _numbers(item.shape, self.size)
        deps = _stacked([self, item])
        self.value[key] = item.value  # in place: the base and the other views of this memory see it
        self.deps = None if deps is None or self.dtype.kind not in "fc" else _select(deps, where,
                                                                                     self.size + item.size)
        base = self._base
        if base is None:
            self._writes += 1
            return
        # this view's new rows go to its base, at the view's positions there
        where = _numbers(base.shape)
        where.reshape(-1)[self._index.reshape(-1)] = _numbers(self.shape, base.size).reshape(-1)
        rows = _stacked([base, self])
        base.deps = None if rows is None or base.dtype.kind not in "fc" else _select(rows, where,
                                                                                     base.size + self.size)
        base._writes += 1
        self._seen = base._writes

    def reshape(self, *shape: Any, order: str = "C") -> Tracer:
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return np.reshape(self, shape, order=order)

    def transpose(self, *axes: Any) -> Tracer:
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return np.transpose(self, axes or None)

    def astype(self, dtype: Any, **_: Any) -> Tracer:
        dtype = np.dtype(dtype)
        deps = self.deps if dtype.kind in "fc" else None  # an integer cast is piecewise constant
        return Tracer(self.value.astype(dtype), deps, self.trace)

    def copy(self, *_: Any, **__: Any) -> Tracer:
        return Tracer(self.value.copy(), self.deps, self.trace)

    def flatten(self, order: str = "C") -> Tracer:
        return np.ravel(self, order=order).copy()  # a copy, never a view (numpy's flatten)

    def round(self, decimals: int = 0, out: Any = None) -> Tracer:
        return np.round(self, decimals, out)

    def __abs__(self) -> Tracer:
        return np.absolute(self)


def _method(name: str) -> Callable[..., Any]:
    def method(self: Tracer, *args: Any, **kwargs: Any) -> Any:
        return getattr(np, name)(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in ("sum", "mean", "prod", "max", "min", "std", "var", "cumsum", "cumprod", "ravel", "squeeze",
              "swapaxes", "clip", "dot", "diagonal", "repeat", "take", "conj", "conjugate", "nonzero"):
    setattr(Tracer, _name, _method(_name))


def _operator(ufunc: Any, reflected: bool = False) -> Callable[..., Any]:
    if reflected:
        return lambda self, other: ufunc(other, self)
    return lambda self, other: ufunc(self, other)


for _dunder, _ufunc in (
    ("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("truediv", np.true_divide),
    ("floordiv", np.floor_divide), ("mod", np.remainder), ("pow", np.power), ("matmul", np.matmul),
):
    setattr(Tracer, f"__{_dunder}__", _operator(_ufunc))
    setattr(Tracer, f"__r{_dunder}__", _operator(_ufunc, reflected=True))
for _dunder, _ufunc in (("lt", np.less), ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal),
                        ("eq", np.equal), ("ne", np.not_equal)):
    setattr(Tracer, f"__{_dunder}__", _operator(_ufunc))
Tracer.__neg__ = lambda self: np.negative(self)  # type: ignore[attr-defined]
Tracer.__pos__ = lambda self: self  # type: ignore[attr-defined]
Tracer.__hash__ = None  # type: ignore[assignment]


def _mark_view(out: Tracer, source: Tracer, where: Callable[[np.ndarray], Any]) -> None:
    """Make ``out`` a view of ``source`` when numpy made its values one (they share memory):
    ``where(numbers)`` applies the same move to ``source``'s element numbers."""
    if out.value.size == 0 or not np.may_share_memory(out.value, source.value):
        return
    index = np.asarray(where(_numbers(source.shape) - 1))
    root = source
    if source._base is not None:  # a view of a view: point at the owner of the memory
        root, index = source._base, source._index.reshape(-1)[index]
    out._base, out._index, out._seen = root, np.asarray(index, dtype=np.int64), root._writes


def _piece(moved: Any, i: int) -> Any:
    return moved[i] if isinstance(moved, (list, tuple)) else moved


def _lift(a: Any, trace: _Trace) -> Tracer:
    """A tracer for ``a``; a constant depends on nothing."""
    if isinstance(a, Tracer):
        return a
    if isinstance(a, (list, tuple)) and any(isinstance(v, Tracer) for v in a):
        return np.stack([_lift(v, trace) for v in a])
    return Tracer(np.asarray(a), None, trace)


def _traced(args: Any) -> list[Tracer]:
    found: list[Tracer] = []
    stack = [args]
    while stack:
        a = stack.pop()
        if isinstance(a, Tracer):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
    return found


def _stacked(ts: list[Tracer]) -> Any:
    """The rows of every tracer in ``ts`` one under the other (``None`` if none depends on anything)."""
    if all(t.deps is None for t in ts):
        return None
    trace = ts[0].trace
    return _sp().vstack([trace.empty(t.size) if t.deps is None else t.deps for t in ts], format="csr")


def _broadcast_rows(t: Tracer, shape: tuple) -> Any:
    """``t``'s rows broadcast to ``shape`` (``None`` if ``t`` depends on nothing)."""
    if t.deps is None:
        return None
    if t.shape == shape:
        return t.deps
    return _select(t.deps, np.broadcast_to(_numbers(t.shape), shape), t.size)


# ------------------------------------------------------------------ elementwise
#: Ufuncs whose result depends on nothing (piecewise constant, or boolean).
_CONSTANT = frozenset("""
    less less_equal greater greater_equal equal not_equal logical_and logical_or logical_xor logical_not
    isnan isinf isfinite isnat signbit sign floor ceil trunc rint floor_divide bitwise_and bitwise_or
    bitwise_xor invert left_shift right_shift gcd lcm heaviside spacing
""".split())
#: Ufuncs that are linear, or piecewise linear: they record no pairs.
_LINEAR = frozenset("""
    add subtract negative positive conjugate conj deg2rad rad2deg degrees radians absolute fabs maximum
    minimum fmax fmin remainder fmod copysign
""".split())


def _elementwise(trace: _Trace, ufunc: Any, inputs: tuple, kwargs: dict) -> Any:
    ts = [_lift(a, trace) for a in inputs]
    value = ufunc(*[t.value for t in ts], **kwargs)
    name = ufunc.__name__
    outs = value if isinstance(value, tuple) else (value,)
    shape = np.shape(outs[0])
    if name in _CONSTANT or all(t.deps is None for t in ts):
        deps = None
    else:
        rows = [_broadcast_rows(t, shape) for t in ts]
        present = [r for r in rows if r is not None]
        deps = _union(present).tocsr()
        _record_pairs(trace, name, ts, rows, deps)
    result = tuple(Tracer(v, deps if np.asarray(v).dtype.kind in "fc" else None, trace) for v in outs)
    return result if isinstance(value, tuple) else result[0]


def _record_pairs(trace: _Trace, name: str, ts: list[Tracer], rows: list, deps: Any) -> None:
    if not trace.second_order or name in _LINEAR:
        return
    if name == "multiply" and len(rows) == 2:
        a, b = rows
        if a is not None and b is not None:
            trace.pairs(a, b)
            trace.pairs(b, a)
        return
    if name in ("divide", "true_divide") and len(rows) == 2:
        a, b = rows
        if b is None:  # division by a constant: linear
            return
        trace.pairs(b)
        if a is not None:
            trace.pairs(a, b)
            trace.pairs(b, a)
        return
    if name == "power" and len(rows) == 2 and rows[1] is None:
        exponent = ts[1].value
        if np.all((exponent == 1) | (exponent == 0)):
            return
    trace.pairs(deps)  # any other nonlinear op: every pair within an element's dependencies


# ------------------------------------------------------------------ reductions
def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(sorted(int(a) % ndim for a in axes)) if ndim else ()


def _reduction(a: Any, compute: Callable[[np.ndarray], Any], axis: Any, keepdims: bool, nonlinear: bool) -> Tracer:
    """Each output element depends on every element it reduces; ``nonlinear``: they interact."""
    if not isinstance(a, Tracer):
        return compute(np.asarray(a))
    value = np.asarray(compute(a.value))
    if a.deps is None:
        return Tracer(value, None, a.trace)
    axes = _axes(axis, a.ndim)
    kept = tuple(1 if i in axes else d for i, d in enumerate(a.shape))
    out = np.broadcast_to(_numbers(kept), a.shape)
    sp = _sp()
    gather = sp.csr_matrix(
        (np.ones(a.size, dtype=bool), (out.ravel() - 1, np.arange(a.size))), shape=(math.prod(kept), a.size)
    )
    deps = (gather @ a.deps).tocsr()
    if nonlinear:
        a.trace.pairs(deps)
    if value.dtype.kind not in "fc":
        deps = None
    return Tracer(value, deps, a.trace)


def _accumulate(a: Any, compute: Callable[[np.ndarray], Any], axis: Any, nonlinear: bool) -> Tracer:
    """``cumsum``-like: element ``p`` along ``axis`` depends on elements ``0..p``."""
    if not isinstance(a, Tracer):
        return compute(np.asarray(a))
    if axis is None:
        a, axis = np.ravel(a), 0
    value = np.asarray(compute(a.value))
    if a.deps is None:
        return Tracer(value, None, a.trace)
    numbers = np.moveaxis(_numbers(a.shape) - 1, int(axis), -1)
    length = numbers.shape[-1]
    p, q = np.tril_indices(length)
    rows, cols = numbers[..., p].ravel(), numbers[..., q].ravel()
    sp = _sp()
    gather = sp.csr_matrix((np.ones(rows.size, dtype=bool), (rows, cols)), shape=(a.size, a.size))
    deps = (gather @ a.deps).tocsr()
    if nonlinear:
        a.trace.pairs(deps)
    return Tracer(value, deps, a.trace)


_UFUNC_REDUCTIONS = {"add": False, "multiply": True, "maximum": False, "minimum": False,
                     "fmax": False, "fmin": False}


def _reducer(func: Callable[..., Any], nonlinear: bool) -> Callable[..., Any]:
    def rule(a: Any, axis: Any = None, *args: Any, keepdims: bool = False, **kwargs: Any) -> Any:
        if args:
            raise unsupported(f"numpy.{func.__name__} with positional arguments after axis")
        return _reduction(a, lambda v: func(v, axis=axis, keepdims=keepdims, **kwargs), axis, keepdims, nonlinear)

    return rule


def _accumulator(func: Callable[..., Any], nonlinear: bool) -> Callable[..., Any]:
    def rule(a: Any, axis: Any = None, **kwargs: Any) -> Any:
        return _accumulate(a, lambda v: func(v, axis=axis, **kwargs), axis, nonlinear)

    return rule


def _norm(x: Any, ord: Any = None, axis: Any = None, keepdims: bool = False) -> Any:
    return _reduction(x, lambda v: np.linalg.norm(v, ord=ord, axis=axis, keepdims=keepdims), axis, keepdims, True)


def _average(a: Any, axis: Any = None, weights: Any = None, **kwargs: Any) -> Any:
    if isinstance(weights, Tracer):
        raise unsupported("numpy.average with traced weights")
    return _reduction(a, lambda v: np.average(v, axis=axis, weights=weights, **kwargs), axis,
                      kwargs.get("keepdims", False), False)


def _diff(a: Any, n: int = 1, axis: int = -1, prepend: Any = None, append: Any = None) -> Any:
    pieces = [p for p in (prepend, a, append) if p is not None]
    if len(pieces) > 1:
        trace = a.trace
        ts = [_lift(p, trace) for p in pieces]
        ts = [t if t.ndim else np.broadcast_to(t, a.shape[:axis % a.ndim] + (1,) + a.shape[axis % a.ndim + 1:])
              for t in ts]
        a = np.concatenate(ts, axis=axis)
    for _ in range(n):
        hi = [slice(None)] * a.ndim
        lo = [slice(None)] * a.ndim
        hi[axis], lo[axis] = slice(1, None), slice(None, -1)
        a = a[tuple(hi)] - a[tuple(lo)]
    return a


# ------------------------------------------------------------------ moves
#: numpy functions that only move, copy or drop elements (padding adds constants): the
#: function applied to element numbers says where each output element comes from.
_MOVES = frozenset("""
    reshape transpose moveaxis swapaxes squeeze expand_dims ravel flip fliplr flipud roll rot90 broadcast_to
    tile repeat take take_along_axis concatenate stack hstack vstack dstack column_stack row_stack block append
    atleast_1d atleast_2d atleast_3d diagonal diag tril triu pad copy array_split split hsplit vsplit
    real delete insert resize flatnonzero
""".split()) - {"flatnonzero"}


def _moved(trace: _Trace, ts: list[Tracer], compute: Callable[[list], Any], dtypes: list) -> Any:
    """``compute`` applied to the values, and to element numbers to gather the rows."""
    value = compute([t.value for t in ts])
    offsets = np.cumsum([0] + [t.size for t in ts])
    numbers = compute([_numbers(t.shape, int(o)) for t, o in zip(ts, offsets)])
    deps = _stacked(ts)
    return _wrap_moved(trace, value, numbers, deps, int(offsets[-1]))


def _wrap_moved(trace: _Trace, value: Any, numbers: Any, deps: Any, total: int) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_wrap_moved(trace, v, i, deps, total) for v, i in zip(value, numbers))
    value = np.asarray(value)
    rows = None if deps is None or value.dtype.kind not in "fc" else _select(deps, numbers, total)
    return Tracer(value, rows, trace)


def _move(func: Callable[..., Any]) -> Callable[..., Any]:
    """The rule of a move: the tracers among the first argument (an array or a list of
    arrays) are moved; constants there become element number 0 (no dependencies)."""

    def rule(first: Any, *args: Any, **kwargs: Any) -> Any:
        if _traced(args) or _traced(kwargs):
            raise unsupported(f"numpy.{func.__name__} with a traced array after the first argument")
        numbers_args, numbers_kwargs = args, kwargs
        if func.__name__ == "pad" and kwargs.get("mode", "constant") == "constant":
            numbers_kwargs = dict(kwargs, constant_values=0)  # the padding is constant: element number 0
        if func.__name__ == "insert":  # the inserted values are constants: element number 0
            if len(args) >= 2:
                numbers_args = (args[0], np.zeros(np.shape(args[1]), dtype=np.int64), *args[2:])
            elif "values" in kwargs:
                numbers_kwargs = dict(kwargs, values=np.zeros(np.shape(kwargs["values"]), dtype=np.int64))
        many = isinstance(first, (list, tuple))
        items = list(first) if many else [first]
        trace = _traced(items)[0].trace
        ts = [_lift(v, trace) for v in items]
        n_numbers = np.cumsum([0] + [t.size for t in ts])

        value = func([t.value for t in ts] if many else ts[0].value, *args, **kwargs)
        numbers = [

            _numbers(t.shape, int(o)) if t.deps is not None else np.zeros(t.shape, dtype=np.int64)
            for t, o in zip(ts, n_numbers)
        ]
        numbers = func(numbers if many else numbers[0], *numbers_args, **numbers_kwargs)
        out = _wrap_moved(trace, value, numbers, _stacked(ts), int(n_numbers[-1]))
        if not many:  # reshape, transpose, split...: numpy may give views

            def moved(numbers: np.ndarray, i: int) -> Any:
                return _piece(func(numbers, *numbers_args, **numbers_kwargs), i)

            for i, piece in enumerate(out if isinstance(out, (list, tuple)) else [out]):
                if isinstance(piece, Tracer):
                    _mark_view(piece, ts[0], lambda numbers, i=i: moved(numbers, i))
        return out

    return rule


# ------------------------------------------------------------------ contractions
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _einsum(subscripts: Any, *operands: Any, **kwargs: Any) -> Any:
    if not isinstance(subscripts, str):
        raise unsupported("numpy.einsum in its interleaved (operand, sublist) form")
    if "..." in subscripts:
        raise unsupported("numpy.einsum with an ellipsis ('...')")
    kwargs.pop("optimize", None)
    spec = subscripts.replace(" ", "")
    inputs, _, output = spec.partition("->")
    terms = inputs.split(",")
    if "->" not in spec:
        letters = "".join(terms)
        output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    trace = _traced(operands)[0].trace
    ts = [_lift(o, trace) for o in operands]
    value = np.einsum(spec, *[t.value for t in ts], **kwargs)
    sizes: dict[str, int] = {}
    for term, t in zip(terms, ts):
        if len(set(term)) != len(term):
            raise unsupported(f"numpy.einsum with a repeated index in one operand ({term!r})")
        for c, d in zip(term, t.shape):
            sizes[c] = max(sizes.get(c, 1), d)
    grid_letters = sorted(sizes)
    grid = tuple(sizes[c] for c in grid_letters)

    def on_grid(term: str, shape: tuple) -> np.ndarray:
        # element number of the operand at every grid point (broadcast dimensions of size 1 included)
        numbers = _numbers(shape) - 1
        order = sorted(range(len(term)), key=lambda i: grid_letters.index(term[i]))
        numbers = np.transpose(numbers, order)
        present = sorted(term, key=grid_letters.index)
        view = numbers.reshape([numbers.shape[present.index(c)] if c in present else 1 for c in grid_letters])
        return np.broadcast_to(view, grid).ravel()

    out_shape = tuple(sizes[c] for c in output)
    out_index = on_grid(output, out_shape)
    sp = _sp()
    points = out_index.size
    picks, rows = [], []
    for term, t in zip(terms, ts):
        if t.deps is None:
            picks.append(None)
            continue
        pick = sp.csr_matrix((np.ones(points, dtype=bool), (np.arange(points), on_grid(term, t.shape))),
                             shape=(points, t.size))
        picks.append(pick @ t.deps)
        rows.append(picks[-1])
    value = np.asarray(value)
    if not rows:
        return Tracer(value, None, trace)
    out_pick = sp.csr_matrix((np.ones(points, dtype=bool), (out_index, np.arange(points))),
                             shape=(math.prod(out_shape), points))
    deps = (out_pick @ _union(rows)).tocsr()
    present = [p for p in picks if p is not None]
    for i in range(len(present)):
        for j in range(i + 1, len(present)):
            trace.pairs(present[i], present[j])
            trace.pairs(present[j], present[i])
    return Tracer(value, deps, trace)


def _matmul(a: Any, b: Any, **kwargs: Any) -> Any:
    if kwargs:
        raise unsupported("numpy.matmul with keyword arguments")
    trace = _traced((a, b))[0].trace
    a, b = _lift(a, trace), _lift(b, trace)
    if a.ndim == 0 or b.ndim == 0:
        raise unsupported("numpy.matmul of a scalar (use *)")
    if a.ndim == 1 and b.ndim == 1:
        return _einsum("k,k->", a, b)
    if a.ndim == 1:
        return np.squeeze(_matmul(np.reshape(a, (1, -1)), b), axis=-2)
    if b.ndim == 1:
        return np.squeeze(_matmul(a, np.reshape(b, (-1, 1))), axis=-1)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if a.shape[:-2] != batch:
        a = np.broadcast_to(a, batch + a.shape[-2:])
    if b.shape[:-2] != batch:
        b = np.broadcast_to(b, batch + b.shape[-2:])
    bl = _LETTERS[3 : 3 + len(batch)]
    return _einsum(f"{bl}ik,{bl}kj->{bl}ij", a, b)


def _tensordot(a: Any, b: Any, axes: Any = 2) -> Any:
    trace = _traced((a, b))[0].trace
    a, b = _lift(a, trace), _lift(b, trace)
    if isinstance(axes, int):
        ax_a, ax_b = list(range(a.ndim - axes, a.ndim)), list(range(axes))
    else:
        ax_a, ax_b = ([axes[0]] if isinstance(axes[0], int) else list(axes[0]),
                      [axes[1]] if isinstance(axes[1], int) else list(axes[1]))
    ax_a, ax_b = [i % a.ndim for i in ax_a], [i % b.ndim for i in ax_b]
    la, lb = list(_LETTERS[: a.ndim]), list(_LETTERS[a.ndim : a.ndim + b.ndim])
    for i, j in zip(ax_a, ax_b):
        lb[j] = la[i]
    out = [c for i, c in enumerate(la) if i not in ax_a] + [c for j, c in enumerate(lb) if j not in ax_b]
    return _einsum(f"{''.join(la)},{''.join(lb)}->{''.join(out)}", a, b)


def _dot(a: Any, b: Any, out: Any = None) -> Any:
    if out is not None:
        raise unsupported("numpy.dot with out=")
    na, nb = np.ndim(a.value if isinstance(a, Tracer) else a), np.ndim(b.value if isinstance(b, Tracer) else b)
    if na == 0 or nb == 0:
        return np.multiply(a, b)
    if nb == 1:
        return _tensordot(a, b, ([na - 1], [0]))
    return _tensordot(a, b, ([na - 1], [nb - 2]))


def _inner(a: Any, b: Any) -> Any:
    na, nb = np.ndim(a.value if isinstance(a, Tracer) else a), np.ndim(b.value if isinstance(b, Tracer) else b)
    if na == 0 or nb == 0:
        return np.multiply(a, b)
    return _tensordot(a, b, ([na - 1], [nb - 1]))


def _outer(a: Any, b: Any, out: Any = None) -> Any:
    return _einsum("i,j->ij", np.ravel(a), np.ravel(b))


def _vdot(a: Any, b: Any) -> Any:
    return _einsum("i,i->", np.ravel(a), np.ravel(b))


# ------------------------------------------------------------------ the rest
def _where(condition: Any, x: Any = None, y: Any = None) -> Any:
    if x is None or y is None:
        raise unsupported("numpy.where with one argument (the elements picked depend on values)")
    trace = _traced((condition, x, y))[0].trace
    cond = condition.value if isinstance(condition, Tracer) else condition
    # both branches: the pattern must hold wherever the condition changes
    return _union_of(trace, [_lift(x, trace), _lift(y, trace)], np.where(cond, _value(x), _value(y)))


def _value(a: Any) -> Any:
    return a.value if isinstance(a, Tracer) else a


def _union_of(trace: _Trace, ts: list[Tracer], value: Any) -> Tracer:
    value = np.asarray(value)
    rows = [r for r in (_broadcast_rows(t, value.shape) for t in ts) if r is not None]
    deps = _union(rows).tocsr() if rows and value.dtype.kind in "fc" else None
    return Tracer(value, deps, trace)


def _clip(a: Any, a_min: Any = None, a_max: Any = None, **kwargs: Any) -> Any:
    trace = _traced((a, a_min, a_max))[0].trace
    ts = [_lift(v, trace) for v in (a, a_min, a_max) if v is not None]
    return _union_of(trace, ts, np.clip(_value(a), _value(a_min), _value(a_max), **kwargs))


def _like(kind: str) -> Callable[..., Any]:
    def rule(a: Any, *args: Any, **kwargs: Any) -> Any:
        value = getattr(np, kind)(_value(a), *args, **kwargs)
        return Tracer(value, None, a.trace)

    return rule


def _sort(a: Any, axis: int = -1, **kwargs: Any) -> Any:
    # each sorted element may come from any element along the axis
    if axis is None:
        a, axis = np.ravel(a), 0
    union = _reduction(a, lambda v: np.sum(v, axis=axis, keepdims=True), axis, True, False)
    return _union_of(a.trace, [union], np.sort(a.value, axis=axis, **kwargs))


def _round(a: Any, decimals: int = 0, out: Any = None) -> Any:
    # piecewise constant: its derivative is zero wherever it exists, so it depends on nothing
    if out is not None:
        raise unsupported("numpy.round with out=")
    return Tracer(np.round(_value(a), decimals), None, a.trace)


def _append(arr: Any, values: Any, axis: Any = None) -> Any:
    # numpy's own definition, in operations that have rules (values may be traced too)
    if axis is None:
        return np.concatenate([np.ravel(arr), np.ravel(values)])
    return np.concatenate([arr, values], axis=axis)


def _shape_of(a: Any) -> tuple:
    return np.shape(_value(a))


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sum": _reducer(np.sum, False), "nansum": _reducer(np.nansum, False), "mean": _reducer(np.mean, False),
    "nanmean": _reducer(np.nanmean, False), "max": _reducer(np.max, False), "amax": _reducer(np.max, False),
    "min": _reducer(np.min, False), "amin": _reducer(np.min, False), "nanmax": _reducer(np.nanmax, False),
    "nanmin": _reducer(np.nanmin, False), "prod": _reducer(np.prod, True), "std": _reducer(np.std, True),
    "var": _reducer(np.var, True), "trapezoid": _reducer(np.trapezoid, False), "average": _average,
    "norm": _norm, "cumsum": _accumulator(np.cumsum, False), "cumprod": _accumulator(np.cumprod, True),
    "diff": _diff, "einsum": _einsum, "matmul": _matmul, "dot": _dot, "tensordot": _tensordot,
    "inner": _inner, "outer": _outer, "vdot": _vdot, "where": _where, "clip": _clip, "sort": _sort,
    "zeros_like": _like("zeros_like"), "ones_like": _like("ones_like"), "empty_like": _like("zeros_like"),
    "full_like": _like("full_like"), "shape": _shape_of, "ndim": lambda a: np.ndim(_value(a)),
    "size": lambda a, axis=None: np.size(_value(a), axis),
    "result_type": lambda *a: np.result_type(*[_value(v) for v in a]),
    "iscomplexobj": lambda a: False, "isrealobj": lambda a: True,
    "round": _round, "around": _round, "round_": _round, "append": _append,
}
#: numpy's array creation functions, reached with ``like=`` a tracer.
_CREATIONS = frozenset({"zeros", "ones", "empty", "full", "eye", "identity", "arange", "linspace"})
for _name in ("trapz",):
    if hasattr(np, _name):
        _FUNCTIONS[_name] = _reducer(getattr(np, _name), False)


# ------------------------------------------------------------------ custom functions
def through_custom_function(fun: Callable[..., Any], leaves: list, treedef: Any, stops: bool = False) -> Any:
    """A custom function ``fun`` called on tracers (``leaves``: its positional arguments
    flattened by ``treedef``): its outputs, each element depending on every input element (a
    dense block); ``stops``: ``ad.stop_gradient``'s, which depend on nothing.

    The derivative through a custom function is its rule's (``bwd``, the jvp rule, the implicit
    function theorem's), which need not have ``f``'s pattern: tracing ``f`` gave an elementwise
    ``f`` with a mixing ``bwd`` a diagonal pattern, and the compressed products folded the
    rule's other entries onto the diagonal, silently.  Tracing the rule instead would not do
    either: one mode's rule says nothing of the other's, and a second derivative also goes
    through how the rule depends on its residuals.  So the block is dense, and for a Hessian
    every pair of its inputs interacts.  ``fun`` runs on the plain values, for the outputs'
    values and shapes; a tracer it reads from a closure keeps its own dependencies (added to
    the block's).  Any function opaque to the tracer whose derivative is not that of its
    operations can be traced this way (``ad.differentiate_with``'s, whose ``f`` is another
    library's)."""
    traced = [a for a in leaves if isinstance(a, Tracer)]
    trace = traced[0].trace
    out = fun(*pytree.tree_unflatten(treedef, [a.value.copy() if isinstance(a, Tracer) else a for a in leaves]))
    block = None  # one row: the union of the inputs' dependencies
    if not stops:
        present = [t.deps for t in traced if t.deps is not None and t.dtype.kind in "fc"]
        if present:
            stacked = _sp().vstack(present, format="csr")
            block = _sp().csr_matrix(np.ones((1, stacked.shape[0]), dtype=bool)) @ stacked
            block = (block != 0).tocsr()
            trace.pairs(block)  # the rule's second derivative may couple any two of its inputs

    def output(v: Any) -> Any:
        if isinstance(v, Tracer):  # f read a tracer from a closure: its rows stay
            own, v = v.deps, Tracer(v.value.copy(), None, trace)  # not a view of the closure's tracer
        elif hasattr(v, "shape") and hasattr(v, "dtype"):
            own, v = None, Tracer(np.asarray(v), None, trace)
        else:
            return v  # a Python number or a non-array: a constant
        if v.dtype.kind not in "fc":
            return Tracer(v.value, None, trace)
        rows = None if block is None else _select(block, np.ones(v.shape, dtype=np.int64), 1)
        if own is not None:
            rows = own if rows is None else (own + rows).tocsr()
        return Tracer(v.value, rows, trace)

    return pytree.tree_map(output, out)


# ------------------------------------------------------------------ entry points
def _register_with_autoray() -> None:
    import autoray

    autoray.register_backend(Tracer, "numpy")


def trace_flat(fn: Callable[[list, list], tuple], xs: list, data: list, second_order: bool) -> tuple[Any, Any]:
    """Run the flat function ``fn`` on tracers of the numpy leaves ``xs``: ``(output tracer, trace)``."""
    _register_with_autoray()
    n = sum(int(np.size(x)) for x in xs)
    trace = _Trace(n, second_order)
    sp = _sp()
    tracers, start = [], 0
    for x in xs:
        x = np.asarray(x)
        k = x.size
        eye = sp.csr_matrix((np.ones(k, dtype=bool), (np.arange(k), np.arange(start, start + k))), shape=(k, n))
        tracers.append(Tracer(x.copy(), eye, trace))
        start += k
    try:
        y, _ = fn(tracers, [np.asarray(d) for d in data])
    except (ValueError, TypeError) as err:
        # numpy hides the conversion's error behind its own when a traced value is written
        # into a numpy array element (out[i] = x[i]): "setting an array element with a sequence"
        if _conversion_refused(err):
            raise SparsityDetectionError(_CONVERSION) from err
        raise
    return _lift(y, trace), trace


def _conversion_refused(err: BaseException | None) -> bool:
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, SparsityDetectionError):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def flat_jacobian_sparsity(fn: Callable[[list, list], tuple], xs: list, data: list) -> Any:
    """The ``(y.size, n)`` boolean CSR pattern of ``fn``'s Jacobian at numpy leaves ``xs``."""
    y, trace = trace_flat(fn, xs, data, second_order=False)
    return (y.deps if y.deps is not None else trace.empty(y.size)).astype(bool).tocsr()


def flat_hessian_sparsity(fn: Callable[[list, list], tuple], xs: list, data: list) -> Any:
    """The ``(n, n)`` boolean CSR pattern of scalar ``fn``'s Hessian at numpy leaves ``xs``."""
    y, trace = trace_flat(fn, xs, data, second_order=True)
    if y.size != 1:
        from .core import NonScalarOutputError

        raise NonScalarOutputError(f"hessian_sparsity needs f to return a scalar, got shape {y.shape}")
    h = trace.hessian()
    if y.deps is None:
        return _sp().csr_matrix(h.shape, dtype=bool)
    # a pair matters only between inputs the output depends on (drops dead code's pairs)
    used = np.zeros(trace.n, dtype=bool)
    used[y.deps.indices] = True
    mask = _sp().diags(used.astype(bool), format="csr", dtype=bool)
    return (mask @ h @ mask).astype(bool).tocsr()


def _flat(f: Callable[..., Any], x: Any, args: tuple) -> tuple[Any, list, list]:
    from .core import backend

    b = backend("finite_differences")  # numpy leaves; it flattens f like every backend does
    return b.flatten(f, x, args)


def jacobian_sparsity(f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """The sparsity pattern of ``f``'s Jacobian at ``x``, found without derivatives.

    ``jacobian_sparsity(f, x, *args) -> P``: a boolean ``scipy.sparse.csr_matrix`` of shape
    ``(y.size, n)``, ``n`` the number of float elements of ``x`` (a pytree's float leaves
    raveled and concatenated in flatten order; ``y`` raveled likewise).  ``f`` runs once on
    tracer arrays, so it must be written with numpy operations (``np.*``, array methods, or
    ``autoray.numpy``).  Conservative: ``P`` holds every nonzero, possibly some structural
    zeros.  An operation without a rule, or control flow on a traced value, raises
    :class:`~abstractdiff.SparsityDetectionError`.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> ad.jacobian_sparsity(lambda x: x[1:] * x[:-1], np.ones(3)).toarray()
        array([[ True,  True, False],
               [False,  True,  True]])
    """
    fn, xs, data = _flat(f, x, args)
    return flat_jacobian_sparsity(fn, xs, data)


def hessian_sparsity(f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """The sparsity pattern of scalar ``f``'s Hessian at ``x``, found without derivatives.

    ``hessian_sparsity(f, x, *args) -> P``: a symmetric boolean ``scipy.sparse.csr_matrix``
    of shape ``(n, n)``, with ``x`` flattened as in :func:`jacobian_sparsity`.  Linear
    operations add no pairs, a product adds the pairs of its factors' inputs, any other
    nonlinear operation the pairs of all its inputs.  Conservative, as
    :func:`jacobian_sparsity`.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> ad.hessian_sparsity(lambda x: (x[0] * x[1:]).sum() + x[2] ** 3, np.ones(3)).toarray()
        array([[False,  True,  True],
               [ True, False, False],
               [ True, False,  True]])
    """
    fn, xs, data = _flat(f, x, args)
    return flat_hessian_sparsity(fn, xs, data)

"""Pytree plumbing shared by every backend.

The public operators take ``f(x, *args)`` with ``x`` and ``args`` arbitrary pytrees
(``optree``: dict, list, tuple, namedtuple, None).  The core flattens both once and
hands adapters a *flat function* ``fn(xs, data) -> (y, aux)`` of two lists:

* ``xs``: the floating-point leaves of ``x``, the ones being differentiated;
* ``data``: every other array leaf, of ``x`` (integer arrays) and of ``args`` (any
  dtype), passed through undifferentiated.

Everything else (Python ints, bools, strings, other objects) is *static*: it is closed
over by the flat function and part of the cache key, so compiled backends specialise on
it exactly as ``jax.jit`` does on static arguments.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable, TypeVar

import numpy as np
import optree

from ._cache import WeakLRU
from ._errors import InvalidOutputError

T = TypeVar("T")

DIFF, DATA, STATIC = 0, 1, 2

PyTree = Any


_FLOAT_DTYPES: dict[Any, bool] = {}


def is_float_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` (numpy, torch, tensorflow or jax) is a real floating type."""
    try:
        return _FLOAT_DTYPES[dtype]  # on the hot path of every call: answer each dtype once
    except (KeyError, TypeError):
        pass
    flag = getattr(dtype, "is_floating_point", None)  # torch.dtype
    if flag is None:
        flag = getattr(dtype, "is_floating", None)  # tf.DType
    if flag is not None:
        result = bool(flag)
    else:
        try:
            result = np.dtype(dtype).name.startswith(("float", "bfloat"))
        except TypeError:
            result = False
    try:
        _FLOAT_DTYPES[dtype] = result
    except TypeError:
        pass
    return result


def is_array(obj: Any) -> bool:
    """Duck-typed array test: numpy, torch, jax (tracers too), tensorflow, ArrayBox."""
    return hasattr(obj, "shape") and hasattr(obj, "dtype")


_ARRAY_TYPES: set[type] = set()  # leaf types already seen to be arrays (not Python scalars)


def leaf_kind(leaf: Any, differentiable: bool) -> int:
    """Classify one leaf as DIFF, DATA or STATIC (see the module docstring)."""
    if type(leaf) in _ARRAY_TYPES:  # the hot path: an array type met before
        return DIFF if differentiable and is_float_dtype(leaf.dtype) else DATA
    if isinstance(leaf, bool):
        return STATIC
    if isinstance(leaf, float):
        return DIFF if differentiable else STATIC
    if isinstance(leaf, (int, str, bytes, complex)):
        return STATIC
    if is_array(leaf):
        _ARRAY_TYPES.add(type(leaf))
        return DIFF if differentiable and is_float_dtype(leaf.dtype) else DATA
    return STATIC


def is_float_leaf(a: Any) -> bool:
    """Whether a pytree leaf is differentiated: a Python float or a floating-point array."""
    return leaf_kind(a, True) == DIFF


def _static_key(leaf: Any) -> Any:
    # (type, value) so that 1, 1.0 and True key differently.  Floats by their exact bits:
    # -0.0 == 0.0 would otherwise share a plan (and its closed-over value), and a NaN
    # never equal to itself would add a plan per call.  Unhashable objects by identity
    # (the flat function keeps them alive, so the id cannot be reused).
    if isinstance(leaf, float):
        return (type(leaf), float.hex(leaf))
    try:
        hash(leaf)
    except TypeError:
        return ("id", id(leaf))
    return (type(leaf), leaf)


class Artefacts:
    """What one backend built for one flat function and one operator: its *variants*.

    ``fn.artefacts(backend, "pullback").get(variant, build)`` returns the artefact for
    ``variant`` (built once with ``build()``).  The backend's type and options are part of
    the key already (:meth:`FlatFunction.artefacts`); ``variant`` holds whatever else
    changes the result: the x64 mode, a device, the input signature (shapes and dtypes)
    when the artefact depends on it.  Thread-safe: two threads asking for a missing
    variant build it once.
    """

    __slots__ = ("operator", "_variants", "_lock")

    def __init__(self, operator: str):
        self.operator = operator
        self._variants: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, variant: Hashable, build: Callable[[], T]) -> T:
        try:
            return self._variants[variant]
        except KeyError:
            pass
        with self._lock:
            if variant not in self._variants:
                self._variants[variant] = build()
            return self._variants[variant]

    def peek(self, variant: Hashable) -> Any:
        """The artefact of ``variant`` if it was built, else ``None``."""
        return self._variants.get(variant)

    def put(self, variant: Hashable, value: Any) -> None:
        self._variants[variant] = value

    def trim(self, maxsize: int) -> None:
        """Keep at most ``maxsize`` variants, dropping the oldest (input signatures that
        change on every call must not grow the cache without end)."""
        with self._lock:
            while len(self._variants) > maxsize:
                del self._variants[next(iter(self._variants))]

    def __len__(self) -> int:
        return len(self._variants)

    def __repr__(self) -> str:
        return f"Artefacts({self.operator!r}, {len(self._variants)} variant(s))"


class HasArtefacts:
    """A function handed to an adapter's ``flat_*`` methods, with a typed cache of artefacts.

    Every callable the core gives adapters (:class:`FlatFunction`, and the core's derived
    functions such as the gradient function of a Hessian) has one, so an adapter never
    needs to know which kind it got.
    """

    __slots__ = ()

    def artefacts(self, backend: Any, operator: str) -> Artefacts:
        """The artefacts ``backend`` keeps for this function and ``operator``."""
        store: dict = self._artefacts  # type: ignore[attr-defined]
        key = (backend.cache_key, operator)
        found = store.get(key)
        if found is None:
            found = store.setdefault(key, Artefacts(operator))
        return found


def artefacts(fn: Any, backend: Any, operator: str) -> Artefacts:
    """``fn.artefacts(backend, operator)``, or a fresh (uncached) store for a plain callable."""
    get = getattr(fn, "artefacts", None)
    return get(backend, operator) if get is not None else Artefacts(operator)


class FlatFunction(HasArtefacts):
    """``f(x, *args)`` seen as ``fn(xs, data) -> (y, aux)`` over flat leaf lists.

    Built once per (function, structure, static leaves) and cached by the backend, so
    adapters can keep compiled variants of it in its typed cache, :meth:`artefacts`.
    """

    __slots__ = (
        "_f",
        "x_treedef",
        "args_treedef",
        "template",
        "diff_index",
        "data_index",
        "n_x_leaves",
        "has_aux",
        "_artefacts",
        "_preparations",
        "__weakref__",
    )

    def __init__(
        self,
        f: Callable[..., Any],
        x_treedef: Any,
        args_treedef: Any,
        template: list[Any],
        diff_index: tuple[int, ...],
        data_index: tuple[int, ...],
        n_x_leaves: int,
        has_aux: bool,
    ):
        self._f = _weak_callable(f)
        self.x_treedef = x_treedef
        self.args_treedef = args_treedef
        self.template = template
        self.diff_index = diff_index
        self.data_index = data_index
        self.n_x_leaves = n_x_leaves
        self.has_aux = has_aux
        self._artefacts: dict[Any, Artefacts] = {}
        # (backend key, preparation class, input signature) -> Preparation (see Backend.preparation)
        self._preparations: dict[Any, Any] = {}

    @property
    def f(self) -> Callable[..., Any]:
        f = self._f()
        if f is None:
            raise ReferenceError(
                "the function being differentiated was garbage collected; keep a reference to it "
                "while its flat function is in use"
            )
        return f

    def rebuild(self, xs: list[Any], data: list[Any]) -> tuple[PyTree, tuple[Any, ...]]:
        """The ``(x, args)`` that ``f`` is called with, from flat leaves."""
        leaves = list(self.template)
        for i, v in zip(self.diff_index, xs):
            leaves[i] = v
        for i, v in zip(self.data_index, data):
            leaves[i] = v
        n = self.n_x_leaves
        x = optree.tree_unflatten(self.x_treedef, leaves[:n])
        args = optree.tree_unflatten(self.args_treedef, leaves[n:])
        return x, args

    def __call__(self, xs: list[Any], data: list[Any]) -> tuple[Any, Any]:
        x, args = self.rebuild(xs, data)
        y, aux = split_aux(self.f(x, *args), self.has_aux)
        return check_output(y), aux

    def unflatten_x(self, values: list[Any], fill: Any = None) -> PyTree:
        """A tree shaped like ``x`` with ``values`` at the float leaves, ``fill`` elsewhere."""
        leaves = [fill] * self.n_x_leaves
        for i, v in zip(self.diff_index, values):
            leaves[i] = v
        return optree.tree_unflatten(self.x_treedef, leaves)

    def __repr__(self) -> str:
        f = self._f()
        name = getattr(f, "__qualname__", repr(f))
        return f"FlatFunction({name}, x={self.x_treedef})"


def split_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(y, aux)`` from what ``f`` returned: ``(out, None)``, or the pair with ``has_aux``."""
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise InvalidOutputError(
            f"with has_aux=True, f must return a pair (y, aux); it returned {type(out).__name__}"
        )
    return out


def check_output(y: Any) -> Any:
    """``f``'s primary output must be an array or a Python number."""
    if is_array(y):
        return y
    if isinstance(y, (int, float)) and not isinstance(y, bool):
        return np.asarray(y, dtype=np.float64)
    raise InvalidOutputError(
        f"f must return an array (or a Python number), but it returned a "
        f"{type(y).__name__}; return one array, e.g. stack or sum the values"
    )


def _weak_callable(f: Callable[..., Any]) -> Callable[[], Any]:
    # The plan cache drops a function's entries when the function dies; a strong
    # reference from the cached FlatFunction would keep it (and them) alive forever.
    # Whoever keeps a FlatFunction beyond the call (a returned pullback) keeps f too.
    try:
        if getattr(f, "__self__", None) is not None and getattr(f, "__func__", None) is not None:
            return weakref.WeakMethod(f)  # type: ignore[arg-type]
        return weakref.ref(f)
    except TypeError:  # not weak-referenceable: the cache does not store it either
        return lambda: f


def _function_identity(f: Callable[..., Any]) -> tuple[Any, ...]:
    """``(function, owner)`` for a bound method (each attribute access makes a new method
    object; these two are stable), else ``(f,)``."""
    owner = getattr(f, "__self__", None)
    func = getattr(f, "__func__", None)
    if owner is not None and func is not None:
        return func, owner
    return (f,)


class PlanCache:
    """Flat functions per user function, dropped when the function is garbage collected.

    Each function keeps at most :attr:`max_per_function` plans, least recently used out
    first: a static argument that changes every call (a step counter passed as an int)
    would otherwise add a plan, and on compiled backends an executable, per call.
    """

    max_per_function = 64

    def __init__(self) -> None:
        # function (and owner of a bound method), held weakly -> that function's plans
        self._functions: WeakLRU[OrderedDict[Any, FlatFunction]] = WeakLRU()
        self._lock = threading.Lock()

    def lookup(self, f: Callable[..., Any], key: Any) -> FlatFunction | None:
        plans = self._functions.get(_function_identity(f))
        if plans is None:
            return None
        fn = plans.get(key)
        if fn is not None and len(plans) > 1:
            try:
                plans.move_to_end(key)
            except KeyError:  # pushed out by another thread meanwhile
                pass
        return fn

    def store(self, f: Callable[..., Any], key: Any, fn: FlatFunction) -> None:
        ident = _function_identity(f)
        with self._lock:
            plans = self._functions.get(ident)
            if plans is None:  # not weak-referenceable (a builtin): put() keeps nothing
                plans = self._functions.put(ident, OrderedDict())
            plans[key] = fn
            while len(plans) > self.max_per_function:
                plans.popitem(last=False)

    def __len__(self) -> int:
        return sum(len(plans) for plans in self._functions.values())

    def clear(self) -> None:
        self._functions.clear()


def flatten_call(
    cache: PlanCache | None,
    f: Callable[..., Any],
    x: PyTree,
    args: tuple[Any, ...],
    has_aux: bool,
) -> tuple[FlatFunction, list[Any], list[Any]]:
    """Split ``f(x, *args)`` into a (cached) flat function and its leaf lists."""
    x_leaves, x_treedef = optree.tree_flatten(x)
    a_leaves, a_treedef = optree.tree_flatten(args)
    diff_index = []
    data_index = []
    static = []
    for i, leaf in enumerate(x_leaves):
        kind = leaf_kind(leaf, True)
        if kind == DIFF:
            diff_index.append(i)
        elif kind == DATA:
            data_index.append(i)
        else:
            static.append((i, _static_key(leaf)))
    n = len(x_leaves)
    for j, leaf in enumerate(a_leaves):
        kind = leaf_kind(leaf, False)
        if kind == DATA:
            data_index.append(n + j)
        else:
            static.append((n + j, _static_key(leaf)))
    key = (x_treedef, a_treedef, tuple(diff_index), tuple(data_index), tuple(static), has_aux)
    leaves = x_leaves + a_leaves
    fn = cache.lookup(f, key) if cache is not None else None
    if fn is None:
        dynamic = set(diff_index) | set(data_index)
        template = [None if i in dynamic else leaf for i, leaf in enumerate(leaves)]
        fn = FlatFunction(
            f, x_treedef, a_treedef, template, tuple(diff_index), tuple(data_index), n, has_aux
        )
        if cache is not None:
            cache.store(f, key, fn)
    xs = [leaves[i] for i in diff_index]
    data = [leaves[i] for i in data_index]
    return fn, xs, data

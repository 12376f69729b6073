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
from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np
import optree

from . import _pytree as pytree
from ._cache import LRU, Memo, WeakLRU, static_key
from ._captures import captures
from ._errors import CollectedError, InvalidOutputError, NonDifferentiableInputError
from ._operator_table import OPERATORS

T = TypeVar("T")

DIFF, DATA, STATIC = 0, 1, 2

PyTree = Any


_FLOAT_DTYPES: Memo = Memo(name="float dtypes", keyed_on="a library's dtype object")


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
        result = dtype_text(dtype).startswith(("float", "bfloat"))
    try:
        _FLOAT_DTYPES[dtype] = result
    except TypeError:
        pass
    return result


def dtype_text(dtype: Any) -> str:
    """A dtype's plain name: numpy's (``"float32"``), else the last dotted part of its text
    (``paddle.float64`` -> ``"float64"``, ``mlx.core.float32`` -> ``"float32"``)."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).rpartition(".")[2].lower()


def is_array(obj: Any) -> bool:
    """Duck-typed array test: numpy, torch, jax (tracers too), tensorflow, ArrayBox."""
    return hasattr(obj, "shape") and hasattr(obj, "dtype")


# leaf types already seen to be arrays (not Python scalars)
_ARRAY_TYPES: Memo = Memo(name="array types", keyed_on="a leaf's type")


#: Array types seen to be pytree leaves themselves (``x`` flattens to ``[x]``), for the fast
#: path of :func:`flatten_call`; a type registered as a pytree node later leaves the set.
_LEAF_ARRAY_TYPES: Memo = Memo(name="single-leaf array types", keyed_on="an input's type")
_LEAF_TREEDEF = pytree.tree_structure(0.0)
_NO_ARGS_TREEDEF = pytree.tree_structure(())
#: The plan-cache key of f(x) with one float array x and no arguments, by has_aux.
_ONE_ARRAY = {
    aux: (_LEAF_TREEDEF, _NO_ARGS_TREEDEF, (0,), (), (), aux) for aux in (False, True)
}


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


def _static_key(leaf: Any, deep: bool = True) -> Any:
    # (type, value) so that 1, 1.0 and True key differently; floats by their exact bits
    # (-0.0 == 0.0 would otherwise share a plan and its closed-over value); with ``deep`` (a
    # backend that reuses traces), an object compared by identity also by its attributes,
    # which the same object can change: the one policy, abstractdiff._cache.static_key.
    return static_key(leaf, deep)


class Artefacts:
    """What one backend built for one flat function and one operator: its *variants*.

    ``fn.artefacts(backend, "pullback").get(variant, build)`` returns the artefact for
    ``variant`` (built once with ``build()``).  The backend's type and options are part of
    the key already (:meth:`FlatFunction.artefacts`); ``variant`` holds whatever else
    changes the result: the x64 mode, a device, the input signature (shapes and dtypes)
    when the artefact depends on it.  At most :attr:`max_variants` are kept, the least
    recently used out first (a shape that changes every call must not grow the cache without
    end): the one cache policy (:class:`abstractdiff._cache.LRU`).  Thread-safe: two threads
    asking for a missing variant build it once.
    """

    __slots__ = ("operator", "_variants")

    max_variants = 64

    def __init__(self, operator: str):
        self.operator = operator
        self._variants: LRU[Hashable, Any] = LRU(
            self.max_variants, name="compiled artefacts",
            keyed_on="flat function, backend and options, operator; x64 mode, device, input shapes and dtypes",
        )

    def get(self, variant: Hashable, build: Callable[[], T]) -> T:
        return self._variants.get_or_build(variant, build)

    def peek(self, variant: Hashable) -> Any:
        """The artefact of ``variant`` if it was built, else ``None``."""
        return self._variants.get(variant)

    def put(self, variant: Hashable, value: Any) -> None:
        self._variants.put(variant, value)

    def __len__(self) -> int:
        return len(self._variants)

    def __repr__(self) -> str:
        return f"Artefacts({self.operator!r}, {len(self._variants)} variant(s))"


#: How many preparations a flat function keeps: 32 input signatures per operator (least
#: recently used out first).
MAX_PREPARATIONS = 32 * len(OPERATORS)


class AuxStatics:
    """The leaves of ``aux`` that a library's compiled function cannot return (ints, strings,
    numpy constants: ``jit``, ``tf.function`` and ``mx.compile`` return arrays only), set aside
    per input signature when the library traces ``f`` and put back after each call, so that
    aux comes back unchanged.

    ``AuxStatics(is_array, flatten=pytree.tree_flatten, unflatten=pytree.tree_unflatten)``:
    ``is_array(leaf)`` says what the compiled function returns; a library with a pytree
    registry of its own passes its flatten and unflatten (jax's ``tree_util``).
    """

    __slots__ = ("_is_array", "_flatten", "_unflatten", "_by_signature")

    def __init__(self, is_array: Callable[[Any], bool], flatten: Callable[[Any], tuple] = pytree.tree_flatten,
                 unflatten: Callable[[Any, list], Any] = pytree.tree_unflatten):
        self._is_array, self._flatten, self._unflatten = is_array, flatten, unflatten
        self._by_signature: dict[Hashable, tuple] = {}

    def split(self, signature: Hashable, aux: Any) -> list:
        """At trace time: ``aux``'s array leaves (what the compiled function returns); the
        others are kept for :meth:`join` under ``signature``."""
        leaves, treedef = self._flatten(aux)
        arrays = [self._is_array(v) for v in leaves]
        self._by_signature[signature] = (treedef, arrays, [None if a else v for v, a in zip(leaves, arrays)])
        return [v for v, a in zip(leaves, arrays) if a]

    def join(self, signature: Hashable, arrays: list) -> Any:
        """After a call: aux rebuilt from the arrays the compiled function returned (``None``
        when nothing was set aside: ``f`` returned no aux)."""
        found = self._by_signature.get(signature)
        if found is None:
            return None
        treedef, kinds, static = found
        values = iter(arrays)
        return self._unflatten(treedef, [next(values) if a else v for a, v in zip(kinds, static)])


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
        "_captured",
        "_one_array",
        "_x_leaf",
        "_array_args",
        "numpy_native",
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
        self._preparations: LRU[Any, Any] = LRU(
            MAX_PREPARATIONS, name="preparations",
            keyed_on="flat function; backend and options, operator, input shapes and dtypes",
        )
        # objects f reads that its plan key names by identity (see abstractdiff._captures)
        self._captured: list[Callable[[], Any]] = []
        # whether numpy arrays are the backend's own (autograd, PyTensor, finite differences):
        # f's numpy output is then a constant of its library, not a derivative numpy dropped
        self.numpy_native = False
        # The hot paths, where rebuilding (x, args) from flat leaves is the identity:
        # x one float array (_x_leaf), each argument one array (_array_args: no static
        # leaf, no container), and both with no arguments at all (_one_array).
        self._x_leaf = n_x_leaves == 1 and diff_index == (0,) and x_treedef == _LEAF_TREEDEF
        n_args = args_treedef.num_children
        self._array_args = (
            self._x_leaf and args_treedef.num_leaves == n_args and args_treedef.num_nodes == n_args + 1
            and data_index == tuple(range(1, 1 + n_args))
        )
        self._one_array = self._array_args and n_args == 0

    def hold_captured(self, objects: list[Any]) -> None:
        """Remember the objects the plan key names by identity: weakly where possible, else
        strongly.  A plan whose object died must not be found by a new object that reuses
        its ``id`` (see :meth:`captured_alive`); objects a compiled trace keeps as
        constants never die while the plan exists, and are released when a plan with newer
        values replaces it (:meth:`PlanCache.store`)."""
        refs = []
        for obj in objects:
            try:
                refs.append(weakref.ref(obj))
            except TypeError:
                refs.append(lambda obj=obj: obj)
        self._captured = refs

    def captured_alive(self) -> bool:
        """False once an object named by identity in the plan key died: its id may be reused."""
        return all(r() is not None for r in self._captured)

    @property
    def f(self) -> Callable[..., Any]:
        f = self._f()
        if f is None:
            raise CollectedError(
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
        x = pytree.tree_unflatten(self.x_treedef, leaves[:n])
        args = pytree.tree_unflatten(self.args_treedef, leaves[n:])
        return x, args

    def __call__(self, xs: list[Any], data: list[Any]) -> tuple[Any, Any]:
        """``(y, aux)`` of ``f`` at the flat leaves, ``y`` checked (:func:`check_output`)."""
        y, aux = self.call_unchecked(xs, data)
        return check_output(y, () if self.numpy_native else xs), aux

    def call_unchecked(self, xs: list[Any], data: list[Any]) -> tuple[Any, Any]:
        """``(y, aux)`` of ``f`` at the flat leaves with no check of ``y``: the call of an adapter
        that evaluates ``f`` where a checked output would be refused, such as a complex-step
        adapter passing ``x + i h t`` and reading the imaginary part of a complex ``y``.  Part
        of the adapter protocol (``docs/guide/adapters.md``); the adapter then checks what it
        returns itself."""
        if self._array_args:
            out = self.f(xs[0], *data)
        else:
            x, args = self.rebuild(xs, data)
            out = self.f(x, *args)
        return split_aux(out, self.has_aux)

    def unflatten_x(self, values: list[Any], fill: Any = None) -> PyTree:
        """A tree shaped like ``x`` with ``values`` at the float leaves, ``fill`` elsewhere."""
        if self._x_leaf:
            return values[0]
        leaves = [fill] * self.n_x_leaves
        for i, v in zip(self.diff_index, values):
            leaves[i] = v
        return pytree.tree_unflatten(self.x_treedef, leaves)

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


_COMPLEX_DTYPES: Memo = Memo(name="complex dtypes", keyed_on="a library's dtype object")


def is_complex_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` (numpy, torch, tensorflow or jax) is a complex type."""
    try:
        return _COMPLEX_DTYPES[dtype]
    except (KeyError, TypeError):
        pass
    flag = getattr(dtype, "is_complex", None)  # torch.dtype and tf.DType say it themselves
    if flag is not None and not callable(flag):
        result = bool(flag)
    else:
        result = dtype_text(dtype).startswith("complex")
    try:
        _COMPLEX_DTYPES[dtype] = result
    except TypeError:
        pass
    return result


def check_output(y: Any, xs: Sequence[Any] = ()) -> Any:
    """``f``'s primary output must be a real array or a Python number; ``xs`` are the arrays
    being differentiated.

    The one policy for ``f`` returning numpy (every backend, decided here): where ``xs`` are
    another library's arrays, a numpy array or numpy scalar cannot depend on them, so it is
    refused (:func:`_numpy_output`) rather than converted to a silently zero derivative; a
    Python number is a constant and becomes a 0-d array.  Backends whose own arrays are numpy
    (autograd, PyTensor's constants) pass no ``xs``: there a numpy output is a constant.
    """
    if type(y) not in _ARRAY_TYPES:  # the hot path: an array type met before skips two hasattr
        if not is_array(y):
            return _scalar_output(y)
        _ARRAY_TYPES.add(type(y))
    if (type(y) is np.ndarray and y.ndim or isinstance(y, np.generic)) and xs and type(xs[0]) is not np.ndarray:
        raise _numpy_output(xs[0])
    dtype = y.dtype
    if getattr(dtype, "kind", None) == "O":  # a numpy object array
        raise InvalidOutputError(
            "f returned an array of Python objects (dtype object): traced values leaked into a "
            "numpy call. A function taking a list (concatenate, stack, array) dispatches on its "
            "first element, so [numpy_data, x] calls numpy and holds x's traced values as objects; "
            "pass like=x (autoray.do('concatenate', [data, x], like=x)) or convert the numpy data "
            "with the backend first (b.asarray(data))"
        )
    if not is_float_dtype(dtype):
        if is_complex_dtype(dtype):
            raise InvalidOutputError(
                f"f returned a complex array ({dtype}); abstractdiff differentiates real functions only, "
                f"and would silently drop the imaginary part: return the real and imaginary parts as "
                f"separate real outputs (e.g. stack them), or a real function of them such as abs(y)**2"
            )
        raise _discrete_output(dtype_text(dtype))
    return y


def _numpy_output(x: Any) -> InvalidOutputError:
    # A numpy result cannot depend on another library's arrays: numpy converted them (numpy on
    # the left of an operator, a numpy function, a list dispatched on a numpy first element) and
    # dropped their derivative, which libraries that let numpy read their arrays (MLX, paddle)
    # would return as a silent zero; or f is constant, which a Python number says.
    kind = f"{type(x).__module__.partition('.')[0]} {type(x).__name__}"
    return InvalidOutputError(
        f"f returned a numpy value while {kind} values were being differentiated, so its derivative "
        f"would silently be zero: numpy converted them and dropped their derivative. That happens with "
        f"numpy on the left of an operator (W * x, W a numpy array f captured: pass W to f as an argument, "
        f"which makes it a native array, or convert it once with b.asarray(W)), with a numpy function "
        f"(np.sum(x): use autoray's numpy, anp.sum) and with a list whose first element is numpy "
        f"(np.concatenate([data, x]): pass like=x, autoray.do('concatenate', [data, x], like=x)). If f "
        f"really is constant, return a Python number or b.asarray(value)"
    )


def _discrete_output(dtype: str) -> InvalidOutputError:
    # A bool or integer output is piecewise constant: libraries answer with a zero derivative
    # (autograd, tensorflow, MLX, PyTensor) or with an error of their own (jax, torch, paddle).
    # Neither is what was meant, and a zero Jacobian is silently wrong for a comparison that
    # stands for a relaxed one (x > 0 for a sigmoid); one error everywhere.
    return InvalidOutputError(
        f"f returned an array of dtype {dtype}, which has no derivative (a {dtype} output is piecewise "
        f"constant: comparisons, rounding, argmax); differentiate a floating-point output instead, e.g. "
        f"cast a mask to float (anp.where(x > 0, 1.0, 0.0)) or use a smooth relaxation such as a sigmoid"
    )


def _scalar_output(y: Any) -> Any:
    if isinstance(y, (int, float)) and not isinstance(y, bool):
        return np.asarray(y, dtype=np.float64)
    if isinstance(y, (bool, np.bool_)):
        raise InvalidOutputError(
            f"f must return an array (or a Python number), but it returned a bool: {_discrete_output('bool')}"
        )
    if isinstance(y, complex):
        raise InvalidOutputError(
            "f returned a Python complex number; abstractdiff differentiates real functions only: "
            "return the real and imaginary parts separately"
        )
    raise InvalidOutputError(
        f"f must return an array (or a Python number), but it returned a "
        f"{type(y).__name__}; return one array, e.g. stack or sum the values"
    )


# ------------------------------------------------------------- custom pytree nodes
def register_pytree_node(
    cls: type, flatten: Callable[[Any], tuple], unflatten: Callable[[Any, Any], Any]
) -> type:
    """Register ``cls`` as a pytree node, so that abstractdiff differentiates the arrays inside it.

    ``register_pytree_node(cls, flatten, unflatten) -> cls`` with optree's convention:
    ``flatten(obj) -> (children, metadata)`` (or ``(children, metadata, entries)``) and
    ``unflatten(metadata, children) -> obj``.  Without it, an object of a class that
    abstractdiff does not know is a static leaf (data, no gradient), and one registered
    only in an optree namespace of your own is refused with an error rather than silently
    left without a gradient.  Classes of ``jax.tree_util`` and ``torch.utils._pytree`` need
    no registering: they are flattened as their library flattens them (:mod:`abstractdiff._pytree`).

    The node goes in abstractdiff's own registry (optree's ``"abstractdiff"`` namespace,
    :mod:`abstractdiff._pytree`), so that optree's global registry, which other code reads,
    is left as it was: your own optree calls see it with ``namespace="abstractdiff"``
    (``optree.tree_map(f, tree, namespace="abstractdiff")``), as they see ``ad.Grads``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> class Pair:
        ...     def __init__(self, w, b):
        ...         self.w, self.b = w, b
        >>> _ = ad.register_pytree_node(Pair, lambda p: ((p.w, p.b), None), lambda _, c: Pair(*c))
        >>> g = ad.gradient("finite_differences", lambda p: (p.w**2).sum() + p.b, Pair(np.ones(2), 3.0))
        >>> np.round(g.w, 6), round(float(g.b), 6)
        (array([2., 2.]), 1.0)
    """
    _LEAF_ARRAY_TYPES.discard(cls)
    optree.register_pytree_node(cls, flatten, unflatten, namespace=pytree.NAMESPACE)
    return cls


#: Static leaves that are never containers.
BASIC_STATIC = (bool, int, float, str, bytes, complex, type(None), np.generic)


def foreign_container(leaf: Any) -> str | None:
    """Where ``leaf`` is registered as a pytree node that abstractdiff's flattening does not see
    (an optree namespace of its own), or ``None``."""
    if isinstance(leaf, BASIC_STATIC):
        return None
    # optree's registry of namespaced nodes; private, so only consulted, never relied on
    registry = getattr(optree.registry, "_NODETYPE_REGISTRY", {})
    for key in list(registry):
        if isinstance(key, tuple) and len(key) == 2 and key[1] is type(leaf) and key[0] != pytree.NAMESPACE:
            return f"the optree namespace {key[0]!r}"
    return None


def unflattened_container_error(leaf: Any, where: str, registry: str) -> NonDifferentiableInputError:
    return NonDifferentiableInputError(
        f"{where} is a {type(leaf).__name__} registered as a pytree node in {registry}, "
        f"which abstractdiff does not flatten: its arrays would be treated as static data and get no "
        f"gradient. Register the class for abstractdiff with ad.register_pytree_node(cls, flatten, "
        f"unflatten), or pass its arrays as a dict or tuple"
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

    Plans that differ only in the values ``f`` reads from globals and closures (see
    :mod:`abstractdiff._captures`) replace each other: the old values are never read again
    (a changed value means a new trace), and keeping their plans would keep their
    compiled traces, which hold those values as constants, alive.
    """

    max_per_function = 64

    def __init__(self, numpy_native: bool = False) -> None:
        #: whether numpy arrays are native to the backend owning this cache (see check_output)
        self.numpy_native = numpy_native
        # function (and owner of a bound method), held weakly -> that function's plans
        self._functions: WeakLRU[LRU[Any, FlatFunction]] = WeakLRU(
            name="plans per function", keyed_on="the user's function (held weakly), backend kind"
        )
        #: (id of a plain function, operator) -> ``(guard, call, ref)``, its hot call (see
        #: Backend._unprepared).  Every unprepared call reads it first, so it is a plain dict
        #: (a WeakLRU lookup costs a method call more); :meth:`set_hot` makes an entry leave
        #: with its function, as WeakLRU does, so that a recycled id never finds it.
        self.hot_calls: Memo = Memo(name="hot calls", keyed_on="the user's function (its id, held weakly), operator")
        self._lock = threading.Lock()

    def set_hot(self, f: Callable[..., Any], operator: Hashable, guard: Any, call: Any) -> None:
        """Keep ``f``'s hot call for ``operator`` while ``f`` lives."""
        key, table = (id(f), operator), self.hot_calls
        table[key] = (guard, call, weakref.ref(f, lambda _ref: table.pop(key, None)))

    def lookup(self, f: Callable[..., Any], key: Any) -> FlatFunction | None:
        plans = self._functions.get(_function_identity(f))
        if plans is None:
            return None
        return plans.get(key)

    def store(self, f: Callable[..., Any], key: Any, fn: FlatFunction, replaces: Any = None) -> None:
        """Store ``fn`` under ``key``; with ``replaces``, first drop the plans whose key starts
        with it (the same structure, other captured values)."""
        ident = _function_identity(f)
        with self._lock:
            plans = self._functions.get(ident)
            if plans is None:  # not weak-referenceable (a builtin): put() keeps nothing
                plans = self._functions.put(ident, LRU(
                    self.max_per_function, name="plans",
                    keyed_on="input structure, static leaves, dtypes, captured globals and closures",
                ))
            if replaces is not None:
                n = len(replaces)
                for old in [k for k in plans.keys() if k[:n] == replaces and k != key]:
                    plans.pop(old)
            plans.put(key, fn)

    def __len__(self) -> int:
        return sum(len(plans) for plans in self._functions.values())

    def clear(self) -> None:
        self._functions.clear()
        self.hot_calls.clear()


def flatten_call(
    cache: PlanCache | None,
    f: Callable[..., Any],
    x: PyTree,
    args: tuple[Any, ...],
    has_aux: bool,
    track_captures: bool = False,
    check_static: Callable[[Any, str], None] | None = None,
) -> tuple[FlatFunction, list[Any], list[Any]]:
    """Split ``f(x, *args)`` into a (cached) flat function and its leaf lists.

    With ``track_captures`` (a backend that traces ``f`` once and reuses the trace), the
    plan is also keyed on the values ``f`` reads from globals and closures
    (:func:`abstractdiff._captures.captures`): a changed value gets a new plan.
    ``check_static(leaf, where)`` may refuse a static leaf (it runs when a plan is built).
    """
    if not args and type(x) in _LEAF_ARRAY_TYPES and is_float_dtype(x.dtype):
        # The hot path of the commonest call, f(x) with one float array: its structure is
        # known without flattening (what the general path below would compute).
        leaves = [x]
        n = 1
        diff_index, data_index, static = [0], [], []
        key = structure = _ONE_ARRAY[has_aux]
        x_treedef, a_treedef = _LEAF_TREEDEF, _NO_ARGS_TREEDEF
    else:
        x_leaves, x_treedef = pytree.tree_flatten(x)
        a_leaves, a_treedef = pytree.tree_flatten(args)
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
                static.append((i, _static_key(leaf, track_captures)))
        n = len(x_leaves)
        for j, leaf in enumerate(a_leaves):
            kind = leaf_kind(leaf, False)
            if kind == DATA:
                data_index.append(n + j)
            else:
                static.append((n + j, _static_key(leaf, track_captures)))
        key = structure = (x_treedef, a_treedef, tuple(diff_index), tuple(data_index), tuple(static), has_aux)
        leaves = x_leaves + a_leaves
        if n == 1 and x_leaves[0] is x and type(x) in _ARRAY_TYPES:
            _LEAF_ARRAY_TYPES.add(type(x))  # an array that is its own (single) leaf
    alive: list[Any] = []
    if track_captures:
        captured, alive = captures(f)
        key = structure + (captured,)
    fn = cache.lookup(f, key) if cache is not None else None
    if fn is not None and alive and not fn.captured_alive():
        fn = None  # an object it named by identity died, and its id is now another's
    if fn is None:
        if check_static is not None:
            for i, _ in static:
                check_static(leaves[i], f"x leaf {i}" if i < n else f"argument leaf {i - n}")
        dynamic = set(diff_index) | set(data_index)
        template = [None if i in dynamic else leaf for i, leaf in enumerate(leaves)]
        fn = FlatFunction(
            f, x_treedef, a_treedef, template, tuple(diff_index), tuple(data_index), n, has_aux
        )
        if alive:
            fn.hold_captured(alive)
        if cache is not None:
            fn.numpy_native = cache.numpy_native
            cache.store(f, key, fn, replaces=structure if track_captures else None)
    xs = [leaves[i] for i in diff_index]
    data = [leaves[i] for i in data_index]
    return fn, xs, data

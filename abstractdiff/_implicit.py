"""Implicit parameters: ``Params``, ``Grads``, ``Variable`` and ``variables``.

Zygote's implicit mode in Python: ``f`` takes no arguments and reads mutable variables,
``ad.Params(obj)`` names the variables to differentiate, and the gradient comes back as
an ``ad.Grads`` mapping keyed by variable identity.  The variables are the libraries'
own (recognised by their backend's ``is_variable`` hook: torch leaf tensors, ``tf.Variable``
...) or, for libraries with immutable arrays (jax, autograd, numpy), an ``ad.Variable``
box.  The differentiation itself is the ``ad.Implicit`` combinator
(:mod:`abstractdiff._implicit_backend`).

Nothing here imports or names an AD library: the backend of a variable or model is found
through the registry by its type (:func:`abstractdiff._registry.backend_for`).

Running an explicit ``f(x, *args)`` implicitly (what the conformance suite does)::

    vs = ad.variables(x, b)                     # the same tree, of b's variables
    g = ad.gradient(ad.Implicit(b), lambda *a: f(current_values(vs), *a), ad.Params(vs), *args)

(``args`` passed through the operator become native arrays, as in explicit mode; read
the gradient back as a tree with ``pytree.tree_map(lambda v: g[v] if v in ps else
None, vs)``.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from . import _pytree as pytree
from ._arrays import dtype_name, shape_of
from ._errors import (
    AbstractDiffError,
    ArgumentTypeError,
    ModeMismatchError,
    NonDifferentiableInputError,
    ShapeMismatchError,
    UnknownVariableError,
)
from ._registry import backend_for
from ._tree import is_array, is_float_dtype, register_pytree_node

__all__ = ["BOXES", "Grads", "Params", "Variable", "current_values", "variable_owner", "variables"]


# ------------------------------------------------------------------ Variable
class _Reads(threading.local):
    """The Variables read while the implicit adapter runs ``f`` (a stack, for nesting)."""

    def __init__(self) -> None:
        self.stack: list[dict[int, Variable]] = []


_reads = _Reads()


def check_assignment(label: str, old: Any, new: Any, shape_hint: str = "", dtype_hint: str = "") -> None:
    """Refuse writing ``new`` into the variable ``label`` holding ``old`` unless it keeps the
    shape (:class:`~abstractdiff.ShapeMismatchError`) and the dtype (``ArgumentTypeError``):
    a variable's shape and dtype are its own (an optimiser's state was built for them)."""
    if shape_of(new) != shape_of(old):
        raise ShapeMismatchError(
            f"cannot assign an array of shape {shape_of(new)} to {label} of shape {shape_of(old)}{shape_hint}"
        )
    if dtype_name(new) != dtype_name(old):
        raise ArgumentTypeError(
            f"cannot assign a {dtype_name(new)} array to {label}, which holds {dtype_name(old)}; cast the new "
            f"value to {dtype_name(old)}{dtype_hint}"
        )


class HeldVariable:
    """A variable whose array is held by a container of its library (an MLX module's dicts
    and lists), for libraries whose models hold immutable arrays: a subclass says how to
    reach the array (:meth:`_get`, :meth:`_set`; ``name`` for messages), the core gives the
    rest as :class:`Variable` does: ``value`` read and written (assignment keeps shape and
    dtype), ``shape``, ``dtype``, ``__array__`` and ``repr``."""

    __slots__ = ()
    name: str

    def _get(self) -> Any:
        raise NotImplementedError

    def _set(self, value: Any) -> Any:
        """Store ``value``; return the array it replaces."""
        raise NotImplementedError

    def _coerce(self, new: Any, old: Any) -> Any:
        """``new`` (numpy, a number) as an array of the library, in ``old``'s dtype where it converts."""
        return new

    @property
    def value(self) -> Any:
        return self._get()

    @value.setter
    def value(self, new: Any) -> None:
        old = self._get()
        new = self._coerce(new, old)
        check_assignment(f"{type(self).__name__} {self.name!r}", old, new)
        self._set(new)

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self._get())

    @property
    def dtype(self) -> Any:
        return self._get().dtype

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        from ._convert import to_numpy

        return np.asarray(to_numpy(self._get()), dtype=dtype)

    def __repr__(self) -> str:
        try:
            a = self._get()
            what = f"shape={shape_of(a)}, dtype={dtype_name(a)}"
        except AbstractDiffError as err:  # its container is gone
            what = str(err)
        return f"{type(self).__name__}({self.name!r}, {what})"


class Variable:
    """A mutable box holding one array, for libraries whose arrays are immutable.

    ``Variable(value, name=None)``; read and write ``v.value``.  Assignment keeps the
    shape and dtype (a clear error otherwise), so an update that silently changed
    precision (jax outside ``jax.enable_x64``) is caught at once.  The box shares the
    array it is given (no copy); ``ad.variables`` makes copies.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> w = ad.Variable(np.array([1.0, 2.0]))
        >>> b = ad.Implicit("finite_differences")
        >>> gs = ad.gradient(b, lambda: (w.value ** 2).sum(), ad.Params([w]))
        >>> np.round(gs[w], 6)
        array([2., 4.])
    """

    __slots__ = ("_value", "name", "__weakref__")

    def __init__(self, value: Any, name: str | None = None):
        if isinstance(value, Variable):
            value = value.value
        if not is_array(value):
            value = np.asarray(value, dtype=np.float64 if isinstance(value, (int, float)) else None)
        self._value = value
        self.name = name

    @property
    def value(self) -> Any:
        if _reads.stack:  # the implicit adapter is running f: note which boxes f reads
            _reads.stack[-1][id(self)] = self
        return self._value

    @value.setter
    def value(self, new: Any) -> None:
        if isinstance(new, Variable):
            new = new.value
        if not is_array(new):
            new = np.asarray(new, dtype=dtype_name(self._value))
        jax_hint = (
            " (jax computes in float32 outside `with jax.enable_x64(True):`; run the update in that scope)"
            if dtype_name(self._value) == "float64" and dtype_name(new) == "float32" else ""
        )
        check_assignment(self._label(), self._value, new,
                         "; a Variable keeps its shape (create a new ad.Variable instead)", jax_hint)
        self._value = new

    def _swap(self, new: Any) -> Any:
        """Set the value without checks (a traced value) and return the old one."""
        old, self._value = self._value, new
        return old

    def _abstractdiff_variable_value(self) -> Any:
        return self._value

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self._value)

    @property
    def dtype(self) -> Any:
        return self._value.dtype

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        from ._convert import to_numpy

        a = np.asarray(to_numpy(self._value), dtype=dtype)
        return a.copy() if copy else a

    def _label(self) -> str:
        return f"Variable {self.name!r}" if self.name else "the Variable"

    def __repr__(self) -> str:
        name = f"{self.name!r}, " if self.name else ""
        return f"Variable({name}shape={self.shape}, dtype={dtype_name(self._value)}, value={self._value!r})"


# ------------------------------------------------------- recognising variables
class _Boxes:
    """The variable hooks of ``ad.Variable`` boxes, named as an adapter's are, so that the
    core treats every owner of variables alike (see :class:`abstractdiff._hooks.AdapterHooks`)."""

    name = "ad.Variable"

    def is_variable(self, v: Any) -> bool:
        return isinstance(v, Variable)

    def check_variable(self, v: Any, where: str) -> None:
        if not is_float_dtype(v.dtype):
            raise NonDifferentiableInputError(
                f"{where} is an ad.Variable of dtype {dtype_name(v._value)}; only float variables can "
                f"be parameters (pass integer data to f another way)"
            )

    def read(self, var: Any) -> Any:
        return var._value

    def read_kept(self, var: Any) -> Any:
        value = var._value  # a numpy array the caller may still write into: copied
        return value.copy() if isinstance(value, np.ndarray) else value

    def write(self, var: Any, value: Any) -> None:
        var.value = value

    def current_value(self, var: Any) -> Any:
        return var.value

    def swap(self, var: Any, value: Any) -> Any:
        return var._swap(value)

    def aliases(self, var: Any) -> tuple[Any, ...]:
        return ()

    def __repr__(self) -> str:
        return "<ad.Variable boxes>"


#: The owner of every ``ad.Variable``.
BOXES = _Boxes()


def variable_owner(v: Any) -> Any:
    """Who knows how to read and write variable ``v``: :data:`BOXES` for an ``ad.Variable``,
    the backend of its library for a library variable, ``None`` if ``v`` is not a variable."""
    if isinstance(v, Variable):
        return BOXES
    b = backend_for(v)
    return b if b is not None and b.is_variable(v) else None


def is_library_variable(leaf: Any) -> bool:
    """A variable its library would accept as a parameter, whatever its dtype (a torch
    tensor that does not require grad is an array, not a variable)."""
    owner = variable_owner(leaf)
    if owner is None:
        return False
    try:
        owner.check_variable(leaf, "leaf")
    except NonDifferentiableInputError:  # an integer variable: still a variable
        return True
    except (TypeError, ValueError):
        return False
    return True


def model_state_variables(model: Any, written: bool = False) -> list[tuple[str, Any]]:
    """Every variable of a model holding variables, as ``(name, variable)``, once each.

    What each library's ``model_state`` hook lists (a torch module's parameters, frozen ones
    included, and its buffers, with their ``state_dict`` names; every variable of a
    tf.Module / Keras model), variables themselves and ``ad.Params`` as they are: what a
    checkpoint saves and data-parallel ranks compare.  ``written``: also what the forward
    pass may write that a checkpoint leaves out (the ``forward_state`` hook: torch's
    non-persistent buffers), which a failed training step restores.
    """
    if getattr(model, "_abstractdiff_params", False):  # ad.Params
        return [("", v) for v in model]
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def add(name: str, var: Any) -> None:
        if id(var) not in seen:  # a shared (tied) weight is stored once
            seen.add(id(var))
            found.append((name, var))

    for leaf in pytree.tree_leaves(model, is_leaf=is_variable_or_model):
        owner = backend_for(leaf)
        state = None if owner is None else owner.model_state(leaf)
        if state is not None:
            for name, var in state:
                add(name, var)
            for name, var in (owner.forward_state(leaf) or []) if written else []:
                add(name, var)
        elif is_library_variable(leaf):
            add("", leaf)
    return found


def model_variables(obj: Any) -> tuple[list[Any], int] | None:
    """``(trainable variables, number of non-trainable ones)`` of a model (``nn.Module``, Keras...), or
    ``None``: the library's ``model_variables`` hook (see :func:`_non_trainable` for what Params counts)."""
    if isinstance(obj, Variable):
        return None
    b = backend_for(obj)
    return None if b is None else b.model_variables(obj)


def _non_trainable(model: Any, trainable: list[Any], counted: int) -> int:
    """How many of ``model``'s variables are not trained: frozen parameters and non-trainable
    state (BatchNorm's running statistics, which torch keeps in buffers and Keras in
    non-trainable variables), as its library's ``model_state`` lists them; ``counted``
    (the ``model_variables`` hook's number) for a library without that hook."""
    b = backend_for(model)
    state = None if b is None else b.model_state(model)
    if state is None:
        return counted
    ids = {id(v) for v in trainable}
    return len({id(v) for _, v in state if id(v) not in ids})


def is_variable_or_model(obj: Any) -> bool:
    """The ``is_leaf`` of trees holding variables: a variable or a model is not flattened further."""
    if isinstance(obj, Variable):
        return True
    b = backend_for(obj)
    return b is not None and (b.is_variable(obj) or b.model_variables(obj) is not None)


def _check_variable(v: Any, where: str) -> Any:
    """The owner of variable ``v``, after checking it can be a parameter."""
    owner = variable_owner(v)
    if owner is None:
        what = type(v).__name__ + (f" of shape {shape_of(v)}" if is_array(v) else "")
        raise ModeMismatchError(
            f"{where} is a {what}, not a variable: ad.Params holds mutable variables (a library's "
            f"own, such as torch leaf tensors requiring grad or tf.Variable, or ad.Variable), or models "
            f"(torch.nn.Module, tf.Module, Keras). Wrap arrays in ad.Variable(array) (jax, autograd, "
            f"numpy), or convert a whole tree with ad.variables(tree, backend)"
        )
    owner.check_variable(v, where)
    return owner


# -------------------------------------------------------------------- Params
def _is_static(leaf: Any) -> bool:
    # As in explicit mode, what can never be differentiated is left alone: Python ints,
    # bools and strings, and integer arrays (or integer variables).  A float array is
    # not: it is a forgotten variable, and _check_variable says how to fix it.
    if isinstance(leaf, (bool, int, str, bytes)):
        return True
    return is_array(leaf) and not is_float_dtype(leaf.dtype)


class Params:
    """The variables to differentiate, in order, de-duplicated by identity.

    ``Params(obj)`` with ``obj`` a ``torch.nn.Module``, a ``tf.Module`` or Keras model,
    or any pytree (list, dict, tuple) of variables and models.  A model's non-trainable
    variables are left out: frozen parameters (``requires_grad=False``,
    ``trainable=False``) and non-trainable state such as BatchNorm's running statistics
    (torch buffers, Keras non-trainable variables); :attr:`non_trainable` and the repr
    say how many.  Leaves that can never be differentiated (Python ints, bools,
    strings, integer arrays) are skipped, as in explicit mode; any other leaf that is
    not a variable (a float numpy array) is a TypeError.  All variables must belong to
    one library.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> w, b = ad.Variable(np.ones(3)), ad.Variable(np.zeros(()))
        >>> ad.Params({"w": w, "b": b})
        Params(2 variables (ad.Variable), 4 values)
    """

    _abstractdiff_params = True

    def __init__(self, obj: Any):
        self._vars: list[Any] = []
        self._index: dict[int, int] = {}
        #: How many variables of the models given were left out as non-trainable (frozen
        #: parameters, buffers such as BatchNorm's running statistics).
        self.non_trainable = 0
        owners: dict[str, Any] = {}
        if isinstance(obj, Params):
            obj = list(obj)
        leaves, _ = pytree.tree_flatten(obj, is_leaf=is_variable_or_model)
        models: set[int] = set()
        for n, leaf in enumerate(leaves):
            found = model_variables(leaf)
            if found is not None:
                vs, counted = found
                if id(leaf) not in models:  # the same model twice: its non-trainable ones count once
                    models.add(id(leaf))
                    self.non_trainable += _non_trainable(leaf, vs, counted)
                where = type(leaf).__name__
            elif _is_static(leaf):
                continue
            else:
                vs, where = [leaf], f"leaf {n} of the tree given to ad.Params"
            for v in vs:
                owner = _check_variable(v, f"{where} ({type(v).__name__})" if found is not None else where)
                owners.setdefault(owner.name, owner)
                if id(v) not in self._index:
                    self._index[id(v)] = len(self._vars)
                    self._vars.append(v)
        if len(owners) > 1:
            raise ModeMismatchError(
                f"ad.Params mixes variables of different libraries ({', '.join(sorted(owners))}); "
                f"differentiate each library's variables with its own ad.Implicit backend"
            )
        #: Who reads and writes these variables: :data:`BOXES` for ``ad.Variable``, else the
        #: backend of their library; ``None`` when there is no variable.
        self.owner: Any = next(iter(owners.values()), None)
        #: The owner's name ("torch", "ad.Variable", ...), or ``None``.
        self.kind: str | None = None if self.owner is None else self.owner.name

    def __iter__(self) -> Iterator[Any]:
        return iter(self._vars)

    def __len__(self) -> int:
        return len(self._vars)

    def __getitem__(self, i: int) -> Any:
        return self._vars[i]

    def __contains__(self, v: object) -> bool:
        return id(v) in self._index

    def __repr__(self) -> str:
        size = sum(int(np.prod(shape_of(v))) for v in self._vars)
        what = self.kind or "none"
        k = self.non_trainable
        left_out = f"; {k} non-trainable variable{'s' * (k != 1)} left out" if k else ""
        n = len(self._vars)
        return f"Params({n} variable{'s' * (n != 1)} ({what}), {size} values{left_out})"

    @property
    def frozen(self) -> int:
        """The older name of :attr:`non_trainable`."""
        return self.non_trainable


# --------------------------------------------------------------------- Grads
class _Identity:
    """Tree metadata naming parameters by identity (tf.Variable cannot be hashed or compared)."""

    __slots__ = ("params",)

    def __init__(self, params: tuple[Any, ...]):
        self.params = params

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Identity)
            and len(other.params) == len(self.params)
            and all(a is b for a, b in zip(self.params, other.params))
        )

    def __hash__(self) -> int:
        return hash(tuple(id(p) for p in self.params))


class Grads(Mapping):
    """Gradients of implicit parameters: ``gs[p]`` is the gradient of parameter ``p``.

    A read-only mapping keyed by variable identity, iterating in ``Params`` order; the
    values are the backend's native arrays.  ``Grads`` is a pytree node (optree), so
    ``ad.to_numpy(gs)`` returns a ``Grads`` of numpy arrays and ``pytree.tree_map``
    works on it.  ``Grads(params, values)``; the implicit operators build it.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> w, c = ad.Variable(np.array([1.0, 2.0])), ad.Variable(np.array(3.0))
        >>> gs = ad.gradient(ad.Implicit("finite_differences"), lambda: c.value * (w.value**2).sum(), ad.Params([w, c]))
        >>> gs
        Grads(2 parameters: [(2,) float64, () float64])
        >>> np.round(gs[w], 6), len(gs), list(gs) == [w, c]
        (array([ 6., 12.]), 2, True)
    """

    def __init__(self, params: Params | list[Any], values: list[Any]):
        self._params = list(params)
        self._values = list(values)
        self._index = {id(p): i for i, p in enumerate(self._params)}
        for i, p in enumerate(self._params):  # a Keras variable is also found by its tf.Variable
            owner = variable_owner(p)
            for alias in () if owner is None else owner.aliases(p):
                self._index.setdefault(id(alias), i)

    def __getitem__(self, p: Any) -> Any:
        i = self._index.get(id(p))
        if i is None:
            what = type(p).__name__ + (f" of shape {shape_of(p)}" if is_array(p) else "")
            raise UnknownVariableError(
                f"this {what} is not one of the {len(self._params)} parameters of the Params that were "
                f"differentiated (parameters are looked up by identity: pass the variable object itself, "
                f"not a copy or its value)"
            )
        return self._values[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def __contains__(self, p: object) -> bool:
        return id(p) in self._index

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Grads):
            return NotImplemented
        from ._convert import to_numpy

        return _Identity(tuple(self._params)) == _Identity(tuple(other._params)) and all(
            np.array_equal(to_numpy(a), to_numpy(b)) for a, b in zip(self._values, other._values)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        parts = [f"{shape_of(g)} {dtype_name(g)}" for g in self._values[:6]]
        more = ", ..." if len(self._values) > 6 else ""
        return f"Grads({len(self._values)} parameters: [{', '.join(parts)}{more}])"


def _flatten_grads(gs: Grads) -> tuple[list[Any], _Identity, None]:
    return gs._values, _Identity(tuple(gs._params)), None


def _unflatten_grads(meta: _Identity, values: Any) -> Grads:
    return Grads(list(meta.params), list(values))


register_pytree_node(Grads, _flatten_grads, _unflatten_grads)


# ------------------------------------------------------------------ variables
def _inner(b: Any) -> Any:
    from ._registry import backend

    b = backend(b)
    return getattr(b, "inner", b)


def variables(tree: Any, b: Any) -> Any:
    """The same pytree with each float array replaced by a fresh variable of backend ``b``.

    ``variables(tree, b) -> tree``: the library's own variables where it has them (torch
    leaf tensors requiring grad on ``b``'s device, ``tf.Variable``), ``ad.Variable`` boxes
    holding ``b``'s native arrays otherwise (the backend's ``new_variable`` hook decides).
    ``b`` is a backend, its name, or an ``ad.Implicit`` backend.  Values are copied (the
    input is never shared or mutated); integer arrays become ``b``'s native arrays and
    other leaves (ints, strings) are returned unchanged.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> vs = ad.variables({"w": np.ones(2), "n": 3}, "finite_differences")
        >>> type(vs["w"]).__name__, vs["n"]
        ('Variable', 3)
    """
    inner = _inner(b)

    def make(leaf: Any) -> Any:
        owner = variable_owner(leaf)
        if owner is not None:  # an existing variable: a new one holds a copy of its value
            leaf = owner.read(leaf)
        if is_array(leaf) and not is_float_dtype(leaf.dtype):
            return inner.convert(leaf)  # data (integer arrays) as native arrays, as explicit mode does
        if not (isinstance(leaf, float) or is_array(leaf)):
            return leaf
        value = inner.convert(leaf)
        made = inner.new_variable(value)
        if made is None:  # a library without mutable variables: the core's box
            made = Variable(value.copy() if isinstance(value, np.ndarray) else value)
        return made

    return pytree.tree_map(make, tree, is_leaf=is_variable_or_model)


def current_values(tree: Any) -> Any:
    """The values a function of explicit arrays should see, read from a tree of variables.

    Each variable's ``current_value`` hook: an ``ad.Variable``'s ``.value`` (the traced
    value while the implicit adapter runs ``f``), a read of a ``tf.Variable`` (recorded
    on the tape), a torch parameter itself; every other leaf passes through.  Call it
    inside ``f`` so that the reads are seen by the differentiation.
    """

    def read(leaf: Any) -> Any:
        owner = variable_owner(leaf)
        return leaf if owner is None else owner.current_value(leaf)

    return pytree.tree_map(read, tree, is_leaf=is_variable_or_model)

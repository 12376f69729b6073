"""Preparation: one typed object per operator, and "unprepared" is prepare-then-call.

Following DifferentiationInterface.jl, every operator has a *preparation*: a
:class:`Preparation` subclass holding the flat function and whatever the adapter built
for it once (a jitted ``value_and_grad``, a ``tf.function``...), with a ``run`` method
that computes the operator from flat leaves.  The unprepared operator
``ad.gradient(b, f, x)`` flattens ``f(x, *args)`` through the plan cache, fetches the
preparation cached on that flat function for the inputs' signature, and runs it; the
prepared operator ``ad.prepare_gradient(b, f, x)`` holds the same preparation and, on
each call, checks that structure, shapes, dtypes and static leaves still match the
preparation (:class:`~abstractdiff.ShapeMismatchError` otherwise: never silently
wrong) before running it.  One code path, so the two cannot drift apart.

What a prepared operator freezes: the *form* of its inputs (structure, shapes, dtypes
and static leaves), which each call checks.  It freezes nothing of ``f``: like the
unprepared operator, and like ``f`` itself, each call sees the values ``f`` reads from its
globals and closures at that call, on every backend.  An eager backend reads them anyway;
on a backend that reuses traces (``reuses_traces``: jax ``jit``, ``tf.function``,
PyTensor, ``compile=True``) each call checks a :class:`~abstractdiff._captures.CaptureWatch`
and prepares again (a new trace) when a value changed.  Not seen, as by ``jax.jit``:
values reached through attributes or inside mutable containers of globals and closures;
pass those as arguments.

Static leaves of the arguments (neither floats nor arrays) are keyed by
:func:`abstractdiff._cache.static_key`, the plan cache's key:

* numbers, strings and ``None`` by value, exactly; an object of a class with its own
  equality and hash (a frozen dataclass, an enum) by that equality; functions, classes,
  modules and other callable objects (a model) by identity;
* on a backend that reuses traces, any other object (an options object of a plain class,
  a non-frozen dataclass, a ``SimpleNamespace``) by identity *and* by its state, its
  attributes keyed by value (numpy arrays by content), so that ``opts.scale = 3.0`` between
  calls is seen although the object is the same: the unprepared operator plans and traces
  again, a prepared one raises :class:`~abstractdiff.ShapeMismatchError` (a new static
  value, as for a dict's entry: prepare again).  An object too large or deep to key on each
  call (:data:`abstractdiff._cache.STATE_BUDGET`) is planned again on every unprepared
  call (never a stale trace) and refused by ``prepare_*`` with
  :class:`~abstractdiff.ArgumentTypeError`;
* on a backend that runs ``f`` on each call (it reads the object's attributes then),
  other objects by identity alone.
"""

from __future__ import annotations

import functools
import threading
from operator import attrgetter
from typing import Any, Callable, ClassVar

from . import _pytree as pytree
from ._arrays import check_scalar, dtype_name, shape_of
from ._batch import Batch, BatchedPullback, BatchedPushforward
from ._cache import static_key
from ._captures import CaptureWatch
from ._errors import ArgumentTypeError, CustomRuleError, ShapeMismatchError
from ._operator_table import OPERATORS, operators_where
from ._tree import _LEAF_ARRAY_TYPES, _LEAF_TREEDEF, FlatFunction, is_array

__all__ = [op.prepare_name for op in OPERATORS.values()]


# ------------------------------------------------------------- preparations
class Preparation:
    """One operator prepared for one flat function (and one input signature).

    ``run(xs, data, *extra)`` computes the operator from the native float leaves ``xs``
    and data leaves ``data`` and returns the user-facing result (trees shaped like
    ``x``).  Built by :meth:`abstractdiff.Backend.preparation`, cached on the flat
    function, shared by the prepared and the unprepared operator.
    """

    operator: ClassVar[str] = "operator"

    def __init__(self, backend: Any, fn: FlatFunction, xs: list, data: list):
        self.backend = backend
        self.fn = fn
        #: the prepared operator the unprepared one calls for inputs of this preparation's
        #: form (built on first use by Backend._unprepared)
        self.unprepared_call: Prepared | None = None
        self.setup(xs, data)

    def setup(self, xs: list, data: list) -> None:
        """Build what the adapter can build once (called with the first inputs)."""

    def run(self, xs: list, data: list, *extra: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fn!r}, {self.backend!r})"


class ValueAndGradientPrep(Preparation):
    """``(y, g)``, or ``((y, aux), g)`` when ``f`` has aux."""

    operator = "value_and_gradient"

    def setup(self, xs: list, data: list) -> None:
        self._run = self.backend.flat_prepare_value_and_gradient(self.fn, xs, data)

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        y, aux, grads = self._run(xs, data)
        check_scalar(y)
        g = self.fn.unflatten_x(self.backend.complete(grads, xs))
        return ((y, aux), g) if self.fn.has_aux else (y, g)


class GradientPrep(ValueAndGradientPrep):
    """``g``, or ``(g, aux)`` when ``f`` has aux.  (``run`` repeats its parent's three lines
    rather than calling a shared helper: it is the hot path of every gradient.)"""

    operator = "gradient"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        y, aux, grads = self._run(xs, data)
        check_scalar(y)
        g = self.fn.unflatten_x(self.backend.complete(grads, xs))
        return (g, aux) if self.fn.has_aux else g


class ValueAndPullbackPrep(Preparation):
    """``(y, vjp)`` with ``vjp(dy) -> dx``."""

    operator = "value_and_pullback"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        b, fn = self.backend, self.fn
        # the pullback may run after the caller wrote into its arrays: it keeps its own point
        xs, data = [b.snapshot(x) for x in xs], [b.snapshot(d) for d in data]
        y, _, vjp = b.flat_value_and_pullback_any(fn, xs, data)
        batched = BatchedPullback(b, fn, xs, data, y)

        def pullback(dy: Any) -> Any:
            if isinstance(dy, Batch):  # k cotangents in one batched call (ad.Batch)
                return batched(dy)
            return fn.unflatten_x(b.complete(vjp(b.cotangent(dy, y)), xs))

        pullback.f = fn.f  # type: ignore[attr-defined]  # fn holds f weakly; a lazy vjp may still call it
        return y, pullback


class PullbackPrep(ValueAndPullbackPrep):
    """``vjp`` with ``vjp(dy) -> dx``."""

    operator = "pullback"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        return super().run(xs, data)[1]


class ValueAndPushforwardPrep(Preparation):
    """``(y, jvp)`` with ``jvp(dx) -> dy``."""

    operator = "value_and_pushforward"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        b, fn = self.backend, self.fn
        # the pushforward may run after the caller wrote into its arrays: it keeps its own point
        xs, data = [b.snapshot(x) for x in xs], [b.snapshot(d) for d in data]
        y, _, jvp = b.flat_value_and_pushforward_any(fn, xs, data)
        batched = BatchedPushforward(b, fn, xs, data)

        def pushforward(dx: Any) -> Any:
            if isinstance(dx, Batch):  # k tangents in one batched call (ad.Batch)
                return batched(dx)
            return jvp(b.tangents(fn, xs, dx))

        pushforward.f = fn.f  # type: ignore[attr-defined]  # fn holds f weakly; jvp calls it again
        return y, pushforward


class PushforwardPrep(ValueAndPushforwardPrep):
    """``jvp`` with ``jvp(dx) -> dy``."""

    operator = "pushforward"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        return super().run(xs, data)[1]


def _check_scalar_x(xs: list, operator: str) -> None:
    if len(xs) != 1 or shape_of(xs[0]) != ():
        raise ShapeMismatchError(
            f"{operator} needs a scalar x (one float of shape ()), got "
            f"{[shape_of(v) for v in xs]}; use jacobian for array inputs"
        )


class DerivativePrep(Preparation):
    """``dy/dx`` for a scalar ``x``, shaped like ``y``."""

    operator = "derivative"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        _check_scalar_x(xs, self.operator)
        return self.backend.flat_value_and_derivative(self.fn, xs, data)[1]


class ValueAndDerivativePrep(Preparation):
    """``(y, dy/dx)`` for a scalar ``x``."""

    operator = "value_and_derivative"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        _check_scalar_x(xs, self.operator)
        return self.backend.flat_value_and_derivative(self.fn, xs, data)


class SecondDerivativePrep(Preparation):
    """``d2y/dx2`` for a scalar ``x``, shaped like ``y``."""

    operator = "second_derivative"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        _check_scalar_x(xs, self.operator)
        return self.backend.flat_second_derivative(self.fn, xs, data)


class ValueDerivativeAndSecondDerivativePrep(Preparation):
    """``(y, dy/dx, d2y/dx2)`` for a scalar ``x``."""

    operator = "value_derivative_and_second_derivative"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        _check_scalar_x(xs, self.operator)
        return self.backend.flat_value_derivative_and_second_derivative(self.fn, xs, data)


class JacobianPrep(Preparation):
    """A tree shaped like ``x`` of ``y.shape + leaf.shape`` arrays."""

    operator = "jacobian"

    def setup(self, xs: list, data: list) -> None:
        self._run = self.backend.flat_prepare_jacobian(self.fn, xs, data)

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        try:
            jacs = self._run(xs, data)
        except CustomRuleError as err:  # a custom rule in one mode only: the Jacobian in that one
            jacs = self.backend.jacobian_in_the_rules_mode(self.fn, xs, data, err)[1]
        return self.fn.unflatten_x(jacs)


class ValueAndJacobianPrep(Preparation):
    """``(y, J)``, ``J`` as :class:`JacobianPrep` gives it."""

    operator = "value_and_jacobian"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        try:
            y, jacs = self.backend.flat_jacobian(self.fn, xs, data)
        except CustomRuleError as err:  # as JacobianPrep
            y, jacs = self.backend.jacobian_in_the_rules_mode(self.fn, xs, data, err)
        return y, self.fn.unflatten_x(jacs)


def hessian_tree(fn: FlatFunction, blocks: list[list[Any]]) -> Any:
    """The Hessian blocks as the user sees them: the ``x.shape + x.shape`` array when ``x``
    is one array, else jax.hessian's layout, a tree like ``x`` of trees like ``x`` (``None``
    at non-float leaves, outside and inside) whose entry ``[i][j]`` is block ``(i, j)``."""
    if fn.x_treedef == _LEAF_TREEDEF:
        return blocks[0][0]
    return fn.unflatten_x([fn.unflatten_x(row) for row in blocks])


class HessianPrep(Preparation):
    """The Hessian of a scalar ``f``: ``x.shape + x.shape`` for one array, nested blocks for a pytree."""

    operator = "hessian"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        return hessian_tree(self.fn, self.backend.flat_hessian_blocks(self.fn, xs, data))


class ValueGradientAndHessianPrep(Preparation):
    """``(y, g, H)``: ``g`` as gradient gives it, ``H`` as hessian does."""

    operator = "value_gradient_and_hessian"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        b, fn = self.backend, self.fn
        y, grads, blocks = b.flat_value_gradient_and_hessian(fn, xs, data)
        check_scalar(y, self.operator)
        return y, fn.unflatten_x(b.complete(grads, xs)), hessian_tree(fn, blocks)


class HvpPrep(Preparation):
    """The Hessian-vector product, shaped like ``x``; ``run(xs, data, v)``."""

    operator = "hvp"

    def setup(self, xs: list, data: list) -> None:
        self._run = self.backend.flat_prepare_hvp(self.fn, xs, data)

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        (v,) = extra
        b, fn = self.backend, self.fn
        tangents = b.tangents(fn, xs, v, "v")
        return fn.unflatten_x(b.complete(self._run(xs, data, tangents), xs))


class GradientAndHvpPrep(Preparation):
    """``(g, H @ v)``, both shaped like ``x``; ``run(xs, data, v)``."""

    operator = "gradient_and_hvp"

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        (v,) = extra
        b, fn = self.backend, self.fn
        tangents = b.tangents(fn, xs, v, "v")
        grads, hv = b.flat_gradient_and_hvp(fn, xs, data, tangents)
        return fn.unflatten_x(b.complete(grads, xs)), fn.unflatten_x(b.complete(hv, xs))


#: The preparation class of each operator.
PREPARATIONS: dict[str, type[Preparation]] = {
    cls.operator: cls
    for cls in (
        ValueAndGradientPrep, GradientPrep, ValueAndPullbackPrep, PullbackPrep, ValueAndPushforwardPrep,
        PushforwardPrep, DerivativePrep, JacobianPrep, HessianPrep, HvpPrep, ValueAndDerivativePrep,
        SecondDerivativePrep, ValueDerivativeAndSecondDerivativePrep, ValueAndJacobianPrep,
        ValueGradientAndHessianPrep, GradientAndHvpPrep,
    )
}


# ---------------------------------------------------------------- signatures
def _signature(leaf: Any) -> tuple[Any, ...]:
    return (shape_of(leaf), dtype_name(leaf))


_REFRESH_LOCK = threading.Lock()

#: What a float64 input that arrives as float32 most likely means, and its fix.
_NARROWED = (
    "(a float64 array that became float32: on jax with x64 off, arithmetic on float64 results "
    "outside the operators, such as p - lr * g, silently computes in float32; do it inside "
    "`with ad.scope(p, g): ...` to keep float64, rather than preparing again for float32)"
)


class Signature:
    """Structure, shapes, dtypes and static leaves of ``(x, args)`` at preparation.

    :meth:`check` flattens a new ``(x, args)``, compares it and returns the native
    leaves, or raises :class:`~abstractdiff.ShapeMismatchError` naming what changed.
    With ``any_shape`` the shapes are free (the signature of an unprepared operator's
    preparation, which serves every shape).
    """

    def __init__(
        self, operator: str, backend: Any, fn: FlatFunction, x: Any, args: tuple, xs: list, data: list,
        any_shape: bool = False, native: tuple[list, list] | None = None,
    ):
        self.operator = operator
        self.backend = backend
        self.fn = fn
        leaves = pytree.tree_leaves(x) + pytree.tree_leaves(args)
        dynamic = set(fn.diff_index) | set(fn.data_index)
        # Static leaves are compared by the plan cache's key (see the module docstring): exact
        # bits for floats (-0.0 is not 0.0); where traces are reused, an object's state too.
        self._deep = deep = bool(backend.reuses_traces)
        self.static = [(i, leaf, static_key(leaf, deep)) for i, leaf in enumerate(leaves) if i not in dynamic]
        #: the static leaves keyed by their state, which the same object can change: each call
        #: keys them again (the others are compared by identity first)
        self._stateful = frozenset(i for i, _, key in self.static if _keyed_by_state(key))
        if not any_shape:  # a prepared operator (an unprepared one plans such an object on each call)
            for i, leaf, key in self.static:
                if key[0] == "unchecked":
                    raise ArgumentTypeError(
                        f"prepared {operator}: static {self._where(i)} is a {type(leaf).__name__} object too large "
                        f"or too deeply nested to check for changes on each call, and {backend!r} reuses its "
                        f"traces, which would keep its old attribute values after it changes; pass the values f "
                        f"reads from it as arguments (arrays, numbers, a dict), give its class value equality and "
                        f"a hash (a frozen dataclass), or call the unprepared operator (which traces it again on "
                        f"every call)"
                    )
        self.x_signature = [_signature(v) for v in xs]
        self.data_signature = [_signature(v) for v in data]
        # The backend's own shape and dtype objects, compared as they are on the hot path;
        # the normalised signatures above only decide (and explain) a mismatch.  A shape of
        # None is free.
        self.x_raw = [(None if any_shape else v.shape, v.dtype) for v in xs]
        self.data_raw = [(None if any_shape else v.shape, v.dtype) for v in data]
        # The dtypes of the converted leaves (``native``, where ``xs``/``data`` are the caller's
        # own arrays): a leaf of another dtype that converts alike passes too (a jax int32
        # array where numpy int64 data was prepared, jax without x64).
        self.x_native, self.data_native = ([dtype_name(v) for v in group] for group in (native or (xs, data)))
        #: The types of the converted leaves: a leaf of one of them that matches is used as it is
        self.native_types = frozenset(type(v) for group in (native or (xs, data)) for v in group)

    def mismatch(self, what: str, expected: Any, got: Any) -> ShapeMismatchError:
        return ShapeMismatchError(
            f"prepared {self.operator} was prepared for {what} {expected}, but was called with "
            f"{got}; prepare again for the new inputs (or call the unprepared operator)"
        )

    def _where(self, i: int) -> str:
        n = self.fn.n_x_leaves
        return f"x leaf {i}" if i < n else f"argument leaf {i - n}"

    def _checked(self, leaves: list, index: tuple, raw: list, signature: list, native: list) -> list:
        out = []
        convert, native_types = self.backend.convert, self.native_types
        for i, (shape, dtype), sig, native_dtype in zip(index, raw, signature, native):
            leaf = leaves[i]
            try:
                same = (shape is None or leaf.shape == shape) and leaf.dtype == dtype
            except Exception:  # a Python float, or dtypes of two libraries that do not compare
                same = False
            if same and type(leaf) in native_types:  # the hot path: nothing to convert
                out.append(leaf)
                continue
            if not same:
                if is_array(leaf):
                    got = _signature(leaf)
                elif isinstance(leaf, float):  # differentiated as a float64 scalar
                    got = ((), "float64")
                else:
                    got = type(leaf).__name__
                if shape is None and isinstance(got, tuple):
                    got = (sig[0], got[1])  # any shape: the dtype decides
                alike = is_array(leaf) and got[0] == sig[0] and dtype_name(convert(leaf)) == native_dtype
                if got != sig and not alike:
                    error = self.mismatch(f"{self._where(i)} of shape/dtype", sig, got)
                    if sig[1] == "float64" and isinstance(got, tuple) and got[1] == "float32":
                        error = ShapeMismatchError(f"{error} {_NARROWED}")
                    raise error
            out.append(convert(leaf))
        return out

    def check(self, x: Any, args: tuple) -> tuple[list, list]:
        fn = self.fn
        if fn._array_args and type(x) in _LEAF_ARRAY_TYPES and len(args) == len(self.data_raw):
            # the hot path, f(x, *arrays): no flattening, one shape and dtype per array
            ((shape, dtype),) = self.x_raw
            try:
                same = (shape is None or x.shape == shape) and x.dtype == dtype and all(
                    type(a) in _LEAF_ARRAY_TYPES and (s is None or a.shape == s) and a.dtype == d
                    for a, (s, d) in zip(args, self.data_raw)
                )
            except Exception:  # dtypes of two libraries that do not compare
                same = False
            if same:
                convert = self.backend.convert
                return [convert(x)], [convert(a) for a in args]
        leaves, x_treedef = pytree.tree_flatten(x)
        if x_treedef != fn.x_treedef:
            raise self.mismatch("x of structure", fn.x_treedef, x_treedef)
        a_leaves, a_treedef = pytree.tree_flatten(args)
        if a_treedef != fn.args_treedef:
            raise self.mismatch("args of structure", fn.args_treedef, a_treedef)
        if a_leaves:
            leaves = leaves + a_leaves
        xs = self._checked(leaves, fn.diff_index, self.x_raw, self.x_signature, self.x_native)
        data = self._checked(leaves, fn.data_index, self.data_raw, self.data_signature, self.data_native)
        stateful = self._stateful
        for i, value, key in self.static:
            leaf = leaves[i]
            if (leaf is not value or i in stateful) and static_key(leaf, self._deep) != key:
                if leaf is value:  # the same object, its attributes changed since
                    raise ShapeMismatchError(
                        f"prepared {self.operator} was prepared for static {self._where(i)}, a "
                        f"{type(value).__name__} object, with other attribute values than it holds now "
                        f"({self.backend!r} reuses its trace, which holds the old ones); prepare again for "
                        f"the new values, pass the values that change as arguments (arrays or numbers: "
                        f"traced, never frozen), or call the unprepared operator"
                    )
                raise self.mismatch(f"static {self._where(i)} =", repr(value), repr(leaf))
        return xs, data


def _keyed_by_state(key: Any) -> bool:
    """Whether a static leaf's key reads its object's state (see abstractdiff._cache.static_key)."""
    return type(key) is tuple and len(key) == 4 and key[0] in ("object", "unchecked")


# ------------------------------------------------------------ prepared operators
def _given(fn: FlatFunction, x: Any, args: tuple, xs: list, data: list) -> tuple[list, list]:
    """The leaves the signature compares: the caller's own arrays, not their conversions
    (numpy int64 data stays int64 there, where jax without x64 converts it to int32), so
    that a prepared operator accepts again the inputs it was prepared with."""
    leaves = pytree.tree_leaves(x) + pytree.tree_leaves(args)
    return (
        [leaves[i] if is_array(leaves[i]) else v for i, v in zip(fn.diff_index, xs)],
        [leaves[i] if is_array(leaves[i]) else v for i, v in zip(fn.data_index, data)],
    )


class Prepared:
    """A prepared operator: ``prepared(x, *args)`` (``prepared(x, v, *args)`` for hvp).

    Holds the operator's :class:`Preparation` and the :class:`Signature` it checks on
    every call.  Built by :func:`prepare_gradient` and friends (``b.prepare(operator,
    f, x, args)``), and by the unprepared operators for themselves (:meth:`for_unprepared`).
    """

    operator: ClassVar[str] = "operator"

    def __init__(self, b: Any, f: Callable[..., Any], x: Any, args: tuple, has_aux: bool = False):
        backend = _backend(b)
        self.f = f  # fn holds f weakly (so the plan cache can drop it); the prepared operator keeps it
        self._prepare_for(backend, x, args, has_aux)

    def _prepare_for(self, backend: Any, x: Any, args: tuple, has_aux: bool) -> None:
        # The watch is made before the plan: a value that changes meanwhile makes it report a change.
        self._watch = CaptureWatch(self.f) if backend.reuses_traces else None
        fn, xs, data = backend.flatten(self.f, x, args, has_aux)
        self._setup(backend, backend.preparation(PREPARATIONS[self.operator], fn, xs, data), x, args, xs, data,
                    has_aux, None)

    @classmethod
    def for_unprepared(
        cls, backend: Any, preparation: Preparation, x: Any, args: tuple, xs: list, data: list, has_aux: bool,
        replan: Callable[..., Any],
    ) -> Prepared:
        """The prepared operator an unprepared operator calls while ``f``'s inputs keep the
        form of ``(x, args)``: the same checks but any shape (a preparation serves every
        shape), ``ShapeMismatchError`` for another form, which the unprepared operator then
        plans and prepares itself.  Where the library traces the call (jax's jit), the trace
        runs ``replan(x, *args)``, the unprepared operator's own route, which plans any
        form instead of refusing it.  It does not keep ``f`` alive (the caller holds it)."""
        self = cls.__new__(cls)
        self.f = None
        self._watch = None  # the unprepared operator checks f's capture guard itself
        self._setup(backend, preparation, x, args, xs, data, has_aux, replan)
        return self

    def _setup(
        self, backend: Any, preparation: Preparation, x: Any, args: tuple, xs: list, data: list, has_aux: bool,
        replan: Callable[..., Any] | None,
    ) -> None:
        self.backend = backend
        self.has_aux = has_aux
        self.fn: FlatFunction = preparation.fn
        self.preparation = preparation
        self.signature = Signature(
            self.operator, backend, self.fn, x, args, *_given(self.fn, x, args, xs, data),
            any_shape=replan is not None, native=(xs, data),
        )
        self._replan = replan
        #: ``None`` where nothing is watched, else ``unchanged() -> bool``: whether ``f`` still
        #: reads the values from its globals and closures that its trace holds (a backend that
        #: reuses traces); when not, the call runs :meth:`refresh` instead
        self.unchanged: Callable[[], bool] | None = (
            None if self._watch is None else functools.partial(self._watch.unchanged, self.f)
        )
        # the library's own dispatcher doing the checks, where the adapter offers one
        self._direct = backend.direct_prepared(self, xs, data)
        inner = self._direct or self._lean_gradient_call(x, args) or self.check_and_run
        #: the whole call, which calling the prepared operator runs: the adapter's direct one,
        #: else the core's lean gradient call, else the check in Python and the run; after the
        #: watch's test where there is one (a direct call marked ``tests_watch`` makes it itself)
        self.call: Callable[..., Any] = inner if self.unchanged is None or getattr(inner, "tests_watch", False) \
            else self._watched(inner, self.unchanged)

    def _lean_gradient_call(self, x: Any, args: tuple) -> Callable[..., Any] | None:
        """A gradient of ``f(x, *arrays)`` (no aux) prepared with the backend's own arrays:
        the signature check, the run and the result inlined in one closure (a few frames and
        conversions fewer: the hot path of small functions and training loops).  A call with
        inputs of another type, shape or dtype goes to :meth:`check_and_run`, which says what
        changed (or, for an unprepared operator's own, plans them)."""
        fn, backend, prep = self.fn, self.backend, self.preparation
        run = getattr(prep, "_run", None)
        if (not isinstance(prep, ValueAndGradientPrep) or fn.has_aux or not fn._array_args or run is None
                or not all(backend.is_native(a) for a in (x, *args))):
            return None
        types = [type(a) for a in (x, *args)]
        raw = self.signature.x_raw + self.signature.data_raw
        n, with_value, check_and_run = len(args), self.operator == ValueAndGradientPrep.operator, self.check_and_run
        zeros_like, leaf_types = backend.zeros_like, _LEAF_ARRAY_TYPES

        def lean(x: Any, *args: Any) -> Any:
            leaves = (x, *args)
            try:
                # a type still a leaf: one registered as a pytree node since flattens now
                same = len(args) == n and all(
                    type(a) is t and t in leaf_types and (s is None or a.shape == s) and a.dtype == d
                    for a, t, (s, d) in zip(leaves, types, raw)
                )
            except Exception:  # dtypes of two libraries that do not compare
                same = False
            if not same:
                return check_and_run(x, *args)
            y, _, grads = run([x], list(args))
            check_scalar(y)
            g = grads[0]
            if g is None:  # f does not depend on x
                g = zeros_like(x)
            return (y, g) if with_value else g

        return lean

    #: ``prepared(x, *args)`` (``prepared(x, v, *args)`` for hvp) runs :attr:`call` with no
    #: Python frame of its own: the hot path of small functions and training loops.
    __call__ = property(attrgetter("call"))

    def _watched(self, inner: Callable[..., Any], unchanged: Callable[[], bool]) -> Callable[..., Any]:
        refresh = self.refresh

        def watched(x: Any, *rest: Any) -> Any:
            return inner(x, *rest) if unchanged() else refresh(x, *rest)

        return watched

    def refresh(self, x: Any, *rest: Any) -> Any:
        """The call where :attr:`unchanged` reported a change: prepared again for the values
        ``f`` reads now from its globals and closures (see the module docstring), then called.
        The inputs must still have the prepared form; the new preparation is of that form."""
        args = rest[1:] if self.operator in TANGENT_OPERATORS else rest
        self.signature.check(x, args)  # another form is refused as before, whatever f reads
        with _REFRESH_LOCK:  # threads calling one prepared operator see one preparation at a time
            if not self._watch.unchanged(self.f):  # else another thread prepared again meanwhile
                self._prepare_for(self.backend, x, args, self.has_aux)
        return self.call(x, *rest)

    def check_and_run(self, x: Any, *args: Any) -> Any:
        """The call in Python: ``(x, args)`` checked against the signature, then the preparation run."""
        xs, data = self.signature.check(x, args)
        return self.preparation.run(xs, data)

    def run_traced(self, x: Any, *rest: Any) -> Any:
        """What an adapter's compiled call (:meth:`~abstractdiff.Backend.direct_prepared`) runs
        when its library traces: :meth:`check_and_run`, which refuses inputs of another
        form; for an unprepared operator's own prepared operator, the unprepared route,
        which plans any form (the library compiles the call once per form it traces)."""
        if self._replan is None:
            return self.check_and_run(x, *rest)
        return self._replan(x, *rest)

    def __repr__(self) -> str:
        return f"<prepared {self.operator} of {self.fn!r} on {self.backend!r}>"


class PreparedValueAndGradient(Prepared):
    """``vg(x, *args) -> (y, g)`` (``((y, aux), g)`` with ``has_aux``)."""

    operator = "value_and_gradient"


class PreparedGradient(Prepared):
    """``g(x, *args) -> gradient`` (``(gradient, aux)`` with ``has_aux``)."""

    operator = "gradient"


class PreparedValueAndPullback(Prepared):
    """``pb(x, *args) -> (y, vjp)`` with ``vjp(dy) -> dx``."""

    operator = "value_and_pullback"


class PreparedValueAndPushforward(Prepared):
    """``pf(x, *args) -> (y, jvp)`` with ``jvp(dx) -> dy``."""

    operator = "value_and_pushforward"


class PreparedPushforward(Prepared):
    """``pf(x, *args) -> jvp`` with ``jvp(dx) -> dy``."""

    operator = "pushforward"


class PreparedDerivative(Prepared):
    """``d(x, *args) -> dy/dx`` for a scalar ``x``."""

    operator = "derivative"


class PreparedJacobian(Prepared):
    """``j(x, *args) -> J``, a tree shaped like ``x`` of ``y.shape + leaf.shape`` arrays."""

    operator = "jacobian"


class PreparedHessian(Prepared):
    """``h(x, *args) -> H`` with ``H.shape == x.shape + x.shape`` (nested blocks for a pytree ``x``)."""

    operator = "hessian"


class PreparedValueAndDerivative(Prepared):
    """``d(x, *args) -> (y, dy/dx)`` for a scalar ``x``."""

    operator = "value_and_derivative"


class PreparedSecondDerivative(Prepared):
    """``d2(x, *args) -> d2y/dx2`` for a scalar ``x``."""

    operator = "second_derivative"


class PreparedValueDerivativeAndSecondDerivative(Prepared):
    """``d(x, *args) -> (y, dy/dx, d2y/dx2)`` for a scalar ``x``."""

    operator = "value_derivative_and_second_derivative"


class PreparedValueAndJacobian(Prepared):
    """``j(x, *args) -> (y, J)``."""

    operator = "value_and_jacobian"


class PreparedValueGradientAndHessian(Prepared):
    """``h(x, *args) -> (y, g, H)``."""

    operator = "value_gradient_and_hessian"


class PreparedPullback(Prepared):
    """``pb(x, *args) -> vjp`` with ``vjp(dy) -> dx`` (what ``b.prepare("pullback", ...)`` returns;
    ``ad.prepare_pullback`` returns value and pullback, as it always has)."""

    operator = "pullback"


class PreparedHvp(Prepared):
    """``h(x, v, *args) -> H @ v``, shaped like ``x``; ``v`` has the structure of ``x``."""

    operator = "hvp"

    def __init__(self, b: Any, f: Callable[..., Any], x: Any, v: Any, args: tuple):
        super().__init__(b, f, x, args)

    def check_and_run(self, x: Any, v: Any, *args: Any) -> Any:  # type: ignore[override]
        xs, data = self.signature.check(x, args)
        return self.preparation.run(xs, data, v)


class PreparedGradientAndHvp(PreparedHvp):
    """``h(x, v, *args) -> (g, H @ v)``, both shaped like ``x``; ``v`` has the structure of ``x``."""

    operator = "gradient_and_hvp"


#: The prepared class of each operator.
PREPARED: dict[str, type[Prepared]] = {
    cls.operator: cls
    for cls in (
        PreparedValueAndGradient, PreparedGradient, PreparedValueAndPullback, PreparedPullback,
        PreparedValueAndPushforward, PreparedPushforward, PreparedDerivative, PreparedJacobian, PreparedHessian,
        PreparedHvp, PreparedValueAndDerivative, PreparedSecondDerivative, PreparedValueDerivativeAndSecondDerivative,
        PreparedValueAndJacobian, PreparedValueGradientAndHessian, PreparedGradientAndHvp,
    )
}

#: The operators whose prepared form is called ``prepared(x, v, *args)``.
TANGENT_OPERATORS = frozenset(operators_where(takes_tangent=True))


def _backend(b: Any) -> Any:
    from ._registry import backend as get_backend

    return get_backend(b)


# ------------------------------------------------------------------ public API
def prepare_value_and_gradient(b: Any, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False) -> Any:
    """Prepare ``value_and_gradient`` of ``f`` for inputs shaped like ``(x, *args)``.

    ``prepare_value_and_gradient(b, f, x, *args, has_aux=False) -> vg`` with
    ``vg(x, *args) -> (y, g)``.  All per-function work (flattening plans, tracing and
    compilation on compiled backends) happens here; each call checks that structure,
    shapes, dtypes and static leaves still match and raises
    :class:`~abstractdiff.ShapeMismatchError` when they do not.  Nothing of ``f`` is
    frozen: each call sees the values ``f`` reads from globals and closures at that call,
    on every backend (a compiled backend traces again when one changed).

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> vg = ad.prepare_value_and_gradient("finite_differences", lambda w, a: (a * w**2).sum(), np.ones(2), 3.0)
        >>> y, g = vg(np.array([1.0, 2.0]), 3.0)
        >>> float(y), np.round(g, 6)
        (15.0, array([ 6., 12.]))
    """
    return _backend(b).prepare("value_and_gradient", f, x, args, has_aux=has_aux)


def prepare_gradient(b: Any, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False) -> Any:
    """Prepare ``gradient`` of ``f``: ``prepare_gradient(b, f, x, *args) -> g`` with ``g(x, *args) -> gradient``.

    See :func:`prepare_value_and_gradient` for what is checked on each call.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> grad = ad.prepare_gradient("finite_differences", lambda w: (w**2).sum(), np.ones(2))
        >>> np.round(grad(np.array([1.0, -3.0])), 6)
        array([ 2., -6.])
    """
    return _backend(b).prepare("gradient", f, x, args, has_aux=has_aux)


def prepare_pullback(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``value_and_pullback``: ``prepare_pullback(b, f, x, *args) -> pb`` with ``pb(x, *args) -> (y, vjp)``.

    The same as :func:`prepare_value_and_pullback` (its older name; it returns the value too).

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> pb = ad.prepare_pullback("finite_differences", lambda w: 2 * w, np.ones(2))
        >>> y, vjp = pb(np.array([1.0, 2.0]))
        >>> np.round(vjp(np.array([1.0, 1.0])), 6)
        array([2., 2.])
    """
    return _backend(b).prepare("value_and_pullback", f, x, args)


def prepare_value_and_pullback(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``value_and_pullback``: ``-> pb`` with ``pb(x, *args) -> (y, vjp)``, ``vjp(dy) -> dx``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> pb = ad.prepare_value_and_pullback("finite_differences", lambda w: w**2, np.ones(2))
        >>> y, vjp = pb(np.array([1.0, 3.0]))
        >>> np.round(vjp(np.ones(2)), 6)
        array([2., 6.])
    """
    return _backend(b).prepare("value_and_pullback", f, x, args)


def prepare_value_and_pushforward(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``value_and_pushforward``: ``-> pf`` with ``pf(x, *args) -> (y, jvp)``, ``jvp(dx) -> dy``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> pf = ad.prepare_value_and_pushforward("finite_differences", lambda w: w**2, np.ones(2))
        >>> y, jvp = pf(np.array([1.0, 3.0]))
        >>> np.round(jvp(np.array([1.0, 0.0])), 6)
        array([2., 0.])
    """
    return _backend(b).prepare("value_and_pushforward", f, x, args)


def prepare_pushforward(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``pushforward``: ``prepare_pushforward(b, f, x, *args) -> pf`` with ``pf(x, *args) -> jvp``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> pf = ad.prepare_pushforward("finite_differences", lambda w: 3 * w, np.ones(2))
        >>> np.round(pf(np.zeros(2))(np.ones(2)), 6)
        array([3., 3.])
    """
    return _backend(b).prepare("pushforward", f, x, args)


def prepare_derivative(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``derivative``: ``prepare_derivative(b, f, x, *args) -> d`` with ``d(x, *args) -> dy/dx``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> d = ad.prepare_derivative("finite_differences", np.sin, 0.0)
        >>> round(float(d(0.0)), 8)
        1.0
    """
    return _backend(b).prepare("derivative", f, x, args)


def prepare_jacobian(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``jacobian``: ``prepare_jacobian(b, f, x, *args) -> j`` with ``j(x, *args) -> J``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> j = ad.prepare_jacobian("finite_differences", lambda w: w[::-1] * 2, np.ones(2))
        >>> np.round(j(np.zeros(2)), 6)
        array([[0., 2.],
               [2., 0.]])
    """
    return _backend(b).prepare("jacobian", f, x, args)


def prepare_hessian(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``hessian``: ``prepare_hessian(b, f, x, *args) -> h`` with ``h(x, *args) -> H``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> h = ad.prepare_hessian("finite_differences", lambda w: (w**3).sum(), np.ones(2))
        >>> np.round(h(np.array([1.0, 2.0])), 4) + 0.0
        array([[ 6.,  0.],
               [ 0., 12.]])
    """
    return _backend(b).prepare("hessian", f, x, args)


def prepare_hvp(b: Any, f: Callable[..., Any], x: Any, v: Any, *args: Any) -> Any:
    """Prepare ``hvp``: ``prepare_hvp(b, f, x, v, *args) -> h`` with ``h(x, v, *args) -> H @ v``.

    ``v`` (shaped like ``x``) may change from call to call; it is checked each time.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> h = ad.prepare_hvp("finite_differences", lambda w: (w**3).sum(), np.ones(2), np.ones(2))
        >>> np.round(h(np.array([1.0, 2.0]), np.array([1.0, 0.0])), 4) + 0.0
        array([6., 0.])
    """
    return _backend(b).prepare("hvp", f, x, args, tangent=v)


def prepare_value_and_derivative(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``value_and_derivative``: ``-> d`` with ``d(x, *args) -> (y, dy/dx)`` for a scalar ``x``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> d = ad.prepare_value_and_derivative("finite_differences", lambda t: t**3, 1.0)
        >>> y, dy = d(2.0)
        >>> float(y), round(float(dy), 6)
        (8.0, 12.0)
    """
    return _backend(b).prepare("value_and_derivative", f, x, args)


def prepare_second_derivative(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``second_derivative``: ``-> d2`` with ``d2(x, *args) -> d2y/dx2`` for a scalar ``x``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> d2 = ad.prepare_second_derivative("finite_differences", lambda t: t**3, 1.0)
        >>> round(float(d2(2.0)), 4)
        12.0
    """
    return _backend(b).prepare("second_derivative", f, x, args)


def prepare_value_derivative_and_second_derivative(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``value_derivative_and_second_derivative``: ``-> d`` with ``d(x, *args) -> (y, dy/dx, d2y/dx2)``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> d = ad.prepare_value_derivative_and_second_derivative("finite_differences", lambda t: t**3, 1.0)
        >>> [round(float(v), 4) for v in d(2.0)]
        [8.0, 12.0, 12.0]
    """
    return _backend(b).prepare("value_derivative_and_second_derivative", f, x, args)


def prepare_value_and_jacobian(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``value_and_jacobian``: ``-> j`` with ``j(x, *args) -> (y, J)``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> j = ad.prepare_value_and_jacobian("finite_differences", lambda w: w[::-1] * 2, np.ones(2))
        >>> y, J = j(np.array([1.0, 3.0]))
        >>> y, np.round(J, 6)
        (array([6., 2.]), array([[0., 2.],
               [2., 0.]]))
    """
    return _backend(b).prepare("value_and_jacobian", f, x, args)


def prepare_value_gradient_and_hessian(b: Any, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Prepare ``value_gradient_and_hessian``: ``-> h`` with ``h(x, *args) -> (y, g, H)``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> h = ad.prepare_value_gradient_and_hessian("finite_differences", lambda w: (w**3).sum(), np.ones(2))
        >>> y, g, H = h(np.array([1.0, 2.0]))
        >>> float(y), np.round(g, 6), np.round(H, 4) + 0.0
        (9.0, array([ 3., 12.]), array([[ 6.,  0.],
               [ 0., 12.]]))
    """
    return _backend(b).prepare("value_gradient_and_hessian", f, x, args)


def prepare_gradient_and_hvp(b: Any, f: Callable[..., Any], x: Any, v: Any, *args: Any) -> Any:
    """Prepare ``gradient_and_hvp``: ``prepare_gradient_and_hvp(b, f, x, v, *args) -> h`` with
    ``h(x, v, *args) -> (g, H @ v)``.

    ``v`` (shaped like ``x``) may change from call to call; it is checked each time.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> h = ad.prepare_gradient_and_hvp("finite_differences", lambda w: (w**3).sum(), np.ones(2), np.ones(2))
        >>> g, hv = h(np.array([1.0, 2.0]), np.array([1.0, 0.0]))
        >>> np.round(g, 6), np.round(hv, 4) + 0.0
        (array([ 3., 12.]), array([6., 0.]))
    """
    return _backend(b).prepare("gradient_and_hvp", f, x, args, tangent=v)

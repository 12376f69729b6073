"""``ad.Implicit(inner)``: the implicit-parameters combinator, in the core.

``f()`` reads variables, ``ad.Params`` names them, and the gradient comes back as
``ad.Grads``.  Implicit mode works on any backend, built-in or third-party, through two
routes chosen by the variables:

* a *native route*, where the variables' backend has one (its
  ``implicit_value_and_gradient`` / ``implicit_value_and_pullback`` hooks: torch
  differentiates its leaf tensors with ``torch.autograd.grad``, TensorFlow watches its
  variables on a tape);
* the *swap route* otherwise: ``f`` becomes an explicit function of the variables'
  values, which swaps each variable's value for the traced one (the owner's ``swap``
  hook: ``ad.Variable`` boxes, or a library's own variables), calls ``f`` and puts the
  values back (``finally``), and the inner backend differentiates it explicitly.

The explicit function of the swap route is cached per (``f``, variables, other boxes),
holding all of them weakly, so that compiling inner backends (jax ``jit``,
``tf.function``) reuse their trace on a repeated call.  ``ad.Variable`` boxes ``f``
reads that are not in ``Params`` ("other boxes") are passed as data, so a trace never
freezes their values.  Which boxes those are is learned whenever ``f`` runs: a call that
reads a box outside the wrapper's set gives correct values (the box is read as it is)
and the next call uses a wrapper for the new set (a new trace on compiled backends); a
dead box simply drops out of the set.  A compiled inner backend runs ``f`` only when it
traces, so replacing a box ``f`` reads (rather than assigning its ``.value``) while the
old box is still alive goes unnoticed until the next trace: assign ``box.value = new``
instead, which is always seen.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from . import _pytree as pytree
from ._arrays import dtype_name, shape_of
from ._backend import Backend
from ._cache import WeakLRU
from ._errors import (
    ArgumentTypeError,
    CollectedError,
    InvalidArgumentError,
    ModeMismatchError,
    NonDifferentiableInputError,
    ShapeMismatchError,
)
from ._implicit import BOXES, Grads, Params, Variable, _reads
from ._operator_table import OPERATORS, operators_where
from ._prepare import PREPARED, Signature
from ._registry import _lookup
from ._registry import backend as _backend
from ._tree import _weak_callable, flatten_call, is_array

__all__ = ["Implicit", "IMPLICIT_OPERATORS"]

#: The operators of implicit mode; the others need an explicit x (the error says which backend).
IMPLICIT_OPERATORS = operators_where(implicit=True)
_EXPLICIT_ONLY = operators_where(implicit=False)


class _Seen(threading.local):
    """Per thread, the collectors of the other boxes ``f`` reads (a stack, for nesting)."""

    def __init__(self) -> None:
        self.stack: list[dict[int, Variable]] = []


_seen = _Seen()


class _Swapped:
    """``f`` as an explicit function of its variables' values: ``(values, extra_values, *args) -> f(*args)``.

    ``extra`` are the boxes ``f`` read that are not parameters, fixed for the wrapper's
    life (a new set of them gets a new wrapper, and so a new trace).  Holds ``f`` and
    every variable weakly: it is cached and must not keep them alive; whoever calls it
    holds them.  ``owner`` swaps values in and out (its ``swap`` hook).
    """

    def __init__(self, f: Callable[..., Any], owner: Any, variables: list[Any], extra: list[Variable]):
        self._f = _weak_callable(f)
        self.owner = owner
        self._vars = [weakref.ref(v) for v in variables]
        self._extra = [weakref.ref(b) for b in extra]
        self._known = {id(v) for v in variables}

    @property
    def __abstractdiff_wrapped__(self) -> Any:
        """The user's ``f``: what a tracing backend fingerprints (see abstractdiff._captures)."""
        return self._f()

    def variables(self) -> tuple[list[Any], list[Variable]]:
        variables = [r() for r in self._vars]
        if self._f() is None or any(v is None for v in variables):
            raise CollectedError("the function or a variable being differentiated was garbage collected")
        # a dead other box cannot be read by f any more: it is left out, never an error
        return variables, [b for b in (r() for r in self._extra) if b is not None]

    def __call__(self, values: list, extra_values: list, *args: Any) -> Any:
        f = self._f()
        if f is None:
            raise CollectedError("the function being differentiated was garbage collected")
        reads: dict[int, Variable] = {}
        swapped: list[tuple[Any, Any, Any]] = []
        _reads.stack.append(reads)
        try:
            pairs = [(self.owner, r, v) for r, v in zip(self._vars, values)]
            pairs += [(BOXES, r, v) for r, v in zip(self._extra, extra_values)]
            for owner, ref, value in pairs:
                var = ref()
                if var is not None:
                    swapped.append((owner, var, owner.swap(var, value)))
            return f(*args)
        finally:
            _reads.stack.pop()
            for owner, var, old in reversed(swapped):
                owner.swap(var, old)
            if _seen.stack:
                seen = _seen.stack[-1]
                seen[id(self)] = self  # f ran
                for key, box in reads.items():
                    if key not in self._known:
                        seen[key] = box


class _Family:
    """The wrappers of one (``f``, variables): one per set of other boxes, the current set
    being the one ``f`` read when it last ran."""

    max_wrappers = 8  # sets of other boxes remembered (each may hold a compiled trace)

    def __init__(self, f: Callable[..., Any], owner: Any, variables: list[Any]):
        self._f = _weak_callable(f)
        self.owner = owner
        self._vars = [weakref.ref(v) for v in variables]
        self.extra: list[weakref.ref] = []
        # keyed by the other boxes, held weakly: a dead box's id may be reused by a new
        # box, so its wrapper (and trace) goes with it
        self.wrappers: WeakLRU[_Swapped] = WeakLRU(
            self.max_wrappers, name="implicit wrappers", keyed_on="the other variables f read (held weakly)"
        )

    def wrapper(self) -> _Swapped:
        extra = tuple(b for b in (r() for r in self.extra) if b is not None)
        w = self.wrappers.get(extra)
        if w is not None:
            return w
        f, variables = self._f(), [r() for r in self._vars]
        if f is None or any(v is None for v in variables):
            raise CollectedError("the function or a variable being differentiated was garbage collected")
        return self.wrappers.put(extra, _Swapped(f, self.owner, variables, list(extra)))

    def observe(self, w: _Swapped, seen: dict[int, Any]) -> None:
        """After an operation: ``seen`` holds ``w`` if ``f`` ran, and the other boxes it read."""
        if id(w) not in seen:
            return  # a compiled trace was reused: f did not run, nothing new was learned
        read = [b for k, b in seen.items() if k != id(w)]
        if [id(b) for b in read] == [id(r()) for r in w._extra]:
            return
        self.extra = [weakref.ref(b) for b in read]
        if any(id(b) not in {id(r()) for r in w._extra} for b in read):
            # f read a box w does not pass as data: a compiled trace of w holds its value
            # as a constant, so w must never be used again
            self.wrappers.discard_value(w)


# Wrapper families per (f, variables), shared by every Implicit instance: a wrapper does
# not depend on the inner backend (whose own plan cache keys on the wrapper), so a fresh
# ad.Implicit(b) per step still reuses jax's compiled trace.  Dropped when f, its owner
# (a bound method's self) or any variable dies.
_FAMILIES: WeakLRU[_Family] = WeakLRU(
    name="implicit wrapper families", keyed_on="the user's function, its owner and its variables (held weakly)"
)


def _family_of(f: Callable[..., Any], owner: Any, variables: list[Any]) -> _Family | None:
    self_ = getattr(f, "__self__", None)
    func = getattr(f, "__func__", f) if self_ is not None else f
    objects = (func, *(() if self_ is None else (self_,)), *variables)
    return _FAMILIES.get_or_put(objects, lambda: _Family(f, owner, variables)) if _weakrefable(func) else None


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


class Implicit(Backend):
    """``Implicit(inner)``: differentiate ``f()`` with respect to ``ad.Params`` on ``inner``.

    ``inner`` is a backend name or instance, built-in or third-party; extra keyword
    options create the inner backend (``Implicit("jax", compile=False)``).  Operators:
    ``gradient``, ``value_and_gradient`` (``has_aux`` too), ``pullback`` and
    ``value_and_pullback``, returning :class:`abstractdiff.Grads`, and their ``prepare_*``
    twins.  Extra positional ``args`` are passed to ``f(*args)`` undifferentiated (data,
    as in explicit mode: compiled backends reuse their trace for new data of the same
    shapes).  The same backend as ``ad.backend("implicit", inner=inner)``.

    ``ad.gradient(Implicit(inner), f, ad.Params(obj), *args) -> ad.Grads``;
    ``ad.value_and_gradient(...) -> (y, Grads)``; ``ad.value_and_pullback(...) -> (y,
    vjp)`` with ``vjp(dy) -> Grads``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> w = ad.Variable(np.array([1.0, -2.0]))
        >>> b = ad.Implicit("finite_differences")
        >>> y, gs = ad.value_and_gradient(b, lambda x: (w.value * x).sum(), ad.Params([w]), np.array([3.0, 4.0]))
        >>> float(y), np.round(gs[w], 6)
        (-5.0, array([3., 4.]))
    """

    name = "implicit"
    implicit = True

    def __init__(self, inner: str | Backend, **inner_options: Any):
        if isinstance(inner, Backend):
            if inner.implicit:
                raise ArgumentTypeError(
                    "the inner backend of ad.Implicit must be an explicit backend, not another ad.Implicit"
                )
            if inner_options:
                raise ArgumentTypeError("options cannot be given with a Backend instance as inner")
            self._inner: Backend | None = inner
            self.inner_name = inner.name
        elif isinstance(inner, str):
            _lookup(inner)  # an unknown name fails now, with the list of names
            if inner == "implicit":
                raise ArgumentTypeError("the inner backend of ad.Implicit must be an explicit backend, such as 'jax'")
            self._inner, self.inner_name = None, inner
        else:
            raise ArgumentTypeError(
                f"inner must be a backend name (such as 'jax') or a Backend, got {type(inner).__name__}"
            )
        self._inner_options = inner_options
        self.options = {"inner": inner, **inner_options}
        self._plans = None  # type: ignore[assignment]

    @property
    def inner(self) -> Backend:
        """The explicit backend doing the work (created on first use)."""
        if self._inner is None:
            self._inner = _backend(self.inner_name, **self._inner_options)
        return self._inner

    # Everything about arrays and devices is the inner backend's.
    @property
    def device(self) -> str:  # type: ignore[override]
        return self.inner.device

    @property
    def approximate(self) -> bool:  # type: ignore[override]
        return self.inner.approximate

    def devices(self) -> list[str]:
        return self.inner.devices()

    def is_native(self, a: Any) -> bool:
        return self.inner.is_native(a)

    def from_numpy(self, a: Any) -> Any:
        return self.inner.asarray(a)

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        return self.inner.asarray(a, dtype)

    def to_numpy(self, a: Any) -> Any:
        return self.inner.to_numpy(a)

    def cast(self, a: Any, dtype: str) -> Any:
        return self.inner.cast(a, dtype)

    def zeros_like(self, a: Any) -> Any:
        return self.inner.zeros_like(a)

    def ones_like(self, a: Any) -> Any:
        return self.inner.ones_like(a)

    # ------------------------------------------------------------- checks
    def params(self, x: Any) -> Params:
        """``x`` checked to be ``ad.Params`` of variables this backend's inner one can differentiate."""
        if not isinstance(x, Params):
            raise ModeMismatchError(
                f"the implicit backend ({self!r}) differentiates f() with respect to ad.Params, but got "
                f"a {type(x).__name__}; wrap the model or variables: ad.gradient(b, f, ad.Params(model)) "
                f"with f taking no arguments, or differentiate f(x) explicitly with "
                f"ad.backend({self.inner_name!r})"
            )
        if x.owner is None:
            raise NonDifferentiableInputError(
                f"{x!r} holds no trainable variable to differentiate; unfreeze some parameters "
                f"(requires_grad=True / trainable=True) or pass the variables themselves"
            )
        if x.owner is not BOXES and not self.inner.is_variable(x[0]):
            raise ModeMismatchError(
                f"Params holds {x.kind} variables but the inner backend is {self.inner_name!r}; use "
                f"ad.Implicit({x.kind!r}), or hold {self.inner_name} values in ad.Variable boxes "
                f"(ad.variables(tree, {self.inner_name!r}))"
            )
        return x

    def _native(self, args: tuple) -> tuple:
        # array leaves of args become native arrays, as in explicit mode
        if not args:
            return args
        inner = self.inner
        return pytree.tree_map(lambda a: a if not is_array(a) or inner.is_native(a) else inner.convert(a), args)

    def _native_route(self, ps: Params) -> bool:
        return ps.owner is not BOXES and self.inner.has_implicit_route

    # --------------------------------------------------------- swap route
    def _swap_run(self, op: Callable[..., Any], f: Callable[..., Any], ps: Params, *args: Any, **kw: Any) -> tuple:
        """``op(wrapper, values, extra values, *args)`` on the inner backend, noting what f read."""
        variables = list(ps)
        family = _family_of(f, ps.owner, variables)
        if family is None:  # f cannot be weakly referenced: a wrapper for this call only
            w = _Swapped(f, ps.owner, variables, [])
            w._f = lambda: f
        else:
            w = family.wrapper()
        _, extra = w.variables()
        owner = ps.owner
        seen: dict[int, Any] = {}
        _seen.stack.append(seen)
        try:
            out = op(w, [owner.read(v) for v in variables], [BOXES.read(b) for b in extra], *args, **kw)
        finally:
            _seen.stack.pop()
        if family is not None:
            family.observe(w, seen)
        return w, out

    # ------------------------------------------------------------ operators
    def run(self, operator: str, f: Callable[..., Any], ps: Params, args: tuple, has_aux: bool = False) -> Any:
        """One implicit operator, by name, on checked ``Params``: what prepared calls run."""
        op = OPERATORS[operator]
        if op.takes_aux:  # of implicit mode's operators, the gradients (Grads, and aux)
            return self._gradient(f, ps, args, has_aux, op.with_value)
        return self._pullback(f, ps, args, op.with_value)

    def _gradient(self, f: Callable[..., Any], ps: Params, args: tuple, has_aux: bool, with_value: bool) -> Any:
        if self._native_route(ps):
            y, aux, grads = self.inner.implicit_value_and_gradient(f, list(ps), self._native(args), has_aux)
        else:
            _, (out, grads) = self._swap_run(self.inner.value_and_gradient, f, ps, *args, has_aux=has_aux)
            y, aux = out if has_aux else (out, None)
        gs = Grads(ps, list(grads))
        if with_value:
            return ((y, aux), gs) if has_aux else (y, gs)
        return (gs, aux) if has_aux else gs

    def _pullback(self, f: Callable[..., Any], ps: Params, args: tuple, with_value: bool) -> Any:
        w = None
        if self._native_route(ps):
            y, vjp = self.inner.implicit_value_and_pullback(f, list(ps), self._native(args))
        else:
            w, (y, vjp) = self._swap_run(self.inner.value_and_pullback, f, ps, *args)

        def pullback(dy: Any) -> Grads:
            return Grads(ps, list(vjp(dy)))

        # the explicit wrapper holds f weakly, and its family may drop it: a pullback that
        # calls f again (finite differences) needs both
        pullback.f, pullback.wrapper = f, w  # type: ignore[attr-defined]
        return (y, pullback) if with_value else pullback

    def _checked(self, f: Callable[..., Any], x: Any) -> Params:
        ps = self.params(x)
        if not callable(f):
            raise ArgumentTypeError(f"f must be callable, got {type(f).__name__}")
        return ps

    def value_and_gradient(self, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False) -> tuple[Any, Grads]:
        """``(y, gs)`` or ``((y, aux), gs)``; see :func:`abstractdiff.value_and_gradient`."""
        return self._gradient(f, self._checked(f, x), args, has_aux, with_value=True)

    def gradient(self, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False) -> Any:
        """``gs`` or ``(gs, aux)``; see :func:`abstractdiff.gradient`."""
        return self._gradient(f, self._checked(f, x), args, has_aux, with_value=False)

    def value_and_pullback(self, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Callable[[Any], Grads]]:
        """``(y, vjp)`` with ``vjp(dy) -> Grads``; see :func:`abstractdiff.value_and_pullback`."""
        return self._pullback(f, self._checked(f, x), args, with_value=True)

    def pullback(self, f: Callable[..., Any], x: Any, *args: Any) -> Callable[[Any], Grads]:
        """``vjp`` with ``vjp(dy) -> Grads``; see :func:`abstractdiff.pullback`."""
        return self._pullback(f, self._checked(f, x), args, with_value=False)

    def prepare(
        self, operator: str, f: Callable[..., Any], x: Any, args: tuple = (), *, has_aux: bool = False,
        tangent: Any = None,
    ) -> PreparedImplicit:
        """An implicit operator prepared for ``f``, these ``Params`` and args shaped like ``args``."""
        if operator in _EXPLICIT_ONLY:
            _explicit_only(operator)(self)
        if operator not in PREPARED:
            raise InvalidArgumentError(f"unknown operator {operator!r}; known: {', '.join(sorted(PREPARED))}")
        return PreparedImplicit(self, operator, f, self._checked(f, x), args, has_aux)


class PreparedImplicit:
    """An implicit operator prepared for one ``f``, one ``ad.Params`` and args of one signature.

    Each call checks that it gets the same variables (by identity), that their values
    kept their shapes and dtypes, and that ``args`` kept structure, shapes, dtypes and
    static leaves (:class:`~abstractdiff.ShapeMismatchError` otherwise), then runs the
    same code as the unprepared operator.
    """

    def __init__(self, backend: Implicit, operator: str, f: Callable[..., Any], ps: Params, args: tuple,
                 has_aux: bool):
        self.operator = operator
        self.backend, self.f, self.params, self.has_aux = backend, f, ps, has_aux
        self.variables = [(shape_of(v), dtype_name(v)) for v in map(ps.owner.read, ps)]
        inner = backend.inner
        fn, _, data = flatten_call(None, _no_function, None, args, False)  # the args' plan, to check them
        self.signature = Signature(self.operator, inner, fn, None, args, [], [inner.convert(d) for d in data])

    def __call__(self, x: Any, *args: Any) -> Any:
        ps = self.backend._checked(self.f, x)
        if ps is not self.params and (len(ps) != len(self.params) or any(a is not b for a, b in zip(ps, self.params))):
            raise ShapeMismatchError(
                f"prepared {self.operator} was prepared for other variables ({self.params!r}), but was called "
                f"with {ps!r}; prepare again for these variables"
            )
        for i, (v, expected) in enumerate(zip(map(ps.owner.read, ps), self.variables)):
            got = (shape_of(v), dtype_name(v))
            if got != expected:
                raise self.signature.mismatch(f"variable {i} of shape/dtype", expected, got)
        self.signature.check(None, args)
        return self.backend.run(self.operator, self.f, ps, args, self.has_aux)

    def __repr__(self) -> str:
        return f"<prepared implicit {self.operator} of {self.f!r} on {self.backend!r}>"


def _no_function(*args: Any) -> None:  # the function of the args-only plan: never called
    raise AssertionError("not called")


def _explicit_only(name: str) -> Callable[..., Any]:
    def refuse(self: Implicit, *_args: Any, **_kwargs: Any) -> Any:
        raise ModeMismatchError(
            f"{name} is not available in implicit mode (ad.Implicit offers gradient, value_and_gradient, "
            f"pullback and value_and_pullback); call ad.{name} on the explicit backend "
            f"ad.backend({self.inner_name!r}) with the variables' values as x "
            f"(abstractdiff._implicit.current_values reads them from a tree of variables)"
        )

    refuse.__name__ = name
    return refuse


for _name in _EXPLICIT_ONLY:
    setattr(Implicit, _name, _explicit_only(_name))

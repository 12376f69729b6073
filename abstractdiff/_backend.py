"""The backend protocol: what users call on a backend.

A backend has two sides, kept in separate classes so that a reader sees each at a glance:

* the adapter side, :class:`abstractdiff._hooks.AdapterHooks`: traits, the two
  primitives (``flat_value_and_pullback`` / ``flat_value_and_pushforward``) and the
  hooks (arrays, devices, variables), each with a numpy-like default; the flat
  operators the core derives from the primitives are in
  :class:`abstractdiff._derived.DerivedOperators`, and an adapter overrides them only
  for speed;
* the user side, :class:`Backend` (this module): the pytree-level operators
  (``gradient``, ``jacobian``...), preparation, and the conversions users call.  Each
  operator is prepare-then-call (:mod:`abstractdiff._prepare`); adapters do not
  override these.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import numpy as np

from . import _prepare as _prep
from . import _pytree as pytree
from ._arrays import check_scalar, dtype_name, shape_of, size_of
from ._batch import Batch
from ._captures import capture_guard
from ._derived import DerivedOperators, GradientDotTangent, GradientFunction
from ._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    ModeMismatchError,
    NonDifferentiableInputError,
    ShapeMismatchError,
)
from ._hooks import HOOKS, parse_device
from ._operator_table import OPERATORS
from ._prepare import PREPARED, TANGENT_OPERATORS, Preparation, Prepared
from ._registry import hold_adapters_in
from ._tree import (
    BASIC_STATIC,
    FlatFunction,
    PyTree,
    flatten_call,
    foreign_container,
    is_array,
    unflattened_container_error,
)
from .protocol import FAST_ROUTES, JACOBIAN_ROUTES, PER_CALL_ROUTES, PRIMITIVES, Adapter

__all__ = [
    "AdapterBackend", "Backend", "GradientDotTangent", "GradientFunction", "check_scalar", "dtype_name", "shape_of",
    "size_of",
]

def _signature_key(xs: list, data: list) -> tuple:
    # What a preparation may depend on: the dtype of every leaf (jax's x64 mode follows it).
    # Not the shapes: a preparation serves every shape (jit retraces per shape itself, and
    # an adapter keys a shape-dependent artefact by shape in its own cache); keying on them
    # would make a new preparation for every batch size.
    return tuple([a.dtype for a in (xs + data if data else xs)])


class Backend(DerivedOperators):
    """Base class of every AD backend.

    Subclasses set :attr:`name`, implement at least one primitive
    (:meth:`flat_value_and_pullback` or :meth:`flat_value_and_pushforward`) and the
    hooks their library needs (:class:`abstractdiff._hooks.AdapterHooks` lists them,
    with numpy defaults).  Users call the pytree-level operators (:meth:`gradient`,
    :meth:`jacobian`, ...) or the module functions ``ad.gradient(backend, ...)``, which
    are the same thing.

    ``Backend(*, device=None, **options)``; ``b.options`` holds them, and two backends
    of the same class and options compare equal.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> class Doubling(ad.Backend):  # a toy reverse mode for f(x) = sum(x**2) only
        ...     name = "doubling"
        ...     def flat_value_and_pullback(self, fn, xs, data):
        ...         y, aux = fn(xs, data)
        ...         return y, aux, lambda dy: [2 * x * dy for x in xs]
        >>> b = Doubling()
        >>> b.gradient(lambda x: (x**2).sum(), np.array([1.0, 3.0]))   # derived by the core
        array([2., 6.])
    """

    # ------------------------------------------------------------ conversions
    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        """``a`` as a native array of this backend, on its device.

        Native arrays and traced values pass through unchanged (cast only when ``dtype``,
        a name such as ``"float32"``, is given and differs); numpy arrays, Python numbers
        (a float is float64) and other libraries' arrays are converted, dtype preserved
        unless ``dtype`` is given.  Safe inside a function being differentiated.
        """
        if self.is_native(a):
            return a if dtype is None or dtype_name(a) == dtype else self.cast(a, dtype)
        if isinstance(a, float):
            a = np.asarray(a, dtype=np.float64)
        elif not isinstance(a, np.ndarray):
            from ._convert import to_numpy

            a = to_numpy(a)
        try:
            return self.from_numpy(np.asarray(a, dtype=dtype))
        except TypeError:  # a dtype numpy has no name for (torch's "bfloat16"): the library casts
            return self.cast(self.from_numpy(np.asarray(a)), dtype)  # type: ignore[arg-type]

    def convert(self, a: Any, dtype: str | None = None) -> Any:
        """The same as :meth:`asarray` (its older name)."""
        return self.asarray(a, dtype)

    # ---------------------------------------------------------------- plumbing
    def flatten(
        self, f: Callable[..., Any], x: PyTree, args: tuple, has_aux: bool = False
    ) -> tuple[FlatFunction, list, list]:
        """The cached flat function of ``f`` and the native leaves of ``x`` and ``args``."""
        if getattr(x, "_abstractdiff_params", False):
            raise ModeMismatchError(
                f"ad.Params reached the explicit {self.name!r} backend; implicit parameters "
                f"need the implicit combinator: use ad.Implicit({self.name!r}) (or "
                f"ad.backend('implicit', inner={self.name!r})), or pass the arrays "
                f"themselves as x to differentiate explicitly"
            )
        if not callable(f):
            raise ArgumentTypeError(f"f must be callable, got {type(f).__name__}")
        fn, xs, data = flatten_call(self._plans, f, x, args, has_aux, self.reuses_traces, self._check_static)
        if not xs:
            kinds = sorted({type(v).__name__ + (f"[{v.dtype}]" if is_array(v) else "") for v in pytree.tree_leaves(x)})
            raise NonDifferentiableInputError(
                f"x has no floating-point leaf to differentiate (its leaves are: "
                f"{', '.join(kinds) or 'none'}); pass float arrays (e.g. "
                f"np.asarray(x, dtype=np.float64)), and pass non-differentiable data as "
                f"extra arguments after x"
            )
        asarray = self.asarray
        return fn, [asarray(v) for v in xs], [asarray(v) for v in data]

    def _check_static(self, leaf: Any, where: str) -> None:
        """A static leaf must not be a container some registry knows and abstractdiff does not
        (its arrays would silently get no gradient)."""
        if isinstance(leaf, BASIC_STATIC):
            return
        registry = foreign_container(leaf)
        if registry is not None:
            raise unflattened_container_error(leaf, where, registry)

    def cotangent(self, dy: Any, y: Any) -> Any:
        """``dy`` checked against ``y``'s shape and converted to a native array of its dtype."""
        if not (is_array(dy) or isinstance(dy, (int, float))):
            raise ShapeMismatchError(
                f"cotangent must be an array shaped like f's output {shape_of(y)}, got "
                f"{type(dy).__name__}"
            )
        got = shape_of(dy) if is_array(dy) else ()
        if got != shape_of(y):
            raise ShapeMismatchError(
                f"cotangent has shape {got} but f's output has shape {shape_of(y)}; "
                f"pass an array shaped like y"
            )
        return self.convert(dy if is_array(dy) else np.asarray(dy), dtype_name(y))

    def tangents(self, fn: FlatFunction, xs: list, dx: PyTree, what: str = "tangent") -> list:
        """The float leaves of ``dx``, a tree shaped like ``x``, checked and converted."""
        if isinstance(dx, Batch):
            raise ShapeMismatchError(
                f"{what} must be one tree shaped like x, got an ad.Batch of {len(dx)}; only the closures "
                f"that pushforward and pullback return take a Batch (pass its members one at a time here)"
            )
        try:
            leaves = fn.x_treedef.flatten_up_to(dx)
        except (ValueError, TypeError) as err:
            got = pytree.tree_structure(dx)
            raise ShapeMismatchError(
                f"{what} must have the structure of x, {fn.x_treedef}, but has {got}"
            ) from err
        out = []
        for i, x in zip(fn.diff_index, xs):
            t = leaves[i]
            if not (is_array(t) or isinstance(t, (int, float))):
                raise ShapeMismatchError(
                    f"{what} leaf at position {i} must be an array of shape {shape_of(x)}, "
                    f"got {type(t).__name__}"
                )
            got_shape = shape_of(t) if is_array(t) else ()
            if got_shape != shape_of(x):
                raise ShapeMismatchError(
                    f"{what} leaf at position {i} has shape {got_shape} but x's leaf has "
                    f"shape {shape_of(x)}"
                )
            out.append(self.convert(t if is_array(t) else np.asarray(t), dtype_name(x)))
        return out

    # -------------------------------------------------------------- preparation
    def preparation(self, cls: type[Preparation], fn: FlatFunction, xs: list, data: list) -> Preparation:
        """The :class:`~abstractdiff._prepare.Preparation` of ``cls``'s operator for ``fn``
        and the signature of ``xs``/``data``, built once and cached on ``fn``."""
        # the hot path of every unprepared operator: one lookup in the common case
        key = (self.cache_key, cls, _signature_key(xs, data))
        preps = fn._preparations
        prep = preps.get(key)
        if prep is None:
            prep = preps.get_or_build(key, lambda: cls(self, fn, xs, data))
        return prep

    def prepare(
        self, operator: str, f: Callable[..., Any], x: Any, args: tuple = (), *, has_aux: bool = False,
        tangent: Any = None,
    ) -> Prepared:
        """``operator`` (``"gradient"``, ``"hvp"``...) prepared for ``f`` at inputs shaped like
        ``(x, *args)``; what ``ad.prepare_<operator>`` returns.  ``tangent`` is the ``v`` of hvp
        and gradient_and_hvp."""
        if operator not in PREPARED:
            raise InvalidArgumentError(f"unknown operator {operator!r}; known: {', '.join(sorted(PREPARED))}")
        if operator in TANGENT_OPERATORS:
            return PREPARED[operator](self, f, x, tangent, args)  # type: ignore[call-arg]
        return PREPARED[operator](self, f, x, args, has_aux)

    def _unprepared(self, cls: type[Preparation], f: Callable[..., Any], x: Any, args: tuple, extra: tuple = (),
                    has_aux: bool = False) -> Any:
        """The unprepared operator: prepare (through the plan cache) and call.

        Its first step is ``f``'s hot call, the prepared operator of the form (structure,
        dtypes, static leaves) of its last inputs, any shape: one lookup by ``f``'s identity,
        the guard's identity tests that ``f`` reads the values from its globals and closures
        that it was traced with (on backends that reuse traces; see :mod:`._captures`), and
        the prepared operator's own checks.  Anything else takes the plan cache
        (:meth:`_new_hot_call`).
        """
        operator = (cls, True) if has_aux else cls
        hot = self._plans.hot_calls.get((id(f), operator))
        if hot is None:
            return self._new_hot_call(cls, operator, f, x, args, extra, has_aux, None)
        guard, call, _ = hot
        if call is None:  # identities cannot vouch for what f reads: the plan cache on each call
            return self._prepare_and_run(cls, f, x, args, extra, has_aux)
        if guard is not None and not guard.unchanged(f):  # f reads other values: new plans, a new guard
            return self._new_hot_call(cls, operator, f, x, args, extra, has_aux, None)
        try:
            return call(x, *extra, *args) if extra else call(x, *args)
        except ShapeMismatchError:  # another form of inputs (or an error, which the plan cache raises again)
            return self._new_hot_call(cls, operator, f, x, args, extra, has_aux, guard)

    def _new_hot_call(self, cls: type[Preparation], operator: Any, f: Callable[..., Any], x: Any, args: tuple,
                      extra: tuple, has_aux: bool, guard: Any) -> Any:
        """The unprepared operator through the plan cache, which makes the prepared operator of
        these inputs ``f``'s hot call; ``guard`` is ``f``'s guard where it still holds."""
        if type(f) is not types.FunctionType:  # a bound method is a new object per access: nothing to key on
            return self._prepare_and_run(cls, f, x, args, extra, has_aux)
        if guard is None and self.reuses_traces:
            guard = capture_guard(f)  # before the plan is made: a value changed meanwhile makes it stale
            if guard is None:
                self._plans.set_hot(f, operator, None, None)
                return self._prepare_and_run(cls, f, x, args, extra, has_aux)
        fn, xs, data = self.flatten(f, x, args, has_aux)
        prep = fn._preparations.get((self.cache_key, cls, _signature_key(xs, data)))  # preparation()'s fast path
        if prep is None:
            prep = self.preparation(cls, fn, xs, data)
            if not self.reuses_traces:  # a form seen once (a new static value per call) is not worth a hot call;
                return prep.run(xs, data, *extra)  # where traces are reused, the hot call is the one compile
        call = self._unprepared_call(cls, prep, x, args, xs, data, has_aux)
        try:
            out = call(x, *extra, *args)
        except ShapeMismatchError:  # built for another form of these dtypes (or an error, raised again)
            return prep.run(xs, data, *extra)
        self._plans.set_hot(f, operator, guard, call)
        return out

    def _prepare_and_run(self, cls: type[Preparation], f: Callable[..., Any], x: Any, args: tuple, extra: tuple,
                         has_aux: bool) -> Any:
        """The unprepared operator through the plan cache alone."""
        fn, xs, data = self.flatten(f, x, args, has_aux)
        prep = fn._preparations.get((self.cache_key, cls, _signature_key(xs, data)))  # preparation()'s fast path
        if prep is None:
            prep = self.preparation(cls, fn, xs, data)
        return prep.run(xs, data, *extra)

    def _unprepared_call(self, cls: type[Preparation], prep: Preparation, x: Any, args: tuple, xs: list,
                         data: list, has_aux: bool) -> Callable[..., Any]:
        """The call of ``prep``'s prepared operator for unprepared use (built once per preparation)."""
        prepared = prep.unprepared_call
        if prepared is None:
            fn, tangent = prep.fn, cls.operator in TANGENT_OPERATORS

            def replan(x: Any, *rest: Any) -> Any:
                extra, args = (rest[:1], rest[1:]) if tangent else ((), rest)
                return self._prepare_and_run(cls, fn.f, x, args, extra, has_aux)

            prepared = PREPARED[cls.operator].for_unprepared(self, prep, x, args, xs, data, has_aux, replan)
            prep.unprepared_call = prepared
        return prepared.call

    # -------------------------------------------------------- public operators
    def value_and_gradient(
        self, f: Callable[..., Any], x: PyTree, *args: Any, has_aux: bool = False
    ) -> tuple[Any, PyTree]:
        """``(y, g)``, or ``((y, aux), g)`` with ``has_aux``; see :func:`abstractdiff.value_and_gradient`."""
        return self._unprepared(_prep.ValueAndGradientPrep, f, x, args, (), has_aux)

    def gradient(self, f: Callable[..., Any], x: PyTree, *args: Any, has_aux: bool = False) -> Any:
        """``g``, or ``(g, aux)`` with ``has_aux``; see :func:`abstractdiff.gradient`."""
        return self._unprepared(_prep.GradientPrep, f, x, args, (), has_aux)

    def value_and_pullback(self, f: Callable[..., Any], x: PyTree, *args: Any) -> tuple[Any, Callable]:
        """``(y, vjp)`` with ``vjp(dy) -> dx``; see :func:`abstractdiff.value_and_pullback`."""
        return self._unprepared(_prep.ValueAndPullbackPrep, f, x, args)

    def pullback(self, f: Callable[..., Any], x: PyTree, *args: Any) -> Callable:
        """``vjp`` with ``vjp(dy) -> dx``; see :func:`abstractdiff.pullback`."""
        return self._unprepared(_prep.PullbackPrep, f, x, args)

    def value_and_pushforward(self, f: Callable[..., Any], x: PyTree, *args: Any) -> tuple[Any, Callable]:
        """``(y, jvp)`` with ``jvp(dx) -> dy``; see :func:`abstractdiff.value_and_pushforward`."""
        return self._unprepared(_prep.ValueAndPushforwardPrep, f, x, args)

    def pushforward(self, f: Callable[..., Any], x: PyTree, *args: Any) -> Callable:
        """``jvp`` with ``jvp(dx) -> dy``; see :func:`abstractdiff.pushforward`."""
        return self._unprepared(_prep.PushforwardPrep, f, x, args)

    def derivative(self, f: Callable[..., Any], x: Any, *args: Any) -> Any:
        """``dy/dx`` for scalar ``x``, shaped like ``y``; see :func:`abstractdiff.derivative`."""
        return self._unprepared(_prep.DerivativePrep, f, x, args)

    def jacobian(self, f: Callable[..., Any], x: PyTree, *args: Any) -> PyTree:
        """Tree shaped like ``x`` of ``y.shape + leaf.shape`` arrays; see :func:`abstractdiff.jacobian`."""
        return self._unprepared(_prep.JacobianPrep, f, x, args)

    def hessian(self, f: Callable[..., Any], x: PyTree, *args: Any) -> PyTree:
        """``x.shape + x.shape`` Hessian of scalar ``f``; see :func:`abstractdiff.hessian`."""
        return self._unprepared(_prep.HessianPrep, f, x, args)

    def hvp(self, f: Callable[..., Any], x: PyTree, v: PyTree, *args: Any) -> PyTree:
        """Hessian-vector product shaped like ``x``; see :func:`abstractdiff.hvp`."""
        return self._unprepared(_prep.HvpPrep, f, x, args, (v,))

    def value_and_derivative(self, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Any]:
        """``(y, dy/dx)`` for scalar ``x``; see :func:`abstractdiff.value_and_derivative`."""
        return self._unprepared(_prep.ValueAndDerivativePrep, f, x, args)

    def second_derivative(self, f: Callable[..., Any], x: Any, *args: Any) -> Any:
        """``d2y/dx2`` for scalar ``x``, shaped like ``y``; see :func:`abstractdiff.second_derivative`."""
        return self._unprepared(_prep.SecondDerivativePrep, f, x, args)

    def value_derivative_and_second_derivative(self, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Any, Any]:
        """``(y, dy/dx, d2y/dx2)`` for scalar ``x``; see :func:`abstractdiff.value_derivative_and_second_derivative`."""
        return self._unprepared(_prep.ValueDerivativeAndSecondDerivativePrep, f, x, args)

    def value_and_jacobian(self, f: Callable[..., Any], x: PyTree, *args: Any) -> tuple[Any, PyTree]:
        """``(y, J)``; see :func:`abstractdiff.value_and_jacobian`."""
        return self._unprepared(_prep.ValueAndJacobianPrep, f, x, args)

    def value_gradient_and_hessian(self, f: Callable[..., Any], x: PyTree, *args: Any) -> tuple[Any, PyTree, PyTree]:
        """``(y, g, H)`` of scalar ``f``; see :func:`abstractdiff.value_gradient_and_hessian`."""
        return self._unprepared(_prep.ValueGradientAndHessianPrep, f, x, args)

    def gradient_and_hvp(self, f: Callable[..., Any], x: PyTree, v: PyTree, *args: Any) -> tuple[PyTree, PyTree]:
        """``(g, H @ v)``, both shaped like ``x``; see :func:`abstractdiff.gradient_and_hvp`."""
        return self._unprepared(_prep.GradientAndHvpPrep, f, x, args, (v,))


#: The core's public operator functions and methods, for adapters of libraries that
#: rewrite the code they call (TensorFlow's autograph marks them to be left alone).
OPERATOR_METHODS = (*OPERATORS, "_unprepared", "asarray", "convert")


# ---------------------------------------------------------------------------------------
# The backend holding an adapter (abstractdiff.protocol.Adapter)
#: The array, device and pytree hooks the holder takes from its adapter as they are (the
#: devices group's normalise_device is the core's parser, not the adapter's).
_ADAPTER_HOOKS = (*HOOKS["arrays"], "devices", *HOOKS["pytrees"])
#: Variable hooks: the adapter's ``variables`` object's, where it has one.
_VARIABLE_HOOKS = HOOKS["variables"]


def _run_prepared(prepare: Callable[..., Any]) -> Callable[..., Any]:
    def per_call(fn: Any, xs: list, data: list, *extra: Any) -> Any:
        return prepare(fn, xs, data)(xs, data, *extra)

    return per_call


def _overrides(adapter: Any, method: str) -> bool:
    return getattr(type(adapter), method) is not getattr(Adapter, method)


class AdapterBackend(Backend):
    """The core's backend holding an adapter: what ``ad.backend(name)`` returns for an adapter
    of the protocol (:class:`abstractdiff.protocol.Adapter`).

    ``AdapterBackend(adapter_class, *, device=None, chunk_size=None, **options)``: the core
    parses ``device`` against the adapter's ``devices()``, keeps ``chunk_size`` itself, and
    makes the adapter with the canonical device and the remaining (the adapter's own) options.
    Everything else is the core's: the operators are derived from the adapter's primitives,
    except where its ``fast_routes`` name a faster method.  Attributes the core does not
    define are read from the adapter (``b.trace_count``), so code written for the adapter
    classes that subclassed ``ad.Backend`` keeps working.
    """

    def __init__(self, adapter_class: type, *, device: str | None = None, chunk_size: int | None = None,
                 **options: Any):
        probe = adapter_class.__new__(adapter_class)  # devices() before the adapter exists: its class's
        canonical = parse_device(device, probe.devices(), adapter_class.name)
        self.adapter = adapter = adapter_class(device=canonical, **options)
        for trait in ("name", "extra", "modules", "approximate", "reuses_traces"):
            setattr(self, trait, getattr(adapter, trait))  # of the instance: one may follow an option
        adapter.backend = self  # the core's services the adapter calls (complete, artefacts' keys)
        for hook in _ADAPTER_HOOKS:
            setattr(self, hook, getattr(adapter, hook))
        self.loops = getattr(adapter, "loops", None)  # the loop hooks object (ad.scan...), set by the adapter
        self.compiler = getattr(adapter, "compiler", None)  # compiles a function of arrays (whole train steps)
        if adapter.variables is not None:
            for hook in _VARIABLE_HOOKS:
                if hasattr(adapter.variables, hook):
                    setattr(self, hook, getattr(adapter.variables, hook))
        for primitive in PRIMITIVES:
            if _overrides(adapter, primitive):
                setattr(self, f"flat_{primitive}", getattr(adapter, primitive))
        for hook in ("custom_function", "custom_rule"):
            if _overrides(adapter, hook):
                setattr(self, hook, getattr(adapter, hook))
        if _overrides(adapter, "direct_prepared"):
            self.direct_prepared = adapter.direct_prepared  # type: ignore[method-assign]
        # the adapter's options as it keeps them (its defaults included): two backends of one
        # adapter with the same settings are equal and share compiled artefacts
        own = {k: v for k, v in adapter.options.items() if k != "device"}
        super().__init__(device=canonical, chunk_size=chunk_size, **own)
        for operator, method in adapter.fast_routes.items():
            if operator not in FAST_ROUTES:
                raise InvalidArgumentError(
                    f"{adapter_class.__name__}.fast_routes names {operator!r}, which has no fast route; "
                    f"operators with one: {', '.join(FAST_ROUTES)}"
                )
            if self.chunk_size is not None and operator in JACOBIAN_ROUTES:
                continue  # the core's chunks of batched primitive calls
            setattr(self, f"flat_{operator}", getattr(adapter, method))
        # DI's pair: a route given only in its prepare form serves the per-call form too
        # (prepare, then run), so an adapter writes each route once
        for operator, per_call in PER_CALL_ROUTES.items():
            if operator in adapter.fast_routes and per_call not in adapter.fast_routes:
                setattr(self, f"flat_{per_call}", _run_prepared(getattr(adapter, adapter.fast_routes[operator])))

    def normalise_device(self, device: str | None) -> str:
        return parse_device(device, self.devices(), self.name)

    def __getattr__(self, name: str) -> Any:
        # only reached for names the backend does not have: the adapter's own attributes
        adapter = self.__dict__.get("adapter")
        if adapter is None or name.startswith("__"):  # not yet made (inside __init__), or a dunder
            raise AttributeError(name)
        return getattr(adapter, name)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"backend({self.name!r}, {opts})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, AdapterBackend) and type(other.adapter) is type(self.adapter)
                and other.options == self.options)

    def __hash__(self) -> int:
        return hash(self.cache_key)

    def _cache_class(self) -> type:
        return type(self.adapter)  # one backend class for every library: the adapter says which

    @property
    def has_reverse(self) -> bool:
        return _overrides(self.adapter, PRIMITIVES[0])  # value_and_pullback

    @property
    def has_forward(self) -> bool:
        return _overrides(self.adapter, PRIMITIVES[1])  # value_and_pushforward

    @property
    def has_custom_function(self) -> bool:
        return _overrides(self.adapter, "custom_function")

    @property
    def has_custom_rule(self) -> bool:
        return _overrides(self.adapter, "custom_rule")

    @property
    def has_implicit_route(self) -> bool:
        variables = self.adapter.variables
        return variables is not None and hasattr(variables, "implicit_value_and_gradient")


hold_adapters_in(AdapterBackend)

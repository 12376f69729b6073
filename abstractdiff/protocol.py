"""The adapter protocol: what one AD library tells the core, and nothing else.

DifferentiationInterface.jl's design: a backend is the core's object and *holds* an
adapter (``ad.backend("autograd")`` is an :class:`abstractdiff.Backend` holding an
``AutogradAdapter``); the core derives every operator from the adapter's primitives and
owns chunking, caching, preparation, pytrees and checks.  An adapter states facts about its
library:

* who it is: :attr:`Adapter.name`, :attr:`~Adapter.extra`, :attr:`~Adapter.modules`,
  :attr:`~Adapter.approximate`, :attr:`~Adapter.reuses_traces`;
* its primitives, on flat leaf lists (``docs/guide/adapters.md``): :meth:`~Adapter.value_and_pullback`
  and/or :meth:`~Adapter.value_and_pushforward`, and optionally their batched forms, which
  take a batch of cotangents or tangents at once, so that the core's chunks cost one call each;
* its fast routes, one mapping (:attr:`~Adapter.fast_routes`) from an operator to the name of
  a method with the signature of the core's own derivation of it, for the operators its
  library does faster (DI's ``prepare_X``/``X(prep)`` pairs); an adapter listing none gets
  every operator derived, and correct;
* its arrays (conversions), its devices, its pytree registry, and optionally the
  custom-derivative hook (:meth:`~Adapter.custom_function`), a compile step
  (:meth:`~Adapter.direct_prepared`) and variable hooks (:attr:`~Adapter.variables`, for
  libraries with mutable state);
* optionally its loop primitives: an adapter sets ``self.loops`` to an object with
  ``fori_loop(lower, upper, body, init)``, ``scan(f, init, xs, length)`` and
  ``while_loop(cond, body, init)`` on flat leaf lists (``ad.fori_loop`` and friends run on
  them, traced once; a hook may return ``NotImplemented`` for the core's Python loop).  It is
  an instance attribute, not one of this class's names, which are at their limit;
* optionally its compiler: ``self.compiler(fn, assigns_variables=False) -> run | None``
  (``jax.jit``, ``tf.function``, ``mx.compile``) compiles a function of lists of native
  arrays; an instance attribute too.  ``ad.train_step`` runs gradient, optimiser rule and
  finite check through it as one compiled call (:mod:`abstractdiff._compiled_step`), and a
  prepared ``ad.Sparse`` operator its products and decompression (:mod:`abstractdiff._sparse`).

Every default is numpy's, so an adapter writes only where its library differs.  This
module imports no other module of abstractdiff.  Adapters written against the older design,
subclasses of ``ad.Backend`` overriding its hooks, keep working (the adapter guide's
migration note).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Sequence

import numpy as np

__all__ = ["Adapter", "FAST_ROUTES", "FlatFn", "JACOBIAN_ROUTES", "PER_CALL_ROUTES", "PRIMITIVES"]

#: ``fn(xs, data) -> (y, aux)``: the user's function on flat leaf lists (``xs`` differentiated).
FlatFn = Callable[[list, list], tuple]

#: The primitives, the core's derivations' only need: reverse and forward mode, then their
#: batched forms (optional: without them the core loops over the primitive).
PRIMITIVES = ("value_and_pullback", "value_and_pushforward", "value_and_batched_pullback",
              "value_and_batched_pushforward")

#: The operators an adapter may give a fast route, with the signature its method must have
#: (the core's derivation of the same operator, which it replaces).  The ``prepare_`` forms
#: return a ``run`` closure the core calls once per call; the others are called per call.
FAST_ROUTES: dict[str, str] = {
    "prepare_value_and_gradient": "(fn, xs, data) -> run(xs, data) -> (y, aux, grads)",
    "prepare_jacobian": "(fn, xs, data) -> run(xs, data) -> jacobians",
    "prepare_hvp": "(fn, xs, data) -> run(xs, data, tangents) -> hvps",
    "value_and_gradient": "(fn, xs, data) -> (y, aux, grads)",
    "jacobian": "(fn, xs, data) -> (y, jacobians)",
    "hessian": "(fn, [x], data) -> H",
    "hvp": "(fn, xs, data, tangents) -> hvps",
    "hessian_blocks": "(fn, xs, data) -> [[H_ij]]",
    "value_gradient_and_hessian": "(fn, xs, data) -> (y, grads, [[H_ij]])",
    "gradient_and_hvp": "(fn, xs, data, tangents) -> (grads, hvps)",
    "value_and_derivative": "(fn, [x], data) -> (y, dy/dx)",
    "second_derivative": "(fn, [x], data) -> d2y/dx2",
    "value_derivative_and_second_derivative": "(fn, [x], data) -> (y, dy/dx, d2y/dx2)",
}

#: The fast routes that build a whole Jacobian: the core takes them only when the backend's
#: ``chunk_size`` is None (chunking is the core's, in batched primitive calls).
JACOBIAN_ROUTES = frozenset({
    "prepare_jacobian", "jacobian", "hessian", "hessian_blocks", "value_gradient_and_hessian",
})

#: The prepare-form routes whose ``run`` has the per-call route's signature: an adapter listing
#: only the prepare form gets the per-call one too (prepare, then run), so it writes the
#: route once (``prepare_jacobian``'s run leaves out the value, so ``jacobian`` is not derived).
PER_CALL_ROUTES: dict[str, str] = {"prepare_value_and_gradient": "value_and_gradient", "prepare_hvp": "hvp"}


class Adapter:
    """One AD library, as the core sees it: the base class of every built-in adapter.

    ``Adapter(*, device="cpu", **options)``: ``device`` is the canonical name the core chose
    from :meth:`devices` (``"cpu"``, ``"cuda:0"``); ``options`` are the adapter's own (such as
    ``compile``), kept in :attr:`options`.  The core's options (``chunk_size``) are not
    passed: the backend holding the adapter owns them.  A subclass overrides ``__init__`` to
    check its options (raise ``ad.ArgumentTypeError`` for an unknown one) and calls
    ``super().__init__``.
    """

    #: Registry name ("torch", "jax"...).
    name: ClassVar[str] = "adapter"
    #: The pip extra that installs the library, for error messages.
    extra: ClassVar[str | None] = None
    #: Top-level modules whose arrays, variables and models this adapter handles.
    modules: ClassVar[tuple[str, ...]] = ()
    #: Whether derivatives are approximations: one bool, or one per order from the first.
    approximate: ClassVar[bool | tuple[bool, ...]] = False
    #: Whether the library traces ``f`` once and reuses the trace (``jit``): the core then
    #: keys its plans on the values ``f`` reads by closure or global.
    reuses_traces: ClassVar[bool] = False
    #: Operator -> name of the method that computes it faster than the core's derivation
    #: (signatures in :data:`FAST_ROUTES`).  Jacobian-building routes are taken only when the
    #: backend's ``chunk_size`` is None: chunking is the core's.
    fast_routes: ClassVar[Mapping[str, str]] = {}
    #: The variable hooks of a library with mutable variables (an object with the methods of
    #: the adapter guide's "Variables" table), or None: ``ad.Variable`` boxes.
    variables: Any = None
    #: The core's backend holding this adapter, set by it: the core services an adapter calls
    #: (``backend.complete``, the key of ``fn.artefacts(backend, ...)``, the core's derivations).
    backend: Any = None

    def __init__(self, *, device: str = "cpu", **options: Any):
        self.device = device
        self.options = options

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in {"device": self.device, **self.options}.items())
        return f"{type(self).__name__}({opts})"

    # ------------------------------------------------------------- primitives
    def value_and_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable[[Any], list]]:
        """Reverse mode: ``(y, aux, vjp)`` with ``vjp(dy) -> list of dx`` (``None``: zeros)."""
        raise NotImplementedError

    def value_and_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable[[list], Any]]:
        """Forward mode: ``(y, aux, jvp)`` with ``jvp(list of dx) -> dy``."""
        raise NotImplementedError

    def value_and_batched_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """Optional: ``(y, aux, vjps)`` with ``vjps(dys)`` for a stack of cotangents (leading
        axis), returning stacked ``dx``; without it the core loops over the primitive."""
        raise NotImplementedError

    def value_and_batched_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """Optional: ``(y, aux, jvps)`` with ``jvps(list of stacked dx)`` -> stacked ``dy``."""
        raise NotImplementedError

    # ----------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        """Whether ``a`` is this library's array type (traced values included)."""
        return isinstance(a, np.ndarray)

    def from_numpy(self, a: np.ndarray) -> Any:
        """A numpy array as a native array on ``self.device``, dtype unchanged."""
        return a

    def to_numpy(self, a: Any) -> np.ndarray:
        """A native array (or variable) as numpy, outside any autodiff graph."""
        return np.asarray(a)

    def cast(self, a: Any, dtype: str) -> Any:
        """Native ``a`` in dtype ``dtype`` (a name such as ``"float32"``)."""
        import autoray

        return autoray.do("astype", a, dtype)

    def zeros_like(self, a: Any) -> Any:
        import autoray

        return autoray.do("zeros_like", a)

    def ones_like(self, a: Any) -> Any:
        import autoray

        return autoray.do("ones_like", a)

    def asarray_like(self, a: np.ndarray, like: Any) -> Any:
        """Numpy ``a`` on the device of native ``like`` (checkpoints restore through it)."""
        return self.from_numpy(a)

    def snapshot(self, a: Any) -> Any:
        """``a`` safe from later in-place writes to the caller's memory (immutable arrays: itself)."""
        return a.copy() if isinstance(a, np.ndarray) else a

    def scope(self, arrays: Sequence[Any]) -> ContextManager[Any]:
        """A context for arithmetic on ``arrays`` outside the operators (jax's x64 mode)."""
        return contextlib.nullcontext()

    def from_dlpack(self, a: Any) -> Any:
        """``a`` (numpy, or any array exporting ``__dlpack__``) as a native array, sharing its
        memory where the library imports it by DLPack (how a composed kernel receives input)."""
        if not isinstance(a, np.ndarray):
            try:
                a = np.from_dlpack(a)
            except (AttributeError, BufferError, RuntimeError, TypeError):
                a = np.asarray(a)
        return self.from_numpy(a)

    def numpy_view(self, a: Any) -> np.ndarray:
        """Native ``a`` as numpy sharing its memory where the library allows it."""
        return self.to_numpy(a)

    # ---------------------------------------------------------------- devices
    def devices(self) -> list[str]:
        """The devices present here in canonical names, ``"cpu"`` first (``"cuda:N"``...)."""
        return ["cpu"]

    # ---------------------------------------------------------------- pytrees
    def pytree_node(self, obj: Any) -> tuple[Callable[[Any], tuple], Callable[[Any, Any], Any]] | None:
        """``(flatten, unflatten)`` when ``obj``'s class is a container of the library's own pytree
        registry (a class registered with ``jax.tree_util``, ``torch.utils._pytree``), else ``None``.

        In optree's convention: ``flatten(obj) -> (children, metadata)`` one level down, and
        ``unflatten(metadata, children) -> obj``; ``metadata`` hashable and compared by value.
        The core registers the class in its own registry the first time it meets one, only
        when the library is already imported (:mod:`abstractdiff._pytree`), and flattens it so
        everywhere: ``x``, arguments, aux, gradients, optimiser state, checkpoints.  A child
        that must stay static data however it looks (a float that the library's own gradient
        leaves alone) is returned boxed in :class:`abstractdiff._pytree.Static`.
        """
        return None

    # --------------------------------------------------- custom derivatives
    def custom_function(
        self,
        value: Callable[..., np.ndarray],
        vjps: Sequence[Callable[..., Any]],
        jvps: Sequence[Callable[..., Any]],
        out: tuple[int, str],
    ) -> Callable[..., Any]:
        """The custom-derivative hook: a function of 1-D arrays of this library whose value is
        ``value`` and whose derivatives are the rules given, through the library's own mechanism
        (``torch.autograd.Function``, ``jax.custom_jvp``, ``tf.custom_gradient``, autograd's
        ``primitive``, ``mx.custom_function``, paddle's ``PyLayer``, a PyTensor ``Op``).

        * ``value(*inputs)`` takes the inputs' values as 1-D numpy arrays and returns a 1-D
          numpy array of ``out = (size, dtype)``: it runs outside the library (a callback
          where the library traces);
        * ``vjps[i](cotangent, *inputs)`` is the cotangent of ``inputs[i]`` and
          ``jvps[i](tangent, *inputs)`` the output's tangent along ``inputs[i]``'s tangent:
          they take and return this library's arrays and call other custom functions, so
          the library differentiates them in turn.  A rule may raise
          :class:`~abstractdiff.CompositionError` (a derivative the caller does not carry).

        Where the mechanism cannot carry a rule (reverse mode only, or no derivative of a rule
        with respect to a primal input), the function must raise
        :class:`~abstractdiff.CompositionError` (:func:`abstractdiff._compose.boundary_error`)
        when that derivative is asked for, never give a silently zero one.  The core builds
        :func:`abstractdiff.differentiate_with`'s value, pullback, pushforward and second
        derivatives on this hook (:func:`abstractdiff._compose.boundary`).
        """
        raise NotImplementedError

    def custom_rule(self, rule: Any) -> Callable[..., tuple]:
        """The hook of ``ad.custom_vjp`` and ``ad.custom_jvp``: ``h(*inputs) -> outputs``, a
        function of this library's arrays (traced ones included) whose derivatives are
        ``rule``'s (an :class:`abstractdiff._custom.Rule`), through the library's own
        mechanism.  The core has flattened the user's pytrees: ``inputs`` and the outputs
        are tuples of float arrays, and the rule checks what the user's rules return.

        * ``rule.value(*inputs) -> outputs`` and ``rule.forward(*inputs) -> (outputs,
          residuals)`` give the value (``residuals`` is opaque: keep it for the backward);
        * ``rule.backward(residuals, cotangents) -> input cotangents`` (``rule.has_vjp``) and
          ``rule.jvp(primals, tangents) -> (outputs, output tangents)`` (``rule.has_jvp``)
          take complete tuples: pass zeros for a missing cotangent or tangent, never None.

        The reverse mode must be ``rule.backward`` and the forward mode ``rule.jvp`` (or the
        library's forward mode built from the backward, where it builds it so); a mode the
        rule lacks raises ``rule.no_vjp_error()`` or ``rule.no_jvp_error()`` when asked for,
        never the derivative of ``rule.value``.  A second derivative must differentiate the
        backward with its residuals' dependence on the inputs recorded (recompute
        ``rule.forward`` with recording on, where the library's forward does not record),
        or raise ``rule.second_order_error(library)``: never a silently zero one.

        An adapter whose library cannot take a derivative inside its backward sets
        ``rule.nested_derivatives = False`` (before running the rule): the core's implicit
        differentiation then takes its derivatives in the forward instead.  Likewise
        ``rule.lazy_forward = True`` where the library runs ``fwd`` only under differentiation
        and differentiates ``fwd`` itself for a higher order (jax), and
        ``rule.derivatives_in_jvp = False`` where the library hides its differentiation from
        a jvp rule (tensorflow): the core then refuses forward mode through rules that take
        derivatives in their jvp.  ``rule.takes_derivatives`` (read only) is True for a rule
        whose functions call the operators (``ad.custom_root``'s): a library that cannot build
        that into a compiled loop's body runs such a loop in Python.  ``rule.with_inputs(inputs)``
        is the rule for a node its library rebuilt on other inputs (PyTensor's graph_replace).
        ``rule.stops_gradient`` marks ``ad.stop_gradient``'s rule (the identity, with zero
        derivatives): an adapter may return the library's own operation for it instead
        (``lax.stop_gradient``, ``detach``), applied to each input.
        """
        raise NotImplementedError

    # ----------------------------------------------------------------- compile
    def direct_prepared(self, prepared: Any, xs: list, data: list) -> Callable[..., Any] | None:
        """Optional compile step: a prepared operator's whole call compiled by the library, or None."""
        return None

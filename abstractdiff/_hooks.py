"""What an adapter implements: traits, primitives and hooks, each with a default.

This class is the whole contract between the core and one AD library.  Every fact about
a library (how to recognise its arrays and variables, convert them, read and write a
variable, scope its precision, which of its routes is fastest) is one of these methods,
so the core never names a library: it finds the backend of an array or variable
through the registry (:func:`abstractdiff._registry.backend_for`) and calls its hooks.
The defaults work for numpy arrays; an adapter overrides what its library does
differently.  The operators users call are in :class:`abstractdiff.Backend`, derived
from the primitives here by :class:`abstractdiff._derived.DerivedOperators`.

The list of hooks is :data:`HOOKS` (``docs/guide/adapters.md`` documents each one and
a test keeps the two in step).
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Callable, ClassVar, ContextManager, Sequence

import numpy as np

from ._arrays import ar, dtype_name
from ._errors import DeviceError, InvalidArgumentError, NonDifferentiableInputError
from ._tree import PlanCache, is_float_dtype

__all__ = ["DEFAULT_CHUNK_SIZE", "HOOKS", "AdapterHooks"]

#: Basis vectors per batched call of a derived Jacobian when a backend's ``chunk_size``
#: is ``None``: a Jacobian with up to this many rows (reverse) or columns (forward) is one
#: batched call; a larger one is split into ``ceil(n / 64)`` calls of equal size.
DEFAULT_CHUNK_SIZE = 64

FlatFn = Callable[[list, list], tuple]

#: Every hook an adapter may implement, by group, in the order the adapter guide lists them.
HOOKS: dict[str, tuple[str, ...]] = {
    "traits": ("name", "extra", "modules", "approximate", "implicit", "reuses_traces"),
    "primitives": ("flat_value_and_pullback", "flat_value_and_pushforward"),
    "fast routes": (
        "flat_value_and_gradient",
        "flat_prepare_value_and_gradient",
        "direct_prepared",
        "flat_jacobian",
        "flat_prepare_jacobian",
        "flat_hessian",
        "flat_hvp",
        "flat_prepare_hvp",
        "flat_value_and_derivative",
        "flat_second_derivative",
        "flat_value_derivative_and_second_derivative",
        "flat_hessian_blocks",
        "flat_value_gradient_and_hessian",
        "flat_gradient_and_hvp",
        "flat_value_and_batched_pushforward",
        "flat_value_and_batched_pullback",
    ),
    "arrays": (
        "is_native", "from_numpy", "to_numpy", "cast", "zeros_like", "ones_like", "asarray_like", "snapshot", "scope",
        "from_dlpack", "numpy_view",
    ),
    "devices": ("devices", "normalise_device"),
    "pytrees": ("is_pytree_node",),
    "variables": (
        "is_variable",
        "check_variable",
        "model_variables",
        "model_state",
        "read",
        "write",
        "current_value",
        "new_variable",
        "swap",
        "aliases",
        "implicit_value_and_gradient",
        "implicit_value_and_pullback",
    ),
    "composition": ("foreign_function",),
}


class AdapterHooks:
    """The adapter side of a backend: traits, the two primitives, and the hooks.

    ``AdapterHooks(*, device=None, chunk_size=None, **options)``: ``device`` is normalised
    by :meth:`normalise_device`; ``chunk_size`` (an option of every backend, checked here)
    is how many basis vectors a derived Jacobian pushes or pulls in one batched call
    (``None``: up to :data:`DEFAULT_CHUNK_SIZE`); ``options`` (the adapter's own, such as
    ``compile``) are kept in ``self.options`` and make two backends of one class equal
    when they match.
    """

    # ------------------------------------------------------------------ traits
    #: Registry name of the backend ("torch", "jax", ...).
    name: ClassVar[str] = "backend"
    #: The pip extra that installs the backend's library, for error messages.
    extra: ClassVar[str | None] = None
    #: Top-level modules whose arrays, variables and models this backend handles
    #: (``("torch",)``): how the core finds the backend of a leaf without importing anything.
    modules: ClassVar[tuple[str, ...]] = ()
    #: Whether derivatives are approximated (finite differences) rather than exact.
    approximate: ClassVar[bool] = False
    #: Whether the backend differentiates ``ad.Params`` (implicit mode) rather than arrays.
    implicit: ClassVar[bool] = False
    #: Whether the backend traces ``f`` once and reuses the trace (``jit``, ``tf.function``):
    #: values ``f`` reads by closure or global are then frozen into the trace, so the core
    #: keys its plans on them too (a property where it depends on an option such as ``compile``).
    reuses_traces: ClassVar[bool] = False
    #: Basis vectors per batched call of a derived Jacobian (``None``: up to
    #: :data:`DEFAULT_CHUNK_SIZE`); set by the ``chunk_size`` option.
    chunk_size: int | None = None

    def __init__(self, *, device: str | None = None, chunk_size: int | None = None, **options: Any):
        if chunk_size is not None:
            if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
                raise InvalidArgumentError(
                    f"chunk_size must be a positive int (basis vectors per batched call of a Jacobian) "
                    f"or None for the default, got {chunk_size!r}"
                )
            self.chunk_size = options["chunk_size"] = int(chunk_size)
        self.device = self.normalise_device(device)
        self.options: dict[str, Any] = {"device": self.device, **options}
        self._plans = PlanCache()

    # ---------------------------------------------------------------- identity
    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options == self.options  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.cache_key)

    @property
    def cache_key(self) -> tuple:
        """``(class, options)``: what a compiled artefact of this backend depends on."""
        key = self.__dict__.get("_cache_key")
        if key is None:
            key = (type(self), tuple(sorted((k, type(v).__name__, repr(v)) for k, v in self.options.items())))
            self.__dict__["_cache_key"] = key
        return key

    # ------------------------------------------------------------- primitives
    def flat_value_and_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """Reverse mode: ``(y, aux, vjp)`` with ``vjp(dy) -> list of dx`` (``None``: zeros).

        ``fn(xs, data) -> (y, aux)``: ``xs`` are the differentiated float leaves, ``data``
        every other array, passed through untouched.
        """
        raise NotImplementedError(f"{self.name} backend has no reverse mode")

    def flat_value_and_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """Forward mode: ``(y, aux, jvp)`` with ``jvp(list of dx) -> dy``."""
        raise NotImplementedError(f"{self.name} backend has no forward mode")

    @property
    def has_reverse(self) -> bool:
        return type(self).flat_value_and_pullback is not AdapterHooks.flat_value_and_pullback

    @property
    def has_forward(self) -> bool:
        return type(self).flat_value_and_pushforward is not AdapterHooks.flat_value_and_pushforward

    # ---------------------------------------------------------------- devices
    def devices(self) -> list[str]:
        """Names of the devices this backend can run on here (``"cpu"`` first)."""
        return ["cpu"]

    def normalise_device(self, device: str | None) -> str:
        """Map a user spelling (``None``, ``"gpu"``, ``"cuda"``...) to a name from :meth:`devices`."""
        if device is None:
            return "cpu"
        name = str(device).lower()
        available = self.devices()
        if name in available:
            return name
        raise DeviceError(
            f"{self.name} backend: device {device!r} is not available here; available "
            f"devices: {', '.join(available)}"
        )

    # ----------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        """Whether ``a`` is already this backend's array type (traced values included)."""
        return isinstance(a, np.ndarray)

    def from_numpy(self, a: np.ndarray) -> Any:
        """A numpy array as a native array on ``self.device``, dtype unchanged."""
        return a

    def to_numpy(self, a: Any) -> np.ndarray:
        """A native array (or variable) as a numpy array, outside any autodiff graph."""
        return np.asarray(a)

    def from_dlpack(self, a: Any) -> Any:
        """``a`` (a numpy array, or another library's array exporting ``__dlpack__``) as a
        native array, dtype unchanged, sharing ``a``'s memory where the library imports it
        by DLPack on ``self.device``, and a copy otherwise (read-only or misaligned memory).

        How a kernel of :func:`abstractdiff.differentiate_with` receives its input.  The
        array is used before the call returns: no :meth:`snapshot` is needed.
        """
        if not isinstance(a, np.ndarray):
            try:
                a = np.from_dlpack(a)
            except (AttributeError, BufferError, RuntimeError, TypeError):
                a = np.asarray(a)
        return self.from_numpy(a)

    def numpy_view(self, a: Any) -> np.ndarray:
        """A native array as numpy sharing its memory where the library allows it (on the
        CPU), read-only where the library's arrays are immutable; a copy otherwise.

        How a kernel of :func:`abstractdiff.differentiate_with` hands its output back.
        """
        return self.to_numpy(a)

    def cast(self, a: Any, dtype: str) -> Any:
        """Native array ``a`` converted to dtype ``dtype`` (a name such as ``"float32"``)."""
        return ar().do("astype", a, dtype)

    def zeros_like(self, a: Any) -> Any:
        return ar().do("zeros_like", a)

    def ones_like(self, a: Any) -> Any:
        return ar().do("ones_like", a)

    def asarray_like(self, a: np.ndarray, like: Any) -> Any:
        """Numpy ``a`` as an array of this library on the device of ``like`` (checkpoints)."""
        return self.from_numpy(a)

    def snapshot(self, a: Any) -> Any:
        """``a`` as it is now, safe from later in-place changes to the caller's memory.

        A pullback or pushforward is a function of the point it was made at; it may run
        long after the call, when the caller has written into the array it passed (and
        numpy inputs often share memory with the native arrays made from them).  Immutable
        arrays (jax, TensorFlow) return themselves; mutable ones a copy (torch's ``clone``
        keeps the autodiff graph of nested use).
        """
        return a.copy() if isinstance(a, np.ndarray) else a

    def scope(self, arrays: Sequence[Any]) -> ContextManager[Any]:
        """A context for arithmetic on ``arrays`` outside the operators (the optimisers).

        jax needs its scoped x64 mode there, or float64 arrays silently become float32.
        """
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- pytrees
    def is_pytree_node(self, obj: Any) -> bool:
        """Whether ``obj`` is a container in the library's own pytree registry (jax.tree_util),
        which abstractdiff does not flatten: the core then refuses it rather than treating its
        arrays as static data (register such classes with ``ad.register_pytree_node``)."""
        return False

    # -------------------------------------------------- variables (implicit mode)
    def is_variable(self, v: Any) -> bool:
        """Whether ``v`` is one of this library's mutable variables (``ad.Params`` may hold it)."""
        return False

    def check_variable(self, v: Any, where: str) -> None:
        """Raise a clear error if variable ``v`` cannot be a parameter (``where`` names it)."""
        if not is_float_dtype(v.dtype):
            raise NonDifferentiableInputError(
                f"{where} is a variable of dtype {dtype_name(v)}; only float variables can be parameters"
            )

    def model_variables(self, obj: Any) -> tuple[list[Any], int] | None:
        """``(trainable variables, number of frozen ones)`` of a model of this library, or ``None``."""
        return None

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        """Every variable a checkpoint saves of a model (frozen ones and buffers too), with names."""
        return None

    def read(self, var: Any) -> Any:
        """The current value of a variable, as a native array outside any autodiff graph."""
        return var.value

    def write(self, var: Any, value: Any) -> None:
        """Assign native array ``value`` to a variable in place (same shape and dtype)."""
        var.value = value

    def current_value(self, var: Any) -> Any:
        """The value ``f`` should compute with, read so that differentiation sees the read."""
        return var.value

    def new_variable(self, value: Any) -> Any:
        """A fresh variable holding a copy of native array ``value`` (``ad.variables``)."""
        from ._implicit import Variable

        return Variable(value.copy() if isinstance(value, np.ndarray) else value)

    def swap(self, var: Any, value: Any) -> Any:
        """Set the variable to ``value`` (a traced value) without checks; return the old value.

        The core's implicit route uses it: it swaps traced values in, calls ``f``, and
        swaps the old values back whatever happens.
        """
        raise NotImplementedError(f"{self.name} backend cannot swap traced values into its variables")

    def aliases(self, var: Any) -> tuple[Any, ...]:
        """Other objects that stand for ``var`` in ``ad.Grads`` lookups (a Keras variable's tf.Variable)."""
        return ()

    def implicit_value_and_gradient(
        self, f: Callable[..., Any], variables: list[Any], args: tuple, has_aux: bool
    ) -> tuple[Any, Any, list[Any]]:
        """A native implicit route: ``(y, aux, grads)`` of ``f(*args)`` for the library's variables.

        Optional: without it, ``ad.Implicit`` swaps traced values into the variables
        (:meth:`swap`) and differentiates explicitly.
        """
        raise NotImplementedError

    def implicit_value_and_pullback(
        self, f: Callable[..., Any], variables: list[Any], args: tuple
    ) -> tuple[Any, Callable[[Any], list[Any]]]:
        """A native implicit route: ``(y, vjp)`` with ``vjp(dy) -> [gradient per variable]``."""
        raise NotImplementedError

    @property
    def has_implicit_route(self) -> bool:
        return type(self).implicit_value_and_gradient is not AdapterHooks.implicit_value_and_gradient

    # ------------------------------------------------------------- composition
    def foreign_function(self, kernel: Any) -> Callable[[Any], Any]:
        """``kernel`` (an :class:`abstractdiff._compose.ForeignKernel`: another library's
        function of one flat vector) as a function of one flat array of this library that
        this library can differentiate: its value is ``kernel.value``, its pullback
        ``kernel.vjp`` and (where this library has forward mode) its pushforward
        ``kernel.jvp``, each on numpy vectors, wired in through the library's own
        custom-derivative mechanism (``torch.autograd.Function``, ``jax.custom_jvp``...).
        What :func:`abstractdiff.differentiate_with` calls when this library's code calls
        a kernel written for another.  Where the mechanism can carry them, the pullback and
        pushforward are differentiable in turn with ``kernel.second_vjp`` and
        ``kernel.second_jvp``; any derivative not carried must raise
        :class:`~abstractdiff.CompositionError`, never come out silently zero.
        """
        from ._errors import CompositionError

        raise CompositionError(
            f"the {self.name} backend cannot call a function differentiated by another library: its "
            f"adapter does not implement the foreign_function hook (see the adapter guide)"
        )

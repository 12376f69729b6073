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

import numbers
import re
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from . import portable
from ._arrays import dtype_name
from ._errors import DeviceError, InvalidArgumentError, NonDifferentiableInputError
from ._tree import PlanCache, is_float_dtype
from .protocol import FAST_ROUTES, PRIMITIVES, Adapter

__all__ = ["DEFAULT_CHUNK_SIZE", "HOOKS", "AdapterHooks", "approximates", "checked_chunk_size", "parse_device"]

#: Basis vectors per batched call of a derived Jacobian when a backend's ``chunk_size``
#: is ``None``: a Jacobian with up to this many rows (reverse) or columns (forward) is one
#: batched call; a larger one is split into ``ceil(n / 64)`` calls of equal size.
DEFAULT_CHUNK_SIZE = 64

FlatFn = Callable[[list, list], tuple]

#: A device as users spell it: ``cpu``, ``gpu``, ``cuda:1``, TensorFlow's ``/GPU:0`` and
#: ``/device:GPU:0``, ``metal``, ``mps``, ``tpu:0`` (case and surrounding blanks ignored).
_DEVICE_SPELLING = re.compile(r"^(?:/(?:device:)?)?(cpu|gpu|cuda|mps|metal|tpu)(?::(\d+))?$")
#: Kinds a spelling names -> the canonical kinds it may stand for, in order of preference.
_GPU_KINDS = {"gpu": ("cuda", "mps"), "cuda": ("cuda",), "mps": ("mps",), "metal": ("mps",), "tpu": ("tpu",)}


def parse_device(device: Any, available: Sequence[str], backend: str = "backend") -> str:
    """``device`` as one of the canonical names in ``available`` (``"cpu"``, ``"cuda:N"``...).

    ``None`` is ``"cpu"``; ``"gpu"``, ``"cuda"`` and ``"cuda:N"``, ``"gpu:N"``, ``"/GPU:N"``
    name an NVIDIA GPU (``"gpu"`` is Apple's Metal GPU, ``"mps:0"``, where that is the GPU
    there is); an index defaults to 0.  A name that is not available raises
    :class:`~abstractdiff.DeviceError` listing those that are.
    """
    if device is None:
        return "cpu"
    spelling = str(device).strip().lower()
    match = _DEVICE_SPELLING.match(spelling)
    name = None
    if match is not None:
        kind, index = match.group(1), int(match.group(2) or 0)
        if kind == "cpu":
            name = "cpu" if index == 0 else None
        else:
            name = next((f"{k}:{index}" for k in _GPU_KINDS[kind] if f"{k}:{index}" in available), None)
    if name is not None and name in available:
        return name
    gpus = "" if len(available) > 1 else "; this machine (or this build of the library) has no GPU it can use"
    raise DeviceError(
        f"{backend} backend: device {device!r} is not available here{gpus}; available devices: "
        f"{', '.join(available)} (spell a GPU 'cuda', 'cuda:N' or 'gpu:N')"
    )

#: Every hook an adapter may implement, by group, in the order the adapter guide lists them.
HOOKS: dict[str, tuple[str, ...]] = {
    "traits": ("name", "extra", "modules", "approximate", "implicit", "reuses_traces"),
    "primitives": tuple(f"flat_{p}" for p in PRIMITIVES[:2]),
    # the operators an adapter may route itself (protocol.FAST_ROUTES), the compile step, and
    # the batched primitives
    "fast routes": (
        *(f"flat_{route}" for route in FAST_ROUTES), "direct_prepared", *(f"flat_{p}" for p in PRIMITIVES[2:]),
    ),
    "arrays": (
        "is_native", "from_numpy", "to_numpy", "cast", "zeros_like", "ones_like", "asarray_like", "snapshot", "scope",
        "from_dlpack", "numpy_view",
    ),
    "devices": ("devices", "normalise_device"),
    "pytrees": ("pytree_node",),
    "variables": (
        "is_variable",
        "check_variable",
        "model_variables",
        "model_state",
        "forward_state",
        "read",
        "read_kept",
        "write",
        "current_value",
        "new_variable",
        "swap",
        "aliases",
        "implicit_value_and_gradient",
        "implicit_value_and_pullback",
    ),
    "composition": ("custom_function", "foreign_function", "custom_rule"),
    # an object with fori_loop, scan and while_loop (ad.fori_loop... on the library's loops)
    "loops": ("loops",),
    # compiles a function of arrays: a whole ad.train_step, a prepared ad.Sparse call
    "compile": ("compiler",),
}


def checked_chunk_size(chunk_size: Any) -> int:
    """``chunk_size`` as a positive int, or :class:`~abstractdiff.InvalidArgumentError`."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise InvalidArgumentError(
            f"chunk_size must be a positive int (basis vectors per batched call of a Jacobian) "
            f"or None for the default, got {chunk_size!r}"
        )
    return int(chunk_size)


def approximates(b: Any, order: int | None = None) -> bool:
    """Whether backend ``b`` approximates derivatives of ``order`` (1, 2...); ``None``: of any order.

    Reads the ``approximate`` trait, a bool or one bool per order.
    """
    declared = b.approximate
    if isinstance(declared, (bool, np.bool_)) or not isinstance(declared, Sequence):
        return bool(declared)
    per_order = tuple(bool(a) for a in declared)
    if not per_order:
        return False
    if order is None:
        return any(per_order)
    return per_order[min(max(order, 1), len(per_order)) - 1]


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
    #: Whether derivatives are approximated (finite differences) rather than exact: one bool
    #: for every order, or one per order from the first, the last standing for higher ones
    #: (a complex-step adapter: ``(False, True)``, exact first derivatives and second ones by
    #: differences).  Read it with :func:`approximates`.
    approximate: ClassVar[bool | tuple[bool, ...]] = False
    #: Whether the backend differentiates ``ad.Params`` (implicit mode) rather than arrays.
    implicit: ClassVar[bool] = False
    #: Whether the backend traces ``f`` once and reuses the trace (``jit``, ``tf.function``):
    #: values ``f`` reads by closure or global are then frozen into the trace, so the core
    #: keys its plans on them too (a property where it depends on an option such as ``compile``).
    reuses_traces: ClassVar[bool] = False
    #: Basis vectors per batched call of a derived Jacobian (``None``: up to
    #: :data:`DEFAULT_CHUNK_SIZE`); set by the ``chunk_size`` option.
    chunk_size: int | None = None
    #: The loop hooks: an object with ``fori_loop``, ``scan`` and ``while_loop`` on flat leaf
    #: lists (the adapter guide's "Loops"), or None: ``ad.fori_loop`` and friends run as Python loops.
    loops: Any = None
    #: The compiler: ``compiler(fn, assigns_variables=False) -> run | None`` (``jax.jit``,
    #: ``tf.function``, ``mx.compile``), or None: whole training steps and sparse calls run op by op.
    compiler: Any = None

    def __init__(self, *, device: str | None = None, chunk_size: int | None = None, **options: Any):
        if chunk_size is not None:
            self.chunk_size = options["chunk_size"] = checked_chunk_size(chunk_size)
        self.device = self.normalise_device(device)
        # the library's numpy/scipy translations, before any f runs (abstractdiff.portable)
        portable.apply(("numpy", *self.modules[:1]))
        self.options: dict[str, Any] = {"device": self.device, **options}
        self._plans = PlanCache(numpy_native=self.is_native(np.zeros(0)))

    def _take_chunk_size(self, chunk_size: Any) -> None:
        """Set the core's ``chunk_size`` option on a backend whose constructor does not take it
        (a third-party adapter written before the option): chunking is the core's job."""
        if chunk_size is None:
            return
        self.chunk_size = self.options["chunk_size"] = checked_chunk_size(chunk_size)
        self.__dict__.pop("_cache_key", None)  # the option is part of what compiled artefacts depend on

    # ---------------------------------------------------------------- identity
    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options == self.options  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.cache_key)

    def _cache_class(self) -> type:
        """The class in :attr:`cache_key`: the backend's own (a holder's: its adapter's)."""
        return type(self)

    @property
    def cache_key(self) -> tuple:
        """``(class, options)``: what a compiled artefact of this backend depends on."""
        key = self.__dict__.get("_cache_key")
        if key is None:
            key = (self._cache_class(), tuple(sorted((k, type(v).__name__, repr(v)) for k, v in self.options.items())))
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

    # ----------------------------------------------- arrays, devices, pytrees
    # The numpy defaults of these library facts are the adapter protocol's, one home for each
    # (abstractdiff.protocol.Adapter, which documents them); an adapter subclassing Backend
    # overrides them here.
    devices = Adapter.devices
    is_native = Adapter.is_native
    from_numpy = Adapter.from_numpy
    to_numpy = Adapter.to_numpy
    from_dlpack = Adapter.from_dlpack
    numpy_view = Adapter.numpy_view
    cast = Adapter.cast
    zeros_like = Adapter.zeros_like
    ones_like = Adapter.ones_like
    asarray_like = Adapter.asarray_like
    snapshot = Adapter.snapshot
    scope = Adapter.scope
    pytree_node = Adapter.pytree_node

    def normalise_device(self, device: str | None) -> str:
        """Map a user spelling to a name from :meth:`devices`; the one device parser.

        Canonical names are ``"cpu"``, ``"cuda:N"`` (an NVIDIA GPU, on every library),
        ``"mps:N"`` (Apple's Metal GPU) and ``"tpu:N"``; adapters list theirs in
        :meth:`devices` and translate them to their library's spelling themselves.  See
        :func:`parse_device` for the spellings accepted.
        """
        return parse_device(device, self.devices(), self.name)

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
        """``(trainable variables, number of non-trainable ones)`` of a model of this library, or
        ``None``; non-trainable: frozen parameters and buffers (BatchNorm's moving statistics)."""
        return None

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        """Every variable a checkpoint saves of a model (frozen ones and buffers too), with names."""
        return None

    def forward_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        """Variables of a model its forward pass may write that ``model_state`` leaves out (torch's
        non-persistent buffers), with names, or ``None``: a failed training step restores them too."""
        return None

    def read(self, var: Any) -> Any:
        """The current value of a variable, as a native array outside any autodiff graph."""
        return var.value

    def read_kept(self, var: Any) -> Any:
        """The current value of a variable, kept apart from later writes to the variable (a
        failed training step writes it back): :meth:`read` where that returns an immutable
        value or a copy; a library whose reads share memory with the variable copies."""
        return self.read(var)

    def write(self, var: Any, value: Any) -> None:
        """Assign native array ``value`` to a variable in place (same shape and dtype)."""
        var.value = value

    def current_value(self, var: Any) -> Any:
        """The value ``f`` should compute with, read so that differentiation sees the read."""
        return var.value

    def new_variable(self, value: Any) -> Any:
        """A fresh variable of the library holding a copy of native array ``value`` (``ad.variables``),
        or ``None`` (the default, for libraries without mutable variables): the core then boxes a
        copy in an :class:`abstractdiff.Variable`."""
        return None

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
    custom_function = Adapter.custom_function  # the protocol's hook, documented there

    @property
    def has_custom_function(self) -> bool:
        return type(self).custom_function is not AdapterHooks.custom_function

    custom_rule = Adapter.custom_rule  # the hook of ad.custom_vjp and ad.stop_gradient, documented there

    @property
    def has_custom_rule(self) -> bool:
        return type(self).custom_rule is not AdapterHooks.custom_rule

    def foreign_function(self, kernel: Any) -> Callable[[Any], Any]:
        """The older composition hook, for adapters without :meth:`custom_function`.

        ``kernel`` (an :class:`abstractdiff._compose.ForeignKernel`: another library's
        function of one flat vector) as a function of one flat array of this library that
        this library can differentiate: its value is ``kernel.value``, its pullback
        ``kernel.vjp`` and (where this library has forward mode) its pushforward
        ``kernel.jvp``, each on numpy vectors.  Where the mechanism can carry them, the
        pullback and pushforward are differentiable in turn with ``kernel.second_vjp`` and
        ``kernel.second_jvp``; any derivative not carried must raise
        :class:`~abstractdiff.CompositionError`, never come out silently zero.  An adapter
        implementing :meth:`custom_function` gets all of this from the core instead.
        """
        from ._errors import CompositionError

        raise CompositionError(
            f"the {self.name} backend cannot call a function differentiated by another library: its "
            f"adapter implements neither the custom_function hook nor foreign_function (see the adapter guide)"
        )

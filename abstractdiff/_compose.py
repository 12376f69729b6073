"""Cross-library composition: ``ad.differentiate_with(f, backend)``.

DifferentiationInterface.jl's ``DifferentiateWith``, for Python's AD libraries.  ``f`` is
a kernel written for ``backend``'s arrays (a physics step in jax, a renderer in torch);
``g = ad.differentiate_with(f, backend)`` can be called from code that another library
differentiates.  ``g`` looks at the arrays it receives, finds the caller's library
through the registry (:func:`abstractdiff._registry.backend_for`), and hands that
library a function whose value, pullback and pushforward ``backend`` computes, through
the caller's own custom-derivative mechanism: the caller adapter's one custom-derivative
hook, :meth:`~abstractdiff.protocol.Adapter.custom_function` (``torch.autograd.Function``,
``jax.custom_jvp`` with ``jax.pure_callback``, ``tf.custom_gradient`` with
``tf.numpy_function``, autograd's ``primitive``...).  :func:`boundary` builds the five
functions of the boundary on it, with their derivative rules and refusals, once for every
library; an adapter written against the older ``foreign_function`` hook still works.

The boundary is one flat vector each way, in numpy: the caller ravels and concatenates
``x``'s float leaves with its own (differentiable) operations, the foreign function maps
that vector to the raveled outputs, and the caller splits and reshapes them again.  So
each adapter's hook handles one array in and one array out, and pytrees, shapes and
dtypes are the core's business.

The vector crosses without a copy where both libraries allow it (on the CPU): the caller
hands a numpy view of its memory; the kernel's backend imports it by DLPack
(:meth:`~abstractdiff._hooks.AdapterHooks.from_dlpack`) and exports its output as a numpy
view (:meth:`~abstractdiff._hooks.AdapterHooks.numpy_view`, read-only where the kernel's
arrays are immutable), which the caller wraps without a copy where it can.  A ``g`` of one
float leaf in and one out can so share the caller's memory end to end; more leaves are
concatenated (one copy each way), and the copies that remain are each adapter's business
(``benchmarks/compose.py`` measures every pair).

* Outside any differentiation (numpy inputs, or a library's plain arrays), ``g(x)`` is
  ``f(x)`` converted to and from the caller's array type.
* Called by ``backend``'s own library, ``g`` is ``f`` itself: the library differentiates
  it natively (nesting included).
* Second derivatives through the boundary are the kernel's (:meth:`ForeignKernel.second_vjp`,
  :meth:`ForeignKernel.second_jvp`), for callers whose mechanism can carry them (torch,
  autograd, MLX, paddle, PyTensor); a derivative the boundary does not carry (a third one,
  or a second one for jax and tensorflow callers) raises
  :class:`~abstractdiff.CompositionError` rather than return a silently zero derivative.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from . import _pytree as pytree
from ._arrays import ar, dtype_name, shape_of
from ._cache import WeakLRU, value_key
from ._convert import content_of
from ._errors import ArgumentTypeError, CompositionError, InvalidArgumentError, NonDifferentiableInputError
from ._tree import is_float_leaf

__all__ = ["DifferentiateWith", "ForeignKernel", "differentiate_with"]


class ForeignKernel:
    """``f`` at one input structure, as numpy functions of one flat vector.

    What :func:`boundary` wires into the caller adapter's ``custom_function`` hook (and an
    adapter's older ``foreign_function`` hook calls): :meth:`value`, :meth:`vjp` and
    :meth:`jvp` take 1-D numpy arrays (or any 1-D array exporting ``__dlpack__``) and
    return 1-D numpy arrays, which may share memory with the kernel's arrays, and be
    read-only; :attr:`in_size`, :attr:`in_dtype`, :attr:`out_size` and :attr:`out_dtype`
    describe them (known before any call, as ``jax.pure_callback`` needs).  The kernel
    ``backend`` computes every derivative.
    """

    def __init__(self, owner: DifferentiateWith, x: Any, args: tuple, in_dtype: str, probe: np.ndarray | None):
        self.owner = owner
        self.backend = owner.backend
        leaves, self.x_treedef = pytree.tree_flatten(x)
        self.float_index = [i for i, leaf in enumerate(leaves) if is_float_leaf(leaf)]
        self.template = list(leaves)
        self.in_shapes = [tuple(np.shape(leaves[i])) for i in self.float_index]
        self.in_sizes = [math.prod(s) for s in self.in_shapes]
        self.in_size = sum(self.in_sizes)
        self.in_dtype = in_dtype
        self.args = args
        out_leaves, self.out_treedef = pytree.tree_flatten(self._probe(probe))
        for leaf in out_leaves:
            if not is_float_leaf(leaf):
                raise NonDifferentiableInputError(
                    f"differentiate_with: f must return float arrays (a pytree of them), but one output "
                    f"leaf is {type(leaf).__name__}; return integer results through a separate function"
                )
        self.out_shapes = [shape_of(leaf) if hasattr(leaf, "shape") else () for leaf in out_leaves]
        self.out_sizes = [math.prod(s) for s in self.out_shapes]
        self.out_size = sum(self.out_sizes)
        self.out_dtypes = [_dtype_text(leaf) for leaf in out_leaves]
        self.out_dtype = np.result_type(*self.out_dtypes).name if out_leaves else in_dtype
        # one object for the derivatives: the backend's plans are keyed on the function (a
        # bound method is a new one per access, and jax would compile the pullback per call)
        self._flat_fn = self._flat_out
        self._weighted_fn = self._weighted_out
        self._along_fn = self._along
        self._boundaries: dict[Any, Callable[[Any], Any]] = {}  # caller backend -> the kernel in its arrays

    def _probe(self, values: np.ndarray | None) -> Any:
        """``f``'s output at the caller's ``x`` (flat ``values``), for its structure (cached per
        input signature).  At the caller's own values, as ``f`` may refuse others (a kernel
        that checks ``x > 0``); a traced ``x`` has none, so zeros stand in for them there."""
        flat = np.zeros(self.in_size, dtype=self.in_dtype) if values is None else values
        native = self.backend.asarray(flat)
        try:
            with self.backend.scope([native]), np.errstate(all="ignore"):
                return self._tree_out(native)
        except Exception as err:
            if values is not None:
                raise
            raise CompositionError(
                f"differentiate_with: f raised {type(err).__name__} ({err}) where abstractdiff evaluated it "
                f"for its output's shapes: x is traced (inside jax.jit or another transformation), so "
                f"zeros of x's shapes stood in for its values. Call g once with concrete x of these shapes "
                f"first (outside jit: the output structure is then kept), or let f accept zeros"
            ) from err

    # ------------------------------------------------------------- the kernel side
    def _rebuild(self, flat: Any) -> Any:
        """``x`` rebuilt from a flat vector of the kernel backend's arrays."""
        a = ar()
        leaves = list(self.template)
        start = 0
        for i, shape, size in zip(self.float_index, self.in_shapes, self.in_sizes):
            part = flat if size == self.in_size else flat[start : start + size]  # a jax slice copies
            leaves[i] = part if shape == (size,) else a.do("reshape", part, shape)
            start += size
        return pytree.tree_unflatten(self.x_treedef, leaves)

    def _tree_out(self, flat: Any) -> Any:
        return self.owner.f(self._rebuild(flat), *self.args)

    def _flat_out(self, flat: Any) -> Any:
        """The kernel's outputs raveled into one vector (in the kernel backend's arrays)."""
        a = ar()
        leaves = pytree.tree_leaves(self._tree_out(flat))
        parts = [leaf if getattr(leaf, "ndim", None) == 1 else a.do("reshape", leaf, (-1,)) for leaf in leaves]
        if len(parts) == 1:
            return parts[0]
        return a.do("concatenate", [a.do("astype", p, self.out_dtype) if _dtype_text(p) != self.out_dtype else p
                                    for p in parts])

    def _native(self, a: Any, dtype: str) -> Any:
        """The caller's flat vector as the kernel backend's array, sharing its memory where
        the backend can (DLPack); ``dtype`` is the boundary's."""
        if not hasattr(a, "__dlpack__"):  # a list, a number: what np.asarray took before
            a = np.asarray(a, dtype)
        elif isinstance(a, np.ndarray) and a.dtype != dtype:
            a = a.astype(dtype)
        out = self.backend.from_dlpack(a)
        return out if dtype_name(out) == dtype else self.backend.cast(out, dtype)

    def _numpy(self, a: Any, dtype: str) -> np.ndarray:
        """The kernel backend's flat result as numpy, its memory where the backend allows."""
        out = np.asarray(self.backend.numpy_view(a))
        return out if out.dtype == dtype else out.astype(dtype)

    def value(self, x: Any) -> np.ndarray:
        """``f`` at the flat input ``x``: the flat output."""
        flat = self._native(x, self.in_dtype)
        with self.backend.scope([flat]):  # jax computes in float64 only in its x64 scope
            return self._numpy(self._flat_out(flat), self.out_dtype)

    def vjp(self, x: Any, dy: Any) -> np.ndarray:
        """The pullback of ``dy`` (flat, like the output) at ``x``: flat, like the input."""
        from ._operators import value_and_pullback

        _, pullback = value_and_pullback(self.backend, self._flat_fn, self._native(x, self.in_dtype))
        return self._numpy(pullback(self._native(dy, self.out_dtype)), self.in_dtype)

    def jvp(self, x: Any, dx: Any) -> np.ndarray:
        """The pushforward of ``dx`` (flat, like the input) at ``x``: flat, like the output."""
        from ._operators import value_and_pushforward

        _, pushforward = value_and_pushforward(self.backend, self._flat_fn, self._native(x, self.in_dtype))
        return self._numpy(pushforward(self._native(dx, self.in_dtype)), self.out_dtype)

    def value_and_vjp(self, x: Any) -> tuple[np.ndarray, Callable[[Any], np.ndarray]]:
        """The flat output and its pullback, from one forward pass (for callers that keep it)."""
        from ._operators import value_and_pullback

        y, pullback = value_and_pullback(self.backend, self._flat_fn, self._native(x, self.in_dtype))
        return self._numpy(y, self.out_dtype), lambda dy: self._numpy(
            pullback(self._native(dy, self.out_dtype)), self.in_dtype
        )

    # second derivatives, for a caller that differentiates the pullback or the pushforward
    def _weighted_out(self, flat: Any, dy: Any) -> Any:
        return ar().do("sum", self._flat_out(flat) * dy)

    def _along(self, t: Any, flat: Any, u: Any) -> Any:
        return self._flat_out(flat + t * u)

    def second_vjp(self, x: Any, dy: Any, v: Any) -> np.ndarray:
        """``d/dx <dy, f'(x) v>`` (flat, like the input): the Hessian of ``<dy, f>`` at ``x``
        times ``v``.  The derivative of the pullback ``x -> f'(x)^T dy`` along ``v``, and
        the pullback of ``dy`` through the derivative of the pushforward ``x -> f'(x) v``."""
        from ._operators import hvp

        if _is_zero(dy) or _is_zero(v):  # bilinear in (dy, v): a caller's dummy zero costs no HVP
            return np.zeros(self.in_size, self.in_dtype)
        flat = self._native(x, self.in_dtype)
        with self.backend.scope([flat]):
            out = hvp(self.backend, self._weighted_fn, flat, self._native(v, self.in_dtype),
                      self._native(dy, self.out_dtype))
            return self._numpy(out, self.in_dtype)

    def second_jvp(self, x: Any, v: Any, w: Any) -> np.ndarray:
        """``f''(x)[v, w]`` (flat, like the output): the derivative of the pushforward
        ``x -> f'(x) v`` along ``w``.  By polarisation, from two second derivatives of
        ``t -> f(x + t u)`` at 0 (``u = v + w`` and ``v - w``)."""
        from ._operators import second_derivative

        if _is_zero(v) or _is_zero(w):  # bilinear in (v, w)
            return np.zeros(self.out_size, self.out_dtype)
        flat, v, w = (self._native(a, self.in_dtype) for a in (x, v, w))
        zero = self.backend.asarray(np.zeros((), self.in_dtype))
        with self.backend.scope([flat]):
            plus = second_derivative(self.backend, self._along_fn, zero, flat, v + w)
            minus = second_derivative(self.backend, self._along_fn, zero, flat, v - w)
            return self._numpy((plus - minus) / 4, self.out_dtype)

    # ------------------------------------------------------------- the caller side
    def split(self, flat: Any) -> Any:
        """The output tree from the caller's flat vector (the caller's own operations)."""
        a = ar()
        leaves = []
        start = 0
        for shape, size, dtype in zip(self.out_shapes, self.out_sizes, self.out_dtypes):
            part = flat if size == self.out_size else flat[start : start + size]  # a slice's derivative costs
            leaf = a.do("reshape", part, shape)
            if dtype != self.out_dtype:
                leaf = a.do("astype", leaf, dtype)
            leaves.append(leaf)
            start += size
        return pytree.tree_unflatten(self.out_treedef, leaves)

    def boundary(self, caller: Any) -> Callable[[Any], Any]:
        """The kernel as a function of one flat array of ``caller``'s library (built once per
        caller backend: :func:`boundary`, or the caller adapter's older ``foreign_function``)."""
        built = self._boundaries.get(caller.cache_key)
        if built is None:
            built = boundary(self, caller) if caller.has_custom_function else caller.foreign_function(self)
            self._boundaries[caller.cache_key] = built
        return built


def boundary_error(kernel: ForeignKernel, caller: str, order: int, remedy: str = "") -> CompositionError:
    """The one refusal of a derivative the boundary does not carry: ``order`` 3 is a third
    derivative (what every caller refuses), 2 a second one (callers whose mechanism carries
    first derivatives only), for ``caller`` (the library whose code calls the kernel)."""
    nth = {2: "second", 3: "third"}.get(order, f"order-{order}")
    carried = "first and second derivatives" if order == 3 else "first derivatives"
    return CompositionError(
        f"a {nth} derivative through differentiate_with's boundary ({caller} code calling a "
        f"{kernel.backend.name} kernel) is not supported: the boundary carries {carried}"
        f"{remedy}; to nest further, write the kernel in {caller} too: a kernel in the caller's own library "
        f"nests natively"
    )


def boundary(kernel: ForeignKernel, caller: Any) -> Callable[[Any], Any]:
    """``kernel`` as a function of one flat array of ``caller``'s library, on its
    :meth:`~abstractdiff.protocol.Adapter.custom_function` hook: five custom functions.

    * ``value(x)``: its pullback is ``pullback(x, dy)``, its pushforward ``pushforward(x, dx)``;
    * ``pullback(x, dy) = f'(x)^T dy``: linear in ``dy``, where its derivative is ``pushforward``
      (reverse) or itself (forward); with respect to ``x`` it is ``second_vjp``;
    * ``pushforward(x, dx) = f'(x) dx``: in ``dx``, ``pullback`` (reverse) or itself (forward);
      in ``x``, ``second_vjp`` (reverse) and ``second_jvp`` (forward);
    * ``second_vjp(x, dy, v)`` (the Hessian of ``<dy, f>`` times ``v``) and ``second_jvp(x, v, w)``
      (``f''(x)[v, w]``): bilinear in their last two operands, where their derivatives are each
      other; their derivatives with respect to ``x``, third ones, raise :func:`boundary_error`.

    The rules refer to each other by name (the kernel's: ``vjp``, ``jvp``...), so the cycle
    pullback <-> pushforward is closed after all five are made.
    """
    custom = caller.custom_function
    nodes: dict[str, Callable[..., Any]] = {}

    def refuse(*_: Any) -> Any:
        raise boundary_error(kernel, caller.name, 3)

    def call(name: str) -> Callable[..., Any]:
        return lambda *arrays: nodes[name](*arrays)

    second_vjp, second_jvp, pullback, pushforward = map(call, ("second_vjp", "second_jvp", "vjp", "jvp"))
    into_x, into_y = (kernel.in_size, kernel.in_dtype), (kernel.out_size, kernel.out_dtype)
    # The second derivatives are bilinear in their last two operands: derivatives there are
    # second derivatives again (a library whose forward mode is two pullbacks, PyTensor's and
    # paddle's, needs them for forward-over-reverse); with respect to x they are third ones.
    nodes["second_vjp"] = custom(
        kernel.second_vjp,
        (refuse, lambda c, x, dy, v: second_jvp(x, v, c), lambda c, x, dy, v: second_vjp(x, dy, c)),
        (refuse, lambda t, x, dy, v: second_vjp(x, t, v), lambda t, x, dy, v: second_vjp(x, dy, t)),
        into_x,
    )
    nodes["second_jvp"] = custom(
        kernel.second_jvp,
        (refuse, lambda c, x, v, w: second_vjp(x, c, w), lambda c, x, v, w: second_vjp(x, c, v)),
        (refuse, lambda t, x, v, w: second_jvp(x, t, w), lambda t, x, v, w: second_jvp(x, v, t)),
        into_y,
    )
    nodes["vjp"] = custom(
        kernel.vjp,
        (lambda u, x, dy: second_vjp(x, dy, u), lambda u, x, dy: pushforward(x, u)),
        (lambda t, x, dy: second_vjp(x, dy, t), lambda t, x, dy: pullback(x, t)),
        into_x,
    )
    nodes["jvp"] = custom(
        kernel.jvp,
        (lambda w, x, dx: second_vjp(x, w, dx), lambda w, x, dx: pullback(x, w)),
        (lambda t, x, dx: second_jvp(x, dx, t), lambda t, x, dx: pushforward(x, t)),
        into_y,
    )
    return custom(kernel.value, (lambda dy, x: pullback(x, dy),), (lambda dx, x: pushforward(x, dx),), into_y)


def _is_zero(a: Any) -> bool:
    """Whether a boundary vector is all zeros; only numpy's are looked at (another library's
    array, on a GPU say, is not copied for it)."""
    return isinstance(a, np.ndarray) and not a.any()


def _shape(a: Any) -> tuple[int, ...]:
    """A leaf's static shape (a Python float's is ``()``; PyTensor's ``x.shape`` is symbolic)."""
    return shape_of(a) if hasattr(a, "shape") else np.shape(a)


def _dtype_text(a: Any) -> str:
    if isinstance(a, float):
        return "float64"
    return dtype_name(a)


class DifferentiateWith:
    """``g(x, *args)``: ``f`` evaluated and differentiated by ``backend``, callable from any
    library's differentiated code.  Built by :func:`differentiate_with`."""

    def __init__(self, f: Callable[..., Any], backend: Any):
        from ._registry import backend as get_backend

        if not callable(f):
            raise ArgumentTypeError(f"differentiate_with: f must be callable, got {type(f).__name__}")
        self.f = f
        self.backend = get_backend(backend)
        self.__abstractdiff_wrapped__ = f  # the stale-trace check looks through to f
        # kernels per input signature and argument values (the one keying policy); objects
        # keyed by identity are held weakly (a kernel holds its args while it is cached)
        self._kernels: WeakLRU[ForeignKernel] = WeakLRU(
            maxsize=64, name="differentiate_with kernels",
            keyed_on="the wrapped function, input shapes and dtypes, argument values (objects held weakly)",
        )

    def __repr__(self) -> str:
        return f"differentiate_with({getattr(self.f, '__qualname__', self.f)!r}, {self.backend.name!r})"

    def kernel(self, x: Any, args: tuple, in_dtype: str) -> ForeignKernel:
        """The :class:`ForeignKernel` for ``x``'s structure, float shapes and dtype, and the
        values of everything else: ``x``'s other leaves and ``args``, by
        :func:`abstractdiff._cache.value_key` (arrays by content, other objects by identity)."""
        leaves, treedef = pytree.tree_flatten(x)
        static_alive: list[Any] = []
        args_alive: list[Any] = []
        key = (
            treedef,
            tuple((_shape(v), _dtype_text(v)) for v in leaves if is_float_leaf(v)),
            value_key([v for v in leaves if not is_float_leaf(v)], static_alive, native=content_of),
            in_dtype,
            value_key(args, args_alive, native=content_of),
        )
        _refuse_traced(self, static_alive, "a non-float leaf of x")
        _refuse_traced(self, args_alive, "an argument after x")
        objects = (self, *static_alive, *args_alive)  # the identity-keyed objects, held weakly by the cache
        kernel = self._kernels.get(objects, key)
        if kernel is None:
            # copies of the arrays keyed by content: a later in-place write must not reach the kernel
            kernel = ForeignKernel(self, _snapshot(self.backend, _shapes_only(x)), _snapshot(self.backend, args),
                                   in_dtype, _flat_values(leaves, in_dtype))
            self._kernels.put(objects, kernel, key)  # not stored when an object has no weak reference
        return kernel

    def __call__(self, x: Any, *args: Any) -> Any:
        from ._registry import backend_for

        leaves = pytree.tree_leaves(x)
        floats = [v for v in leaves if is_float_leaf(v)]
        if not floats:
            raise NonDifferentiableInputError(
                f"{self!r} needs float arrays in x (its float leaves are what crosses libraries); "
                f"got leaves {sorted({type(v).__name__ for v in leaves})}"
            )
        caller = None
        for v in floats:
            caller = backend_for(v)
            if caller is not None:
                break
        if caller is not None and caller.name == self.backend.name:
            return self.f(x, *args)  # the kernel's own library: it differentiates f natively
        if caller is None:
            from ._sparsity import Tracer, through_custom_function

            if any(isinstance(v, Tracer) for v in floats):  # ad.Sparse's detection: opaque, a dense block
                flat, treedef = pytree.tree_flatten((x, *args))
                return through_custom_function(lambda *a: self(*a), flat, treedef)
        dtypes = {_dtype_text(v) for v in floats}
        if len(dtypes) > 1:
            raise InvalidArgumentError(
                f"{self!r}: x's float leaves have different dtypes ({', '.join(sorted(dtypes))}); the "
                f"boundary carries one dtype: cast them to one dtype first"
            )
        (in_dtype,) = dtypes
        kernel = self.kernel(x, args, in_dtype)
        if caller is None:  # numpy (or a library no backend claims): values only
            flats = [np.reshape(np.asarray(v, in_dtype), (-1,)) for v in floats]
            flat = flats[0] if len(flats) == 1 else np.concatenate(flats)  # one leaf: no copy
            return pytree.tree_map(np.asarray, _split_numpy(kernel, kernel.value(flat)))
        a = ar()
        flat = a.do("reshape", floats[0], (-1,)) if len(floats) == 1 else a.do(
            "concatenate", [a.do("reshape", v, (-1,)) for v in floats]
        )
        return kernel.split(kernel.boundary(caller)(flat))


def _refuse_traced(owner: DifferentiateWith, keyed_by_identity: list, what: str) -> None:
    """Refuse a traced array among the values the kernel closes over (an array that
    :func:`~abstractdiff._cache.value_key` could only key by identity has no values): they are
    needed when the kernel runs (a callback), and only x's float leaves cross the boundary."""
    from ._registry import backend_for

    for v in keyed_by_identity:
        lib = backend_for(v)
        if lib is not None and lib.is_native(v):
            raise CompositionError(
                f"{owner!r}: {what} is a traced {lib.name} value ({type(v).__name__}, inside jax.jit or "
                f"another transformation), but the kernel needs its values: only x's float leaves cross the "
                f"boundary as traced operands. Pass that data as a concrete array (numpy, or computed outside "
                f"the transformation and closed over), or make it a float leaf of x (it then also gets a "
                f"gradient)"
            )


def _snapshot(kernel_backend: Any, tree: Any) -> Any:
    """``tree`` with its arrays copied, as the kernel library's arrays, which ``f`` is written for
    (numpy data too: a torch kernel's ``x * w`` cannot take a numpy ``w``)."""
    from ._registry import backend_for

    def leaf(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return kernel_backend.asarray(v.copy())
        lib = backend_for(v)
        if lib is None or not lib.is_native(v):
            return v
        if lib.name == kernel_backend.name:
            return lib.snapshot(v)
        return kernel_backend.asarray(np.array(content_of(v)))

    return pytree.tree_map(leaf, tree)


def _flat_values(leaves: list, dtype: str) -> np.ndarray | None:
    """x's float leaves as one flat numpy vector, or ``None`` where one is traced (no values)."""
    parts = []
    for v in leaves:
        if is_float_leaf(v):
            values = np.asarray(v) if isinstance(v, float) else content_of(v)
            if values is None:
                return None
            parts.append(np.reshape(values, (-1,)).astype(dtype, copy=False))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _split_numpy(kernel: ForeignKernel, flat: np.ndarray) -> Any:
    leaves, start = [], 0
    for shape, size, dtype in zip(kernel.out_shapes, kernel.out_sizes, kernel.out_dtypes):
        leaves.append(flat[start : start + size].reshape(shape).astype(dtype, copy=False))
        start += size
    return pytree.tree_unflatten(kernel.out_treedef, leaves)


def _shapes_only(x: Any) -> Any:
    """``x`` with float leaves replaced by numpy zeros of their shape (the kernel keeps no
    caller arrays, which may be tracers)."""

    def leaf(v: Any) -> Any:
        if is_float_leaf(v):
            return np.zeros(_shape(v))
        return v

    return pytree.tree_map(leaf, x)


def differentiate_with(f: Callable[..., Any], backend: Any) -> DifferentiateWith:
    """``g = differentiate_with(f, backend)``: ``f`` (written for ``backend``'s arrays)
    made callable from code that any library differentiates.

    ``g(x, *args)`` takes the caller's arrays (or tracers), evaluates ``f`` with
    ``backend`` and gives the caller's library the pullback and pushforward of ``f``,
    both computed by ``backend``, through its own custom-derivative mechanism.  Outside
    any differentiation it is ``f`` converted to and from the caller's array type.  ``x``
    is a pytree whose float leaves share one dtype; ``args`` are passed to ``f`` (not
    differentiated), their arrays (numpy ones and another library's) as ``backend``'s arrays; they must be
    concrete (not traced inside ``jax.jit``: a :class:`~abstractdiff.CompositionError` says
    so); ``f`` returns a float array or a pytree of them.  The kernels are cached per input
    signature and per value of the arguments (arrays by content, other objects by identity).

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> g = ad.differentiate_with(lambda x: np.sin(x) * 2.0, "finite_differences")
        >>> g(np.array([0.0, 1.0])).round(6)
        array([0.      , 1.682942])
    """
    return DifferentiateWith(f, backend)

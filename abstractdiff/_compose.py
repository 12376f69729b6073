"""Cross-library composition: ``ad.differentiate_with(f, backend)``.

DifferentiationInterface.jl's ``DifferentiateWith``, for Python's AD libraries.  ``f`` is
a kernel written for ``backend``'s arrays (a physics step in jax, a renderer in torch);
``g = ad.differentiate_with(f, backend)`` can be called from code that another library
differentiates.  ``g`` looks at the arrays it receives, finds the caller's library
through the registry (:func:`abstractdiff._registry.backend_for`), and hands that
library a function whose value, pullback and pushforward ``backend`` computes, through
the caller's own custom-derivative mechanism: the caller adapter's
:meth:`~abstractdiff._hooks.AdapterHooks.foreign_function` hook (``torch.autograd.Function``,
``jax.custom_jvp`` with ``jax.pure_callback``, ``tf.custom_gradient`` with
``tf.py_function``, autograd's ``primitive``...).

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
import threading
from typing import Any, Callable

import numpy as np
import optree

from ._arrays import ar, dtype_name, shape_of
from ._errors import ArgumentTypeError, InvalidArgumentError, NonDifferentiableInputError
from ._tree import is_float_leaf

__all__ = ["DifferentiateWith", "ForeignKernel", "differentiate_with"]


class ForeignKernel:
    """``f`` at one input structure, as numpy functions of one flat vector.

    What a caller adapter's ``foreign_function`` hook calls: :meth:`value`, :meth:`vjp`
    and :meth:`jvp` take 1-D numpy arrays (or any 1-D array exporting ``__dlpack__``) and
    return 1-D numpy arrays, which may share memory with the kernel's arrays, and be
    read-only; :attr:`in_size`, :attr:`in_dtype`, :attr:`out_size` and :attr:`out_dtype`
    describe them (known before any call, as ``jax.pure_callback`` needs).  The kernel
    ``backend`` computes every derivative.
    """

    def __init__(self, owner: DifferentiateWith, x: Any, args: tuple, in_dtype: str):
        self.owner = owner
        self.backend = owner.backend
        leaves, self.x_treedef = optree.tree_flatten(x)
        self.float_index = [i for i, leaf in enumerate(leaves) if is_float_leaf(leaf)]
        self.template = list(leaves)
        self.in_shapes = [tuple(np.shape(leaves[i])) for i in self.float_index]
        self.in_sizes = [math.prod(s) for s in self.in_shapes]
        self.in_size = sum(self.in_sizes)
        self.in_dtype = in_dtype
        self.args = args
        # the output's structure: one evaluation at zeros (cached per input signature)
        probe = self.backend.asarray(np.zeros(self.in_size, dtype=in_dtype))
        with self.backend.scope([probe]), np.errstate(all="ignore"):
            out = self._tree_out(probe)
        out_leaves, self.out_treedef = optree.tree_flatten(out)
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
        return optree.tree_unflatten(self.x_treedef, leaves)

    def _tree_out(self, flat: Any) -> Any:
        return self.owner.f(self._rebuild(flat), *self.args)

    def _flat_out(self, flat: Any) -> Any:
        """The kernel's outputs raveled into one vector (in the kernel backend's arrays)."""
        a = ar()
        leaves = optree.tree_leaves(self._tree_out(flat))
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
        return optree.tree_unflatten(self.out_treedef, leaves)


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
        self._kernels: dict[Any, ForeignKernel] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"differentiate_with({getattr(self.f, '__qualname__', self.f)!r}, {self.backend.name!r})"

    def kernel(self, x: Any, args: tuple, in_dtype: str) -> ForeignKernel:
        """The :class:`ForeignKernel` for ``x``'s structure, shapes and dtype (cached)."""
        leaves, treedef = optree.tree_flatten(x)
        key = (
            treedef,
            tuple((_shape(v), _dtype_text(v)) if is_float_leaf(v) else ("static", repr(v)) for v in leaves),
            in_dtype,
            tuple(map(repr, args)) if args else (),
        )
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = ForeignKernel(self, _shapes_only(x), args, in_dtype)
            with self._lock:
                if len(self._kernels) > 64:
                    self._kernels.clear()
                self._kernels[key] = kernel
        return kernel

    def __call__(self, x: Any, *args: Any) -> Any:
        from ._registry import backend_for

        leaves = optree.tree_leaves(x)
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
            return optree.tree_map(np.asarray, _split_numpy(kernel, kernel.value(flat)))
        a = ar()
        flat = a.do("reshape", floats[0], (-1,)) if len(floats) == 1 else a.do(
            "concatenate", [a.do("reshape", v, (-1,)) for v in floats]
        )
        foreign = caller.foreign_function(kernel)
        return kernel.split(foreign(flat))


def _split_numpy(kernel: ForeignKernel, flat: np.ndarray) -> Any:
    leaves, start = [], 0
    for shape, size, dtype in zip(kernel.out_shapes, kernel.out_sizes, kernel.out_dtypes):
        leaves.append(flat[start : start + size].reshape(shape).astype(dtype, copy=False))
        start += size
    return optree.tree_unflatten(kernel.out_treedef, leaves)


def _shapes_only(x: Any) -> Any:
    """``x`` with float leaves replaced by numpy zeros of their shape (the kernel keeps no
    caller arrays, which may be tracers)."""

    def leaf(v: Any) -> Any:
        if is_float_leaf(v):
            return np.zeros(_shape(v))
        return v

    return optree.tree_map(leaf, x)


def differentiate_with(f: Callable[..., Any], backend: Any) -> DifferentiateWith:
    """``g = differentiate_with(f, backend)``: ``f`` (written for ``backend``'s arrays)
    made callable from code that any library differentiates.

    ``g(x, *args)`` takes the caller's arrays (or tracers), evaluates ``f`` with
    ``backend`` and gives the caller's library the pullback and pushforward of ``f``,
    both computed by ``backend``, through its own custom-derivative mechanism.  Outside
    any differentiation it is ``f`` converted to and from the caller's array type.  ``x``
    is a pytree whose float leaves share one dtype; ``args`` are passed to ``f`` as they
    are (not differentiated); ``f`` returns a float array or a pytree of them.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> g = ad.differentiate_with(lambda x: np.sin(x) * 2.0, "finite_differences")
        >>> g(np.array([0.0, 1.0])).round(6)
        array([0.      , 1.682942])
    """
    return DifferentiateWith(f, backend)

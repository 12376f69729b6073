"""Cross-library composition: ``ad.differentiate_with(f, backend)``.

DifferentiationInterface.jl's ``DifferentiateWith``, for Python's AD libraries.  ``f`` is
a kernel written for ``backend``'s arrays (a physics step in jax, a renderer in torch);
``g = ad.differentiate_with(f, backend)`` can be called from code that another library
differentiates.  ``g`` looks at the arrays it receives, finds the caller's library
through the registry (:func:`abstractdiff._registry.backend_for`), and hands that
library a function whose value, pullback and pushforward ``backend`` computes, through
the caller's own custom-derivative mechanism: the caller adapter's
:meth:`~abstractdiff._hooks.AdapterHooks.foreign_function` hook (``torch.autograd.Function``,
``jax.custom_vjp`` with ``jax.pure_callback``, ``tf.custom_gradient`` with
``tf.py_function``, autograd's ``primitive``...).

The boundary is one flat vector each way, in numpy: the caller ravels and concatenates
``x``'s float leaves with its own (differentiable) operations, the foreign function maps
that vector to the raveled outputs, and the caller splits and reshapes them again.  So
each adapter's hook handles one array in and one array out, and pytrees, shapes and
dtypes are the core's business.  Arrays cross to numpy without a copy where the library
allows it on CPU (torch, jax, numpy itself).

* Outside any differentiation (numpy inputs, or a library's plain arrays), ``g(x)`` is
  ``f(x)`` converted to and from the caller's array type.
* Called by ``backend``'s own library, ``g`` is ``f`` itself: the library differentiates
  it natively (nesting included).
* A second derivative through the boundary is not supported: the adapters raise
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
    and :meth:`jvp` take and return 1-D numpy arrays; :attr:`in_size`, :attr:`in_dtype`,
    :attr:`out_size` and :attr:`out_dtype` describe them (known before any call, as
    ``jax.pure_callback`` needs).  The kernel ``backend`` computes every derivative.
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

    # ------------------------------------------------------------- the kernel side
    def _rebuild(self, flat: Any) -> Any:
        """``x`` rebuilt from a flat vector of the kernel backend's arrays."""
        a = ar()
        leaves = list(self.template)
        start = 0
        for i, shape, size in zip(self.float_index, self.in_shapes, self.in_sizes):
            leaves[i] = a.do("reshape", flat[start : start + size], shape)
            start += size
        return optree.tree_unflatten(self.x_treedef, leaves)

    def _tree_out(self, flat: Any) -> Any:
        return self.owner.f(self._rebuild(flat), *self.args)

    def _flat_out(self, flat: Any) -> Any:
        """The kernel's outputs raveled into one vector (in the kernel backend's arrays)."""
        a = ar()
        leaves = optree.tree_leaves(self._tree_out(flat))
        parts = [a.do("reshape", leaf, (-1,)) for leaf in leaves]
        if len(parts) == 1:
            return parts[0]
        return a.do("concatenate", [a.do("astype", p, self.out_dtype) if _dtype_text(p) != self.out_dtype else p
                                    for p in parts])

    def _numpy(self, a: Any, dtype: str) -> np.ndarray:
        out = np.asarray(self.backend.to_numpy(a))
        if out.dtype != dtype:
            return out.astype(dtype)
        # the caller's library may wrap it without a copy (torch warns on read-only memory)
        return out if out.flags.writeable else out.copy()

    def value(self, x: np.ndarray) -> np.ndarray:
        """``f`` at the flat input ``x``: the flat output."""
        flat = self.backend.asarray(np.asarray(x, self.in_dtype))
        with self.backend.scope([flat]):  # jax computes in float64 only in its x64 scope
            return self._numpy(self._flat_out(flat), self.out_dtype)

    def vjp(self, x: np.ndarray, dy: np.ndarray) -> np.ndarray:
        """The pullback of ``dy`` (flat, like the output) at ``x``: flat, like the input."""
        from ._operators import value_and_pullback

        _, pullback = value_and_pullback(self.backend, self._flat_out, np.asarray(x, self.in_dtype))
        return self._numpy(pullback(np.asarray(dy, self.out_dtype)), self.in_dtype)

    def jvp(self, x: np.ndarray, dx: np.ndarray) -> np.ndarray:
        """The pushforward of ``dx`` (flat, like the input) at ``x``: flat, like the output."""
        from ._operators import value_and_pushforward

        _, pushforward = value_and_pushforward(self.backend, self._flat_out, np.asarray(x, self.in_dtype))
        return self._numpy(pushforward(np.asarray(dx, self.in_dtype)), self.out_dtype)

    def value_and_vjp(self, x: np.ndarray) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
        """The flat output and its pullback, from one forward pass (for callers that keep it)."""
        from ._operators import value_and_pullback

        y, pullback = value_and_pullback(self.backend, self._flat_out, np.asarray(x, self.in_dtype))
        return self._numpy(y, self.out_dtype), lambda dy: self._numpy(
            pullback(np.asarray(dy, self.out_dtype)), self.in_dtype
        )

    # ------------------------------------------------------------- the caller side
    def split(self, flat: Any) -> Any:
        """The output tree from the caller's flat vector (the caller's own operations)."""
        a = ar()
        leaves = []
        start = 0
        for shape, size, dtype in zip(self.out_shapes, self.out_sizes, self.out_dtypes):
            leaf = a.do("reshape", flat[start : start + size], shape)
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
            flat = np.concatenate([np.reshape(np.asarray(v, in_dtype), (-1,)) for v in floats])
            return optree.tree_map(np.asarray, _split_numpy(kernel, kernel.value(flat)))
        a = ar()
        flat = floats[0].reshape((-1,)) if len(floats) == 1 else a.do(
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

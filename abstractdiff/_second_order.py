"""``ad.SecondOrder(outer, inner)``: second-order operators as ``outer`` over ``inner``.

DifferentiationInterface.jl's ``SecondOrder``: the first-order operators (gradient,
pullback, pushforward, jacobian...) are ``inner``'s, and every second-order operator
(hessian, hvp and the others derived from the four flat methods below) differentiates
with ``outer`` a function that calls ``inner``'s gradient (or derivative).

Which pairs work:

* the same library twice, options free (jax over jax with ``compile=False``...): the
  library nests its own transforms (forward-over-reverse where ``outer`` has a forward
  mode);
* an approximate ``outer`` (finite differences) over any ``inner``: differences need
  values only, so ``outer`` differentiates a numpy function that converts its input to
  ``inner``'s arrays, calls ``inner``'s gradient and converts the result back.

An exact ``outer`` cannot trace another library's code (nor finite differences' numpy
arithmetic): such pairs are refused when the backend is created.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import numpy as np

from ._arrays import ar, dtype_name, shape_of, size_of
from ._backend import Backend
from ._derived import DerivedOperators, GradientFunction
from ._errors import ArgumentTypeError, InvalidArgumentError
from ._hooks import HOOKS, approximates
from ._operator_table import operators_where
from ._tree import HasArtefacts, PlanCache, artefacts

__all__ = ["SecondOrder"]

FlatFn = Callable[[list, list], tuple]

#: The flat methods ``SecondOrder`` computes itself; every other second-order one the core
#: derives from these, and every first-order one is ``inner``'s.
SECOND_ORDER_METHODS = ("flat_hessian", "flat_hessian_blocks", "flat_hvp", "flat_second_derivative")


# --------------------------------------------------------- flat functions of inner
class _LeafGradient(HasArtefacts):
    """``xs -> inner's gradient of fn at xs``, leaf ``k`` only (a block row of the Hessian)."""

    __slots__ = ("backend", "fn", "k", "_artefacts")

    def __init__(self, backend: Backend, fn: FlatFn, k: int):
        self.backend, self.fn, self.k, self._artefacts = backend, fn, k, {}

    def __call__(self, xs: list, data: list) -> tuple[Any, None]:
        _, _, grads = self.backend.flat_value_and_gradient(self.fn, xs, data)
        return self.backend.complete(grads, xs)[self.k], None


class _GradientDotTangent(HasArtefacts):
    """``(xs, data + tangents) -> <inner's gradient of fn at xs, tangents>``.

    The tangents travel as data, so a compiled ``outer`` traces this function once and
    reuses the trace for every new tangent (the core's own version holds them).
    """

    __slots__ = ("backend", "fn", "n_data", "_artefacts")

    def __init__(self, backend: Backend, fn: FlatFn, n_data: int):
        self.backend, self.fn, self.n_data, self._artefacts = backend, fn, n_data, {}

    def __call__(self, xs: list, data: list) -> tuple[Any, None]:
        n = self.n_data
        _, _, grads = self.backend.flat_value_and_gradient(self.fn, xs, data[:n])
        grads = self.backend.complete(grads, xs)
        total = sum(ar().do("sum", g * t) for g, t in zip(grads, data[n:]))
        return total, None


class _Derivative(HasArtefacts):
    """``x -> inner's dfn/dx at x`` for a scalar ``x``, shaped like ``fn``'s output."""

    __slots__ = ("backend", "fn", "_artefacts")

    def __init__(self, backend: Backend, fn: FlatFn):
        self.backend, self.fn, self._artefacts = backend, fn, {}

    def __call__(self, xs: list, data: list) -> tuple[Any, None]:
        return _derivative(self.backend, self.fn, xs, data), None


def _derivative(b: Backend, fn: FlatFn, xs: list, data: list) -> Any:
    """``b``'s derivative of ``fn`` at scalar ``xs[0]``: a pushforward of one, or the Jacobian."""
    native = getattr(b, "flat_value_and_derivative", None)
    if native is not None:
        return native(fn, xs, data)[1]
    if b.has_forward:
        return b.flat_value_and_pushforward(fn, xs, data)[2]([b.ones_like(xs[0])])
    return b.flat_jacobian(fn, xs, data)[1][0]


class _ThroughNumpy(HasArtefacts):
    """A flat function of ``inner``'s arrays seen as a function of numpy arrays.

    ``(xs, data) -> numpy result``: ``xs`` (numpy) become ``inner``'s arrays of the same
    dtype, ``data`` (already ``inner``'s) pass through, and the result comes back as one
    numpy array: the flat concatenation of a list result (a gradient), or the array.
    """

    __slots__ = ("inner", "fn", "_artefacts")

    def __init__(self, inner: Backend, fn: FlatFn):
        self.inner, self.fn, self._artefacts = inner, fn, {}

    def __call__(self, xs: list, data: list) -> tuple[np.ndarray, None]:
        inner = self.inner
        y, _ = self.fn([inner.asarray(np.asarray(x)) for x in xs], data)
        if isinstance(y, list):
            return np.concatenate([np.reshape(inner.to_numpy(v), -1) for v in y]), None
        return np.asarray(inner.to_numpy(y)), None


class _Gradients(HasArtefacts):
    """``xs -> inner's gradient of fn at xs``, every leaf (a list: :class:`_ThroughNumpy` concatenates it)."""

    __slots__ = ("backend", "fn", "_artefacts")

    def __init__(self, backend: Backend, fn: FlatFn):
        self.backend, self.fn, self._artefacts = backend, fn, {}

    def __call__(self, xs: list, data: list) -> tuple[list, None]:
        _, _, grads = self.backend.flat_value_and_gradient(self.fn, xs, data)
        return self.backend.complete(grads, xs), None


def _split(flat: Any, xs: list) -> list:
    """A numpy vector (or the rows of a matrix) cut into pieces shaped like ``xs``."""
    out, start = [], 0
    for x in xs:
        n = size_of(x)
        out.append(np.reshape(flat[start : start + n], shape_of(x) + np.shape(flat)[1:]))
        start += n
    return out


# -------------------------------------------------------------------- the backend
class SecondOrder(Backend):
    """``SecondOrder(outer, inner)``: second-order operators differentiate ``inner``'s
    first-order ones with ``outer``; first-order operators are ``inner``'s.

    ``outer`` and ``inner`` are backend names or instances (``ad.backend("jax",
    compile=False)`` for options).  Arrays are ``inner``'s.  Pairs that work: one library
    twice (jax over jax, torch over torch...: its transforms nest), and finite
    differences over any backend (``outer`` needs values only); other pairs raise
    :class:`~abstractdiff.InvalidArgumentError`.

    ``ad.hessian(SecondOrder(outer, inner), f, x) -> H``; ``ad.hvp(SecondOrder(outer,
    inner), f, x, v) -> H @ v``; every other operator and ``prepare_*`` as on any backend.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> b = ad.SecondOrder("finite_differences", "finite_differences")
        >>> b.name
        'second_order(finite_differences, finite_differences)'
        >>> np.round(ad.hessian(b, lambda x: (x**3).sum(), np.array([1.0, 2.0])), 4) + 0.0
        array([[ 6.,  0.],
               [ 0., 12.]])
    """

    name = "second_order"

    def __init__(self, outer: str | Backend, inner: str | Backend):
        self.outer = _resolve(outer, "outer")
        self.inner = _resolve(inner, "inner")
        self._through_numpy = _check_pair(self.outer, self.inner)
        self.name = f"second_order({self.outer.name}, {self.inner.name})"  # type: ignore[misc]
        # its derivatives are second ones of the pair: approximate where either is, at any order
        self.approximate = approximates(self.outer) or approximates(self.inner)  # type: ignore[misc]
        self.options = {"outer": self.outer, "inner": self.inner}
        self._plans = PlanCache(numpy_native=self.outer._plans.numpy_native and self.inner._plans.numpy_native)

    # ---------------------------------------------------------------- identity
    def __repr__(self) -> str:
        return f"SecondOrder(outer={self.outer!r}, inner={self.inner!r})"

    @property
    def cache_key(self) -> tuple:
        return (SecondOrder, self.outer.cache_key, self.inner.cache_key)

    # ------------------------------------------------- what is inner's or both's
    @property
    def device(self) -> str:  # type: ignore[override]
        return self.inner.device

    @property
    def reuses_traces(self) -> bool:  # type: ignore[override]
        # a compiled outer traces f (through inner's gradient) as much as a compiled inner
        return bool(self.inner.reuses_traces or self.outer.reuses_traces)

    @property
    def has_reverse(self) -> bool:
        return self.inner.has_reverse

    @property
    def has_forward(self) -> bool:
        return self.inner.has_forward

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        return self.inner.asarray(a, dtype)

    # ------------------------------------------------------------ second order
    def _wrapper(self, fn: FlatFn, what: Hashable, build: Callable[[], Any]) -> Any:
        """The flat function ``outer`` differentiates, built once per ``fn`` and kept in its
        artefacts: a compiled ``outer`` then traces it once, not on every call."""
        return artefacts(fn, self, "second order").get(what, build)

    def _numpy(self, xs: list) -> list[np.ndarray]:
        return [np.asarray(self.inner.to_numpy(x)) for x in xs]

    def _native(self, a: Any, like: Any) -> Any:
        return self.inner.asarray(np.asarray(a), dtype_name(like))

    def flat_hessian(self, fn: FlatFn, xs: list, data: list) -> Any:
        """Hessian of scalar ``fn`` of one input: ``outer``'s Jacobian of ``inner``'s gradient."""
        if self._through_numpy:
            return self.flat_hessian_blocks(fn, xs, data)[0][0]
        grad = self._wrapper(fn, "gradient function", lambda: GradientFunction(self.inner, fn))
        return self.outer.flat_jacobian(grad, xs, data)[1][0]

    def flat_hessian_blocks(self, fn: FlatFn, xs: list, data: list) -> list[list[Any]]:
        """Blocks ``[i][j]`` of the Hessian, shaped ``xs[i].shape + xs[j].shape``."""
        if self._through_numpy:
            grads = self._wrapper(fn, "numpy gradients", lambda: _ThroughNumpy(self.inner, _Gradients(self.inner, fn)))
            _, jacs = self.outer.flat_jacobian(grads, self._numpy(xs), data)
            n = sum(size_of(x) for x in xs)
            full = np.concatenate([np.reshape(j, (n, size_of(x))) for j, x in zip(jacs, xs)], axis=1)
            full = 0.5 * (full + full.T)  # the exact Hessian is symmetric: averaging halves the error
            rows = _split(full, xs)  # rows[i]: xs[i].shape + (n,)
            return [
                [self._native(np.reshape(b, shape_of(xi) + shape_of(xj)), xi) for b, xj in zip(_split_last(r, xs), xs)]
                for r, xi in zip(rows, xs)
            ]
        out = []
        for i in range(len(xs)):
            row = self._wrapper(fn, ("gradient leaf", i), lambda i=i: _LeafGradient(self.inner, fn, i))
            out.append(list(self.outer.flat_jacobian(row, xs, data)[1]))
        return out

    def flat_hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> list:
        """``H @ tangents``: ``outer``'s pushforward of ``inner``'s gradient (forward over
        reverse), or ``outer``'s gradient of ``<inner's gradient, tangents>``."""
        outer = self.outer
        if self._through_numpy:
            grads = self._wrapper(fn, "numpy gradients", lambda: _ThroughNumpy(self.inner, _Gradients(self.inner, fn)))
            _, _, jvp = outer.flat_value_and_pushforward_any(grads, self._numpy(xs), data)
            hv = np.asarray(jvp(self._numpy(tangents)))
            return [self._native(h, x) for h, x in zip(_split(hv, xs), xs)]
        if outer.has_forward and len(xs) == 1:
            grad = self._wrapper(fn, "gradient function", lambda: GradientFunction(self.inner, fn))
            _, _, jvp = outer.flat_value_and_pushforward(grad, xs, data)
            return [jvp(list(tangents))]
        n = len(data)
        dot = self._wrapper(fn, ("gradient dot tangent", n), lambda: _GradientDotTangent(self.inner, fn, n))
        _, _, hv = outer.flat_value_and_gradient(dot, xs, [*data, *tangents])
        return outer.complete(hv, xs)

    def flat_second_derivative(self, fn: FlatFn, xs: list, data: list) -> Any:
        """``d2fn/dx2`` for a scalar ``x``, shaped like ``fn``'s output: ``outer``'s derivative
        of ``inner``'s derivative."""
        if self._through_numpy:
            d = self._wrapper(fn, "numpy derivative", lambda: _ThroughNumpy(self.inner, _Derivative(self.inner, fn)))
            (x,) = self._numpy(xs)
            _, _, jvp = self.outer.flat_value_and_pushforward_any(d, [x], data)
            d2 = np.asarray(jvp([np.ones_like(x)]))
            return self.inner.asarray(d2)
        own = getattr(self.outer.flat_second_derivative, "__func__", None)  # a fast route is the adapter's
        if self.outer == self.inner and own is not DerivedOperators.flat_second_derivative:
            # one backend over itself: its own second derivative is that composition, by the
            # route its library supports (paddle's is reverse over reverse: its forward over
            # forward fails for sin and pow)
            return self.outer.flat_second_derivative(fn, xs, data)
        d = self._wrapper(fn, "derivative function", lambda: _Derivative(self.inner, fn))
        return _derivative(self.outer, d, xs, data)


def _split_last(row: np.ndarray, xs: list) -> list[np.ndarray]:
    """The last axis of ``row`` cut into pieces of ``xs``' sizes."""
    out, start = [], 0
    for x in xs:
        n = size_of(x)
        out.append(row[..., start : start + n])
        start += n
    return out


# ---------------------------------------------------- first order: inner's, all of it
def _forwarded(name: str) -> Callable[..., Any]:
    def method(self: SecondOrder, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``inner``'s ``{name}``."
    return method


def _first_order_methods() -> list[str]:
    """Every flat operator of the protocol that is not second order (new ones included: the
    core's derived defaults must not run on ``SecondOrder`` and bypass ``inner``'s own)."""
    return [
        name for name in dir(Backend)
        if name.startswith("flat_") and not any(op in name for op in operators_where(order=2))
    ]


_HOOKS_OF_INNER = (*HOOKS["arrays"], *HOOKS["devices"], *HOOKS["pytrees"], "one_hot", "complete")
for _name in (*_first_order_methods(), *_HOOKS_OF_INNER):
    if _name not in SecondOrder.__dict__:
        setattr(SecondOrder, _name, _forwarded(_name))
for _name in SECOND_ORDER_METHODS:
    assert _name in SecondOrder.__dict__, _name


# --------------------------------------------------------------------- the checks
def _resolve(b: Any, role: str) -> Backend:
    from ._registry import backend

    if not isinstance(b, (str, Backend)):
        raise ArgumentTypeError(
            f"{role} must be a backend name (such as 'jax') or a Backend, got {type(b).__name__}"
        )
    b = backend(b)
    if b.implicit:
        raise ArgumentTypeError(
            f"{role} of ad.SecondOrder must be an explicit backend, not {b!r}: second-order operators "
            f"differentiate arrays, not ad.Params"
        )
    if isinstance(b, SecondOrder):
        raise ArgumentTypeError(
            f"{role} of ad.SecondOrder cannot be another ad.SecondOrder ({b!r}); pass the backends themselves"
        )
    return b


#: What :func:`_check_pair` says works, for its errors.
_WORKING_PAIRS = (
    "the same library twice, with any options (SecondOrder('jax', 'jax'), SecondOrder('torch', 'torch')...), "
    "or finite differences over any backend (SecondOrder('finite_differences', inner))"
)


def _check_pair(outer: Backend, inner: Backend) -> bool:
    """Refuse a pair that cannot work; ``True`` when ``outer`` differentiates through numpy."""
    if approximates(outer):
        if not outer.is_native(np.zeros(())):
            raise InvalidArgumentError(
                f"the approximate outer backend {outer.name!r} does not work on numpy arrays, so it cannot "
                f"differentiate {inner.name!r}'s gradient through numpy; pairs that work: {_WORKING_PAIRS}"
            )
        return True
    if outer.name == inner.name:
        return False
    if approximates(inner):
        raise InvalidArgumentError(
            f"ad.SecondOrder({outer.name!r}, {inner.name!r}): the exact outer backend {outer.name!r} cannot "
            f"differentiate {inner.name!r}, whose gradient is numpy arithmetic {outer.name!r} does not trace; "
            f"pairs that work: {_WORKING_PAIRS}"
        )
    raise InvalidArgumentError(
        f"ad.SecondOrder({outer.name!r}, {inner.name!r}): {outer.name!r} cannot differentiate "
        f"{inner.name!r}'s code (wrapping one library's function for another is not supported yet); "
        f"pairs that work: {_WORKING_PAIRS}"
    )


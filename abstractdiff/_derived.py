"""The flat operators the core derives from an adapter's primitives.

``gradient`` is a pullback seeded with one (or pushforwards over a basis), ``jacobian``
is pullbacks over the output basis or pushforwards over the input basis, ``hessian`` is
the Jacobian of the gradient, ``hvp`` is forward-over-reverse (or reverse-over-reverse),
and the missing primitive comes from the Jacobian: DifferentiationInterface.jl's
derivations.  An adapter overrides one of these only where its library has a faster
native route (jax's jitted ``value_and_grad``, ``torch.func.hessian``...).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import numpy as np

from ._arrays import ar, check_scalar, dtype_name, shape_of, size_of
from ._hooks import AdapterHooks
from ._tree import HasArtefacts

FlatFn = Callable[[list, list], tuple]


class GradientFunction(HasArtefacts):
    """``xs -> gradient of fn at xs`` as a flat function, for second-order operators."""

    __slots__ = ("backend", "fn", "_artefacts")

    def __init__(self, backend: DerivedOperators, fn: FlatFn):
        self.backend, self.fn, self._artefacts = backend, fn, {}

    def __call__(self, xs: list, data: list) -> tuple[Any, None]:
        _, _, grads = self.backend.flat_value_and_gradient(self.fn, xs, data)
        return self.backend.complete(grads, xs)[0], None


class GradientDotTangent(HasArtefacts):
    """``xs -> <gradient of fn at xs, tangents>``: its gradient is the Hessian-vector product."""

    __slots__ = ("backend", "fn", "tangents", "_artefacts")

    def __init__(self, backend: DerivedOperators, fn: FlatFn, tangents: list):
        self.backend, self.fn, self.tangents, self._artefacts = backend, fn, tangents, {}

    def __call__(self, xs: list, data: list) -> tuple[Any, None]:
        _, _, grads = self.backend.flat_value_and_gradient(self.fn, xs, data)
        grads = self.backend.complete(grads, xs)
        total = sum(ar().do("sum", g * t) for g, t in zip(grads, self.tangents))
        return total, None


class DerivedOperators(AdapterHooks):
    """Flat operators derived from the primitives; each may be overridden for speed."""

    def one_hot(self, like: Any, index: int) -> Any:
        """An array shaped and typed like ``like`` with a single one at flat ``index``."""
        e = np.zeros(size_of(like), dtype=dtype_name(like))
        e[index] = 1
        return self.asarray(e.reshape(shape_of(like)))  # type: ignore[attr-defined]

    def complete(self, grads: Sequence[Any], xs: Sequence[Any]) -> list[Any]:
        """Replace ``None`` (an unconnected leaf) by zeros shaped like the input."""
        return [self.zeros_like(x) if g is None else g for g, x in zip(grads, xs)]

    def flat_value_and_gradient(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, list]:
        """``(y, aux, grads)``: a pullback seeded with one, or pushforwards over a basis."""
        if self.has_reverse:
            y, aux, vjp = self.flat_value_and_pullback(fn, xs, data)
            check_scalar(y)
            return y, aux, vjp(self.ones_like(y))
        y, aux, jvp = self.flat_value_and_pushforward(fn, xs, data)
        check_scalar(y)
        return y, aux, [self.forward_columns(jvp, xs, k, y) for k in range(len(xs))]

    def flat_prepare_value_and_gradient(self, fn: FlatFn, xs: list, data: list) -> Callable[[list, list], tuple]:
        """``run(xs, data) -> (y, aux, grads)`` for repeated calls on inputs shaped like ``xs``/``data``.

        Every ``value_and_gradient`` (prepared or not) calls the ``run`` built here once
        per flat function; adapters override it to hoist per-call work (cache lookups,
        dtype scopes, compilation) out of the loop.
        """
        return functools.partial(self.flat_value_and_gradient, fn)

    def flat_value_and_pullback_any(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """The pullback from the reverse primitive, or from the Jacobian in forward mode only."""
        if self.has_reverse:
            return self.flat_value_and_pullback(fn, xs, data)
        y, jacs = self.flat_jacobian(fn, xs, data)
        ny = size_of(y)
        a = ar()

        def vjp(dy: Any) -> list:
            flat_dy = a.do("reshape", dy, (1, ny))
            return [
                a.do("reshape", a.do("matmul", flat_dy, a.do("reshape", j, (ny, size_of(x)))), shape_of(x))
                for j, x in zip(jacs, xs)
            ]

        return y, None, vjp

    def flat_value_and_pushforward_any(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """The pushforward from the forward primitive, or from the Jacobian in reverse mode only."""
        if self.has_forward:
            return self.flat_value_and_pushforward(fn, xs, data)
        y, jacs = self.flat_jacobian(fn, xs, data)
        ny = size_of(y)
        a = ar()

        def jvp(ts: list) -> Any:
            total = None
            for j, x, t in zip(jacs, xs, ts):
                part = a.do("matmul", a.do("reshape", j, (ny, size_of(x))), a.do("reshape", t, (size_of(x), 1)))
                total = part if total is None else total + part
            return a.do("reshape", total, shape_of(y))

        return y, None, jvp

    def forward_columns(self, jvp: Callable, xs: list, k: int, y: Any) -> Any:
        """``d y / d xs[k]`` by one pushforward per element of ``xs[k]``; shape ``y.shape + xs[k].shape``."""
        a = ar()
        zeros = [self.zeros_like(x) for x in xs]
        cols = []
        for j in range(size_of(xs[k])):
            tangents = list(zeros)
            tangents[k] = self.one_hot(xs[k], j)
            cols.append(jvp(tangents))
        stacked = a.do("reshape", a.do("stack", cols), (len(cols), size_of(y)))
        return a.do("reshape", a.do("transpose", stacked), shape_of(y) + shape_of(xs[k]))

    def flat_jacobian(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, list]:
        """``(y, [J_k])`` with ``J_k.shape == y.shape + xs[k].shape``."""
        a = ar()
        n_in = sum(size_of(x) for x in xs)
        if self.has_reverse:
            y, _, vjp = self.flat_value_and_pullback(fn, xs, data)
            if not (self.has_forward and size_of(y) > n_in):
                rows = [self.complete(vjp(self.one_hot(y, i)), xs) for i in range(size_of(y))]
                jacs = [
                    a.do("reshape", a.do("stack", [row[k] for row in rows]), shape_of(y) + shape_of(x))
                    if rows
                    else self.asarray(np.zeros(shape_of(y) + shape_of(x), dtype=dtype_name(x)))  # type: ignore[attr-defined]
                    for k, x in enumerate(xs)
                ]
                return y, jacs
        y, _, jvp = self.flat_value_and_pushforward(fn, xs, data)
        return y, [self.forward_columns(jvp, xs, k, y) for k in range(len(xs))]

    def flat_hessian(self, fn: FlatFn, xs: list, data: list) -> Any:
        """Hessian of scalar ``fn`` with respect to its single input, ``x.shape * 2``."""
        _, jacs = self.flat_jacobian(GradientFunction(self, fn), xs, data)
        return jacs[0]

    def flat_hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> list:
        """Hessian-vector product: forward-over-reverse when possible, else reverse-over-reverse."""
        if self.has_forward and len(xs) == 1:
            _, _, jvp = self.flat_value_and_pushforward(GradientFunction(self, fn), xs, data)
            return [jvp(tangents)]
        _, _, hv = self.flat_value_and_gradient(GradientDotTangent(self, fn, tangents), xs, data)
        return self.complete(hv, xs)

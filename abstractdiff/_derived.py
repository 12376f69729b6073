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
import math
from typing import Any, Callable, Sequence

import numpy as np

from ._arrays import ar, check_scalar, dtype_name, shape_of, size_of
from ._hooks import DEFAULT_CHUNK_SIZE, AdapterHooks
from ._tree import HasArtefacts, artefacts

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


class DerivativeFunction(HasArtefacts):
    """``xs -> dfn/dx at xs`` (scalar ``x``) as a flat function, for second derivatives."""

    __slots__ = ("backend", "fn", "_artefacts")

    def __init__(self, backend: DerivedOperators, fn: FlatFn):
        self.backend, self.fn, self._artefacts = backend, fn, {}

    def __call__(self, xs: list, data: list) -> tuple[Any, None]:
        return self.backend.flat_value_and_derivative(self.fn, xs, data)[1], None


class PackedInput(HasArtefacts):
    """``fn`` of several leaves seen as a function of their concatenation, one vector.

    The block Hessian of ``fn`` is the Hessian of this function split into blocks: the
    derivation reuses the adapter's own single-input ``flat_hessian``.
    """

    __slots__ = ("fn", "shapes", "_artefacts")

    def __init__(self, fn: FlatFn, shapes: list[tuple[int, ...]]):
        self.fn, self.shapes, self._artefacts = fn, shapes, {}

    def __call__(self, zs: list, data: list) -> tuple[Any, Any]:
        (z,) = zs
        a = ar()
        leaves, start = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            leaves.append(a.do("reshape", z[start : start + n], shape))
            start += n
        return self.fn(leaves, data)


def _cached(fn: Any, backend: Any, what: str, key: Any, build: Callable[[], Any]) -> Any:
    """A helper function of ``fn`` built once per ``key`` and kept in ``fn``'s artefacts, so
    that compiled backends trace it once rather than on every call."""
    return artefacts(fn, backend, what).get(key, build)


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
        y, aux, jvps = self.flat_value_and_batched_pushforward(fn, xs, data)
        check_scalar(y)
        return y, aux, self.forward_jacobian(jvps, xs, y)

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

    # ------------------------------------------------------------- batched
    def flat_value_and_batched_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """``(y, aux, jvps)`` with ``jvps(stacked tangents) -> stacked dy``.

        Each tangent leaf carries a leading batch axis of length ``k`` (``(k,) + x.shape``)
        and so does the result (``(k,) + y.shape``).  The default loops over the batch with
        the pushforward; adapters vectorise it (``jax.vmap``, ``torch.func.vmap``).
        """
        # from the Jacobian in reverse mode only; with no primitive at all, the primitive's own error
        pushforward = self.flat_value_and_pushforward_any if self.has_reverse else self.flat_value_and_pushforward
        y, aux, jvp = pushforward(fn, xs, data)

        def jvps(ts: list) -> Any:
            with self.scope(ts):
                return ar().do("stack", [jvp([t[i] for t in ts]) for i in range(shape_of(ts[0])[0])])

        return y, aux, jvps

    def flat_value_and_batched_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """``(y, aux, vjps)`` with ``vjps(stacked dy) -> list of stacked dx`` (``None``: zeros).

        ``dy`` is shaped ``(k,) + y.shape`` and each ``dx`` ``(k,) + x.shape``.  The default
        loops over the batch with the pullback; adapters vectorise it.
        """
        pullback = self.flat_value_and_pullback_any if self.has_forward else self.flat_value_and_pullback
        y, aux, vjp = pullback(fn, xs, data)

        def vjps(dys: Any) -> list:
            with self.scope([dys]):  # indexing the batch is arithmetic too (paddle's static mode)
                rows = [self.complete(vjp(dys[i]), xs) for i in range(shape_of(dys)[0])]
                return [ar().do("stack", [row[k] for row in rows]) for k in range(len(xs))]

        return y, aux, vjps

    def complete_batched(self, grads: Sequence[Any], xs: Sequence[Any], k: int) -> list[Any]:
        """:meth:`complete` for a batch: ``None`` becomes zeros shaped ``(k,) + x.shape``."""
        return [
            self.asarray(np.zeros((k,) + shape_of(x), dtype=dtype_name(x))) if g is None else g  # type: ignore[attr-defined]
            for g, x in zip(grads, xs)
        ]

    def basis_chunks(self, n: int) -> list[tuple[int, int]]:
        """``[start, stop)`` ranges covering ``range(n)``: ``ceil(n / chunk_size)`` chunks of one
        width (the last one shorter), so a Jacobian costs that many batched calls."""
        if n == 0:
            return []
        count = -(-n // (self.chunk_size or DEFAULT_CHUNK_SIZE))
        width = -(-n // count)
        return [(start, min(start + width, n)) for start in range(0, n, width)]

    def _basis(self, like: Any, offset: int, start: int, stop: int, width: int) -> Any:
        """Rows ``start..stop`` of the identity, restricted to the leaf ``like`` whose flat elements
        begin at ``offset``, shaped ``(width,) + like.shape``; rows past ``stop`` are zeros (padding:
        every chunk has one shape, so a compiled backend traces its batched call once)."""
        n = size_of(like)
        e = np.zeros((width, n), dtype=dtype_name(like))
        for r in range(stop - start):
            j = start + r - offset
            if 0 <= j < n:
                e[r, j] = 1
        return self.asarray(e.reshape((width,) + shape_of(like)))  # type: ignore[attr-defined]

    def forward_jacobian(self, jvps: Callable, xs: list, y: Any) -> list:
        """``[d y / d xs[k]]`` by batched pushforwards of the input basis, one per chunk."""
        a = ar()
        sizes = [size_of(x) for x in xs]
        offsets = [sum(sizes[:k]) for k in range(len(xs))]
        chunks = self.basis_chunks(sum(sizes))
        if not chunks or size_of(y) == 0:
            return [self.asarray(np.zeros(shape_of(y) + shape_of(x), dtype=dtype_name(y))) for x in xs]  # type: ignore[attr-defined]
        width = chunks[0][1] - chunks[0][0]
        cols = []
        # the slicing and joining of the chunks are arithmetic on the library's arrays: in its
        # scope (jax's x64; paddle's dynamic mode, where a user's static mode would crash them)
        with self.scope([y, *xs]):
            for start, stop in chunks:
                out = jvps([self._basis(x, o, start, stop, width) for x, o in zip(xs, offsets)])
                cols.append(out[: stop - start])
            flat = a.do("transpose", a.do("reshape", a.do("concatenate", cols, axis=0), (sum(sizes), size_of(y))))
            return [
                a.do("reshape", flat[:, o : o + n], shape_of(y) + shape_of(x)) for x, o, n in zip(xs, offsets, sizes)
            ]

    def reverse_jacobian(self, vjps: Callable, xs: list, y: Any) -> list:
        """``[d y / d xs[k]]`` by batched pullbacks of the output basis, one per chunk."""
        a = ar()
        chunks = self.basis_chunks(size_of(y))
        if not chunks:
            return [self.asarray(np.zeros(shape_of(y) + shape_of(x), dtype=dtype_name(x))) for x in xs]  # type: ignore[attr-defined]
        width = chunks[0][1] - chunks[0][0]
        rows: list[list] = [[] for _ in xs]
        with self.scope([y, *xs]):  # as in forward_jacobian
            for start, stop in chunks:
                dxs = self.complete_batched(vjps(self._basis(y, 0, start, stop, width)), xs, width)
                for k, dx in enumerate(dxs):
                    rows[k].append(dx[: stop - start])
            return [
                a.do("reshape", a.do("concatenate", r, axis=0), shape_of(y) + shape_of(x)) for r, x in zip(rows, xs)
            ]

    def flat_jacobian(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, list]:
        """``(y, [J_k])`` with ``J_k.shape == y.shape + xs[k].shape``: batched pullbacks of the
        output basis, or batched pushforwards of the input basis (the fewer), in chunks of
        :attr:`chunk_size`."""
        n_in = sum(size_of(x) for x in xs)
        if self.has_reverse:
            y, _, vjps = self.flat_value_and_batched_pullback(fn, xs, data)
            if not (self.has_forward and size_of(y) > n_in):
                return y, self.reverse_jacobian(vjps, xs, y)
        return self._jacobian_in_mode(True, fn, xs, data)

    def _jacobian_in_mode(self, forward: bool, fn: FlatFn, xs: list, data: list) -> tuple[Any, list]:
        """``(y, [J_k])`` by batched pushforwards of the input basis, or batched pullbacks of the output's."""
        if forward:
            y, _, jvps = self.flat_value_and_batched_pushforward(fn, xs, data)
            return y, self.forward_jacobian(jvps, xs, y)
        y, _, vjps = self.flat_value_and_batched_pullback(fn, xs, data)
        return y, self.reverse_jacobian(vjps, xs, y)

    def jacobian_in_the_rules_mode(self, fn: FlatFn, xs: list, data: list, err: Exception) -> tuple[Any, list]:
        """``(y, [J_k])`` in the mode a custom rule has, where ``err`` (its refusal of the other
        mode, ``err.mode``) stopped the Jacobian's own route; else ``err`` is raised again."""
        mode = getattr(err, "mode", None)
        if mode == "reverse" and self.has_forward or mode == "forward" and self.has_reverse:
            return self._jacobian_in_mode(mode == "reverse", fn, xs, data)
        raise err

    def direct_prepared(self, prepared: Any, xs: list, data: list) -> Callable[..., Any] | None:
        """A prepared operator's whole call, ``(x, *args) -> result`` (``(x, v, *args)`` for
        ``hvp`` and ``gradient_and_hvp``), run by the library's own dispatcher, or ``None``
        (the default: ``prepared.check_and_run``, the core's check of the inputs against
        ``prepared.signature`` in Python, then ``prepared.preparation``).  An adapter whose
        library compares structure, shapes and dtypes itself on every call (jax's ``jit``)
        returns a function whose traced body is ``prepared.run_traced``, so that the core's
        check and run happen only when the library traces, that is for the first call and
        for every call whose signature changed: then the check raises
        :class:`~abstractdiff.ShapeMismatchError` as the core's would (the prepared operator
        an unprepared operator keeps for itself plans the new inputs instead); inputs it
        does not hand to its library go to ``prepared.check_and_run``.  Where traces are
        reused, the core tests ``prepared.unchanged()`` (whether ``f`` still reads what its
        trace holds) before each call, in a wrapper; a direct call may make that test itself,
        running ``prepared.refresh(x, *rest)`` when it fails, and say so with
        ``direct.tests_watch = True``, which saves the wrapper's frame (jax's does).
        """
        return None

    def flat_prepare_jacobian(self, fn: FlatFn, xs: list, data: list) -> Callable[[list, list], list]:
        """``run(xs, data) -> [J_k]`` (no value) for repeated calls on inputs like ``xs``/``data``.

        Every ``jacobian`` (prepared or not) calls the ``run`` built here once per flat
        function and input signature; adapters override it to hoist per-call work (a
        compiled Jacobian that skips the value, the choice of mode).
        """
        return lambda xs, data: self.flat_jacobian(fn, xs, data)[1]

    def flat_prepare_hvp(self, fn: FlatFn, xs: list, data: list) -> Callable[[list, list, list], list]:
        """``run(xs, data, tangents) -> [Hv_k]`` for repeated calls, as :meth:`flat_prepare_jacobian`."""
        return lambda xs, data, tangents: self.flat_hvp(fn, xs, data, tangents)

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

    # ------------------------------------------------ the rest of the operator family
    def flat_value_and_derivative(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any]:
        """``(y, dy/dx)`` for one scalar input: one pushforward, or the Jacobian in reverse mode only."""
        if self.has_forward:
            y, _, jvp = self.flat_value_and_pushforward(fn, xs, data)
            return y, jvp([self.ones_like(xs[0])])
        y, jacs = self.flat_jacobian(fn, xs, data)
        return y, jacs[0]

    def flat_second_derivative(self, fn: FlatFn, xs: list, data: list) -> Any:
        """``d2y/dx2`` for one scalar input, shaped like ``y``: the derivative of the derivative
        (forward over forward, or the Jacobian of the Jacobian in reverse mode only)."""
        inner = _cached(fn, self, "derivative function", None, lambda: DerivativeFunction(self, fn))
        return self.flat_value_and_derivative(inner, xs, data)[1]

    def flat_value_derivative_and_second_derivative(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Any]:
        """``(y, dy/dx, d2y/dx2)`` for one scalar input."""
        y, d = self.flat_value_and_derivative(fn, xs, data)
        return y, d, self.flat_second_derivative(fn, xs, data)

    def flat_hessian_blocks(self, fn: FlatFn, xs: list, data: list) -> list[list[Any]]:
        """The Hessian of scalar ``fn`` as blocks: ``blocks[i][j].shape == xs[i].shape + xs[j].shape``.

        One input: ``[[flat_hessian]]``.  Several: the :meth:`flat_hessian` of ``fn`` seen
        as a function of the concatenated inputs, split into blocks.
        """
        if len(xs) == 1:
            return [[self.flat_hessian(fn, xs, data)]]
        a = ar()
        shapes = [shape_of(x) for x in xs]
        sizes = [size_of(x) for x in xs]
        packed = _cached(fn, self, "packed input", tuple(shapes), lambda: PackedInput(fn, shapes))
        z = a.do("concatenate", [a.do("reshape", x, (n,)) for x, n in zip(xs, sizes)])
        h = self.flat_hessian(packed, [z], data)
        starts = [sum(sizes[:i]) for i in range(len(xs))]
        return [
            [
                a.do("reshape", h[si : si + ni, sj : sj + nj], shapes[i] + shapes[j])
                for j, (sj, nj) in enumerate(zip(starts, sizes))
            ]
            for i, (si, ni) in enumerate(zip(starts, sizes))
        ]

    def flat_value_gradient_and_hessian(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, list, list[list[Any]]]:
        """``(y, grads, blocks)``: the value and gradient, and :meth:`flat_hessian_blocks`."""
        y, _, grads = self.flat_value_and_gradient(fn, xs, data)
        check_scalar(y)
        return y, self.complete(grads, xs), self.flat_hessian_blocks(fn, xs, data)

    def flat_gradient_and_hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> tuple[list, list]:
        """``(grads, hv)``: the gradient and :meth:`flat_hvp`."""
        _, _, grads = self.flat_value_and_gradient(fn, xs, data)
        return self.complete(grads, xs), self.complete(self.flat_hvp(fn, xs, data, tangents), xs)

"""HIPS autograd: reverse mode by tracing numpy code on the CPU; no compilation.

autograd re-traces the function on every call (there is nothing to cache), boxes the
list of float leaves as one container (a single leaf bare), and differentiates through
``autograd.numpy`` ops only; backend-neutral functions reach those through ``autoray``.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import autograd
import autograd.extend
import autograd.numpy as anp
import numpy as np
import optree
from autograd.core import make_jvp, make_vjp
from autograd.numpy.numpy_boxes import ArrayBox
from autograd.tracer import Box

from abstractdiff._backend import Backend, check_scalar, shape_of, size_of
from abstractdiff._errors import ArgumentTypeError, CompositionError, DeviceError

FlatFn = Callable[[list, list], tuple]

_MISSING_JVP = re.compile(r"JVP of .* not defined")
# What numpy says when it meets an ArrayBox it cannot use: np.array(box, dtype=float),
# item assignment, float(box).
_BOX_MISUSE = re.compile(r"ArrayBox|setting an array element with a sequence")
_BOX_HINT = (
    "autograd backend: f received autograd ArrayBox values (the traced inputs) and a plain "
    "numpy operation could not handle them. Write f with autograd.numpy or autoray "
    "(`from autoray import numpy as anp`) instead of numpy conversions such as "
    "np.array(x, dtype=...) or float(x), and build arrays with anp.stack/anp.where: "
    "autograd has no in-place assignment (x[i] = ...)."
)


def _cast(g: Any, like: Any) -> Any:
    """``g`` with the dtype of ``like``: numpy upcasts float32 when mixed with float64 constants."""
    if not isinstance(g, Box):
        g = np.asarray(g)
    return g if g.dtype == like.dtype else g.astype(like.dtype)


class _Traced:
    """``fn`` as autograd's unary function of the boxed list of float leaves.

    A single leaf is traced bare: the list container costs a getitem node per leaf and
    makes a small gradient ~30% slower.

    Keeps ``aux`` and strips from it the boxes of this trace only, so that nested use
    still sees the outer trace's boxes.
    """

    def __init__(self, backend: AutogradBackend, fn: FlatFn, data: list, n: int, scalar: str | None = None):
        self.backend, self.fn, self.data, self.n, self.scalar = backend, fn, data, n, scalar
        self.aux: Any = None

    def __call__(self, boxed: Any) -> Any:
        self.backend.trace_count += 1
        xs = [boxed[i] for i in range(self.n)] if self.n != 1 else [boxed]
        y, aux = self.fn(xs, self.data)
        if self.scalar is not None:
            check_scalar(y, self.scalar)
        level = getattr(boxed, "_trace", None)
        # autograd warns ("Output seems independent of input") when y, or for second order
        # the gradient, does not depend on the traced inputs; silencing that per call would
        # reset the process-wide warning registry.  Adding a zero that depends on the inputs
        # keeps the values and connects the graph: unconnected gradients come out as zeros.
        if self.scalar in ("hessian", "hvp"):
            y = y + 0.0 * sum(anp.sum(x * x) for x in xs)  # x*x: its gradient depends on x too
        elif not (isinstance(y, Box) and y._trace == level):
            y = y + 0.0 * anp.sum(xs[0])
        if aux is not None:
            self.aux = optree.tree_map(lambda a: a._value if isinstance(a, Box) and a._trace == level else a, aux)
        return y


def _run(transform: Callable[[], Any]) -> Any:
    """Run an autograd transform, adding a hint to errors that come from numpy misuse."""
    try:
        return transform()
    except (TypeError, ValueError) as err:
        if _BOX_MISUSE.search(str(err)) and _BOX_HINT not in getattr(err, "__notes__", ()):
            err.add_note(_BOX_HINT)  # the user's exception itself, type unchanged
        raise


def _packed(xs: list) -> Any:
    return xs[0] if len(xs) == 1 else list(xs)


def _unpacked(gs: Any, n: int) -> list:
    return [gs] if n == 1 else list(gs)


def _primal(y: Any, xs: list, data: list) -> Any:
    """``f``'s value: a nested trace's box as it is, else an array no wider than the inputs'
    floats (numpy 2 promotes float32 arrays with float64 scalars such as ``np.log(2)``,
    where the other libraries keep float32: the dtype promise holds for values too)."""
    if isinstance(y, Box):
        return y
    y = np.asarray(y)
    if y.dtype.kind != "f" or any(getattr(x, "dtype", None) == y.dtype for x in xs):
        return y  # the common case, decided cheaply: y is no wider than an input
    floats = [a.dtype for a in (*xs, *data) if not isinstance(a, Box) and np.asarray(a).dtype.kind == "f"]
    if y.dtype.kind == "f" and floats:
        dtype = np.result_type(*floats)
        if dtype.itemsize < y.dtype.itemsize:  # widened by a Python or numpy scalar only
            y = y.astype(dtype)
    return y


class AutogradBackend(Backend):
    name = "autograd"
    extra = "autograd"
    modules = ("autograd",)

    def __init__(self, *, device: str | None = None, chunk_size: int | None = None, **options: Any):
        if options:
            raise ArgumentTypeError(
                f"autograd backend got unexpected option(s) {', '.join(map(repr, options))}; its only "
                f"options are device='cpu' and chunk_size (autograd runs eagerly on the CPU: there is "
                f"nothing to compile)"
            )
        super().__init__(device=device, chunk_size=chunk_size)
        #: Python executions of ``f`` under autograd tracing (autograd traces every call).
        self.trace_count = 0

    def normalise_device(self, device: str | None) -> str:
        if device is None or str(device).lower() in ("cpu", "cpu:0"):
            return "cpu"
        raise DeviceError(
            f"autograd backend: device {device!r} is not available; autograd runs on the CPU only "
            f"(numpy arrays). Available devices: cpu"
        )

    def is_native(self, a: Any) -> bool:
        return isinstance(a, (np.ndarray, ArrayBox))

    def snapshot(self, a: Any) -> Any:
        return a.copy() if isinstance(a, np.ndarray) else a  # a traced ArrayBox is never written in place

    def to_numpy(self, a: Any) -> np.ndarray:
        while isinstance(a, Box):  # an ArrayBox: unwrap to the primal value
            a = a._value
        return np.asarray(a)

    # ------------------------------------------------------------- composition
    def foreign_function(self, kernel: Any) -> Callable[[Any], Any]:
        # autograd primitives with the kernel's pullback (defvjp) and pushforward (defjvp).
        # Those two are primitives too, whose derivatives are the kernel's second
        # derivatives (with respect to the cotangent or tangent: each other; with respect
        # to x: kernel.second_vjp / second_jvp).  A third derivative raises, never a
        # silent zero.
        def refuse(*_: Any) -> Any:
            raise CompositionError(
                f"a third derivative through differentiate_with's boundary (autograd code calling a "
                f"{kernel.backend.name} kernel) is not supported: the boundary carries first and second "
                f"derivatives; write the kernel with autograd.numpy to nest further (an autograd kernel "
                f"nests natively)"
            )

        @autograd.extend.primitive
        def second_vjp(x: np.ndarray, dy: np.ndarray, v: np.ndarray) -> np.ndarray:
            return kernel.second_vjp(x, dy, v)

        @autograd.extend.primitive
        def second_jvp(x: np.ndarray, v: np.ndarray, w: np.ndarray) -> np.ndarray:
            return kernel.second_jvp(x, v, w)

        for op in (second_vjp, second_jvp):
            autograd.extend.defvjp(op, refuse, refuse, refuse)
            autograd.extend.defjvp(op, refuse, refuse, refuse)

        @autograd.extend.primitive
        def pullback(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
            return kernel.vjp(x, dy)

        @autograd.extend.primitive
        def pushforward(x: np.ndarray, dx: np.ndarray) -> np.ndarray:
            return kernel.jvp(x, dx)

        autograd.extend.defvjp(
            pullback,
            lambda ans, x, dy: lambda u: second_vjp(x, dy, u),
            lambda ans, x, dy: lambda u: pushforward(x, u),
        )
        autograd.extend.defjvp(
            pullback,
            lambda x_dot, ans, x, dy: second_vjp(x, dy, x_dot),
            lambda dy_dot, ans, x, dy: pullback(x, dy_dot),
        )
        autograd.extend.defvjp(
            pushforward,
            lambda ans, x, dx: lambda w: second_vjp(x, w, dx),
            lambda ans, x, dx: lambda w: pullback(x, w),
        )
        autograd.extend.defjvp(
            pushforward,
            lambda x_dot, ans, x, dx: second_jvp(x, dx, x_dot),
            lambda dx_dot, ans, x, dx: pushforward(x, dx_dot),
        )

        @autograd.extend.primitive
        def foreign(x: np.ndarray) -> np.ndarray:
            return kernel.value(x)

        autograd.extend.defvjp(foreign, lambda ans, x: lambda dy: pullback(x, dy))
        autograd.extend.defjvp(foreign, lambda dx, ans, x: pushforward(x, dx))
        return foreign

    # ------------------------------------------------------------- primitives
    def _trace_reverse(self, fn: FlatFn, xs: list, data: list, scalar: str | None = None):
        traced = _Traced(self, fn, data, len(xs), scalar)
        vjp, y = _run(lambda: make_vjp(traced, _packed(xs)))
        return _primal(y, xs, data), traced.aux, vjp

    def flat_value_and_pullback(self, fn: FlatFn, xs: list, data: list, scalar: str | None = None):
        y, aux, vjp = self._trace_reverse(fn, xs, data, scalar)

        def pullback(dy: Any) -> list:
            # The backward pass runs no user code: no _run needed.
            return [_cast(g, x) for g, x in zip(_unpacked(vjp(dy), len(xs)), xs)]

        return y, aux, pullback

    def flat_value_and_pushforward(self, fn: FlatFn, xs: list, data: list):
        # autograd's forward mode re-runs f for each tangent, so the value comes from a
        # plain call.  Some primitives (numpy.linalg) have no JVP rule: for them the
        # tangent is a reverse-of-reverse product (vjp is linear in its cotangent, so
        # the vjp of the vjp is the jvp), as autograd's make_jvp_reversemode does.
        y, aux = _run(lambda: fn(xs, data))
        y = _primal(y, xs, data)
        state = {"reverse": None}

        def pushforward(ts: list) -> Any:
            if state["reverse"] is None:
                try:
                    _, dy = _run(lambda: make_jvp(_Traced(self, fn, data, len(xs)), _packed(xs))(_packed(ts)))
                    return _cast(dy, y)
                except NotImplementedError as err:
                    if not _MISSING_JVP.search(str(err)):
                        raise
                    _, _, vjp = self._trace_reverse(fn, xs, data)
                    state["reverse"] = _run(lambda: make_vjp(vjp, np.zeros(shape_of(y), dtype=y.dtype))[0])
            return _cast(state["reverse"](_packed(ts)), y)

        return y, aux, pushforward

    # ------------------------------------------------------ fast overrides
    def flat_value_and_gradient(self, fn: FlatFn, xs: list, data: list):
        # The scalar check runs inside the trace, before autograd's own (a TypeError).
        y, aux, vjp = self.flat_value_and_pullback(fn, xs, data, scalar="gradient")
        return y, aux, vjp(np.ones((), dtype=y.dtype))

    # flat_jacobian is the core's: chunks of chunk_size basis rows, one batched pullback each
    # (autograd has no vmap, so a batch is a loop of vjps of one trace, as autograd.jacobian's)

    def flat_hessian(self, fn: FlatFn, xs: list, data: list) -> Any:
        if self.chunk_size is not None:  # autograd.hessian has no chunks: the core's, of the gradient
            return super().flat_hessian(fn, xs, data)
        (x,) = xs
        traced = _Traced(self, fn, data, 1, scalar="hessian")
        if size_of(x) == 0:  # autograd.hessian stacks no rows and fails; an empty x's Hessian is known
            _run(lambda: traced(x))  # f still runs once, so its output is checked as for any x
            return np.zeros(shape_of(x) * 2, dtype=x.dtype)
        h = _run(lambda: autograd.hessian(traced)(x))
        return _cast(h, x)

    def flat_hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> list:
        # make_hvp: the vjp of the gradient (reverse-over-reverse); H is symmetric.
        traced = _Traced(self, fn, data, len(xs), scalar="hvp")
        hvp, _ = _run(lambda: autograd.make_hvp(traced)(_packed(xs)))
        return [_cast(h, x) for h, x in zip(_unpacked(hvp(_packed(tangents)), len(xs)), xs)]


# ---------------------------------------------------------------------------------------
# Portable functions: autoray translations for numpy/scipy calls that autograd lacks, or
# has without a derivative (docs/guide/portable.md, conformance_tests/test_portable.py).
# Each takes numpy's/scipy's arguments and is built from autograd.numpy/autograd.scipy
# ops (or is an autograd primitive with its VJP), so autograd differentiates it.
# Registered when this adapter is imported, i.e. when an autograd backend is created.
def _register_portable_functions() -> None:
    import autograd.scipy.linalg
    import autograd.scipy.special
    import autoray
    from abstractdiff.adapters import finite_differences
    from autograd.extend import defvjp, primitive
    from autograd.tracer import getval

    # f also sees plain numpy arrays (its data, which autograd does not box): numpy's
    # short names (logsumexp, linalg.solve_triangular) come from the numpy adapter.
    finite_differences._register_portable_functions()
    special = autograd.scipy.special

    def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
        if return_sign:
            raise NotImplementedError("logsumexp(return_sign=True) is not differentiable by autograd")
        if b is None:
            return special.logsumexp(a, axis=axis, keepdims=keepdims)
        return special.logsumexp(a, axis=axis, b=b, keepdims=keepdims)

    def log_softmax(x, axis=None):
        return x - logsumexp(x, axis=axis, keepdims=True)

    def softmax(x, axis=None):
        return anp.exp(log_softmax(x, axis=axis))

    def xlogy(x, y):
        zero = x == 0
        return anp.where(zero, 0.0, x * anp.log(anp.where(zero, 1.0, y)))

    def unary(op: Callable) -> Callable:
        def numpy_like(x):
            return op(x)

        return numpy_like

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        return autograd.scipy.linalg.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit_diagonal)

    def take_along_axis(arr, indices, axis):
        # fancy indexing (differentiable), as numpy builds it: arange over arr's other axes
        if axis is None:
            arr, axis = anp.ravel(arr), 0
        indices = getval(indices)
        ndim = anp.ndim(arr)
        axis = axis % ndim
        index = []
        for d, n in enumerate(anp.shape(arr)):
            if d == axis:
                index.append(indices)
            else:
                index.append(np.arange(n).reshape([n if k == d else 1 for k in range(ndim)]))
        return arr[tuple(index)]

    def sort(a, axis=-1, kind=None, order=None):
        # autograd's sort has a gradient for vectors only
        if axis is None:
            a, axis = anp.ravel(a), 0
        return take_along_axis(a, np.argsort(getval(a), axis=axis, kind=kind), axis)

    def cumprod(a, axis=None, dtype=None, out=None):
        # no VJP for cumprod in autograd: running products, which it differentiates
        if dtype is not None or out is not None:
            raise NotImplementedError("dtype= and out= are not supported by autograd")
        if axis is None:
            a, axis = anp.ravel(a), 0
        moved = anp.moveaxis(a, axis, 0)
        if anp.shape(moved)[0] == 0:
            return a
        rows = [moved[0]]
        for k in range(1, anp.shape(moved)[0]):
            rows.append(rows[-1] * moved[k])
        return anp.moveaxis(anp.stack(rows), 0, axis)

    def flip(m, axis=None):
        # no VJP for flip in autograd: reversed slices
        ndim = anp.ndim(m)
        axes = range(ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
        index = [slice(None)] * ndim
        for ax in axes:
            index[ax % ndim] = slice(None, None, -1)
        return m[tuple(index)]

    def diagonal(a, offset=0, axis1=0, axis2=1):
        # autograd's VJP of diagonal takes offset=0 on the last two axes only
        moved = anp.moveaxis(a, (axis1, axis2), (-2, -1))
        n, m = anp.shape(moved)[-2:]
        rows = np.arange(max(0, -offset), max(0, min(n, m - offset)))
        return moved[..., rows, rows + offset]

    def pad(array, pad_width, mode="constant", **kwargs):
        # autograd's VJP of pad needs mode passed explicitly (it has no default there)
        return anp.pad(array, pad_width, mode, **kwargs)

    # numpy.copy has no derivative in autograd: a primitive with the identity's, to every order
    copied = autograd.extend.primitive(lambda a: np.array(a, copy=True))
    autograd.extend.defvjp(copied, lambda ans, a: lambda g: g)
    autograd.extend.defjvp(copied, lambda g, ans, a: g)

    def copy(a):
        return copied(a)

    def broadcast_to(array, shape):
        # autograd's VJP of broadcast_to cannot add leading axes: add them first
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        lead = len(shape) - anp.ndim(array)
        return anp.broadcast_to(anp.reshape(array, (1,) * lead + anp.shape(array)), shape)

    def eigvalsh(a, UPLO="L"):
        return anp.linalg.eigh(a, UPLO)[0]

    @primitive
    def qr_primitive(a, mode):
        q, r = np.linalg.qr(a, mode)
        return q, r

    def qr_vjp(ans, a, mode):
        q, r = ans
        m, n = anp.shape(a)[-2:]

        def transpose(x):
            return anp.swapaxes(x, -1, -2)

        def times_inverse_rt(x):  # x @ inv(r).T
            return transpose(anp.linalg.solve(r, transpose(x)))

        def vjp(g):
            # TensorFlow's QrGrad (m >= n, reduced R): Liao et al., arXiv:1903.09650, eq. (5)
            if m < n or (mode == "complete" and m != n):
                raise NotImplementedError("the derivative of qr needs rows >= columns and mode='reduced'")
            dq, dr = g
            qdq = transpose(q) @ dq
            rdr = r @ transpose(dr)
            lower = anp.tril(qdq - transpose(qdq) + rdr - transpose(rdr))
            return q @ (dr + times_inverse_rt(lower)) + times_inverse_rt(dq - q @ qdq)

        return vjp

    defvjp(qr_primitive, qr_vjp)

    def qr(a, mode="reduced"):
        # autograd has no derivative for qr: a primitive with one, for the (Q, R) modes
        if mode in ("reduced", "complete"):
            return qr_primitive(a, mode)
        return anp.linalg.qr(a, mode)

    functions = {
        "logsumexp": logsumexp,
        "scipy.special.logsumexp": logsumexp,
        "scipy.special.erf": unary(special.erf),
        "scipy.special.erfc": unary(special.erfc),
        "scipy.special.expit": unary(special.expit),
        "scipy.special.logit": unary(special.logit),
        "scipy.special.gammaln": unary(special.gammaln),
        "scipy.special.digamma": unary(special.digamma),
        "scipy.special.xlogy": xlogy,
        "scipy.special.softmax": softmax,
        "scipy.special.log_softmax": log_softmax,
        "linalg.solve_triangular": solve_triangular,
        "scipy.linalg.solve_triangular": solve_triangular,
        "linalg.eigvalsh": eigvalsh,
        "linalg.qr": qr,
        "take_along_axis": take_along_axis,
        "sort": sort,
        "cumprod": cumprod,
        "flip": flip,
        "diagonal": diagonal,
        "pad": pad,
        "copy": copy,
        "broadcast_to": broadcast_to,
    }
    for name, fn in functions.items():
        autoray.register_function("autograd", name, fn)

    # Comparisons of autograd's boxes give plain numpy arrays, so where(x > 0, x, y)
    # dispatches on the numpy mask: numpy's where hands traced values to autograd's.
    def where_for_boxes(numpy_where: Callable) -> Callable:
        def where(condition, *args, **kwargs):
            if any(isinstance(a, Box) for a in args):
                return anp.where(condition, *args, **kwargs)
            return numpy_where(condition, *args, **kwargs)

        return where

    autoray.register_function("numpy", "where", where_for_boxes, wrap=True)


_register_portable_functions()

"""paddle's translations of numpy/scipy calls (docs/guide/portable.md): the names paddle lacks,
takes differently, or cannot differentiate twice.

paddle 3.3 has no double grad for max, min, prod, logsumexp, softmax, p_norm, diagonal, tril,
inverse, cholesky... (a Hessian or a pushforward through them fails), and its gradients of
``linalg.solve`` and ``triangular_solve`` are wrong or crash with a constant operand.  Each
translation takes numpy's arguments and is built from paddle ops that have derivatives of every
order and keep dtype and place; the linear algebra uses PyLayers with explicit adjoints
(``_Solve``, ``_Inverse``, ``_Slogdet``, ``_Cholesky`` in :func:`translations`).  Where f
meets one of these gaps anyway, :func:`explained` turns paddle's message into one that names
the op and the fix (these translations among them).  The adapter imports the helpers both need
(:func:`_arrays`, :func:`_fresh`, :func:`_needs_grad`) from here.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

from .._errors import AbstractDiffError, ArgumentTypeError, CompositionError, InvalidArgumentError
from . import Table


def _arrays() -> tuple[type, ...]:
    """paddle's arrays: eager tensors, and the symbolic values f sees while to_static traces it."""
    import paddle

    return (paddle.Tensor, paddle.pir.Value)


def _fresh(x: Any) -> Any:
    # detach() makes a new tensor object sharing x's memory: the caller's tensor, its
    # stop_gradient flag and its .grad are never touched.
    t = x.detach()
    t.stop_gradient = False
    return t


def _needs_grad(t: Any) -> bool:
    import paddle  # imported by the adapter already: a lookup in sys.modules

    return isinstance(t, paddle.Tensor) and not t.stop_gradient


# ------------------------------------------------ what paddle's failures mean
#: What paddle says when an op has no derivative of its gradient (max, prod, softmax...).
_NO_SECOND_DERIVATIVE = "doesn't have any grad op"
#: What paddle 3.3 says when a double-grad kernel wants the gradient of an input nobody
#: asked for (pow's: the derivative of an inner gradient of x**2 with respect to other inputs).
MISSING_INPUT_GRADIENT = "can not be nullptr"
_SECOND_DERIVATIVE_HINT = (
    "paddle backend: f uses an op whose gradient paddle 3.3 cannot differentiate (its *_grad op has no grad "
    "op: max, min, prod, cumprod, logsumexp, softmax, log_softmax, linalg.norm, sort, einsum and strided "
    "slices x[::2] among others), and second derivatives (hessian, hvp, an operator nested in another) need "
    "one. Through autoray, max, min, prod, logsumexp, softmax and log_softmax are translated to ops that "
    "paddle differentiates twice; elsewhere, write f with such ops."
)
_POW_HINT = (
    "paddle backend: paddle 3.3's higher-order derivative kernels of pow (x**k) fail in some nested "
    "uses (a third derivative, or an outer derivative through an inner pushforward); written as a "
    "product (x * x * x), the same function avoids them."
)
#: (what paddle says, the note abstractdiff adds) for paddle's higher-order failures
_HINTS = (
    (_NO_SECOND_DERIVATIVE, _SECOND_DERIVATIVE_HINT),
    (MISSING_INPUT_GRADIENT, _POW_HINT),
    ("MetaTensor is not initialized", _POW_HINT),
)


#: paddle 3.3's words for an op whose gradient has no derivative of its own (diagonal_grad...)
_NO_GRAD_OP = re.compile(r"The Op (\w+) doesn't have any grad op")
#: ... for a kernel its build lacks in a dtype (its CPU build has no float16 sin, multiply...)
_NO_KERNEL = re.compile(r"kernel with key \((\w+), [^,]*, (\w+)\) of kernel `(\w+)` is not registered")
#: ... for a second derivative through concat or stack of a constant with differentiated tensors
_EMPTY_GRAD_SLOT = "Unable to fill empty grad inputs"
_SECOND_ORDER_FIX = (
    'ad.SecondOrder("finite_differences", b) (second-order operators as finite differences of paddle\'s '
    "exact gradient)"
)


def explained(err: BaseException) -> Exception | None:
    """An abstractdiff error for a paddle failure whose cause and fix abstractdiff knows
    (:func:`_translated`), else ``None``, after adding a note to ``err`` where one helps
    (:data:`_HINTS`)."""
    message = str(err)
    if not isinstance(err, AbstractDiffError):  # else already ours (an operator nested in another)
        translated = _translated(message)
        if translated is not None:
            return translated
    if isinstance(err, (RuntimeError, ValueError)):
        notes = getattr(err, "__notes__", ())
        for pattern, hint in _HINTS:
            if pattern in message and hint not in notes:
                err.add_note(hint)
    return None


def _translated(message: str) -> Exception | None:
    """paddle raises these as RuntimeError or SystemError with its own internals in the message
    (the grad op, the kernel key): the user needs which operation failed, why, and what to do."""
    missing = _NO_GRAD_OP.search(message)
    if missing is not None:
        op = missing.group(1)
        out: Exception = CompositionError(
            f"paddle backend: paddle 3.3 has no derivative of {op}, the gradient of paddle's "
            f"{op.removesuffix('_grad')} (paddle: \"The Op {op} doesn't have any grad op\"), and a second "
            f"derivative (hessian, hvp, forward mode through a gradient, an operator nested in another) needs "
            f"one. Use {_SECOND_ORDER_FIX}, or write f with the portable functions (docs/guide/portable.md), "
            f"which the paddle backend translates to ops that paddle differentiates twice"
        )
        out.add_note(_SECOND_DERIVATIVE_HINT)
        return out
    kernel = _NO_KERNEL.search(message)
    if kernel is not None:
        device, dtype, op = kernel.groups()
        return ArgumentTypeError(
            f"paddle backend: this paddle build has no {dtype} kernel of {op} on the {device} (paddle: "
            f"\"The kernel with key ({device}, ..., {dtype}) of kernel `{op}` is not registered\"); compute in "
            f"float32 on the {device} (x.astype('float32'), and float32 data), or in {dtype} on a GPU where "
            f"paddle has such kernels (ad.backend('paddle', device='gpu'))"
        )
    if _EMPTY_GRAD_SLOT in message:
        return CompositionError(
            "paddle backend: paddle 3.3 cannot take a second derivative through paddle.concat or paddle.stack of "
            "a constant with differentiated tensors (paddle: \"Unable to fill empty grad inputs due to empty "
            "GradSlotMeta\"). Join them with autoray's concatenate or stack (the paddle backend translates "
            f"them so that this works), give the constant stop_gradient=False, or use {_SECOND_ORDER_FIX}"
        )
    return None


def translations() -> Table:
    # imported here: importing this module imports nothing heavy.  A paddle backend applies
    # this table, and its adapter has imported paddle by then (safely after TensorFlow).
    import paddle

    array_types = _arrays()

    # Linear solves with their adjoint.  paddle 3.3's own gradients of paddle.linalg.solve and
    # paddle.linalg.triangular_solve are wrong when only one of the two operands is
    # differentiated (a constant right-hand side: a GP likelihood's data): triangular_solve's
    # gradient with respect to the matrix reads the unset gradient of the right-hand side (off
    # by 100% and more, different from call to call), solve's crashes the process (a segfault);
    # and triangular_solve's gradient has no derivative of its own.
    def _mT(a: Any) -> Any:
        perm = list(range(a.ndim))
        perm[-2], perm[-1] = perm[-1], perm[-2]
        return paddle.transpose(a, perm)

    _FLIPPED = {None: None, "lower": "upper", "upper": "lower"}

    def _constant(values: np.ndarray, like: Any, dtype: Any = None) -> Any:
        """``values`` as a tensor where ``like`` is (a value to_static traces has no place: where the program runs)."""
        return paddle.to_tensor(values, dtype=dtype, place=None if isinstance(like, paddle.pir.Value) else like.place)

    def _triangle(a: Any, triangle: str, k: int = 0) -> Any:
        """``tril(a, k)`` or ``triu(a, k)`` as a product with a constant mask: paddle 3.3's tril_grad
        and triu_grad have no derivative of their own."""
        n, m = int(a.shape[-2]), int(a.shape[-1])
        return a * _constant((np.tril if triangle == "lower" else np.triu)(np.ones((n, m)), k), a, a.dtype)

    class _Solve(paddle.autograd.PyLayer):
        """``x = a^{-1} b`` for a matrix right-hand side ``b`` (``..., n, k``) and ``a`` square
        (``triangle=None``) or triangular (``"lower"``, ``"upper"``: only that triangle is read).

        The adjoint: ``db = a^{-T} dx`` and ``da = -db x^T`` (its triangle, for a triangular ``a``),
        written with this layer again, so that derivatives of every order are right.
        """

        @staticmethod
        def forward(ctx: Any, a: Any, b: Any, triangle: str | None) -> Any:
            ctx.triangle, ctx.needs = triangle, (not a.stop_gradient, not b.stop_gradient)
            ctx.save_for_backward(a, b)
            if triangle is None:
                return paddle.linalg.solve(a, b)
            return paddle.linalg.triangular_solve(a, b, upper=triangle == "upper")

        @staticmethod
        def backward(ctx: Any, dx: Any) -> tuple[Any, Any]:
            a, b = ctx.saved_tensor()
            triangle = ctx.triangle
            db = _Solve.apply(_mT(a), dx, _FLIPPED[triangle])
            da = None
            if ctx.needs[0]:
                # x again, as a function of a and b (not the saved value): a second derivative sees it
                da = -(db @ _mT(_Solve.apply(a, b, triangle)))
                da = da if triangle is None else _triangle(da, triangle)
            return da, (db if ctx.needs[1] else None)

    class _Inverse(paddle.autograd.PyLayer):
        """``inv(a)``, whose adjoint ``-inv^T g inv^T`` uses this layer again (paddle 3.3's
        inverse_grad has no derivative of its own)."""

        @staticmethod
        def forward(ctx: Any, a: Any) -> Any:
            ctx.save_for_backward(a)
            return paddle.linalg.inv(a)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (a,) = ctx.saved_tensor()
            inverse_t = _mT(_Inverse.apply(a))
            return -(inverse_t @ g @ inverse_t)

    class _Slogdet(paddle.autograd.PyLayer):
        """``(sign, log|det a|)``: ``d log|det a| = tr(a^{-1} da)``, with :class:`_Inverse`
        (paddle 3.3's slogdet_grad has no derivative of its own)."""

        @staticmethod
        def forward(ctx: Any, a: Any) -> tuple[Any, Any]:
            ctx.save_for_backward(a)
            out = paddle.linalg.slogdet(a)  # sign and log|det| stacked on a first axis
            return out[0], out[1]

        @staticmethod
        def backward(ctx: Any, dsign: Any, dlog: Any) -> Any:
            (a,) = ctx.saved_tensor()
            if dlog is None:  # the sign alone: constant almost everywhere
                return paddle.zeros_like(a)
            return dlog.unsqueeze(-1).unsqueeze(-1) * _mT(_Inverse.apply(a))

    def _phi(a: Any) -> Any:
        # the lower triangle, with half the diagonal
        return _triangle(a, "lower") - 0.5 * a * _constant(np.eye(int(a.shape[-1])), a, a.dtype)

    class _Cholesky(paddle.autograd.PyLayer):
        """numpy's (lower) ``cholesky(a)``, whose adjoint (JAX's) uses this layer and
        :class:`_Inverse` again (paddle 3.3's cholesky_grad has no derivative of its own)."""

        @staticmethod
        def forward(ctx: Any, a: Any) -> Any:
            ctx.save_for_backward(a)
            return paddle.linalg.cholesky(a)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (a,) = ctx.saved_tensor()
            lower = _Cholesky.apply(a)
            inverse = _Inverse.apply(lower)
            out = _mT(inverse) @ _phi(_mT(lower) @ g) @ inverse
            return 0.5 * (out + _mT(out))

    def _solved(a: Any, b: Any, triangle: str | None) -> Any:
        """numpy's ``solve(a, b)`` (a 1-D ``b`` is a vector, batch axes broadcast) through :class:`_Solve`."""
        vector = b.ndim == 1
        if vector:
            b = b.unsqueeze(-1)
        batch = list(np.broadcast_shapes(tuple(int(d) for d in a.shape[:-2]), tuple(int(d) for d in b.shape[:-2])))
        if [int(d) for d in a.shape[:-2]] != batch:
            a = paddle.broadcast_to(a, batch + [int(d) for d in a.shape[-2:]])
        if [int(d) for d in b.shape[:-2]] != batch:
            b = paddle.broadcast_to(b, batch + [int(d) for d in b.shape[-2:]])
        x = _Solve.apply(a, b, triangle)
        return x.squeeze(-1) if vector else x

    def _merged(a: Any, axis: Any) -> tuple[Any, list[int]]:
        """``a`` with the axes ``axis`` (None: all) moved last and merged into one, and the
        shape of a reduction over them with ``keepdims=True``."""
        ndim, shape = a.ndim, [int(d) for d in a.shape]
        if axis is None:
            axes = list(range(ndim))
        else:
            axes = sorted({int(ax) % max(ndim, 1) for ax in (axis if isinstance(axis, (tuple, list)) else (axis,))})
        kept = [i for i in range(ndim) if i not in axes]
        if kept + axes != list(range(ndim)):
            a = paddle.transpose(a, kept + axes)
        return a.reshape([shape[i] for i in kept] + [-1]), [1 if i in axes else d for i, d in enumerate(shape)]

    names = {
        paddle.bool: "bool", paddle.int8: "int8", paddle.int16: "int16", paddle.int32: "int32",
        paddle.int64: "int64", paddle.uint8: "uint8", paddle.float16: "float16", paddle.bfloat16: "bfloat16",
        paddle.float32: "float32", paddle.float64: "float64", paddle.complex64: "complex64",
        paddle.complex128: "complex128",
    }

    def get_dtype_name(x: Any) -> str:
        # autoray 0.11 maps paddle's legacy dtype names ("FP64"); paddle 3 names them "FLOAT64"
        return names[x.dtype]

    def finish(r: Any, keepdims_shape: list[int], keepdims: bool) -> Any:
        return r.reshape(keepdims_shape) if keepdims else r

    def extremum(arg: Callable) -> Callable:
        # the value at the arg-extremum: gather has derivatives of every order, max_grad none
        def numpy_like(a, axis=None, out=None, keepdims=False, initial=None, where=None):
            if out is not None or initial is not None or where is not None:
                raise NotImplementedError("out=, initial= and where= are not supported on paddle tensors")
            b, keepdims_shape = _merged(a, axis)
            r = paddle.take_along_axis(b, arg(b, axis=-1, keepdim=True), axis=-1).squeeze(-1)
            return finish(r, keepdims_shape, keepdims)

        return numpy_like

    def prod(a, axis=None, dtype=None, out=None, keepdims=False, initial=None, where=None):
        # products of pairs, log2(n) times: prod_grad has no derivative of its own
        if out is not None or initial is not None or where is not None:
            raise NotImplementedError("out=, initial= and where= are not supported on paddle tensors")
        b, keepdims_shape = _merged(a if dtype is None else paddle.cast(a, dtype), axis)
        while int(b.shape[-1]) > 1:
            if int(b.shape[-1]) % 2:
                b = paddle.concat([b, paddle.ones_like(b[..., :1])], axis=-1)
            b = b.reshape([int(d) for d in b.shape[:-1]] + [-1, 2])
            b = b[..., 0] * b[..., 1]
        r = paddle.ones(b.shape[:-1], dtype=b.dtype) if int(b.shape[-1]) == 0 else b[..., 0]  # empty: one
        return finish(r, keepdims_shape, keepdims)

    def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
        if b is not None or return_sign:
            raise NotImplementedError("b= and return_sign= are not supported on paddle tensors")
        merged, keepdims_shape = _merged(a, axis)
        # the shift cancels in every derivative, so it needs none: detached (and 0 where the
        # maximum is infinite, which would give inf - inf)
        m = paddle.max(merged.detach(), axis=-1, keepdim=True)
        m = paddle.where(paddle.isfinite(m), m, paddle.zeros_like(m))
        r = (m + paddle.log(paddle.sum(paddle.exp(merged - m), axis=-1, keepdim=True))).squeeze(-1)
        return finish(r, keepdims_shape, keepdims)

    def log_softmax(x, axis=None):
        return x - logsumexp(x, axis=axis, keepdims=True)

    def softmax(x, axis=None):
        return paddle.exp(log_softmax(x, axis=axis))

    def moment(root: bool) -> Callable:
        # numpy's ddof=0 by default; paddle.std/var default to unbiased=True, and take no ddof
        def numpy_like(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
            if dtype is not None or out is not None:
                raise NotImplementedError("dtype= and out= are not supported on paddle tensors")
            b, keepdims_shape = _merged(a, axis)
            centred = b - paddle.mean(b, axis=-1, keepdim=True)
            var = paddle.sum(centred * centred, axis=-1) / (int(b.shape[-1]) - ddof)
            return finish(paddle.sqrt(var) if root else var, keepdims_shape, keepdims)

        return numpy_like

    def take(a, indices, axis=None, out=None, mode=None):
        if out is not None or mode is not None:
            raise NotImplementedError("out= and mode= are not supported on paddle tensors")
        indices = indices if isinstance(indices, array_types) else paddle.to_tensor(np.asarray(indices))
        if axis is None:
            a, axis = a.reshape([-1]), 0
        axis = int(axis) % a.ndim
        shape = [int(d) for d in a.shape]
        picked = paddle.index_select(a, indices.reshape([-1]), axis=axis)
        return picked.reshape(shape[:axis] + [int(d) for d in indices.shape] + shape[axis + 1:])

    def qr(a, mode="reduced"):
        if mode not in ("reduced", "complete"):
            raise NotImplementedError(f"mode={mode!r} is not supported on paddle tensors (reduced, complete)")
        q, r = paddle.linalg.qr(a, mode=mode)
        # paddle 3.3's QR gradient crashes the process (a segfault in QrGradKernel) unless
        # both Q and R get a cotangent: a zero ties each to the other, so that using one
        # of them is enough
        tie = 0.0 * (paddle.sum(q) + paddle.sum(r))
        return q + tie, r + tie

    def like(value: Any, ref: Any) -> Any:
        """A Python or numpy scalar as a tensor of ``ref``'s dtype and place (numpy's weak scalars)."""
        if isinstance(value, array_types):
            return value
        # a traced value (to_static) has no place: the constant goes where the program runs
        return paddle.to_tensor(value, dtype=ref.dtype, place=ref.place if isinstance(ref, paddle.Tensor) else None)

    def scalar_second(op: Callable) -> Callable:
        # numpy takes a Python scalar second argument (np.maximum(x, 0.0)); paddle wants a tensor
        def numpy_like(x1, x2):
            return op(x1, like(x2, x1))

        return numpy_like

    def unary(op: Callable) -> Callable:
        def numpy_like(x):
            return op(x)

        return numpy_like

    def expand_dims(a, axis):
        return paddle.unsqueeze(a, axis)

    def cumprod(a, axis=None, dtype=None, out=None):
        if out is not None:
            raise NotImplementedError("out= is not supported on paddle tensors")
        a = a if dtype is None else paddle.cast(a, dtype)
        return paddle.cumprod(a.reshape([-1]) if axis is None else a, dim=0 if axis is None else axis)

    def dot(a, b):
        # numpy.dot: a product with a 0-d array, else a sum over a's last axis and b's
        # second-to-last (its only one for a vector); paddle.dot takes vectors only.
        b = like(b, a)
        if a.ndim == 0 or b.ndim == 0:
            return a * b
        return paddle.tensordot(a, b, axes=([a.ndim - 1], [max(b.ndim - 2, 0)]))

    def roll(a, shift, axis=None):
        return paddle.roll(a, shift, axis=axis)

    def repeat(a, repeats, axis=None):
        if not isinstance(repeats, int):
            repeats = paddle.to_tensor(np.asarray(repeats))
        return paddle.repeat_interleave(a, repeats, axis=axis)

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        if trans in (2, "C"):
            raise NotImplementedError("trans='C' is not supported on paddle tensors (real matrices: use 'T')")
        if unit_diagonal:  # the diagonal is not read: ones, and no derivative
            a = _triangle(a, "lower", -1) + _triangle(a, "upper", 1) + paddle.eye(int(a.shape[-1]), dtype=a.dtype)
        if trans in (1, "T"):
            a, lower = _mT(a), not lower
        return _solved(a, like(b, a), "lower" if lower else "upper")

    def solve(a, b):
        return _solved(a, like(b, a), None)

    # paddle's own first derivatives of these are right: a program to_static traces (compile=True,
    # first order only) keeps them, and PyLayers, which to_static does not convert
    def inv(a):
        return paddle.linalg.inv(a) if isinstance(a, paddle.pir.Value) else _Inverse.apply(a)

    def cholesky(a, upper=False):
        lower = paddle.linalg.cholesky(a) if isinstance(a, paddle.pir.Value) else _Cholesky.apply(a)
        return _mT(lower) if upper else lower

    def slogdet(a):
        if isinstance(a, paddle.pir.Value):
            out = paddle.linalg.slogdet(a)
            return out[0], out[1]
        return _Slogdet.apply(a)

    def det(a):
        if isinstance(a, paddle.pir.Value):
            return paddle.linalg.det(a)
        sign, logabsdet = _Slogdet.apply(a)
        return sign * paddle.exp(logabsdet)

    # diagonal, trace, diag, tril and triu: paddle 3.3's diagonal_grad, trace_grad, diag_grad,
    # tril_grad and triu_grad have no derivative of their own; a gather and products with
    # constant masks have derivatives of every order
    def diagonal(a, offset=0, axis1=0, axis2=1):
        a = paddle.moveaxis(a, [axis1, axis2], [-2, -1])
        n, m = int(a.shape[-2]), int(a.shape[-1])
        rows = np.arange(max(0, -offset), min(n, m - offset))
        flat = a.reshape([int(d) for d in a.shape[:-2]] + [n * m])
        index = _constant(rows * m + rows + offset, a)
        return paddle.index_select(flat, index, axis=-1)

    def trace(a, offset=0, axis1=0, axis2=1, dtype=None, out=None):
        if dtype is not None or out is not None:
            raise NotImplementedError("trace's dtype= and out= are not supported on paddle tensors")
        return paddle.sum(diagonal(a, offset, axis1, axis2), axis=-1)

    def diag(v, k=0):
        if v.ndim != 1:
            return diagonal(v, k)
        n = int(v.shape[0]) + abs(k)
        # v's entries on the rows of the k-th diagonal (a constant selection matrix), masked
        select = np.eye(n, int(v.shape[0]), min(k, 0))
        return (_constant(select, v, v.dtype) @ v).unsqueeze(-1) * _constant(np.eye(n, k=k), v, v.dtype)

    def triangle(kind: str) -> Callable:
        def numpy_like(m, k=0):
            return _triangle(m, kind, k)

        return numpy_like

    def pad(array, pad_width, mode="constant", constant_values=0, **kwargs):
        # numpy's widths: an int, (n,), (before, after), ((before, after),) or one pair per axis;
        # paddle's: before and after of each axis, flat
        if mode != "constant" or kwargs:
            raise NotImplementedError("pad supports mode='constant' only on paddle tensors")
        if np.ndim(constant_values) != 0:
            raise NotImplementedError("pad supports one scalar constant_values only on paddle tensors")
        widths = np.asarray(pad_width)
        if widths.dtype.kind not in "iu" or (widths < 0).any():
            raise InvalidArgumentError(f"pad_width must be non-negative integers, got {pad_width!r}")
        pairs = np.broadcast_to(widths, (array.ndim, 2))
        return paddle.nn.functional.pad(array, [int(w) for w in pairs.ravel()], mode="constant",
                                        value=float(constant_values))

    def joined(op: Callable) -> Callable:
        # numpy joins numpy arrays with tensors (autoray dispatches on like=x); paddle wants
        # tensors only: numpy arrays go where the first tensor is
        def numpy_like(arrays, axis=0, out=None, dtype=None):
            if out is not None or dtype is not None:
                raise NotImplementedError("out= and dtype= are not supported on paddle tensors")
            ref = next((a for a in arrays if isinstance(a, paddle.Tensor)), None)
            place = None if ref is None else ref.place
            # paddle 3.3's second derivative of concat or stack fails on a constant among
            # differentiated tensors ("Unable to fill empty grad inputs"): with differentiated
            # ones, each float constant joins as a new leaf of its own (nothing differentiates it)
            differentiated = any(_needs_grad(a) for a in arrays)

            def joinable(a: Any) -> Any:
                if not isinstance(a, array_types):
                    a = paddle.to_tensor(np.asarray(a), place=place)
                if differentiated and isinstance(a, paddle.Tensor) and a.stop_gradient and a.is_floating_point():
                    a = _fresh(a)
                return a

            return op([joinable(a) for a in arrays], axis=axis)

        return numpy_like

    def erfc(x):
        return 1.0 - paddle.erf(x)

    def xlogy(x, y):
        # 0 where x == 0, as scipy (and a zero gradient there for y)
        y = like(y, x)
        return paddle.where(x == 0, paddle.zeros_like(x), x * paddle.log(paddle.where(x == 0, paddle.ones_like(y), y)))

    functions: dict[str, Callable] = {
        "max": extremum(paddle.argmax),
        "amax": extremum(paddle.argmax),
        "min": extremum(paddle.argmin),
        "amin": extremum(paddle.argmin),
        "prod": prod,
        "logsumexp": logsumexp,
        "scipy.special.logsumexp": logsumexp,
        "scipy.special.softmax": softmax,
        "scipy.special.log_softmax": log_softmax,
        "std": moment(root=True),
        "var": moment(root=False),
        "take": take,
        "linalg.qr": qr,
        "expand_dims": expand_dims,
        "concatenate": joined(paddle.concat),
        "stack": joined(paddle.stack),
        "cumprod": cumprod,
        "dot": dot,
        "roll": roll,
        "repeat": repeat,
        "linalg.solve": solve,
        "linalg.inv": inv,
        "linalg.slogdet": slogdet,
        "linalg.det": det,
        "linalg.cholesky": cholesky,
        "diagonal": diagonal,
        "trace": trace,
        "diag": diag,
        "tril": triangle("lower"),
        "triu": triangle("upper"),
        "pad": pad,
        "copy": unary(paddle.clone),
        "linalg.solve_triangular": solve_triangular,
        "scipy.linalg.solve_triangular": solve_triangular,
        "arcsin": unary(paddle.asin),
        "arctan": unary(paddle.atan),
        "scipy.special.erf": unary(paddle.erf),
        "scipy.special.erfc": erfc,
        "scipy.special.expit": unary(paddle.nn.functional.sigmoid),
        "scipy.special.logit": unary(paddle.logit),
        "scipy.special.gammaln": unary(paddle.lgamma),
        "scipy.special.digamma": unary(paddle.digamma),
        "scipy.special.xlogy": xlogy,
    }
    for name, op in (("maximum", paddle.maximum), ("minimum", paddle.minimum), ("logaddexp", paddle.logaddexp),
                     ("arctan2", paddle.atan2), ("hypot", paddle.hypot)):
        functions[name] = scalar_second(op)
    return Table("paddle", functions=functions, dtype_name=get_dtype_name)

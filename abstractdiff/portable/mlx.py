"""MLX's translations of numpy/scipy calls (docs/guide/portable.md): the calls mlx.core lacks,
takes differently, or computes less precisely than float64 promises, and the derivatives MLX
lacks (conformance_tests/test_portable.py checks them).

MLX's CPU kernels for sin, cos, exp, erf, sigmoid (and so logaddexp, logsumexp, softmax) are
float32-accurate polynomials, float64 arrays included (about 1e-7 relative error, and tan's and
erf's derivatives inherit it); tan, sinh, cosh, tanh, expm1, log, power are exact.  The
translations below compute those functions, and their derivatives of every order
(``mx.custom_function``), from the exact ones in float64; float32 keeps MLX's kernels.  MLX has
no derivative for its linear algebra (inv, solve, cholesky, eigh...): the ones here add them.
Calls of ``mx.*`` itself keep MLX's behaviour.

This module imports MLX when it is imported, not in :func:`translations`: the exact kernels
and the derivative rules are MLX custom functions, built once, at module level, so that the
rules can call one another (derivatives of every order).  Only :func:`abstractdiff.portable.apply`
(when an mlx backend is created) and the mlx adapter import it, both once MLX is loaded.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import mlx.core as mx

from . import Table


def _one(a: Any) -> Any:
    # mx.custom_function hands a single primal, tangent or cotangent over bare
    return a[0] if isinstance(a, (list, tuple)) else a


def _unary(value: Callable[[Any], Any], derivative: Callable[[Any, Any], Any]) -> Any:
    """``value`` as an MLX function whose derivative is ``derivative(x, value(x))``."""
    f = mx.custom_function(value)

    @f.vjp
    def vjp(x: Any, cotangent: Any, y: Any) -> Any:
        return _one(cotangent) * derivative(_one(x), _one(y))

    @f.jvp
    def jvp(x: Any, tangent: Any) -> Any:
        x = _one(x)
        return _one(tangent) * derivative(x, f(x))

    return f


def _half_angle(x: Any) -> tuple[Any, Any]:
    t = mx.tan(0.5 * x)  # exact in float64, unlike mx.sin/mx.cos
    return t, 1.0 + t * t


_sin64 = _unary(lambda x: 2.0 * _half_angle(x)[0] / _half_angle(x)[1], lambda x, y: _cos64(x))
_cos64 = _unary(lambda x: (1.0 - _half_angle(x)[0] ** 2) / _half_angle(x)[1], lambda x, y: -_sin64(x))
_tan64 = _unary(mx.tan, lambda x, y: 1.0 + y * y)
_exp64 = _unary(lambda x: mx.power(math.e, x), lambda x, y: y)
# Python floats, never numpy scalars: a numpy scalar on the left of an MLX array converts the
# array to numpy (and drops its derivative)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_HALF_LOG_TWO_PI = 0.5 * math.log(2.0 * math.pi)
_LOG_PI = math.log(math.pi)
_ERF_TERMS = 100  # enough for |x| <= 6, where erf(x) rounds to +-1 in float64


def _erf64_value(x: Any) -> Any:
    # erf(x) = 2/sqrt(pi) exp(-x^2) sum_n 2^n x^(2n+1) / (1 3 5 ... (2n+1)): positive terms, no
    # cancellation
    a = mx.minimum(mx.abs(x), 6.0)
    a2 = 2.0 * a * a
    term = total = a
    for n in range(1, _ERF_TERMS):
        term = term * a2 / (2 * n + 1)
        total = total + term
    return mx.sign(x) * mx.minimum(total * _TWO_OVER_SQRT_PI * _exp64(-a * a), 1.0)


_erf64 = _unary(_erf64_value, lambda x, y: _TWO_OVER_SQRT_PI * _exp64(-x * x))


def _wide(a: Any) -> bool:
    return isinstance(a, mx.array) and a.dtype == mx.float64


def _other(x1: Any, x2: Any) -> Any:
    """The MLX array of a binary function's two arguments (numpy takes a Python scalar for one)."""
    return x1 if isinstance(x1, mx.array) else x2


# -- log Gamma and digamma (MLX has neither): Lanczos' approximation (g = 7, 9 terms), about
# 1e-15 relative in float64, with the reflection formula below 1/2.
_LANCZOS = (0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313,
            -176.61502916214059, 12.507343278686905, -0.13857109526572012, 9.9843695780195716e-6,
            1.5056327351493116e-7)


def _lanczos(z: Any) -> tuple[Any, Any]:
    """``(log Gamma(z), digamma(z))`` for ``z >= 1/2``."""
    z = z - 1.0
    a, da = _LANCZOS[0], 0.0
    for i, p in enumerate(_LANCZOS[1:], 1):
        a = a + p / (z + i)
        da = da - p / (z + i) ** 2
    t = z + 7.5
    log_t = mx.log(t)
    return _HALF_LOG_TWO_PI + (z + 0.5) * log_t - t + mx.log(a), log_t + (z + 0.5) / t - 1.0 + da / a


def _reflected(z: Any) -> tuple[Any, Any, Any]:
    """``(z < 1/2, log Gamma and digamma at max(z, 1 - z))``; the other side's inputs stay finite."""
    low = z < 0.5
    return low, *_lanczos(mx.where(low, 1.0 - z, z))


def _digamma(z: Any) -> Any:
    low, _, psi = _reflected(z)
    return mx.where(low, psi - math.pi / (_tan64 if _wide(z) else mx.tan)(math.pi * mx.where(low, z, 0.25)), psi)


def _gammaln_value(z: Any) -> Any:
    low, lg, _ = _reflected(z)
    sine = (_sin64 if _wide(z) else mx.sin)(math.pi * mx.where(low, z, 0.5))
    return mx.where(low, _LOG_PI - mx.log(mx.abs(sine)) - lg, lg)


_gammaln = _unary(_gammaln_value, lambda z, y: _digamma(z))


# -- linear algebra: MLX computes it on the CPU stream only and has no derivative for it.
# Each function below has its reverse and forward rule (those of JAX), written with these
# functions again, so that derivatives of every order exist.
def _mT(a: Any) -> Any:
    return mx.swapaxes(a, -1, -2)


def _sym(a: Any) -> Any:
    return 0.5 * (a + _mT(a))


def _tangent(t: Any, like: Any) -> Any:
    # mx.custom_function hands None for an input that has no tangent
    return mx.zeros_like(like) if t is None else t


_inv = mx.custom_function(lambda a: mx.linalg.inv(a, stream=mx.cpu))


@_inv.vjp
def _inv_vjp(a: Any, cotangent: Any, inverse: Any) -> Any:
    inverse = _one(inverse)
    return -_mT(inverse) @ _one(cotangent) @ _mT(inverse)


@_inv.jvp
def _inv_jvp(a: Any, tangent: Any) -> Any:
    inverse = _inv(_one(a))
    return -inverse @ _one(tangent) @ inverse


def _as_matrix(b: Any) -> tuple[Any, bool]:
    return (b[..., None], True) if b.ndim == 1 else (b, False)


def _solve_value(a: Any, b: Any) -> Any:
    """``a x = b`` by MLX's solve, but a 1x1 system (batched or not) by ``tri_inv(a) @ b``.

    MLX's LUF kernel (0.32: ``luf.cpp`` passes ``lu.nbytes()`` to ``set_data`` as the data
    size, which counts elements) gives its LU output 8 times its element count (float64; 4
    times for float32): a kernel that reads it as one contiguous block runs past its buffer,
    and writes past it where it reuses that buffer for its output.  In ``mx.linalg.solve``
    the LU goes only to ``tril``/``triu``, which take the contiguous path only where the LU
    is row- and column-contiguous at once, a single 1x1 matrix, and only fused by
    ``mx.compile``: a compiled float64 solve of a 1x1 system corrupted the heap
    (``corrupted size vs. prev_size``, segfaults; every run in 300 calls, none for 2x2 to
    5x5, batched, or eagerly), the custom_root of a scalar under ``compile=True``.  A 1x1
    system is what LU reduces it to, ``L = 1``, ``U = a``: the same value, and the same
    error for a zero ``a`` ("triangular inversion failed"), without the LUF kernel."""
    if a.shape[-1] == 1:
        return mx.linalg.tri_inv(a, upper=True, stream=mx.cpu) @ b
    return mx.linalg.solve(a, b, stream=mx.cpu)


_solve = mx.custom_function(_solve_value)


@_solve.vjp
def _solve_vjp(primals: Any, cotangent: Any, x: Any) -> tuple[Any, Any]:
    a, _ = primals
    db = _solve(_mT(a), _one(cotangent))
    return -(_as_matrix(db)[0] @ _mT(_as_matrix(_one(x))[0])), db


@_solve.jvp
def _solve_jvp(primals: Any, tangents: Any) -> Any:
    a, b = primals
    da, db = _tangent(tangents[0], a), _tangent(tangents[1], b)
    x = _solve(a, b)
    x_m, vector = _as_matrix(x)
    rhs = _as_matrix(db)[0] - da @ x_m
    out = _solve(a, rhs)
    return out[..., 0] if vector else out


@_solve.vmap
def _solve_vmap(inputs: Any, axes: Any) -> tuple[Any, int]:
    # batched on axis 0 and solved by _solve again: without this rule MLX batches
    # mx.linalg.solve's own graph under mx.vmap (a Hessian's rows), and a derivative taken
    # outside the vmap meets the LU pivots' gather, which has no derivative, not the rules
    (a, b), (ax_a, ax_b) = inputs, axes
    size = a.shape[ax_a] if ax_a is not None else b.shape[ax_b]
    vector = b.ndim - (ax_b is not None) == 1
    a = mx.broadcast_to(a, (size, *a.shape)) if ax_a is None else mx.moveaxis(a, ax_a, 0)
    b = mx.broadcast_to(b, (size, *b.shape)) if ax_b is None else mx.moveaxis(b, ax_b, 0)
    x = _solve(a, b[..., None] if vector else b)
    return (x[..., 0] if vector else x), 0


def _phi(a: Any) -> Any:
    # the lower triangle, with half the diagonal
    return mx.tril(a) - 0.5 * a * mx.eye(a.shape[-1], dtype=a.dtype)


_cholesky = mx.custom_function(lambda a: mx.linalg.cholesky(a, stream=mx.cpu))


@_cholesky.vjp
def _cholesky_vjp(a: Any, cotangent: Any, lower: Any) -> Any:
    lower = _one(lower)
    inverse = _inv(lower)
    return _sym(_mT(inverse) @ _phi(_mT(lower) @ _one(cotangent)) @ inverse)


@_cholesky.jvp
def _cholesky_jvp(a: Any, tangent: Any) -> Any:
    lower = _cholesky(_one(a))
    inverse = _inv(lower)
    return lower @ _phi(inverse @ _sym(_one(tangent)) @ _mT(inverse))


_eigh = mx.custom_function(lambda a: tuple(mx.linalg.eigh(a, stream=mx.cpu)))


def _eigh_gaps(w: Any) -> Any:
    # F[i, j] = 1 / (w[j] - w[i]) off the diagonal, 0 on it (distinct eigenvalues)
    eye = mx.eye(w.shape[-1], dtype=w.dtype)
    return 1.0 / (eye + w[..., None, :] - w[..., :, None]) - eye


@_eigh.vjp
def _eigh_vjp(a: Any, cotangents: Any, outputs: Any) -> Any:
    (dw, dv), (w, v) = cotangents, outputs
    inner = _eigh_gaps(w) * (_mT(v) @ dv) + dw[..., None] * mx.eye(w.shape[-1], dtype=w.dtype)
    return _sym(v @ inner @ _mT(v))


@_eigh.jvp
def _eigh_jvp(a: Any, tangent: Any) -> tuple[Any, Any]:
    w, v = _eigh(_one(a))
    vav = _mT(v) @ _sym(_one(tangent)) @ v
    return mx.diagonal(vav, axis1=-2, axis2=-1), v @ (_eigh_gaps(w) * vav)


# slogdet and det: MLX computes them from an LU factorisation, whose primitive has no vjp rule
# ("[Primitive::vjp] Not implemented for LUF", n >= 4; 3x3 and smaller use a closed form), and
# MLX's det of float64 goes through its float32-accurate exp.  d log|det a| = tr(a^{-1} da)
# gives both rules, with _inv, so that derivatives of every order exist; det = sign * exp(log|det|).
_slogdet = mx.custom_function(lambda a: tuple(mx.linalg.slogdet(a, stream=mx.cpu)))


@_slogdet.vjp
def _slogdet_vjp(a: Any, cotangents: Any, outputs: Any) -> Any:
    dlog = cotangents[1]
    if dlog is None:  # the sign alone: constant almost everywhere
        return mx.zeros_like(_one(a))
    return dlog[..., None, None] * _mT(_inv(_one(a)))


@_slogdet.jvp
def _slogdet_jvp(a: Any, tangent: Any) -> tuple[Any, Any]:
    dlog = mx.sum(_mT(_inv(_one(a))) * _one(tangent), axis=(-2, -1))
    return mx.zeros_like(dlog), dlog


def _det(a: Any) -> Any:
    sign, logabsdet = _slogdet(a)
    return sign * (_exp64 if _wide(a) else mx.exp)(logabsdet)


def _solve_triangular(a: Any, b: Any, lower: bool) -> Any:
    """``a x = b`` for triangular ``a``, as a solve with the triangle of ``a`` (differentiable)."""
    return _solve(mx.tril(a) if lower else mx.triu(a), b)


def translations() -> Table:
    """The autoray translations of numpy/scipy names for MLX arrays."""

    def precise(exact: Callable[..., Any], fast: Callable[..., Any]) -> Callable[..., Any]:
        def numpy_like(x, *args, **kwargs):
            return (exact if _wide(x) else fast)(x, *args, **kwargs)

        return numpy_like

    def expit(x):
        if not _wide(x):
            return mx.sigmoid(x)
        # exp of a non-positive number on either side: no overflow, no cancellation
        e = _exp64(-mx.abs(x))
        return mx.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    def logaddexp(x1, x2):
        x1, x2 = (a if isinstance(a, mx.array) else mx.array(a, dtype=_other(x1, x2).dtype) for a in (x1, x2))
        if not (_wide(x1) or _wide(x2)):
            return mx.logaddexp(x1, x2)
        m = mx.maximum(x1, x2)
        d = -mx.abs(x1 - x2)
        d = mx.where(mx.isnan(d), 0.0, d)  # inf - inf: the two are -inf (or +inf) alike
        return m + mx.log1p(_exp64(d))

    def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
        if b is not None or return_sign:
            raise NotImplementedError("logsumexp's b= and return_sign= are not supported on mlx arrays")
        if not _wide(a):
            return mx.logsumexp(a, axis=axis, keepdims=keepdims)
        m = mx.stop_gradient(mx.max(a, axis=axis, keepdims=True))
        m = mx.where(mx.isinf(m), 0.0, m)
        out = mx.log(mx.sum(_exp64(a - m), axis=axis, keepdims=True)) + m
        return out if keepdims else mx.squeeze(out, axis=axis)

    def log_softmax(x, axis=None):
        return x - logsumexp(x, axis=axis, keepdims=True)

    def softmax(x, axis=None):
        return (_exp64 if _wide(x) else mx.exp)(log_softmax(x, axis=axis))

    def erfc(x):
        return 1.0 - (_erf64(x) if _wide(x) else mx.erf(x))

    def logit(x):
        return mx.log(x) - mx.log1p(-x)

    def xlogy(x, y):
        y = y if isinstance(y, mx.array) else mx.array(y, dtype=x.dtype)
        zero = x == 0
        return mx.where(zero, 0.0, x * mx.log(mx.where(zero, 1.0, y)))

    def hypot(x1, x2):
        return mx.sqrt(x1 * x1 + x2 * x2)

    def dot(a, b):
        # numpy.dot: a product with a 0-d array, else a sum over a's last axis and b's
        # second-to-last (its only one for a vector)
        if a.ndim == 0 or b.ndim == 0:
            return a * b
        return mx.tensordot(a, b, axes=([a.ndim - 1], [max(b.ndim - 2, 0)]))

    def integer_result(op: Callable[..., Any]) -> Callable[..., Any]:
        # MLX refuses to differentiate a gather through indices computed from the traced
        # values ("Cannot calculate VJP with respect to indices"): integers carry no gradient
        def numpy_like(*args, **kwargs):
            return mx.stop_gradient(op(*args, **kwargs))

        return numpy_like

    def gather(op: Callable[..., Any]) -> Callable[..., Any]:
        def numpy_like(a, indices, *args, **kwargs):
            if isinstance(indices, mx.array):
                indices = mx.stop_gradient(indices)
            return op(a, indices, *args, **kwargs)

        return numpy_like

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        if unit_diagonal:
            a = mx.tril(a, -1) + mx.triu(a, 1) + mx.eye(a.shape[-1], dtype=a.dtype)
        if trans in (1, 2, "T", "C"):
            a, lower = _mT(a), not lower
        return _solve_triangular(a, b, lower)

    def eigh(a, UPLO="L"):
        a = mx.tril(a) + _mT(mx.tril(a, -1)) if UPLO == "L" else mx.triu(a) + _mT(mx.triu(a, 1))
        return _eigh(a)

    def plain(fn: Callable[..., Any]) -> Callable[..., Any]:
        # a Python function of this module, as the portable table's test looks for
        def numpy_like(*args, **kwargs):
            return fn(*args, **kwargs)

        return numpy_like

    functions = {
        "linalg.inv": plain(_inv),
        "linalg.solve": plain(_solve),
        "linalg.solve_triangular": solve_triangular,
        "scipy.linalg.solve_triangular": solve_triangular,
        "linalg.cholesky": plain(_cholesky),
        "linalg.slogdet": plain(_slogdet),
        "linalg.det": plain(_det),
        "linalg.eigh": eigh,
        "linalg.eigvalsh": lambda a, UPLO="L": eigh(a, UPLO)[0],
        "scipy.special.gammaln": plain(_gammaln),
        "scipy.special.digamma": plain(_digamma),
        "sin": precise(_sin64, mx.sin),
        "cos": precise(_cos64, mx.cos),
        "tan": precise(_tan64, mx.tan),
        "exp": precise(_exp64, mx.exp),
        "logaddexp": logaddexp,
        "logsumexp": logsumexp,
        "scipy.special.logsumexp": logsumexp,
        "scipy.special.softmax": softmax,
        "scipy.special.log_softmax": log_softmax,
        "scipy.special.expit": expit,
        "scipy.special.logit": logit,
        "scipy.special.erf": precise(_erf64, mx.erf),
        "scipy.special.erfc": erfc,
        "scipy.special.xlogy": xlogy,
        "hypot": hypot,
        "dot": dot,
        "argmax": integer_result(mx.argmax),
        "argmin": integer_result(mx.argmin),
        "argsort": integer_result(mx.argsort),
        "take": gather(mx.take),
        "take_along_axis": gather(mx.take_along_axis),
        "copy": plain(mx.array),  # a new array (an alias would see the original's item writes), differentiable
    }
    return Table("mlx", functions=functions)

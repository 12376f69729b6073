"""Portable functions: every entry of the table runs unchanged on every backend.

For each backend (torch, jax, tensorflow, autograd, mlx, paddle, pytensor,
finite_differences; the implicit backend is not used) and each entry of
``abstractdiff.testing._portable.PORTABLE``, in float64 and float32, at each of the entry's
points (n = 3, and n = 6 for the matrix functions), :func:`observe` checks, in order:

* the value against the numpy/scipy reference (rtol 1e-10 in float64);
* (float64 and float32) the gradient of the nonlinear scalar ``sum(w * sin(f(x)))`` (fixed, distinct weights
  ``w``; the value comes back as aux) against finite differences in float64: its cotangent
  ``w * cos(f(x))`` depends on the value, which a linear ``sum(w * f(x))`` would not test;
* (float64) the pushforward of ``f`` along a fixed tangent (forward mode) against finite
  differences;
* (float64) the Hessian-vector product of that scalar against jax's in float64 (torch's, then
  autograd's, where jax is the backend checked or is not here or has a gap on the entry;
  finite differences, at a looser tolerance, where none of them is available);
* every result keeps the inputs' dtype.

What it reaches is one of :data:`LEVELS`: ✓, "first order" (the second derivative raises),
"value only" (a first derivative raises) or ✗ (a wrong number, or a value that raises).  A pair
not in :data:`GAPS` must reach ✓; a pair in it must reach exactly its mark, so a gap that
closes fails the run too, as a strict xfail does, and the docs page never understates or
overstates what works.  Backends run as in the rest of the conformance suite: every
available one (an unavailable one is skipped with the reason), or those named by
``--ad-backend`` / ``ABSTRACTDIFF_BACKENDS`` (which must load).

The same table generates ``docs/guide/portable.md`` (between its ``portable:table``
markers); :func:`test_docs_page_is_current` fails when the committed page differs.
Regenerate it with::

    .venv/bin/python -m conformance_tests.test_portable

and list the pairs whose marks no longer match (after an adapter changed) with
``--survey [backend ...]``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from autoray import do

import abstractdiff as ad
from abstractdiff.testing import is_approximate
from abstractdiff.testing._grid import ENV, requested_backends
from abstractdiff.testing._portable import CATEGORIES, PORTABLE, Portable

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guide" / "portable.md"

#: The backends of the page's columns, and the autoray name of the arrays ``f`` sees on each.
BACKENDS = ("torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor", "finite_differences")
AUTORAY_NAME = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow", "autograd": "autograd",
                "mlx": "mlx", "paddle": "paddle", "pytensor": "pytensor", "finite_differences": "numpy"}



def mark(backend: str, entry_id: str, dtype: str) -> tuple[str, str]:
    """``(mark, reason)`` the pair must reach in ``dtype``.  float32 checks no second derivative
    (:func:`observe`), so there a "first order" mark, or one listed in :data:`FLOAT64_ONLY`, is ✓."""
    status, reason = GAPS.get((backend, entry_id), ("✓", ""))
    if dtype != "float64" and (status == "first order" or (backend, entry_id) in FLOAT64_ONLY):
        return "✓", ""
    return status, reason


def _paddle_second_order(op: str) -> tuple[str, str]:
    return "first order", f"paddle 3.3 has no second derivative of its {op} ({op}_grad has no grad op)"


_NOT_FOUND = "autoray finds no {name!r} for {lib}: the adapter has no translation yet"

#: (backend, entry id) -> (mark, reason): the mark of :data:`LEVELS` the entry reaches there
#: (every pair not listed reaches ✓).  The check is strict both ways: a pair that does worse
#: or better than its mark fails :func:`test_portable`.
GAPS: dict[tuple[str, str], tuple[str, str]] = {
    ("mlx", "linalg.svd"): ("value only", "MLX has no derivative for its SVD"),
    ("mlx", "linalg.qr"): ("value only", "MLX has no derivative for its QR decomposition"),
    # the float64 second derivative only (see FLOAT64_ONLY)
    ("mlx", "expm1"): ("✗", "its second derivative is float32-accurate in float64 (about 1e-7 relative): MLX's exp"),
    **{("paddle", entry): _paddle_second_order(op) for entry, op in {
        "cumsum": "cumsum", "cumprod": "cumprod", "linalg.norm-axis": "p_norm", "linalg.norm-frobenius": "p_norm",
        "einsum": "einsum", "kron": "kron", "linalg.eigh": "eigh", "linalg.eigvalsh": "eigvalsh",
        "linalg.svd": "svd", "linalg.qr": "qr", "sort": "argsort", "roll": "roll", "roll-keywords": "roll",
        "log1p": "log1p", "expm1": "expm1", "tan": "tan", "sinh": "sinh", "cosh": "cosh",
        "arcsin": "asin", "arctan": "atan", "arctan2": "atan2", "floor": "floor",
        "reciprocal": "reciprocal", "scipy.special.erf": "erf", "scipy.special.erfc": "erf",
        "scipy.special.logit": "logit", "scipy.special.gammaln": "lgamma", "scipy.special.digamma": "digamma",
        "logaddexp": "log1p", "softplus": "log1p",
    }.items()},
}
#: Gaps of the float64-only checks (the pushforward and the second derivative) that are not
#: "first order" marks: float32 reaches ✓ there.
FLOAT64_ONLY = frozenset({("mlx", "expm1")})

#: What abstractdiff translates, per backend: autoray name -> why.  Each library's table,
#: ``abstractdiff.portable.<library>``, holds these; creating the backend registers it with
#: autoray (:func:`abstractdiff.portable.apply`); every other call is autoray's own translation,
#: or the library's function of that name.  ``test_translations_come_from_the_portable_tables``
#: keeps this in step.
_SCALAR = "numpy takes a Python scalar as second argument; torch wants a tensor"
_SCIPY_TORCH = "not in torch's namespace: torch.special"
_SCIPY_TF = "not in tf.experimental.numpy: tf.math"
_SCIPY_AUTOGRAD = "autoray looks in autograd.numpy: autograd.scipy.special"
_SCIPY_PYTENSOR = "autoray looks in pytensor.tensor: found there under its own name"
_EXACT64 = "MLX's CPU kernel is float32-accurate, float64 included (about 1e-7)"
_NO_DERIVATIVE = "MLX has no derivative for it (and runs it on the CPU stream only): JAX's rules"
_PADDLE_LAYER = "paddle 3.3's gradient has no derivative of its own: a PyLayer with derivatives of every order"
_PADDLE_MASKS = "paddle 3.3's gradient has no derivative of its own: a gather, or products with constant masks"
_GATHER = "MLX refuses to differentiate a gather through indices computed from the traced values"
TRANSLATED: dict[str, dict[str, str]] = {
    "torch": {
        "logsumexp": "torch.logsumexp takes `dim`, not `axis`/`keepdims`",
        "scipy.special.logsumexp": "not found: torch.logsumexp, with `axis`/`keepdims`",
        "std": "torch.std's default is `correction=1` (numpy's `ddof=0`): wrong values, and no `ddof`",
        "var": "torch.var's default is `correction=1` (numpy's `ddof=0`): wrong values, and no `ddof`",
        "roll": "torch.roll takes `shifts`/`dims`, not `axis`",
        "dot": "torch.dot takes vectors only",
        "repeat": "not found: torch.repeat_interleave",
        "maximum": _SCALAR,
        "minimum": _SCALAR,
        "arctan2": _SCALAR,
        "hypot": _SCALAR,
        "logaddexp": _SCALAR,
        "linalg.solve_triangular": "torch.linalg.solve_triangular takes `upper=`, not `lower=`, and a matrix "
                                   "right-hand side",
        "scipy.linalg.solve_triangular": "autoray's translation takes a matrix right-hand side only",
        "scipy.special.erf": _SCIPY_TORCH,
        "scipy.special.erfc": _SCIPY_TORCH,
        "scipy.special.expit": _SCIPY_TORCH,
        "scipy.special.logit": _SCIPY_TORCH,
        "scipy.special.gammaln": _SCIPY_TORCH,
        "scipy.special.digamma": _SCIPY_TORCH,
        "scipy.special.xlogy": _SCIPY_TORCH,
        "scipy.special.softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.log_softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "copy": "autoray's torch copy is `detach().clone()`: a silently zero derivative; clone()",
        "pad": "torch wants the widths flat, last axis first; autoray's translation reads numpy's flat pair "
               "(1, 2) as two pairs",
    },
    "jax": {
        "logsumexp": "not in jax.numpy: jax.scipy.special.logsumexp",
        "linalg.solve_triangular": "not in jax.numpy: jax.scipy.linalg.solve_triangular",
    },
    "tensorflow": {
        "pad": "tf.pad takes one (before, after) pair per axis, not numpy's int or single pair",
        "logsumexp": "not in tf.experimental.numpy: tf.math.reduce_logsumexp",
        "scipy.special.logsumexp": "not found: tf.math.reduce_logsumexp",
        "std": "tf.experimental.numpy.std fails on `ddof=`",
        "var": "tf.experimental.numpy.var fails on `ddof=`",
        "linalg.solve_triangular": "not found: tf.linalg.triangular_solve, with a vector right-hand side",
        "scipy.linalg.solve_triangular": "autoray's translation takes a matrix right-hand side only",
        "scipy.special.erf": _SCIPY_TF,
        "scipy.special.erfc": _SCIPY_TF,
        "scipy.special.expit": "not found: tf.math.sigmoid",
        "scipy.special.logit": "not found: log(x) - log1p(-x)",
        "scipy.special.gammaln": "not found: tf.math.lgamma",
        "scipy.special.digamma": _SCIPY_TF,
        "scipy.special.xlogy": _SCIPY_TF,
        "scipy.special.softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.log_softmax": "not found: from logsumexp, over `axis` (all elements when None)",
    },
    "autograd": {
        "copy": "autograd has no derivative of numpy.copy: a primitive with the identity's",
        "logsumexp": "not in autograd.numpy: autograd.scipy.special.logsumexp",
        "scipy.special.logsumexp": _SCIPY_AUTOGRAD,
        "scipy.special.erf": _SCIPY_AUTOGRAD,
        "scipy.special.erfc": _SCIPY_AUTOGRAD,
        "scipy.special.expit": _SCIPY_AUTOGRAD,
        "scipy.special.logit": _SCIPY_AUTOGRAD,
        "scipy.special.gammaln": _SCIPY_AUTOGRAD,
        "scipy.special.digamma": _SCIPY_AUTOGRAD,
        "scipy.special.xlogy": "not in autograd: x * log(y), 0 where x == 0",
        "scipy.special.softmax": "not in autograd: from logsumexp",
        "scipy.special.log_softmax": "not in autograd: from logsumexp",
        "linalg.solve_triangular": "autograd.scipy.linalg.solve_triangular",
        "scipy.linalg.solve_triangular": "autoray looks in autograd.numpy: autograd.scipy.linalg",
        "linalg.eigvalsh": "no derivative in autograd: the eigenvalues of eigh",
        "linalg.qr": "no derivative in autograd: a primitive with one (rows >= columns, reduced mode)",
        "take_along_axis": "no derivative in autograd: fancy indexing",
        "sort": "autograd differentiates sort of vectors only: argsort, then take_along_axis",
        "cumprod": "no derivative in autograd: running products",
        "flip": "no derivative in autograd: reversed slices",
        "diagonal": "autograd differentiates offset=0 only: fancy indexing",
        "pad": "autograd's derivative fails unless `mode` is passed",
        "broadcast_to": "autograd's derivative fails on new leading axes: reshape first",
        "where": "a comparison of autograd's traced values is a numpy mask, which autoray would send to numpy's "
                 "`where`: a dispatcher sends a call with a traced value to autograd.numpy.where",
    },
    "mlx": {
        "copy": "autoray finds no copy for mlx: mx.array(a), a new array that keeps the derivative",
        "sin": f"{_EXACT64}: from tan(x/2), with exact derivatives",
        "cos": f"{_EXACT64}: from tan(x/2), with exact derivatives",
        "exp": f"{_EXACT64}: power(e, x)",
        "tan": "its derivative uses MLX's float32-accurate cos, float64 included: 1 + tan^2",
        "logaddexp": f"{_EXACT64} (its exp): max + log1p(exp(-|x - y|))",
        "logsumexp": f"{_EXACT64} (its exp): from the exact exp",
        "scipy.special.logsumexp": "not found: as logsumexp",
        "scipy.special.softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.log_softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.expit": f"not found; mx.sigmoid: {_EXACT64}: from the exact exp",
        "scipy.special.logit": "not found: log(x) - log1p(-x)",
        "scipy.special.erf": f"not found; mx.erf: {_EXACT64}: a series of positive terms in float64",
        "scipy.special.erfc": "not found: 1 - erf",
        "scipy.special.xlogy": "not found: x * log(y), 0 where x == 0",
        "scipy.special.gammaln": "MLX has no gamma functions: Lanczos' approximation (about 1e-14)",
        "scipy.special.digamma": "MLX has no gamma functions: the derivative of Lanczos' approximation",
        "hypot": "not in mlx.core: sqrt(x^2 + y^2)",
        "dot": "not in mlx.core: tensordot over numpy.dot's axes",
        "argmax": f"{_GATHER}: an integer result carries no derivative (stop_gradient)",
        "argsort": f"{_GATHER}: an integer result carries no derivative (stop_gradient)",
        "take": f"{_GATHER}: the indices with stop_gradient",
        "take_along_axis": f"{_GATHER}: the indices with stop_gradient",
        "linalg.inv": _NO_DERIVATIVE,
        "linalg.solve": _NO_DERIVATIVE,
        "linalg.cholesky": _NO_DERIVATIVE,
        "linalg.eigh": _NO_DERIVATIVE,
        "linalg.eigvalsh": f"{_NO_DERIVATIVE} (the eigenvalues of eigh)",
        "linalg.solve_triangular": "mx.linalg.solve_triangular takes `upper=` and has no derivative: a solve "
                                   "with the triangle",
        "scipy.linalg.solve_triangular": "not found: as linalg.solve_triangular",
        "linalg.det": "MLX's LU factorisation has no derivative (past 3x3, where it is used): from slogdet",
        "linalg.slogdet": "MLX's LU factorisation has no derivative (past 3x3, where it is used): A^{-T}",
    },
    "paddle": {
        "copy": "autoray finds no copy for paddle: clone(), which keeps the derivative",
        "max": "paddle.max has no second derivative (max_grad has no grad op): the value at the argmax",
        "min": "paddle.min has no second derivative (min_grad has no grad op): the value at the argmin",
        "prod": "paddle.prod has no second derivative (prod_grad has no grad op): products of pairs",
        "logsumexp": "paddle.logsumexp takes `keepdim` and has no second derivative: shifted by its detached max",
        "scipy.special.logsumexp": "not found: as logsumexp",
        "scipy.special.softmax": "not found (paddle's softmax has no second derivative): from logsumexp",
        "scipy.special.log_softmax": "not found (paddle's log_softmax has no second derivative): from logsumexp",
        "std": "paddle.std's default is `unbiased=True` (numpy's `ddof=0`): wrong values, and no `ddof`",
        "var": "paddle.var's default is `unbiased=True` (numpy's `ddof=0`): wrong values, and no `ddof`",
        "take": "paddle.take takes no `axis`: paddle.index_select",
        "linalg.qr": "paddle 3.3's QR gradient crashes the process (a segfault) unless both Q and R are used: "
                     "each is tied to the other by a zero",
        "expand_dims": "not found: paddle.unsqueeze",
        "concatenate": "paddle.concat takes tensors only: numpy arrays in the list (with `like=x`) are converted",
        "stack": "paddle.stack takes tensors only: numpy arrays in the list (with `like=x`) are converted",
        "cumprod": "paddle.cumprod takes `dim`, not `axis`",
        "dot": "paddle.dot takes vectors only",
        "roll": "paddle.roll takes `shifts`, not `shift`",
        "repeat": "not found: paddle.repeat_interleave",
        "linalg.solve_triangular": "not found: paddle.linalg.triangular_solve, with `upper=` and a matrix "
                                   "right-hand side",
        "scipy.linalg.solve_triangular": "not found: paddle.linalg.triangular_solve, with `upper=` and a matrix "
                                         "right-hand side",
        "arcsin": "not found: paddle.asin",
        "arctan": "not found: paddle.atan",
        "arctan2": "not found: paddle.atan2, with a Python scalar second argument too",
        "maximum": "numpy takes a Python scalar as second argument; paddle wants a tensor",
        "minimum": "numpy takes a Python scalar as second argument; paddle wants a tensor",
        "logaddexp": "numpy takes a Python scalar as second argument; paddle wants a tensor",
        "hypot": "numpy takes a Python scalar as second argument; paddle wants a tensor",
        "scipy.special.erf": "not found: paddle.erf",
        "scipy.special.erfc": "not found: 1 - paddle.erf",
        "scipy.special.expit": "not found: paddle.nn.functional.sigmoid",
        "scipy.special.logit": "not found: paddle.logit",
        "scipy.special.gammaln": "not found: paddle.lgamma",
        "scipy.special.digamma": "not found: paddle.digamma",
        "scipy.special.xlogy": "not found: x * log(y), 0 where x == 0",
        "linalg.solve": "paddle's derivative crashes on an (n, 1) right-hand side: a solve of its own",
        "linalg.inv": _PADDLE_LAYER,
        "linalg.cholesky": _PADDLE_LAYER,
        "linalg.det": f"{_PADDLE_LAYER} (from slogdet)",
        "linalg.slogdet": _PADDLE_LAYER,
        "diagonal": _PADDLE_MASKS,
        "trace": _PADDLE_MASKS,
        "tril": _PADDLE_MASKS,
        "triu": _PADDLE_MASKS,
        "pad": "paddle takes the widths flat, before and after per axis, not numpy's int or pairs",
    },
    "pytensor": {
        "scipy.special.logsumexp": "not found: pytensor.tensor.logsumexp, with `axis`/`keepdims`",
        "scipy.special.erf": _SCIPY_PYTENSOR,
        "scipy.special.erfc": _SCIPY_PYTENSOR,
        "scipy.special.expit": "not found: pytensor.tensor.sigmoid",
        "scipy.special.logit": "not found: pytensor.tensor.special.logit",
        "scipy.special.gammaln": _SCIPY_PYTENSOR,
        "scipy.special.digamma": _SCIPY_PYTENSOR,
        "scipy.special.xlogy": "not in pytensor: x * log(y), 0 where x == 0",
        "scipy.special.softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.special.log_softmax": "not found: from logsumexp, over `axis` (all elements when None)",
        "scipy.linalg.solve_triangular": "not found: pytensor.tensor.linalg.solve_triangular",
        "linalg.norm": "pytensor's norm over an axis differentiates through a complex abs, which its "
                       "gradient refuses: sqrt(sum(x**2)) for the 2-norm and Frobenius norm",
        "prod": "pytensor's prod has no second derivative: a balanced tree of products (exact with zeros)",
        "split": "pytensor.tensor.split takes split sizes and a count, not numpy's sections or indices",
        "asarray": "not found: pytensor.tensor.as_tensor_variable, cast to `dtype`",
        "hypot": "not in pytensor: sqrt(x1**2 + x2**2)",
        "kron": "not found: pytensor.tensor.linalg.kron",
        "ravel": "not found: pytensor.tensor.flatten",
        "copy": "not in pytensor.tensor: a graph's values are never written in place, so the identity",
    },
    "finite_differences": {
        "logsumexp": "not in numpy: scipy.special.logsumexp",
        "linalg.solve_triangular": "not in numpy: scipy.linalg.solve_triangular",
    },
}

TOLERANCES = {
    # (value rtol, value atol, gradient rtol, gradient atol, second-order rtol, second-order atol),
    # relative to the largest magnitude of the reference.
    "float64": (1e-10, 1e-12, 1e-6, 1e-8, 1e-8, 1e-10),
    "float32": (2e-5, 2e-6, 2e-4, 2e-5, 2e-3, 2e-4),
}
#: The gradient reference: finite differences in float64 with a step below the default
#: (eps**(1/5), about 7e-4), so that their truncation error stays below the gradient tolerance
#: where f is steep (sin(1/x) near x = 1/13: 1e-5 relative at the default step).
REFERENCE_STEP = 1e-4
#: The finite-differences backend itself, at its default step, against those references: its
#: (gradient rtol, gradient atol, second-order rtol, second-order atol) in float64.  Nested
#: differences (its second order) reach about 1e-3 relative where the function is steep or
#: its eigenvalues close (eigh at n = 6: 1.3e-3), so they are held to the float32 tolerance.
APPROXIMATE = (1e-5, 1e-7, 2e-3, 2e-4)
#: Where the second-order reference comes from: the first of these (in float64) that is not
#: the backend under test and reaches ✓ on the entry; finite differences where none is here.
SECOND_ORDER_REFERENCES = ("jax", "torch", "autograd")
DTYPES = ("float64", "float32")


# ------------------------------------------------------------------ helpers
@functools.cache
def _backend(name: str) -> ad.Backend | str:
    """The backend, or why it is unavailable."""
    if name not in ad.available_backends():
        try:
            ad.backend(name)
        except Exception as err:  # the reason is the skip message
            return f"backend {name!r} is not available here: {err}"
        return f"backend {name!r} is not available here"
    return ad.backend(name)


def _load(name: str, config: Any) -> ad.Backend:
    requested = requested_backends(config)
    if requested and name not in requested:
        pytest.skip(f"backend {name!r} is not selected (--ad-backend / {ENV})")
    b = _backend(name)
    if isinstance(b, str):
        if name in requested:
            pytest.fail(f"{b} (asked for with --ad-backend / {ENV})", pytrace=False)
        pytest.skip(b)
    return b


@functools.cache
def _function(entry_id: str) -> Callable[..., Any]:
    """``f(x, *data)``: the entry's call, with ``x`` one array or a tuple of them (one object per entry)."""
    entry = _ENTRIES[entry_id]
    if len(entry.wrt) == 1:
        return lambda x, *data: entry.fn(x, *data)
    return lambda x, *data: entry.fn(*x, *data)


_ENTRIES = {p.id: p for p in PORTABLE}


def _weights(shape: tuple, dtype: str) -> np.ndarray:
    """Fixed, distinct weights for the pullback (a plain sum could hide a permutation)."""
    n = int(np.prod(shape))
    return (1.0 + 0.5 * np.cos(np.arange(n) + 1.0)).reshape(shape).astype(dtype)


def _tangent(x: Any) -> Any:
    """A fixed direction for the Hessian-vector product, shaped like ``x``."""
    if isinstance(x, tuple):
        return tuple(_tangent(a) for a in x)
    return (0.6 - 0.8 * np.sin(1.7 * np.arange(x.size) + 0.3)).reshape(x.shape).astype(x.dtype)


def _point(entry: Portable, dtype: str, point: int = 0) -> tuple[Any, list]:
    wrt, data = entry.inputs(dtype, point)
    return (wrt[0] if len(wrt) == 1 else tuple(wrt)), data


def _widened(x: Any) -> Any:
    return tuple(a.astype(np.float64) for a in x) if isinstance(x, tuple) else x.astype(np.float64)


def _flat(tree: Any) -> list[np.ndarray]:
    tree = ad.to_numpy(tree)
    return [np.asarray(t) for t in (tree if isinstance(tree, tuple) else (tree,))]


@functools.cache
def _scalar(entry_id: str) -> Callable[..., Any]:
    """``sum(w * sin(f(x)))``: nonlinear in ``f``, so the cotangent ``w * cos(f(x))`` depends on
    the value (a linear ``sum(w * f(x))`` hides derivatives that are right for constant
    cotangents only, as paddle's triangular solve was), and the Hessian has both of its terms."""
    f = _function(entry_id)

    def scalar(x: Any, w: Any, *data: Any) -> Any:
        return do("sum", w * do("sin", f(x, *data)))

    return scalar


@functools.cache
def _loss(entry_id: str) -> Callable[..., Any]:
    """``(sum(w * sin(f(x))), f(x))``: the scalar to differentiate, the value as aux (one compilation)."""
    f = _function(entry_id)

    def loss(x: Any, w: Any, *data: Any) -> tuple[Any, Any]:
        out = f(x, *data)
        return do("sum", w * do("sin", out)), out

    return loss


@functools.cache
def _reference_gradient(entry_id: str, dtype: str, point: int) -> list[np.ndarray]:
    """Finite differences of the scalar, in float64 at the point rounded to ``dtype``."""
    entry = _ENTRIES[entry_id]
    x, data = _point(entry, dtype, point)
    w = _weights(entry.expected(dtype, point).shape, "float64")
    oracle = ad.backend("finite_differences", step=REFERENCE_STEP)
    g, _ = ad.gradient(oracle, _loss(entry_id), _widened(x), w, *data, has_aux=True)
    return _flat(g)


@functools.cache
def _reference_pushforward(entry_id: str, dtype: str, point: int) -> np.ndarray:
    """Finite differences of ``f`` along the tangent, in float64 at the point rounded to ``dtype``."""
    x, data = _point(_ENTRIES[entry_id], dtype, point)
    x = _widened(x)
    oracle = ad.backend("finite_differences", step=REFERENCE_STEP)
    _, jvp = ad.value_and_pushforward(oracle, _function(entry_id), x, *data)
    return np.asarray(ad.to_numpy(jvp(_tangent(x))))


def _second_order_reference(entry_id: str, tested: str) -> str:
    for name in SECOND_ORDER_REFERENCES:
        if name != tested and not isinstance(_backend(name), str) and (name, entry_id) not in GAPS:
            return name
    return "finite_differences"


@functools.cache
def _reference_hvp(entry_id: str, dtype: str, point: int, tested: str) -> tuple[str, list[np.ndarray]]:
    """``(source, hvp)``: the Hessian-vector product of the scalar, in float64 at the point rounded to ``dtype``."""
    entry = _ENTRIES[entry_id]
    x, data = _point(entry, dtype, point)
    x = _widened(x)
    w = _weights(entry.expected(dtype, point).shape, "float64")
    source = _second_order_reference(entry_id, tested)
    return source, _flat(ad.hvp(source, _scalar(entry_id), x, _tangent(x), w, *data))


# ------------------------------------------------------------------ what a backend reaches
#: The marks, worst first.  A check observes one of them per (backend, entry, dtype):
#:   "✗"           a wrong number: the value, the gradient or the Hessian-vector product differs
#:                 from the reference (or the value raises);
#:   "value only"  the value matches; the gradient or the pushforward raises an error;
#:   "first order" the value and the gradient match; the second derivative raises an error;
#:   "✓"           all three match.
LEVELS = ("✗", "value only", "first order", "✓")


class _Wrong(Exception):
    """A check found a wrong number (the level is ✗)."""


class _ReferenceFailed(Exception):
    """A reference could not be computed: the test's problem, never the checked backend's."""


def _reference(compute: Callable[..., Any], *key: Any) -> Any:
    try:
        return compute(*key)
    except Exception as err:
        raise _ReferenceFailed(f"{compute.__name__}{key}: {type(err).__name__}: {err}") from err


def _close(actual: np.ndarray, expected: np.ndarray, rtol: float, atol: float, what: str) -> None:
    try:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol * max(1.0, np.max(np.abs(expected))),
                                   err_msg=what)
    except AssertionError as err:
        raise _Wrong(str(err)) from None


def _oracle(b: ad.Backend, dtype: str) -> ad.Backend:
    # float32 steps are too coarse for these tolerances (1e-5 at best, worse near a kink):
    # finite differences in float32 take the documented float32 oracle's derivatives, which
    # evaluate f in float64.
    if b.name == "finite_differences" and dtype != "float64":
        return ad.backend("finite_differences", compute_dtype="float64")
    return b


def _check_value(b: ad.Backend, entry: Portable, dtype: str, point: int, y: Any) -> None:
    rtol, atol = TOLERANCES[dtype][:2]
    expected = entry.expected(dtype, point)
    value = np.asarray(ad.to_numpy(y))
    if value.shape != expected.shape:
        raise _Wrong(f"value shape {value.shape}, numpy's is {expected.shape}")
    _close(value, expected, rtol, atol, "value")
    if value.dtype != np.dtype(dtype):
        raise _Wrong(f"value dtype {value.dtype}, inputs are {dtype}")


def _value(b: ad.Backend, entry: Portable, x: Any, data: list) -> Any:
    """``f`` on the backend, where its gradient raises: through the operators where they can
    evaluate it, else on its native arrays (autograd builds a pullback eagerly, so an operation
    without a derivative fails even ``value_and_pullback``)."""
    try:
        return ad.value_and_pullback(b, _function(entry.id), x, *data)[0]
    except Exception:
        native = tuple(b.asarray(a) for a in x) if isinstance(x, tuple) else b.asarray(x)
        with ad.scope(native):
            return _function(entry.id)(native, *(b.asarray(d) for d in data))


def _tolerances(b: ad.Backend, dtype: str) -> tuple[float, float, float, float]:
    """(first-order rtol, atol, second-order rtol, atol) for ``b`` in ``dtype``."""
    first, second = TOLERANCES[dtype][2:4], TOLERANCES[dtype][4:]
    if is_approximate(b) and dtype == "float64":
        first, second = APPROXIMATE[:2], APPROXIMATE[2:]
    return (*first, *second)


def _check_gradient(b: ad.Backend, entry: Portable, dtype: str, point: int, g: Any) -> None:
    grtol, gatol = _tolerances(b, dtype)[:2]
    for k, (gk, ref) in enumerate(zip(_flat(g), _reference(_reference_gradient, entry.id, dtype, point))):
        if gk.dtype != np.dtype(dtype):
            raise _Wrong(f"gradient {k} dtype {gk.dtype}, inputs are {dtype}")
        _close(gk, ref, grtol, gatol, f"gradient {k} against finite differences")


def _check_hvp(b: ad.Backend, entry: Portable, dtype: str, point: int, h: Any) -> None:
    source, reference = _reference(_reference_hvp, entry.id, dtype, point, b.name)
    rtol, atol = _tolerances(b, dtype)[2:]
    if source == "finite_differences":
        rtol, atol = max(rtol, APPROXIMATE[2]), max(atol, APPROXIMATE[3])
    for k, (hk, ref) in enumerate(zip(_flat(h), reference)):
        if hk.dtype != np.dtype(dtype):
            raise _Wrong(f"Hessian-vector product {k} dtype {hk.dtype}, inputs are {dtype}")
        _close(hk, ref, rtol, atol, f"Hessian-vector product {k} against {source}'s in float64")


def _check_float32(b: ad.Backend, entry: Portable, point: int) -> str:
    """float32: the value and the gradient (one call); "✓", or "value only" where the gradient raises."""
    x, data = _point(entry, "float32", point)
    w = _weights(entry.expected("float32", point).shape, "float32")
    try:
        g, y = ad.gradient(_oracle(b, "float32"), _loss(entry.id), x, w, *data, has_aux=True)
    except Exception as err:  # no gradient: is the value right at least?
        _check_value(b, entry, "float32", point, _value(b, entry, x, data))
        return f"value only (the gradient raises {type(err).__name__}: {err})"
    if b.name == "finite_differences":
        y = _value(b, entry, x, data)  # the value of f on the float32 inputs, not the oracle's float64 one
    _check_value(b, entry, "float32", point, y)
    _check_gradient(b, entry, "float32", point, g)
    return "✓"


def _check_float64(b: ad.Backend, entry: Portable, point: int) -> str:
    """float64: the value and the pushforward (one call), the gradient and the Hessian-vector
    product (one call); "✓", "first order" or "value only" where a derivative raises."""
    x, data = _point(entry, "float64", point)
    found = "✓"
    try:  # forward mode: a derivative of its own on several libraries (pytensor's R-op, torch's duals)
        y, jvp = ad.value_and_pushforward(b, _function(entry.id), x, *data)
        t = np.asarray(ad.to_numpy(jvp(_tangent(x))))
    except Exception as err:
        y, t = _value(b, entry, x, data), None
        found = f"value only (the pushforward raises {type(err).__name__}: {err})"
    _check_value(b, entry, "float64", point, y)
    if t is not None:
        if t.dtype != np.float64:
            raise _Wrong(f"pushforward dtype {t.dtype}, inputs are float64")
        expected = _reference(_reference_pushforward, entry.id, "float64", point)
        _close(t, expected, *_tolerances(b, "float64")[:2], "pushforward against finite differences")
    w = _weights(entry.expected("float64", point).shape, "float64")
    try:
        g, h = ad.gradient_and_hvp(b, _scalar(entry.id), x, _tangent(x), w, *data)
    except Exception as second:
        h = None
        try:
            g = ad.gradient(b, _scalar(entry.id), x, w, *data)
        except Exception as err:
            return f"value only (the gradient raises {type(err).__name__}: {err})"
        found = found if found != "✓" else f"first order ({type(second).__name__}: {second})"
    _check_gradient(b, entry, "float64", point, g)
    if h is not None:
        _check_hvp(b, entry, "float64", point, h)
    return found


def observe(b: ad.Backend, entry: Portable, dtype: str) -> tuple[str, str]:
    """``(level, why)``: the mark of :data:`LEVELS` the entry reaches on ``b`` in ``dtype``, the
    lowest over its points (n = 3, and n = 6 for the matrix functions), and what stopped it.

    float64 checks the value, the gradient, the pushforward and the Hessian-vector product;
    float32 the value and the gradient (the derivatives' code is the same in both dtypes on
    every library, and each compiled call costs a trace on jax and tensorflow)."""
    level, why = "✓", ""
    for point in entry.points:
        at = f" at {'n = 6' if point else 'the first point'}"
        try:
            found = _check_float64(b, entry, point) if dtype == "float64" else _check_float32(b, entry, point)
        except _ReferenceFailed:
            raise
        except _Wrong as err:
            return "✗", f"a wrong number{at}: {err}"
        except Exception as err:  # the value itself raises
            return "✗", f"the value{at} raises {type(err).__name__}: {err}"
        mark = found.split(" (")[0]
        if LEVELS.index(mark) < LEVELS.index(level):
            level, why = mark, f"{found}{at}"
    return level, why


# ------------------------------------------------------------------ the grid
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entry", PORTABLE, ids=lambda p: p.id)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_portable(backend_name: str, entry: Portable, dtype: str, request: pytest.FixtureRequest) -> None:
    """The entry reaches exactly its mark: a gap that closes fails too (strict), so the page never understates."""
    b = _load(backend_name, request.config)
    status, reason = mark(backend_name, entry.id, dtype)
    level, why = observe(b, entry, dtype)
    if level == status:
        if status != "✓":
            pytest.xfail(f"{status}: {reason}")
        return
    if LEVELS.index(level) > LEVELS.index(status):
        pytest.fail(f"XPASS(strict): {entry.call} now reaches {level!r} on {backend_name} (marked {status!r}): "
                    f"update GAPS and regenerate docs/guide/portable.md", pytrace=False)
    pytest.fail(f"{entry.call} on {backend_name} in {dtype}: {level!r}, marked {status!r}: {why}", pytrace=False)


def _registered_by(lib: str, name: str) -> str | None:
    """The module of the function autoray calls for ``name`` on ``lib``, or None where it has
    none (numpy's ``logsumexp`` exists only once the numpy adapter registered it)."""
    import autoray

    try:
        return getattr(autoray.get_lib_fn(lib, name), "__module__", None)
    except (AttributeError, ImportError):
        return None


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_translations_come_from_the_portable_tables(backend_name: str, request: pytest.FixtureRequest) -> None:
    """The table's names this backend's library table registers are exactly those of :data:`TRANSLATED`,
    and they come from ``abstractdiff.portable.<library>``, never from the adapter."""
    from abstractdiff import portable

    _load(backend_name, request.config)  # creating the backend applies its library's table
    lib = AUTORAY_NAME[backend_name]
    module = f"abstractdiff.portable.{lib}"
    assert lib in portable.applied(), f"creating the {backend_name} backend did not apply {module}"
    names = {p.name for p in PORTABLE}
    ours = {name for name in names if _registered_by(lib, name) == module}
    assert ours == set(TRANSLATED[backend_name]), (
        f"registered by {module}: {sorted(ours)}; TRANSLATED lists {sorted(TRANSLATED[backend_name])}"
    )
    adapter = f"abstractdiff.adapters.{backend_name}"
    from_adapter = {name for name in names for where in (lib, "numpy") if _registered_by(where, name) == adapter}
    assert not from_adapter, f"{adapter} registers translations itself: {sorted(from_adapter)}"


def test_no_table_replaces_numpys_own_functions() -> None:
    """Nothing patches numpy's functions for numpy users: the numpy table only adds names numpy lacks."""
    import numpy as np

    from abstractdiff import portable

    numpy_table = portable.table("numpy")
    assert numpy_table is not None and not numpy_table.wrapped
    for name in numpy_table.names():
        head, _, tail = name.rpartition(".")
        owner = np if not head else getattr(np, head, None)
        assert owner is None or not hasattr(owner, tail), f"the numpy table replaces numpy's own {name}"
    for lib in portable.applied():
        found = portable.table(lib)
        assert found is None or found.library == lib, f"the {lib} table registers for {found.library}"


def test_table_is_large_and_unique() -> None:
    assert len(PORTABLE) >= 60
    assert len({p.id for p in PORTABLE}) == len(PORTABLE)
    assert {p.category for p in PORTABLE} == set(CATEGORIES)
    assert set(TRANSLATED) == set(BACKENDS)
    assert not {n for per in TRANSLATED.values() for n in per} - {p.name for p in PORTABLE}
    assert not {b for _, b in GAPS} - {p.id for p in PORTABLE}
    assert FLOAT64_ONLY <= set(GAPS)
    assert {status for status, _ in GAPS.values()} <= set(LEVELS[:-1])
    assert all(reason for _, reason in GAPS.values()), "every gap says why"


# ------------------------------------------------------------------ the docs page
BEGIN, END = "<!-- portable:table -->", "<!-- /portable:table -->"
_HEADINGS = {"torch": "torch", "jax": "jax", "tensorflow": "tensorflow", "autograd": "autograd",
             "mlx": "mlx", "paddle": "paddle", "pytensor": "pytensor", "finite_differences": "finite differences"}


def _cell(backend: str, entry: Portable) -> str:
    status, reason = GAPS.get((backend, entry.id), ("✓", ""))
    if (backend, entry.id) in FLOAT64_ONLY:
        status = f"{status} in float64 (✓ in float32)"
    mark = status if not reason else f"{status}: {reason}"
    if entry.name in TRANSLATED[backend]:
        mark += " [†](#translations)"
    return mark


def render_table() -> str:
    """The generated part of docs/guide/portable.md (between the markers)."""
    out = [BEGIN, "<!-- generated by conformance_tests/test_portable.py: edit the table there -->", "",
           f"{len(PORTABLE)} calls, each checked on every backend at n = 3 and, for the matrix functions, at "
           "n = 6 too, with derivatives of the nonlinear scalar `sum(w * sin(f(x)))` (fixed weights `w`), "
           "so that the cotangent `w * cos(f(x))` depends on the value.", "",
           "- **✓**: the value matches numpy/scipy and the gradient (reverse mode) matches finite differences, "
           "in float64 and in float32; in float64 the pushforward along a fixed tangent (forward mode) matches "
           "finite differences too, and the Hessian-vector product matches jax's (another exact backend's on "
           "the jax column); every result keeps the inputs' dtype.  "
           "The finite-differences column, an approximation, is held to 1e-5 relative for first "
           "derivatives and 2e-3 for second ones (nested differences) in float64.",
           "- **first order**: the value and the gradient are checked as for ✓; the second derivative "
           "raises an error (it never gives a number), for the reason given.",
           "- **value only**: the value is checked; a first derivative (the gradient, or the pushforward of "
           "forward mode) raises an error.",
           "- **✗**: do not use it on that backend: the call raises, or the value or a derivative is a "
           "**wrong number** (the reason says which).",
           "- **†**: abstractdiff's translation (see [below](#translations)).", "",
           "Every mark is checked both ways: a call that does better than its mark fails the test too, "
           "until the mark is raised.", ""]
    for category in CATEGORIES:
        out += [f"### {category.capitalize()}", ""]
        out.append("| call | " + " | ".join(_HEADINGS[b] for b in BACKENDS) + " | notes |")
        out.append("|---|" + ":-:|" * len(BACKENDS) + "---|")
        for entry in (p for p in PORTABLE if p.category == category):
            call = entry.call.replace("|", "\\|")
            cells = " | ".join(_cell(b, entry) for b in BACKENDS)
            out.append(f"| `{call}` | {cells} | {entry.note} |")
        out.append("")
    out += ["### Translations", "",
            "What abstractdiff translates, per library: each library's table is one module, "
            "`abstractdiff/portable/<library>.py`, whose `translations()` returns the functions; creating "
            "a backend registers its library's table with autoray (`abstractdiff.portable.apply`), once per "
            "process. Importing an adapter registers nothing, and no table replaces one of numpy's own "
            "functions. Every other call is autoray's own translation or the library's function of that "
            "name.", ""]
    for backend in BACKENDS:
        if not TRANSLATED[backend]:
            continue
        out += [f"**{_HEADINGS[backend]}**", "", "| name | why |", "|---|---|"]
        out += [f"| `{name}` | {why} |" for name, why in TRANSLATED[backend].items()]
        out.append("")
    out.append(END)
    return "\n".join(out)


def rendered_page(text: str) -> str:
    """``text`` with its table region replaced by :func:`render_table`."""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{PAGE} has no {BEGIN} ... {END} region")
    return pattern.sub(lambda _: render_table(), text)


def test_docs_page_is_current() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert rendered_page(text) == text, (
        "docs/guide/portable.md is stale: run `.venv/bin/python -m conformance_tests.test_portable`"
    )


def survey(backends: tuple[str, ...] = BACKENDS) -> list[str]:
    """Every (backend, entry, dtype) whose observed level differs from its mark, one line each:
    what to change in :data:`GAPS` after an adapter changed (``python -m conformance_tests.test_portable
    --survey [backend ...]``; slow: the whole grid)."""
    lines = []
    for name in backends:
        b = _backend(name)
        if isinstance(b, str):
            lines.append(b)
            continue
        for entry in PORTABLE:
            for dtype in DTYPES:
                level, why = observe(b, entry, dtype)
                status = mark(name, entry.id, dtype)[0]
                if level != status:
                    lines.append(f"{name} | {entry.id} | {dtype} | reaches {level!r}, marked {status!r} | {why[:400]}")
    return lines


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--survey"]:
        print("\n".join(survey(tuple(sys.argv[2:]) or BACKENDS)) or "every mark is what its pair reaches")
    else:
        PAGE.write_text(rendered_page(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"wrote {PAGE}")

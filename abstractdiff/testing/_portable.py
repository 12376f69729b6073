"""The portable functions: array functions a backend-neutral ``f`` may call through autoray.

Each entry is one call exactly as a user writes it (``call``, evaluated with ``do`` =
``autoray.do`` and ``ar`` = ``autoray`` in scope), its differentiated inputs (``wrt``),
its other inputs (``data``) and a numpy/scipy reference for its value.  The names are
numpy's (``"roll"``, ``"linalg.solve"``), scipy's where numpy has none
(``"scipy.special.erf"``, ``"scipy.linalg.solve_triangular"``), plus two short names
users reach for first: ``"logsumexp"`` (``scipy.special.logsumexp``) and
``"linalg.solve_triangular"`` (``scipy.linalg.solve_triangular``).

``conformance_tests/test_portable.py`` checks every entry on every backend (value
against the reference; the gradient of a nonlinear scalar of the value against finite
differences; its Hessian-vector product against jax in float64; dtype kept) and generates
``docs/guide/portable.md`` from this table.  The matrix functions carry a second point
(``resized``: the same call at n = 6, besides the n = 3 of ``wrt``), because some
libraries' derivatives are right at 3x3 only.  The translations that make every entry
work are each library's table in :mod:`abstractdiff.portable`, registered when a backend of
that library is created: importing this module imports no AD library, and scipy only when a
reference is evaluated.

>>> from abstractdiff.testing._portable import PORTABLE
>>> len(PORTABLE) >= 60
True
>>> roll = next(p for p in PORTABLE if p.name == "roll")
>>> roll.call
'do("roll", x, 1, axis=1)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..core import InvalidArgumentError

_FUNCTIONS: dict[str, Callable[..., Any]] = {}

#: Categories, in the order of the docs page.
CATEGORIES = ("reductions", "linear algebra", "indexing and shape", "creation", "elementwise", "special functions")


@dataclass(frozen=True)
class Portable:
    """One portable call: ``call`` evaluated on ``wrt`` (differentiated) and ``data``."""

    name: str  # the autoray name, as passed to ``do``
    category: str
    call: str  # the expression, with the inputs' names free
    reference: Callable[..., Any]  # numpy/scipy, on numpy arrays (wrt then data)
    wrt: tuple[tuple[str, np.ndarray], ...]
    data: tuple[tuple[str, np.ndarray], ...] = ()
    id: str = ""  # unique test id (defaults to the name)
    note: str = ""  # shown on the docs page
    resized: tuple[tuple[str, np.ndarray], ...] = ()  # a second point: inputs replaced by name (n = 6)

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", self.name)

    @property
    def fn(self) -> Callable[..., Any]:
        """``call`` as a function of the inputs (wrt, then data), built on first use."""
        fn = _FUNCTIONS.get(self.call)
        if fn is None:
            import autoray  # on first use: importing this module stays cheap

            names = ", ".join(n for n, _ in (*self.wrt, *self.data))
            fn = _FUNCTIONS[self.call] = eval(f"lambda {names}: {self.call}", {"do": autoray.do, "ar": autoray})
        return fn

    @property
    def points(self) -> tuple[int, ...]:
        """The indices of the entry's points: ``(0,)``, or ``(0, 1)`` with a ``resized`` one."""
        return (0, 1) if self.resized else (0,)

    def inputs(self, dtype: str = "float64", point: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``(wrt, data)`` at ``point`` as numpy arrays, float arrays in ``dtype``."""
        if point not in self.points:
            raise InvalidArgumentError(f"{self.id} has points {self.points}, not {point}")
        replaced = dict(self.resized) if point else {}

        def cast(name: str, a: np.ndarray) -> np.ndarray:
            a = replaced.get(name, a)
            return a.astype(dtype) if a.dtype.kind == "f" else a

        return [cast(n, a) for n, a in self.wrt], [cast(n, a) for n, a in self.data]

    def expected(self, dtype: str = "float64", point: int = 0) -> np.ndarray:
        """The reference value at ``point``, computed in float64 from the inputs rounded to ``dtype``."""
        wrt, data = self.inputs(dtype, point)
        widen = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in (*wrt, *data)]
        return np.asarray(self.reference(*widen), dtype=np.float64)


# ------------------------------------------------------------------ inputs
# Distinct values at least 1/13 apart, in (0, 1), away from every kink the entries use
# (0.5 for abs/sign/where/maximum, 0.2/0.8 for clip, thirds for floor): the finite
# differences that check the gradients take steps of ~1e-3.
M = (((np.arange(12) * 5) % 12) + 1.0).reshape(3, 4) / 13.0
M2 = (((np.arange(12) * 7) % 12) + 1.5).reshape(3, 4) / 14.0
A = np.array([[2.0, 0.3, -0.2], [0.1, 1.5, 0.4], [-0.3, 0.2, 1.8]])
B = np.array([[0.7, -0.4], [0.2, 0.9], [-0.5, 0.3], [1.1, 0.6]])
V3 = np.array([0.5, -1.0, 2.0])
V4 = np.array([0.3, -0.7, 1.2, 0.4])
T = (np.arange(24.0).reshape(2, 3, 4) + 1.0) / 25.0
TALL = np.array([[1.0, 0.2, -0.3], [0.4, 1.5, 0.1], [-0.2, 0.3, 0.9], [0.6, -0.5, 0.7]])
K2 = np.array([[1.0, 0.5], [-0.3, 0.8]])
K2B = np.array([[0.2, -1.0], [0.7, 0.4]])
IDX = np.array([2, 0, 3])
IDX2 = np.array([[3, 1], [0, 0], [2, 3]])
# The second points of the matrix functions (n = 6): well conditioned, distinct eigenvalues
# and singular values (gaps > 0.07), so that every derivative is defined and smooth there.
A6 = np.eye(6) * 1.2 + ((((np.arange(36) * 7) % 13) - 6) / 40.0).reshape(6, 6)
V6 = np.array([0.4, -0.9, 1.3, 0.2, -0.5, 0.8])
B6 = np.stack([V6, np.cos(np.arange(6.0))], axis=1)
TALL6 = (((np.arange(42) * 11) % 17) + 1.0).reshape(7, 6) / 18.0 + np.eye(7, 6)
M6 = np.ascontiguousarray(TALL6.T)  # contiguous: the inputs are plain arrays, as a user's usually are


def _sp(module: str) -> Any:
    import importlib

    return importlib.import_module(f"scipy.{module}")


def _n6(**inputs: np.ndarray) -> tuple[tuple[str, np.ndarray], ...]:
    """The inputs of an entry's second point, by name."""
    return tuple(inputs.items())


def _P(name: str, category: str, call: str, reference: Callable[..., Any], wrt: dict, data: dict | None = None,
       **kw: Any) -> Portable:
    return Portable(name, category, call, reference, tuple(wrt.items()), tuple((data or {}).items()), **kw)


_R, _L, _S, _C, _E, _X = CATEGORIES

PORTABLE: tuple[Portable, ...] = (
    # -------------------------------------------------------------- reductions
    _P("sum", _R, 'do("sum", x, axis=0)', lambda x: np.sum(x, axis=0), {"x": M}),
    _P("mean", _R, 'do("mean", x, axis=1, keepdims=True)', lambda x: np.mean(x, axis=1, keepdims=True), {"x": M}),
    _P("prod", _R, 'do("prod", x, axis=1)', lambda x: np.prod(x, axis=1), {"x": M}),
    _P("max", _R, 'do("max", x, axis=1)', lambda x: np.max(x, axis=1), {"x": M}),
    _P("min", _R, 'do("min", x, axis=0)', lambda x: np.min(x, axis=0), {"x": M}),
    _P("argmax", _R, 'do("take_along_axis", x, do("expand_dims", do("argmax", x, axis=1), 1), axis=1)',
       lambda x: np.max(x, axis=1, keepdims=True), {"x": M}, note="integer result, used as an index"),
    _P("std", _R, 'do("std", x, axis=0)', lambda x: np.std(x, axis=0), {"x": M}),
    _P("var", _R, 'do("var", x, axis=1, ddof=1)', lambda x: np.var(x, axis=1, ddof=1), {"x": M}),
    _P("logsumexp", _R, 'do("logsumexp", x, axis=1)', lambda x: _sp("special").logsumexp(x, axis=1), {"x": M},
       note="scipy.special.logsumexp's semantics"),
    _P("scipy.special.logsumexp", _R, 'do("scipy.special.logsumexp", x, axis=0, keepdims=True)',
       lambda x: _sp("special").logsumexp(x, axis=0, keepdims=True), {"x": M}),
    _P("cumsum", _R, 'do("cumsum", x, axis=1)', lambda x: np.cumsum(x, axis=1), {"x": M}),
    _P("cumprod", _R, 'do("cumprod", x, axis=0)', lambda x: np.cumprod(x, axis=0), {"x": M}),
    _P("linalg.norm", _R, 'do("linalg.norm", x, axis=1)', lambda x: np.linalg.norm(x, axis=1), {"x": M},
       id="linalg.norm-axis"),
    _P("linalg.norm", _R, 'do("linalg.norm", x)', lambda x: np.linalg.norm(x), {"x": M}, id="linalg.norm-frobenius"),
    # -------------------------------------------------------------- linear algebra
    _P("matmul", _L, 'do("matmul", a, b)', lambda a, b: a @ b, {"a": M, "b": B}, resized=_n6(a=A6, b=B6)),
    _P("dot", _L, 'do("dot", a, v)', lambda a, v: np.dot(a, v), {"a": M, "v": V4}),
    _P("einsum", _L, 'do("einsum", "ij,jk->ik", a, b)', lambda a, b: np.einsum("ij,jk->ik", a, b), {"a": M, "b": B}),
    _P("tensordot", _L, 'do("tensordot", a, b, axes=1)', lambda a, b: np.tensordot(a, b, axes=1), {"a": M, "b": B}),
    _P("outer", _L, 'do("outer", u, v)', lambda u, v: np.outer(u, v), {"u": V3, "v": V4}),
    _P("kron", _L, 'do("kron", a, b)', lambda a, b: np.kron(a, b), {"a": K2, "b": K2B}),
    _P("trace", _L, 'do("trace", a)', lambda a: np.trace(a), {"a": A}, resized=_n6(a=A6)),
    _P("diagonal", _L, 'do("diagonal", a, offset=1)', lambda a: np.diagonal(a, offset=1), {"a": M}),
    _P("linalg.inv", _L, 'do("linalg.inv", a)', lambda a: np.linalg.inv(a), {"a": A}, resized=_n6(a=A6)),
    _P("linalg.solve", _L, 'do("linalg.solve", a, b)', lambda a, b: np.linalg.solve(a, b), {"a": A, "b": V3},
       note="1-d right-hand side", resized=_n6(a=A6, b=V6)),
    _P("linalg.solve", _L, 'do("linalg.solve", a, b)', lambda a, b: np.linalg.solve(a, b),
       {"a": A, "b": V3[:, None]}, id="linalg.solve-column", note="an (n, 1) right-hand side",
       resized=_n6(a=A6, b=V6[:, None])),
    _P("linalg.solve_triangular", _L, 'do("linalg.solve_triangular", do("tril", a), b, lower=True)',
       lambda a, b: _sp("linalg").solve_triangular(np.tril(a), b, lower=True), {"a": A, "b": V3},
       note="scipy.linalg.solve_triangular's semantics", resized=_n6(a=A6, b=V6)),
    _P("scipy.linalg.solve_triangular", _L, 'do("scipy.linalg.solve_triangular", do("triu", a), b, lower=False)',
       lambda a, b: _sp("linalg").solve_triangular(np.triu(a), b, lower=False), {"a": A, "b": B[:3]},
       resized=_n6(a=A6, b=B6)),
    _P("linalg.cholesky", _L, 'do("linalg.cholesky", a @ do("transpose", a) + 3.0 * do("eye", a.shape[0], like=a))',
       lambda a: np.linalg.cholesky(a @ a.T + 3.0 * np.eye(len(a))), {"a": A}, resized=_n6(a=A6)),
    _P("linalg.det", _L, 'do("linalg.det", a)', lambda a: np.linalg.det(a), {"a": A}, resized=_n6(a=A6)),
    _P("linalg.slogdet", _L, 'do("linalg.slogdet", a)[1]', lambda a: np.linalg.slogdet(a)[1], {"a": A},
       resized=_n6(a=A6)),
    _P("linalg.eigh", _L, 'do("linalg.eigh", a + do("transpose", a))[0]',
       lambda a: np.linalg.eigh(a + a.T)[0], {"a": A}, note="eigenvalues (eigenvectors have a sign freedom)",
       resized=_n6(a=A6)),
    _P("linalg.eigvalsh", _L, 'do("linalg.eigvalsh", a + do("transpose", a))',
       lambda a: np.linalg.eigvalsh(a + a.T), {"a": A}, resized=_n6(a=A6)),
    _P("linalg.svd", _L, 'do("linalg.svd", a)[1]', lambda a: np.linalg.svd(a)[1], {"a": M},
       note="singular values (the vectors have a sign freedom)", resized=_n6(a=M6)),
    _P("linalg.qr", _L, 'do("abs", do("diagonal", do("linalg.qr", a)[1]))',
       lambda a: np.abs(np.diagonal(np.linalg.qr(a)[1])), {"a": TALL}, note="|diag R| (R's signs are a convention)",
       resized=_n6(a=TALL6)),
    # -------------------------------------------------------------- indexing and shape
    _P("take", _S, 'do("take", x, i, axis=1)', lambda x, i: np.take(x, i, axis=1), {"x": M}, {"i": IDX},
       note="integer indices as data"),
    _P("take_along_axis", _S, 'do("take_along_axis", x, i, axis=1)',
       lambda x, i: np.take_along_axis(x, i, axis=1), {"x": M}, {"i": IDX2}),
    _P("sort", _S, 'do("sort", x, axis=1)', lambda x: np.sort(x, axis=1), {"x": M}),
    _P("argsort", _S, 'do("take_along_axis", x, do("argsort", x, axis=0), axis=0)', lambda x: np.sort(x, axis=0),
       {"x": M}, note="integer result, used as an index"),
    _P("reshape", _S, 'do("reshape", x, (4, 3))', lambda x: np.reshape(x, (4, 3)), {"x": M}),
    _P("ravel", _S, 'do("ravel", x)', lambda x: np.ravel(x), {"x": M}),
    _P("copy", _S, 'do("copy", x)', lambda x: np.copy(x), {"x": M}, note="a copy keeps the derivative"),
    _P("transpose", _S, 'do("transpose", x, (2, 0, 1))', lambda x: np.transpose(x, (2, 0, 1)), {"x": T}),
    _P("moveaxis", _S, 'do("moveaxis", x, 0, -1)', lambda x: np.moveaxis(x, 0, -1), {"x": T}),
    _P("swapaxes", _S, 'do("swapaxes", x, 0, 2)', lambda x: np.swapaxes(x, 0, 2), {"x": T}),
    _P("squeeze", _S, 'do("squeeze", x, axis=1)', lambda x: np.squeeze(x, axis=1), {"x": M.reshape(3, 1, 4)}),
    _P("expand_dims", _S, 'do("expand_dims", x, axis=1)', lambda x: np.expand_dims(x, axis=1), {"x": M}),
    _P("broadcast_to", _S, 'do("broadcast_to", v, (3, 4))', lambda v: np.broadcast_to(v, (3, 4)), {"v": V4}),
    _P("flip", _S, 'do("flip", x, axis=1)', lambda x: np.flip(x, axis=1), {"x": M}),
    _P("roll", _S, 'do("roll", x, 1, axis=1)', lambda x: np.roll(x, 1, axis=1), {"x": M}),
    _P("roll", _S, 'do("roll", x, shift=-1, axis=0)', lambda x: np.roll(x, shift=-1, axis=0), {"x": M},
       id="roll-keywords"),
    _P("tril", _S, 'do("tril", x, k=-1)', lambda x: np.tril(x, k=-1), {"x": M}),
    _P("triu", _S, 'do("triu", x, k=1)', lambda x: np.triu(x, k=1), {"x": M}),
    _P("pad", _S, 'do("pad", x, ((1, 0), (0, 2)))', lambda x: np.pad(x, ((1, 0), (0, 2))), {"x": M},
       note="constant mode"),
    _P("pad", _S, 'do("pad", x, 1)', lambda x: np.pad(x, 1), {"x": M}, id="pad-flat",
       note="one width for every side"),
    _P("pad", _S, 'do("pad", x, (1, 2))', lambda x: np.pad(x, (1, 2)), {"x": M}, id="pad-pair",
       note="one (before, after) pair for every axis"),
    _P("where", _S, 'do("where", x > 0.5, x, x**2)', lambda x: np.where(x > 0.5, x, x**2), {"x": M}),
    _P("where", _S, 'do("where", m, x, 0.0)', lambda x, m: np.where(m, x, 0.0), {"x": M}, {"m": M2 > 0.5},
       id="where-mask", note="a boolean mask as data"),
    _P("clip", _S, 'do("clip", x, 0.2, 0.8)', lambda x: np.clip(x, 0.2, 0.8), {"x": M}),
    _P("concatenate", _S, 'do("concatenate", [x, x**2], axis=1)', lambda x: np.concatenate([x, x**2], axis=1),
       {"x": M}),
    _P("concatenate", _S, 'do("concatenate", [d, x], axis=0, like=x)', lambda x, d: np.concatenate([d, x], axis=0),
       {"x": M}, {"d": M2}, id="concatenate-like",
       note="data first: `like=x` (the data stay numpy arrays on autograd and finite differences)"),
    _P("stack", _S, 'do("stack", [x, 2.0 * x], axis=1)', lambda x: np.stack([x, 2.0 * x], axis=1), {"x": M}),
    _P("split", _S, 'do("concatenate", do("split", x, 2, axis=1)[::-1], axis=0)',
       lambda x: np.concatenate(np.split(x, 2, axis=1)[::-1], axis=0), {"x": M}),
    _P("tile", _S, 'do("tile", x, (2, 1))', lambda x: np.tile(x, (2, 1)), {"x": M}),
    _P("repeat", _S, 'do("repeat", x, 2, axis=0)', lambda x: np.repeat(x, 2, axis=0), {"x": M}),
    _P("diff", _S, 'do("diff", x, axis=1)', lambda x: np.diff(x, axis=1), {"x": M}),
    # -------------------------------------------------------------- creation (inside f)
    _P("eye", _C, 'x + do("eye", 3, 4, like=x)', lambda x: x + np.eye(3, 4), {"x": M},
       note="dtype and device from `like`"),
    _P("zeros", _C, 'do("concatenate", [x, do("zeros", (1, 4), like=x)], axis=0)',
       lambda x: np.concatenate([x, np.zeros((1, 4))], axis=0), {"x": M}, note="dtype and device from `like`"),
    _P("ones_like", _C, 'x * do("ones_like", x)', lambda x: x * np.ones_like(x), {"x": M}),
    _P("asarray", _C, 'x * do("asarray", [0.1, 0.2, 0.3, 0.4], like=x, dtype=ar.to_backend_dtype(ar.get_dtype_name(x), like=x))',  # noqa: E501
       lambda x: x * np.array([0.1, 0.2, 0.3, 0.4]), {"x": M}, note="pass `dtype=`: `asarray` keeps the data's"),
    # -------------------------------------------------------------- elementwise
    _P("exp", _E, 'do("exp", x)', np.exp, {"x": M}),
    _P("log", _E, 'do("log", x)', np.log, {"x": M}),
    _P("log1p", _E, 'do("log1p", x)', np.log1p, {"x": M}),
    _P("expm1", _E, 'do("expm1", x)', np.expm1, {"x": M}),
    _P("sin", _E, 'do("sin", x)', np.sin, {"x": M}),
    _P("cos", _E, 'do("cos", x)', np.cos, {"x": M}),
    _P("tan", _E, 'do("tan", x)', np.tan, {"x": M}),
    _P("tanh", _E, 'do("tanh", x)', np.tanh, {"x": M}),
    _P("sinh", _E, 'do("sinh", x)', np.sinh, {"x": M}),
    _P("cosh", _E, 'do("cosh", x)', np.cosh, {"x": M}),
    _P("arcsin", _E, 'do("arcsin", x)', np.arcsin, {"x": M}),
    _P("arctan", _E, 'do("arctan", x)', np.arctan, {"x": M}),
    _P("arctan2", _E, 'do("arctan2", x, y)', np.arctan2, {"x": M, "y": M2}),
    _P("sqrt", _E, 'do("sqrt", x)', np.sqrt, {"x": M}),
    _P("abs", _E, 'do("abs", x - 0.5)', lambda x: np.abs(x - 0.5), {"x": M}),
    _P("square", _E, 'do("square", x)', np.square, {"x": M}),
    _P("power", _E, 'do("power", x, 2.5)', lambda x: np.power(x, 2.5), {"x": M}),
    _P("maximum", _E, 'do("maximum", x, 0.5)', lambda x: np.maximum(x, 0.5), {"x": M}, note="with a Python scalar"),
    _P("minimum", _E, 'do("minimum", x, y)', np.minimum, {"x": M, "y": M2}),
    _P("sign", _E, 'x * do("sign", x - 0.5)', lambda x: x * np.sign(x - 0.5), {"x": M},
       note="piecewise constant: its derivative is 0"),
    _P("floor", _E, 'x - do("floor", 3.0 * x) / 3.0', lambda x: x - np.floor(3.0 * x) / 3.0, {"x": M},
       note="piecewise constant: its derivative is 0"),
    _P("reciprocal", _E, 'do("reciprocal", x)', np.reciprocal, {"x": M}),
    _P("hypot", _E, 'do("hypot", x, y)', np.hypot, {"x": M, "y": M2}),
    # -------------------------------------------------------------- special functions
    _P("scipy.special.erf", _X, 'do("scipy.special.erf", x)', lambda x: _sp("special").erf(x), {"x": M}),
    _P("scipy.special.erfc", _X, 'do("scipy.special.erfc", x)', lambda x: _sp("special").erfc(x), {"x": M}),
    _P("scipy.special.expit", _X, 'do("scipy.special.expit", x)', lambda x: _sp("special").expit(x), {"x": M},
       note="the logistic sigmoid"),
    _P("scipy.special.logit", _X, 'do("scipy.special.logit", x)', lambda x: _sp("special").logit(x), {"x": M}),
    _P("scipy.special.gammaln", _X, 'do("scipy.special.gammaln", x + 1.0)',
       lambda x: _sp("special").gammaln(x + 1.0), {"x": M}),
    _P("scipy.special.digamma", _X, 'do("scipy.special.digamma", x + 1.0)',
       lambda x: _sp("special").digamma(x + 1.0), {"x": M}),
    _P("scipy.special.xlogy", _X, 'do("scipy.special.xlogy", x, y)', lambda x, y: _sp("special").xlogy(x, y),
       {"x": M, "y": M2}),
    _P("scipy.special.softmax", _X, 'do("scipy.special.softmax", x, axis=1)',
       lambda x: _sp("special").softmax(x, axis=1), {"x": M}),
    _P("scipy.special.log_softmax", _X, 'do("scipy.special.log_softmax", x, axis=1)',
       lambda x: _sp("special").log_softmax(x, axis=1), {"x": M}),
    _P("logaddexp", _X, 'do("logaddexp", x, y)', np.logaddexp, {"x": M, "y": M2}),
    _P("logaddexp", _X, 'do("logaddexp", x, 0.0)', lambda x: np.logaddexp(x, 0.0), {"x": M}, id="softplus",
       note="softplus: log(1 + exp(x))"),
)

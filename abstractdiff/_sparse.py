"""``ad.Sparse(b)``: sparse Jacobians and Hessians by compressed evaluation.

A Jacobian with few nonzeros per row needs far fewer products than it has columns:
columns that share no row (*structurally orthogonal*) get one color, one pushforward
per color computes the sum of that color's columns, and each nonzero ``(i, j)`` is read
back from the compressed column of ``j``'s color at row ``i`` (Curtis, Powell and Reid;
Gebremedhin, Manne and Pothen, "What color is your Jacobian?").  Rows are colored the
same way when batched pullbacks need fewer calls.  Hessians: column coloring of the
(symmetric) pattern, with Hessian-vector products of the inner backend's gradient.

The pattern comes from :func:`abstractdiff.jacobian_sparsity` /
:func:`abstractdiff.hessian_sparsity` (or the user's ``sparsity=``), the coloring from
networkx's greedy coloring of the column intersection graph.  Both are computed once per
flat function, input shapes and *values of the data arguments* and of what ``f`` reads from
globals and closures (a detected pattern depends on everything that is not differentiated:
``take(x, idx)`` has another pattern for another ``idx``), so each call with the same data is
the compressed products plus a gather.  A
prepared operator detects at preparation, and again whenever a call's data differ.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import numpy as np

from ._arrays import ar, dtype_name, shape_of, size_of
from ._backend import Backend
from ._cache import value_key
from ._captures import captures
from ._convert import content_of
from ._derived import GradientFunction, PackedInput
from ._errors import ArgumentTypeError, InvalidArgumentError, ShapeMismatchError, SparsityPatternError
from ._hooks import HOOKS, approximates
from ._prepare import HessianPrep, JacobianPrep, Preparation
from ._second_order import _forwarded
from ._sparsity import flat_hessian_sparsity, flat_jacobian_sparsity
from ._tree import FlatFunction, PlanCache, artefacts

__all__ = ["Sparse", "color_columns"]

FlatFn = Callable[[list, list], tuple]

#: The colorings ``ad.Sparse`` offers: networkx's greedy strategy ``largest_first`` (a
#: column meeting many others is colored first), or columns in their natural order.
COLORINGS = ("greedy", "natural")


def _sp() -> Any:
    import scipy.sparse

    return scipy.sparse


# ------------------------------------------------------------------ patterns and colors
def as_pattern(sparsity: Any) -> Any:
    """``sparsity`` (a scipy sparse matrix or a 2-D array, nonzero or True where the
    derivative may be nonzero) as a boolean CSR matrix."""
    sp = _sp()
    if sp.issparse(sparsity):
        pattern = sp.csr_matrix(sparsity)
    elif hasattr(sparsity, "shape") and hasattr(sparsity, "dtype") or isinstance(sparsity, (list, tuple)):
        dense = np.asarray(sparsity)
        if dense.ndim != 2:
            raise ShapeMismatchError(
                f"sparsity must be a 2-D pattern (y.size, x.size) for a Jacobian or (x.size, x.size) for a "
                f"Hessian, got an array of shape {dense.shape}"
            )
        pattern = sp.csr_matrix(dense != 0)
    else:
        raise ArgumentTypeError(
            f"sparsity must be a scipy.sparse matrix or a boolean array, got {type(sparsity).__name__}"
        )
    pattern = (pattern != 0).tocsr()
    pattern.eliminate_zeros()
    pattern.sort_indices()
    return pattern


def color_columns(pattern: Any, coloring: str = "greedy") -> np.ndarray:
    """A color per column of ``pattern`` such that no two columns of one color have a nonzero
    in the same row (a coloring of the column intersection graph, by networkx)."""
    import networkx as nx

    sp = _sp()
    n = pattern.shape[1]
    p = pattern.astype(np.int8)
    conflicts = sp.triu((p.T @ p).tocsr(), k=1).tocoo()
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from(zip(conflicts.row.tolist(), conflicts.col.tolist()))
    strategy: Any = "largest_first" if coloring == "greedy" else (lambda g, _colors: sorted(g))
    colors = nx.coloring.greedy_color(graph, strategy=strategy)
    return np.array([colors[j] for j in range(n)], dtype=np.int64)


def _seeds(colors: np.ndarray) -> Any:
    """``S[c, j] = 1`` when column ``j`` has color ``c``: one seed vector per color (sparse)."""
    n = colors.size
    count = int(colors.max()) + 1 if n else 0
    return _sp().csr_matrix((np.ones(n), (colors, np.arange(n))), shape=(count, n))


def _digest(pattern: Any) -> str:
    h = hashlib.sha1(repr(pattern.shape).encode())
    h.update(np.ascontiguousarray(pattern.indptr).tobytes())
    h.update(np.ascontiguousarray(pattern.indices).tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ compressed products
class _Plan:
    """A pattern, its coloring and what decompression needs, for one flat function and input shapes.

    ``mode`` is ``"forward"`` (columns colored; one pushforward per color) or ``"reverse"``
    (rows colored; one pullback per color).  Compressed results ``B`` are ``(colors, length)``:
    ``B[c]`` the sum of color ``c``'s columns (forward) or rows (reverse).
    """

    def __init__(self, pattern: Any, mode: str, colors: np.ndarray, what: str, given: bool):
        self.pattern, self.mode, self.colors, self.what, self.given = pattern, mode, colors, what, given
        self.held: list[Any] = []
        coo = pattern.tocoo()  # CSR order: data in this order builds the result on pattern's indices
        self.rows, self.cols = coo.row, coo.col
        seeds = _seeds(colors)
        self.seeds = seeds.toarray()
        self.count = self.seeds.shape[0]
        # where a compressed result may be nonzero: anywhere else, the pattern misses an entry
        support = seeds @ (pattern.T if mode == "forward" else pattern).astype(np.float64)
        self.outside = support.toarray() == 0
        if mode == "forward":
            self.pick = (colors[self.cols], self.rows)
        else:
            self.pick = (colors[self.rows], self.cols)

    def decompress(self, compressed: np.ndarray, approximate: bool, order: int = 1) -> Any:
        """The sparse matrix from the compressed results, after checking them against the pattern.

        An approximating backend's results are nonzero by its error where the pattern has none:
        finite differences' error, about ``eps**(1/3)`` relative at first order and ``eps**(1/4)``
        at second, in the results' dtype (float32 Hessians err by ~1e-2, float64 Jacobians ~1e-5)."""
        scale = float(np.max(np.abs(compressed))) if compressed.size else 0.0
        eps = float(np.finfo(compressed.dtype).eps) if np.issubdtype(compressed.dtype, np.floating) else 2.0**-52
        tol = eps ** (1 / (2 + order)) * max(1.0, scale) if approximate else 0.0
        bad = self.outside & (np.abs(compressed) > tol)
        if bad.any():
            c, k = (int(v[0]) for v in np.nonzero(bad))
            where = f"row {k}" if self.mode == "forward" else f"column {k}"
            source = "the sparsity you passed" if self.given else "the detected pattern"
            kind = "column" if self.mode == "forward" else "row"
            raise SparsityPatternError(
                f"the {self.what} has a nonzero at {where} of the compressed {kind}"
                f" of color {c} ({compressed[c, k]!r}), where {source} has none: the pattern misses an entry, "
                f"and the sparse result would be wrong. Pass a pattern that holds every nonzero (sparsity=...), "
                f"or leave sparsity=None to detect it"
            )
        values = compressed[self.pick]
        return _sp().csr_matrix((values, self.pattern.indices, self.pattern.indptr), shape=self.pattern.shape)


def _seed_leaves(b: Backend, block: np.ndarray, xs: list) -> list:
    """Rows of ``block`` (``(k, n)``) cut into leaves shaped ``(k,) + x.shape``, as ``b``'s arrays."""
    out, start = [], 0
    k = block.shape[0]
    for x in xs:
        n = size_of(x)
        out.append(b.asarray(np.ascontiguousarray(block[:, start : start + n]).reshape((k,) + shape_of(x)),
                             dtype_name(x)))
        start += n
    return out


def _compressed(b: Backend, seeds: np.ndarray, call: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``call`` on the seeds in ``b``'s chunks (the last one padded: one shape per batched call)."""
    chunks = b.basis_chunks(seeds.shape[0])
    if not chunks:
        return np.zeros((0, 0))
    width = chunks[0][1] - chunks[0][0]
    out = []
    for start, stop in chunks:
        block = np.zeros((width, seeds.shape[1]), dtype=seeds.dtype)
        block[: stop - start] = seeds[start:stop]
        out.append(call(block)[: stop - start])
    return np.concatenate(out, axis=0)


def _flat_numpy(b: Backend, leaves: list, k: int) -> np.ndarray:
    """Batched leaves ``(k,) + shape`` as one ``(k, total)`` numpy array."""
    return np.concatenate([np.reshape(np.asarray(b.to_numpy(v)), (k, -1)) for v in leaves], axis=1)


# ------------------------------------------------------------------ Jacobians
def _jacobian_plan(sparse: Sparse, fn: FlatFn, xs: list, data: list) -> _Plan:
    inner = sparse.inner
    n = sum(size_of(x) for x in xs)
    if sparse.sparsity is not None:
        with inner.scope([*xs, *data]):  # jax evaluates float64 only in its x64 scope
            m = size_of(fn(xs, data)[0])
        pattern = sparse.sparsity
        _check_shape(pattern, (m, n), "Jacobian", "(y.size, x.size)")
    else:
        pattern = flat_jacobian_sparsity(fn, _numpy(inner, xs), _numpy(inner, data))
    columns = color_columns(pattern, sparse.coloring) if inner.has_forward else None
    rows = color_columns(pattern.T.tocsr(), sparse.coloring) if inner.has_reverse else None
    if columns is not None and (rows is None or _count(columns) <= _count(rows)):
        return _Plan(pattern, "forward", columns, "Jacobian", sparse.sparsity is not None)
    return _Plan(pattern, "reverse", rows, "Jacobian", sparse.sparsity is not None)  # type: ignore[arg-type]


def _count(colors: np.ndarray) -> int:
    return int(colors.max()) + 1 if colors.size else 0


def _check_shape(pattern: Any, expected: tuple, what: str, layout: str) -> None:
    if pattern.shape != expected:
        raise ShapeMismatchError(
            f"sparsity has shape {pattern.shape} but the {what} of f at x has shape {expected} {layout}; "
            f"a pytree x counts its float leaves raveled and concatenated in flatten order, y likewise"
        )


def _numpy(b: Backend, leaves: list) -> list:
    return [np.asarray(b.to_numpy(v)) for v in leaves]


def sparse_jacobian(sparse: Sparse, plan: _Plan, fn: FlatFn, xs: list, data: list) -> Any:
    """The CSR Jacobian of ``fn`` at ``xs`` by ``plan``'s compressed products."""
    inner = sparse.inner
    m, n = plan.pattern.shape
    if plan.count == 0:
        return _sp().csr_matrix((m, n))
    if plan.mode == "forward":
        y, _, jvps = inner.flat_value_and_batched_pushforward(fn, xs, data)

        def call(block: np.ndarray) -> np.ndarray:
            return np.reshape(np.asarray(inner.to_numpy(jvps(_seed_leaves(inner, block, xs)))), (block.shape[0], m))
    else:
        y, _, vjps = inner.flat_value_and_batched_pullback(fn, xs, data)

        def call(block: np.ndarray) -> np.ndarray:
            k = block.shape[0]
            dys = inner.asarray(block.reshape((k,) + shape_of(y)), dtype_name(y))
            return _flat_numpy(inner, inner.complete_batched(vjps(dys), xs, k), k)

    return plan.decompress(_compressed(inner, plan.seeds, call), approximates(inner, 1), order=1)


# ------------------------------------------------------------------ Hessians
def _hessian_plan(sparse: Sparse, fn: FlatFn, xs: list, data: list) -> _Plan:
    inner = sparse.inner
    n = sum(size_of(x) for x in xs)
    if sparse.sparsity is not None:
        pattern = sparse.sparsity
        _check_shape(pattern, (n, n), "Hessian", "(x.size, x.size)")
    else:
        pattern = flat_hessian_sparsity(fn, _numpy(inner, xs), _numpy(inner, data))
    mode = "forward" if inner.has_forward else "reverse"  # H is symmetric: rows and columns alike
    return _Plan(pattern, mode, color_columns(pattern, sparse.coloring), "Hessian", sparse.sparsity is not None)


def sparse_hessian(sparse: Sparse, plan: _Plan, fn: FlatFn, xs: list, data: list) -> Any:
    """The CSR Hessian of scalar ``fn`` at ``xs``: compressed Hessian-vector products, forward
    over reverse (the inner backend's batched pushforward of its gradient) where it has a
    forward mode, else reverse over reverse."""
    inner = sparse.inner
    n = plan.pattern.shape[0]
    if plan.count == 0:
        return _sp().csr_matrix((n, n))
    shapes = [shape_of(x) for x in xs]
    store = artefacts(fn, sparse, "sparse hessian")
    packed = store.get(("packed", tuple(shapes)), lambda: PackedInput(fn, shapes))
    grad = store.get(("gradient function", tuple(shapes)), lambda: GradientFunction(inner, packed))
    a = ar()
    z = a.do("concatenate", [a.do("reshape", x, (size_of(x),)) for x in xs]) if len(xs) > 1 else \
        a.do("reshape", xs[0], (n,))
    if plan.mode == "forward":
        _, _, jvps = inner.flat_value_and_batched_pushforward(grad, [z], data)

        def call(block: np.ndarray) -> np.ndarray:
            return np.asarray(inner.to_numpy(jvps([inner.asarray(block, dtype_name(z))])))
    else:
        _, _, vjps = inner.flat_value_and_batched_pullback(grad, [z], data)

        def call(block: np.ndarray) -> np.ndarray:
            k = block.shape[0]
            return _flat_numpy(inner, inner.complete_batched(vjps(inner.asarray(block, dtype_name(z))), [z], k), k)

    return plan.decompress(_compressed(inner, plan.seeds, call), approximates(inner, 2), order=2)


# ------------------------------------------------------------------ preparations
def _plan_key(sparse: Sparse, fn: Any, xs: list, data: list) -> tuple[tuple | None, list]:
    """``(key, held)``: what a plan depends on besides the flat function (which holds the
    static leaves), and the objects the plan must hold so that the ids in the key stay theirs.

    A given pattern depends on the input shapes only.  A detected one also on the data
    arguments by value (the one keying policy, :func:`abstractdiff._cache.value_key`) and on
    what ``f`` reads from globals and closures (:func:`abstractdiff._captures.captures`: a
    global index array).  ``None``: data without concrete content (keyed by identity only),
    so the plan is rebuilt rather than cached."""
    shapes = (tuple(shape_of(v) for v in xs), tuple(shape_of(v) for v in data))
    if sparse.sparsity is not None:
        return shapes, []
    alive: list[Any] = []
    data_key = value_key(data, alive, native=content_of)
    if alive:
        return None, []
    captured, held = captures(fn.f) if isinstance(fn, FlatFunction) else ((), [])
    return (shapes, data_key, captured), held


class SparseJacobianPrep(Preparation):
    """The Jacobian as a ``(y.size, x.size)`` CSR matrix: pattern and coloring built at
    preparation, and again for a call whose data arguments differ (per input shapes and
    data values, kept in the flat function's artefacts)."""

    operator = JacobianPrep.operator
    _build = staticmethod(_jacobian_plan)
    _compute = staticmethod(sparse_jacobian)
    _store = "sparse jacobian plan"

    def setup(self, xs: list, data: list) -> None:
        self.plan(xs, data)

    def plan(self, xs: list, data: list) -> _Plan:
        b, fn = self.backend, self.fn
        key, held = _plan_key(b, fn, xs, data)
        if key is None:
            return self._build(b, fn, xs, data)

        def build() -> _Plan:
            plan = self._build(b, fn, xs, data)
            plan.held = held  # the objects captures() keyed by identity: their ids stay theirs
            return plan

        return artefacts(fn, b, self._store).get(key, build)

    def run(self, xs: list, data: list, *extra: Any) -> Any:
        return self._compute(self.backend, self.plan(xs, data), self.fn, xs, data)


class SparseHessianPrep(SparseJacobianPrep):
    """The Hessian of a scalar ``f`` as an ``(x.size, x.size)`` CSR matrix."""

    operator = HessianPrep.operator
    _build = staticmethod(_hessian_plan)
    _compute = staticmethod(sparse_hessian)
    _store = "sparse hessian plan"


_SPARSE_PREPARATIONS: dict[type, type[Preparation]] = {JacobianPrep: SparseJacobianPrep,
                                                        HessianPrep: SparseHessianPrep}


# ------------------------------------------------------------------ the backend
class Sparse(Backend):
    """``Sparse(b, sparsity=None, coloring="greedy")``: ``jacobian`` and ``hessian`` as
    ``scipy.sparse`` CSR matrices by compressed evaluation on ``b``; every other operator is ``b``'s.

    ``ad.jacobian(Sparse(b), f, x) -> J``, a ``csr_matrix`` of shape ``(y.size, x.size)``;
    ``ad.hessian(Sparse(b), f, x) -> H`` of shape ``(x.size, x.size)``.  A pytree ``x``
    counts its float leaves raveled and concatenated in flatten order (``y`` likewise).
    ``sparsity`` is the pattern (a scipy sparse matrix or a boolean array of that shape);
    ``None`` detects it with :func:`~abstractdiff.jacobian_sparsity` /
    :func:`~abstractdiff.hessian_sparsity`.  ``coloring`` is ``"greedy"`` (networkx,
    largest first) or ``"natural"``.  Pattern and coloring are built once per function,
    input shapes and values of the data arguments (prepared operators too: a call with
    other data detects again); a computed nonzero outside the pattern raises
    :class:`~abstractdiff.SparsityPatternError`.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> b = ad.Sparse("finite_differences")
        >>> J = ad.jacobian(b, lambda x: x[1:] * x[:-1], np.array([1.0, 2.0, 3.0]))
        >>> J.shape, J.nnz
        ((2, 3), 4)
        >>> np.round(J.toarray(), 6)
        array([[2., 1., 0.],
               [0., 3., 2.]])
    """

    name = "sparse"

    def __init__(self, backend: str | Backend, sparsity: Any = None, coloring: str = "greedy"):
        self.inner = _resolve(backend)
        if coloring not in COLORINGS:
            raise InvalidArgumentError(f"coloring must be one of {', '.join(map(repr, COLORINGS))}, got {coloring!r}")
        self.sparsity = None if sparsity is None else as_pattern(sparsity)
        self.coloring = coloring
        self.name = f"sparse({self.inner.name})"  # type: ignore[misc]
        self.approximate = self.inner.approximate  # type: ignore[misc]
        digest = None if self.sparsity is None else _digest(self.sparsity)
        self.options = {"backend": self.inner, "sparsity": digest, "coloring": coloring}
        self._plans = PlanCache(numpy_native=self.inner._plans.numpy_native)

    def __repr__(self) -> str:
        given = "detected" if self.sparsity is None else f"given {self.sparsity.shape}"
        return f"Sparse({self.inner!r}, sparsity={given}, coloring={self.coloring!r})"

    @property
    def cache_key(self) -> tuple:
        return (Sparse, self.inner.cache_key, self.options["sparsity"], self.coloring)

    @property
    def device(self) -> str:  # type: ignore[override]
        return self.inner.device

    @property
    def reuses_traces(self) -> bool:  # type: ignore[override]
        return self.inner.reuses_traces

    @property
    def has_reverse(self) -> bool:
        return self.inner.has_reverse

    @property
    def has_forward(self) -> bool:
        return self.inner.has_forward

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        return self.inner.asarray(a, dtype)

    def preparation(self, cls: type[Preparation], fn: Any, xs: list, data: list) -> Preparation:
        """The inner backend's preparations, but the sparse ones for ``jacobian`` and ``hessian``."""
        return super().preparation(_SPARSE_PREPARATIONS.get(cls, cls), fn, xs, data)


_HOOKS_OF_INNER = (*HOOKS["arrays"], *HOOKS["devices"], *HOOKS["pytrees"], "one_hot", "complete",
                   "complete_batched", "basis_chunks")
for _name in (*[n for n in dir(Backend) if n.startswith("flat_")], *_HOOKS_OF_INNER):
    if _name not in Sparse.__dict__:
        setattr(Sparse, _name, _forwarded(_name))


def _resolve(b: Any) -> Backend:
    from ._registry import backend

    if not isinstance(b, (str, Backend)):
        raise ArgumentTypeError(f"backend must be a backend name (such as 'jax') or a Backend, got {type(b).__name__}")
    b = backend(b)
    if b.implicit:
        raise ArgumentTypeError(f"ad.Sparse needs an explicit backend, not {b!r}: it differentiates arrays")
    if isinstance(b, Sparse):
        raise ArgumentTypeError(f"ad.Sparse of another ad.Sparse ({b!r}): pass the inner backend itself")
    return b

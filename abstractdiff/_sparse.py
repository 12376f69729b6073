"""``ad.Sparse(b)``: sparse Jacobians and Hessians by compressed evaluation.

A Jacobian with few nonzeros per row needs far fewer products than it has columns:
columns that share no row (*structurally orthogonal*) get one color, one pushforward
per color computes the sum of that color's columns, and each nonzero ``(i, j)`` is read
back from the compressed column of ``j``'s color at row ``i`` (Curtis, Powell and Reid;
Gebremedhin, Manne and Pothen, "What color is your Jacobian?").  Rows are colored the
same way for pullbacks, and a *bidirectional* coloring seeds some columns forward and some
rows backward (a dense row plus a dense column: 2 products of each kind where either side
alone needs ``n``).  Hessians are colored *symmetrically*: a star coloring, read back
directly (``H[i, j]`` from the product of ``j``'s color at ``i`` or of ``i``'s color at
``j``), or an acyclic one, read back by substitution (fewer colors, more arithmetic); the
colorings are :mod:`abstractdiff._coloring`'s (SparseMatrixColorings.jl's algorithms).

The pattern comes from :func:`abstractdiff.jacobian_sparsity` /
:func:`abstractdiff.hessian_sparsity`, from one dense derivative (``sparsity="dense-probe"``)
or from the user's ``sparsity=``.  Pattern and coloring are computed once per flat function,
input shapes and *values of the data arguments* and of what ``f`` reads from globals and
closures (a detected pattern depends on everything that is not differentiated: ``take(x,
idx)`` has another pattern for another ``idx``), so each call with the same data is the
compressed products plus a gather.  A prepared operator detects at preparation, and again
whenever a call's data differ.  Equal ``Sparse`` backends share their plans: an unprepared
``ad.jacobian(ad.Sparse("jax"), f, x)`` plans ``f`` once, not once per new ``Sparse``.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any, Callable, Hashable, NamedTuple

import numpy as np

from ._sparsity import flat_hessian_sparsity, flat_jacobian_sparsity
from .core import (
    HOOKS,
    LRU,
    ArgumentTypeError,
    Backend,
    CustomRuleError,
    FlatFunction,
    GradientFunction,
    HessianPrep,
    InvalidArgumentError,
    JacobianPrep,
    ModeMismatchError,
    PackedInput,
    PlanCache,
    Preparation,
    PreparedHessian,
    PreparedJacobian,
    ShapeMismatchError,
    SparsityPatternError,
    approximates,
    ar,
    artefacts,
    captures,
    content_of,
    dtype_name,
    forwarded,
    shape_of,
    size_of,
    value_key,
)

__all__ = ["Sparse", "SparseColors", "color_columns"]

FlatFn = Callable[[list, list], tuple]

#: ``coloring=`` values and what they mean: ``(kind, vertex order)``.  ``"auto"``: the
#: symmetric (star) coloring of a Hessian, the cheapest of column, row and bidirectional
#: coloring of a Jacobian.  ``"greedy"`` and ``"natural"`` (the vertex orders of earlier
#: versions) are ``"auto"`` with the largest-first and the natural order.
COLORINGS: dict[str, tuple[str, str]] = {
    "auto": ("auto", "largest_first"),
    "star": ("star", "largest_first"),
    "acyclic": ("acyclic", "largest_first"),
    "column": ("column", "largest_first"),
    "greedy": ("auto", "largest_first"),
    "natural": ("auto", "natural"),
}

#: ``mode=`` values: ``"auto"`` (the fewest products), ``"forward"`` (columns, pushforwards),
#: ``"reverse"`` (rows, pullbacks), ``"mixed"`` (bidirectional: both).  For a Hessian,
#: forward is forward-over-reverse Hessian-vector products, reverse reverse-over-reverse.
MODES = ("auto", "forward", "reverse", "mixed")

#: ``sparsity="dense-probe"``: the pattern of one dense derivative at the preparation point.
DENSE_PROBE = "dense-probe"


class SparseColors(NamedTuple):
    """The colors of a plan: ``columns`` (``(x.size,)``, the seed of each column pushed
    forward) and ``rows`` (``(y.size,)``, the seed of each row pulled back); ``None`` for a
    side that is not seeded, ``-1`` for a column or row left out of a bidirectional
    coloring.  A Hessian's symmetric coloring is its ``columns`` (``rows`` is ``None``)."""

    columns: np.ndarray | None
    rows: np.ndarray | None


def _sp() -> Any:
    import scipy.sparse

    return scipy.sparse


def _coloring_module() -> Any:
    """:mod:`abstractdiff._coloring`, or ``None`` where it cannot be imported (the networkx
    column coloring is the fallback then)."""
    try:
        from . import _coloring
    except ImportError:
        return None
    return _coloring


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
            f"sparsity must be a scipy.sparse matrix, a boolean array or {DENSE_PROBE!r}, "
            f"got {type(sparsity).__name__}"
        )
    return _clean(pattern)


def _clean(pattern: Any) -> Any:
    """A boolean CSR copy of ``pattern``, canonical (sorted, no explicit zeros): a plan holds its
    index arrays, which nothing else may then sort or prune in place."""
    pattern = _sp().csr_matrix(pattern, copy=True)  # first: scipy's != sorts its operand in place
    pattern = (pattern != 0).tocsr()
    pattern.eliminate_zeros()
    pattern.sort_indices()
    return pattern


def _symmetric(pattern: Any) -> Any:
    """``pattern`` or its transpose: the pattern a symmetric coloring needs."""
    return _clean(pattern + pattern.T)


def color_columns(pattern: Any, coloring: str = "greedy") -> np.ndarray:
    """A color per column of ``pattern`` such that no two columns of one color have a nonzero
    in the same row (a distance-1 coloring of the column intersection graph);
    ``coloring`` is a vertex order (``"largest_first"``, ``"natural"``...) or a ``coloring=``
    value naming one (``"greedy"``: largest first)."""
    order = COLORINGS[coloring][1] if coloring in COLORINGS else coloring
    module = _coloring_module()
    if module is not None:
        return np.asarray(module.column_coloring(pattern, order=order), dtype=np.int64)
    return _networkx_columns(pattern, order)


def _networkx_columns(pattern: Any, order: str) -> np.ndarray:
    import networkx as nx

    sp = _sp()
    n = pattern.shape[1]
    p = pattern.astype(np.int8)
    conflicts = sp.triu((p.T @ p).tocsr(), k=1).tocoo()
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from(zip(conflicts.row.tolist(), conflicts.col.tolist()))
    strategy: Any = (lambda g, _colors: sorted(g)) if order == "natural" else order
    colors = nx.coloring.greedy_color(graph, strategy=strategy)
    return np.array([colors[j] for j in range(n)], dtype=np.int64)


def _seeds(colors: np.ndarray, count: int) -> np.ndarray:
    """``S[c, j] = 1`` when column ``j`` has color ``c`` (``-1``: no seed): ``(count, n)``."""
    seeds = np.zeros((count, colors.size))
    seeded = np.nonzero(colors >= 0)[0]
    seeds[colors[seeded], seeded] = 1.0
    return seeds


def _count(colors: np.ndarray | None) -> int:
    return 0 if colors is None or not colors.size else int(colors.max()) + 1


def _digest(pattern: Any) -> str:
    h = hashlib.sha1(repr(pattern.shape).encode())
    h.update(np.ascontiguousarray(pattern.indptr).tobytes())
    h.update(np.ascontiguousarray(pattern.indices).tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ plans
class _Plan:
    """A pattern, its coloring and what decompression needs, for one flat function and input shapes.

    Compressed results are ``forward`` ``(n_forward, y.size)`` (``forward[c]``: the sum of
    color ``c``'s columns, one pushforward or Hessian-vector product per color) and
    ``reverse`` ``(n_reverse, x.size)`` (``reverse[c]``: the sum of color ``c``'s rows, one
    pullback per color).  ``mode``: ``"forward"``, ``"reverse"`` or ``"mixed"`` (both).  A
    ``symmetric`` plan (a Hessian's) reads ``H[i, j]`` from ``forward[color[j], i]`` or from
    ``forward[color[i], j]``, whichever holds it alone.  ``index``: where each nonzero (CSR
    order) is in ``forward`` and ``reverse`` raveled and concatenated, when every one is read
    directly; else ``substitute(forward, reverse)`` computes them (acyclic colorings).
    """

    def __init__(self, pattern: Any, what: str, given: bool, columns: np.ndarray | None, rows: np.ndarray | None,
                 *, kind: str, symmetric: bool = False, substitute: Callable[..., np.ndarray] | None = None):
        self.pattern, self.what, self.given, self.kind, self.symmetric = pattern, what, given, kind, symmetric
        self.colors = SparseColors(columns, rows)
        self.n_forward, self.n_reverse = _count(columns), _count(rows)
        #: products per call, forward and reverse together
        self.count = self.n_forward + self.n_reverse
        self.mode = "mixed" if kind == "bidirectional" else "reverse" if rows is not None else "forward"
        self.held: list[Any] = []
        #: the seeds as the inner backend's arrays, per chunk and input signature (built on first use)
        self.native: dict = {}
        self.hvp_mode = "forward"  # a Hessian's: forward over reverse, or reverse over reverse
        #: this plan in the one mode a custom rule has, once a rule refused the other (see _in_the_rules_mode)
        self.rules_mode: _Plan | None = None
        sp = _sp()
        p = pattern.astype(np.float64)
        self.forward_seeds = None if columns is None else _seeds(columns, self.n_forward)
        self.reverse_seeds = None if rows is None else _seeds(rows, self.n_reverse)
        # where a compressed result may be nonzero: anywhere else, the pattern misses an entry
        self.outside_forward = None if columns is None else (sp.csr_matrix(self.forward_seeds) @ p.T).toarray() == 0
        self.outside_reverse = None if rows is None else (sp.csr_matrix(self.reverse_seeds) @ p).toarray() == 0
        self.substitute = substitute
        self.index = None if substitute is not None else self._direct_index(p)

    def _direct_index(self, p: Any) -> np.ndarray | None:
        """Each nonzero's place in the compressed results (``None``: some need substitution)."""
        m, n = self.pattern.shape
        coo = self.pattern.tocoo()  # CSR order: data in this order builds the result on pattern's indices
        i, j = coo.row, coo.col
        index = np.full(i.size, -1, dtype=np.int64)
        columns, rows = self.colors
        if self.n_forward:
            counts = np.asarray(p @ self.forward_seeds.T)  # (m, n_forward): columns of each color in each row
            c = columns[j]
            alone = (c >= 0) & (counts[i, np.maximum(c, 0)] == 1)
            index[alone] = c[alone] * m + i[alone]
            if self.symmetric:  # H[i, j] = H[j, i]: from the product of i's color, at row j
                c = columns[i]
                alone = (index < 0) & (counts[j, c] == 1)
                index[alone] = c[alone] * n + j[alone]
        if self.n_reverse:
            counts = np.asarray(self.reverse_seeds @ p)  # (n_reverse, n): rows of each color in each column
            r = rows[i]
            alone = (index < 0) & (r >= 0) & (counts[np.maximum(r, 0), j] == 1)
            index[alone] = self.n_forward * m + r[alone] * n + j[alone]
        return index if (index >= 0).all() else None

    def decompress(self, forward: np.ndarray | None, reverse: np.ndarray | None, approximate: bool,
                   order: int = 1) -> Any:
        """The sparse matrix from the compressed results, after checking them against the pattern."""
        parts = [a for a in (forward, reverse) if a is not None]
        for compressed, outside, kind in ((forward, self.outside_forward, "column"),
                                          (reverse, self.outside_reverse, "row")):
            if compressed is not None:
                self._check(compressed, outside, kind, approximate, order)
        if self.index is not None:
            flat = np.concatenate([a.ravel() for a in parts]) if len(parts) > 1 else parts[0].ravel()
            values = flat[self.index]
        else:
            values = self.substitute(forward, reverse)  # type: ignore[misc]
        # the result's own index arrays: a caller sorting or pruning it in place leaves the plan intact
        return _sp().csr_matrix((values, self.pattern.indices.copy(), self.pattern.indptr.copy()),
                                shape=self.pattern.shape)

    def _check(self, compressed: np.ndarray, outside: np.ndarray, kind: str, approximate: bool, order: int) -> None:
        """An approximating backend's results are nonzero by its error where the pattern has none:
        finite differences' error, about ``eps**(1/3)`` relative at first order and ``eps**(1/4)``
        at second, in the results' dtype (float32 Hessians err by ~1e-2, float64 Jacobians ~1e-5)."""
        scale = float(np.max(np.abs(compressed))) if compressed.size else 0.0
        eps = float(np.finfo(compressed.dtype).eps) if np.issubdtype(compressed.dtype, np.floating) else 2.0**-52
        tol = eps ** (1 / (2 + order)) * max(1.0, scale) if approximate else 0.0
        bad = outside & (np.abs(compressed) > tol)
        if bad.any():
            c, k = (int(v[0]) for v in np.nonzero(bad))
            where = f"row {k}" if kind == "column" else f"column {k}"
            source = "the sparsity you passed" if self.given else "the detected pattern"
            raise SparsityPatternError(
                f"the {self.what} has a nonzero at {where} of the compressed {kind}"
                f" of color {c} ({compressed[c, k]!r}), where {source} has none: the pattern misses an entry, "
                f"and the sparse result would be wrong. Pass a pattern that holds every nonzero (sparsity=...), "
                f"or leave sparsity=None to detect it"
            )


def _csr_data(result: Any, pattern: Any) -> np.ndarray:
    """``result``'s values at ``pattern``'s nonzeros, in CSR order."""
    result = _sp().csr_matrix(result)
    result.sort_indices()
    if result.nnz == pattern.nnz and np.array_equal(result.indptr, pattern.indptr) \
            and np.array_equal(result.indices, pattern.indices):
        return np.asarray(result.data)
    coo = pattern.tocoo()
    return np.asarray(result[coo.row, coo.col]).ravel()


def _substitution(module: Any, name: str, pattern: Any, coloring: Any) -> Callable[..., np.ndarray]:
    """``(forward, reverse) -> values`` by ``module``'s decompression ``name`` (its plan
    object's ``values`` where it offers one: the work done once)."""
    make_plan = getattr(module, f"{name}_plan", None)
    if make_plan is not None:
        plan = make_plan(pattern, coloring)
        if name == "bidirectional":
            return lambda forward, reverse: np.asarray(plan.values(forward.T, reverse))
        return lambda forward, reverse: np.asarray(plan.values(forward.T))
    decompress = getattr(module, f"decompress_{name}")
    if name == "bidirectional":
        return lambda forward, reverse: _csr_data(decompress(pattern, coloring, forward.T, reverse), pattern)
    return lambda forward, reverse: _csr_data(decompress(pattern, coloring, forward.T), pattern)


def _jacobian_coloring(sparse: Sparse, pattern: Any, given: bool, mode: str | None = None) -> _Plan:
    """The cheapest plan ``sparse``'s mode (or ``mode``) and coloring allow: columns (forward),
    rows (reverse) or both (bidirectional); ties go to forward, then reverse."""
    inner, kind, order, mode = sparse.inner, sparse.kind, sparse.order, mode or sparse.mode
    if kind in ("star", "acyclic"):
        raise InvalidArgumentError(
            f"coloring={sparse.coloring!r} is a symmetric coloring, for Hessians; a Jacobian takes coloring='auto' "
            f"(the cheapest of column, row and bidirectional) or 'column' (columns or rows only), and mode=... "
            f"to force one"
        )
    options: list[tuple[int, int, Callable[[], _Plan]]] = []
    if mode in ("auto", "forward") and inner.has_forward:
        columns = color_columns(pattern, order)
        options.append((_count(columns), 0, lambda: _Plan(pattern, "Jacobian", given, columns, None, kind="column")))
    if mode in ("auto", "reverse") and inner.has_reverse:
        rows = color_columns(pattern.T.tocsr(), order)
        options.append((_count(rows), 1, lambda: _Plan(pattern, "Jacobian", given, None, rows, kind="row")))
    if mode in ("auto", "mixed") and kind == "auto" and inner.has_forward and inner.has_reverse:
        module = _coloring_module()
        if module is None and mode == "mixed":
            raise InvalidArgumentError("mode='mixed' needs the bidirectional coloring of abstractdiff._coloring")
        if module is not None:
            bi = module.bidirectional_coloring(pattern, order=order)
            options.append((int(bi.ncolors), 2, lambda: _bidirectional_plan(module, pattern, given, bi)))
    return min(options, key=lambda option: option[:2])[2]()


def _bidirectional_plan(module: Any, pattern: Any, given: bool, bi: Any) -> _Plan:
    columns = np.asarray(bi.column_colors, dtype=np.int64)
    rows = np.asarray(bi.row_colors, dtype=np.int64)
    plan = _Plan(pattern, "Jacobian", given, columns, rows, kind="bidirectional")
    if plan.index is None:  # a coloring decompressed by substitution
        plan = _Plan(pattern, "Jacobian", given, columns, rows, kind="bidirectional",
                     substitute=_substitution(module, "bidirectional", pattern, bi))
    return plan


def _hessian_coloring(sparse: Sparse, pattern: Any, given: bool) -> _Plan:
    """A symmetric plan: star (direct) or acyclic (substitution) coloring, or distance-1
    column coloring (``coloring="column"``, or where :mod:`._coloring` is missing)."""
    inner, kind, order = sparse.inner, sparse.kind, sparse.order
    if sparse.mode == "mixed":
        raise InvalidArgumentError(
            "mode='mixed' (bidirectional coloring) is for Jacobians; a Hessian is symmetric: its colorings "
            "are coloring='star' (the default), 'acyclic' or 'column', with mode='forward' or 'reverse'"
        )
    pattern = _symmetric(pattern)
    module = _coloring_module()
    substitute = None
    if kind in ("auto", "star") and module is not None:
        colors = np.asarray(module.star_coloring(pattern, order=order).colors, dtype=np.int64)
        kind = "star"
    elif kind == "acyclic" and module is not None:
        coloring = module.acyclic_coloring(pattern, order=order)
        colors = np.asarray(coloring.colors, dtype=np.int64)
        substitute = _substitution(module, "acyclic", pattern, coloring)
    else:
        colors, kind = color_columns(pattern, order), "column"
    plan = _Plan(pattern, "Hessian", given, colors, None, kind=kind, symmetric=True, substitute=substitute)
    plan.hvp_mode = "forward" if sparse.mode != "reverse" and inner.has_forward else "reverse"
    return plan


# ------------------------------------------------------------------ compressed products
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


def _compressed(b: Backend, seeds: np.ndarray, to_native: Callable[[np.ndarray], Any],
                call: Callable[[Any], np.ndarray], cache: dict | None = None, key: Hashable = None,
                native: bool = False) -> np.ndarray:
    """``call`` on the seeds in ``b``'s chunks (the last one padded: one shape per batched call),
    each chunk made ``b``'s arrays by ``to_native`` once per ``key`` where ``cache`` keeps them
    (a plan's: its seeds never change, so a call converts none).  ``native``: ``call``
    returns ``b``'s arrays, and so does this (inside a compiled call, see :func:`_fused`)."""
    chunks = b.basis_chunks(seeds.shape[0])
    if not chunks:
        return np.zeros((0, 0))
    width = chunks[0][1] - chunks[0][0]
    out = []
    for start, stop in chunks:
        seed = None if cache is None else cache.get((key, start))
        if seed is None:
            block = np.zeros((width, seeds.shape[1]), dtype=seeds.dtype)
            block[: stop - start] = seeds[start:stop]
            seed = to_native(block)
            if cache is not None:
                cache[(key, start)] = seed
        out.append(call(seed)[: stop - start])
    if native:
        return out[0] if len(out) == 1 else ar().do("concatenate", out, axis=0)
    return np.concatenate(out, axis=0)


def _flat_numpy(b: Backend, leaves: list, k: int, native: bool = False) -> np.ndarray:
    """Batched leaves ``(k,) + shape`` as one ``(k, total)`` numpy array (``b``'s array with ``native``)."""
    if native:
        a = ar()
        parts = [a.do("reshape", v, (k, -1)) for v in leaves]
        return parts[0] if len(parts) == 1 else a.do("concatenate", parts, axis=1)
    return np.concatenate([np.reshape(np.asarray(b.to_numpy(v)), (k, -1)) for v in leaves], axis=1)


def _numpy(b: Backend, leaves: list) -> list:
    return [np.asarray(b.to_numpy(v)) for v in leaves]


def _signature(xs: list) -> tuple:
    return tuple((shape_of(x), dtype_name(x)) for x in xs)


def jacobian_products(inner: Backend, fn: FlatFn, xs: list, data: list, forward_seeds: np.ndarray | None,
                      reverse_seeds: np.ndarray | None, cache: dict | None = None,
                      native: bool = False) -> tuple[Any, Any]:
    """``(J S_f^T, S_r J)`` transposed as ``(k_f, y.size)`` and ``(k_r, x.size)``: the batched
    pushforwards of the rows of ``forward_seeds`` and pullbacks of those of ``reverse_seeds``
    (``None`` for a side without seeds); numpy arrays, or ``inner``'s with ``native``."""
    forward = reverse = None
    if forward_seeds is not None and forward_seeds.shape[0]:
        y, _, jvps = inner.flat_value_and_batched_pushforward(fn, xs, data)
        m = size_of(y)

        def push(seeds: list) -> np.ndarray:
            out = jvps(seeds)
            return ar().do("reshape", out, (-1, m)) if native else np.reshape(np.asarray(inner.to_numpy(out)), (-1, m))

        forward = _compressed(inner, forward_seeds, lambda block: _seed_leaves(inner, block, xs), push, cache,
                              ("forward", _signature(xs)), native)
    if reverse_seeds is not None and reverse_seeds.shape[0]:
        y, _, vjps = inner.flat_value_and_batched_pullback(fn, xs, data)

        def cotangents(block: np.ndarray) -> Any:
            return inner.asarray(block.reshape((block.shape[0],) + shape_of(y)), dtype_name(y))

        def pull(dys: Any) -> np.ndarray:
            k = shape_of(dys)[0]
            return _flat_numpy(inner, inner.complete_batched(vjps(dys), xs, k), k, native)

        reverse = _compressed(inner, reverse_seeds, cotangents, pull, cache, ("reverse", _signature([y])), native)
    return forward, reverse


def hessian_products(sparse: Sparse, fn: FlatFn, xs: list, data: list, seeds: np.ndarray, mode: str,
                     cache: dict | None = None, native: bool = False) -> np.ndarray:
    """``(k, x.size)``: the Hessian-vector products of the rows of ``seeds``, forward over
    reverse (the inner backend's batched pushforward of its gradient) or reverse over reverse."""
    inner = sparse.inner
    n = sum(size_of(x) for x in xs)
    shapes = [shape_of(x) for x in xs]
    store = artefacts(fn, sparse, "sparse hessian")
    packed = store.get(("packed", tuple(shapes)), lambda: PackedInput(fn, shapes))
    grad = store.get(("gradient function", tuple(shapes)), lambda: GradientFunction(inner, packed))
    a = ar()
    z = a.do("concatenate", [a.do("reshape", x, (size_of(x),)) for x in xs]) if len(xs) > 1 else \
        a.do("reshape", xs[0], (n,))
    dtype = dtype_name(z)
    if mode == "forward":
        _, _, jvps = inner.flat_value_and_batched_pushforward(grad, [z], data)

        def call(block: Any) -> np.ndarray:
            out = jvps([block])
            return out if native else np.asarray(inner.to_numpy(out))
    else:
        _, _, vjps = inner.flat_value_and_batched_pullback(grad, [z], data)

        def call(block: Any) -> np.ndarray:
            k = shape_of(block)[0]
            return _flat_numpy(inner, inner.complete_batched(vjps(block), [z], k), k, native)

    key = (HessianPrep.operator, dtype)
    return _compressed(inner, seeds, lambda block: inner.asarray(block, dtype), call, cache, key, native)


# ------------------------------------------------------------------ Jacobians
def _check_shape(pattern: Any, expected: tuple, what: str, layout: str) -> None:
    if pattern.shape != expected:
        raise ShapeMismatchError(
            f"sparsity has shape {pattern.shape} but the {what} of f at x has shape {expected} {layout}; "
            f"a pytree x counts its float leaves raveled and concatenated in flatten order, y likewise"
        )


def _jacobian_pattern(sparse: Sparse, fn: FlatFn, xs: list, data: list) -> Any:
    inner = sparse.inner
    n = sum(size_of(x) for x in xs)
    if sparse.probe:  # one dense Jacobian, by the cheaper of n pushforwards and m pullbacks
        with inner.scope([*xs, *data]):  # jax evaluates float64 only in its x64 scope
            m = size_of(fn(xs, data)[0])
        forward = inner.has_forward and (n <= m or not inner.has_reverse)
        fwd, rev = jacobian_products(inner, fn, xs, data, np.eye(n) if forward else None,
                                     None if forward else np.eye(m))
        return _clean(_sp().csr_matrix(fwd.T if forward else rev))  # type: ignore[union-attr]
    if sparse.sparsity is not None:
        with inner.scope([*xs, *data]):
            m = size_of(fn(xs, data)[0])
        _check_shape(sparse.sparsity, (m, n), "Jacobian", "(y.size, x.size)")
        return sparse.sparsity
    return _clean(flat_jacobian_sparsity(fn, _numpy(inner, xs), _numpy(inner, data)))


def _jacobian_plan(sparse: Sparse, fn: FlatFn, xs: list, data: list) -> _Plan:
    pattern = _jacobian_pattern(sparse, fn, xs, data)
    return _jacobian_coloring(sparse, pattern, sparse.sparsity is not None)


def sparse_jacobian(sparse: Sparse, plan: _Plan, fn: FlatFn, xs: list, data: list) -> Any:
    """The CSR Jacobian of ``fn`` at ``xs`` by ``plan``'s compressed products."""
    if plan.count == 0:
        return _sp().csr_matrix(plan.pattern.shape)
    plan = plan.rules_mode or plan  # a custom rule refused this plan's mode before
    try:
        fused = _fused(sparse, plan, fn, xs, data, 1)
        if fused is not None:
            return fused
        forward, reverse = jacobian_products(sparse.inner, fn, xs, data, plan.forward_seeds, plan.reverse_seeds,
                                             plan.native)
    except CustomRuleError as err:  # a custom rule in one mode only: the Jacobian in that one
        return sparse_jacobian(sparse, _in_the_rules_mode(sparse, plan, err, 1), fn, xs, data)
    return plan.decompress(forward, reverse, approximates(sparse.inner, 1), order=1)


def _in_the_rules_mode(sparse: Sparse, plan: _Plan, err: CustomRuleError, order: int) -> _Plan:
    """``plan`` in the one mode a custom rule has, where ``err`` (the rule's refusal of the
    other, ``err.mode``) stopped it and ``mode="auto"`` left the choice to us, as a dense
    Jacobian or Hessian takes it; else ``err`` is raised again.  Kept on ``plan``: a later call
    goes straight to it.  A Jacobian colors the pattern again for pullbacks or pushforwards;
    a Hessian's coloring stays and its products become reverse over reverse."""
    refused, inner = getattr(err, "mode", None), sparse.inner
    if sparse.mode != "auto":
        raise err
    if order == 1:
        want = {"reverse": "forward", "forward": "reverse"}.get(refused)  # type: ignore[arg-type]
        if want is None or plan.mode == want or not (inner.has_forward if want == "forward" else inner.has_reverse):
            raise err
        plan.rules_mode = _jacobian_coloring(sparse, plan.pattern, plan.given, mode=want)
    else:
        if refused != "forward" or plan.hvp_mode != "forward" or not inner.has_reverse:
            raise err
        other = copy.copy(plan)
        other.native, other.hvp_mode = {}, "reverse"  # its own compiled calls: the refused ones are cached
        plan.rules_mode = other
    return plan.rules_mode


# ------------------------------------------------------------------ Hessians
def _hessian_pattern(sparse: Sparse, fn: FlatFn, xs: list, data: list) -> Any:
    n = sum(size_of(x) for x in xs)
    if sparse.probe:  # one dense Hessian: n Hessian-vector products
        mode = "forward" if sparse.mode != "reverse" and sparse.inner.has_forward else "reverse"
        return _clean(_sp().csr_matrix(hessian_products(sparse, fn, xs, data, np.eye(n), mode).T))
    if sparse.sparsity is not None:
        _check_shape(sparse.sparsity, (n, n), "Hessian", "(x.size, x.size)")
        return sparse.sparsity
    return _clean(flat_hessian_sparsity(fn, _numpy(sparse.inner, xs), _numpy(sparse.inner, data)))


def _hessian_plan(sparse: Sparse, fn: FlatFn, xs: list, data: list) -> _Plan:
    pattern = _hessian_pattern(sparse, fn, xs, data)
    return _hessian_coloring(sparse, pattern, sparse.sparsity is not None)


def sparse_hessian(sparse: Sparse, plan: _Plan, fn: FlatFn, xs: list, data: list) -> Any:
    """The CSR Hessian of scalar ``fn`` at ``xs`` from ``plan``'s compressed Hessian-vector products."""
    if plan.count == 0:
        return _sp().csr_matrix(plan.pattern.shape)
    plan = plan.rules_mode or plan  # a custom rule refused this plan's mode before
    try:
        fused = _fused(sparse, plan, fn, xs, data, 2)
        if fused is not None:
            return fused
        compressed = hessian_products(sparse, fn, xs, data, plan.forward_seeds, plan.hvp_mode,  # type: ignore[arg-type]
                                      plan.native)
    except CustomRuleError as err:  # forward over reverse refused by a reverse-only rule: reverse over reverse
        return sparse_hessian(sparse, _in_the_rules_mode(sparse, plan, err, 2), fn, xs, data)
    return plan.decompress(compressed, None, approximates(sparse.inner, 2), order=2)


# ------------------------------------------------------------------ one compiled call
def _fused(sparse: Sparse, plan: _Plan, fn: FlatFn, xs: list, data: list, order: int) -> Any:
    """The sparse result from one compiled call of the inner backend's library (its
    ``compiler`` hook: ``jax.jit``, ``tf.function``, ``mx.compile``): the compressed products,
    the check that they are zero outside the pattern, and the decompression (a gather of each
    nonzero from where it lies alone), so one small array comes back per call instead of every
    compressed product.  ``None`` where there is no compiler, the backend approximates, the
    decompression needs substitution (acyclic colorings, solved in numpy), the pattern is
    empty (no product to compute) or the inputs are not the inner backend's arrays; also where
    the compiled check finds a nonzero outside the pattern, so that the step-by-step route
    raises its error, which says where."""
    inner = sparse.inner
    compiler = getattr(inner, "compiler", None)
    if compiler is None or plan.index is None or not plan.index.size or approximates(inner, order) or not all(
            inner.is_native(a) for a in xs):
        return None
    key = ("compiled", order, _signature(xs), _signature([a for a in data if inner.is_native(a)]))
    run = plan.native.get(key)
    if run is None:
        run = plan.native[key] = compiler(_fused_body(sparse, plan, fn, order))
    # one transfer: the values, then the check (a copy: the result is the caller's to change)
    values = np.array(inner.to_numpy(run(list(xs), list(data))))
    if values[-1] != 0.0:
        return None
    return _sp().csr_matrix((values[:-1], plan.pattern.indices.copy(), plan.pattern.indptr.copy()),
                            shape=plan.pattern.shape)


def _fused_body(sparse: Sparse, plan: _Plan, fn: FlatFn, order: int) -> Callable[[list, list], Any]:
    """``(xs, data) -> values``: the nonzeros in CSR order, then the sum of ``|product|``
    outside the pattern (0 unless the pattern misses an entry)."""
    inner, a = sparse.inner, ar()

    def body(xs: list, data: list) -> tuple:
        # the seeds, masks and index are the trace's constants (not the plan's cached arrays:
        # made inside a trace, those would be the trace's values)
        if order == 1:
            parts = jacobian_products(inner, fn, xs, data, plan.forward_seeds, plan.reverse_seeds, None, True)
        else:
            parts = (hessian_products(sparse, fn, xs, data, plan.forward_seeds, plan.hvp_mode, None, True), None)
        masks = (plan.outside_forward, plan.outside_reverse)
        compressed = [(c, mask) for c, mask in zip(parts, masks) if c is not None]
        flat = [a.do("reshape", c, (-1,)) for c, _ in compressed]
        flat = flat[0] if len(flat) == 1 else a.do("concatenate", flat)
        outside = sum(a.do("sum", a.do("abs", c) * inner.asarray(mask.astype(np.float64), dtype_name(c)))
                      for c, mask in compressed)
        index = inner.asarray(plan.index, "int32" if plan.index.max() < 2**31 else "int64")
        return a.do("concatenate", [a.do("take", flat, index), a.do("reshape", outside, (1,))])

    return body


# ------------------------------------------------------------------ preparations
def _plan_key(sparse: Sparse, fn: Any, xs: list, data: list) -> tuple[tuple | None, list]:
    """``(key, held)``: what a plan depends on besides the flat function (which holds the
    static leaves), and the objects the plan must hold so that the ids in the key stay theirs.

    A given pattern depends on the input shapes only.  A detected (or dense-probed) one also
    on the data arguments by value (the one keying policy, :func:`abstractdiff._cache.value_key`)
    and on what ``f`` reads from globals and closures (:func:`abstractdiff._captures.captures`:
    a global index array).  ``None``: data without concrete content (keyed by identity only),
    so the plan is rebuilt rather than cached.  A dense probe is not keyed on ``x``: its
    pattern is the first point's (see the guide)."""
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


class _Inspected:
    """What a prepared sparse operator tells of its plan (that of its preparation point: a
    call with other data arguments may plan again, and is not what these describe)."""

    preparation: SparseJacobianPrep
    _plan: _Plan

    def _setup(self, backend: Any, preparation: Any, x: Any, args: tuple, xs: list, data: list,
               *rest: Any) -> None:
        super()._setup(backend, preparation, x, args, xs, data, *rest)  # type: ignore[misc]
        self._plan = preparation.plan(xs, data)

    @property
    def sparsity(self) -> Any:
        """The pattern: a boolean ``scipy.sparse`` CSR matrix (a Hessian's symmetrised), a copy."""
        return self._plan.pattern.copy()

    @property
    def ncolors(self) -> int:
        """Compressed products per call, forward and reverse together."""
        return self._plan.count

    @property
    def colors(self) -> SparseColors:
        """The color of each column and row (:class:`SparseColors`)."""
        return self._plan.colors

    @property
    def mode(self) -> str:
        """``"forward"``, ``"reverse"`` or ``"mixed"``: the products of a call."""
        return self._plan.mode

    @property
    def coloring(self) -> str:
        """The coloring: ``"column"``, ``"row"``, ``"bidirectional"``, ``"star"`` or ``"acyclic"``."""
        return self._plan.kind


class SparsePreparedJacobian(_Inspected, PreparedJacobian):
    """``j(x, *args) -> J`` (CSR), with ``.sparsity``, ``.ncolors`` and ``.colors``."""


class SparsePreparedHessian(_Inspected, PreparedHessian):
    """``h(x, *args) -> H`` (CSR), with ``.sparsity``, ``.ncolors`` and ``.colors``."""


_SPARSE_PREPARED = {JacobianPrep.operator: SparsePreparedJacobian, HessianPrep.operator: SparsePreparedHessian}

#: Plan caches of ``Sparse`` backends, per cache key: equal backends share their plans (a
#: new ``ad.Sparse("jax")`` per call would otherwise detect, color and compile again).
_PLAN_CACHES: LRU[tuple, PlanCache] = LRU(32, name="Sparse plan tables", keyed_on="the Sparse backend's options")


# ------------------------------------------------------------------ the backend
class Sparse(Backend):
    """``Sparse(b, sparsity=None, coloring="auto", mode="auto")``: ``jacobian`` and ``hessian``
    as ``scipy.sparse`` CSR matrices by compressed evaluation on ``b``; every other operator is ``b``'s.

    ``ad.jacobian(Sparse(b), f, x) -> J``, a ``csr_matrix`` of shape ``(y.size, x.size)``;
    ``ad.hessian(Sparse(b), f, x) -> H`` of shape ``(x.size, x.size)``.  A pytree ``x``
    counts its float leaves raveled and concatenated in flatten order (``y`` likewise).

    ``sparsity``: the pattern (a scipy sparse matrix or a boolean array of that shape);
    ``None`` detects it with :func:`~abstractdiff.jacobian_sparsity` /
    :func:`~abstractdiff.hessian_sparsity`; ``"dense-probe"`` takes the nonzeros of one dense
    derivative at the preparation point (valid near that point only: an entry that happens
    to be zero there is left out).

    ``coloring``: ``"auto"`` colors a Hessian symmetrically (star coloring, read back
    directly) and a Jacobian by the cheapest of columns (forward), rows (reverse) and both
    (bidirectional) that the inner backend's modes allow; ``"star"``; ``"acyclic"`` (a
    Hessian's fewest colors, read back by substitution); ``"column"`` (distance-1 coloring
    of columns or rows only, as before symmetric colorings).  ``"greedy"`` and
    ``"natural"`` are ``"auto"`` with the largest-first and the natural vertex order.

    ``mode``: ``"auto"``, or ``"forward"`` / ``"reverse"`` / ``"mixed"`` (bidirectional,
    Jacobians only) to force the products; a Hessian's mode picks forward-over-reverse or
    reverse-over-reverse Hessian-vector products.

    Pattern and coloring are built once per function, input shapes and values of the data
    arguments (prepared operators too: a call with other data detects again), and shared by
    equal ``Sparse`` backends; a computed nonzero outside the pattern raises
    :class:`~abstractdiff.SparsityPatternError`.  A prepared sparse operator has
    ``.sparsity`` (the pattern), ``.ncolors`` (products per call) and ``.colors``
    (:class:`SparseColors`: ``.columns`` and ``.rows``).

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> b = ad.Sparse("finite_differences")
        >>> J = ad.jacobian(b, lambda x: x[1:] * x[:-1], np.array([1.0, 2.0, 3.0]))
        >>> J.shape, J.nnz
        ((2, 3), 4)
        >>> np.round(J.toarray(), 6)
        array([[2., 1., 0.],
               [0., 3., 2.]])
        >>> jac = ad.prepare_jacobian(b, lambda x: x[1:] * x[:-1], np.ones(3))
        >>> jac.ncolors, jac.sparsity.shape
        (2, (2, 3))
    """

    name = "sparse"

    def __init__(self, backend: str | Backend, sparsity: Any = None, coloring: str = "auto", mode: str = "auto"):
        self.inner = _resolve(backend)
        if not isinstance(coloring, str) or coloring not in COLORINGS:
            raise InvalidArgumentError(f"coloring must be one of {', '.join(map(repr, COLORINGS))}, got {coloring!r}")
        if not isinstance(mode, str) or mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
        _check_mode(self.inner, mode, coloring)
        self.probe = isinstance(sparsity, str) and sparsity == DENSE_PROBE
        self.sparsity = None if sparsity is None or self.probe else as_pattern(sparsity)
        self.coloring, self.mode = coloring, mode
        self.kind, self.order = COLORINGS[coloring]
        self.name = f"sparse({self.inner.name})"  # type: ignore[misc]
        self.approximate = self.inner.approximate  # type: ignore[misc]
        digest = DENSE_PROBE if self.probe else None if self.sparsity is None else _digest(self.sparsity)
        # the coloring by meaning: "greedy" is "auto" with the largest-first order, equal to it
        self.options = {"backend": self.inner, "sparsity": digest, "coloring": self.kind, "order": self.order,
                        "mode": mode}
        numpy_native = self.inner._plans.numpy_native
        self._plans = _PLAN_CACHES.get_or_build((self.cache_key, numpy_native),
                                                lambda: PlanCache(numpy_native=numpy_native))

    def __repr__(self) -> str:
        given = DENSE_PROBE if self.probe else "detected" if self.sparsity is None else f"given {self.sparsity.shape}"
        return f"Sparse({self.inner!r}, sparsity={given}, coloring={self.coloring!r}, mode={self.mode!r})"

    @property
    def cache_key(self) -> tuple:
        return (Sparse, self.inner.cache_key, self.options["sparsity"], self.kind, self.order, self.mode)

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

    def prepare(self, operator: str, f: Callable[..., Any], x: Any, args: tuple = (), *, has_aux: bool = False,
                tangent: Any = None) -> Any:
        """Backend.prepare, with the inspectable prepared Jacobian and Hessian."""
        prepared = _SPARSE_PREPARED.get(operator)
        if prepared is None:
            return super().prepare(operator, f, x, args, has_aux=has_aux, tangent=tangent)
        return prepared(self, f, x, args, has_aux)


def _check_mode(inner: Backend, mode: str, coloring: str) -> None:
    needs = {"forward": ("forward",), "reverse": ("reverse",), "mixed": ("forward", "reverse")}.get(mode, ())
    missing = [m for m in needs if not getattr(inner, f"has_{m}")]
    if missing:
        raise ModeMismatchError(
            f"mode={mode!r} needs the {' and '.join(missing)} mode of the inner backend, which {inner!r} lacks; "
            f"leave mode='auto' to use the modes it has"
        )
    if mode == "mixed" and COLORINGS[coloring][0] != "auto":
        raise InvalidArgumentError(
            f"mode='mixed' is the bidirectional coloring of a Jacobian, which coloring={coloring!r} excludes; "
            f"use coloring='auto'"
        )


_HOOKS_OF_INNER = (*HOOKS["arrays"], *HOOKS["devices"], *HOOKS["pytrees"], "one_hot", "complete",
                   "complete_batched", "basis_chunks")
for _name in (*[n for n in dir(Backend) if n.startswith("flat_")], *_HOOKS_OF_INNER):
    if _name not in Sparse.__dict__:
        setattr(Sparse, _name, forwarded(_name))


def _resolve(b: Any) -> Backend:
    from .core import backend

    if not isinstance(b, (str, Backend)):
        raise ArgumentTypeError(f"backend must be a backend name (such as 'jax') or a Backend, got {type(b).__name__}")
    b = backend(b)
    if b.implicit:
        raise ArgumentTypeError(f"ad.Sparse needs an explicit backend, not {b!r}: it differentiates arrays")
    if isinstance(b, Sparse):
        raise ArgumentTypeError(f"ad.Sparse of another ad.Sparse ({b!r}): pass the inner backend itself")
    return b

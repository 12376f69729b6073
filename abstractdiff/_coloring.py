"""Graph colorings for compressed sparse Jacobians and Hessians, and their decompressions.

A coloring groups columns (or rows) so that one product per color, ``B = J @ S``, carries
every nonzero of ``J``; decompression reads each nonzero back out of ``B``.  Patterns are
boolean ``scipy.sparse`` matrices (anything :func:`scipy.sparse.csr_matrix` accepts is
converted); results are CSR matrices with the sparsity of the pattern.

* Jacobians, one direction: :func:`column_coloring` / :func:`row_coloring`, a greedy
  distance-1 coloring of the column (row) intersection graph (Curtis, Powell and Reid 1974;
  Gebremedhin, Manne and Pothen, "What color is your Jacobian? Graph coloring for
  computing derivatives", SIAM Review 47(4), 2005, section 3).
* Jacobians, both directions: :func:`bidirectional_coloring`, some columns seeded forward
  and some rows in reverse (Coleman and Verma, "The efficient computation of sparse
  Jacobian matrices using automatic differentiation", SIAM J. Sci. Comput. 19(4), 1998).
* Hessians: :func:`star_coloring` (direct recovery) and :func:`acyclic_coloring` (fewer
  colors, recovery by substitution), Gebremedhin, Tarafdar, Manne and Pothen, "New acyclic
  and star coloring algorithms with application to computing Hessians", SIAM J. Sci.
  Comput. 29(3), 2007 (Algorithms 4.1 and 3.1).

Decompression is on the hot path of every sparse derivative, so each kind has a *plan*
(:func:`column_plan`, :func:`row_plan`, :func:`star_plan`, :func:`acyclic_plan`,
:func:`bidirectional_plan`) computed once per pattern and coloring: ``plan.values(B...)``
is one fancy index into the flattened compressed products (plus one sparse triangular
solve for the acyclic kind) returning the nonzeros in the CSR order of the pattern;
``plan.matrix(B...)`` wraps them as a CSR matrix.  The ``decompress_*`` functions are
plan-then-call.

Hessian colorings act on the symmetrised pattern without its diagonal.  The greedy
colorings are pure Python loops over adjacency lists (linear in the edges for distance-1;
star and acyclic ones scan a neighbor's distinct neighbor colors, from per-vertex tables,
rather than all its neighbors, so a dense row costs little).  Measured for 10^5 vertices:
a 2-D 5-point Laplacian takes 0.15 s (column), 1 s (star, acyclic); an arrowhead 0.6 s
(star, acyclic), 0.1 s (bidirectional); a random pattern with ~7 nonzeros a row 2-3 s.
scipy is imported only when a function needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .core import InvalidArgumentError, ShapeMismatchError

__all__ = [
    "ORDERS",
    "AcyclicColoring",
    "BiColoring",
    "DecompressionPlan",
    "StarColoring",
    "acyclic_coloring",
    "acyclic_plan",
    "bidirectional_coloring",
    "bidirectional_plan",
    "column_coloring",
    "column_plan",
    "decompress_acyclic",
    "decompress_bidirectional",
    "decompress_columns",
    "decompress_rows",
    "decompress_star",
    "row_coloring",
    "row_plan",
    "seed_matrix",
    "star_coloring",
    "star_plan",
]

#: Vertex orders of the greedy algorithms: decreasing degree (stable), index order, or
#: Matula and Beck's smallest-last (degeneracy) order.
ORDERS = ("largest_first", "natural", "smallest_last")

#: Above this many (estimated) intersection-graph entries column colorings do without
#: the graph (:func:`_greedy_bipartite`).
_GRAPH_BUDGET = 20_000_000
#: The star bicoloring (a Python star coloring of the m + n vertex bipartite graph) is the
#: slowest candidate and seldom the best: it is tried below this sum of squared degrees.
_STAR_BICOLORING_BUDGET = 2_000_000


def _sp() -> Any:
    import scipy.sparse

    return scipy.sparse


# ------------------------------------------------------------------ patterns and graphs


def _pattern(pattern: Any, caller: str, square: bool = False) -> Any:
    """``pattern`` as a boolean CSR matrix with sorted indices and no explicit zeros."""
    sparse = _sp()
    try:
        p = sparse.csr_matrix(pattern, dtype=bool, copy=True)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{caller}: the pattern must be a 2-D (sparse) matrix: {error}") from None
    p.eliminate_zeros()
    p.sort_indices()
    if square and p.shape[0] != p.shape[1]:
        raise ShapeMismatchError(
            f"{caller} needs a square, symmetric Hessian pattern; got shape {p.shape} "
            "(a Jacobian pattern wants column_coloring, row_coloring or bidirectional_coloring)")
    return p


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise InvalidArgumentError(f"unknown vertex order {order!r}; expected one of {ORDERS}")


def _adjacency(p: Any) -> Any:
    """The symmetric off-diagonal adjacency (boolean CSR, sorted) of a square pattern."""
    a = (p + p.T).tocsr()
    a.setdiag(False)
    a.eliminate_zeros()
    a.sort_indices()
    return a


def _intersection_graph(p: Any) -> Any:
    """Columns of ``p`` joined when they share a row: the off-diagonal pattern of ``p.T @ p``."""
    q = p.astype(np.int32)
    g = (q.T @ q).tocsr()
    g.setdiag(0)
    g.eliminate_zeros()
    g.sort_indices()
    return g


def _edge_ids(g: Any) -> np.ndarray:
    """An id per undirected edge for each stored entry of a symmetric CSR ``g`` (both
    directions of an edge get the same id, ``0..nnz/2-1``)."""
    n = g.shape[0]
    rows = np.repeat(np.arange(n), np.diff(g.indptr))
    cols = g.indices
    twin = np.lexsort((rows, cols))  # entry k's transpose sits at CSR position twin[k]
    low = np.minimum(np.arange(cols.size), twin)
    _, ids = np.unique(low, return_inverse=True)
    return ids.astype(np.int64)


def _vertex_order(g: Any, order: str) -> list[int]:
    n = g.shape[0]
    if order == "natural":
        return list(range(n))
    degree = np.diff(g.indptr)
    if order == "largest_first":
        return np.argsort(-degree, kind="stable").tolist()
    return _smallest_last(g.indptr.tolist(), g.indices.tolist(), degree.tolist())


def _smallest_last(indptr: list[int], indices: list[int], degree: list[int]) -> list[int]:
    """Matula and Beck's smallest-last order: repeatedly remove a vertex of least remaining
    degree; color in the reverse of removal (bucket queue, linear time)."""
    n = len(degree)
    if n == 0:
        return []
    buckets: list[dict[int, None]] = [{} for _ in range(max(degree) + 1)]
    for v, d in enumerate(degree):
        buckets[d][v] = None
    removed = [False] * n
    removal = []
    low = 0
    for _ in range(n):
        while not buckets[low]:
            low += 1
        v = next(iter(buckets[low]))
        del buckets[low][v]
        removed[v] = True
        removal.append(v)
        for w in indices[indptr[v]:indptr[v + 1]]:
            if not removed[w]:
                d = degree[w]
                del buckets[d][w]
                degree[w] = d - 1
                buckets[d - 1][w] = None
        low = max(low - 1, 0)
    removal.reverse()
    return removal


# ------------------------------------------------------------------ distance-1 colorings


def _greedy(g: Any, order: str) -> np.ndarray:
    """Greedy distance-1 coloring of the graph ``g`` (symmetric CSR, no diagonal): each vertex
    in ``order`` takes the smallest color none of its colored neighbors has."""
    n = g.shape[0]
    indptr, indices = g.indptr.tolist(), g.indices.tolist()
    color = [-1] * n
    forbidden = [-1] * (n + 1)
    for v in _vertex_order(g, order):
        for w in indices[indptr[v]:indptr[v + 1]]:
            forbidden[color[w]] = v  # color -1 writes the sentinel slot forbidden[n]
        c = 0
        while forbidden[c] == v:
            c += 1
        color[v] = c
    return np.array(color, dtype=np.int64)


def _greedy_bipartite(p: Any, order: str) -> np.ndarray:
    """The same greedy coloring of the columns without building the intersection graph:
    each row keeps the colors of its columns as the bits of a Python integer, and a column
    takes the lowest bit free in all of its rows.  For patterns with dense rows, whose
    intersection graph would not fit in memory (a dense row is a clique of all columns).
    The degrees ordering the columns are the upper bounds sum over a column's rows of
    (row count - 1); ``smallest_last`` needs the graph and uses that largest-first order."""
    m, n = p.shape
    if order == "natural":
        sequence = list(range(n))
    else:
        bound = p.T @ (np.diff(p.indptr).astype(np.int64) - 1)
        sequence = np.argsort(-np.asarray(bound).ravel(), kind="stable").tolist()
    csc = p.tocsc()
    csc.sort_indices()
    indptr, indices = csc.indptr.tolist(), csc.indices.tolist()
    used = [0] * m
    color = [0] * n
    for j in sequence:
        rows = indices[indptr[j]:indptr[j + 1]]
        forbidden = 0
        for i in rows:
            forbidden |= used[i]
        c = (~forbidden & (forbidden + 1)).bit_length() - 1
        bit = 1 << c
        for i in rows:
            used[i] |= bit
        color[j] = c
    return np.array(color, dtype=np.int64)


def _column_greedy(p: Any, order: str) -> np.ndarray:
    nnz_row = np.diff(p.indptr).astype(np.int64)
    if int((nnz_row ** 2).sum()) > _GRAPH_BUDGET:
        return _greedy_bipartite(p, order)
    return _greedy(_intersection_graph(p), order)


def column_coloring(pattern: Any, order: str = "largest_first") -> np.ndarray:
    """``(n,)`` int64 colors ``0..c-1`` of the columns of an ``(m, n)`` pattern, no two
    columns of one color sharing a row: a greedy distance-1 coloring of the column
    intersection graph (Gebremedhin, Manne and Pothen 2005, section 3.1).  ``J @ S`` with
    ``S[j, colors[j]] = 1`` then holds every nonzero: see :func:`decompress_columns`.
    Where the intersection graph would exceed about 2e7 entries (dense rows) the graph is
    not built and the degrees ordering the columns are upper bounds."""
    _check_order(order)
    return _column_greedy(_pattern(pattern, "column_coloring"), order)


def row_coloring(pattern: Any, order: str = "largest_first") -> np.ndarray:
    """``(m,)`` int64 colors of the rows, no two rows of one color sharing a column (the
    column coloring of the transpose); ``S.T @ J`` holds every nonzero."""
    _check_order(order)
    return _column_greedy(_pattern(pattern, "row_coloring").T.tocsr(), order)


def seed_matrix(colors: Any, ncolors: int | None = None) -> np.ndarray:
    """The dense ``(len(colors), ncolors)`` seed ``S[j, colors[j]] = 1`` (rows of -1, the
    unseeded vertices of a bicoloring, stay zero): ``J @ S`` is the compressed Jacobian."""
    colors = np.asarray(colors, dtype=np.int64).ravel()
    count = _count(colors) if ncolors is None else int(ncolors)
    seeds = np.zeros((colors.size, count))
    seeded = np.flatnonzero(colors >= 0)
    seeds[seeded, colors[seeded]] = 1.0
    return seeds


def _frozen(array: np.ndarray) -> np.ndarray:
    """``array`` made read-only: colorings are values that plans are built from."""
    array.setflags(write=False)
    return array


def _count(colors: np.ndarray) -> int:
    return int(colors.max()) + 1 if colors.size and colors.max() >= 0 else 0


# ------------------------------------------------------------------ star coloring


@dataclass(frozen=True, eq=False)
class StarColoring:
    """A symmetric coloring in which every path on four vertices uses at least three colors
    (so each color pair induces disjoint stars) and adjacent vertices differ: the nonzeros
    of ``H`` are read directly from ``H @ S`` (:func:`decompress_star`).  The coloring
    classes compare and hash by identity (their fields are arrays); ``colors`` is read-only."""

    colors: np.ndarray
    ncolors: int


def _star_greedy(g: Any, order: list[int]) -> list[int]:
    """Algorithm 4.1 of Gebremedhin, Tarafdar, Manne and Pothen (2007) on the symmetric,
    diagonal-free CSR graph ``g``, visiting vertices in ``order``.

    Stars are tracked per edge (``star``) with their hub (``hub``, -1 while a star is a
    single edge).  Two tables keep the scans over a neighbor's neighbors short where the
    paper scans them whole: ``nbr_of_color[w * N + c]`` is one neighbor of ``w`` colored
    ``c`` (with the edge id), and ``hub_nbrs[w]`` the hubs of the stars ``w`` is a leaf of.
    """
    n = g.shape[0]
    indptr, indices = g.indptr.tolist(), g.indices.tolist()
    edge = _edge_ids(g).tolist()
    big = n + 1
    color = [-1] * n
    forbidden = [-1] * (n + 1)
    treated = [-1] * n
    first_nbr: list[tuple[int, int, int]] = [(-1, -1, -1)] * (n + 1)  # per color: (v, w, edge vw)
    star = [-1] * (len(indices) // 2)
    hub: list[int] = []
    hub_nbrs: list[list[int]] = [[] for _ in range(n)]
    nbr_of_color: dict[int, tuple[int, int]] = {}

    def treat(v: int, w: int) -> None:  # forbid the colors of w's neighbors
        for x in indices[indptr[w]:indptr[w + 1]]:
            forbidden[color[x]] = v
        treated[w] = v

    for v in order:
        lo, hi = indptr[v], indptr[v + 1]
        nbrs, edges = indices[lo:hi], edge[lo:hi]
        for w in nbrs:
            forbidden[color[w]] = v
        for w, e in zip(nbrs, edges):
            cw = color[w]
            if cw < 0:
                continue
            p, q, _ = first_nbr[cw]
            if p == v:  # case 1: v would be the hub of a star through w and q
                if treated[q] != v:
                    treat(v, q)
                treat(v, w)
            else:
                first_nbr[cw] = (v, w, e)
                for x in hub_nbrs[w]:  # case 2: x hubs a star w leaves: v must not take x's color
                    forbidden[color[x]] = v
        c = 0
        while forbidden[c] == v:
            c += 1
        color[v] = c
        # update the stars (the paper's updateStars)
        for w, e in zip(nbrs, edges):
            cw = color[w]
            if cw < 0:
                continue
            found = nbr_of_color.get(w * big + c)
            if found is not None:  # v-w-x with color(x) == color(v): w is the hub
                x, e_wx = found
                s = star[e_wx]
                if hub[s] < 0:
                    hub[s] = w
                    hub_nbrs[x].append(w)
                star[e] = s
                hub_nbrs[v].append(w)
                continue
            p, q, e_pq = first_nbr[cw]
            if p == v and q != w:  # w-v-q with color(w) == color(q): v is the hub
                s = star[e_pq]
                if hub[s] < 0:
                    hub[s] = v
                    hub_nbrs[q].append(v)
                star[e] = s
                hub_nbrs[w].append(v)
            else:  # a new star of one edge
                hub.append(-1)
                star[e] = len(hub) - 1
        for w, e in zip(nbrs, edges):
            nbr_of_color.setdefault(w * big + c, (v, e))
    return color


def star_coloring(pattern: Any, order: str = "largest_first") -> StarColoring:
    """A star coloring of the adjacency graph of a square, symmetric Hessian pattern (the
    diagonal is ignored): greedy Algorithm 4.1 of Gebremedhin, Tarafdar, Manne and Pothen,
    "New acyclic and star coloring algorithms with application to computing Hessians",
    SIAM J. Sci. Comput. 29(3), 2007.  Arrowhead patterns take 2 colors, tridiagonal 3."""
    _check_order(order)
    g = _adjacency(_pattern(pattern, "star_coloring", square=True))
    colors = _frozen(np.array(_star_greedy(g, _vertex_order(g, order)), dtype=np.int64))
    return StarColoring(colors, _count(colors))


# ------------------------------------------------------------------ acyclic coloring


@dataclass(frozen=True, eq=False)
class AcyclicColoring:
    """A symmetric coloring in which every cycle uses at least three colors (each color pair
    induces a forest): the nonzeros of ``H`` follow from ``H @ S`` by substitution along
    those trees (:func:`decompress_acyclic`).  Never needs more colors than a star one."""

    colors: np.ndarray
    ncolors: int


def _find(parent: list[int], e: int) -> int:
    root = e
    while parent[root] != root:
        root = parent[root]
    while parent[e] != root:
        parent[e], e = root, parent[e]
    return root


def _acyclic_greedy(g: Any, order: list[int]) -> list[int]:
    """Algorithm 3.1 of Gebremedhin, Tarafdar, Manne and Pothen (2007): the two-colored
    trees are sets of edges in a disjoint-set forest (``parent``), ``first_visit`` per
    tree records from which vertex and neighbor it was last reached.  The paper's scan of
    every colored neighbor ``x`` of ``w`` visits one ``x`` per color here (all edges ``wx``
    of one color pair lie in one tree), from the per-vertex tables ``nbr_colors`` and
    ``nbr_of_color``."""
    n = g.shape[0]
    indptr, indices = g.indptr.tolist(), g.indices.tolist()
    edge = _edge_ids(g).tolist()
    big = n + 1
    color = [-1] * n
    forbidden = [-1] * (n + 1)
    first_nbr: list[tuple[int, int, int]] = [(-1, -1, -1)] * (n + 1)
    nedges = len(indices) // 2
    parent = list(range(nedges))
    size = [1] * nedges
    first_visit: list[tuple[int, int]] = [(-1, -1)] * nedges
    nbr_colors: list[list[int]] = [[] for _ in range(n)]
    nbr_of_color: dict[int, tuple[int, int]] = {}

    def union(a: int, b: int) -> None:
        ra, rb = _find(parent, a), _find(parent, b)
        if ra != rb:
            if size[ra] < size[rb]:
                ra, rb = rb, ra
            parent[rb] = ra
            size[ra] += size[rb]

    for v in order:
        lo, hi = indptr[v], indptr[v + 1]
        nbrs, edges = indices[lo:hi], edge[lo:hi]
        for w in nbrs:
            forbidden[color[w]] = v
        for w in nbrs:
            if color[w] < 0:
                continue
            for cx in nbr_colors[w]:
                if forbidden[cx] == v:
                    continue
                _, e_wx = nbr_of_color[w * big + cx]
                root = _find(parent, e_wx)  # preventCycle(v, w, x)
                p, q = first_visit[root]
                if p != v:
                    first_visit[root] = (v, w)
                elif q != w:  # v reaches this tree twice: its other color would close a cycle
                    forbidden[cx] = v
        c = 0
        while forbidden[c] == v:
            c += 1
        color[v] = c
        for w, e in zip(nbrs, edges):  # growStar(v, w)
            cw = color[w]
            if cw < 0:
                continue
            p, q, e_pq = first_nbr[cw]
            if p != v:
                first_nbr[cw] = (v, w, e)
            else:
                union(e, e_pq)
        for w, e in zip(nbrs, edges):  # mergeTrees(v, w, x) for x ~ w colored like v
            if color[w] < 0:
                continue
            found = nbr_of_color.get(w * big + c)
            if found is not None:
                union(e, found[1])
        for w, e in zip(nbrs, edges):
            key = w * big + c
            if key not in nbr_of_color:
                nbr_of_color[key] = (v, e)
                nbr_colors[w].append(c)
    return color


def acyclic_coloring(pattern: Any, order: str = "largest_first") -> AcyclicColoring:
    """An acyclic coloring of the adjacency graph of a square, symmetric Hessian pattern:
    greedy Algorithm 3.1 (with the disjoint-set forest of two-colored trees) of
    Gebremedhin, Tarafdar, Manne and Pothen, SIAM J. Sci. Comput. 29(3), 2007."""
    _check_order(order)
    g = _adjacency(_pattern(pattern, "acyclic_coloring", square=True))
    colors = _frozen(np.array(_acyclic_greedy(g, _vertex_order(g, order)), dtype=np.int64))
    return AcyclicColoring(colors, _count(colors))


# ------------------------------------------------------------------ bidirectional coloring


@dataclass(frozen=True, eq=False)
class BiColoring:
    """Columns seeded forward (``J @ Sc``, ``column_colors[j]`` in ``0..n_forward-1``) and
    rows seeded in reverse (``Sr.T @ J``, ``row_colors[i]`` in ``0..n_reverse-1``); -1
    marks a column or row not seeded.  ``method`` says which heuristic produced it."""

    column_colors: np.ndarray
    row_colors: np.ndarray
    n_forward: int
    n_reverse: int
    method: str = field(default="", compare=False)

    @property
    def ncolors(self) -> int:
        return self.n_forward + self.n_reverse


def _renumber(colors: np.ndarray) -> tuple[np.ndarray, int]:
    """Colors of the seeded entries renumbered ``0..k-1`` (-1 kept)."""
    out = np.full(colors.shape, -1, dtype=np.int64)
    seeded = colors >= 0
    used, out[seeded] = np.unique(colors[seeded], return_inverse=True)
    return out, int(used.size)


def _split_lower_bound(p: Any, reverse_rows: np.ndarray) -> int:
    """Products a split needs at least: the densest forward row and the densest column of
    ``J[R]`` are cliques of their intersection graphs."""
    nnz_row = np.diff(p.indptr)
    forward = int(nnz_row[~reverse_rows].max(initial=0))
    reverse = int(np.asarray(p[reverse_rows].sum(axis=0)).max(initial=0)) if reverse_rows.any() else 0
    return forward + reverse


def _split_rows_reverse(p: Any, reverse_rows: np.ndarray, order: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``reverse_rows`` (a mask) recovered in reverse, all other nonzeros forward: a
    row coloring of ``J[R]`` and a column coloring of ``J[~R]`` (columns with no nonzero
    outside ``R`` stay unseeded)."""
    m, n = p.shape
    fwd = p[~reverse_rows]
    column_colors = _column_greedy(fwd, order)
    column_colors[np.diff(fwd.tocsc().indptr) == 0] = -1
    row_colors = np.full(m, -1, dtype=np.int64)
    if reverse_rows.any():
        row_colors[reverse_rows] = _column_greedy(p[reverse_rows].T.tocsr(), order)
    return column_colors, row_colors


def _star_bicoloring(p: Any, order: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Coleman and Verma's star bicoloring: a star coloring of the bipartite graph of ``J``
    (the augmented ``[[0, J], [J.T, 0]]``), then each nonzero read on the side where it is
    alone of its color, and only the vertices some nonzero is read through seeded (the
    others get the neutral color -1), as in SparseMatrixColorings.jl."""
    m, n = p.shape
    sparse = _sp()
    aug = sparse.bmat([[None, p], [p.T, None]], format="csr", dtype=bool)
    aug.sort_indices()
    degree = np.diff(aug.indptr).astype(np.int64)
    if int((degree ** 2).sum()) > _STAR_BICOLORING_BUDGET:
        return None
    colors = np.array(_star_greedy(aug, _vertex_order(aug, order)), dtype=np.int64)
    rows = np.repeat(np.arange(m), np.diff(p.indptr))
    cols = p.indices + m
    big = int(colors.max()) + 1 if colors.size else 1
    fwd_ok = _unique_keys(rows * big + colors[cols])
    rev_ok = _unique_keys(cols * big + colors[rows])
    seeded = np.zeros(m + n, dtype=bool)
    seeded[cols[fwd_ok & ~rev_ok]] = True
    seeded[rows[rev_ok & ~fwd_ok]] = True
    active = np.zeros((2, big), dtype=bool)  # colors already seeded: 0 rows, 1 columns
    active[0, colors[:m][seeded[:m]]] = True
    active[1, colors[m:][seeded[m:]]] = True
    for i, j in zip(rows[fwd_ok & rev_ok].tolist(), cols[fwd_ok & rev_ok].tolist()):
        if seeded[i] or seeded[j]:
            continue
        if active[1, colors[j]] or not active[0, colors[i]]:
            seeded[j] = active[1, colors[j]] = True
        else:
            seeded[i] = True
    return np.where(seeded[m:], colors[m:], -1), np.where(seeded[:m], colors[:m], -1)


def _unique_keys(keys: np.ndarray) -> np.ndarray:
    """For each key, whether it occurs exactly once."""
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    return counts[inverse] == 1


def bidirectional_coloring(pattern: Any, order: str = "largest_first") -> BiColoring:
    """A bicoloring of an ``(m, n)`` Jacobian pattern with direct recovery: the cheapest
    (fewest products) of Coleman and Verma's star bicoloring of the bipartite graph
    (SIAM J. Sci. Comput. 19(4), 1998) and of the partitions that recover the densest rows
    (above both four times the median count and the median plus ten; up to four
    thresholds) in reverse and the rest forward, or the densest columns forward and the
    rest in reverse.  The one-sided column and row colorings are among the candidates, so
    it never needs more products than either.  ``method`` names the winner.

    An arrowhead (dense first row and column plus the diagonal) takes 3 products; a
    bordered band of half-bandwidth ``k`` with ``b`` dense rows and columns about
    ``2k + 1 + 2b``.  Partitions are tried in the order of a lower bound on their products
    (the densest row of the forward part plus the densest column of the reverse part) and
    skipped once the bound reaches the best count found, so a dense row's clique is never
    colored for nothing; the star bicoloring is only tried on graphs whose squared degrees
    sum to under 2e6 (it is the slowest candidate, and on random patterns the partitions
    beat it)."""
    _check_order(order)
    p = _pattern(pattern, "bidirectional_coloring")
    m, n = p.shape
    splits = []  # (lower bound, name, pattern, reverse-row mask, transposed)
    for name, q, transposed in (("rows", p, False), ("columns", p.T.tocsr(), True)):
        nnz = np.diff(q.indptr)
        typical = float(np.median(nnz)) if nnz.size else 0.0
        dense = np.unique(nnz[nnz > max(4 * typical, typical + 10)])
        for t in dense[::-1][:4].tolist() + [int(nnz.max(initial=0)) + 1]:
            mask = nnz >= t
            splits.append((_split_lower_bound(q, mask), f"dense {name} split at {t}", q, mask, transposed))
    splits.sort(key=lambda s: s[0])
    best: BiColoring | None = None

    def consider(method: str, found: tuple[np.ndarray, np.ndarray]) -> None:
        nonlocal best
        column_colors, n_forward = _renumber(found[0])
        row_colors, n_reverse = _renumber(found[1])
        if best is None or n_forward + n_reverse < best.ncolors:
            best = BiColoring(_frozen(column_colors), _frozen(row_colors), n_forward, n_reverse, method)

    for bound, method, q, mask, transposed in splits:
        if best is not None and bound >= best.ncolors:
            break  # sorted: no later split can do better
        found = _split_rows_reverse(q, mask, order)
        consider(method, (found[1], found[0]) if transposed else found)
    star = _star_bicoloring(p, order)
    if star is not None:
        consider("star bicoloring", star)
    assert best is not None
    return best


# ------------------------------------------------------------------ decompression plans


@dataclass(frozen=True, eq=False)
class DecompressionPlan:
    """What decompression needs, computed once per pattern and coloring.

    ``rows``, ``cols`` (and ``indptr``, ``indices``): the nonzeros of the result in the CSR
    order of the pattern.  ``values(*compressed)`` returns their values (one gather from
    the flattened compressed products, concatenated in argument order, ``shapes`` giving
    each one's expected shape); ``matrix(*compressed)`` the CSR matrix.
    """

    shape: tuple[int, int]
    indptr: np.ndarray
    indices: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    index: np.ndarray
    shapes: tuple[tuple[int, int], ...]
    kind: str

    def _flat(self, compressed: tuple[Any, ...]) -> np.ndarray:
        if len(compressed) != len(self.shapes):
            raise InvalidArgumentError(
                f"the {self.kind} decompression takes {len(self.shapes)} compressed array(s), got {len(compressed)}")
        flats = []
        for b, shape in zip(compressed, self.shapes):
            b = np.asarray(b)
            if b.shape != shape:
                raise ShapeMismatchError(
                    f"the {self.kind} decompression expects a compressed array of shape {shape}, got {b.shape}")
            flats.append(b.ravel())
        flat = flats[0] if len(flats) == 1 else np.concatenate(flats)
        return flat if np.issubdtype(flat.dtype, np.inexact) else flat.astype(np.float64)

    def values(self, *compressed: Any) -> np.ndarray:
        """The nonzeros, in the CSR order of the pattern."""
        return self._flat(compressed)[self.index]

    def matrix(self, *compressed: Any) -> Any:
        """The decompressed matrix, CSR with the sparsity of the pattern."""
        return _sp().csr_matrix((self.values(*compressed), self.indices.copy(), self.indptr.copy()), shape=self.shape)


@dataclass(frozen=True, eq=False)
class AcyclicPlan(DecompressionPlan):
    """Recovery by substitution: ``index`` gathers the right-hand sides ``b`` (one per
    edge, ordered leaves first along each two-colored tree) followed by the diagonal;
    ``lu`` solves the unit lower-triangular ``(I + A) h = b``, ``A[e, e'] = 1`` where edge
    ``e'`` hangs below ``e``; ``place`` puts the edge values and the diagonal in CSR order."""

    nedges: int = 0
    lu: Any = None
    place: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def values(self, *compressed: Any) -> np.ndarray:
        gathered = self._flat(compressed)[self.index]
        if self.nedges:
            b = gathered[:self.nedges]
            if np.iscomplexobj(b):  # the factor is real: solve the two parts
                h = self.lu.solve(b.real.astype(np.float64)) + 1j * self.lu.solve(b.imag.astype(np.float64))
            else:
                h = self.lu.solve(b.astype(np.float64))
            gathered = np.concatenate([h.astype(gathered.dtype, copy=False), gathered[self.nedges:]])
        return gathered[self.place]


def _csr_coordinates(p: Any) -> tuple[np.ndarray, np.ndarray]:
    return np.repeat(np.arange(p.shape[0]), np.diff(p.indptr)), p.indices.astype(np.int64)


def _plan(p: Any, index: np.ndarray, shapes: tuple[tuple[int, int], ...], kind: str) -> DecompressionPlan:
    rows, cols = _csr_coordinates(p)
    return DecompressionPlan(p.shape, p.indptr, p.indices, rows, cols, index.astype(np.int64), shapes, kind)


def _colors_array(colors: Any, length: int, what: str) -> np.ndarray:
    colors = np.asarray(colors, dtype=np.int64).ravel()
    if colors.size != length:
        raise ShapeMismatchError(f"{what}: {colors.size} colors for {length} vertices")
    return colors


def _require(ok: np.ndarray, kind: str, detail: str) -> None:
    if not ok.all():
        k = int(np.flatnonzero(~ok)[0])
        raise InvalidArgumentError(f"the coloring is not a valid {kind} coloring of this pattern ({detail}, entry {k})")


def column_plan(pattern: Any, colors: Any) -> DecompressionPlan:
    """Plan for ``compressed = J @ S`` of shape ``(m, c)``: ``J[i, j] = compressed[i, colors[j]]``."""
    p = _pattern(pattern, "column_plan")
    colors = _colors_array(colors, p.shape[1], "column_plan")
    c = _count(colors)
    rows, cols = _csr_coordinates(p)
    index = rows * c + colors[cols]
    _require(_unique_keys(index), "column", "two columns of one color share a row")
    return _plan(p, index, ((p.shape[0], c),), "column")


def row_plan(pattern: Any, colors: Any) -> DecompressionPlan:
    """Plan for ``compressed = S.T @ J`` of shape ``(c, n)``: ``J[i, j] = compressed[colors[i], j]``."""
    p = _pattern(pattern, "row_plan")
    colors = _colors_array(colors, p.shape[0], "row_plan")
    c = _count(colors)
    rows, cols = _csr_coordinates(p)
    index = colors[rows] * p.shape[1] + cols
    _require(_unique_keys(index), "row", "two rows of one color share a column")
    return _plan(p, index, ((c, p.shape[1]),), "row")


def _symmetric_counts(p: Any, colors: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """For each off-diagonal entry ``(i, j)`` of the pattern, whether ``j`` is the only
    neighbor of ``i`` colored ``colors[j]`` (``at_i``), and whether ``i`` is the only
    neighbor of ``j`` colored ``colors[i]`` (``at_j``), on the symmetrised graph."""
    g = _adjacency(p)
    grows, gcols = _csr_coordinates(g)
    gkeys = grows * c + colors[gcols]
    uniq, counts = np.unique(gkeys, return_counts=True)
    rows, cols = _csr_coordinates(p)

    def alone(keys: np.ndarray) -> np.ndarray:
        if not uniq.size:
            return np.zeros(keys.shape, dtype=bool)
        pos = np.minimum(np.searchsorted(uniq, keys), uniq.size - 1)
        return (uniq[pos] == keys) & (counts[pos] == 1)

    return alone(rows * c + colors[cols]), alone(cols * c + colors[rows])


def star_plan(pattern: Any, coloring: StarColoring) -> DecompressionPlan:
    """Plan for ``compressed = H @ S`` of shape ``(n, ncolors)``: an off-diagonal
    ``H[i, j] = B[i, colors[j]]`` where ``j`` is the only neighbor of ``i`` of its color,
    else ``B[j, colors[i]]`` (one of the two holds in a star coloring); ``H[i, i] =
    B[i, colors[i]]`` (Gebremedhin, Tarafdar, Manne and Pothen 2007, section 2)."""
    p = _pattern(pattern, "star_plan", square=True)
    colors = _colors_array(coloring.colors, p.shape[0], "star_plan")
    c = max(int(coloring.ncolors), _count(colors))
    rows, cols = _csr_coordinates(p)
    at_i, at_j = _symmetric_counts(p, colors, c)
    diagonal = rows == cols
    _require(diagonal | ((colors[rows] != colors[cols]) & (at_i | at_j)), "star", "no side reads this entry alone")
    index = np.where(diagonal | at_i, rows * c + colors[cols], cols * c + colors[rows])
    return _plan(p, index, ((p.shape[0], c),), "star")


def acyclic_plan(pattern: Any, coloring: AcyclicColoring) -> AcyclicPlan:
    """Plan for ``compressed = H @ S`` with an acyclic coloring: each color pair induces a
    forest, so peeling a leaf ``u`` off its tree gives ``H[u, w] = B[u, colors[w]]`` minus
    the edges already peeled at ``u`` (substitution; Gebremedhin, Tarafdar, Manne and
    Pothen 2007, section 5).  The peeling order (a breadth-first order of every tree,
    children first) and the triangular factor are computed here once."""
    from scipy.sparse.csgraph import breadth_first_order, connected_components
    from scipy.sparse.linalg import splu

    sparse = _sp()
    p = _pattern(pattern, "acyclic_plan", square=True)
    n = p.shape[0]
    colors = _colors_array(coloring.colors, n, "acyclic_plan")
    c = max(int(coloring.ncolors), _count(colors), 1)
    g = _adjacency(p)
    upper = sparse.triu(g, k=1).tocoo()
    u, w = upper.row.astype(np.int64), upper.col.astype(np.int64)
    _require(colors[u] != colors[w], "acyclic", "adjacent vertices share a color")
    pair = np.minimum(colors[u], colors[w]) * c + np.maximum(colors[u], colors[w])
    nodes, node_of = np.unique(np.concatenate([u * c * c + pair, w * c * c + pair]), return_inverse=True)
    nedges, nnodes = u.size, nodes.size
    a, b = node_of[:nedges], node_of[nedges:]
    forest = sparse.csr_matrix((np.ones(nedges), (a, b)), shape=(nnodes, nnodes))
    ncomp, label = connected_components(forest, directed=False)
    _require(np.bincount(label, minlength=ncomp) == np.bincount(label[a], minlength=ncomp) + 1,
             "acyclic", "a two-colored cycle")
    root = nnodes  # a super-root joined to one node per tree makes one breadth-first search
    reps = np.unique(label, return_index=True)[1]
    links = sparse.csr_matrix((np.ones(nedges + reps.size),
                               (np.concatenate([a, np.full(reps.size, root)]), np.concatenate([b, reps]))),
                              shape=(nnodes + 1, nnodes + 1))
    bfs, pred = breadth_first_order(links, root, directed=False, return_predecessors=True)
    child = np.where(pred[a] == b, a, b)
    position = np.empty(nnodes + 1, dtype=np.int64)
    position[bfs] = np.arange(bfs.size)
    peel = np.argsort(-position[child], kind="stable")  # edges, deepest child first
    rank = np.empty(nedges, dtype=np.int64)
    rank[peel] = np.arange(nedges)
    leaf_vertex = nodes[child] // (c * c)
    other_vertex = np.where(leaf_vertex == u, w, u)
    rhs = (leaf_vertex * c + colors[other_vertex])[peel]
    # edge e' hangs below e when its parent node is e's child node
    parent_node = np.where(child == a, b, a)
    by_child = np.full(nnodes, -1, dtype=np.int64)
    by_child[child] = np.arange(nedges)
    above = by_child[parent_node]  # the edge whose child node is my parent node (-1 at a root)
    has = above >= 0
    lu = None
    if nedges:
        tri = sparse.csc_matrix((np.ones(int(has.sum())), (rank[above[has]], rank[np.flatnonzero(has)])),
                                shape=(nedges, nedges)) + sparse.identity(nedges, format="csc")
        lu = splu(tri.tocsc(), permc_spec="NATURAL", diag_pivot_thresh=0.0)
    rows, cols = _csr_coordinates(p)
    diagonal = rows == cols
    diag_rows = rows[diagonal]
    index = np.concatenate([rhs, diag_rows * c + colors[diag_rows]])
    place = np.empty(rows.size, dtype=np.int64)
    place[diagonal] = nedges + np.arange(diag_rows.size)
    off = ~diagonal
    lo_v, hi_v = np.minimum(rows[off], cols[off]), np.maximum(rows[off], cols[off])
    edge_key = u * n + w
    sorter = np.argsort(edge_key)
    place[off] = rank[sorter[np.searchsorted(edge_key, lo_v * n + hi_v, sorter=sorter)]]
    return AcyclicPlan(p.shape, p.indptr, p.indices, rows, cols, index.astype(np.int64),
                       ((n, max(int(coloring.ncolors), _count(colors))),), "acyclic",
                       nedges=nedges, lu=lu, place=place)


def bidirectional_plan(pattern: Any, coloring: BiColoring) -> DecompressionPlan:
    """Plan for ``forward = J @ Sc`` ``(m, n_forward)`` and ``reverse = Sr.T @ J``
    ``(n_reverse, n)``: ``J[i, j] = forward[i, column_colors[j]]`` where column ``j`` is
    seeded and alone of its color among row ``i``'s seeded columns, else
    ``reverse[row_colors[i], j]`` (alone among column ``j``'s seeded rows).
    ``values(forward, reverse)``."""
    p = _pattern(pattern, "bidirectional_plan")
    m, n = p.shape
    cc = _colors_array(coloring.column_colors, n, "bidirectional_plan")
    rc = _colors_array(coloring.row_colors, m, "bidirectional_plan")
    nf, nr = int(coloring.n_forward), int(coloring.n_reverse)
    rows, cols = _csr_coordinates(p)
    fwd_key = rows * max(nf, 1) + cc[cols]
    rev_key = rc[rows] * n + cols
    fwd_seeded, rev_seeded = cc[cols] >= 0, rc[rows] >= 0
    fwd_ok = np.zeros(rows.size, dtype=bool)
    rev_ok = np.zeros(rows.size, dtype=bool)
    fwd_ok[fwd_seeded] = _unique_keys(fwd_key[fwd_seeded])
    rev_ok[rev_seeded] = _unique_keys(rev_key[rev_seeded])
    _require(fwd_ok | rev_ok, "bidirectional", "neither direction reads this entry alone")
    index = np.where(fwd_ok, fwd_key, m * nf + rev_key)
    return _plan(p, index, ((m, nf), (nr, n)), "bidirectional")


# ------------------------------------------------------------------ decompression


def decompress_columns(pattern: Any, colors: Any, compressed: Any) -> Any:
    """``J`` (CSR, the pattern's sparsity) from ``compressed = J @ S``, ``(m, c)``."""
    return column_plan(pattern, colors).matrix(compressed)


def decompress_rows(pattern: Any, colors: Any, compressed: Any) -> Any:
    """``J`` from ``compressed = S.T @ J``, ``(c, n)``."""
    return row_plan(pattern, colors).matrix(compressed)


def decompress_star(pattern: Any, coloring: StarColoring, compressed: Any) -> Any:
    """``H`` (CSR, symmetric, the pattern's sparsity) from ``compressed = H @ S``, ``(n, ncolors)``."""
    return star_plan(pattern, coloring).matrix(compressed)


def decompress_acyclic(pattern: Any, coloring: AcyclicColoring, compressed: Any) -> Any:
    """``H`` from ``compressed = H @ S`` by substitution (:func:`acyclic_plan`)."""
    return acyclic_plan(pattern, coloring).matrix(compressed)


def decompress_bidirectional(pattern: Any, coloring: BiColoring, forward: Any, reverse: Any) -> Any:
    """``J`` from ``forward = J @ Sc`` ``(m, n_forward)`` and ``reverse = Sr.T @ J`` ``(n_reverse, n)``."""
    return bidirectional_plan(pattern, coloring).matrix(forward, reverse)

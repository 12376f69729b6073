"""Colorings and decompressions of ``abstractdiff._coloring``, checked by their definitions.

Each coloring is checked against the property that makes it usable (distance-1, star: no
path on four vertices with two colors, acyclic: no cycle with two colors, bicoloring:
every nonzero alone of its color on a seeded side), against brute-force optimal colorings
on small patterns, and by decompressing exact products of random matrices with the pattern.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from abstractdiff import _coloring as col
from abstractdiff._errors import InvalidArgumentError, ShapeMismatchError

# ------------------------------------------------------------------ patterns


def csr(dense) -> sp.csr_matrix:
    p = sp.csr_matrix(np.asarray(dense, dtype=bool))
    p.sort_indices()
    return p


def symmetric(p) -> sp.csr_matrix:
    return csr((p + p.T).toarray())


def random_pattern(rng, m, n, density) -> sp.csr_matrix:
    return csr(rng.random((m, n)) < density)


def random_symmetric(rng, n, density, diagonal=True) -> sp.csr_matrix:
    d = rng.random((n, n)) < density
    d = d | d.T
    np.fill_diagonal(d, diagonal)
    return csr(d)


def arrowhead(n) -> sp.csr_matrix:
    p = sp.lil_matrix((n, n), dtype=bool)
    p[0, :] = True
    p[:, 0] = True
    p.setdiag(True)
    return p.tocsr()


def banded(n, k) -> sp.csr_matrix:
    offsets = list(range(-k, k + 1))
    p = sp.diags([np.ones(n - abs(o)) for o in offsets], offsets, shape=(n, n), format="csr").astype(bool)
    p.sort_indices()
    return p


def laplacian_2d(side) -> sp.csr_matrix:
    eye = sp.eye(side, dtype=bool)
    tri = banded(side, 1)
    return (sp.kron(eye, tri) + sp.kron(tri, eye)).astype(bool).tocsr()


def block_diagonal(blocks, b) -> sp.csr_matrix:
    return sp.block_diag([np.ones((b, b), dtype=bool)] * blocks, format="csr")


def bordered_banded(n, k, border) -> sp.csr_matrix:
    p = banded(n, k).tolil()
    p[:border, :] = True
    p[:, :border] = True
    return p.tocsr()


EDGE_CASES = {
    "1x1": csr([[1]]),
    "1x1 empty": csr([[0]]),
    "no nonzeros": csr(np.zeros((4, 4))),
    "dense": csr(np.ones((5, 5))),
    "empty rows and columns": csr([[0, 0, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0], [0, 1, 0, 1]]),
    "diagonal": csr(np.eye(6)),
    "no diagonal": csr([[0, 1, 1], [1, 0, 0], [1, 0, 0]]),
}


def rectangular_cases(rng):
    yield "wide", random_pattern(rng, 5, 12, 0.3)
    yield "tall", random_pattern(rng, 12, 5, 0.3)
    yield "empty row and column", csr([[1, 0, 1], [0, 0, 0], [1, 0, 0]])
    yield "2x0", sp.csr_matrix((2, 0), dtype=bool)
    yield "0x3", sp.csr_matrix((0, 3), dtype=bool)
    yield "dense 4x6", csr(np.ones((4, 6)))


# ------------------------------------------------------------------ checkers (definitions)


def graph(p):
    """Adjacency sets of the off-diagonal symmetric graph of a square pattern."""
    d = p.toarray() | p.toarray().T
    np.fill_diagonal(d, False)
    return [set(np.flatnonzero(row).tolist()) for row in d]


def is_distance1_columns(p, colors) -> bool:
    return all(len(set(colors[p.indices[p.indptr[i]:p.indptr[i + 1]]].tolist())) == p.indptr[i + 1] - p.indptr[i]
               for i in range(p.shape[0]))


def is_proper(adj, colors) -> bool:
    return all(colors[v] != colors[w] for v in range(len(adj)) for w in adj[v])


def is_star(p, colors) -> bool:
    """Proper, and no path a-b-c-d on four vertices with only two colors."""
    adj = graph(p)
    if not is_proper(adj, colors):
        return False
    for b in range(len(adj)):
        for c in adj[b]:
            for a in adj[b] - {c}:
                if colors[a] != colors[c]:
                    continue
                if any(colors[d] == colors[b] for d in adj[c] - {a, b}):
                    return False
    return True


def is_acyclic(p, colors) -> bool:
    """Proper, and every pair of colors induces a forest (no two-colored cycle)."""
    adj = graph(p)
    if not is_proper(adj, colors):
        return False
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for v in range(len(adj)):
        for w in adj[v]:
            if v < w:
                pair = (min(colors[v], colors[w]), max(colors[v], colors[w]))
                rv, rw = find((v, pair)), find((w, pair))
                if rv == rw:
                    return False
                parent[rv] = rw
    return True


def is_bicoloring(p, bc) -> bool:
    """Every nonzero (i, j) is alone of its color on a seeded side: column j seeded and no
    other seeded column of its color in row i, or row i seeded and alone in column j."""
    d = p.toarray()
    cc, rc = bc.column_colors, bc.row_colors
    assert set(cc[cc >= 0].tolist()) == set(range(bc.n_forward))
    assert set(rc[rc >= 0].tolist()) == set(range(bc.n_reverse))
    for i, j in zip(*np.nonzero(d)):
        forward = cc[j] >= 0 and sum(1 for k in np.flatnonzero(d[i]) if cc[k] == cc[j]) == 1
        reverse = rc[i] >= 0 and sum(1 for k in np.flatnonzero(d[:, j]) if rc[k] == rc[i]) == 1
        if not (forward or reverse):
            return False
    return True


def ncolors(colors) -> int:
    return int(colors.max()) + 1 if colors.size else 0


# ------------------------------------------------------------------ products


def seeds(colors, count):
    s = np.zeros((colors.size, count))
    seeded = colors >= 0
    s[np.flatnonzero(seeded), colors[seeded]] = 1.0
    return s


def random_values(rng, p, symmetric_values=False):
    a = p.toarray() * rng.standard_normal(p.shape)
    if symmetric_values:
        a = np.triu(a) + np.triu(a, 1).T
    return a


def assert_same(result, expected, p):
    assert sp.issparse(result) and result.format == "csr"
    assert result.shape == p.shape
    np.testing.assert_array_equal(result.indptr, p.indptr)
    np.testing.assert_array_equal(result.indices, p.indices)
    np.testing.assert_allclose(result.toarray(), expected, rtol=0, atol=1e-12)


def check_all_jacobian(p, rng, order="largest_first"):
    j = random_values(rng, p)
    cols = col.column_coloring(p, order)
    assert is_distance1_columns(p, cols)
    assert_same(col.decompress_columns(p, cols, j @ seeds(cols, ncolors(cols))), j, p)
    rows = col.row_coloring(p, order)
    assert is_distance1_columns(p.T.tocsr(), rows)
    assert_same(col.decompress_rows(p, rows, seeds(rows, ncolors(rows)).T @ j), j, p)
    bc = col.bidirectional_coloring(p, order)
    assert is_bicoloring(p, bc)
    assert bc.ncolors <= min(ncolors(cols), ncolors(rows))
    forward = j @ seeds(bc.column_colors, bc.n_forward)
    reverse = seeds(bc.row_colors, bc.n_reverse).T @ j
    assert_same(col.decompress_bidirectional(p, bc, forward, reverse), j, p)


def check_all_hessian(p, rng, order="largest_first"):
    h = random_values(rng, p, symmetric_values=True)
    star = col.star_coloring(p, order)
    assert star.colors.dtype == np.int64 and star.ncolors == ncolors(star.colors)
    assert is_star(p, star.colors)
    assert_same(col.decompress_star(p, star, h @ seeds(star.colors, star.ncolors)), h, p)
    acyclic = col.acyclic_coloring(p, order)
    assert acyclic.ncolors == ncolors(acyclic.colors)
    assert is_acyclic(p, acyclic.colors)
    assert_same(col.decompress_acyclic(p, acyclic, h @ seeds(acyclic.colors, acyclic.ncolors)), h, p)
    return star, acyclic


# ------------------------------------------------------------------ correctness on random patterns


@pytest.mark.parametrize("order", col.ORDERS)
def test_random_jacobians(order):
    rng = np.random.default_rng(1)
    for _ in range(25):
        m, n = rng.integers(1, 30, size=2)
        check_all_jacobian(random_pattern(rng, m, n, rng.uniform(0.02, 0.5)), rng, order)


@pytest.mark.parametrize("order", col.ORDERS)
def test_random_hessians(order):
    rng = np.random.default_rng(2)
    for _ in range(25):
        n = int(rng.integers(1, 40))
        check_all_hessian(random_symmetric(rng, n, rng.uniform(0.02, 0.4), diagonal=bool(rng.integers(2))), rng, order)


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_edge_cases(name):
    rng = np.random.default_rng(3)
    p = EDGE_CASES[name]
    for order in col.ORDERS:
        check_all_hessian(p, rng, order)
        check_all_jacobian(p, rng, order)


def test_rectangular_edge_cases():
    rng = np.random.default_rng(4)
    for _, p in rectangular_cases(rng):
        for order in col.ORDERS:
            check_all_jacobian(p, rng, order)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(bool, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=9)),
       st.sampled_from(col.ORDERS))
def test_property_jacobian(dense, order):
    check_all_jacobian(csr(dense), np.random.default_rng(5), order)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(bool, st.tuples(st.integers(1, 9)).map(lambda t: (t[0], t[0]))), st.sampled_from(col.ORDERS))
def test_property_hessian(dense, order):
    check_all_hessian(csr(dense | dense.T), np.random.default_rng(6), order)


def test_column_coloring_without_the_graph(monkeypatch):
    """Dense rows: the bitset greedy, never building the intersection graph, gives valid
    colorings, and the very colors of the graph greedy in the natural order."""
    rng = np.random.default_rng(14)
    patterns = [random_pattern(rng, int(rng.integers(1, 30)), int(rng.integers(1, 30)), 0.2) for _ in range(15)]
    patterns += [arrowhead(30), bordered_banded(30, 2, 2), EDGE_CASES["no nonzeros"]]
    natural = [col.column_coloring(p, "natural") for p in patterns]
    monkeypatch.setattr(col, "_GRAPH_BUDGET", -1)
    for p, expected in zip(patterns, natural):
        np.testing.assert_array_equal(col.column_coloring(p, "natural"), expected)
        for order in col.ORDERS:
            check_all_jacobian(p, rng, order)
    assert ncolors(col.column_coloring(arrowhead(30))) == 30


def test_seed_matrix():
    colors = np.array([1, -1, 0, 1])
    np.testing.assert_array_equal(col.seed_matrix(colors), seeds(colors, 2))
    assert col.seed_matrix(colors, 4).shape == (4, 4)


def test_unsymmetric_input_pattern_is_symmetrised_for_the_coloring():
    p = csr([[1, 1, 0], [0, 1, 1], [0, 0, 1]])  # upper triangle of a tridiagonal
    assert is_star(symmetric(p), col.star_coloring(p).colors)
    assert is_acyclic(symmetric(p), col.acyclic_coloring(p).colors)


def test_colorings_are_deterministic():
    p = laplacian_2d(12)
    for order in col.ORDERS:
        np.testing.assert_array_equal(col.star_coloring(p, order).colors, col.star_coloring(p, order).colors)
        np.testing.assert_array_equal(col.acyclic_coloring(p, order).colors, col.acyclic_coloring(p, order).colors)


# ------------------------------------------------------------------ brute force on small patterns


def partitions(n):
    """Every coloring of n vertices up to renaming colors (restricted growth strings)."""
    def grow(prefix, top):
        if len(prefix) == n:
            yield np.array(prefix, dtype=np.int64)
            return
        for c in range(top + 2):
            yield from grow(prefix + [c], max(top, c))
    if n == 0:
        yield np.zeros(0, dtype=np.int64)
        return
    yield from grow([0], 0)


def optimum(n, valid) -> int:
    return min(ncolors(c) for c in partitions(n) if valid(c))


def test_brute_force_small_patterns():
    rng = np.random.default_rng(7)
    ratios = {"column": [], "star": [], "acyclic": []}
    for _ in range(12):
        n = int(rng.integers(2, 8))
        h = random_symmetric(rng, n, rng.uniform(0.2, 0.6))
        j = random_pattern(rng, int(rng.integers(1, 8)), n, 0.4)
        best = {
            "column": optimum(n, lambda c, j=j: is_distance1_columns(j, c)),
            "star": optimum(n, lambda c, h=h: is_star(h, c)),
            "acyclic": optimum(n, lambda c, h=h: is_acyclic(h, c)),
        }
        assert best["acyclic"] <= best["star"]
        for order in col.ORDERS:
            got = {"column": ncolors(col.column_coloring(j, order)),
                   "star": col.star_coloring(h, order).ncolors,
                   "acyclic": col.acyclic_coloring(h, order).ncolors}
            for kind in got:
                assert best[kind] <= got[kind] <= 2 * best[kind] + 1, (kind, order, got, best)
                ratios[kind].append(got[kind] / max(best[kind], 1))
    print("greedy / optimal colors, mean:", {k: round(float(np.mean(v)), 3) for k, v in ratios.items()})


@pytest.mark.parametrize("case", ["path", "star graph", "clique", "block diagonal", "empty"])
def test_greedy_is_optimal_on_easy_classes(case):
    patterns = {"path": banded(7, 1), "star graph": arrowhead(7), "clique": csr(np.ones((5, 5))),
                "block diagonal": block_diagonal(3, 2), "empty": csr(np.eye(5))}
    p = patterns[case]
    n = p.shape[0]
    for order in col.ORDERS:
        assert col.star_coloring(p, order).ncolors == optimum(n, lambda c: is_star(p, c))
        assert col.acyclic_coloring(p, order).ncolors == optimum(n, lambda c: is_acyclic(p, c))
        assert ncolors(col.column_coloring(p, order)) == optimum(n, lambda c: is_distance1_columns(p, c))


# ------------------------------------------------------------------ target color counts


@pytest.mark.parametrize("order", col.ORDERS)
def test_hessian_targets(order):
    rng = np.random.default_rng(8)
    star, acyclic = check_all_hessian(arrowhead(40), rng, order)
    assert star.ncolors == 2 and acyclic.ncolors == 2
    star, acyclic = check_all_hessian(banded(40, 1), rng, order)
    assert star.ncolors <= 3 and acyclic.ncolors <= 3
    for k in (1, 2, 3, 5):
        star, acyclic = check_all_hessian(banded(60, k), rng, order)
        assert star.ncolors <= 2 * k + 1
        assert acyclic.ncolors <= star.ncolors
    for b in (1, 3, 5):
        p = block_diagonal(6, b)
        star, acyclic = check_all_hessian(p, rng, order)
        assert star.ncolors == b and acyclic.ncolors == b
        assert ncolors(col.column_coloring(p, order)) == b


@pytest.mark.parametrize("order", col.ORDERS)
def test_jacobian_targets(order):
    rng = np.random.default_rng(9)
    bc = col.bidirectional_coloring(arrowhead(50), order)
    assert bc.ncolors <= 4, bc
    check_all_jacobian(arrowhead(50), rng, order)
    for k, border in ((1, 1), (1, 2), (2, 2), (3, 1)):
        p = bordered_banded(60, k, border)
        bc = col.bidirectional_coloring(p, order)
        assert bc.ncolors <= 2 * k + 1 + 2 * border, (k, border, bc)
        check_all_jacobian(p, rng, order)
    # one-sided colorings: a banded Jacobian needs 2k + 1 columns
    assert ncolors(col.column_coloring(banded(50, 2), order)) == 5


# ------------------------------------------------------------------ plans


def test_plans_match_decompress_and_are_reusable():
    rng = np.random.default_rng(10)
    p = random_symmetric(rng, 30, 0.15)
    star = col.star_coloring(p)
    acyclic = col.acyclic_coloring(p)
    cols = col.column_coloring(p)
    bc = col.bidirectional_coloring(p)
    plans = {"star": col.star_plan(p, star), "acyclic": col.acyclic_plan(p, acyclic),
             "column": col.column_plan(p, cols), "row": col.row_plan(p, cols), "bi": col.bidirectional_plan(p, bc)}
    rows_ref = np.repeat(np.arange(30), np.diff(p.indptr))
    for plan in plans.values():
        np.testing.assert_array_equal(plan.rows, rows_ref)
        np.testing.assert_array_equal(plan.cols, p.indices)
    for _ in range(3):  # new values through the same plans
        h = random_values(rng, p, symmetric_values=True)
        expected = h[p.nonzero()]
        np.testing.assert_allclose(plans["star"].values(h @ seeds(star.colors, star.ncolors)), expected, atol=1e-12)
        np.testing.assert_allclose(plans["acyclic"].values(h @ seeds(acyclic.colors, acyclic.ncolors)), expected,
                                   atol=1e-12)
        np.testing.assert_allclose(plans["column"].values(h @ seeds(cols, ncolors(cols))), expected, atol=1e-12)
        np.testing.assert_allclose(plans["row"].values(seeds(cols, ncolors(cols)).T @ h), expected, atol=1e-12)
        forward, reverse = h @ seeds(bc.column_colors, bc.n_forward), seeds(bc.row_colors, bc.n_reverse).T @ h
        np.testing.assert_allclose(plans["bi"].values(forward, reverse), expected, atol=1e-12)
        assert_same(plans["bi"].matrix(forward, reverse), h, p)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128])
def test_plans_keep_the_dtype(dtype):
    rng = np.random.default_rng(11)
    p = random_symmetric(rng, 25, 0.2)
    h = random_values(rng, p, symmetric_values=True)
    if dtype is np.complex128:
        h = h + 1j * random_values(rng, p, symmetric_values=True)
    h = h.astype(dtype)
    tol = 1e-5 if dtype is np.float32 else 1e-12
    for coloring, plan_of in ((col.star_coloring(p), col.star_plan), (col.acyclic_coloring(p), col.acyclic_plan)):
        values = plan_of(p, coloring).values(h @ seeds(coloring.colors, coloring.ncolors).astype(dtype))
        assert values.dtype == dtype
        np.testing.assert_allclose(values, h[p.nonzero()], rtol=0, atol=tol)
    bc = col.bidirectional_coloring(p)
    forward = h @ seeds(bc.column_colors, bc.n_forward).astype(dtype)
    reverse = seeds(bc.row_colors, bc.n_reverse).astype(dtype).T @ h
    assert col.bidirectional_plan(p, bc).values(forward, reverse).dtype == dtype


def test_colorings_are_read_only():
    star = col.star_coloring(banded(5, 1))
    with pytest.raises(ValueError):
        star.colors[0] = 3


# ------------------------------------------------------------------ errors


def test_errors():
    wide = random_pattern(np.random.default_rng(12), 3, 4, 0.5)
    for coloring in (col.star_coloring, col.acyclic_coloring):
        with pytest.raises(ShapeMismatchError, match=r"square.*\(3, 4\)"):
            coloring(wide)
    for coloring in (col.column_coloring, col.row_coloring, col.star_coloring, col.acyclic_coloring,
                     col.bidirectional_coloring):
        with pytest.raises(InvalidArgumentError, match="unknown vertex order 'random'"):
            coloring(csr(np.eye(3)), order="random")
    p = banded(6, 1)
    with pytest.raises(InvalidArgumentError, match="not a valid star coloring"):
        col.star_plan(p, col.StarColoring(np.array([0, 1, 0, 1, 0, 1]), 2))  # proper but not star
    with pytest.raises(InvalidArgumentError, match="not a valid acyclic coloring"):
        col.acyclic_plan(symmetric(csr([[0, 1, 0, 1], [0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]])),
                         col.AcyclicColoring(np.array([0, 1, 0, 1]), 2))  # a two-colored 4-cycle
    with pytest.raises(InvalidArgumentError, match="not a valid column coloring"):
        col.column_plan(p, np.zeros(6, dtype=np.int64))
    star = col.star_coloring(p)
    with pytest.raises(ShapeMismatchError, match="expects a compressed array of shape"):
        col.decompress_star(p, star, np.zeros((6, star.ncolors + 1)))
    with pytest.raises(ShapeMismatchError, match="colors for"):
        col.column_plan(p, np.zeros(5, dtype=np.int64))


def test_every_raise_is_an_abstractdiff_error():
    import ast
    import inspect

    from abstractdiff import _errors

    tree = ast.parse(inspect.getsource(col))
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            assert issubclass(getattr(_errors, call.id), _errors.AbstractDiffError), ast.unparse(node)


def test_module_imports_no_ad_library():
    import ast
    import inspect

    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(col))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0] if node.level == 0 else "." + node.module)
    assert names <= {"__future__", "dataclasses", "typing", "numpy", "scipy", ".core"}, names


# ------------------------------------------------------------------ timings (printed, not asserted)


def _timed(f, *args):
    start = time.perf_counter()
    result = f(*args)
    return result, time.perf_counter() - start


@pytest.mark.parametrize("size", [10_000, 100_000])
def test_timings(size, capsys):
    side = int(round(size ** 0.5))
    lines = []
    rng = np.random.default_rng(13)
    for name, p in (("laplacian", laplacian_2d(side)), ("arrowhead", arrowhead(size))):
        n = p.shape[0]
        h = sp.csr_matrix(p, dtype=float)
        h.data = rng.standard_normal(h.nnz)
        h = (h + h.T).tocsr()
        kinds = [("star", col.star_coloring, col.star_plan), ("acyclic", col.acyclic_coloring, col.acyclic_plan)]
        if name == "laplacian":  # an arrowhead's column intersection graph is a clique of n
            kinds.append(("column", col.column_coloring, col.column_plan))
        for kind, color, plan_of in kinds:
            coloring, t_color = _timed(color, p)
            plan, t_plan = _timed(plan_of, p, coloring)
            colors = coloring if kind == "column" else coloring.colors
            b = h @ seeds(colors, ncolors(colors))
            values, t_values = _timed(plan.values, b)
            np.testing.assert_allclose(values, np.asarray(h[p.nonzero()]).ravel(), atol=1e-10)
            lines.append(f"{name:9s} n={n:6d} {kind:8s} colors={ncolors(colors):3d} color {t_color:6.3f}s "
                         f"plan {t_plan:6.3f}s values {t_values * 1e3:7.2f}ms")
        if name == "arrowhead":  # a clique of n columns: colored without building it
            colors, t_color = _timed(col.column_coloring, p)
            lines.append(f"{name:9s} n={n:6d} column   colors={ncolors(colors):6d} color {t_color:6.3f}s")
        bc, t_color = _timed(col.bidirectional_coloring, p)
        plan, t_plan = _timed(col.bidirectional_plan, p, bc)
        lines.append(f"{name:9s} n={n:6d} bidirectional colors={bc.ncolors:3d} ({bc.n_forward}+{bc.n_reverse}) "
                     f"color {t_color:6.3f}s plan {t_plan:6.3f}s [{bc.method}]")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_brute_force_enumerates_every_partition():
    assert [sum(1 for _ in partitions(n)) for n in range(6)] == [1, 1, 2, 5, 15, 52]  # Bell numbers
    assert all(len(set(map(tuple, partitions(4)))) == 15 for _ in itertools.repeat(None, 1))

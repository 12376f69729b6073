"""``ad.Sparse``'s colorings: symmetric (star, acyclic) Hessians, bidirectional Jacobians,
forced modes, inspection of a prepared operator, the dense probe, plans kept across
unprepared calls, and the errors.  Exact backends against their own dense results (1e-10,
float64); color counts where :mod:`abstractdiff._coloring` is there."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import abstractdiff as ad
import abstractdiff._sparse as sparse_module
from abstractdiff._registry import unavailable_reason
from abstractdiff.testing._sparse_problems import (
    arrowhead,
    arrowhead_jacobian,
    coloring_problems,
    tridiagonal,
    tridiagonal_hessian,
)

from .test_operators import ForwardOnly  # the backend with only a pushforward

EXACT = ("jax", "torch", "autograd", "tensorflow", "mlx", "paddle", "pytensor")
#: the backends where the color bounds of the issue are asserted
BOUNDED = ("jax", "torch", "autograd", "tensorflow")
PROBLEMS = coloring_problems()
HAS_COLORING = sparse_module._coloring_module() is not None
needs_coloring = pytest.mark.skipif(not HAS_COLORING, reason="abstractdiff._coloring is not there yet")


def _inner(name: str) -> ad.Backend:
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return ad.backend(name)


def _dense(inner: ad.Backend, problem, x) -> np.ndarray:
    operator = ad.jacobian if problem.kind == "jacobian" else ad.hessian
    return np.asarray(ad.to_numpy(operator(inner, problem.f, x))).reshape(-1, problem.x.size)


def _prepare(b, problem, x):
    return getattr(ad, f"prepare_{problem.kind}")(b, problem.f, x)


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
@pytest.mark.parametrize("name", EXACT)
def test_matches_dense(name: str, problem) -> None:
    inner = _inner(name)
    x = inner.asarray(problem.x)
    dense = _dense(inner, problem, x)
    prepared = _prepare(ad.Sparse(inner), problem, x)
    operator = ad.jacobian if problem.kind == "jacobian" else ad.hessian
    for got in (prepared(x), operator(ad.Sparse(inner), problem.f, x)):
        assert isinstance(got, sp.csr_matrix) and got.shape == dense.shape
        np.testing.assert_allclose(got.toarray(), dense, rtol=1e-10, atol=1e-10)
    assert prepared.ncolors <= problem.x.size


@needs_coloring
@pytest.mark.parametrize("name", BOUNDED)
@pytest.mark.parametrize("f,bound", [(arrowhead, 3), (tridiagonal_hessian, 3)], ids=["arrowhead", "tridiagonal"])
def test_symmetric_coloring_needs_few_products(name: str, f, bound: int) -> None:
    inner = _inner(name)
    x = np.random.default_rng(0).normal(size=30)
    h = ad.prepare_hessian(ad.Sparse(inner), f, inner.asarray(x))
    assert h.ncolors <= bound and h.coloring == "star"
    assert h.colors.rows is None and h.colors.columns.shape == (30,)


@needs_coloring
@pytest.mark.parametrize("name", ["jax", "torch"])
def test_bidirectional_coloring_of_an_arrowhead_jacobian(name: str) -> None:
    inner = _inner(name)
    x = np.random.default_rng(1).normal(size=30)
    j = ad.prepare_jacobian(ad.Sparse(inner), arrowhead_jacobian, inner.asarray(x))
    assert j.ncolors <= 4 and j.mode == "mixed"
    columns, rows = j.colors
    assert columns.shape == (30,) and rows.shape == (30,) and ((columns == -1).any() or (rows == -1).any())
    assert (columns >= 0).any() and (rows >= 0).any()
    for mode in ("forward", "reverse"):  # one side alone: a dense row or column, n products
        assert ad.prepare_jacobian(ad.Sparse(inner, mode=mode), arrowhead_jacobian, inner.asarray(x)).ncolors == 30


@pytest.mark.parametrize("coloring", ["auto", "star", "acyclic", "column", "greedy", "natural"])
@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.kind == "hessian"], ids=lambda p: p.name)
def test_every_hessian_coloring_is_exact(problem, coloring: str) -> None:
    inner = _inner("jax")
    dense = _dense(inner, problem, problem.x)
    h = ad.prepare_hessian(ad.Sparse(inner, coloring=coloring), problem.f, problem.x)
    np.testing.assert_allclose(h(problem.x).toarray(), dense, rtol=1e-10, atol=1e-10)
    column = ad.prepare_hessian(ad.Sparse(inner, coloring="column"), problem.f, problem.x)
    assert h.ncolors <= column.ncolors or coloring == "natural"


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse", "mixed"])
@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p.kind == "jacobian"], ids=lambda p: p.name)
def test_every_jacobian_mode_is_exact(problem, mode: str) -> None:
    if mode == "mixed" and not HAS_COLORING:
        pytest.skip("abstractdiff._coloring is not there yet")
    inner = _inner("jax")
    dense = _dense(inner, problem, problem.x)
    j = ad.prepare_jacobian(ad.Sparse(inner, mode=mode), problem.f, problem.x)
    np.testing.assert_allclose(j(problem.x).toarray(), dense, rtol=1e-10, atol=1e-10)
    columns, rows = j.colors
    assert mode == "auto" or j.mode == mode
    assert (columns is None) == (j.mode == "reverse") and (rows is None) == (j.mode == "forward")


def test_inspection_of_a_prepared_operator() -> None:
    b = ad.Sparse("autograd" if unavailable_reason("autograd") is None else "finite_differences")
    x = np.random.default_rng(2).normal(size=20)
    j = ad.prepare_jacobian(b, tridiagonal, x)
    assert sp.issparse(j.sparsity) and j.sparsity.dtype == bool and j.sparsity.shape == (20, 20)
    assert (j.sparsity != ad.jacobian_sparsity(tridiagonal, x)).nnz == 0
    assert j.ncolors == 3 and j.mode == "forward" and j.coloring == "column"
    assert isinstance(j.colors, sparse_module.SparseColors) and j.colors.rows is None
    assert sorted(set(j.colors.columns.tolist())) == [0, 1, 2]
    h = ad.prepare_hessian(b, lambda x: (x[0] * x[1:]).sum(), x)  # the pattern is symmetrised
    assert (h.sparsity != h.sparsity.T).nnz == 0 and h.sparsity[0, 5] and h.sparsity[5, 0]


def test_dense_probe_is_the_dense_derivative_at_the_point() -> None:
    inner = _inner("jax")
    x = np.random.default_rng(3).normal(size=20)
    x[4] = 0.0  # d(x_4^2 x_5)/dx_5 = x_4^2 = 0 here: the probe leaves it out (locally valid only)
    f = lambda x: x[1:] * x[:-1] ** 2  # noqa: E731
    j = ad.prepare_jacobian(ad.Sparse(inner, sparsity="dense-probe"), f, x)
    dense = np.asarray(ad.jacobian(inner, f, x))
    assert (j.sparsity.toarray() == (dense != 0)).all() and not j.sparsity[4, 4]
    assert ad.jacobian_sparsity(f, x)[4, 4]  # the detector keeps it at every point
    np.testing.assert_allclose(j(x).toarray(), dense, rtol=1e-12)
    h = ad.prepare_hessian(ad.Sparse(inner, sparsity="dense-probe"), arrowhead, x + 1.0)
    np.testing.assert_allclose(h(x + 1.0).toarray(), np.asarray(ad.hessian(inner, arrowhead, x + 1.0)), rtol=1e-12)
    assert h.sparsity.nnz == 3 * 20 - 2 and "dense-probe" in repr(ad.Sparse(inner, sparsity="dense-probe"))


def _counting(monkeypatch) -> list:
    calls: list = []
    for name in ("_jacobian_plan", "_hessian_plan"):
        original = getattr(sparse_module, name)
        monkeypatch.setattr(sparse_module, name, lambda *a, _o=original, _n=name: calls.append(_n) or _o(*a))
    monkeypatch.setattr(sparse_module.SparseJacobianPrep, "_build", staticmethod(sparse_module._jacobian_plan))
    monkeypatch.setattr(sparse_module.SparseHessianPrep, "_build", staticmethod(sparse_module._hessian_plan))
    return calls


@pytest.mark.parametrize("name", ["jax", "finite_differences"])
def test_unprepared_calls_plan_once(monkeypatch, name: str) -> None:
    inner = _inner(name)
    calls = _counting(monkeypatch)
    f = lambda x: tridiagonal(x) * 2.0  # noqa: E731  (a new function: nothing planned yet)
    g = lambda x: arrowhead(x) * 2.0  # noqa: E731
    rng = np.random.default_rng(4)
    for _ in range(4):  # the same backend, a new equal one, new points: one plan each
        for b in (ad.Sparse(inner), ad.Sparse(name)):
            x = inner.asarray(rng.normal(size=30))
            ad.jacobian(b, f, x)
            ad.hessian(b, g, x)
    assert sorted(calls) == ["_hessian_plan", "_jacobian_plan"]
    assert ad.Sparse(inner, coloring="greedy") == ad.Sparse(inner)  # the old name of the default
    ad.jacobian(ad.Sparse(inner, coloring="greedy"), f, inner.asarray(rng.normal(size=30)))
    ad.jacobian(ad.Sparse(inner, coloring="natural"), f, inner.asarray(rng.normal(size=30)))
    ad.jacobian(ad.Sparse(inner), f, inner.asarray(rng.normal(size=31)))
    assert len(calls) == 4, "another coloring and another shape plan again"


def test_data_arguments_still_plan_again(monkeypatch) -> None:
    calls = _counting(monkeypatch)
    f = lambda x, idx: x[idx] * x[1:]  # noqa: E731
    b, x = ad.Sparse("finite_differences"), np.ones(6)
    first = ad.jacobian(b, f, x, np.arange(5))
    ad.jacobian(b, f, x, np.arange(5))
    other = ad.jacobian(b, f, x, np.arange(5)[::-1].copy())
    assert len(calls) == 2 and (first != other).nnz > 0


def test_a_given_pattern_is_left_as_it_was() -> None:
    # an unsorted CSR pattern, as scipy builds from unsorted triplets: Sparse sorts its own copy
    pattern = sp.csr_matrix((np.ones(3, bool), np.array([2, 0, 1]), np.array([0, 2, 3])), shape=(2, 3))
    before = pattern.indices.copy()
    f = lambda x: x[:2] * x[1:] * np.array([1.0, 0.0]) + np.array([0.0, 1.0]) * x[1]  # noqa: E731
    j = ad.prepare_jacobian(ad.Sparse("finite_differences", sparsity=sp.csr_matrix(np.ones((2, 3)))), f, np.ones(3))
    ad.Sparse("finite_differences", sparsity=pattern)
    assert (pattern.indices == before).all() and not pattern.has_sorted_indices
    J = j(np.ones(3))
    J.sort_indices()
    J.indices[:] = 0  # a caller writing into its result leaves the plan intact
    assert (j(np.ones(3)).indices == j.sparsity.indices).all()


def test_errors() -> None:
    with pytest.raises(ad.InvalidArgumentError, match="mode must be one of"):
        ad.Sparse("finite_differences", mode="sideways")
    with pytest.raises(ad.InvalidArgumentError, match="coloring must be one of"):
        ad.Sparse("finite_differences", coloring="distance-2")
    with pytest.raises(ad.ModeMismatchError, match="reverse"):
        ad.Sparse(ForwardOnly(), mode="reverse")
    with pytest.raises(ad.ModeMismatchError, match="reverse"):
        ad.Sparse(ForwardOnly(), mode="mixed")
    with pytest.raises(ad.InvalidArgumentError, match="excludes"):
        ad.Sparse("finite_differences", mode="mixed", coloring="column")
    x = np.ones(6)
    with pytest.raises(ad.InvalidArgumentError, match="for Hessians"):
        ad.jacobian(ad.Sparse("finite_differences", coloring="acyclic"), tridiagonal, x)
    with pytest.raises(ad.InvalidArgumentError, match="for Jacobians"):
        ad.hessian(ad.Sparse("finite_differences", mode="mixed"), arrowhead, x)
    with pytest.raises(ad.ArgumentTypeError, match="dense-probe"):
        ad.Sparse("finite_differences", sparsity="dense")
    j = ad.jacobian(ad.Sparse(ForwardOnly()), tridiagonal, x)  # auto: the mode it has
    assert j.nnz == 16

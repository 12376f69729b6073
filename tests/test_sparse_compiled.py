"""A prepared ad.Sparse operator on a compiling backend: compressed products, pattern check and
decompression as one compiled call (abstractdiff._sparse._fused), exact against the
step-by-step route and dense results, traced once, and with the step-by-step route's errors."""

from __future__ import annotations

import autoray as ar
import numpy as np
import pytest
import scipy.sparse as sp

import abstractdiff as ad
import abstractdiff._sparse as sparse_module
from abstractdiff.testing._sparse_problems import arrowhead, arrowhead_jacobian, banded_hessian, laplacian_residual
from tests.test_train import need

COMPILING = [("jax", {}), ("tensorflow", {}), ("mlx", {"compile": True})]
IDS = [name for name, _ in COMPILING]


def inner(name, options):
    need(name)
    return ad.backend(name, **options)


def point(b, n: int, dtype: str, seed: int = 0):
    return b.convert(np.random.default_rng(seed).uniform(0.5, 1.5, n).astype(dtype))


def compiled_keys(plan) -> list:
    return [k for k in plan.native if isinstance(k, tuple) and k[:1] == ("compiled",)]


def plan_of(prepared, x):
    return prepared.preparation.plan([x], [])


def step_by_step(monkeypatch):
    monkeypatch.setattr(sparse_module, "_fused", lambda *args: None)


CASES = [
    ("jacobian", laplacian_residual, 49, "auto"),
    ("jacobian", arrowhead_jacobian, 40, "mixed"),
    ("hessian", arrowhead, 60, "auto"),
    ("hessian", banded_hessian, 80, "auto"),
]


@pytest.mark.parametrize("kind,f,n,mode", CASES, ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])
@pytest.mark.parametrize("name,options", COMPILING, ids=IDS)
def test_one_compiled_call_is_exact_against_the_step_by_step_route(name, options, kind, f, n, mode, monkeypatch):
    b = inner(name, options)
    dtype = "float32" if name == "mlx" else "float64"
    x = point(b, n, dtype)
    prepare = ad.prepare_jacobian if kind == "jacobian" else ad.prepare_hessian
    prepared = prepare(ad.Sparse(b, mode=mode) if kind == "jacobian" else ad.Sparse(b), f, x)
    got = prepared(x)
    assert compiled_keys(plan_of(prepared, x)), "the prepared call did not compile"
    assert isinstance(got, sp.csr_matrix)
    with monkeypatch.context() as m:
        step_by_step(m)
        want = prepare(ad.Sparse(b, mode=mode) if kind == "jacobian" else ad.Sparse(b), f, x)(x)
    np.testing.assert_array_equal(got.indptr, want.indptr)
    np.testing.assert_array_equal(got.indices, want.indices)
    tol = 1e-12 if dtype == "float64" else 1e-5
    np.testing.assert_allclose(got.data, want.data, rtol=tol, atol=tol)
    dense = (ad.jacobian if kind == "jacobian" else ad.hessian)(b, f, x)
    np.testing.assert_allclose(got.toarray(), ad.to_numpy(dense), rtol=tol, atol=tol)


def test_a_new_point_reuses_the_trace_and_gives_its_own_values():
    b = inner("jax", {})
    prepared = ad.prepare_hessian(ad.Sparse(b), arrowhead, point(b, 50, "float64"))
    prepared(point(b, 50, "float64"))
    traces = b.trace_count
    points = [point(b, 50, "float64", seed) for seed in (1, 2, 3)]
    results = [prepared(x) for x in points]
    assert b.trace_count == traces
    for x, got in zip(points, results):
        np.testing.assert_allclose(got.toarray(), np.asarray(ad.hessian(b, arrowhead, x)), rtol=1e-12, atol=1e-12)


def test_a_pattern_that_misses_an_entry_still_raises_where_it_is():
    b = inner("jax", {})
    x = point(b, 49, "float64")
    # the diagonal without its first element for the Laplacian's Jacobian: a compressed column
    # is nonzero at a row none of its columns has (where the compiled check sees it too)
    wrong = np.eye(49, dtype=bool)
    wrong[0, 0] = False
    prepared = ad.prepare_jacobian(ad.Sparse(b, sparsity=sp.csr_matrix(wrong)), laplacian_residual, x)
    with pytest.raises(ad.SparsityPatternError, match="row 0 of the compressed column"):
        prepared(x)


def test_the_caller_may_change_a_result_without_touching_the_plan():
    b = inner("jax", {})
    x = point(b, 40, "float64")
    prepared = ad.prepare_hessian(ad.Sparse(b), arrowhead, x)
    first = prepared(x)
    first.indices[:] = 0
    first.data[:] = 0.0
    again = prepared(x)
    np.testing.assert_allclose(again.toarray(), np.asarray(ad.hessian(b, arrowhead, x)), rtol=1e-12, atol=1e-12)


def test_substitution_and_approximate_backends_take_the_step_by_step_route():
    b = inner("jax", {})
    x = point(b, 40, "float64")
    acyclic = ad.prepare_hessian(ad.Sparse(b, coloring="acyclic"), banded_hessian, x)
    got = acyclic(x)
    np.testing.assert_allclose(got.toarray(), np.asarray(ad.hessian(b, banded_hessian, x)), rtol=1e-12, atol=1e-12)
    if plan_of(acyclic, x).index is None:  # substitution: solved in numpy, after the products
        assert not compiled_keys(plan_of(acyclic, x))
    fd = ad.prepare_jacobian(ad.Sparse("finite_differences"), laplacian_residual, np.ones(16))
    fd(np.ones(16))
    assert not compiled_keys(fd.preparation.plan([np.ones(16)], []))


@pytest.mark.parametrize("name,options", COMPILING, ids=IDS)
def test_an_empty_pattern_gives_an_all_zero_matrix(name, options):
    # a linear function's Hessian has no nonzero: nothing to compress or gather (found by
    # hypothesis in test_properties: the compiled call's index was empty)
    b = inner(name, options)
    dtype = "float32" if name == "mlx" else "float64"
    x = point(b, 5, dtype)

    def linear(v):
        return ar.do("sum", v * 2.0)

    prepared = ad.prepare_hessian(ad.Sparse(b), linear, x)
    for got in (ad.hessian(ad.Sparse(b), linear, x), prepared(x)):
        assert isinstance(got, sp.csr_matrix) and got.shape == (5, 5) and got.nnz == 0

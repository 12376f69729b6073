"""Sparsity detection rules, coloring, decompression and the errors of ``ad.Sparse``
(numpy only: finite differences as the inner backend, and jax/torch-free dense checks)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import abstractdiff as ad
from abstractdiff._sparse import color_columns
from abstractdiff.testing._sparse_problems import sparse_problems

RNG = np.random.default_rng(0)

#: (name, f, n): each supported operation; the detected pattern must hold the true nonzeros.
RULES = [
    ("ufuncs", lambda x: np.sin(x) * np.exp(x[::-1]) + np.tanh(x) / (1 + x**2), 5),
    ("broadcast", lambda x: (x.reshape(2, 3) * x[:3]).ravel(), 6),
    ("sum_axis", lambda x: x.reshape(2, 3).sum(axis=0) + np.mean(x.reshape(2, 3), axis=0), 6),
    ("prod_max", lambda x: np.concatenate([np.prod(x.reshape(3, 2), axis=1), np.max(x.reshape(3, 2), axis=1)]), 6),
    ("matmul", lambda x: x.reshape(2, 3) @ x[:3], 6),
    ("dot_const", lambda x: np.dot(np.ones((2, 3)), x[3:]), 6),
    ("einsum", lambda x: np.einsum("ij,jk->ik", x[:4].reshape(2, 2), x[2:].reshape(2, 2)).ravel(), 6),
    ("tensordot", lambda x: np.tensordot(x.reshape(2, 3), np.ones(3), axes=1), 6),
    ("outer_inner", lambda x: np.concatenate([np.outer(x[:2], x[2:4]).ravel(), [np.inner(x[:3], x[3:])]]), 6),
    ("slicing", lambda x: x[1:4] - x[::2][:3], 6),
    ("transpose", lambda x: np.transpose(x.reshape(2, 3)).ravel() * x, 6),
    ("stack", lambda x: np.stack([x[:3], x[3:] ** 2]).T.ravel(), 6),
    ("roll_flip", lambda x: np.roll(x, 2) + np.flip(x), 6),
    ("diff_cumsum", lambda x: np.concatenate([np.diff(x), np.cumsum(x)]), 6),
    ("pad", lambda x: np.pad(x, 1, constant_values=3.0)[:-2] * x.sum(), 6),
    ("where_clip", lambda x: np.where(x > 0, x**2, -x) + np.clip(x[::-1], -0.5, 0.5), 6),
    ("setitem", lambda x: _setitem(x), 6),
    ("norm_std", lambda x: np.array([1.0]) * np.linalg.norm(x[:3]) + np.std(x[3:]), 6),
    ("repeat_tile", lambda x: np.repeat(x[:2], 3) + np.tile(x[4:], 3), 6),
    ("maximum_abs", lambda x: np.maximum(x, x[::-1]) + abs(x), 6),
    ("methods", lambda x: x.reshape(3, 2).sum(0).astype(np.float64) + x.reshape(3, 2).T.mean(1)[:2], 6),
]


def _setitem(x):
    y = np.zeros_like(x)
    y[1:] = x[:-1] ** 2
    return y


def _dense_jacobian(f, x):
    return ad.to_numpy(ad.jacobian("autograd", f, x)) if False else _fd(f, x)


def _fd(f, x, h=1e-6):
    """Central differences: nonzero where the Jacobian is (at a random point)."""
    cols = [(np.asarray(f(x + h * e)) - np.asarray(f(x - h * e))).ravel() / (2 * h) for e in np.eye(x.size)]
    return np.stack(cols, axis=1)


@pytest.mark.parametrize("name,f,n", RULES, ids=[r[0] for r in RULES])
def test_detection_is_conservative(name, f, n) -> None:
    pattern = ad.jacobian_sparsity(f, np.ones(n))
    assert sp.issparse(pattern) and pattern.dtype == bool
    for _ in range(3):
        x = RNG.normal(size=n)
        dense = _fd(f, x)
        assert pattern.shape == dense.shape
        missed = (np.abs(dense) > 1e-6) & ~pattern.toarray()
        assert not missed.any(), f"{name}: detection missed {np.argwhere(missed)}"


def test_detection_is_sparse_where_it_should_be() -> None:
    pattern = ad.jacobian_sparsity(sparse_problems()[0].f, np.ones(50)).toarray()
    assert pattern.sum() == 50 + 2 * 49  # exactly tridiagonal
    assert not ad.jacobian_sparsity(lambda x: x[::-1] * 2, np.ones(3)).toarray().diagonal()[[0, 2]].any()


@pytest.mark.parametrize("f,expected", [
    (lambda x: (x**2).sum(), np.eye(3, dtype=bool)),
    (lambda x: (x[0] * x[1]) + x[2], np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]], bool)),
    (lambda x: np.sum(3 * x + 1), np.zeros((3, 3), bool)),
    (lambda x: x[0] / x[2], np.array([[0, 0, 1], [0, 0, 0], [1, 0, 1]], bool)),
    (lambda x: np.sin(x[:2]).sum() * 1.0 + np.dot(x, x), np.eye(3, dtype=bool)),
])
def test_hessian_sparsity_rules(f, expected) -> None:
    np.testing.assert_array_equal(ad.hessian_sparsity(f, np.ones(3)).toarray(), expected)


def test_hessian_sparsity_of_arrowhead_and_pytree() -> None:
    arrow = sparse_problems()[3]
    h = ad.hessian_sparsity(arrow.f, arrow.x).toarray()
    assert h[0].all() and h[:, 0].all() and np.count_nonzero(h) == 3 * 50 - 2
    tree = ad.hessian_sparsity(lambda p: (p["a"] * p["b"]).sum(), {"a": np.ones(2), "b": np.ones(2)})
    assert tree.shape == (4, 4) and tree[0, 2] and not tree[0, 1]


@pytest.mark.parametrize("f,what", [
    (lambda x: x if x[0] > 0 else -x, "control flow"),
    (lambda x: float(x[0]) * x, "control flow"),
    (lambda x: np.linalg.solve(np.eye(3), x), "solve"),
    (lambda x: x[np.argmax(x)] * x, "argmax"),
])
def test_unsupported_operations_raise(f, what) -> None:
    with pytest.raises(ad.SparsityDetectionError, match="sparsity="):
        ad.jacobian_sparsity(f, np.ones(3))


@pytest.mark.parametrize("coloring", ["greedy", "natural"])
@pytest.mark.parametrize("problem", sparse_problems(), ids=lambda p: p.name)
def test_coloring_is_valid(problem, coloring) -> None:
    find = ad.jacobian_sparsity if problem.kind == "jacobian" else ad.hessian_sparsity
    pattern = find(problem.f, problem.x)
    colors = color_columns(pattern, coloring)
    dense = pattern.toarray()
    for c in np.unique(colors):
        assert dense[:, colors == c].sum(axis=1).max() <= 1, "two columns of one color share a row"


def test_laplacian_needs_few_colors() -> None:
    pattern = ad.jacobian_sparsity(sparse_problems(grid=20)[1].f, np.ones(400))
    assert color_columns(pattern).max() + 1 <= 8


def test_sparse_jacobian_and_hessian_match_dense_on_finite_differences() -> None:
    b = ad.Sparse("finite_differences")
    for problem in sparse_problems():
        x = problem.x
        if problem.kind == "jacobian":
            got, dense = ad.jacobian(b, problem.f, x), ad.jacobian("finite_differences", problem.f, x)
        else:
            got, dense = ad.hessian(b, problem.f, x), ad.hessian("finite_differences", problem.f, x)
        assert isinstance(got, sp.csr_matrix)
        np.testing.assert_allclose(got.toarray(), dense.reshape(got.shape), atol=1e-5)


def test_pytree_input_is_raveled_in_flatten_order() -> None:
    b = ad.Sparse("finite_differences")
    f = lambda p: p["a"] * p["b"][::-1]  # noqa: E731
    J = ad.jacobian(b, f, {"a": np.array([1.0, 2.0]), "b": np.array([3.0, 4.0])})
    np.testing.assert_allclose(J.toarray(), [[4, 0, 0, 1], [0, 3, 2, 0]], atol=1e-6)


def test_given_sparsity_and_other_operators_are_inner() -> None:
    f = sparse_problems()[0].f
    pattern = ad.jacobian_sparsity(f, np.ones(50))
    b = ad.Sparse("finite_differences", sparsity=pattern.toarray(), coloring="natural")
    assert ad.jacobian(b, f, np.ones(50)).nnz == pattern.nnz
    np.testing.assert_allclose(ad.gradient(b, lambda x: (x**2).sum(), np.ones(3)), 2 * np.ones(3), atol=1e-6)
    assert b == ad.Sparse("finite_differences", sparsity=pattern, coloring="natural")
    assert b != ad.Sparse("finite_differences")


def test_prepared_detects_once(monkeypatch) -> None:
    import abstractdiff._sparse as sparse_module

    calls = []
    original = sparse_module.flat_jacobian_sparsity
    monkeypatch.setattr(sparse_module, "flat_jacobian_sparsity", lambda *a: calls.append(1) or original(*a))
    tridiagonal = sparse_problems()[0].f
    f = lambda x: tridiagonal(x)  # noqa: E731  (a new function: equal Sparse backends share plans)
    j = ad.prepare_jacobian(ad.Sparse("finite_differences"), f, np.ones(50))
    for _ in range(3):
        j(RNG.normal(size=50))
    assert calls == [1]


def test_errors() -> None:
    f = sparse_problems()[0].f
    with pytest.raises(ad.ShapeMismatchError, match=r"sparsity has shape \(3, 3\).*\(50, 50\)"):
        ad.jacobian(ad.Sparse("finite_differences", sparsity=np.eye(3)), f, np.ones(50))
    with pytest.raises(ad.ShapeMismatchError, match="2-D"):
        ad.Sparse("finite_differences", sparsity=np.ones(3))
    with pytest.raises(ad.ArgumentTypeError):
        ad.Sparse("finite_differences", sparsity="dense")
    with pytest.raises(ad.InvalidArgumentError, match="coloring"):
        ad.Sparse("finite_differences", coloring="best")
    with pytest.raises(ad.ArgumentTypeError):
        ad.Sparse(3)  # type: ignore[arg-type]
    with pytest.raises(ad.ArgumentTypeError):
        ad.Sparse(ad.Sparse("finite_differences"))
    # a pattern that misses entries (the diagonal without its first element, for a tridiagonal
    # Jacobian): detectable where a compressed column is nonzero at a row none of its columns has
    wrong = np.eye(50, dtype=bool)
    wrong[0, 0] = False
    with pytest.raises(ad.SparsityPatternError, match="misses an entry"):
        ad.jacobian(ad.Sparse("finite_differences", sparsity=sp.csr_matrix(wrong)), f, np.ones(50))
    with pytest.raises(ad.SparsityPatternError):
        ad.hessian(ad.Sparse("finite_differences", sparsity=wrong), sparse_problems()[3].f, np.ones(50))
    assert issubclass(ad.SparsityPatternError, ad.ShapeMismatchError)

"""``ad.Sparse`` on every exact backend: the four sparse problems (tridiagonal, 2-D
Laplacian residual, bundle adjustment, arrowhead Hessian), prepared and unprepared, equal
to the dense Jacobian or Hessian to 1e-12 in float64, with one compressed product per color
(an arrowhead Hessian, symmetrically colored: at most 3)."""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._arrays import shape_of
from abstractdiff.testing import _grid
from abstractdiff.testing._sparse_problems import sparse_problems

EXACT = ("torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor")
PROBLEMS = sparse_problems()


class _Spy:
    """Counts the seed vectors (non-padding rows) that reach the inner batched hooks."""

    def __init__(self, b: ad.Backend):
        self.seeds = 0
        for hook in ("flat_value_and_batched_pushforward", "flat_value_and_batched_pullback"):
            setattr(b, hook, self._wrap(getattr(b, hook)))

    def _wrap(self, hook):
        def spied(fn, xs, data):
            y, aux, batched = hook(fn, xs, data)

            def counted(seeds):
                leaves = seeds if isinstance(seeds, list) else [seeds]
                try:
                    arrays = [np.asarray(ad.to_numpy(s)) for s in leaves]
                except Exception:  # noqa: BLE001 - traced seeds (a compiled sparse call): one chunk, unpadded
                    self.seeds += int(shape_of(leaves[0])[0])
                    return batched(seeds)
                rows = np.concatenate([a.reshape(a.shape[0], -1) for a in arrays], axis=1)
                self.seeds += int(np.count_nonzero(np.abs(rows).sum(axis=1)))
                return batched(seeds)

            return y, aux, counted

        return spied


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
@pytest.mark.parametrize("name", EXACT)
def test_sparse_problem(name: str, problem) -> None:
    inner = _grid.load(_grid.Case(name, "cpu", "float64"))
    b = ad.Sparse(inner)
    x = inner.asarray(problem.x)
    operator = ad.jacobian if problem.kind == "jacobian" else ad.hessian
    dense = np.asarray(ad.to_numpy(operator(inner, problem.f, x))).reshape(-1, problem.x.size)
    spy = _Spy(inner)
    prepared = getattr(ad, f"prepare_{problem.kind}")(b, problem.f, x)
    plan = prepared.preparation.plan([x], [])
    for key in [k for k in plan.native if isinstance(k, tuple) and k[:1] == ("compiled",)]:
        del plan.native[key]  # a compiled call another test traced (plans are shared): trace it again, spied
    got = prepared(x)
    assert spy.seeds == plan.count, "one compressed product per color"
    assert plan.count < problem.x.size
    if problem.name == "arrowhead":  # star coloring: the hub and the rest (column coloring: n colors)
        assert plan.count <= 3 and plan.kind == "star"
    for sparse in (got, operator(b, problem.f, x)):
        assert sparse.shape == dense.shape
        np.testing.assert_allclose(sparse.toarray(), dense, rtol=1e-12, atol=1e-12)

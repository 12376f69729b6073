"""Explicit and implicit modes give the same numbers: every default scenario through ``ad.Implicit(b)``.

A scenario ``f(x, *args)`` runs implicitly as::

    vs = ad.variables(x, b)
    ad.gradient(ad.Implicit(b), lambda *args: f(current_values(vs), *args), ad.Params(vs), *args)

(``args`` pass through the implicit operator, so their numpy arrays become native
arrays, as in explicit mode), and its gradient, value and pullback are compared with the scenario's analytic
references and with the explicit backend's own results.
"""

from __future__ import annotations

import numpy as np
import optree
import pytest

import abstractdiff as ad
from abstractdiff._implicit import current_values
from abstractdiff.testing._scenarios import default_scenarios

RTOL = {"float32": 1e-4, "float64": 1e-9}
FD_RTOL = {"float32": 2e-3, "float64": 1e-8}
OPERATORS = ("gradient", "value_and_gradient", "pullback")

BACKENDS = [name for name in ad.available_backends() if name != "implicit"]
SCENARIOS = [s for s in default_scenarios() if any(op in s.operators for op in OPERATORS)]


@pytest.fixture(params=BACKENDS, scope="module")
def b(request):
    try:
        return ad.backend(request.param)
    except ad.BackendUnavailableError as err:
        pytest.skip(str(err))


def _close(actual, expected, rtol: float, what: str) -> None:
    got = optree.tree_leaves(actual, none_is_leaf=True)
    want = optree.tree_leaves(expected, none_is_leaf=True)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}: leaf {i} should be None (not differentiable), got {type(g).__name__}"
            continue
        g = np.asarray(ad.to_numpy(g), dtype=np.float64)
        w = np.asarray(w, dtype=np.float64)
        assert g.shape == w.shape, f"{what}: leaf {i} has shape {g.shape}, expected {w.shape}"
        atol = rtol * max(1.0, float(np.max(np.abs(w), initial=0.0)))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{what}: leaf {i}")


def _as_tree(gs: ad.Grads, vs, ps: ad.Params):
    """The gradients laid out like ``x``: None where ``x`` has no variable."""
    return optree.tree_map(lambda v: gs[v] if v in ps else None, vs, none_is_leaf=True)


@pytest.mark.parametrize("s", SCENARIOS, ids=lambda s: s.id)
def test_scenario_runs_implicitly(b, s):
    rtol = FD_RTOL[s.dtype] if b.name == "finite_differences" else RTOL[s.dtype]
    implicit = ad.Implicit(b)
    vs = ad.variables(s.x, b)
    ps = ad.Params(vs)
    before = ad.to_numpy(current_values(vs))

    def f(*args):
        return s.f(current_values(vs), *args)

    if "gradient" in s.operators:
        gs = ad.gradient(implicit, f, ps, *s.args)
        assert list(gs) == list(ps)
        _close(_as_tree(gs, vs, ps), s.reference("gradient"), rtol, f"{s.id} gradient")
        _close(_as_tree(gs, vs, ps), ad.gradient(b, s.f, s.x, *s.args), RTOL[s.dtype], f"{s.id} gradient vs explicit")
    if "value_and_gradient" in s.operators:
        y, gs = ad.value_and_gradient(implicit, f, ps, *s.args)
        _close(y, s.reference("value"), RTOL[s.dtype], f"{s.id} value")
        _close(_as_tree(gs, vs, ps), s.reference("gradient"), rtol, f"{s.id} value_and_gradient")
    if "pullback" in s.operators:
        y, vjp = ad.value_and_pullback(implicit, f, ps, *s.args)
        _close(y, s.reference("value"), RTOL[s.dtype], f"{s.id} pullback value")
        _close(_as_tree(vjp(s.cotangent), vs, ps), s.reference("pullback"), rtol, f"{s.id} pullback")
    # the variables hold their values again, unchanged
    optree.tree_map(np.testing.assert_array_equal, ad.to_numpy(current_values(vs)), before, none_is_leaf=True)

"""The plan cache: keyed exactly, bounded per function, and invisible to results."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._tree import PlanCache

FD = "finite_differences"


def signed(x, s):
    return (x * math.copysign(1.0, s)).sum()


def test_negative_zero_static_argument_gets_its_own_plan():
    b = ad.backend(FD)
    x = np.ones(2)
    np.testing.assert_allclose(ad.gradient(b, signed, x, 0.0), [1.0, 1.0], rtol=1e-9)
    # -0.0 == 0.0 in Python; a cache keyed on equality would reuse the +0.0 plan.
    np.testing.assert_allclose(ad.gradient(b, signed, x, -0.0), [-1.0, -1.0], rtol=1e-9)


def test_nan_static_argument_reuses_its_plan():
    b = type(ad.backend(FD))()  # a fresh instance: its own, empty plan cache

    def f(x, s):
        return (x**2).sum() + (0.0 if s != s else s)

    for _ in range(5):
        ad.gradient(b, f, np.ones(2), float("nan"))
    assert len(b._plans) == 1


def test_prepared_operator_tells_negative_zero_apart():
    grad = ad.prepare_gradient(FD, signed, np.ones(2), 0.0)
    with pytest.raises(ad.ShapeMismatchError, match="static"):
        grad(np.ones(2), -0.0)


def test_plans_per_function_are_bounded():
    b = type(ad.backend(FD))()  # a fresh instance: its own, empty plan cache

    def f(x, step):
        return (x * step).sum()

    for step in range(PlanCache.max_per_function + 40):
        ad.gradient(b, f, np.ones(2), step)
    assert len(b._plans) == PlanCache.max_per_function
    # the most recent plans are the ones kept, and results stay right
    np.testing.assert_allclose(ad.gradient(b, f, np.ones(2), 3), [3.0, 3.0], rtol=1e-9)


def test_autograd_leaves_the_warning_registry_alone():
    if "autograd" not in ad.available_backends():
        pytest.skip("autograd is not installed here")
    b = ad.backend("autograd")

    def user_code():
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # show each distinct warning once per location
        for _ in range(3):
            user_code()
            ad.gradient(b, lambda x: (x**2).sum(), np.ones(2))
            ad.gradient(b, lambda x: np.float64(1.0) + 0 * x.sum(), np.ones(2))
    assert len([w for w in seen if "deprecated thing" in str(w.message)]) == 1


def test_one_array_fast_path_shares_the_general_plan():
    # f(x) with one float array skips flattening; its plan must be the one the general
    # path (a prepared operator, an argument) finds, and results must agree.
    b = ad.backend("finite_differences")

    def f(x, scale=1.0):
        return scale * (x**2).sum()

    x = np.array([1.0, 2.0])
    ad.gradient(b, f, x)
    ad.gradient(b, f, x)  # the fast path now
    prepared = ad.prepare_gradient(b, f, x)
    assert len(b._plans._functions.get((f,))) == 1
    np.testing.assert_allclose(prepared(x), ad.gradient(b, f, x), rtol=1e-6)
    np.testing.assert_allclose(ad.gradient(b, f, x, 3.0), 3 * ad.gradient(b, f, x), rtol=1e-6)


def test_array_type_registered_as_a_node_after_use_is_flattened():
    # An array type first met as a leaf, then registered as a pytree node: the fast path
    # must not keep treating it as one leaf.  This node has no children (its values are
    # metadata), so flattening it finds nothing to differentiate.
    class Frozen(np.ndarray):
        pass

    b = ad.backend("finite_differences")
    x = np.array([1.0, 2.0]).view(Frozen)
    f = lambda v: (v**2).sum()  # noqa: E731
    ad.gradient(b, f, x)
    ad.gradient(b, f, x)
    ad.register_pytree_node(
        Frozen, lambda v: ((), tuple(np.asarray(v).tolist())), lambda meta, _: np.array(meta).view(Frozen)
    )
    with pytest.raises(ad.NonDifferentiableInputError):
        ad.gradient(b, f, x)

"""The plan key of tracing backends: the values f reads from globals and closures."""

from __future__ import annotations

import functools
import gc

import numpy as np

import abstractdiff as ad
from abstractdiff._captures import CONTENT_LIMIT, captures

OFFSET = 1.0


def helper(x):
    return x + OFFSET


def uses_helper(x):
    return helper(x) * 2


def key(f):
    return captures(f)[0]


def test_numbers_strings_and_tuples_by_value():
    a, s, t = 1.5, "mode", (1, 2.0)
    f = lambda x: x * a if s == "mode" and t else x  # noqa: E731
    before = key(f)
    assert key(f) == before
    a = -0.0  # -0.0 == 0.0 and 1.5 != -0.0: exact bits either way
    assert key(f) != before
    g = lambda x: x * b  # noqa: E731
    b = 0.0
    zero = key(g)
    b = -0.0
    assert key(g) != zero


def test_a_helper_of_the_same_module_is_followed():
    global OFFSET
    before = key(uses_helper)
    OFFSET = 2.0
    try:
        assert key(uses_helper) != before
    finally:
        OFFSET = 1.0
    assert key(uses_helper) == before


def test_a_library_function_is_compared_by_identity_only():
    f = lambda x: np.sum(x)  # noqa: E731
    k, alive = captures(f)
    assert all(v is not np.sum for v in alive)  # np is a module: not followed
    assert k == key(f)


def test_small_numpy_arrays_by_content_large_ones_by_identity():
    small = np.ones(3)
    f = lambda x: x * small  # noqa: E731
    before = key(f)
    small[0] = 5.0
    assert key(f) != before
    large = np.ones(CONTENT_LIMIT + 1)
    g = lambda x: x * large  # noqa: E731
    k, alive = captures(g)
    assert any(a is large for a in alive)
    large[0] = 5.0  # in place, large: not seen (documented)
    assert key(g) == k


def test_partial_arguments_and_bound_methods():
    def scaled(x, scale):
        return x * scale

    assert key(functools.partial(scaled, scale=2.0)) != key(functools.partial(scaled, scale=3.0))

    class Model:
        def loss(self, x):
            return x * OFFSET

    m = Model()
    assert key(m.loss) == key(m.loss)


def test_a_dead_object_named_by_identity_invalidates_its_plan():
    b = type(ad.backend("finite_differences"))()
    b.__dict__["reuses_traces"] = True  # exercise the tracing path on a numpy backend

    class Weights:
        def __init__(self, v):
            self.v = v

    def make(weights):
        return lambda x: (x * weights.v).sum()  # weights: compared by identity

    f = make(Weights(2.0))
    np.testing.assert_allclose(ad.gradient(b, f, np.ones(2)), [2.0, 2.0], rtol=1e-8)
    (fn,) = [fn for plans in b._plans._functions.values() for fn in plans.values()]
    assert fn.captured_alive()
    f.__closure__[0].cell_contents = None  # the Weights object dies
    gc.collect()
    assert not fn.captured_alive()  # a new object reusing its id cannot find this plan


def act(x):
    return x * OFFSET


ACTS = (act,)


def test_helpers_inside_a_captured_tuple_are_followed():
    global OFFSET
    f = lambda x: ACTS[0](x)  # noqa: E731
    before = key(f)
    OFFSET = 3.0
    try:
        assert key(f) != before
    finally:
        OFFSET = 1.0

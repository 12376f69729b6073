"""The plan key of tracing backends: the values f reads from globals and closures."""

from __future__ import annotations

import functools
import gc
import math

import numpy as np

import abstractdiff as ad
from abstractdiff._captures import captures

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


def test_numpy_arrays_by_content_whatever_their_size():
    # issue 24: no size cut-off that silently falls back to identity
    for n in (3, 100_000):
        arr = np.ones(n)
        f = (lambda a: (lambda x: x * a))(arr)  # reads arr through its closure
        before = key(f)
        arr[-1] = 5.0  # in place
        assert key(f) != before, n


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


# ------------------------------------------------ the guard: the same key, by identities
def test_the_guard_agrees_with_the_key_it_stands_for():
    """Every change the key sees, the guard sees (and the guard passes while nothing changed)."""
    global OFFSET
    from abstractdiff._captures import capture_guard

    small = np.ones(3)
    scale = 2.0

    def f(x):
        return helper(x) * scale + small.sum() + ACTS[0](x)

    guard = capture_guard(f)
    assert guard is not None and guard.unchanged(f) and guard.unchanged(f)
    changes = [
        lambda: globals().__setitem__("OFFSET", 2.0),  # read by a helper it follows
        lambda: small.__setitem__(0, 5.0),  # a small numpy array, in place
        lambda: globals().__setitem__("ACTS", (helper,)),  # a tuple replaced
    ]
    try:
        for change in changes:
            before = key(f)
            change()
            assert key(f) != before
            assert not guard.unchanged(f)
            guard = capture_guard(f)
            assert guard.unchanged(f)
        scale = 3.0  # a closure cell
        assert not guard.unchanged(f)
    finally:
        OFFSET = 1.0
        globals()["ACTS"] = (act,)


def test_the_guard_sees_a_new_global_and_a_new_code():
    from abstractdiff._captures import capture_guard

    f = lambda x: x * UNDEFINED_YET  # noqa: E731, F821
    guard = capture_guard(f)
    globals()["UNDEFINED_YET"] = 2.0  # a name the code reads, absent when the guard was built
    try:
        assert not guard.unchanged(f)
    finally:
        del globals()["UNDEFINED_YET"]
    assert guard.unchanged(f)
    g = lambda x: x  # noqa: E731
    guard = capture_guard(g)
    g.__code__ = (lambda x: x * OFFSET).__code__
    assert not guard.unchanged(g)


def test_the_guard_goes_stale_when_an_object_it_names_dies_and_keeps_nothing_alive():
    from abstractdiff._captures import capture_guard

    class Weights:
        v = 2.0

    def make(weights):
        return lambda x: x * weights.v

    f = make(Weights())
    guard = capture_guard(f)
    assert guard.unchanged(f)
    f.__closure__[0].cell_contents = None  # the Weights object dies: its id may be reused
    gc.collect()
    assert guard.stale and not guard.unchanged(f)


def test_no_guard_where_identities_cannot_vouch_for_the_key():
    from abstractdiff._captures import capture_guard

    def scaled(x, scale):
        return x * scale

    assert capture_guard(functools.partial(scaled, scale=2.0)) is None  # not a plain function

    def late():
        f = lambda x: x * later  # noqa: E731
        guard = capture_guard(f)  # an empty cell: filled later
        later = 1.0  # noqa: F841
        return guard

    assert late() is None


# ------------------------------------------------ the hot call of unprepared operators
def tracing_fd():
    b = type(ad.backend("finite_differences"))()  # its own, empty plan cache
    b.__dict__["reuses_traces"] = True  # exercise the tracing path (guards) on a numpy backend
    return b


def squared_helper(x):
    return (uses_helper(x) ** 2).sum()


def test_unprepared_calls_see_every_change_through_the_hot_call(monkeypatch):
    global OFFSET
    b = tracing_fd()
    flattened = []
    original = type(b).flatten
    monkeypatch.setattr(type(b), "flatten", lambda self, *a: flattened.append(1) or original(self, *a))
    x = np.array([1.0, 2.0])
    scale = 1.0

    def closure(x):
        return scale * (x**2).sum()

    try:
        for offset in (1.0, 2.0, 2.0, -0.0, 0.0):
            OFFSET = scale = offset
            for call in range(3):
                before = len(flattened)
                y, g = ad.value_and_gradient(b, squared_helper, x)  # a global read by a helper
                np.testing.assert_allclose(g, 8 * (x + offset), rtol=1e-6)
                np.testing.assert_allclose(ad.gradient(b, closure, x), 2 * offset * x, rtol=1e-6, atol=1e-9)
                if call:  # the same values: the hot call, no flattening
                    assert len(flattened) == before
    finally:
        OFFSET = 1.0


def test_the_hot_call_takes_any_shape_and_leaves_other_forms_to_the_plan_cache():
    b = type(ad.backend("finite_differences"))()

    def f(t, s):
        x = t["a"] if isinstance(t, dict) else t
        return (x**2).sum() * math.copysign(1.0, s)

    calls = [(np.ones(2), 1.0), (np.ones(2), 1.0), (np.ones(5), 1.0), (np.ones(5), -0.0), (np.ones(5), 0.0),
             (np.ones(3, np.float32), 2.0), ({"a": np.ones(2)}, 1.0), (np.ones(2), 3)]
    for x, s in calls + calls[::-1]:  # each form twice in a row, then alternating
        for _ in range(2):
            g = ad.gradient(b, f, x, s)
            x_, g_ = (x["a"], g["a"]) if isinstance(x, dict) else (x, g)
            np.testing.assert_allclose(g_, 2 * x_ * math.copysign(1.0, s), rtol=1e-3)  # -0.0 is not 0.0
            assert g_.dtype == x_.dtype


def test_hot_calls_leave_with_their_function_and_bound_methods_make_none():
    b = tracing_fd()
    f = lambda x: (x**2).sum()  # noqa: E731
    for _ in range(3):
        ad.gradient(b, f, np.ones(2))
    assert len(b._plans.hot_calls) == 1
    del f
    gc.collect()
    assert not b._plans.hot_calls

    class Model:
        def loss(self, x):
            return (x**2).sum()

    m = Model()
    for _ in range(3):
        ad.gradient(b, m.loss, np.ones(2))
    assert not b._plans.hot_calls


def test_attribute_names_are_not_globals():
    f = lambda x: np.linalg.norm(x)  # noqa: E731  reads the global np only
    before = key(f)
    globals()["norm"] = 1.0  # a global named like an attribute f reads: not f's business
    try:
        assert key(f) == before
    finally:
        del globals()["norm"]


def test_a_function_no_guard_vouches_for_takes_the_plan_cache_on_each_call():
    b = tracing_fd()

    def make():
        def f(x):
            return (x**2).sum() * (later if x.size > 5 else 1.0)

        for _ in range(3):  # `later` is an empty cell: no guard, the plan cache on each call
            np.testing.assert_allclose(ad.gradient(b, f, np.ones(2)), [2.0, 2.0], rtol=1e-6)
        later = 3.0
        np.testing.assert_allclose(ad.gradient(b, f, np.ones(6)), np.full(6, 6.0), rtol=1e-6)
        return f

    f = make()
    ((guard, call, _),) = b._plans.hot_calls.values()
    assert guard is None and call is None
    np.testing.assert_allclose(ad.gradient(b, f, np.ones(6)), np.full(6, 6.0), rtol=1e-6)

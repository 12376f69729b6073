"""Pytree inputs: containers, static leaves, unconnected leaves, data passed as args."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import optree
import pytest

import abstractdiff as ad

RTOL = 1e-9  # first-order finite differences in float64 are accurate to ~1e-12

Pair = namedtuple("Pair", ["left", "right"])

A = np.array([0.5, -1.5, 2.0])
B = np.array([[1.0, -0.3], [0.2, 0.7]])
C = np.asarray(1.25)


def close(actual, expected, rtol=RTOL):
    expected = np.asarray(expected, dtype=np.float64)
    assert isinstance(actual, np.ndarray)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * float(np.max(np.abs(expected), initial=0)))


def weighted_square_sum(tree):
    # Each float leaf i contributes (i + 1) * sum(leaf**2): gradient 2 (i + 1) leaf.
    leaves = optree.tree_leaves(tree)
    return sum((i + 1) * np.sum(leaf**2) for i, leaf in enumerate(leaves))


TREES = {
    "dict": lambda: {"a": A.copy(), "b": B.copy()},
    "list": lambda: [A.copy(), B.copy(), C.copy()],
    "tuple": lambda: (A.copy(), C.copy()),
    "namedtuple": lambda: Pair(A.copy(), B.copy()),
    "nested": lambda: {"layer": [Pair(A.copy(), {"w": B.copy()}), (C.copy(),)], "z": A.copy() * 2},
}


@pytest.mark.parametrize("kind", list(TREES))
def test_gradient_keeps_the_structure(fd, kind):
    x = TREES[kind]()
    g = ad.gradient(fd, weighted_square_sum, x)
    assert optree.tree_structure(g) == optree.tree_structure(x)
    for i, (gi, xi) in enumerate(zip(optree.tree_leaves(g), optree.tree_leaves(x))):
        close(gi, 2 * (i + 1) * xi)
    if kind == "namedtuple":
        assert type(g) is Pair


@pytest.mark.parametrize("kind", list(TREES))
def test_jacobian_hvp_pullback_pushforward_on_trees(fd, kind):
    x = TREES[kind]()
    leaves = optree.tree_leaves(x)
    v = optree.tree_map(lambda a: np.ones_like(a) * 0.5, x)
    hv = ad.hvp(fd, weighted_square_sum, x, v)
    assert optree.tree_structure(hv) == optree.tree_structure(x)
    for i, h in enumerate(optree.tree_leaves(hv)):
        close(h, np.full(leaves[i].shape, 2 * (i + 1) * 0.5), rtol=1e-6)

    def stacked(t):  # y = (sum of leaf 0, sum of squares of the last leaf)
        ls = optree.tree_leaves(t)
        return np.stack([np.sum(ls[0]), np.sum(ls[-1] ** 2)])

    jac = ad.jacobian(fd, stacked, x)
    assert optree.tree_structure(jac) == optree.tree_structure(x)
    jl = optree.tree_leaves(jac)
    for i, (j, leaf) in enumerate(zip(jl, leaves)):
        assert j.shape == (2,) + leaf.shape
        expected = np.zeros((2,) + leaf.shape)
        if i == 0:
            expected[0] = 1.0
        if i == len(leaves) - 1:
            expected[1] = 2 * leaf
        close(j, expected)

    dy = np.array([2.0, -1.0])
    dx = ad.pullback(fd, stacked, x)(dy)
    for j, d in zip(jl, optree.tree_leaves(dx)):
        close(d, np.tensordot(dy, j, axes=1))
    jvp = ad.pushforward(fd, stacked, x)
    close(jvp(v), sum(np.tensordot(j, t, axes=t.ndim) for j, t in zip(jl, optree.tree_leaves(v))))


def test_none_leaves_stay_none(fd):
    x = {"w": A.copy(), "skip": None, "more": [None, C.copy()]}
    g = ad.gradient(fd, lambda t: np.sum(t["w"] ** 2) + t["more"][1] * 3, x)
    assert g["skip"] is None and g["more"][0] is None
    assert optree.tree_structure(g) == optree.tree_structure(x)
    close(g["w"], 2 * A)
    close(g["more"][1], 3.0)


def test_static_leaves_get_none(fd):
    x = {
        "w": A.copy(),
        "n": 3,
        "flag": True,
        "name": "scale",
        "idx": np.array([2, 0]),
        "mask": np.array([True, False, True]),
    }

    def f(t):
        assert t["name"] == "scale" and t["flag"] is True
        return t["n"] * np.sum(t["w"][t["idx"]] ** 2) + np.sum(t["w"][t["mask"]])

    g = ad.gradient(fd, f, x)
    for key in ("n", "flag", "name", "idx", "mask"):
        assert g[key] is None, key
    close(g["w"], np.array([2 * 3 * A[0] + 1, 0.0, 2 * 3 * A[2] + 1]))


def test_integer_array_leaf_is_passed_unchanged(fd):
    idx = np.array([1, 2], dtype=np.int32)
    seen = []

    def f(t):
        seen.append(t["idx"])
        return np.sum(t["w"][t["idx"]])

    g = ad.gradient(fd, f, {"w": A.copy(), "idx": idx})
    assert all(s.dtype == np.int32 and np.array_equal(s, idx) for s in seen)
    close(g["w"], [0.0, 1.0, 1.0])


def test_python_float_leaves_are_differentiated(fd):
    x = {"a": 1.5, "b": [2.0, A.copy()]}
    g = ad.gradient(fd, lambda t: t["a"] ** 3 * t["b"][0] + np.sum(t["b"][1]) * t["a"], x)
    close(g["a"], 3 * 1.5**2 * 2.0 + np.sum(A))
    close(g["b"][0], 1.5**3)
    close(g["b"][1], np.full(3, 1.5))
    assert g["a"].dtype == np.float64


def test_python_float_x(fd):
    g = ad.gradient(fd, lambda t: t**2, 3.0)
    close(g, 6.0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_unconnected_float_leaves_get_exact_zeros(fd, dtype):
    x = {"used": A.astype(dtype), "unused": B.astype(dtype), "unused_scalar": 2.0}
    g = ad.gradient(fd, lambda t: np.sum(t["used"] ** 2), x)
    assert isinstance(g["unused"], np.ndarray) and g["unused"].dtype == dtype
    assert np.array_equal(g["unused"], np.zeros_like(B)), g["unused"]  # exact, not rounding noise
    assert np.asarray(g["unused_scalar"]) == 0.0
    assert g["used"].dtype == dtype
    # Also through the pullback and the jacobian.
    dx = ad.pullback(fd, lambda t: t["used"] * 2, x)(np.ones(3, dtype=dtype))
    assert np.array_equal(dx["unused"], np.zeros_like(B))
    jac = ad.jacobian(fd, lambda t: t["used"] * 2, x)
    assert jac["unused"].shape == (3, 2, 2) and np.array_equal(jac["unused"], np.zeros((3, 2, 2)))


def test_mixed_dtypes_each_leaf_keeps_its_dtype(fd):
    x = {"d": A.copy(), "s": B.astype(np.float32)}
    g = ad.gradient(fd, lambda t: np.sum(t["d"] ** 2) + np.sum(t["s"] ** 2), x)
    assert g["d"].dtype == np.float64 and g["s"].dtype == np.float32
    close(g["d"], 2 * A)
    np.testing.assert_allclose(g["s"], 2 * B, rtol=1e-4, atol=1e-4 * 2)


def test_args_are_data_not_differentiated(fd):
    weights = np.array([1.0, 2.0, 3.0])
    calls = []

    def f(x, w, scale, options, label):
        calls.append((w, scale, label))
        return scale * np.sum(w * x**2) + options["shift"] * np.sum(x)

    g = ad.gradient(fd, f, A.copy(), weights, 0.5, {"shift": np.asarray(4.0)}, "name")
    assert isinstance(g, np.ndarray) and g.shape == A.shape  # args add nothing to the gradient
    close(g, 0.5 * 2 * weights * A + 4.0)
    # args reach f exactly: no perturbation of array data, Python scalars stay Python scalars.
    for w, scale, label in calls:
        assert np.array_equal(w, weights)
        assert type(scale) is float and scale == 0.5 and label == "name"


def test_args_with_every_operator(fd):
    w = np.array([2.0, -1.0, 0.5])
    f = lambda x, w, k: k * np.sum(w * x**3)  # noqa: E731
    y, g = ad.value_and_gradient(fd, f, A.copy(), w, 2)
    close(np.asarray(y), 2 * np.sum(w * A**3))
    close(g, 6 * w * A**2)
    close(ad.hessian(fd, f, A.copy(), w, 2), np.diag(12 * w * A), rtol=1e-6)
    close(ad.hvp(fd, f, A.copy(), np.ones(3), w, 2), 12 * w * A, rtol=1e-6)
    vec = lambda x, w: w * x**2  # noqa: E731
    close(ad.jacobian(fd, vec, A.copy(), w), np.diag(2 * w * A))
    close(ad.pullback(fd, vec, A.copy(), w)(np.ones(3)), 2 * w * A)
    close(ad.pushforward(fd, vec, A.copy(), w)(np.ones(3)), 2 * w * A)
    close(ad.derivative(fd, lambda t, w: w * t**2, np.asarray(1.5), w), 3 * w)


def test_tangent_tree_with_none_at_static_leaves(fd):
    # The gradient of a tree with static leaves (None there) is a valid tangent / hvp vector.
    x = {"w": A.copy(), "n": 3}
    f = lambda t: np.sum(t["w"] ** 3) * t["n"]  # noqa: E731
    g = ad.gradient(fd, f, x)
    assert g["n"] is None
    hv = ad.hvp(fd, f, x, g)
    close(hv["w"], 6 * 3 * A * g["w"], rtol=1e-6)
    assert hv["n"] is None
    close(ad.pushforward(fd, f, x)({"w": np.ones(3), "n": None}), np.sum(3 * A**2) * 3)


def test_has_aux_with_tree_input_and_aux(fd):
    x = Pair(A.copy(), C.copy())

    def f(t):
        y = np.sum(t.left**2) * t.right
        return y, {"y_twice": 2 * y, "leaves": len(t)}

    (y, aux), g = ad.value_and_gradient(fd, f, x, has_aux=True)
    close(np.asarray(y), np.sum(A**2) * C)
    close(np.asarray(aux["y_twice"]), 2 * np.sum(A**2) * C)
    assert aux["leaves"] == 2
    assert type(g) is Pair
    close(g.left, 2 * A * C)
    close(g.right, np.sum(A**2))


def test_second_order_with_scalar_leaves(fd):
    # Regression: 0-d leaves used to get a zero hvp (the nested stencil edited a copy).
    f = lambda t: t[0] ** 2 * t[1] ** 2  # noqa: E731
    x = [np.asarray(1.0), np.asarray(2.0)]
    hv = ad.hvp(fd, f, x, [np.asarray(1.0), np.asarray(0.0)])  # H = [[8, 8], [8, 2]] at (1, 2)
    close(hv[0], 8.0, rtol=1e-6)
    close(hv[1], 8.0, rtol=1e-6)
    close(ad.hvp(fd, lambda t: t**3, 2.0, 1.0), 12.0, rtol=1e-6)
    close(ad.hvp(fd, lambda t: t**3, np.asarray(2.0, dtype=np.float32), 1.0).astype(np.float64), 12.0, rtol=2e-3)
    close(ad.hessian(fd, lambda t: t**3, 2.0), 12.0, rtol=1e-6)

"""Prepared operators: same numbers as the unprepared ones, and every mismatch refused."""

from __future__ import annotations

import gc
from collections import namedtuple

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad

FD = "finite_differences"
Pair = namedtuple("Pair", "w b")


def loss(p, inputs, scale):
    residual = anp.sum(inputs * p.w, axis=1) + p.b  # autoray: runs on every backend's arrays
    return scale * anp.sum(residual**2)


def make(dtype=np.float64):
    rng = np.random.default_rng(0)
    p = Pair(rng.normal(size=3).astype(dtype), np.asarray(0.5, dtype=dtype))
    return p, rng.normal(size=(4, 3)).astype(dtype)


def test_prepared_value_and_gradient_matches_unprepared():
    p, inputs = make()
    vg = ad.prepare_value_and_gradient(FD, loss, p, inputs, 2.0)
    y, g = vg(p, inputs, 2.0)
    y0, g0 = ad.value_and_gradient(FD, loss, p, inputs, 2.0)
    assert float(y) == pytest.approx(float(y0), rel=1e-12)
    np.testing.assert_allclose(g.w, g0.w, rtol=1e-12)
    assert isinstance(g, Pair)
    # analytic: 2 * scale * inputs^T r, r = inputs w + b
    r = inputs @ p.w + p.b
    np.testing.assert_allclose(g.w, 4.0 * inputs.T @ r, rtol=1e-8)
    np.testing.assert_allclose(g.b, 4.0 * r.sum(), rtol=1e-8)


def test_prepared_gradient_and_aux():
    p, inputs = make()

    def with_aux(p, inputs):
        return loss(p, inputs, 1.0), {"n": inputs.shape[0]}

    grad = ad.prepare_gradient(FD, with_aux, p, inputs, has_aux=True)
    g, aux = grad(p, inputs)
    assert aux == {"n": 4}
    np.testing.assert_allclose(g.w, ad.gradient(FD, loss, p, inputs, 1.0).w, rtol=1e-12)
    (y, aux), g2 = ad.prepare_value_and_gradient(FD, with_aux, p, inputs, has_aux=True)(p, inputs)
    assert aux == {"n": 4} and np.shape(y) == ()


def test_prepared_pullback():
    x = np.array([1.0, 2.0, 3.0])
    pb = ad.prepare_pullback(FD, lambda x, a: a * x**2, x, np.array([1.0, 10.0, 100.0]))
    y, vjp = pb(x, np.array([1.0, 10.0, 100.0]))
    np.testing.assert_allclose(vjp(np.ones(3)), [2.0, 40.0, 600.0], rtol=1e-9)
    with pytest.raises(ad.ShapeMismatchError):
        vjp(np.ones(2))


def test_new_values_same_shapes_are_accepted():
    p, inputs = make()
    vg = ad.prepare_value_and_gradient(FD, loss, p, inputs, 2.0)
    p2 = Pair(p.w + 1.0, p.b * 3)
    _, g = vg(p2, inputs * 2, 2.0)
    np.testing.assert_allclose(g.w, ad.gradient(FD, loss, p2, inputs * 2, 2.0).w, rtol=1e-12)


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda p, i: ((Pair(np.ones(4), p.b), i, 2.0)), "x leaf 0 of shape/dtype"),
        (lambda p, i: ((Pair(p.w.astype(np.float32), p.b), i, 2.0)), "float32"),
        (lambda p, i: ((p, i[:2], 2.0)), "argument leaf 0 of shape/dtype"),
        (lambda p, i: ((p, i.astype(np.float32), 2.0)), "argument leaf 0"),
        (lambda p, i: ((p, i, 3.0)), "static argument leaf 1"),
        (lambda p, i: (({"w": p.w, "b": p.b}, i, 2.0)), "x of structure"),
        (lambda p, i: ((p, i, 2.0, 1.0)), "args of structure"),
    ],
)
def test_mismatch_is_refused_with_a_clear_error(change, fragment):
    p, inputs = make()
    vg = ad.prepare_value_and_gradient(FD, loss, p, inputs, 2.0)
    with pytest.raises(ad.ShapeMismatchError, match="prepare again") as err:
        vg(*change(p, inputs))
    assert isinstance(err.value, ValueError)
    assert fragment in str(err.value)


def test_prepared_operator_keeps_a_lambda_alive():
    x = np.array([1.0, 2.0])
    grad = ad.prepare_gradient(FD, lambda x: (x**3).sum(), x)
    gc.collect()
    np.testing.assert_allclose(grad(x), 3 * x**2, rtol=1e-9)


def test_prepared_input_is_not_mutated():
    p, inputs = make()
    before = (p.w.copy(), p.b.copy(), inputs.copy())
    ad.prepare_value_and_gradient(FD, loss, p, inputs, 2.0)(p, inputs, 2.0)
    for a, b in zip(before, (p.w, p.b, inputs)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["jax", "torch", "tensorflow", "autograd"])
def test_native_prepared_matches_and_checks(name):
    if name not in ad.available_backends():
        pytest.skip(f"{name} is not installed here")
    b = ad.backend(name)
    p, inputs = make(np.float32)
    vg = ad.prepare_value_and_gradient(b, loss, p, inputs, 2.0)
    y, g = vg(p, inputs, 2.0)  # numpy in: converted as the unprepared call does
    y0, g0 = ad.value_and_gradient(b, loss, p, inputs, 2.0)
    np.testing.assert_allclose(ad.to_numpy(g.w), ad.to_numpy(g0.w), rtol=1e-6)
    assert ad.to_numpy(g.w).dtype == np.float32
    native = Pair(b.asarray(p.w), b.asarray(p.b))
    _, g_native = vg(native, b.asarray(inputs), 2.0)  # native in: no conversion needed
    np.testing.assert_allclose(ad.to_numpy(g_native.w), ad.to_numpy(g0.w), rtol=1e-6)
    with pytest.raises(ad.ShapeMismatchError):
        vg(Pair(p.w.astype(np.float64), p.b), inputs, 2.0)
    with pytest.raises(ad.ShapeMismatchError):
        vg(Pair(b.asarray(np.ones(5, np.float32)), native.b), inputs, 2.0)

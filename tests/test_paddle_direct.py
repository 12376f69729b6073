"""The paddle adapter's direct prepared call (``PaddleAdapter.direct_prepared``): the same
results as the core's checked route, and anything it does not recognise goes there, which
raises the clear error."""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad

paddle = pytest.importorskip("paddle")


@pytest.fixture(scope="module")
def b():
    return ad.backend("paddle")


def f(x, a):
    return paddle.sum(paddle.sin(x) * a + x**2)


def tensors(b, n=5, dtype="float32"):
    return b.asarray(np.linspace(-1, 1, n).astype(dtype)), b.asarray(np.arange(n, dtype=dtype))


def assert_same(out, ref):
    for o, r in zip(out, ref):
        np.testing.assert_allclose(o.numpy(), r.numpy(), rtol=1e-6)
        assert o.dtype == r.dtype and o.stop_gradient


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_direct_agrees_with_the_checked_route(b, dtype):
    x, a = tensors(b, dtype=dtype)
    prepared = ad.prepare_value_and_gradient(b, f, x, a)
    assert prepared._direct is not None
    assert_same(prepared(x, a), prepared.check_and_run(x, a))
    assert_same(ad.value_and_gradient(b, f, x, a), prepared.check_and_run(x, a))
    g = ad.prepare_gradient(b, f, x, a)
    assert_same([g(x, a)], [prepared.check_and_run(x, a)[1]])
    assert x.stop_gradient and a.stop_gradient  # the caller's flags are left alone


def test_direct_refers_what_it_does_not_recognise(b):
    x, a = tensors(b)
    prepared = ad.prepare_value_and_gradient(b, f, x, a)
    with pytest.raises(ad.ShapeMismatchError):
        prepared(x.astype("float64"), a)
    with pytest.raises(ad.ShapeMismatchError):
        prepared(x[:3], a[:3])
    with pytest.raises(ad.ShapeMismatchError):
        prepared(x)
    with paddle.no_grad():  # grad mode is the operator's own
        assert_same(prepared(x, a), prepared.check_and_run(x, a))


def test_direct_checks_the_output(b):
    x, _ = tensors(b)
    assert_same([ad.prepare_gradient(b, lambda x: 3.0, x)(x)], [paddle.zeros_like(x)])  # a constant
    assert_same([ad.prepare_gradient(b, lambda x: paddle.sum(x * x).astype("float64"), x)(x)], [2 * x])
    with pytest.raises(ad.NonScalarOutputError):
        ad.prepare_gradient(b, lambda x: x * x, x)(x)
    with pytest.raises(ad.InvalidOutputError):
        ad.prepare_gradient(b, lambda x: paddle.sum(x).astype("int32"), x)(x)


def test_direct_nested_in_an_outer_derivative(b):
    # x with stop_gradient=False in grad mode is an outer derivative's value: the checked route
    x, a = tensors(b)
    inner = ad.prepare_gradient(b, f, x, a)
    outer = ad.gradient(b, lambda x: paddle.sum(inner(x, a) * x), x)
    reference = ad.gradient(b, lambda x: paddle.sum(ad.gradient(b, f, x, a) * x), x)
    assert_same([outer], [reference])


def test_direct_with_an_operator_nested_in_f(b):
    # the inner operator's leaves are hidden from paddle.grad: the direct call collects them too
    x, _ = tensors(b)
    outer = ad.prepare_gradient(b, lambda x: paddle.sum(ad.gradient(b, lambda z: paddle.sum(z**3), x)), x)
    assert_same([outer(x)], [6 * x])


def test_a_pytree_takes_the_core_route(b):
    x, a = tensors(b)
    tree = {"u": x, "v": (a, x[:2])}

    def g(t, a):  # t["v"][0] unused: its gradient is zeros
        return paddle.sum(t["u"] * a) + paddle.sum(t["v"][1] ** 2)

    prepared = ad.prepare_value_and_gradient(b, g, tree, a)
    assert prepared._direct is None
    y, grads = prepared(tree, a)
    np.testing.assert_allclose(y.numpy(), g(tree, a).numpy(), rtol=1e-6)
    for got, ref in zip([grads["u"], *grads["v"]], [a, paddle.zeros_like(a), 2 * x[:2]]):
        assert_same([got], [ref])


def test_direct_from_several_threads(b):
    # the frames of nested operators are per thread; paddle.grad runs under the adapter's lock
    from concurrent.futures import ThreadPoolExecutor

    x, a = tensors(b)
    prepared = ad.prepare_value_and_gradient(b, f, x, a)
    reference = prepared.check_and_run(x, a)
    with ThreadPoolExecutor(4) as pool:
        for out in pool.map(lambda _: prepared(x, a), range(32)):
            assert_same(out, reference)

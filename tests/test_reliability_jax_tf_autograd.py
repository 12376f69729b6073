"""Never silently wrong, round 3 (issue 24): the jax, TensorFlow and autograd adapters.

Each test fails on the version before the fix:

* item 7, a jax prepared operator refused the numpy int64 data it was prepared with: the
  signature held the converted leaf (int32, jax without x64) and the call gave int64;
* item 10, jax kept a jaxpr per new function in its global caches (a linearisation or a
  pullback returned from one jit and passed into another), so building a ``Batch``
  pushforward or pullback, or an ``ad.Sparse`` Jacobian or Hessian, for a new function per
  call grew memory without bound (up to jax's cache sizes);
* item 11, TensorFlow on a pytree of float32 and float64 leaves whose ``f`` mixes them
  gave TensorFlow's ``Input 'y' of 'Mul' Op has type float64 ...``; autograd on a
  zero-size ``x`` gave ``need at least one array to stack`` for the Hessian.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad

TOL = {np.float32: 1e-5, np.float64: 1e-12}


def _close(got, want, dtype) -> None:
    got = np.asarray(ad.to_numpy(got))
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])


# ------------------------------------------------------------------ item 7: jax int64 data
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_jax_prepared_operator_accepts_the_int64_data_it_was_prepared_with(dtype):
    jnp = pytest.importorskip("jax.numpy")
    x = np.array([0.5, 1.5, 2.5], dtype=dtype)
    idx = np.array([2, 0, 2])  # int64, which jax without x64 converts to int32

    def f(x, idx):
        return anp.sum(anp.take(x, idx, axis=0) ** 2)

    want = np.array([2 * x[0], 0.0, 4 * x[2]])  # d/dx of x2^2 + x0^2 + x2^2
    g = ad.prepare_gradient("jax", f, x, idx)
    for data in (idx, idx.copy(), jnp.asarray(idx)):  # the caller's int64, and jax's own int32
        _close(g(x, data), want, dtype)
    with pytest.raises(ad.ShapeMismatchError, match="float"):  # another float dtype is still refused
        g(x.astype(np.float16), idx)
    jac = ad.prepare_jacobian("jax", lambda x, idx: anp.take(x, idx, axis=0) * 3.0, x, idx)
    _close(jac(x, idx), 3.0 * np.eye(3)[idx], dtype)
    tree = {"w": x, "n": np.arange(3)}  # an int64 leaf of x itself
    g = ad.prepare_gradient("jax", lambda p: anp.sum(p["w"] * p["n"]), tree)
    _close(g(tree)["w"], np.arange(3.0), dtype)


# --------------------------------------------------- item 10: jax memory per new function
def _live_jaxprs() -> int:
    from jax.extend.core import Jaxpr

    gc.collect()
    return sum(type(o) is Jaxpr for o in gc.get_objects())


def _batch_calls(kind: str):
    """One call of ``kind`` for a new function ``sin(x) * c``, and its analytic result."""
    x = np.linspace(0.1, 1.0, 4)
    e = np.eye(4)

    def call(c: float):
        def f(x):
            return anp.sin(x) * c

        if kind == "batched pushforward":
            return ad.pushforward("jax", f, x)(ad.Batch(e[0], e[1])).stack(), c * np.cos(x) * e[:2]
        if kind == "batched pullback":
            return ad.pullback("jax", f, x)(ad.Batch(e[0], e[2])).stack(), c * np.cos(x) * e[[0, 2]]
        if kind == "pullback":
            return ad.pullback("jax", f, x)(e[1]), c * np.cos(x) * e[1]
        if kind == "sparse jacobian":
            return ad.jacobian(ad.Sparse("jax"), f, x).toarray(), c * np.diag(np.cos(x))
        return ad.hessian(ad.Sparse("jax"), lambda x: anp.sum(f(x)), x).toarray(), -c * np.diag(np.sin(x))

    return call


@pytest.mark.parametrize(
    "kind", ["batched pushforward", "batched pullback", "pullback", "sparse jacobian", "sparse hessian"]
)
def test_jax_new_function_per_call_leaves_no_jaxpr_behind(kind):
    # jax keeps its global caches bounded by entry count (thousands), not by bytes: before
    # the fix each call left one jaxpr of the user's function there (four for a sparse
    # Hessian).  Counting live jaxprs is deterministic where RSS is not.
    pytest.importorskip("jax")
    call = _batch_calls(kind)
    for c in (1.0, 2.0):  # warm: the adapter's own one-off traces
        call(c)
    before = _live_jaxprs()
    for i in range(4):  # a leak is one jaxpr a call: 4 > the 1 allowed
        got, want = call(3.0 + i)
        _close(got, want, np.float64)
    assert _live_jaxprs() - before <= 1


def test_jax_batched_closures_reuse_their_compiled_code():
    # the closure's tree is set aside at trace time: a reused function traces once
    pytest.importorskip("jax")
    b = ad.backend("jax")
    x = np.linspace(0.1, 1.0, 3, dtype=np.float32)
    e = np.eye(3, dtype=np.float32)

    def f(x, w):
        return anp.sin(x) * w

    for w in (np.float32(2.0), np.float32(3.0)):
        jvps = ad.pushforward(b, f, x, w)(ad.Batch(e[0], e[1])).stack()
        vjps = ad.pullback(b, f, x, w)(ad.Batch(e[1], e[2])).stack()
        _close(jvps, w * np.cos(x) * e[:2], np.float32)
        _close(vjps, w * np.cos(x) * e[1:], np.float32)
        if w == 2.0:
            traced = b.trace_count
    assert b.trace_count == traced  # new data of the same shapes: no retrace


# ------------------------------------------ item 11: TensorFlow pytrees of two float dtypes
@pytest.mark.parametrize("compile", [True, False])
def test_tensorflow_mixed_float_leaves(compile):
    tf = pytest.importorskip("tensorflow")
    b = ad.backend("tensorflow", compile=compile)
    x = {"a": np.array([1.0, 2.0], dtype=np.float32), "b": np.array([0.5, 1.5, 2.5])}

    # f consistent in itself (it casts where the leaves meet): each leaf keeps its dtype
    def cast(p):
        return anp.sum(tf.cast(p["a"], tf.float64) ** 2) + anp.sum(p["b"] ** 3)

    g = ad.gradient(b, cast, x)
    _close(g["a"], 2 * x["a"], np.float32)
    _close(g["b"], 3 * x["b"] ** 2, np.float64)

    # f mixing them: our error, naming each leaf's dtype and the fix
    def mixed(p):
        return anp.sum(p["a"] * anp.sum(p["b"]))

    for call in (
        lambda: ad.gradient(b, mixed, x),
        lambda: ad.jacobian(b, lambda p: p["a"] * anp.sum(p["b"]), x),
        lambda: ad.pullback(b, mixed, x)(np.float32(1.0)),
        lambda: ad.prepare_gradient(b, mixed, x)(x),
    ):
        with pytest.raises(ad.ArgumentTypeError, match=r"x\['a'\]: float32, x\['b'\]: float64") as info:
            call()
        assert "tf.cast" in str(info.value) and "does not promote" in str(info.value)


def test_tensorflow_gradient_of_a_gather_is_a_dense_tensor():
    # tf.gather's gradient is IndexedSlices: it came back as the gradient itself (an object
    # array to ad.to_numpy), and hvp raised a raw AttributeError
    tf = pytest.importorskip("tensorflow")
    x, idx = np.array([1.0, 2.0, 3.0]), np.array([0, 0, 2])

    def f(x, idx):
        return anp.sum(anp.take(x, idx, axis=0) ** 2)

    grad, hess = np.array([4.0, 0.0, 6.0]), np.diag([4.0, 0.0, 2.0])
    v = np.array([1.0, 2.0, 3.0])
    for compile in (True, False):
        b = ad.backend("tensorflow", compile=compile)
        results = [
            (ad.gradient(b, f, x, idx), grad),
            (ad.value_and_gradient(b, f, x, idx)[1], grad),
            (ad.prepare_gradient(b, f, x, idx)(x, idx), grad),
            (ad.pullback(b, lambda x, idx: anp.take(x, idx, axis=0) ** 2, x, idx)(np.ones(3)), grad),
            (ad.hvp(b, f, x, v, idx), hess @ v),
            (ad.gradient_and_hvp(b, f, x, v, idx)[1], hess @ v),
            (ad.value_gradient_and_hessian(b, f, x, idx)[1], grad),
        ]
        for got, want in results:
            assert isinstance(got, tf.Tensor)
            _close(got, want, np.float64)


# --------------------------------------------------- items 11 and 5: zero-size x, empty derivative
@pytest.mark.parametrize("name", ["autograd", "jax", "tensorflow"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_size_x_has_an_empty_derivative(name, dtype):
    pytest.importorskip(name)
    x = np.zeros((0,), dtype=dtype)

    def scalar(x):
        return anp.sum(x**2) + 1.0

    _close(ad.gradient(name, scalar, x), np.zeros(0), dtype)
    _close(ad.jacobian(name, anp.sin, x), np.zeros((0, 0)), dtype)
    _close(ad.hessian(name, scalar, x), np.zeros((0, 0)), dtype)
    _close(ad.prepare_hessian(name, scalar, x)(x), np.zeros((0, 0)), dtype)
    y, g, h = ad.value_gradient_and_hessian(name, scalar, x)
    _close(y, 1.0, dtype)  # the value is still f(x)
    _close(g, np.zeros(0), dtype)
    _close(h, np.zeros((0, 0)), dtype)
    with pytest.raises(ad.NonScalarOutputError):  # f still runs, and its output is checked
        ad.hessian(name, anp.sin, x)
    # an empty leaf next to a full one: its blocks are empty, the other's are right
    tree = {"e": x, "w": np.array([1.0, 2.0], dtype=dtype)}
    h = ad.hessian(name, lambda p: anp.sum(p["e"] ** 3) + anp.sum(p["w"] ** 3), tree)
    _close(h["w"]["w"], np.diag(6 * tree["w"]), dtype)
    _close(h["e"]["e"], np.zeros((0, 0)), dtype)
    _close(h["e"]["w"], np.zeros((0, 2)), dtype)


# ------------------------- jax: a numpy array closed over in one x64 mode, converted in the other
def _shifted_product_jacobian(x, idx):
    """The exact Jacobian of ``x[1:] * x[idx]``."""
    jac = np.zeros((x.size - 1, x.size))
    rows = np.arange(x.size - 1)
    np.add.at(jac, (rows, rows + 1), x[idx])
    np.add.at(jac, (rows, idx), x[1:])
    return jac


@pytest.mark.parametrize("int_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("order", ["captured first", "argument first"])
@pytest.mark.parametrize("operator", ["jacobian", "prepare_jacobian", "gradient", "hessian"])
def test_jax_array_captured_in_x64_then_passed_as_data(operator, order, int_dtype):
    # jax keeps what it canonicalised a numpy array to per array object, not per x64 mode:
    # idx closed over by a float64 (x64) trace, then converted as an argument (outside x64,
    # as int32) became an int32 array over an int64 buffer, which the compiled call refused
    pytest.importorskip("jax")
    x = np.random.default_rng(0).normal(size=40)
    idx = np.arange(39).astype(int_dtype)[::-1].copy()
    jac = _shifted_product_jacobian(x, idx)
    hess = np.zeros((40, 40))
    np.add.at(hess, (np.arange(1, 40), idx), 1.0)
    hess = hess + hess.T
    captured_f = lambda x: x[1:] * x[idx]  # noqa: E731
    argument_f = lambda x, i: x[1:] * x[i]  # noqa: E731

    def run(f, *args):
        if operator == "jacobian":
            return ad.jacobian("jax", f, x, *args), jac
        if operator == "prepare_jacobian":
            return ad.prepare_jacobian("jax", f, x, *args)(x, *args), jac
        total = lambda x, *a: anp.sum(f(x, *a))  # noqa: E731
        if operator == "gradient":
            return ad.gradient("jax", total, x, *args), jac.sum(axis=0)
        return ad.hessian("jax", total, x, *args), hess

    calls = [(captured_f,), (argument_f, idx)]
    for f_and_args in calls if order == "captured first" else calls[::-1]:
        got, want = run(*f_and_args)
        assert np.asarray(got).dtype == np.float64
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


def test_jax_float64_array_captured_by_a_float32_trace_then_differentiated():
    # the float side of the same jax cache: w seen by a float32 trace (outside x64), then
    # converted as a float64 x inside the x64 scope, became float64 over a float32 buffer
    pytest.importorskip("jax")
    rng = np.random.default_rng(1)
    w = rng.normal(size=30)
    x32 = rng.normal(size=30).astype(np.float32)
    np.testing.assert_allclose(ad.gradient("jax", lambda x: anp.sum(x * w.astype(np.float32)), x32),
                               w.astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(ad.gradient("jax", lambda x: anp.sum(x * w), x32), w.astype(np.float32), rtol=1e-6)
    g = ad.gradient("jax", lambda x: anp.sum(x**3), w)
    assert g.dtype == np.float64
    np.testing.assert_allclose(g, 3 * w**2, rtol=1e-12)
    # jax keeps its float32 conversion of w while the float32 trace above is alive, until the
    # cyclic collector frees it (its lambda is gone): collected here, so that this does not
    # depend on the tests before it; while it is alive, a clear ArgumentTypeError
    # (tests/test_jax_captured_constants_x64.py)
    gc.collect()
    np.testing.assert_allclose(ad.jacobian("jax", lambda x: x * w, w), np.diag(w), rtol=1e-12)

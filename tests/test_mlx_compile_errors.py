"""mx.compile's own failures under ``ad.backend("mlx", compile=True)``: MLX 0.32's compiler
raises ``IndexError: _Map_base::at`` (C++'s out_of_range, from ``compile_replace``) on some
second derivatives that run right eagerly; the adapter runs those signatures uncompiled instead
of showing the raw error (oracle case ``mlx-hessian-scan_sum_float+scan_sum_float``)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
jax = pytest.importorskip("jax")
pytest.importorskip("autoray")

import abstractdiff as ad  # noqa: E402


def _make(np_, fori):
    """``F(x, d)``: two identical blocks (``v * k``, indexed, through sin) summed in a
    two-step loop.  Through abstractdiff's float64 MLX ``sin`` (an ``mx.custom_function``), the
    compiled second derivative of this graph is one MLX 0.32's compiler fails on."""

    def block(v, d):
        xs = v * d["k"]
        return np_.sin(xs[0]) + np_.sin(xs[1])

    def F(x, d):
        v = fori(0, 2, lambda i, v: 0.5 * (v + (block(v, d) + block(v, d))), x)
        return np_.sum(d["w"] * v)

    return F


def _data():
    return {"k": np.array([1.0, 0.5, -0.75]), "w": np.array(1.25)}


def _jax_hessian(x: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp
    from jax import lax

    with jax.enable_x64(True):
        F = _make(jnp, lax.fori_loop)
        d = {k: jnp.asarray(v) for k, v in _data().items()}
        return np.asarray(jax.hessian(lambda x: F(x, d))(jnp.asarray(x)))


def test_compiled_sparse_hessian_where_mlx_compile_fails_matches_jax():
    from autoray import numpy as anp

    F = _make(anp, ad.fori_loop)
    x = np.array(-0.7)
    b = ad.Sparse(ad.backend("mlx", compile=True), sparsity="dense-probe", mode="auto")
    expected = _jax_hessian(x)
    for _ in range(2):  # the second call finds the failed signature remembered
        h = ad.hessian(b, F, x, _data())
        np.testing.assert_allclose(h.toarray().reshape(()), expected, rtol=1e-10)


def test_compiled_hvp_where_mlx_compile_fails_matches_jax():
    # the same graph as the forward-over-reverse product of ad.hvp with a Sparse pattern
    from autoray import numpy as anp

    F = _make(anp, ad.fori_loop)
    b = ad.Sparse(ad.backend("mlx", compile=True), sparsity="dense-probe", mode="forward")
    for x in (np.array(-0.7), np.array(0.3)):  # a new point: the plan's compiled call again
        h = ad.hessian(b, F, x, _data())
        np.testing.assert_allclose(h.toarray().reshape(()), _jax_hessian(x), rtol=1e-10)


def test_mlx_compile_failure_falls_back_to_the_function_itself():
    # MLX's own failure, without abstractdiff's transforms: the adapter's compile wrapper
    from abstractdiff.adapters.mlx import _CompiledOrEager

    from abstractdiff.portable.mlx import _sin64

    def F(v, k):
        for _ in range(2):
            v = 0.5 * (v + ((_sin64((v * k)[0]) + _sin64((v * k)[1])) + (_sin64((v * k)[0]) + _sin64((v * k)[1]))))
        return v

    def second(x, k):  # d2F/dx2 as a vjp of a vjp (the Sparse Hessian's reverse product)
        g = mx.grad(lambda z: F(z, k))
        return mx.vjp(lambda u, x: mx.vjp(g, [x], [u])[1][0], [mx.zeros_like(x), x], [mx.ones_like(x)])[1][0]

    with mx.stream(mx.cpu):
        x, k = mx.array(-0.7, dtype=mx.float64), mx.array([1.0, 0.5], dtype=mx.float64)
        eager = np.array(second(x, k))
        run = _CompiledOrEager(second)
        assert np.array(run(x, k)) == pytest.approx(eager, rel=1e-12)
        assert np.array(run(x, k)) == pytest.approx(eager, rel=1e-12)
        # another signature is compiled afresh (and right, compiled or not)
        xs, ks = mx.array(-0.7, dtype=mx.float32), mx.array([1.0, 0.5], dtype=mx.float32)
        assert np.array(run(xs, ks)) == pytest.approx(eager, rel=1e-5)


def test_an_index_error_of_f_itself_is_raised_under_compile():
    # the fallback reruns f eagerly: f's own IndexError comes back (not swallowed, not MLX's)
    def f(x):
        return x * [1.0][3]

    b = ad.backend("mlx", compile=True)
    with pytest.raises(IndexError, match="list index out of range"):
        ad.gradient(b, lambda x: (x * f(x)).sum(), np.ones(2))

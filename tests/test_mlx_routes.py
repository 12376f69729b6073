"""The mlx adapter's batched primitives (one mx.vmap per batch) and its fast routes against
the core's derivation from those primitives."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'abstractdiff[mlx]'")

from abstractdiff.adapters.mlx import MLXAdapter  # noqa: E402

import abstractdiff as ad  # noqa: E402
from abstractdiff._backend import AdapterBackend  # noqa: E402


def f(xs: list, data: list) -> tuple:
    a, b = xs
    return mx.concatenate([mx.sin(a) * b.sum(), a * a]), None


def scalar(x, w):
    return (mx.sin(x) * (w @ x)).sum() + (x * x).sum() ** 2


@pytest.mark.parametrize("compile", [False, True])
def test_batched_primitives_agree_with_the_unbatched_ones(compile):
    adapter = ad.backend("mlx", compile=compile).adapter
    xs = [mx.array([0.1, 0.2, 0.3]), mx.array([1.0, -2.0])]
    y, _, vjp = adapter.value_and_pullback(f, xs, [])
    _, _, vjps = adapter.value_and_batched_pullback(f, xs, [])
    dys = mx.array(np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32))
    stacked = vjps(dys)
    for k in range(4):
        for got, want in zip(stacked, vjp(dys[k])):
            np.testing.assert_allclose(np.array(got[k]), np.array(want), rtol=1e-6)
    _, _, jvp = adapter.value_and_pushforward(f, xs, [])
    _, _, jvps = adapter.value_and_batched_pushforward(f, xs, [])
    ts = [mx.ones((4, 3)) * mx.arange(4)[:, None], mx.ones((4, 2))]
    out = jvps(ts)
    assert out.shape == (4, *y.shape)
    for k in range(4):
        np.testing.assert_allclose(np.array(out[k]), np.array(jvp([t[k] for t in ts])), rtol=1e-6)


def test_batched_primitives_of_an_empty_x_are_zeros_of_the_batch():
    adapter = ad.backend("mlx").adapter
    xs = [mx.zeros((0, 2))]
    y, _, vjps = adapter.value_and_batched_pullback(lambda xs, d: (xs[0].sum() + 1.0, None), xs, [])
    assert [g.shape for g in vjps(mx.ones((3,)))] == [(3, 0, 2)]
    _, _, jvps = adapter.value_and_batched_pushforward(lambda xs, d: (xs[0].sum() + 1.0, None), xs, [])
    assert jvps([mx.zeros((3, 0, 2))]).shape == (3,)


@pytest.mark.parametrize("operator", ["jacobian", "hessian", "hvp"])
@pytest.mark.parametrize("n", [1, 10])
def test_fast_routes_agree_with_the_core_derivation(operator, n):
    class CoreOnly(MLXAdapter):
        fast_routes = {k: v for k, v in MLXAdapter.fast_routes.items() if k != operator}

    rng = np.random.default_rng(n)
    x, v = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    w = rng.standard_normal((n, n)).astype(np.float32)
    results = []
    for b in (ad.backend("mlx"), AdapterBackend(CoreOnly)):
        if operator == "jacobian":
            out = ad.jacobian(b, lambda x, w: mx.concatenate([mx.tanh(w @ x), x * x]), x, w)
        elif operator == "hessian":
            out = ad.hessian(b, scalar, x, w)
        else:
            out = ad.hvp(b, scalar, x, v, w)
        results.append(np.array(out))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-5)

"""torch's fast routes after the fold: the Jacobian's per-call run is kept with the flat
function and serves every dtype; the Hessian is the core's and keeps float32."""

import numpy as np
import pytest

import abstractdiff as ad

torch = pytest.importorskip("torch")


def test_per_call_jacobian_serves_each_dtype_of_one_function():
    b = ad.backend("torch")

    def f(x):
        return torch.sin(x) * 0.5 * x

    for dtype in (torch.float32, torch.float64, torch.float32):
        x = torch.linspace(-1.0, 1.0, 4, dtype=dtype)
        y, jac = ad.value_and_jacobian(b, f, x)
        assert y.dtype == jac.dtype == dtype
        want = torch.diag(0.5 * (torch.cos(x) * x + torch.sin(x)))
        torch.testing.assert_close(jac, want)
        torch.testing.assert_close(ad.jacobian(b, f, x), want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_hessian_is_the_cores_and_keeps_the_dtype(dtype):
    b = ad.backend("torch")
    assert not {"hessian", "value_gradient_and_hessian"} & set(b.adapter.fast_routes)
    x = np.linspace(-1.0, 1.0, 5).astype(dtype)

    def f(x):
        return (0.25 * x * x * x).sum()  # a Python float: torch's forward mode would promote

    y, g, h = ad.value_gradient_and_hessian(b, f, x)
    assert y.dtype == g.dtype == h.dtype == getattr(torch, dtype)
    np.testing.assert_allclose(ad.to_numpy(h), np.diag(1.5 * x), rtol=1e-5)
    np.testing.assert_allclose(ad.to_numpy(ad.hessian(b, f, x)), np.diag(1.5 * x), rtol=1e-5)
    np.testing.assert_allclose(ad.to_numpy(g), 0.75 * x * x, rtol=1e-5)

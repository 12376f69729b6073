"""The rest of DifferentiationInterface.jl's operator family: second_derivative,
value_and_derivative, value_derivative_and_second_derivative, value_and_jacobian,
value_gradient_and_hessian, gradient_and_hvp (and their prepared twins), and the block
Hessian of a pytree, against analytic values and against the operators they combine."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import numpy as np
import optree
import pytest
from autoray import numpy as anp

import abstractdiff as ad

BACKENDS = {
    "finite_differences": None,
    "torch": "torch",
    "jax": "jax",
    "autograd": "autograd",
    "tensorflow": "tensorflow",
}


def _backend(name: str) -> ad.Backend:
    module = BACKENDS[name]
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    return ad.backend(name)


@pytest.fixture(params=list(BACKENDS))
def b(request: pytest.FixtureRequest) -> ad.Backend:
    return _backend(request.param)


def rtol(b: ad.Backend, order: int = 1) -> float:
    if b.approximate:
        return 1e-7 if order == 1 else 1e-5
    return 1e-10


def close(got: Any, expected: Any, tol: float) -> None:
    got_leaves, got_def = optree.tree_flatten(ad.to_numpy(got), none_is_leaf=True)
    exp_leaves, exp_def = optree.tree_flatten(ad.to_numpy(expected), none_is_leaf=True)
    assert got_def == exp_def, f"structure {got_def} != {exp_def}"
    scale = max([float(np.max(np.abs(e), initial=0.0)) for e in exp_leaves if e is not None] + [1.0])
    for g, e in zip(got_leaves, exp_leaves):
        if e is None:
            assert g is None
            continue
        g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=0, atol=tol * scale)


# ------------------------------------------------------------------ functions
def wave(t: Any, c: Any) -> Any:
    return anp.sin(t) * c * t**2


def wave_refs(u: float, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    value = math.sin(u) * u**2 * c
    d1 = (math.cos(u) * u**2 + 2 * u * math.sin(u)) * c
    d2 = ((2 - u**2) * math.sin(u) + 4 * u * math.cos(u)) * c
    return value, d1, d2


def block_f(x: dict) -> Any:
    m, v = x["m"], x["v"]
    r = anp.sum(m * v, axis=1)
    return 0.5 * anp.sum(r**2) + anp.sum(m**3) / 3.0 + x["k"] * anp.sum(anp.exp(v))


def block_point(dtype: str = "float64") -> dict:
    rng = np.random.default_rng(0)
    return {"m": rng.uniform(-1, 1, (2, 3)).astype(dtype), "v": rng.uniform(-1, 1, 3).astype(dtype), "k": 2}


def block_hessian(x: dict) -> dict:
    m, v, k = np.asarray(x["m"], np.float64), np.asarray(x["v"], np.float64), x["k"]
    r = m @ v
    h_mm = np.einsum("ac,bd->abcd", np.eye(2), np.outer(v, v))
    h_mm += np.einsum("ab,ac,bd->abcd", 2 * m, np.eye(2), np.eye(3))
    h_mv = np.einsum("ad,b->abd", m, v) + np.einsum("a,bd->abd", r, np.eye(3))
    return {
        "m": {"m": h_mm, "v": h_mv, "k": None},
        "v": {"m": np.transpose(h_mv, (2, 0, 1)), "v": m.T @ m + np.diag(k * np.exp(v)), "k": None},
        "k": None,
    }


def cubic(w: Any, a: Any) -> Any:
    return anp.sum(a * w**3) + w[0] * w[1]


W = np.array([0.5, -1.2, 2.0])
A = np.array([1.0, 2.0, -0.5])


# ------------------------------------------------------------ scalar x
def test_derivatives_of_a_scalar_input(b: ad.Backend) -> None:
    c = np.array([1.0, -2.0, 0.5])
    value, d1, d2 = wave_refs(0.7, c)
    x = np.asarray(0.7)
    close(ad.second_derivative(b, wave, x, c), d2, rtol(b, 2))
    y, d = ad.value_and_derivative(b, wave, x, c)
    close(y, value, 1e-15)
    close(d, d1, rtol(b))
    close(d, ad.derivative(b, wave, x, c), 1e-12)
    y, d, dd = ad.value_derivative_and_second_derivative(b, wave, x, c)
    close((y, d, dd), (value, d1, d2), rtol(b, 2))
    # a Python float is a float64 scalar x too
    close(ad.second_derivative(b, lambda t: t**3, 2.0), 12.0, rtol(b, 2))


def test_prepared_twins_of_the_scalar_operators(b: ad.Backend) -> None:
    c = np.array([1.0, -2.0, 0.5])
    x0, x1 = np.asarray(0.3), np.asarray(0.7)
    value, d1, d2 = wave_refs(0.7, c)
    close(ad.prepare_second_derivative(b, wave, x0, c)(x1, c), d2, rtol(b, 2))
    close(ad.prepare_value_and_derivative(b, wave, x0, c)(x1, c), (value, d1), rtol(b))
    close(ad.prepare_value_derivative_and_second_derivative(b, wave, x0, c)(x1, c), (value, d1, d2), rtol(b, 2))


# ------------------------------------------------------------ combined operators
def test_value_and_jacobian_is_value_and_jacobian(b: ad.Backend) -> None:
    def f(w: Any, a: Any) -> Any:
        return anp.tanh(w) * a + w[0] * w[2]

    y, J = ad.value_and_jacobian(b, f, W, A)
    close(y, np.tanh(W) * A + W[0] * W[2], 1e-15)
    expected = np.diag(A * (1 - np.tanh(W) ** 2))
    expected[:, 0] += W[2]
    expected[:, 2] += W[0]
    close(J, expected, rtol(b))
    close(J, ad.jacobian(b, f, W, A), 1e-12)
    close(ad.prepare_value_and_jacobian(b, f, np.zeros(3), A)(W, A), (y, J), 1e-12)


def test_value_gradient_and_hessian_is_the_three_operators(b: ad.Backend) -> None:
    y, g, H = ad.value_gradient_and_hessian(b, cubic, W, A)
    close(y, np.sum(A * W**3) + W[0] * W[1], 1e-15)
    grad = 3 * A * W**2 + np.array([W[1], W[0], 0.0])
    hess = np.diag(6 * A * W) + np.array([[0, 1, 0], [1, 0, 0], [0, 0, 0]])
    close((g, H), (grad, hess), rtol(b, 2))
    y2, g2 = ad.value_and_gradient(b, cubic, W, A)
    close((y, g, H), (y2, g2, ad.hessian(b, cubic, W, A)), rtol(b, 2))
    close(ad.prepare_value_gradient_and_hessian(b, cubic, np.ones(3), A)(W, A), (y, g, H), 1e-12)


def test_gradient_and_hvp_is_gradient_and_hvp(b: ad.Backend) -> None:
    x = block_point()
    v = {"m": np.arange(6.0).reshape(2, 3) / 6, "v": np.array([1.0, -1.0, 0.5]), "k": 0}
    g, hv = ad.gradient_and_hvp(b, block_f, x, v)
    close(g, ad.gradient(b, block_f, x), rtol(b))
    close(hv, ad.hvp(b, block_f, x, v), rtol(b, 2))
    h = block_hessian(x)
    expected = {
        "m": np.tensordot(h["m"]["m"], v["m"], 2) + np.tensordot(h["m"]["v"], v["v"], 1),
        "v": np.tensordot(h["v"]["m"], v["m"], 2) + h["v"]["v"] @ v["v"],
        "k": None,
    }
    close(hv, expected, rtol(b, 2))
    close(ad.prepare_gradient_and_hvp(b, block_f, block_point(), v)(x, v), (g, hv), 1e-9)


# ------------------------------------------------------------ pytree Hessian
def test_hessian_of_a_pytree_is_nested_blocks(b: ad.Backend) -> None:
    x = block_point()
    H = ad.hessian(b, block_f, x)
    close(H, block_hessian(x), rtol(b, 2))
    assert H["k"] is None and H["m"]["k"] is None
    assert tuple(H["m"]["v"].shape) == (2, 3, 3) and tuple(H["v"]["m"].shape) == (3, 2, 3)
    y, g, H2 = ad.value_gradient_and_hessian(b, block_f, x)
    close(H2, H, rtol(b, 2))
    close(g, ad.gradient(b, block_f, x), rtol(b))
    close(ad.prepare_hessian(b, block_f, block_point())(x), H, 1e-9)


def test_hessian_of_one_array_keeps_its_shape(b: ad.Backend) -> None:
    H = ad.hessian(b, cubic, W, A)
    assert tuple(H.shape) == (3, 3)
    # a tree holding one array gets jax.hessian's nested layout
    Ht = ad.hessian(b, lambda t, a: cubic(t["w"], a), {"w": W}, A)
    assert set(Ht) == {"w"} and set(Ht["w"]) == {"w"}
    close(Ht["w"]["w"], H, 1e-9)


@pytest.mark.parametrize("name", ["torch", "jax", "finite_differences"])
def test_float32_is_kept(name: str) -> None:
    b = _backend(name)
    x = block_point("float32")
    y, g, H = ad.value_gradient_and_hessian(b, block_f, x)
    assert ad.to_numpy(H["m"]["v"]).dtype == np.float32 and ad.to_numpy(g["v"]).dtype == np.float32
    close(H, block_hessian(x), 1e-3 if b.approximate else 1e-5)
    d2 = ad.second_derivative(b, wave, np.asarray(0.7, np.float32), np.ones(2, np.float32))
    assert ad.to_numpy(d2).dtype == np.float32


def test_pytree_hessian_has_the_layout_of_jax_hessian() -> None:
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    x = block_point()
    with jax.enable_x64(True):
        floats = {"m": jnp.asarray(x["m"]), "v": jnp.asarray(x["v"])}
        expected = jax.hessian(lambda t: block_f({**t, "k": x["k"]}))(floats)
    for name in ("finite_differences", "jax", "torch"):
        b = _backend(name)
        got = ad.hessian(b, block_f, x)
        for i in ("m", "v"):
            for j in ("m", "v"):
                close(got[i][j], np.asarray(expected[i][j]), rtol(b, 2))


# ------------------------------------------------------------ errors
def fd() -> ad.Backend:
    return ad.backend("finite_differences")


@pytest.mark.parametrize("op", ["second_derivative", "value_and_derivative", "value_derivative_and_second_derivative"])
def test_scalar_operators_need_a_scalar_x(op: str) -> None:
    with pytest.raises(ad.ShapeMismatchError, match="scalar x"):
        getattr(ad, op)(fd(), lambda t: t**2, np.ones(3))
    with pytest.raises(ad.ShapeMismatchError, match="scalar x"):
        getattr(ad, f"prepare_{op}")(fd(), lambda t: t**2, np.ones(3))(np.ones(3))


def test_value_gradient_and_hessian_needs_a_scalar_output() -> None:
    with pytest.raises(ad.NonScalarOutputError):
        ad.value_gradient_and_hessian(fd(), lambda t: t**2, np.ones(3))
    with pytest.raises(ad.NonScalarOutputError):
        ad.hessian(fd(), lambda t: t["a"] ** 2, {"a": np.ones(3), "b": np.ones(2)})


@pytest.mark.parametrize(
    "v", [np.ones(3), {"m": np.ones((2, 3))}, {"m": np.ones((3, 2)), "v": np.ones(3), "k": 0}], ids=str
)
def test_gradient_and_hvp_checks_v(v: Any) -> None:
    x = block_point()
    with pytest.raises(ad.ShapeMismatchError, match="structure|shape"):
        ad.gradient_and_hvp(fd(), block_f, x, v)
    prepared = ad.prepare_gradient_and_hvp(fd(), block_f, x, x)
    with pytest.raises(ad.ShapeMismatchError, match="structure|shape"):
        prepared(x, v)


NEW_OPERATORS = (
    "second_derivative", "value_and_derivative", "value_derivative_and_second_derivative", "value_and_jacobian",
    "value_gradient_and_hessian", "gradient_and_hvp",
)


@pytest.mark.parametrize("op", NEW_OPERATORS)
def test_implicit_mode_refuses_them(op: str) -> None:
    imp = ad.Implicit("finite_differences")
    ps = ad.Params([ad.Variable(np.ones(2))])
    args = (ps, np.ones(2)) if op == "gradient_and_hvp" else (ps,)
    with pytest.raises(ad.ModeMismatchError, match=f"{op} is not available in implicit mode"):
        getattr(ad, op)(imp, lambda: 0.0, *args)
    with pytest.raises(ad.ModeMismatchError, match="implicit mode"):
        getattr(ad, f"prepare_{op}")(imp, lambda: 0.0, *args)


def test_every_operator_is_exported_with_its_prepared_twin() -> None:
    for op in NEW_OPERATORS:
        assert op in ad.__all__ and f"prepare_{op}" in ad.__all__
        assert callable(getattr(ad.Backend, op))
    from abstractdiff.testing import OPERATORS

    assert set(NEW_OPERATORS) <= set(OPERATORS)

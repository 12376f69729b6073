"""ad.differentiate_with: a kernel of one library inside code another library differentiates."""

from __future__ import annotations

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff.testing._composition import X, check_pair, kernel, outer_code, reference

# available_backends, not importing: paddle imported after tensorflow crashes (its adapter
# imports it safely)
OUTERS = [name for name in ("torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor")
          if name in ad.available_backends()]
INNERS = OUTERS
#: outer libraries whose forward mode reaches the kernel's pushforward
FORWARD = {"torch", "autograd", "mlx", "paddle", "pytensor"}


def scalar(f):
    """A scalar function of ``f``'s vector output (weights that depend on ``t`` too)."""
    return lambda t: anp.sum(f(t) * anp.cos(t[:4]))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
def test_matrix(outer, inner, dtype):
    """The value outside any derivative, the gradient, the pullback and (where the outer
    library has forward mode through the boundary) the pushforward, against the same
    function in one library: float64 to 1e-12, float32 to 1e-5 (the check ``abstractdiff
    check`` runs, :func:`abstractdiff.testing._composition.check_pair`)."""
    result = check_pair(outer, inner, dtype)
    assert result.ok, result.line()
    want = ["value", "gradient", "pullback"] + (["pushforward"] if outer in FORWARD or outer == inner else [])
    assert result.passed == want, result.line()


@pytest.mark.parametrize("outer", sorted(set(OUTERS) - FORWARD - {"torch"}))
def test_forward_mode_refused_where_the_outer_cannot(outer):
    b = ad.backend(outer)
    inner = "torch" if outer != "torch" else "jax"
    f = outer_code(ad.differentiate_with(kernel, inner))
    x = b.asarray(X)
    with pytest.raises((ad.CompositionError, TypeError), match="forward"):
        ad.pushforward(b, f, x)(b.asarray(np.ones(5)))


@pytest.mark.parametrize("outer", OUTERS)
def test_second_derivative_through_the_boundary_raises(outer):
    inner = "jax" if outer != "jax" else "torch"
    b = ad.backend(outer)
    f = outer_code(ad.differentiate_with(kernel, inner))
    with pytest.raises((ad.CompositionError, TypeError)) as info:
        ad.hessian(b, lambda t: anp.sum(f(t)), b.asarray(X))
    if outer != "jax":  # jax refuses forward mode over a custom_vjp itself (its own TypeError)
        assert isinstance(info.value, ad.CompositionError)
        assert inner in str(info.value) and outer in str(info.value)


@pytest.mark.parametrize("lib", OUTERS)
def test_same_library_is_native_and_nests(lib):
    b = ad.backend(lib)
    g = ad.differentiate_with(kernel, lib)
    f = outer_code(g)
    x = b.asarray(X)
    h = ad.hessian(b, lambda t: anp.sum(f(t)), x)
    np.testing.assert_allclose(ad.to_numpy(h), ad.to_numpy(ad.hessian(b, lambda t: anp.sum(reference(t)), x)),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.skipif("jax" not in OUTERS or "torch" not in INNERS, reason="needs jax and torch")
def test_under_jax_jit_and_vmap():
    import jax
    import jax.numpy as jnp

    g = ad.differentiate_with(kernel, "torch")
    loss = scalar(outer_code(g))
    want = scalar(reference)
    with jax.enable_x64(True):
        xs = jnp.stack([jnp.asarray(X), jnp.asarray(2 * X)])
        np.testing.assert_allclose(jax.jit(jax.grad(loss))(xs[0]), jax.grad(want)(xs[0]), rtol=1e-12)
        np.testing.assert_allclose(jax.vmap(jax.grad(loss))(xs), jax.vmap(jax.grad(want))(xs), rtol=1e-12)


@pytest.mark.skipif("tensorflow" not in OUTERS or "jax" not in INNERS, reason="needs tensorflow and jax")
def test_under_tf_function():
    import tensorflow as tf

    g = ad.differentiate_with(kernel, "jax")
    loss = scalar(outer_code(g))
    want = scalar(reference)

    @tf.function
    def grad(x, f):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
        return tape.gradient(y, x)

    x = tf.constant(X)
    np.testing.assert_allclose(grad(x, loss).numpy(), grad(x, want).numpy(), rtol=1e-12)


@pytest.mark.skipif("torch" not in OUTERS or "jax" not in INNERS, reason="needs torch and jax")
def test_implicit_mode_torch_parameters():
    import torch

    w = torch.nn.Parameter(torch.tensor(X))
    g = ad.differentiate_with(kernel, "jax")

    grads = ad.gradient(ad.Implicit("torch"), lambda: scalar(outer_code(g))(w), ad.Params([w]))
    want = ad.gradient(ad.Implicit("torch"), lambda: scalar(reference)(w), ad.Params([w]))
    np.testing.assert_allclose(ad.to_numpy(grads[w]), ad.to_numpy(want[w]), rtol=1e-12)
    assert w.grad is None  # nothing accumulated


@pytest.mark.skipif("jax" not in OUTERS or "autograd" not in INNERS, reason="needs jax and autograd")
def test_implicit_mode_jax_variables():
    v = ad.Variable(np.asarray(X))
    g = ad.differentiate_with(kernel, "autograd")
    grads = ad.gradient(ad.Implicit("jax"), lambda: scalar(outer_code(g))(v.value), ad.Params([v]))
    want = ad.gradient(ad.Implicit("jax"), lambda: scalar(reference)(v.value), ad.Params([v]))
    np.testing.assert_allclose(ad.to_numpy(grads[v]), ad.to_numpy(want[v]), rtol=1e-12)


def test_outside_differentiation_numpy_in_numpy_out():
    g = ad.differentiate_with(kernel, "finite_differences")
    out = g({"u": X[:3], "v": X[3:]})
    assert isinstance(out["a"], np.ndarray) and out["a"].dtype == np.float64
    np.testing.assert_allclose(out["a"], np.sin(X[:3]) * X[3])


@pytest.mark.skipif("torch" not in OUTERS or "jax" not in INNERS, reason="needs torch and jax")
def test_outside_differentiation_caller_arrays_come_back():
    import torch

    g = ad.differentiate_with(kernel, "jax")
    out = g({"u": torch.tensor(X[:3], dtype=torch.float32), "v": torch.tensor(X[3:], dtype=torch.float32)})
    assert isinstance(out["a"], torch.Tensor) and out["a"].dtype == torch.float32
    assert isinstance(out["b"], torch.Tensor) and out["b"].shape == ()


@pytest.mark.skipif("torch" not in OUTERS or "jax" not in INNERS, reason="needs torch and jax")
def test_errors_inside_the_kernel_propagate():
    def failing(x):
        raise ValueError("kernel says no")

    g = ad.differentiate_with(failing, "jax")
    import torch

    with pytest.raises(ValueError, match="kernel says no") as info:
        ad.gradient("torch", lambda t: g(t).sum(), torch.ones(3, dtype=torch.float64))
    assert any(entry.name == "failing" for entry in info.traceback)


def test_bad_arguments():
    with pytest.raises(ad.ArgumentTypeError, match="callable"):
        ad.differentiate_with(3, "finite_differences")
    with pytest.raises(ad.UnknownBackendError):
        ad.differentiate_with(kernel, "no-such-backend")
    g = ad.differentiate_with(kernel, "finite_differences")
    with pytest.raises(ad.NonDifferentiableInputError):
        g({"u": np.arange(3), "v": np.arange(2)})
    with pytest.raises(ad.InvalidArgumentError, match="dtypes"):
        g({"u": X[:3].astype(np.float32), "v": X[3:]})


def test_a_backend_without_the_hook_says_so():
    class Bare(ad.Backend):
        name = "bare"

    with pytest.raises(ad.CompositionError, match="foreign_function"):
        Bare().foreign_function(None)


@pytest.mark.skipif("mlx" not in OUTERS or "autograd" not in INNERS, reason="needs mlx and autograd")
def test_mlx_jacobian_over_a_kernel_takes_the_loop():
    # the mlx backend's Jacobians batch with mx.vmap, where the kernel gets no concrete
    # values: the adapter falls back to one pullback per row, and a Hessian still refuses
    b = ad.backend("mlx")
    f = outer_code(ad.differentiate_with(kernel, "autograd"))
    x = b.asarray(X)
    np.testing.assert_allclose(np.array(ad.jacobian(b, f, x)), np.array(ad.jacobian(b, reference, x)), rtol=1e-12)
    with pytest.raises(ad.CompositionError):
        ad.hessian(b, lambda t: anp.sum(f(t)), x)


@pytest.mark.parametrize("outer", OUTERS)
def test_implicit_mode_every_caller(outer):
    """ad.Implicit(outer): f reads the caller library's own variables and calls a kernel of
    another library; the gradient per variable equals the single-library reference."""
    from abstractdiff._implicit import current_values

    inner = "jax" if outer != "jax" else "torch"
    g = ad.differentiate_with(kernel, inner)
    b = ad.backend(outer)
    weights = b.asarray(np.array([1.0, -2.0, 0.5, 3.0]))

    def scalar(f):
        return lambda: anp.sum(f(current_values(vs)["t"]) * weights)

    vs = ad.variables({"t": X}, b)
    grads = ad.gradient(ad.Implicit(outer), scalar(outer_code(g)), ad.Params(vs))
    want = ad.gradient(ad.Implicit(outer), scalar(reference), ad.Params(vs))
    np.testing.assert_allclose(ad.to_numpy(grads[vs["t"]]), ad.to_numpy(want[vs["t"]]), rtol=1e-12, atol=1e-12)

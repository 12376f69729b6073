"""Equinox modules (and other ``jax.tree_util`` classes) are pytrees as jax flattens them.

Gradients against ``eqx.filter_grad``; training with ``ad.train_step``/``ad.train`` against
one step written by hand; prepared operators; checkpoints; the ``eqx.partition``/``combine``
idiom; and a module on the other backends, flattened the same way.
"""

from __future__ import annotations

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff import optim
from abstractdiff._registry import unavailable_reason

jax = pytest.importorskip("jax")
eqx = pytest.importorskip("equinox")
jnp = jax.numpy


def mlp() -> eqx.nn.MLP:
    return eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))


def batch() -> tuple:
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(16, 3)), jnp.float32), jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)


def loss(model: eqx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def assert_trees_close(got: object, want: object, atol: float = 1e-6) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=atol)


def test_an_mlps_gradient_equals_filter_grad() -> None:
    model, (x, y) = mlp(), batch()
    g = ad.gradient("jax", loss, model, x, y)
    assert type(g) is eqx.nn.MLP  # the user's own type
    assert g.activation is None  # non-array leaves get no gradient, as filter_grad gives them
    assert_trees_close(g, eqx.filter_grad(loss)(model, x, y))
    value, g2 = ad.value_and_gradient("jax", loss, model, x, y)
    np.testing.assert_allclose(float(value), float(loss(model, x, y)), rtol=1e-6)
    assert_trees_close(g2, g)


def test_a_python_float_in_a_module_is_static_as_filter_grad_leaves_it() -> None:
    class Scaled(eqx.Module):
        w: jax.Array
        scale: float  # a plain field, not eqx.field(static=True): a leaf jax sees

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.scale * jnp.sum(self.w * x)

    m, x = Scaled(jnp.array([1.0, 2.0]), 3.0), jnp.array([0.5, -1.0])
    g = ad.gradient("jax", lambda m, x: m(x), m, x)
    assert g.scale is None and eqx.filter_grad(lambda m, x: m(x))(m, x).scale is None
    np.testing.assert_allclose(np.asarray(g.w), 3.0 * np.asarray(x))
    # the float keys the plan as a static leaf does: a new value is a new function, not a stale one
    np.testing.assert_allclose(np.asarray(ad.gradient("jax", lambda m, x: m(x), Scaled(m.w, 5.0), x).w),
                               5.0 * np.asarray(x))


def test_a_dropout_probability_is_no_parameter() -> None:
    class Net(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.dropout(self.linear(x), inference=True)

    net = Net(eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(1)), eqx.nn.Dropout(0.5))
    f = lambda n, x: jnp.sum(n(x) ** 2)  # noqa: E731
    x = jnp.ones(3)
    g = ad.gradient("jax", f, net, x)
    assert g.dropout.p is None
    assert_trees_close(g, eqx.filter_grad(f)(net, x))
    state = optim.setup(optim.Descent(0.1), net)
    state, new, _ = ad.train_step(f, net, (x,), state, backend="jax")
    assert new.dropout.p == 0.5  # not trained


def test_partition_and_combine() -> None:
    model, (x, y) = mlp(), batch()
    params, static = eqx.partition(model, eqx.is_array)

    def split_loss(params: eqx.Module, static: eqx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
        return loss(eqx.combine(params, static), x, y)

    g = ad.gradient("jax", split_loss, params, static, x, y)
    assert_trees_close(g, eqx.filter_grad(loss)(model, x, y))


def test_train_step_is_one_sgd_step() -> None:
    model, (x, y) = mlp(), batch()
    state = optim.setup(optim.Descent(0.1), model)
    state, new, value = ad.train_step(loss, model, (x, y), state, backend="jax")
    assert type(new) is eqx.nn.MLP
    grads = eqx.filter_grad(loss)(model, x, y)
    want = eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))
    assert_trees_close(eqx.filter(new, eqx.is_array), eqx.filter(want, eqx.is_array))
    np.testing.assert_allclose(float(value), float(loss(model, x, y)), rtol=1e-6)
    assert new.activation is model.activation  # static leaves come back as they were


def test_train_lowers_the_loss_with_adam() -> None:
    model, (x, y) = mlp(), batch()
    data = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)]
    state = optim.setup(optim.Adam(1e-2), model)
    before = float(loss(model, x, y))
    state, model = ad.train(loss, model, data, state, backend="jax", epochs=20, progress=False)[:2]
    assert type(model) is eqx.nn.MLP
    assert float(loss(model, x, y)) < 0.7 * before


def test_prepared_gradient_is_reused_and_right() -> None:
    model, (x, y) = mlp(), batch()
    prepared = ad.prepare_gradient("jax", loss, model, x, y)
    for scale in (1.0, 2.0):  # new values of the same structure: one preparation
        m = jax.tree_util.tree_map(lambda a, s=scale: a * s if eqx.is_array(a) else a, model)
        assert_trees_close(prepared(m, x, y), eqx.filter_grad(loss)(m, x, y))


def test_a_checkpoint_round_trips(tmp_path: object) -> None:
    model, (x, y) = mlp(), batch()
    state = optim.setup(optim.Adam(1e-2), model)
    state, model, _ = ad.train_step(loss, model, (x, y), state, backend="jax")
    for name in ("ckpt.npz", "ckpt.safetensors"):
        path = tmp_path / name  # type: ignore[operator]
        ad.save_checkpoint(path, state, model)
        fresh = mlp()
        state2, model2 = ad.load_checkpoint(path, like=(optim.setup(optim.Adam(1e-2), fresh), fresh))
        assert type(model2) is eqx.nn.MLP
        assert_trees_close(eqx.filter(model2, eqx.is_array), eqx.filter(model, eqx.is_array), atol=0)
        assert int(state2.step) == int(state.step)
        # training continues from the checkpoint exactly as from the saved state
        _, a, _ = ad.train_step(loss, model, (x, y), state, backend="jax")
        _, b, _ = ad.train_step(loss, model2, (x, y), state2, backend="jax")
        assert_trees_close(eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array))


def test_to_numpy_keeps_the_module() -> None:
    model = mlp()
    out = ad.to_numpy(model)
    assert type(out) is eqx.nn.MLP
    assert isinstance(out.layers[0].weight, np.ndarray)
    assert out.activation is model.activation


class Affine(eqx.Module):
    """An Equinox module whose call is written with autoray, so that any backend runs it."""

    w: object
    b: object
    scale: float

    def __call__(self, x: object) -> object:
        return self.scale * anp.sum((self.w * x + self.b) ** 2)


@pytest.mark.parametrize("name", ["finite_differences", "autograd", "torch", "tensorflow", "mlx", "paddle",
                                  "pytensor"])
def test_a_module_is_flattened_as_jax_flattens_it_on_every_backend(name: str) -> None:
    if unavailable_reason(name) is not None:
        pytest.skip(unavailable_reason(name))
    w, b, x = np.array([1.0, -2.0]), np.array([0.5, 0.25]), np.array([2.0, 1.0])
    g = ad.gradient(name, lambda m, x: m(x), Affine(w, b, 3.0), x)
    assert type(g) is Affine and g.scale is None  # never a None gradient for the arrays
    r = w * x + b
    tol = 1e-5 if name == "finite_differences" else 1e-10
    np.testing.assert_allclose(ad.to_numpy(g.w), 6.0 * r * x, rtol=tol)
    np.testing.assert_allclose(ad.to_numpy(g.b), 6.0 * r, rtol=tol)

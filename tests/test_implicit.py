"""Implicit parameters: Params, Grads, Variable, variables and the ad.Implicit adapter.

The generic route is tested on finite differences (no AD library needed); the torch,
tensorflow/Keras, jax and autograd routes are skipped when their library is missing.
"""

from __future__ import annotations

import copy
import gc

import numpy as np
import optree
import pytest

import abstractdiff as ad
from abstractdiff._implicit import current_values

RTOL = {"float32": 1e-4, "float64": 1e-9}
FD_RTOL = {"float32": 2e-3, "float64": 1e-8}


def assert_close(actual, expected, rtol):
    actual, expected = np.asarray(ad.to_numpy(actual), dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    atol = rtol * max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def loss_of(w, c):
    # y = c * sum(w**2) + sum(sin(w)); dy/dw = 2 c w + cos(w)
    return c.value * (w.value**2).sum() + np.sin(w.value).sum()


@pytest.fixture
def fd_implicit():
    return ad.Implicit("finite_differences")


# ---------------------------------------------------------------- Variable
def test_variable_box_reads_writes_and_checks():
    v = ad.Variable(np.array([1.0, 2.0]), name="w")
    assert v.shape == (2,) and v.dtype == np.float64
    v.value = np.array([3.0, 4.0])
    np.testing.assert_array_equal(np.asarray(v), [3.0, 4.0])
    np.testing.assert_array_equal(ad.to_numpy({"v": v})["v"], [3.0, 4.0])
    assert "Variable('w', shape=(2,), dtype=float64" in repr(v)
    with pytest.raises(ad.ShapeMismatchError, match=r"shape \(3,\) to Variable 'w' of shape \(2,\)"):
        v.value = np.zeros(3)
    with pytest.raises(TypeError, match="float32 array to Variable 'w', which holds float64; cast"):
        v.value = np.zeros(2, dtype=np.float32)
    np.testing.assert_array_equal(v.value, [3.0, 4.0])  # a refused assignment changes nothing
    assert ad.Variable(2.5).dtype == np.float64


# ------------------------------------------------------------------ Params
def test_params_order_dedup_and_static_leaves():
    a, b = ad.Variable(np.ones(2)), ad.Variable(np.zeros((2, 3)))
    ps = ad.Params({"b": b, "a": a, "again": [a], "n": 3, "idx": np.arange(2)})
    assert list(ps) == [a, b]  # optree sorts dict keys: a, again (duplicate), b
    assert len(ps) == 2 and a in ps and ad.Variable(1.0) not in ps
    assert repr(ps) == "Params(2 variables (ad.Variable), 8 values)"
    assert list(ad.Params(ps)) == [a, b]


def test_params_rejects_a_numpy_array_and_says_how_to_fix():
    with pytest.raises(
        TypeError, match=r"leaf 1 .* is a ndarray of shape \(2,\), not a variable.*ad\.Variable\(array\).*ad\.variables"
    ):
        ad.Params([ad.Variable(np.ones(2)), np.ones(2)])
    with pytest.raises(TypeError, match="is a float, not a variable"):
        ad.Params([1.5])


def test_params_of_an_integer_variable_is_static_and_empty_params_refused(fd_implicit):
    ps = ad.Params([ad.Variable(np.arange(3))])
    assert len(ps) == 0
    with pytest.raises(ad.NonDifferentiableInputError, match="no trainable variable"):
        ad.gradient(fd_implicit, lambda: np.float64(0.0), ps)


def test_params_is_refused_by_an_explicit_backend(fd):
    ps = ad.Params([ad.Variable(np.ones(2))])
    with pytest.raises(ad.ModeMismatchError, match=r"ad\.Implicit\('finite_differences'\)"):
        ad.gradient(fd, lambda x: x.sum(), ps)


def test_implicit_refuses_anything_but_params(fd_implicit):
    w = ad.Variable(np.ones(2))
    for x in (np.ones(2), w, [w]):
        with pytest.raises(ad.ModeMismatchError, match=r"wrap the model or variables: .*ad\.Params"):
            ad.gradient(fd_implicit, lambda: w.value.sum(), x)
    assert issubclass(ad.ModeMismatchError, TypeError)


@pytest.mark.parametrize("op", [
    "jacobian", "hessian", "hvp", "pushforward", "value_and_pushforward", "derivative", "value_and_derivative",
    "second_derivative", "value_derivative_and_second_derivative", "value_and_jacobian", "value_gradient_and_hessian",
    "gradient_and_hvp",
])
def test_explicit_only_operators_say_which_backend_to_use(fd_implicit, op):
    w = ad.Variable(np.ones(2))
    v = [np.ones(2)] if op in ("hvp", "gradient_and_hvp") else []
    with pytest.raises(
        ad.ModeMismatchError, match=rf"{op} is not available in implicit mode.*ad\.backend\('finite_differences'\)"
    ):
        getattr(ad, op)(fd_implicit, lambda: w.value, ad.Params([w]), *v)


def test_implicit_construction():
    b = ad.backend("implicit", inner="finite_differences")
    assert b is ad.backend("implicit", inner="finite_differences")
    assert b == ad.Implicit("finite_differences") and b.inner is ad.backend("finite_differences")
    assert repr(b) == "Implicit(inner='finite_differences')"
    assert ad.Implicit(ad.backend("finite_differences")).inner_name == "finite_differences"
    with pytest.raises(ad.UnknownBackendError):
        ad.Implicit("no_such_backend")
    with pytest.raises(TypeError, match="explicit backend"):
        ad.Implicit(b)


# ------------------------------------------------------------------- Grads
def test_grads_mapping_lookup_and_conversion(fd_implicit):
    w, c = ad.Variable(np.array([0.5, -1.0])), ad.Variable(np.array(2.0))
    ps = ad.Params([w, c])
    gs = ad.gradient(fd_implicit, lambda: loss_of(w, c), ps)
    assert isinstance(gs, ad.Grads) and len(gs) == 2 and list(gs) == [w, c] and w in gs
    assert_close(gs[w], 2 * 2.0 * w.value + np.cos(w.value), FD_RTOL["float64"])
    assert_close(gs[c], (w.value**2).sum(), FD_RTOL["float64"])
    assert [id(g) for g in gs.values()] == [id(gs[w]), id(gs[c])]
    assert [k for k, _ in gs.items()] == [w, c]
    with pytest.raises(KeyError, match="not one of the 2 parameters"):
        gs[ad.Variable(np.ones(2))]
    as_numpy = ad.to_numpy(gs)
    assert isinstance(as_numpy, ad.Grads) and as_numpy == gs and as_numpy[c] is not None
    doubled = optree.tree_map(lambda g: 2 * g, gs, namespace="abstractdiff")  # abstractdiff's own registry
    assert_close(doubled[w], 2 * gs[w], 1e-15)
    assert "Grads(2 parameters: [(2,) float64, () float64])" == repr(gs)


# ------------------------------------------------------------ generic route
def test_fd_implicit_equals_explicit_and_aux(fd, fd_implicit):
    w, c = ad.Variable(np.array([0.3, 0.7, -0.2])), ad.Variable(np.array(1.5))
    ps = ad.Params([w, c])
    (y, aux), gs = ad.value_and_gradient(fd_implicit, lambda: (loss_of(w, c), "aux"), ps, has_aux=True)
    y_e, g_e = ad.value_and_gradient(fd, lambda x: x[1] * (x[0] ** 2).sum() + np.sin(x[0]).sum(), [w.value, c.value])
    assert aux == "aux" and float(y) == float(y_e)
    assert_close(gs[w], g_e[0], 1e-15)
    assert_close(gs[c], g_e[1], 1e-15)


def test_fd_pullback_and_args(fd_implicit):
    w = ad.Variable(np.array([1.0, 2.0]))
    y, vjp = ad.value_and_pullback(fd_implicit, lambda a: a * w.value**2, ad.Params([w]), np.array([3.0, 5.0]))
    np.testing.assert_array_equal(y, [3.0, 20.0])
    gc.collect()  # nobody but the pullback holds the lambda now; FD's lazy vjp calls it again
    assert_close(vjp(np.array([1.0, 1.0]))[w], [6.0, 20.0], FD_RTOL["float64"])
    with pytest.raises(ad.ShapeMismatchError):
        vjp(np.ones(3))


def test_values_are_restored_after_f_raises(fd_implicit):
    original = np.array([1.0, 2.0])
    w = ad.Variable(original)
    seen = []

    def f():
        seen.append(w.value)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ad.gradient(fd_implicit, f, ad.Params([w]))
    assert seen and w.value is original
    gs = ad.gradient(fd_implicit, lambda: (w.value**2).sum(), ad.Params([w]))
    assert w.value is original and np.all(original == [1.0, 2.0])
    assert_close(gs[w], [2.0, 4.0], FD_RTOL["float64"])


def test_variables_builds_fresh_boxes(fd_implicit):
    x = {"w": np.array([1.0, 2.0]), "n": 3, "idx": np.array([0, 1])}
    vs = ad.variables(x, fd_implicit)
    assert isinstance(vs["w"], ad.Variable) and vs["n"] == 3 and vs["idx"].dtype.kind == "i"
    vs["w"].value = np.array([5.0, 6.0])
    np.testing.assert_array_equal(x["w"], [1.0, 2.0])  # the input was copied, not shared
    assert list(ad.Params(vs)) == [vs["w"]]
    assert current_values(vs)["w"] is vs["w"].value


# -------------------------------------------------------------------- torch
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _torch_model(torch):
    torch.manual_seed(0)  # the generator of this test only: no global default changed
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def test_torch_module_gradients_equal_backward_and_grad_untouched(torch):
    model = _torch_model(torch)
    reference = copy.deepcopy(model)
    x, t = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    sentinel = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = sentinel  # a .grad set by the user: must stay the very same tensor

    def loss_fn(m):
        return ((m(x) - t) ** 2).mean()

    y, gs = ad.value_and_gradient(ad.Implicit("torch"), lambda: loss_fn(model), ad.Params(model))
    loss = loss_fn(reference)
    loss.backward()
    assert float(y) == float(loss.detach()) and not y.requires_grad
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(gs[p], q.grad.numpy(), RTOL["float64"])
    assert model[0].weight.grad is sentinel and torch.equal(sentinel, torch.full_like(sentinel, 7.0))
    assert all(p.grad is None for p in list(model.parameters())[1:])


def test_torch_frozen_parameters_are_skipped_and_unused_get_zeros(torch):
    model = _torch_model(torch)
    model[0].bias.requires_grad_(False)
    unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    ps = ad.Params([model, unused])
    assert repr(ps) == "Params(4 variables (torch), 44 values; 1 non-trainable variable left out)"
    assert model[0].bias not in ps
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():  # the adapter enables grad itself
        gs = ad.gradient(ad.Implicit("torch"), lambda: model(x).sum(), ps)
    assert torch.equal(gs[unused], torch.zeros(3, dtype=torch.float64))
    assert gs[model[2].weight].shape == (1, 8)


def test_torch_pullback_and_errors(torch):
    w = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    y, vjp = ad.value_and_pullback(ad.Implicit("torch"), lambda: w**2, ad.Params([w]))
    np.testing.assert_array_equal(vjp(np.array([1.0, 3.0]))[w].numpy(), [2.0, 12.0])
    np.testing.assert_array_equal(vjp(np.array([1.0, 0.0]))[w].numpy(), [2.0, 0.0])  # callable twice
    assert w.grad is None
    with pytest.raises(TypeError, match=r"does not require grad; call \.requires_grad_\(\)"):
        ad.Params([torch.ones(2, dtype=torch.float64)])
    with pytest.raises(TypeError, match="not a leaf"):
        ad.Params([w * 2])
    with pytest.raises(
        TypeError, match=r"holds torch variables but the inner backend is 'finite_differences'.*ad\.Implicit\('torch'\)"
    ):
        ad.gradient(ad.Implicit("finite_differences"), lambda: (w**2).sum(), ad.Params([w]))
    with pytest.raises(TypeError, match="mixes variables of different libraries"):
        ad.Params([w, ad.Variable(np.ones(2))])


def test_torch_variables_are_fresh_leaves(torch):
    x = np.array([1.0, 2.0])
    (v,) = ad.variables([x], ad.Implicit("torch"))
    assert v.is_leaf and v.requires_grad and v.dtype == torch.float64
    with torch.no_grad():
        v.add_(1.0)
    np.testing.assert_array_equal(x, [1.0, 2.0])  # not sharing the caller's memory


def test_torch_has_aux_args_and_boxes_on_inner_torch(torch):
    w = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    b = ad.Implicit("torch")
    (y, aux), gs = ad.value_and_gradient(
        b, lambda a: ((a * w**2).sum(), {"w2": w**2}), ad.Params([w]), np.array(3.0), has_aux=True
    )
    assert not aux["w2"].requires_grad  # aux comes back detached: no graph kept alive
    np.testing.assert_array_equal(gs[w].numpy(), [6.0, 12.0])
    box = ad.Variable(torch.tensor([1.0, 2.0], dtype=torch.float64))  # the generic route on torch
    gs = ad.gradient(b, lambda: (box.value**3).sum(), ad.Params([box]))
    np.testing.assert_allclose(gs[box].numpy(), [3.0, 12.0], rtol=1e-12)
    assert not box.value.requires_grad


@pytest.mark.gpu
def test_torch_model_on_gpu_gets_numpy_data_on_its_device(torch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch here")
    model = _torch_model(torch).cuda()
    x = np.random.default_rng(0).normal(size=(5, 4))
    gs = ad.gradient(ad.Implicit("torch"), lambda data: model(data).sum(), ad.Params(model), x)
    cpu = copy.deepcopy(model).cpu()
    cpu(torch.as_tensor(x)).sum().backward()
    for p, q in zip(model.parameters(), cpu.parameters()):
        assert gs[p].device == p.device
        assert_close(gs[p].cpu().numpy(), q.grad.numpy(), 1e-10)  # GPU differs in the last bits


# --------------------------------------------------------- tensorflow/keras
@pytest.fixture
def tf():
    return pytest.importorskip("tensorflow")


def test_keras_sequential_gradients_equal_gradient_tape(tf):
    keras = pytest.importorskip("keras")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 3)), dtype=tf.float32)
    ps = ad.Params(model)
    # BatchNormalization's moving statistics: non-trainable state, not frozen parameters
    assert repr(ps).endswith("; 2 non-trainable variables left out)") and ps.non_trainable == 2
    y, gs = ad.value_and_gradient(ad.Implicit("tensorflow"), lambda: tf.reduce_mean(model(x) ** 2), ps)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
    expected = tape.gradient(loss, model.trainable_variables)
    assert float(y) == pytest.approx(float(loss), rel=1e-6)
    assert len(gs) == len(model.trainable_variables)
    for v, e in zip(model.trainable_variables, expected):
        assert_close(gs[v], e.numpy(), RTOL["float32"])
        assert gs[v.value] is gs[v]  # also found by the tf.Variable the Keras variable wraps


def test_tf_variables_unhashable_keys_unconnected_zeros_and_pullback(tf):
    a = tf.Variable(np.array([1.0, 2.0]))
    b = tf.Variable(np.array(3.0))
    frozen = tf.Variable(np.array(1.0), trainable=False)
    ps = ad.Params([a, b])
    gs = ad.gradient(ad.Implicit("tensorflow"), lambda: tf.reduce_sum(a**2) * frozen, ps)
    np.testing.assert_array_equal(gs[a].numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(gs[b].numpy(), 0.0)  # unconnected: zeros, not None
    y, vjp = ad.value_and_pullback(ad.Implicit("tensorflow"), lambda: a * b, ps)
    g1, g2 = vjp(np.array([1.0, 1.0])), vjp(np.array([2.0, 0.0]))
    np.testing.assert_array_equal(g1[a].numpy(), [3.0, 3.0])
    np.testing.assert_array_equal(g2[b].numpy(), 2.0)
    module = tf.Module()
    module.w, module.s = a, frozen
    assert repr(ad.Params(module)) == "Params(1 variable (tensorflow), 2 values; 1 non-trainable variable left out)"
    (v,) = ad.variables([np.ones(2)], "tensorflow")
    assert isinstance(v, tf.Variable) and v.dtype == tf.float64


# ---------------------------------------------------------- jax and autograd
@pytest.mark.parametrize("inner", ["jax", "autograd", "finite_differences"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_generic_route_equals_explicit(inner, dtype):
    if inner != "finite_differences":
        pytest.importorskip(inner)
    from autoray import numpy as anp

    b = ad.backend(inner)
    rng = np.random.default_rng(1)
    x = {"w": rng.normal(size=(3, 2)).astype(dtype), "b": rng.normal(size=2).astype(dtype)}
    data = rng.normal(size=(4, 3)).astype(dtype)

    def f(p, data):
        return anp.sum(anp.tanh(data @ p["w"] + p["b"]) ** 2)

    vs = ad.variables(x, b)
    y_e, g_e = ad.value_and_gradient(b, f, x, data)
    y_i, gs = ad.value_and_gradient(ad.Implicit(b), lambda: f(current_values(vs), data), ad.Params(vs))
    tol = RTOL[dtype] if inner != "finite_differences" else 1e-15
    assert_close(y_i, ad.to_numpy(y_e), tol)
    for k in x:
        assert ad.to_numpy(gs[vs[k]]).dtype == np.dtype(dtype)
        assert_close(gs[vs[k]], ad.to_numpy(g_e[k]), tol)
    _, vjp = ad.value_and_pullback(ad.Implicit(b), lambda: f(current_values(vs), data), ad.Params(vs))
    assert_close(vjp(np.asarray(2.0, dtype=dtype))[vs["b"]], 2 * ad.to_numpy(g_e["b"]), tol)


def test_jax_repeated_call_does_not_retrace():
    pytest.importorskip("jax")
    jb = ad.backend("jax")
    b = ad.Implicit(jb)
    w = ad.variables(np.array([1.0, 2.0, 3.0]), jb)
    ps = ad.Params([w])

    def loss(scale):
        return scale * (w.value**2).sum()

    ad.gradient(b, loss, ps, np.array(1.0))
    before = jb.trace_count
    gs = ad.gradient(b, loss, ps, np.array(2.0))  # new data, same shapes: the compiled trace is reused
    # a fresh Params of the same variables, and a fresh Implicit, reuse it too
    gs2 = ad.gradient(ad.Implicit(jb), loss, ad.Params([w]), np.array(2.0))
    assert jb.trace_count == before
    assert_close(gs[w], [4.0, 8.0, 12.0], RTOL["float64"])
    assert_close(gs2[w], [4.0, 8.0, 12.0], RTOL["float64"])
    with pytest.raises(ad.TracedControlFlowError):  # errors inside the trace still restore the values
        ad.gradient(b, lambda: float(w.value.sum()), ps)
    assert type(w.value).__name__ == "ArrayImpl"


def test_jax_reads_of_other_variables_are_not_frozen_into_the_trace():
    pytest.importorskip("jax")
    jb = ad.backend("jax")
    b = ad.Implicit(jb)
    w = ad.variables(np.array([1.0, 2.0]), jb)
    scale = ad.variables(np.array(1.0), jb)  # read by f, not differentiated

    def loss():
        return scale.value * (w.value**2).sum()

    ps = ad.Params([w])
    assert_close(ad.gradient(b, loss, ps)[w], [2.0, 4.0], RTOL["float64"])
    scale.value = jb.asarray(np.array(3.0))
    assert_close(ad.gradient(b, loss, ps)[w], [6.0, 12.0], RTOL["float64"])
    before = jb.trace_count
    scale.value = jb.asarray(np.array(5.0))
    assert_close(ad.gradient(b, loss, ps)[w], [10.0, 20.0], RTOL["float64"])
    assert jb.trace_count == before  # scale is now passed as data


def test_jax_params_refused_by_torch_implicit():
    pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match=r"holds torch variables but the inner backend is 'jax'"):
        ad.gradient(ad.Implicit("jax"), lambda: w.sum(), ad.Params([w]))


def test_cached_explicit_wrappers_do_not_keep_functions_or_variables_alive(fd_implicit):
    from abstractdiff import _implicit_backend as implicit

    w = ad.Variable(np.ones(2))
    f = lambda: (w.value**2).sum()  # noqa: E731
    ad.gradient(fd_implicit, f, ad.Params([w]))
    n = len(implicit._FAMILIES)
    assert n >= 1
    del f
    gc.collect()
    assert len(implicit._FAMILIES) == n - 1


# ------------------------------------------------ other boxes f reads (not Params)
def _extra_counts(b, monkeypatch):
    """Record how many other boxes' values each operation passes to the inner backend."""
    counts = []
    inner_vg = b.inner.value_and_gradient

    def spy(w, values, extra_values, *args, **kw):
        counts.append(len(extra_values))
        return inner_vg(w, values, extra_values, *args, **kw)

    monkeypatch.setattr(b.inner, "value_and_gradient", spy)  # the inner backend is shared
    return counts


def test_replaced_other_box_that_died_is_dropped_not_an_error(fd_implicit):
    w = ad.Variable(np.ones(3))
    state = {}

    def loss():
        return (w.value * state["x"].value).sum()

    for step in range(4):
        state["x"] = ad.Variable(np.arange(3.0) + step)  # a new data box each step; the old one dies
        gc.collect()
        assert_close(ad.gradient(fd_implicit, loss, ad.Params([w]))[w], np.arange(3.0) + step, FD_RTOL["float64"])


def test_replaced_other_boxes_kept_alive_are_not_accumulated(fd_implicit, monkeypatch):
    w = ad.Variable(np.ones(3))
    keep, state = [], {}
    counts = _extra_counts(fd_implicit, monkeypatch)

    def loss():
        return (w.value * state["x"].value).sum()

    for step in range(5):
        state["x"] = ad.Variable(np.arange(3.0) + step)
        keep.append(state["x"])
        assert_close(ad.gradient(fd_implicit, loss, ad.Params([w]))[w], np.arange(3.0) + step, FD_RTOL["float64"])
    # the first call learns the box; from then on one box (the last one read), never all of them
    assert counts == [0, 1, 1, 1, 1]


def test_other_boxes_set_follows_what_f_reads(fd_implicit, monkeypatch):
    from abstractdiff import _implicit_backend as implicit

    w, a, c = ad.Variable(np.ones(2)), ad.Variable(np.array(2.0)), ad.Variable(np.array(3.0))
    use = {"c": True}
    counts = _extra_counts(fd_implicit, monkeypatch)

    def loss():
        y = a.value * (w.value**2).sum()
        return y * c.value if use["c"] else y

    ps = ad.Params([w])
    assert_close(ad.gradient(fd_implicit, loss, ps)[w], [12.0, 12.0], FD_RTOL["float64"])
    use["c"] = False
    assert_close(ad.gradient(fd_implicit, loss, ps)[w], [4.0, 4.0], FD_RTOL["float64"])
    assert_close(ad.gradient(fd_implicit, loss, ps)[w], [4.0, 4.0], FD_RTOL["float64"])
    assert counts == [0, 2, 1]  # rebuilt from the reads of the last call, not append-only
    family = next(f for f in implicit._FAMILIES.values() if f._f() is loss)
    assert len(family.wrappers) <= implicit._Family.max_wrappers


def test_jax_other_box_reused_does_not_retrace_and_replaced_box_is_read():
    pytest.importorskip("jax")
    jb = ad.backend("jax")
    b = ad.Implicit(jb)
    w = ad.Variable(np.ones(3))
    state = {"x": ad.Variable(np.arange(3.0))}

    def loss():
        return (w.value * state["x"].value).sum()

    ps = ad.Params([w])
    for step in range(2):  # the first trace learns x, the second passes it as data
        state["x"].value = np.arange(3.0) + step
        assert_close(ad.gradient(b, loss, ps)[w], np.arange(3.0) + step, RTOL["float64"])
    before = jb.trace_count
    for step in range(2, 6):  # same box, new values: no retrace
        state["x"].value = np.arange(3.0) + step
        assert_close(ad.gradient(b, loss, ps)[w], np.arange(3.0) + step, RTOL["float64"])
    assert jb.trace_count == before
    for step in range(6, 9):  # a new box each step, the old one dropped: read, never an error
        state["x"] = ad.Variable(np.arange(3.0) + step)
        gc.collect()
        assert_close(ad.gradient(b, loss, ps)[w], np.arange(3.0) + step, RTOL["float64"])


def test_a_model_listed_twice_counts_its_frozen_parameters_once():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].bias.requires_grad_(False)
    ps = ad.Params([model, model])
    assert len(ps) == 3 and ps.non_trainable == 1 and "1 non-trainable variable left out" in repr(ps)


def test_to_numpy_leaves_a_model_alone_and_converts_its_variables():
    torch = pytest.importorskip("torch")
    layer = torch.nn.Linear(2, 1)
    out = ad.to_numpy({"model": layer, "w": layer.weight})
    assert out["model"] is layer and isinstance(out["w"], np.ndarray) and out["w"].shape == (1, 2)

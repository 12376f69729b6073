"""Never silently wrong: regressions of the silent wrong results new users found, on every backend.

Each test fails on the version before the fix (stale traces on jax and tensorflow, late
reads of the caller's buffer on torch, autograd and finite differences, complex outputs
losing their imaginary part, leaked autograd boxes giving zero Jacobians, a non-finite
"last good" model, custom pytree nodes treated as static, float64 values for float32
inputs on autograd).
"""

from __future__ import annotations

import numpy as np
import optree
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff import optim
from abstractdiff._implicit import current_values

EXPLICIT = ["finite_differences", "autograd", "jax", "tensorflow", "torch", "mlx", "paddle", "pytensor"]


@pytest.fixture(params=EXPLICIT)
def b(request):
    if request.param not in ad.available_backends():
        pytest.skip(f"{request.param} is not installed here")
    return ad.backend(request.param)


def close(got, want, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(ad.to_numpy(got), dtype=np.float64), want, rtol=rtol, atol=1e-9)


# ------------------------------------------------------------------ 1. stale traces
SCALE = 2.0


def scaled(x):
    return SCALE * anp.sum(x**2)


def test_a_changed_global_is_seen(b):
    global SCALE
    x = np.array([1.0, 2.0])
    SCALE = 2.0
    close(ad.gradient(b, scaled, x), 4 * x)
    traces = getattr(b, "trace_count", None)
    close(ad.gradient(b, scaled, x), 4 * x)
    if traces is not None and b.reuses_traces:
        assert b.trace_count == traces  # the same value: the trace is reused
    SCALE = 5.0
    try:
        close(ad.gradient(b, scaled, x), 10 * x)
        if traces is not None and b.reuses_traces:
            assert b.trace_count > traces  # a changed value: traced again
    finally:
        SCALE = 2.0


def test_a_changed_closure_value_and_numpy_array_are_seen(b):
    x = np.array([1.0, 2.0])
    for scale in (2.0, 5.0, 2.0):
        close(ad.gradient(b, lambda x: scale * anp.sum(x**2), x), 2 * scale * x)  # noqa: B023
    weights = np.array([1.0, 3.0])
    f = lambda x: anp.sum(x * b.asarray(weights))  # noqa: E731
    close(ad.gradient(b, f, x), weights)
    weights[:] = [7.0, -1.0]  # changed in place: compared by content
    close(ad.gradient(b, f, x), [7.0, -1.0])


def test_a_training_loop_whose_penalty_switches_trains_the_right_objective(b):
    """The trainer-switch task: the penalty weight f reads by closure goes from 0 to 100."""
    penalty = 0.0

    def loss(m, target):
        return anp.sum((m["w"] - target) ** 2) + penalty * anp.sum(m["w"] ** 2)

    model = {"w": np.ones(2)}
    state = optim.setup(optim.Descent(0.001), model)
    target = np.array([2.0, -1.0])
    for step in range(4):
        penalty = 0.0 if step < 2 else 100.0
        w = np.asarray(ad.to_numpy(model["w"]))
        state, model, value = ad.train_step(loss, model, (target,), state, backend=b)
        expected = np.sum((w - target) ** 2) + penalty * np.sum(w**2)
        assert float(ad.to_numpy(value)) == pytest.approx(expected, rel=1e-6), (step, penalty)


TABLE = None


def test_a_replaced_global_array_is_seen(b):
    global TABLE
    x = np.array([1.0, 2.0])
    f = lambda x: anp.sum(x * TABLE)  # noqa: E731
    try:
        for k in range(3):
            TABLE = b.asarray(np.full(2, float(k + 1)))  # a new native array each time
            close(ad.gradient(b, f, x), np.full(2, k + 1.0))
    finally:
        TABLE = None


# ---------------------------------------------------------------- 2. late reads
def test_pullback_and_pushforward_are_functions_of_their_point(b):
    x = np.array([1.0, 2.0])
    y, vjp = ad.value_and_pullback(b, lambda x: x**3, x)
    _, jvp = ad.value_and_pushforward(b, lambda x: x**3, x)
    x[:] = 5.0  # the caller reuses its buffer
    close(vjp(np.ones(2)), [3.0, 12.0])
    close(jvp(np.ones(2)), [3.0, 12.0])
    data = np.array([1.0, 10.0])
    _, vjp = ad.value_and_pullback(b, lambda x, d: d * x**2, np.array([1.0, 2.0]), data)
    data[:] = 0.0
    close(vjp(np.ones(2)), [2.0, 40.0])


# --------------------------------------------------------- 4. complex outputs
@pytest.mark.parametrize("op", ["gradient", "jacobian", "pullback"])
def test_complex_output_raises_instead_of_dropping_the_imaginary_part(b, op):
    x = np.ones(2)
    # ours, or the library's own refusal (tensorflow will not multiply float by complex): both TypeErrors
    with pytest.raises(TypeError, match="complex"):
        if op == "gradient":
            ad.gradient(b, lambda x: anp.sum(x) * (1 + 1j), x)
        elif op == "jacobian":
            ad.jacobian(b, lambda x: x * (1 + 1j), x)
        else:
            ad.pullback(b, lambda x: x * (1 + 1j), x)(np.ones(2))


# ------------------------------------------------------------ 5. leaked tracers
def test_a_list_dispatched_on_numpy_is_right_or_raises_never_silently_wrong(b):
    data = np.array([1.0, 2.0])
    f = lambda x: anp.concatenate([data, x])  # noqa: E731  numpy first: dispatches to numpy
    x = np.array([3.0, 4.0])
    want = np.vstack([np.zeros((2, 2)), np.eye(2)])
    try:
        jac = ad.jacobian(b, f, x)
    except ad.InvalidOutputError as err:
        assert "like=" in str(err)
        return
    except Exception as err:  # noqa: BLE001  the library's own refusal (jax, torch, tensorflow)
        assert not isinstance(err, AssertionError)
        return
    close(jac, want)


# ----------------------------------------------------- 6. the last good model is finite
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the point of the test
@pytest.mark.parametrize("implicit", [False, True], ids=["explicit", "implicit"])
def test_an_update_that_overflows_raises_with_a_finite_model(b, implicit):
    loss = lambda m, t: anp.sum((current_values(m)["w"] - t) ** 2)  # noqa: E731
    backend = ad.Implicit(b) if implicit else b
    model = ad.variables({"w": np.ones(2)}, b) if implicit else {"w": np.ones(2)}
    state = optim.setup(optim.Descent(1e308), model)
    with pytest.raises(ad.NonFiniteError) as err:
        ad.train_step(loss, model, (np.array([1e10, 0.0]),), state, backend=backend)
    values = ad.to_numpy(optree.tree_map(optim.read, err.value.model) if implicit else err.value.model)
    assert np.all(np.isfinite(values["w"])) and err.value.step == 1
    close(values["w"], [1.0, 1.0])  # nothing applied


# ------------------------------------------------------- 7. custom pytree nodes
class Namespaced:
    def __init__(self, w):
        self.w = w


optree.register_pytree_node(Namespaced, lambda n: ((n.w,), None), lambda _, c: Namespaced(*c), namespace="mine")


class Registered:
    def __init__(self, w, b):
        self.w, self.b = w, b


ad.register_pytree_node(Registered, lambda r: ((r.w, r.b), None), lambda _, c: Registered(*c))


def test_a_node_of_another_registry_is_refused_not_a_silent_none(b):
    with pytest.raises(ad.NonDifferentiableInputError, match="register_pytree_node"):
        ad.gradient(b, lambda p: anp.sum(p["n"].w ** 2) + anp.sum(p["v"]), {"n": Namespaced(np.ones(2)),
                                                                        "v": np.ones(1)})


def test_a_registered_node_is_differentiated(b):
    g = ad.gradient(b, lambda r: anp.sum(r.w**2) + 3 * r.b, Registered(np.array([1.0, 2.0]), np.array(0.5)))
    assert isinstance(g, Registered)
    close(g.w, [2.0, 4.0])
    close(g.b, 3.0)


def test_a_jax_tree_util_node_in_an_argument_is_data_as_jax_flattens_it():
    jax = pytest.importorskip("jax")

    class JaxNode:
        def __init__(self, w):
            self.w = w

    jax.tree_util.register_pytree_node(JaxNode, lambda n: ((n.w,), None), lambda _, c: JaxNode(*c))
    w = np.array([1.0, 2.0])
    close(ad.gradient("jax", lambda x, n: anp.sum(x * n.w), np.ones(2), JaxNode(w)), w)
    # its arrays are data, not constants baked into a plan: a new value gives the new gradient
    close(ad.gradient("jax", lambda x, n: anp.sum(x * n.w), np.ones(2), JaxNode(3 * w)), 3 * w)


# ------------------------------------------------------ the dtype promise for values
def gaussian_nll(params, x):
    """The library-authors guide's example: numpy 2 promotes float32 with np.log's float64."""
    mu, log_sigma = params["mu"], params["log_sigma"]
    z = (x - mu) * anp.exp(-log_sigma)
    return anp.sum(0.5 * z**2 + log_sigma) + 0.5 * np.log(2 * np.pi) * x.shape[0]


def test_float32_inputs_give_a_float32_value(b):
    params = {"mu": np.float32(0.5) * np.ones((), np.float32), "log_sigma": np.zeros((), np.float32)}
    x = np.array([0.1, -0.3, 0.8], dtype=np.float32)
    y, g = ad.value_and_gradient(b, gaussian_nll, params, x)
    assert ad.to_numpy(y).dtype == np.float32 and ad.to_numpy(g["mu"]).dtype == np.float32
    y, _ = ad.value_and_pullback(b, gaussian_nll, params, x)
    assert ad.to_numpy(y).dtype == np.float32


# --------------------------------------------------------------- clear errors
def test_asarray_inside_f_passes_traced_data_through(b):
    f = lambda x, d: anp.sum(b.asarray(d) * x) + anp.sum(b.asarray(x, "float64") * 0)  # noqa: E731
    close(ad.gradient(b, f, np.array([1.0, 2.0]), np.array([3.0, 4.0])), [3.0, 4.0])


def test_the_function_own_attribute_error_is_not_wrapped(b):
    class Mine(Exception):
        pass

    def f(x):
        raise Mine("f's own error")

    with pytest.raises(Mine):
        ad.gradient(b, f, np.ones(2))
    if b.name == "tensorflow":  # x.sum() does not exist on a tensor, traced or not: f's own AttributeError
        with pytest.raises(AttributeError) as err:
            ad.gradient(b, lambda x: x.sum(), np.ones(2))
        assert not isinstance(err.value, ad.TracedControlFlowError)


def test_a_captured_numpy_array_times_a_tensor_is_explained_or_works(b):
    w = np.array([1.0, 2.0])
    try:
        g = ad.gradient(b, lambda x: anp.sum(w * x), np.ones(2))
    except ad.InvalidOutputError as err:  # mlx, paddle: numpy converted the array and dropped its derivative
        assert "as an argument" in str(err) or "like=x" in str(err)
        return
    except TypeError as err:  # torch: numpy cannot multiply a tensor; the note says what to do
        assert any("Pass the array to f as an argument" in note for note in getattr(err, "__notes__", ()))
        return
    close(g, w)


def test_a_float64_batch_trains_a_float32_torch_module():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(3, 1)
    before = model.weight.detach().clone()
    x, y = np.random.default_rng(0).normal(size=(4, 3)), np.zeros((4, 1))  # float64 data
    loss = lambda m, x, y: ((m(x) - y) ** 2).mean()  # noqa: E731
    state = optim.setup(optim.Descent(0.1), model)
    state, model, value = ad.train_step(loss, model, (x, y), state, backend=ad.Implicit("torch"))
    assert value.dtype == torch.float32 and model.weight.dtype == torch.float32
    assert not torch.equal(model.weight.detach(), before)


# ------------------------------------------------------ found in review: more of the same
def test_implicit_training_follows_a_changed_global(b):
    """train_step wraps the loss twice (bound loss, implicit wrapper): both are looked through."""
    global SCALE
    vs = ad.variables({"w": np.array([1.0, 2.0])}, b)
    loss = lambda m, t: SCALE * anp.sum((current_values(m)["w"] - t) ** 2)  # noqa: E731
    state = optim.setup(optim.Descent(0.0), vs)
    try:
        values = []
        for scale in (1.0, 10.0):
            SCALE = scale
            state, vs, value = ad.train_step(loss, vs, (np.zeros(2),), state, backend=ad.Implicit(b))
            values.append(float(ad.to_numpy(value)))
    finally:
        SCALE = 2.0
    assert values == pytest.approx([5.0, 50.0])


def test_replaced_captured_arrays_are_released(b):
    """A global array replaced every step must not keep its old values (and traces) alive."""
    import gc
    import weakref

    global TABLE
    f = lambda x: anp.sum(x * TABLE)  # noqa: E731
    refs = []
    try:
        for k in range(6):
            TABLE = b.asarray(np.full(3, float(k)))
            try:
                refs.append(weakref.ref(TABLE))
            except TypeError:  # an array type without weak references: nothing to check
                pytest.skip(f"{type(TABLE).__name__} cannot be weakly referenced")
            close(ad.gradient(b, f, np.ones(3)), np.full(3, float(k)))
    finally:
        TABLE = None
    gc.collect()
    assert sum(r() is not None for r in refs[:-1]) <= 1, "old captured arrays kept alive"
    plans = [fn for entry in b._plans._functions.values() for fn in entry.values() if fn.f is f]
    assert len(plans) <= 1


def test_float64_data_makes_a_float64_value_on_every_backend(b):
    x, d = np.ones(3, dtype=np.float32), np.full(3, 1.0 + 1e-12)
    if b.name == "tensorflow":  # tensorflow never promotes: a clear error naming the dtypes (issue 24 item 11)
        with pytest.raises(ad.ArgumentTypeError, match="float32"):
            ad.value_and_gradient(b, lambda x, d: anp.sum(x * d), x, d)
        return
    y, _ = ad.value_and_gradient(b, lambda x, d: anp.sum(x * d), x, d)
    assert ad.to_numpy(y).dtype == np.float64


def test_a_tensorflow_variable_given_as_x_is_not_read_late():
    tf = pytest.importorskip("tensorflow")
    v = tf.Variable([1.0, 2.0], dtype=tf.float64)
    _, vjp = ad.value_and_pullback("tensorflow", lambda x: x * x, v)
    _, jvp = ad.value_and_pushforward("tensorflow", lambda x: x * x, v)
    v.assign([10.0, 10.0])
    close(vjp(np.ones(2)), [2.0, 4.0])
    close(jvp(np.ones(2)), [2.0, 4.0])


@pytest.mark.parametrize("name", ["finite_differences", "autograd", "torch", "jax", "tensorflow", "mlx", "paddle",
                                  "pytensor"])
def test_a_jax_tree_util_class_is_flattened_as_jax_flattens_it_never_a_none_gradient(name):
    jax = pytest.importorskip("jax")
    import dataclasses

    from abstractdiff._registry import unavailable_reason

    if unavailable_reason(name) is not None:
        pytest.skip(unavailable_reason(name))

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Pair:
        w: object
        b: object

    g = ad.gradient(name, lambda p: anp.sum(p.w**2) + anp.sum(p.w * p.b), Pair(np.array([1.0, 2.0]), np.zeros(2)))
    assert type(g) is Pair  # the user's own type, as jax.grad gives it
    close(ad.to_numpy(g.w), [2.0, 4.0])
    close(ad.to_numpy(g.b), [1.0, 2.0])


@pytest.mark.parametrize("name", ["finite_differences", "autograd", "torch", "jax", "tensorflow", "mlx", "paddle",
                                  "pytensor"])
def test_an_argument_that_is_a_container_of_one_array_reaches_f_as_the_container(name):
    # {"w": w} and (w,) are one leaf each, as a bare array is: the hot path of "every argument
    # one array" once handed f the bare array, and d[0] then silently read w's first element
    from abstractdiff._registry import unavailable_reason

    if unavailable_reason(name) is not None:
        pytest.skip(unavailable_reason(name))
    w = np.array([1.0, 2.0])
    for _ in range(2):  # the first call plans, the second takes the hot path
        close(ad.to_numpy(ad.gradient(name, lambda x, d: anp.sum(x * d["w"]), np.ones(2), {"w": w})), w)
        close(ad.to_numpy(ad.gradient(name, lambda x, t: anp.sum(x * t[0]), np.ones(2), (w,))), w)
        close(ad.to_numpy(ad.gradient(name, lambda x, t: anp.sum(x * t[0]), np.ones(2), [w])), w)


class _TorchNode:
    def __init__(self, w, b):
        self.w, self.b = w, b


@pytest.mark.parametrize("name", ["finite_differences", "autograd", "torch", "jax", "tensorflow", "mlx", "paddle",
                                  "pytensor"])
def test_a_torch_pytree_class_is_flattened_as_torch_flattens_it_never_a_none_gradient(name):
    torch_pytree = pytest.importorskip("torch.utils._pytree")
    from abstractdiff._registry import unavailable_reason

    if unavailable_reason(name) is not None:
        pytest.skip(unavailable_reason(name))
    if _TorchNode not in torch_pytree.SUPPORTED_NODES:
        torch_pytree.register_pytree_node(
            _TorchNode, lambda n: ([n.w, n.b], "context"), lambda children, _: _TorchNode(*children)
        )
    g = ad.gradient(name, lambda n: anp.sum(n.w**2) + anp.sum(n.w * n.b), _TorchNode(np.array([1.0, 2.0]), np.zeros(2)))
    assert type(g) is _TorchNode
    close(ad.to_numpy(g.w), [2.0, 4.0])
    close(ad.to_numpy(g.b), [1.0, 2.0])

"""The whole training step as one compiled call (abstractdiff._compiled_step): the same values
as the op-by-op step, one trace per form, exact keys, and every error path of the step."""

from __future__ import annotations

import collections
import gc
import time
import warnings
import weakref

import autoray
import numpy as np
import pytest

import abstractdiff as ad
import abstractdiff._compiled_step as cs
from abstractdiff import optim
from tests.test_train import need

#: the backends whose train_step compiles as a whole (MLX only with compile=True)
COMPILING = [("jax", {}), ("tensorflow", {}), ("mlx", {"compile": True})]
IDS = [name for name, _ in COMPILING]


def backend(name: str, options: dict):
    need(name)
    return ad.backend(name, **options)


class cs_off:
    """The whole-step compilation off (the reference path), as a context."""

    def __enter__(self):
        self.saved, cs._compiler = cs._compiler, lambda b: None

    def __exit__(self, *exc):
        cs._compiler = self.saved


def _convert(b, tree, dtype):
    from abstractdiff import _pytree

    return _pytree.tree_map(lambda a: b.convert(np.asarray(a, dtype=dtype)), tree)


def data(b, dtype: str):
    rng = np.random.default_rng(1)
    return b.convert(rng.standard_normal((16, 3)).astype(dtype)), b.convert(rng.standard_normal((16, 1)).astype(dtype))


def loss(m, x, y):
    h = autoray.do("tanh", x @ m["layer"]["w"] + m["layer"]["b"])
    return autoray.do("mean", (h @ m["out"][0] + m["out"][1] - y) ** 2)


RULES = {
    "adam": lambda: optim.Adam(1e-2),
    "adam-schedule": lambda: optim.Adam(optim.schedules.piecewise(1e-2, {2: 0.5, 4: 0.5})),
    "clip-chain": lambda: optim.chain(optim.ClipGlobalNorm(0.5), optim.ClipNorm(0.3),
                                      optim.AdamW(1e-2, weight_decay=0.1)),
    "momentum": lambda: optim.Momentum(1e-2, 0.9),
}


def run_steps(b, rule, dtype, n=6):
    model = _convert(b, _numpy_mlp(), dtype)
    x, y = data(b, dtype)
    state = optim.setup(rule, model)
    losses = []
    for _ in range(n):
        state, model, value = ad.train_step(loss, model, (x, y), state, backend=b)
        losses.append(float(ad.to_numpy(value)))
    return state, model, losses


def _numpy_mlp():
    rng = np.random.default_rng(0)
    return {"layer": {"w": rng.standard_normal((3, 5)) * 0.5, "b": np.zeros(5)},
            "out": [rng.standard_normal((5, 1)), np.zeros(1)]}


def leaves(tree):
    from abstractdiff import _pytree
    from abstractdiff._tree import is_array

    return [np.asarray(ad.to_numpy(a)) if is_array(a) else a for a in _pytree.tree_leaves(tree, none_is_leaf=True)]


def compiled_entries():
    return [e for e in cs.STEPS._entries._entries.values() if e.run is not cs._FAILED]


def compiled_and_op_by_op(fit):
    """``(fit(), fit())``: first with the whole step compiled (a fallback warning is an error,
    and a compiled step must exist after it), then op by op (the reference)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ad.CompileFallbackWarning)  # it did compile
        got = fit()
    assert compiled_entries(), "the step did not compile"
    with cs_off():
        want = fit()
    return got, want


#: every rule in both dtypes on jax; on the others, the clipping chain and a schedule (a lean grid:
#: a tf.function trace costs seconds), in float32 only on MLX (no float64 on its compiled path)
VALUE_CASES = [
    *[("jax", {}, rule, dtype) for rule in sorted(RULES) for dtype in ("float64", "float32")],
    ("tensorflow", {}, "clip-chain", "float64"), ("tensorflow", {}, "adam-schedule", "float32"),
    ("mlx", {"compile": True}, "clip-chain", "float32"), ("mlx", {"compile": True}, "adam-schedule", "float32"),
]


@pytest.mark.parametrize("name,options,rule,dtype", VALUE_CASES, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in VALUE_CASES])
def test_a_compiled_step_gives_the_op_by_op_values(name, options, rule, dtype):
    b = backend(name, options)
    cs.STEPS.clear()
    (state, model, losses), (want_state, want_model, want_losses) = compiled_and_op_by_op(
        lambda: run_steps(b, RULES[rule](), dtype))
    tol = 1e-12 if dtype == "float64" else 3e-5  # float32: the rule's scalars are traced in float32
    np.testing.assert_allclose(losses, want_losses, rtol=tol, atol=tol)
    for got, want in zip(leaves(model), leaves(want_model)):
        assert got.dtype == want.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert state.step == want_state.step == 6
    for got, want in zip(leaves(state.tree), leaves(want_state.tree)):
        if isinstance(want, int):  # the documented OptState: Python ints stay Python ints
            assert type(got) is int and got == want
        elif want is None:
            assert got is None
        else:
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name,options", COMPILING, ids=IDS)
def test_the_step_is_traced_once_and_a_schedule_never_retraces(name, options):
    b = backend(name, options)
    cs.STEPS.clear()
    run_steps(b, RULES["adam-schedule"](), "float32", n=2)
    traces = b.trace_count
    run_steps(b, RULES["adam-schedule"](), "float32", n=8)  # new arrays, same form, scheduled lr changing
    assert b.trace_count == traces
    assert len(compiled_entries()) == 1


def test_a_changed_global_the_loss_reads_is_seen():
    b = backend("jax", {})
    cs.STEPS.clear()
    global SCALE
    SCALE = 1.0

    def scaled(m, x, y):
        return SCALE * loss(m, x, y)

    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
    state = optim.setup(optim.Descent(0.1), model)
    _, _, first = ad.train_step(scaled, model, (x, y), state, backend=b)
    SCALE = 3.0
    _, new_model, second = ad.train_step(scaled, model, (x, y), state, backend=b)
    np.testing.assert_allclose(float(second), 3.0 * float(first), rtol=1e-12)
    with cs_off():
        _, want, _ = ad.train_step(scaled, model, (x, y), state, backend=b)
    for got, w in zip(leaves(new_model), leaves(want)):
        np.testing.assert_allclose(got, w, rtol=1e-12)


def test_an_adjusted_hyperparameter_is_not_a_stale_constant():
    b = backend("jax", {})
    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
    state = optim.setup(optim.Descent(0.1), model)
    _, a, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    _, c, _ = ad.train_step(loss, model, (x, y), optim.adjust(state, lr=0.2), backend=b)
    start, one, two = leaves(model), leaves(a), leaves(c)
    for s, p, q in zip(start, one, two):
        np.testing.assert_allclose(q - s, 2 * (p - s), rtol=1e-10, atol=1e-14)
    # -0.0 and 0.0 are different keys (value_key): neither finds the other's step
    assert cs._rule_key(optim.Descent(0.0), []) != cs._rule_key(optim.Descent(-0.0), [])


def test_frozen_paths_are_part_of_the_form():
    b = backend("jax", {})
    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
    state = optim.setup(optim.Adam(1e-2), model)
    _, free, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    _, frozen, _ = ad.train_step(loss, model, (x, y), optim.freeze(state, ("layer",)), backend=b)
    np.testing.assert_array_equal(ad.to_numpy(frozen["layer"]["w"]), ad.to_numpy(model["layer"]["w"]))
    assert not np.array_equal(ad.to_numpy(free["layer"]["w"]), ad.to_numpy(model["layer"]["w"]))
    np.testing.assert_allclose(ad.to_numpy(frozen["out"][0]), ad.to_numpy(free["out"][0]), rtol=1e-12)


@pytest.mark.parametrize("name,options", COMPILING, ids=IDS)
def test_a_non_finite_step_raises_and_applies_nothing(name, options):
    b = backend(name, options)
    model, (x, y) = _convert(b, _numpy_mlp(), "float32"), data(b, "float32")
    state = optim.setup(optim.Adam(1e-2), model)
    state, model, _ = ad.train_step(loss, model, (x, y), state, backend=b)  # compiled, finite
    bad = b.convert(np.full((16, 1), np.inf, dtype="float32"))
    with pytest.raises(ad.NonFiniteError, match="step 2") as info:
        ad.train_step(loss, model, (x, bad), state, backend=b)
    assert info.value.state is state and info.value.model is model and info.value.step == 2
    assert compiled_entries()


def test_a_rule_that_needs_a_concrete_number_runs_op_by_op_with_a_warning():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class SignIfLarge(optim.Rule):
        lr: float = 0.1

        def apply(self, state, x, g):
            big = float(ad.to_numpy(autoray.do("max", autoray.do("abs", g)))) > 1.0  # needs the value
            return None, self.lr * (g / 2 if big else g)

    b = backend("jax", {})
    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
    state = optim.setup(SignIfLarge(), model)
    with pytest.warns(ad.CompileFallbackWarning, match="op by op"):
        got_state, got, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ad.CompileFallbackWarning)  # once per form, not per step
        ad.train_step(loss, model, (x, y), state, backend=b)
    with cs_off():
        _, want, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    for g, w in zip(leaves(got), leaves(want)):
        np.testing.assert_array_equal(g, w)
    assert got_state.step == 1


def test_forms_that_do_not_compile_take_the_op_by_op_step_silently():
    b = backend("jax", {})
    x, y = data(b, "float64")
    mixed = _convert(b, _numpy_mlp(), "float64")
    mixed["out"][1] = b.convert(np.zeros(1, dtype="float32"))  # two float dtypes: no one step dtype
    numpy_model = _numpy_mlp()  # numpy leaves: converted by the op-by-op step first
    for model in (mixed, numpy_model):
        state = optim.setup(optim.Adam(1e-2), model)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ad.CompileFallbackWarning)
            state, new, _ = ad.train_step(loss, model, (x, y), state, backend=b)
        assert state.step == 1
    # the numpy model's second step (converted now) compiles
    cs.STEPS.clear()
    ad.train_step(loss, new, (x, y), state, backend=b)
    assert compiled_entries()


@pytest.mark.parametrize("stride", [0, 2])
def test_a_rules_python_int_that_is_not_a_step_count_comes_back_exact(stride):
    # the compiled step builds the new state with each int one more (Adam's t) while the
    # library computes, and again where the report says otherwise
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Strided(optim.Rule):
        lr: float = 0.1

        def init(self, x):
            return 5

        def apply(self, state, x, g):
            return state + stride, self.lr * g * (1 + 0 * state)

    b = backend("jax", {})
    cs.STEPS.clear()

    def fit():
        model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
        state = optim.setup(Strided(), model)
        for _ in range(3):
            state, model, _ = ad.train_step(loss, model, (x, y), state, backend=b)
        return state, model

    (state, model), (want_state, want_model) = compiled_and_op_by_op(fit)
    counts = [c for c in leaves(state.tree) if isinstance(c, int)]
    assert counts == [c for c in leaves(want_state.tree) if isinstance(c, int)] == [5 + 3 * stride] * 4
    assert all(type(c) is int for c in counts)
    for g, w in zip(leaves(model), leaves(want_model)):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,options", COMPILING, ids=IDS)
def test_chains_of_one_form_at_different_steps_interleave_exactly(name, options):
    # a step's Python-int state leaves (Adam's step counts) go in as the last step's report
    # where they are the ints it reported: chains of one form at other step counts must not
    # be given the other chain's counts
    b = backend(name, options)
    cs.STEPS.clear()

    def chains():
        model, (x, y) = _convert(b, _numpy_mlp(), "float32"), data(b, "float32")
        rule = optim.Adam(1e-2)  # one rule object: both chains meet the same plan
        ahead = [optim.setup(rule, model), model]
        for _ in range(3):
            ahead[0], ahead[1], _ = ad.train_step(loss, ahead[1], (x, y), ahead[0], backend=b)
        behind = [optim.setup(rule, model), model]
        for _ in range(4):
            for chain in (ahead, behind):
                chain[0], chain[1], _ = ad.train_step(loss, chain[1], (x, y), chain[0], backend=b)
        return ahead, behind

    got = chains()
    assert len(compiled_entries()) == 1
    with cs_off():
        want = chains()
    for (g_state, g_model), (w_state, w_model) in zip(got, want):
        assert g_state.step == w_state.step
        for g, w in zip(leaves((g_state.tree, g_model)), leaves((w_state.tree, w_model))):
            if isinstance(w, int):
                assert type(g) is int and g == w
            else:
                np.testing.assert_allclose(g, w, rtol=3e-5, atol=3e-5)


def test_a_checkpoint_of_compiled_steps_resumes_to_the_same_values(tmp_path):
    b = backend("jax", {})
    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
    state = optim.setup(optim.Adam(optim.schedules.piecewise(1e-2, {2: 0.5, 4: 0.5})), model)
    for _ in range(3):
        state, model, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    ad.save_checkpoint(tmp_path / "ck.npz", state, model)
    straight_state, straight = state, model
    for _ in range(3):
        straight_state, straight, _ = ad.train_step(loss, straight, (x, y), straight_state, backend=b)
    state, model = ad.load_checkpoint(tmp_path / "ck.npz", like=(state, model))
    for _ in range(3):
        state, model, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    for got, want in zip(leaves(model), leaves(straight)):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert state.step == straight_state.step == 6


def test_train_takes_the_compiled_step():
    b = backend("jax", {})
    cs.STEPS.clear()
    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
    result = ad.train(loss, model, [(x, y)] * 4, optim.setup(optim.Adam(1e-2), model), backend=b, epochs=2)
    assert result.state.step == 8 and compiled_entries()
    with cs_off():
        want = ad.train(loss, model, [(x, y)] * 4, optim.setup(optim.Adam(1e-2), model), backend=b, epochs=2)
    for got, w in zip(leaves(result.model), leaves(want.model)):
        np.testing.assert_allclose(got, w, rtol=1e-12)


def test_a_bound_method_loss_reuses_its_compiled_step():
    class Task:
        def loss(self, m, x, y):
            return loss(m, x, y)

    b = backend("jax", {})
    cs.STEPS.clear()
    task = Task()
    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
    state = optim.setup(optim.Descent(0.1), model)
    for _ in range(3):
        state, model, _ = ad.train_step(task.loss, model, (x, y), state, backend=b)  # a new method object each time
    traces = b.trace_count
    ad.train_step(task.loss, model, (x, y), state, backend=b)
    assert b.trace_count == traces and len(compiled_entries()) == 1


def test_a_dead_loss_function_leaves_no_compiled_step():
    b = backend("jax", {})
    cs.STEPS.clear()
    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")

    def own_loss(m, x, y):
        return loss(m, x, y)

    ref = weakref.ref(own_loss)
    state = optim.setup(optim.Descent(0.1), model)
    for _ in range(3):
        state, model, _ = ad.train_step(own_loss, model, (x, y), state, backend=b)
    assert compiled_entries()
    del own_loss
    gc.collect()
    assert ref() is None, "the compiled step keeps the loss function alive"
    assert not compiled_entries()


def test_a_plan_holds_no_arrays_of_the_step_it_was_made_from():
    b = backend("jax", {})
    cs.STEPS.clear()
    model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
    state = optim.setup(optim.Adam(1e-2), model)
    first = weakref.ref(model["layer"]["w"])
    state, model, _ = ad.train_step(loss, model, (x, y), state, backend=b)  # makes the plan, compiles
    for _ in range(3):
        state, model, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    gc.collect()
    assert first() is None, "a plan keeps the first step's model arrays alive"


# ------------------------------------------------------------------ the loop's plan, recognised by its structure
def _reordered(m):
    return collections.OrderedDict(reversed(list(m.items())))


#: a model (and state) changed between steps into containers of other kinds: each is another
#: form, whose step gives back the containers the op-by-op step gives back
CONTAINER_CHANGES = {
    "ordered-model-and-state": lambda m, s: (_reordered(m), s._replace(tree=_reordered(s.tree))),
    "ordered-model-dict-state": lambda m, s: (_reordered(m), s),  # the state comes back an OrderedDict
    "defaultdict-model": lambda m, s: (collections.defaultdict(list, m), s),
    "nested-dict-replaced-in-place": lambda m, s: (m.__setitem__("layer", _reordered(m["layer"])) or m, s),
    # dicts whose keys come in another order (which a structure's equality ignores)
    "model-keys-reordered": lambda m, s: (dict(reversed(list(m.items()))), s),
    "model-and-state-keys-reordered": lambda m, s: (dict(reversed(list(m.items()))),
                                                    s._replace(tree=dict(reversed(list(s.tree.items()))))),
    "state-keys-reordered": lambda m, s: (m, s._replace(tree=dict(reversed(list(s.tree.items()))))),
}


@pytest.mark.parametrize("change", sorted(CONTAINER_CHANGES))
def test_containers_of_other_kinds_are_other_forms(change):
    # a step recognises the last plan's form by its structure's own flatten, which takes an
    # OrderedDict or a defaultdict for a dict, and ignores (as the structure's equality does)
    # the order of a dict's keys: the plan checks the dicts' types and orders itself
    b = backend("jax", {})
    cs.STEPS.clear()

    def fit():
        model, (x, y) = _convert(b, _numpy_mlp(), "float64"), data(b, "float64")
        state, values = optim.setup(optim.Adam(1e-2), model), []
        for i in range(6):
            if i == 3:
                model, state = CONTAINER_CHANGES[change](model, state)
            state, model, value = ad.train_step(loss, model, (x, y), state, backend=b)
            values.append(float(ad.to_numpy(value)))
        return state, model, values

    (state, model, values), (want_state, want_model, want_values) = compiled_and_op_by_op(fit)
    np.testing.assert_allclose(values, want_values, rtol=1e-12, atol=1e-12)
    assert type(model) is type(want_model) and list(model) == list(want_model)
    assert type(model["layer"]) is type(want_model["layer"]) and list(model["layer"]) == list(want_model["layer"])
    assert type(state.tree) is type(want_state.tree) and list(state.tree) == list(want_state.tree)
    for got, want in zip(leaves((model, state.tree)), leaves((want_model, want_state.tree))):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_batch_of_another_dtype_is_another_form():
    # the plan's call is the compiler's for its arrays' dtypes (jax: in its x64 scope or not):
    # a numpy float64 batch after float32 ones must not run float32's (outside the x64 scope
    # jax takes numpy float64 as float32)
    b = backend("jax", {})
    cs.STEPS.clear()
    x32, y32 = data(b, "float32")
    x64, y64 = (np.asarray(ad.to_numpy(a)) for a in data(b, "float64"))

    def fit():
        model = _convert(b, _numpy_mlp(), "float32")
        state, values = optim.setup(optim.Adam(1e-2), model), []
        for x, y in [(x32, y32)] * 2 + [(x64, y64)] * 2 + [(x32, y32)]:
            state, model, value = ad.train_step(loss, model, (x, y), state, backend=b)
            values.append(np.asarray(ad.to_numpy(value)))
        return model, values

    (model, values), (want_model, want_values) = compiled_and_op_by_op(fit)
    assert [v.dtype for v in values] == [v.dtype for v in want_values]
    assert values[2].dtype == np.float64  # the float64 batch's loss, in float64
    np.testing.assert_allclose(values, want_values, rtol=3e-5, atol=3e-5)
    for got, want in zip(leaves(model), leaves(want_model)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5)


def test_a_steps_inputs_are_held_to_the_next_dispatch_only_while_small():
    # the arrays a loop lets go of when it rebinds to a step's results are freed at the next
    # step's dispatch (while the library computes), where the model and state are small
    b = backend("jax", {})
    cs.STEPS.clear()
    x, y = data(b, "float64")

    def wide_loss(m, x, y):
        return autoray.do("mean", (x @ m["w"][:3, :1] - y) ** 2) + 0 * autoray.do("sum", m["w"])

    for size, held in [(400, False), (5, True)]:  # 160,000 elements (x3 with Adam's state), 25
        model = {"w": b.convert(np.ones((max(size, 3), size)) * 0.1)}
        state = optim.setup(optim.Adam(1e-2), model)
        first = weakref.ref(model["w"])
        state, model, _ = ad.train_step(wide_loss, model, (x, y), state, backend=b)
        assert compiled_entries()
        gc.collect()
        assert (first() is not None) is held, f"size {size}: held {first() is not None}"
        second = weakref.ref(model["w"])
        state, model, _ = ad.train_step(wide_loss, model, (x, y), state, backend=b)
        gc.collect()
        assert first() is None, "the first step's inputs outlive the next dispatch"
    assert second() is not None  # the last step's inputs (small), until a next dispatch or a clear
    cs.STEPS.clear()
    gc.collect()
    assert second() is None


# ------------------------------------------------------------------ implicit Keras on tensorflow
@pytest.fixture
def keras_tf():
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "tensorflow":
        pytest.skip(f"Keras runs on {keras.backend.backend()} here (tests/test_keras.py covers each Keras backend)")
    return tf, keras


def test_an_implicit_keras_step_compiles_as_one_tf_function(keras_tf):
    tf, keras = keras_tf
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 4)).astype("float32"), rng.standard_normal((32, 1)).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])

    def mse(model, x, y):
        return keras.ops.mean((model(x) - y) ** 2)

    def fit(n=5):
        model = make()
        state = optim.setup(optim.chain(optim.ClipNorm(1.0), optim.Adam(1e-2)), model)
        for _ in range(n):
            state, model, _ = ad.train_step(mse, model, (x, y), state, backend=ad.Implicit("tensorflow"))
        return state, model

    cs.STEPS.clear()
    (state, model), (want_state, want) = compiled_and_op_by_op(fit)
    for v, w in zip(model.trainable_variables, want.trainable_variables):
        np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=3e-5, atol=3e-5)
    assert state.step == want_state.step == 5 and state.implicit
    # a non-finite batch: nothing assigned (the graph selects the old values), the error raised
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ad.NonFiniteError):
        ad.train_step(mse, model, (x, np.full_like(y, np.nan)), state, backend=ad.Implicit("tensorflow"))
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_a_state_set_up_for_other_variables_is_refused_after_compiled_steps(keras_tf):
    tf, keras = keras_tf
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 4)).astype("float32"), rng.standard_normal((16, 1)).astype("float32")

    def make():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])

    def mse(model, x, y):
        return keras.ops.mean((model(x) - y) ** 2)

    rule, b = optim.Adam(1e-2), ad.Implicit("tensorflow")
    first, second = make(), make()
    mine, other = optim.setup(rule, first), optim.setup(rule, second)  # one rule object, two set-ups
    for _ in range(2):
        mine, first, _ = ad.train_step(mse, first, (x, y), mine, backend=b)  # compiled, the plan made
    assert compiled_entries()
    before = [v.numpy().copy() for v in first.trainable_variables]
    with pytest.raises(ad.UnknownVariableError, match="not the variable the optimiser state was set up for"):
        ad.train_step(mse, first, (x, y), other, backend=b)
    for v, was in zip(first.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), was)


@pytest.mark.parametrize("last_wait", [0.0, 1.0], ids=["polls", "blocks"])
def test_jax_to_numpy_of_a_result_being_computed_gives_its_values(last_wait):
    # the compiled step's sync polls a result still being computed where the waits were
    # short (a blocked thread wakes late), and blocks where they were long
    need("jax")
    import jax

    b = ad.backend("jax")
    adapter = b.adapter
    adapter._wait = last_wait
    x = np.linspace(0.0, 1.0, 384 * 384).reshape(384, 384)  # long enough to be pending when to_numpy starts
    a = jax.jit(lambda m: (m @ m @ m).sum(axis=0))(b.convert(x.astype(np.float32)))
    pending = not a.is_ready()
    start = time.perf_counter()
    got = b.to_numpy(a)
    waited = time.perf_counter() - start
    np.testing.assert_allclose(got, (x @ x @ x).sum(axis=0), rtol=1e-4)
    if pending:  # the wait moved the smoothed length by its weight: one late result does not flip the mode
        assert adapter._wait != last_wait
        if last_wait == 0.0:
            assert 0.0 < adapter._wait <= 0.2 * waited
        else:  # a long-waiting loop needs several short waits to poll again
            assert 0.8 * last_wait < adapter._wait < last_wait

"""train_step and train: explicit and implicit mode, callbacks, progress, non-finite steps."""

from __future__ import annotations

import sys

import autoray
import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim
from abstractdiff._implicit import current_values
from abstractdiff.parity import mlp_data, mlp_init, mlp_loss


def need(name: str):
    try:
        return ad.backend(name)
    except ad.BackendUnavailableError as err:
        pytest.skip(str(err))


def quadratic(model, c):
    return autoray.do("sum", (current_values(model)["w"] - c) ** 2)


TARGET = np.array([1.0, -2.0, 3.0])


# ------------------------------------------------------------------ explicit
def test_train_explicit_returns_state_and_model_and_learns():
    data = mlp_data()
    model = mlp_init()
    start = float(np.mean([mlp_loss(model, x, y) for x, y in data]))
    state = optim.setup(optim.Adam(0.05), model)
    state, trained = ad.train(mlp_loss, model, data, state, backend="autograd" if "autograd" in
                              ad.available_backends() else "finite_differences", epochs=8, progress=False)
    assert state.step == 8 * len(data)
    end = float(np.mean([mlp_loss(ad.to_numpy(trained), x, y) for x, y in data]))
    assert end < 0.5 * start
    np.testing.assert_array_equal(model["w0"], mlp_init()["w0"])  # the input model is not mutated


@pytest.mark.parametrize("name", ["torch", "jax", "tensorflow", "autograd"])
def test_train_step_converts_numpy_model_and_leaves_inputs_alone(name):
    b = need(name)
    model = {"w": np.zeros(3), "n": 2}
    state = optim.setup(optim.Momentum(0.1), model)
    saved = model["w"].copy()
    state, new, loss = ad.train_step(quadratic, model, (TARGET,), state, backend=b)
    assert b.is_native(new["w"]) and b.is_native(loss) and new["n"] == 2
    assert ad.to_numpy(new["w"]).dtype == np.float64
    np.testing.assert_allclose(ad.to_numpy(new["w"]), 0.2 * TARGET, rtol=1e-12)
    np.testing.assert_allclose(float(ad.to_numpy(loss)), 14.0, rtol=1e-12)
    np.testing.assert_array_equal(model["w"], saved)
    assert state.step == 1 and b.is_native(state.tree["w"])


def test_jax_float64_training_keeps_float64_without_global_x64():
    need("jax")
    import jax

    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Adam(0.1), model)
    state, model = ad.train(quadratic, model, [(TARGET,)] * 3, state, backend="jax", progress=False)
    assert str(model["w"].dtype) == "float64" and str(state.tree["w"][0].dtype) == "float64"
    assert not jax.config.jax_enable_x64


def test_a_single_array_batch_is_passed_as_one_argument():
    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Descent(0.5), model)
    state, model, loss = ad.train_step(quadratic, model, TARGET, state, backend="finite_differences")
    np.testing.assert_allclose(model["w"], TARGET, rtol=1e-8)


# ------------------------------------------------------------------ implicit
@pytest.mark.parametrize("name", ["finite_differences", "jax", "autograd", "torch", "tensorflow"])
def test_implicit_variables_are_updated_in_place(name):
    if name != "finite_differences":
        need(name)
    b = ad.Implicit(name)
    vs = ad.variables({"w": np.zeros(3)}, b)
    box = vs["w"]
    state = optim.setup(optim.Momentum(0.1, 0.5), vs)
    assert state.implicit
    state, same, loss = ad.train_step(quadratic, vs, (TARGET,), state, backend=b)
    assert same is vs and vs["w"] is box
    np.testing.assert_allclose(ad.to_numpy(vs)["w"], 0.2 * TARGET, rtol=1e-9)
    state, vs = ad.train(quadratic, vs, [(TARGET,)] * 100, state, backend=b, progress=False)
    np.testing.assert_allclose(ad.to_numpy(vs)["w"], TARGET, rtol=1e-6)
    assert state.step == 101


def test_implicit_torch_module_trains_without_touching_grad():
    torch = need("torch") and __import__("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    x = np.random.default_rng(0).normal(size=(32, 4))
    y = x.sum(axis=1, keepdims=True)

    def loss(m, x, y):
        return ((m(x) - y) ** 2).mean()

    first = net[0].weight
    state = optim.setup(optim.Adam(0.01), net)
    with torch.no_grad():
        start = float(loss(net, torch.as_tensor(x), torch.as_tensor(y)))
    state, out = ad.train(loss, net, [(x, y)] * 200, state, backend=ad.Implicit("torch"), progress=False)
    assert out is net and net[0].weight is first
    assert all(p.grad is None for p in net.parameters()), ".grad must stay untouched"
    with torch.no_grad():
        assert float(loss(net, torch.as_tensor(x), torch.as_tensor(y))) < 0.1 * start


def test_implicit_keras_model_trains_in_place():
    need("tensorflow")
    import keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip("Keras runs on the tensorflow backend only here")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def loss(m, x, y):
        import tensorflow as tf

        return tf.reduce_mean((m(x) - y) ** 2)

    start = float(loss(model, x, y))
    state = optim.setup(optim.Adam(0.01), model)
    state, out = ad.train(loss, model, [(x, y)] * 150, state, backend=ad.Implicit("tensorflow"), progress=False)
    assert out is model
    assert float(loss(model, x, y)) < 0.3 * start


def test_implicit_jax_numpy_float64_boxes_stay_float64():
    need("jax")
    import jax

    w = ad.Variable(np.ones(3))  # numpy float64, updated with jax float64 gradients
    state = optim.setup(optim.Adam(0.1), [w])

    def loss(ws, x):
        return ((ws[0].value - x) ** 2).sum()

    state, _, value = ad.train_step(loss, [w], (np.zeros(3),), state, backend=ad.Implicit("jax"))
    assert ad.to_numpy(w.value).dtype == np.float64
    # Adam's first step moves every element by lr * g / (|g| + eps), g = 2
    np.testing.assert_allclose(ad.to_numpy(w.value), 1 - 0.1 * 2 / (2 + 1e-8), rtol=1e-12)
    assert float(ad.to_numpy(value)) == 3.0
    assert not jax.config.jax_enable_x64


def test_training_does_not_keep_the_model_or_loss_alive():
    torch = need("torch") and __import__("torch")
    import gc
    import weakref

    def run():
        m = torch.nn.Linear(4, 1)
        loss = lambda m, x: m(x).sum()  # noqa: E731
        state = optim.setup(optim.Descent(0.1), m)
        data = [(np.ones((2, 4), dtype="float32"),)] * 2
        ad.train(loss, m, data, state, backend=ad.Implicit("torch"), progress=False)
        return weakref.ref(m), weakref.ref(loss)

    model, loss = run()
    gc.collect()
    assert model() is None and loss() is None


def test_alternating_models_do_not_retrace():
    jb = need("jax")
    b = ad.Implicit(jb)
    m1, m2 = ad.variables({"w": np.ones(3)}, jb), ad.variables({"w": np.ones(3)}, jb)
    s1, s2 = optim.setup(optim.Descent(0.1), m1), optim.setup(optim.Descent(0.1), m2)
    s1, m1, _ = ad.train_step(quadratic, m1, (TARGET,), s1, backend=b)
    s2, m2, _ = ad.train_step(quadratic, m2, (TARGET,), s2, backend=b)
    before = jb.trace_count
    for _ in range(3):  # a GAN's two models, one step each in turn
        s1, m1, _ = ad.train_step(quadratic, m1, (TARGET,), s1, backend=b)
        s2, m2, _ = ad.train_step(quadratic, m2, (TARGET,), s2, backend=b)
    assert jb.trace_count == before
    want = TARGET + 0.8**4 * (1 - TARGET)  # Descent(0.1) on sum((w - c)^2): w - c shrinks by 0.8 a step
    np.testing.assert_allclose(ad.to_numpy(m1)["w"], want, rtol=1e-12)
    np.testing.assert_allclose(ad.to_numpy(m2)["w"], want, rtol=1e-12)


def test_bound_functions_are_bounded_in_number():
    from abstractdiff._train import _BOUND

    b = ad.Implicit("finite_differences")
    models = [ad.variables({"w": np.zeros(3)}, b) for _ in range(_BOUND.size + 4)]  # dicts: held strongly
    for m in models:
        ad.train_step(quadratic, m, (TARGET,), optim.setup(optim.Descent(0.1), m), backend=b)
    assert len(_BOUND) <= _BOUND.size


# ------------------------------------------------------------------ callbacks and progress
def test_callbacks_see_every_step_and_can_stop():
    seen = []

    def record(info):
        seen.append(info)

    def stop_at_3(info):
        return False if info.step == 3 else None

    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Descent(0.1), model)
    data = [(TARGET,)] * 4
    state, model = ad.train(quadratic, model, data, state, backend="finite_differences", epochs=2,
                            callbacks=[record, stop_at_3], progress=False)
    assert [i.step for i in seen] == [1, 2, 3] and state.step == 3
    assert [i.epoch for i in seen] == [0, 0, 0]
    assert isinstance(seen[0].loss, float)
    assert seen[0].loss == pytest.approx(14.0)  # the loss before the first update
    assert seen[1].loss == pytest.approx(14.0 * 0.8**2)
    assert seen[-1].model is model and seen[-1].state is state


def test_epochs_count_in_callbacks():
    epochs = []
    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Descent(0.1), model)
    ad.train(quadratic, model, [(TARGET,)] * 2, state, backend="finite_differences", epochs=3,
             callbacks=[lambda i: epochs.append((i.epoch, i.step))], progress=False)
    assert epochs == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (2, 6)]


def test_progress_false_prints_nothing(capsys):
    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Descent(0.1), model)
    ad.train(quadratic, model, [(TARGET,)] * 3, state, backend="finite_differences", progress=False)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_progress_bar_shows_the_running_loss(capsys):
    pytest.importorskip("tqdm")
    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Descent(0.1), model)
    ad.train(quadratic, model, [(TARGET,)] * 3, state, backend="finite_differences", progress=True)
    err = capsys.readouterr().err
    assert "loss=" in err and "3/3" in err


def test_progress_without_tqdm_prints_a_line_per_epoch(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import tqdm.auto now raises ImportError
    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Descent(0.1), model)
    ad.train(quadratic, model, [(TARGET,)] * 3, state, backend="finite_differences", epochs=2, progress=True)
    err = capsys.readouterr().err
    # epochs count from 0, as StepInfo.epoch; the fraction is how many of the run's are done
    assert "epoch 0 (1/2): step 3, loss " in err and "epoch 1 (2/2): step 6, loss " in err


# ------------------------------------------------------------------ non-finite steps
def _nan_data():
    bad = np.array([np.nan, 0.0, 0.0])
    return [(TARGET,), (TARGET,), (bad,), (TARGET,)]


def test_non_finite_loss_stops_before_the_update_explicit():
    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Momentum(0.1), model)
    good_state, good_model = ad.train(quadratic, model, _nan_data()[:2], state, backend="finite_differences",
                                      progress=False)
    with pytest.raises(ad.NonFiniteError, match="step 3") as info:
        ad.train(quadratic, model, _nan_data(), state, backend="finite_differences", progress=False)
    err = info.value
    assert err.step == 3 and err.state.step == 2
    np.testing.assert_array_equal(err.model["w"], good_model["w"])
    np.testing.assert_array_equal(err.state.tree["w"], good_state.tree["w"])
    assert isinstance(err, FloatingPointError)


def test_non_finite_gradient_with_finite_loss_is_caught():
    name = next((n for n in ("torch", "jax", "autograd") if n in ad.available_backends()), None)
    if name is None:
        pytest.skip("needs an exact AD backend (sqrt has an infinite derivative at 0)")

    def loss(m, c):
        return autoray.do("sum", autoray.do("sqrt", autoray.do("abs", m["w"] - c)))

    model = {"w": np.array([1.0, 2.0])}
    state = optim.setup(optim.Descent(0.1), model)
    with pytest.raises(ad.NonFiniteError, match="not finite") as info:
        ad.train_step(loss, model, (np.array([1.0, 0.0]),), state, backend=name)
    assert info.value.step == 1
    np.testing.assert_array_equal(ad.to_numpy(info.value.model["w"]), [1.0, 2.0])


@pytest.mark.parametrize("name", ["finite_differences", "torch", "tensorflow", "jax"])
def test_non_finite_leaves_implicit_variables_at_last_good_values(name):
    if name != "finite_differences":
        need(name)
    b = ad.Implicit(name)
    vs = ad.variables({"w": np.zeros(3)}, b)
    state = optim.setup(optim.Adam(0.1), vs)
    state, _ = ad.train(quadratic, vs, _nan_data()[:2], state, backend=b, progress=False)
    good = ad.to_numpy(vs)["w"].copy()
    with pytest.raises(ad.NonFiniteError) as info:
        ad.train(quadratic, vs, _nan_data()[2:], state, backend=b, progress=False)
    assert info.value.step == 3 and info.value.state.step == 2 and info.value.model is vs
    np.testing.assert_array_equal(ad.to_numpy(vs)["w"], good)
    assert np.all(np.isfinite(good))


# ------------------------------------------------------------------ errors
def test_mode_mismatches_say_what_to_do():
    vs = ad.variables({"w": np.zeros(3)}, "finite_differences")
    state = optim.setup(optim.Descent(0.1), vs)
    with pytest.raises(ad.ModeMismatchError, match=r"ad.Implicit\('finite_differences'\)"):
        ad.train_step(quadratic, vs, (TARGET,), state, backend="finite_differences")
    explicit_state = optim.setup(optim.Descent(0.1), {"w": np.zeros(3)})
    with pytest.raises(ad.ModeMismatchError, match="set up for a pytree of arrays"):
        ad.train_step(quadratic, vs, (TARGET,), explicit_state, backend=ad.Implicit("finite_differences"))
    with pytest.raises(TypeError, match="OptState"):
        ad.train_step(quadratic, {"w": np.zeros(3)}, (TARGET,), None, backend="finite_differences")


def test_train_checks_epochs_and_one_shot_data():
    model = {"w": np.zeros(3)}
    state = optim.setup(optim.Descent(0.1), model)
    with pytest.raises(ValueError, match="epochs must be"):
        ad.train(quadratic, model, [(TARGET,)], state, backend="finite_differences", epochs=-1)
    with pytest.raises(TypeError, match="one-shot iterator"):
        ad.train(quadratic, model, ((TARGET,) for _ in range(2)), state, backend="finite_differences", epochs=2)
    same_state, same_model = ad.train(quadratic, model, [(TARGET,)], state, backend="finite_differences", epochs=0)
    assert same_state is state and same_model is model
    # a generator is fine for one epoch
    state, _ = ad.train(quadratic, model, ((TARGET,) for _ in range(2)), state, backend="finite_differences",
                        progress=False)
    assert state.step == 2


# ------------------------------------------------------------------ the example
def test_digits_example_runs_and_saves_the_plot(tmp_path):
    import subprocess
    from pathlib import Path

    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    names = [n for n in ("autograd", "torch") if n in ad.available_backends()] or ["finite_differences"]
    script = Path(__file__).resolve().parents[1] / "examples" / "digits.py"
    out = tmp_path / "loss.png"
    steps = "20" if names != ["finite_differences"] else "1"
    run = subprocess.run(
        [sys.executable, str(script), str(out), "--steps", steps, "--backends", ",".join(names)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    for name in names:
        assert f"{name:<12} test accuracy" in run.stdout
    assert "largest relative difference" in run.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

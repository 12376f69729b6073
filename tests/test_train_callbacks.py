"""ad.train's history, epoch-end callbacks, validation, early stopping and checkpoints.

Losses are checked against values recomputed independently (the closed form of
gradient descent on a quadratic), on finite differences, autograd and torch, explicit and
implicit (``ad.Implicit``).
"""

from __future__ import annotations

import os
import socket
import sys

import autoray
import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim
from abstractdiff.callbacks import Callback, Checkpoint, EarlyStopping

from .test_train import need, quadratic  # the same skip helper and loss

C1, C2 = np.array([1.0, -2.0, 3.0]), np.array([0.5, 0.0, -1.0])
DATA = [(C1,), (C2,)]
LR = 0.1
# (backend name, implicit?)
MODES = [("finite_differences", False), ("autograd", False), ("torch", False),
         ("finite_differences", True), ("torch", True)]
IDS = [f"{'implicit-' if imp else ''}{name}" for name, imp in MODES]


def setup(name: str, implicit: bool, w0=None):
    """(backend, model, state) for the quadratic, starting at w0."""
    if name != "finite_differences":
        need(name)
    w0 = np.zeros(3) if w0 is None else w0
    b = ad.Implicit(name) if implicit else ad.backend(name)
    model = ad.variables({"w": w0.copy()}, b) if implicit else {"w": w0.copy()}
    return b, model, optim.setup(optim.Descent(LR), model)


def expected_losses(data, epochs, w0=None):
    """Descent(LR) on sum((w - c)^2), by hand: every step's loss (before its update) and w."""
    w = np.zeros(3) if w0 is None else w0.copy()
    losses = []
    for _ in range(epochs):
        for (c,) in data:
            losses.append(float(np.sum((w - c) ** 2)))
            w = w - LR * 2 * (w - c)
    return losses, w


def rtol(name):
    return 1e-6 if name == "finite_differences" else 1e-12


def w_of(model):
    return np.array(ad.to_numpy(model)["w"], copy=True)


class Recorder(Callback):
    """Every hook call, in order, with the epoch and step numbers and copies of the values."""

    def __init__(self, tag="r", log=None):
        self.tag, self.log = tag, [] if log is None else log
        self.epochs: list = []

    def on_train_begin(self, state, model, distributed):
        self.log.append((self.tag, "begin", state.step))

    def on_step_end(self, info):
        self.log.append((self.tag, "step", info.epoch, info.step))

    def on_epoch_end(self, info):
        self.log.append((self.tag, "epoch", info.epoch, info.step))
        self.epochs.append(info)

    def on_train_end(self, state, model):
        self.log.append((self.tag, "end", state.step))


# ------------------------------------------------------------------ history
@pytest.mark.parametrize("name,implicit", MODES, ids=IDS)
def test_history_records_every_step_loss_and_epoch_means(name, implicit):
    b, model, state = setup(name, implicit)
    run = ad.train(quadratic, model, DATA, state, backend=b, epochs=3, progress=False)
    want, w = expected_losses(DATA, 3)
    h = run.history
    assert isinstance(run, ad.TrainResult) and isinstance(h, ad.History)
    np.testing.assert_allclose(h.losses, want, rtol=rtol(name))
    assert h.steps == [1, 2, 3, 4, 5, 6] and h.epochs == [0, 1, 2]
    assert set(h.metrics) == {"loss"}
    np.testing.assert_allclose(h.metrics["loss"], np.mean(np.reshape(want, (3, 2)), axis=1), rtol=rtol(name))
    np.testing.assert_allclose(w_of(run.model), w, rtol=rtol(name))
    # still the pair it always was
    state, model = run
    assert run.state is state and run.model is model and run[1] is model and len(run) == 2
    assert "6 steps, 3 epochs" in repr(h)


def test_history_steps_continue_from_the_state():
    _, model, state = setup("finite_differences", False)
    state, model = ad.train(quadratic, model, DATA, state, backend="finite_differences", progress=False)
    run = ad.train(quadratic, model, DATA, state, backend="finite_differences", progress=False)
    assert run.history.steps == [3, 4] and run.history.epochs == [0]


def test_an_epoch_cut_short_by_a_step_callback_has_no_epoch_entry():
    rec = Recorder()
    run = ad.train(quadratic, {"w": np.zeros(3)}, DATA * 2, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                   backend="finite_differences", epochs=3, progress=False,
                   callbacks=[lambda info: info.step != 6, rec])
    assert run.state.step == 6 and run.history.steps == [1, 2, 3, 4, 5, 6]
    assert run.history.epochs == [0] and len(run.history.metrics["loss"]) == 1
    assert [e[1] for e in rec.log].count("epoch") == 1 and rec.log[-1] == ("r", "end", 6)


def test_non_finite_error_carries_the_history_so_far():
    data = [(C1,), (C2,), (np.array([np.nan, 0.0, 0.0]),)]
    with pytest.raises(ad.NonFiniteError) as info:
        ad.train(quadratic, {"w": np.zeros(3)}, data, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                 backend="finite_differences", progress=False)
    assert info.value.history.steps == [1, 2]
    np.testing.assert_allclose(info.value.history.losses, expected_losses(DATA, 1)[0], rtol=1e-6)


# ------------------------------------------------------------------ epoch-end callbacks
def test_callbacks_run_in_order_with_epoch_numbers_from_zero():
    log: list = []
    a, b = Recorder("a", log), Recorder("b", log)
    steps = []
    ad.train(quadratic, {"w": np.zeros(3)}, DATA, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
             backend="finite_differences", epochs=2, progress=False,
             callbacks=[a, lambda info: steps.append((info.epoch, info.step)), b])
    assert log == [
        ("a", "begin", 0), ("b", "begin", 0),
        ("a", "step", 0, 1), ("b", "step", 0, 1), ("a", "step", 0, 2), ("b", "step", 0, 2),
        ("a", "epoch", 0, 2), ("b", "epoch", 0, 2),
        ("a", "step", 1, 3), ("b", "step", 1, 3), ("a", "step", 1, 4), ("b", "step", 1, 4),
        ("a", "epoch", 1, 4), ("b", "epoch", 1, 4),
        ("a", "end", 4), ("b", "end", 4),
    ]
    assert steps == [(0, 1), (0, 2), (1, 3), (1, 4)]  # a plain function: after every step, as before
    info = a.epochs[-1]
    assert isinstance(info, ad.EpochInfo) and info.metrics == {"loss": info.loss}
    np.testing.assert_allclose(info.loss, np.mean(expected_losses(DATA, 2)[0][2:]), rtol=1e-6)


def test_an_epoch_end_callback_returning_false_stops_after_every_callback_saw_the_epoch():
    class StopAt(Callback):
        def on_epoch_end(self, info):
            return False if info.epoch == 1 else None

    rec = Recorder()
    run = ad.train(quadratic, {"w": np.zeros(3)}, DATA, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                   backend="finite_differences", epochs=5, progress=False, callbacks=[StopAt(), rec])
    assert run.state.step == 4 and run.history.epochs == [0, 1] and [i.epoch for i in rec.epochs] == [0, 1]


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("name,implicit", MODES, ids=IDS)
def test_validation_batches_give_the_mean_loss_at_each_epoch_end(name, implicit):
    b, model, state = setup(name, implicit)
    val = [(np.array([2.0, 2.0, 2.0]),), (np.array([-1.0, 0.0, 1.0]),)]
    rec = Recorder()
    run = ad.train(quadratic, model, DATA, state, backend=b, epochs=3, progress=False, validation=val,
                   callbacks=[rec])
    # recomputed from the weights at each epoch end, by hand
    w = np.zeros(3)
    want = []
    for _ in range(3):
        for (c,) in DATA:
            w = w - LR * 2 * (w - c)
        want.append(np.mean([np.sum((w - c) ** 2) for (c,) in val]))
    np.testing.assert_allclose(run.history.metrics["val_loss"], want, rtol=rtol(name))
    assert [set(i.metrics) for i in rec.epochs] == [{"loss", "val_loss"}] * 3  # before the callbacks
    assert [i.metrics["val_loss"] for i in rec.epochs] == run.history.metrics["val_loss"]


@pytest.mark.parametrize("implicit", [False, True], ids=["explicit", "implicit"])
def test_jax_float64_validation_stays_float64_without_global_x64(implicit):
    b, model, state = setup("jax", implicit)
    import jax

    val = [(np.array([2.0, 2.0, 2.0]) / 3,)]
    run = ad.train(quadratic, model, DATA, state, backend=b, progress=False, validation=val)
    w = np.zeros(3)
    for (c,) in DATA:
        w = w - LR * 2 * (w - c)
    np.testing.assert_allclose(run.history.metrics["val_loss"], [np.sum((w - val[0][0]) ** 2)], rtol=1e-13)
    b, model, state = setup("jax", implicit)
    run = ad.train(quadratic, model, DATA, state, backend=b, progress=False,
                   validation=lambda m: quadratic(m, np.float64(1) / 3))  # the function's arithmetic too
    np.testing.assert_allclose(run.history.metrics["val_loss"], [np.sum((w - 1 / 3) ** 2)], rtol=1e-13)
    assert not jax.config.jax_enable_x64


def test_one_tuple_of_arrays_is_one_validation_batch():
    x = np.random.default_rng(0).normal(size=(8, 3))
    y = x.sum(axis=1)

    def mse(m, x, y):
        return autoray.do("mean", (x @ m["w"] - y) ** 2)

    run = ad.train(mse, {"w": np.zeros(3)}, [(x, y)], optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                   backend="finite_differences", progress=False, validation=(x, y))
    np.testing.assert_allclose(run.history.metrics["val_loss"][0], mse(run.model, x, y), rtol=1e-12)


def test_a_validation_function_gives_val_metrics():
    seen = []

    def validate(model):
        seen.append(w_of(model))
        return {"loss": float(np.sum(w_of(model) ** 2)), "acc": np.float32(0.5)}

    run = ad.train(quadratic, {"w": np.zeros(3)}, DATA, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                   backend="finite_differences", epochs=2, progress=False, validation=validate)
    assert set(run.history.metrics) == {"loss", "val_loss", "val_acc"}
    assert run.history.metrics["val_acc"] == [0.5, 0.5]
    assert run.history.metrics["val_loss"] == [float(np.sum(w**2)) for w in seen]
    np.testing.assert_allclose(seen[-1], w_of(run.model), rtol=0)
    run = ad.train(quadratic, {"w": np.zeros(3)}, DATA, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                   backend="finite_differences", progress=False, validation=lambda m: 7)
    assert run.history.metrics["val_loss"] == [7.0]


def test_a_metric_missing_from_an_epoch_is_nan_there():
    run = ad.train(quadratic, {"w": np.zeros(3)}, DATA, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                   backend="finite_differences", epochs=3, progress=False,
                   validation=_scripted([{"a": 1.0}, {"b": 2.0}, {"a": 3.0, "b": 4.0}]))
    m = run.history.metrics
    assert list(m) == ["loss", "val_a", "val_b"] and len(m["loss"]) == 3
    np.testing.assert_array_equal(m["val_a"], [1.0, np.nan, 3.0])
    np.testing.assert_array_equal(m["val_b"], [np.nan, 2.0, 4.0])


def _bn_net(torch, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1)).double()


def _bn_data(n=4):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        x = rng.normal(size=(16, 3))
        out.append((x, x.sum(axis=1, keepdims=True)))
    return out


def net_loss(m, x, y):
    return ((m(x) - y) ** 2).mean()


def test_validating_a_torch_module_does_not_change_its_batchnorm_statistics():
    torch = need("torch") and __import__("torch")
    data = _bn_data()
    plain, validated = _bn_net(torch), _bn_net(torch)
    ad.train(net_loss, plain, data, optim.setup(optim.Adam(0.01), plain), backend=ad.Implicit("torch"),
             epochs=2, progress=False)
    run = ad.train(net_loss, validated, data, optim.setup(optim.Adam(0.01), validated),
                   backend=ad.Implicit("torch"), epochs=2, progress=False, validation=_bn_data(2))
    assert len(run.history.metrics["val_loss"]) == 2
    for (k, a), (_, b) in zip(plain.state_dict().items(), validated.state_dict().items()):
        assert torch.equal(a, b), k  # running_mean, running_var, num_batches_tracked included


def test_float64_validation_data_meets_a_float32_torch_module():
    torch = need("torch") and __import__("torch")
    net = torch.nn.Linear(3, 1)
    data = _bn_data(1)
    run = ad.train(net_loss, net, data, optim.setup(optim.Adam(0.01), net), backend=ad.Implicit("torch"),
                   progress=False, validation=data)
    with torch.no_grad():
        x, y = (torch.as_tensor(a, dtype=torch.float32) for a in data[0])
        assert run.history.metrics["val_loss"][0] == pytest.approx(float(net_loss(net, x, y)), rel=1e-6)


# ------------------------------------------------------------------ early stopping
def _scripted(values):
    """A validation function returning values[epoch]: a constructed loss sequence."""
    calls = iter(values)
    return lambda model: next(calls)


def _train_fd(epochs, callbacks, validation=None, model=None):
    model = {"w": np.zeros(3)} if model is None else model
    return ad.train(quadratic, model, DATA, optim.setup(optim.Descent(LR), model), backend="finite_differences",
                    epochs=epochs, progress=False, callbacks=callbacks, validation=validation)


@pytest.mark.parametrize("patience,min_delta,stop,best_epoch", [
    (0, 0.0, 2, 1), (1, 0.0, 2, 1),  # patience 0 stops at the first epoch without improvement, as 1 does
    (2, 0.0, 5, 3),                  # 3.9995 improves on 4.0; then 4.2, 4.1: two epochs without
    (2, 1e-3, 3, 1),                 # ... but not by more than min_delta
    (3, 0.0, None, 6),               # 1.0 at the last epoch comes within the patience
    (3, 0.6, 4, 1),                  # 4.0 improves on 5.0 by more than 0.6; nothing after it does
])
def test_early_stopping_stops_at_the_right_epoch(patience, min_delta, stop, best_epoch):
    values = [5.0, 4.0, 4.5, 3.9995, 4.2, 4.1, 1.0]
    es = EarlyStopping("val_loss", patience=patience, min_delta=min_delta)
    run = _train_fd(len(values), [es], validation=_scripted(values))
    assert es.stopped_epoch == stop and es.best_epoch == best_epoch and es.best == values[best_epoch]
    epochs = len(values) if stop is None else stop + 1
    assert run.history.epochs == list(range(epochs)) and run.state.step == 2 * epochs
    assert run.history.metrics["val_loss"] == values[:epochs]


def test_early_stopping_mode_max_and_monitor_loss():
    es = EarlyStopping("val_acc", mode="max", patience=1)
    run = _train_fd(6, [es], validation=_scripted([{"acc": a} for a in [0.1, 0.5, 0.4, 0.6, 0.6, 0.9]]))
    assert es.stopped_epoch == 2 and es.best == 0.5 and es.best_epoch == 1 and run.history.epochs == [0, 1, 2]
    es = EarlyStopping("loss", patience=0)  # the training loss keeps falling: never stops
    run = _train_fd(4, [es])
    assert es.stopped_epoch is None and run.history.epochs == [0, 1, 2, 3] and es.best_epoch == 3


def test_early_stopping_nan_never_improves():
    es = EarlyStopping(patience=2)
    _train_fd(5, [es], validation=_scripted([float("nan"), 2.0, float("nan"), 3.0, 1.0]))
    assert es.best == 2.0 and es.best_epoch == 1 and es.stopped_epoch == 3


class Snapshots(Callback):
    """Copies of (state, model) at each epoch end, as numpy."""

    def __init__(self, copy_model):
        self.copy_model, self.models, self.states = copy_model, [], []

    def on_epoch_end(self, info):
        self.models.append(self.copy_model(info.model))
        self.states.append(info.state)


@pytest.mark.parametrize("name,implicit", MODES, ids=IDS)
def test_restore_best_gives_the_best_weights_exactly(name, implicit):
    b, model, state = setup(name, implicit)
    start = w_of(model)
    snaps = Snapshots(w_of)
    es = EarlyStopping(patience=2, restore_best=True)
    run = ad.train(quadratic, model, DATA, state, backend=b, epochs=10, progress=False,
                   validation=_scripted([3.0, 1.0, 2.0, 2.0, 0.0]), callbacks=[snaps, es])
    assert es.best_epoch == 1 and es.stopped_epoch == 3 and run.history.epochs == [0, 1, 2, 3]
    np.testing.assert_array_equal(w_of(run.model), snaps.models[1])  # exactly: no arithmetic on the way
    assert not np.array_equal(snaps.models[1], snaps.models[3])
    assert run.state is snaps.states[1] and run.state.step == 4
    if implicit:
        assert run.model is model  # the same variables, their values written back
        state, model, _ = ad.train_step(quadratic, run.model, (C1,), run.state, backend=b)  # resumes
        assert state.step == 5
    else:
        np.testing.assert_array_equal(ad.to_numpy(model)["w"], start)  # the caller's model untouched


def test_restore_best_is_a_no_op_when_the_last_epoch_is_the_best():
    es = EarlyStopping(restore_best=True)
    rec = Snapshots(w_of)
    run = _train_fd(3, [rec, es], validation=_scripted([3.0, 2.0, 1.0]))
    assert run.state is rec.states[-1]


def test_restore_best_restores_a_torch_module_with_batchnorm_in_place():
    torch = need("torch") and __import__("torch")
    net = _bn_net(torch)
    params = list(net.parameters())

    def copy(m):
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    snaps = Snapshots(copy)
    es = EarlyStopping(patience=1, restore_best=True)
    state = optim.setup(optim.Adam(0.05), net)
    run = ad.train(net_loss, net, _bn_data(), state, backend=ad.Implicit("torch"), epochs=6, progress=False,
                   validation=_scripted([2.0, 1.0, 1.5]), callbacks=[snaps, es])
    assert es.stopped_epoch == 2 and run.model is net and all(p is q for p, q in zip(net.parameters(), params))
    best, last = snaps.models[1], snaps.models[2]
    for k, v in net.state_dict().items():  # parameters and buffers, bit for bit
        assert torch.equal(v, best[k]), k
    assert not torch.equal(best["1.running_mean"], last["1.running_mean"])
    assert int(net.state_dict()["1.num_batches_tracked"]) == 8
    assert run.state is snaps.states[1] and all(p.grad is None for p in net.parameters())
    ad.train(net_loss, net, _bn_data(1), run.state, backend=ad.Implicit("torch"), progress=False)  # resumes


# ------------------------------------------------------------------ checkpoints
def _leftovers(directory):
    return [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_checkpoint_every_n_epochs_writes_loadable_files(tmp_path):
    snaps = Snapshots(w_of)
    ck = Checkpoint(tmp_path / "run-{epoch:02d}-{step}.npz", every=2)
    _train_fd(5, [snaps, ck])
    assert [os.path.basename(p) for p in ck.saved] == ["run-01-4.npz", "run-03-8.npz"]
    assert sorted(os.listdir(tmp_path)) == ["run-01-4.npz", "run-03-8.npz"] and not _leftovers(tmp_path)
    like = (optim.setup(optim.Descent(LR), {"w": np.zeros(3)}), {"w": np.zeros(3)})
    for path, epoch in zip(ck.saved, (1, 3)):
        state, model = ad.load_checkpoint(path, like=like)
        assert state.step == 2 * (epoch + 1)
        np.testing.assert_array_equal(model["w"], snaps.models[epoch])


def test_checkpoint_every_n_steps_counts_global_steps(tmp_path):
    ck = Checkpoint(str(tmp_path / "s{step}.npz"), every=3, on="step")
    _, model = _train_fd(4, [ck])
    assert [os.path.basename(p) for p in ck.saved] == ["s3.npz", "s6.npz"]
    ck2 = Checkpoint(str(tmp_path / "latest.npz"), every=1, on="step")  # no field: each save replaces the last
    state, model = _train_fd(2, [ck2])
    assert len(ck2.saved) == 4 and set(ck2.saved) == {str(tmp_path / "latest.npz")}
    like = (optim.setup(optim.Descent(LR), {"w": np.zeros(3)}), {"w": np.zeros(3)})
    loaded_state, loaded = ad.load_checkpoint(tmp_path / "latest.npz", like=like)
    assert loaded_state.step == 4
    np.testing.assert_array_equal(loaded["w"], model["w"])


def test_a_failed_checkpoint_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    import abstractdiff._checkpoint as ckpt

    path = tmp_path / "latest.npz"
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", flaky)
    with pytest.raises(OSError, match="disk full"):
        _train_fd(3, [Checkpoint(path)])
    assert os.listdir(tmp_path) == ["latest.npz"]  # the temporary file is gone
    like = (optim.setup(optim.Descent(LR), {"w": np.zeros(3)}), {"w": np.zeros(3)})
    assert ad.load_checkpoint(path, like=like)[0].step == 2  # the first epoch's, intact


def test_checkpoint_of_a_torch_module_loads_into_a_fresh_one(tmp_path):
    torch = need("torch") and __import__("torch")
    net = _bn_net(torch)
    ck = Checkpoint(tmp_path / "net.npz")
    state, _ = ad.train(net_loss, net, _bn_data(), optim.setup(optim.Adam(0.01), net),
                        backend=ad.Implicit("torch"), epochs=2, progress=False, callbacks=[ck])
    fresh = _bn_net(torch, seed=1)
    loaded_state, same = ad.load_checkpoint(ck.saved[-1], like=(optim.setup(optim.Adam(0.01), fresh), fresh))
    assert same is fresh and loaded_state.step == state.step == 8
    for (k, a), (_, b) in zip(net.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), k


# ------------------------------------------------------------------ progress numbering
def test_progress_line_numbers_epochs_as_stepinfo_does(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import tqdm.auto now raises ImportError
    epochs = []
    run = ad.train(quadratic, {"w": np.zeros(3)}, DATA, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                   backend="finite_differences", epochs=2, validation=[(C1,)],
                   callbacks=[lambda info: epochs.append(info.epoch)])
    lines = capsys.readouterr().err.splitlines()
    h = run.history
    assert lines == [
        f"epoch {e} ({e + 1}/2): step {2 * (e + 1)}, loss {h.metrics['loss'][e]:.4g}, "
        f"val_loss {h.metrics['val_loss'][e]:.4g}"
        for e in (0, 1)
    ]
    assert epochs == [0, 0, 1, 1] and h.epochs == [0, 1]


def test_progress_bar_numbers_epochs_as_stepinfo_does(capsys):
    pytest.importorskip("tqdm")
    ad.train(quadratic, {"w": np.zeros(3)}, DATA, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
             backend="finite_differences", epochs=2, validation=[(C1,)])
    err = capsys.readouterr().err
    assert "epoch=0" in err and "epoch=1" in err and "epoch=2" not in err and "val_loss=" in err and "4/4" in err


# ------------------------------------------------------------------ Params wording
def test_params_call_batchnorm_statistics_non_trainable_not_frozen():
    torch = need("torch") and __import__("torch")
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ps = ad.Params(net)
    # running_mean, running_var and num_batches_tracked: state, not parameters, and not frozen
    assert repr(ps) == "Params(4 variables (torch), 24 values; 3 non-trainable variables left out)"
    assert ps.non_trainable == 3 and ps.frozen == 3 and "frozen" not in repr(ps)
    net[0].bias.requires_grad_(False)
    ps = ad.Params(net)
    assert repr(ps) == "Params(3 variables (torch), 20 values; 4 non-trainable variables left out)"
    assert repr(ad.Params([net, net])) == repr(ps)  # a model given twice counts once
    assert "left out" not in repr(ad.Params(torch.nn.Linear(2, 1)))


# ------------------------------------------------------------------ errors
def _train_with(**kw):
    return ad.train(quadratic, {"w": np.zeros(3)}, DATA, optim.setup(optim.Descent(LR), {"w": np.zeros(3)}),
                    backend="finite_differences", progress=False, **kw)


def _raises(cls, match):
    assert issubclass(cls, ad.AbstractDiffError)
    return pytest.raises(cls, match=match)


@pytest.mark.parametrize("callbacks,match", [
    (lambda info: None, r"must be a list of callbacks.*callbacks=\[<lambda>\]"),
    (EarlyStopping(), r"must be a list of callbacks"),
    (3, "must be a list of callbacks, got int"),
    ([EarlyStopping], r"callbacks\[0\] is the class EarlyStopping, not an instance"),
    ([print, "x"], r"callbacks\[1\] is a str, not a callback"),
])
def test_bad_callbacks_are_refused_before_any_step(callbacks, match):
    with _raises(ad.ArgumentTypeError, match):
        _train_with(callbacks=callbacks)


def test_a_bad_on_train_end_result_is_an_error():
    class Bad(Callback):
        def on_train_end(self, state, model):
            return "best"

    with _raises(ad.ArgumentTypeError, "on_train_end returned a str"):
        _train_with(callbacks=[Bad()])


@pytest.mark.parametrize("validation,cls,match", [
    ("val.npz", ad.ArgumentTypeError, "validation must be a function"),
    (3, ad.ArgumentTypeError, "validation must be a function"),
    (np.ones(3), ad.ArgumentTypeError, "validation must be a function"),
    (((C1,) for _ in range(2)), ad.ArgumentTypeError, "one-shot iterator"),
    ([], ad.InvalidArgumentError, "holds no batches"),
    (lambda m: "good", ad.ArgumentTypeError, "not a number"),
    (lambda m: True, ad.ArgumentTypeError, "not a number"),
    (lambda m: np.ones(2), ad.ArgumentTypeError, "not a number"),
    (lambda m: {"acc": None}, ad.ArgumentTypeError, "the validation metric 'acc'"),
    (lambda m: {1: 0.5}, ad.ArgumentTypeError, "metric names are strings"),
])
def test_bad_validation_is_an_error(validation, cls, match):
    with _raises(cls, match):
        _train_with(validation=validation)


def test_validation_data_without_batches_is_an_error():
    class Empty:
        def __iter__(self):
            return iter(())

    with _raises(ad.InvalidArgumentError, "yielded no batches"):
        _train_with(validation=Empty())


@pytest.mark.parametrize("kw,match", [
    ({"patience": -1}, "patience must be an int >= 0"),
    ({"patience": 1.5}, "patience must be an int >= 0"),
    ({"patience": True}, "patience must be an int >= 0"),
    ({"min_delta": -0.1}, "min_delta must be a finite number >= 0"),
    ({"min_delta": float("nan")}, "min_delta must be a finite number >= 0"),
    ({"mode": "auto"}, "mode must be 'min' or 'max'"),
    ({"monitor": ""}, "monitor must be a metric name"),
    ({"restore_best": 1}, "restore_best must be True or False"),
])
def test_bad_early_stopping_arguments(kw, match):
    with _raises(ad.InvalidArgumentError, match):
        EarlyStopping(**kw)


def test_a_monitor_that_is_not_recorded_names_the_recorded_ones():
    with _raises(ad.InvalidArgumentError, r"'val_loss' is not recorded \(validation metrics need validation=") as e:
        _train_with(callbacks=[EarlyStopping()])
    assert "['loss']" in str(e.value)
    with _raises(ad.InvalidArgumentError, r"'accuracy' is not recorded; the recorded ones are \['loss', 'val_loss'\]"):
        _train_with(callbacks=[EarlyStopping("accuracy")], validation=[(C1,)])


@pytest.mark.parametrize("args,kw,cls,match", [
    (("a.npz",), {"every": 0}, ad.InvalidArgumentError, "every must be an int >= 1"),
    (("a.npz",), {"every": True}, ad.InvalidArgumentError, "every must be an int >= 1"),
    (("a.npz",), {"on": "batch"}, ad.InvalidArgumentError, "on must be 'epoch' or 'step'"),
    (("a-{loss}.npz",), {}, ad.InvalidArgumentError, r"fields \{epoch\} and \{step\} only"),
    (("a-{epoch.npz",), {}, ad.InvalidArgumentError, "not a valid file-name pattern"),
    ((3,), {}, ad.ArgumentTypeError, "path must be a str or a path"),
])
def test_bad_checkpoint_arguments(args, kw, cls, match):
    with _raises(cls, match):
        Checkpoint(*args, **kw)


# ------------------------------------------------------------------ distributed
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dp():
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_gloo_available()) or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo, and no process group already open")
    group = ad.DataParallel("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", timeout=30)
    yield group
    group.close()


def test_distributed_checkpoints_are_written_by_rank_0_and_every_rank_waits(dp, tmp_path, monkeypatch):
    calls = []
    real = dp.save_checkpoint
    monkeypatch.setattr(dp, "save_checkpoint", lambda *a: (calls.append(a[0]), real(*a)))
    es = EarlyStopping("loss", patience=1)
    ck = Checkpoint(tmp_path / "dp-{epoch}.npz")
    run = _train_with(callbacks=[ck, es], distributed=dp)
    assert calls == [str(tmp_path / "dp-0.npz")] and os.path.exists(calls[0]) and run.history.epochs == [0]
    monkeypatch.setattr(type(dp), "is_main", property(lambda self: False))  # another rank: writes nothing
    ck = Checkpoint(tmp_path / "other-{epoch}.npz")
    _train_with(callbacks=[ck], distributed=dp)
    assert ck.saved == [str(tmp_path / "other-0.npz")] and not os.path.exists(ck.saved[0])

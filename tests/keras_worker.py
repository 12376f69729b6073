"""One Keras backend's checks of abstractdiff's implicit mode, run by tests/test_keras.py.

Keras picks its backend when it is imported, so each backend runs in its own process:
``KERAS_BACKEND=torch python tests/keras_worker.py`` prints one JSON object of measurements
on its last stdout line, which the test asserts on (a failure here exits nonzero, with the
traceback on stderr).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

import abstractdiff as ad
from abstractdiff import optim

BACKEND = os.environ.get("KERAS_BACKEND", "")  # set by tests/test_keras.py; empty when imported otherwise
#: The other abstractdiff backend each Keras backend's model is given, to check the refusal.
OTHER = {"tensorflow": "jax", "torch": "tensorflow", "jax": "torch"}
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "keras_three_backends.py"


def _keras():
    import keras

    assert keras.config.backend() == BACKEND, (keras.config.backend(), BACKEND)
    return keras


def dense(keras, batchnorm: bool = False):
    layers = [keras.Input((3,)), keras.layers.Dense(4, activation="tanh")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    return keras.Sequential([*layers, keras.layers.Dense(1)])


def data(n: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    return x, np.sin(x.sum(axis=1, keepdims=True)).astype("float32")


def loss(model, x, y):
    import keras

    return keras.ops.mean((model(x, training=True) - y) ** 2)


def twins(keras, batchnorm: bool = False):
    """Two identical models: the second gets the first's initial weights."""
    a, b = dense(keras, batchnorm), dense(keras, batchnorm)
    b.set_weights(a.get_weights())
    return a, b


def max_diff(xs: list, ys: list) -> float:
    return max(float(np.max(np.abs(np.asarray(u, dtype=np.float64) - np.asarray(v, dtype=np.float64))))
               for u, v in zip(xs, ys))


def _numpy_loss(ws: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    w0, b0, w1, b1 = ws
    return float(np.mean((np.tanh(x @ w0 + b0) @ w1 + b1 - y) ** 2))


def _central_differences(ws: list[np.ndarray], x: np.ndarray, y: np.ndarray, eps: float = 1e-6) -> list:
    x, y = x.astype(np.float64), y.astype(np.float64)
    grads = []
    for i, w in enumerate(ws):
        g = np.zeros_like(w)
        for j in np.ndindex(w.shape):
            up, down = [u.copy() for u in ws], [u.copy() for u in ws]
            up[i][j] += eps
            down[i][j] -= eps
            g[j] = (_numpy_loss(up, x, y) - _numpy_loss(down, x, y)) / (2 * eps)
        grads.append(g)
    return grads


def check_gradient(keras) -> dict:
    """The implicit gradient of a Dense model against central differences of a numpy copy."""
    model = dense(keras)
    x, y = data()
    ps = ad.Params(model)
    b = ad.Implicit(BACKEND)
    f = lambda x, y: loss(model, x, y)  # noqa: E731  data as args: converted to the backend's arrays
    value, gs = ad.value_and_gradient(b, f, ps, x, y)
    ws = [np.asarray(v, dtype=np.float64) for v in model.trainable_variables]
    expected = _central_differences(ws, x, y)
    got = [ad.to_numpy(gs[v]) for v in model.trainable_variables]
    _, vjp = ad.value_and_pullback(b, f, ps, x, y)
    pulled = vjp(np.float32(1.0))
    aliases = all(gs[v.value] is gs[v] for v in model.trainable_variables) if BACKEND != "jax" else True
    untouched = all(getattr(v.value, "grad", None) is None for v in model.variables)  # torch's .grad
    return {
        "n_params": len(ps), "value_err": abs(float(ad.to_numpy(value)) - _numpy_loss(ws, x, y)),
        "grad_err": max_diff(got, expected), "grad_scale": max(float(np.max(np.abs(e))) for e in expected),
        "pullback_err": max_diff([ad.to_numpy(pulled[v]) for v in model.trainable_variables], got),
        "aliases": aliases, "grad_untouched": untouched,
    }


def check_sgd(keras, batchnorm: bool) -> dict:
    """One ``train_step`` with ``optim.Descent(lr)`` against Keras's SGD ``train_on_batch``."""
    lr = 0.1
    theirs, ours = twins(keras, batchnorm)
    x, y = data()
    theirs.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    theirs.train_on_batch(x, y)
    state = optim.setup(optim.Descent(lr), ours)
    before = [np.asarray(v) for v in ours.non_trainable_variables]
    state, out, _ = ad.train_step(loss, ours, (x, y), state, backend=ad.Implicit(BACKEND))
    result = {"max_diff": max_diff(ours.get_weights(), theirs.get_weights()), "same_model": out is ours}
    if batchnorm:
        result["frozen"] = ad.Params(ours).frozen
        result["state_size"] = len(state.tree)
        result["moving_changed"] = max_diff([np.asarray(v) for v in ours.non_trainable_variables], before)
    return result


def check_train(keras) -> dict:
    """``ad.train`` with Adam over a few epochs: the loss (over all batches) goes down."""
    model = dense(keras, batchnorm=True)
    x, y = data(64)
    batches = [(x[i: i + 16], y[i: i + 16]) for i in range(0, 64, 16)]
    native = [[ad.backend(BACKEND).asarray(a) for a in batch] for batch in batches]

    def mean_loss() -> float:  # batches of one shape: jax compiles its eager ops once
        return float(np.mean([ad.to_numpy(loss(model, *batch)) for batch in native]))

    state = optim.setup(optim.Adam(0.02), model)
    losses = [mean_loss()]
    for _ in range(3):
        state, out = ad.train(loss, model, batches, state, backend=ad.Implicit(BACKEND), progress=False)
        assert out is model
        losses.append(mean_loss())
    return {"losses": losses, "steps": state.step}


def check_checkpoint(keras) -> dict:
    """Save a trained model with BatchNormalization and its Adam state, load it into a fresh
    model, and take one more step with each: both stay identical."""
    model, fresh = dense(keras, batchnorm=True), dense(keras, batchnorm=True)
    x, y = data()
    rule = optim.Adam(0.05)
    state = optim.setup(rule, model)
    b = ad.Implicit(BACKEND)
    for _ in range(3):
        state, model, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "keras.npz"
        ad.save_checkpoint(path, state, model)
        loaded, other = ad.load_checkpoint(path, like=(optim.setup(rule, fresh), fresh))
    result = {"loaded_diff": max_diff(other.get_weights(), model.get_weights()), "same_model": other is fresh,
              "moving_nonzero": bool(np.any(np.asarray(other.layers[1].moving_mean) != 0))}
    state, model, _ = ad.train_step(loss, model, (x, y), state, backend=b)
    loaded, other, _ = ad.train_step(loss, other, (x, y), loaded, backend=b)
    result["next_step_diff"] = max_diff(other.get_weights(), model.get_weights())
    return result


def check_mismatch(keras) -> dict:
    """The model given to another backend's ad.Implicit: refused, naming the one to use."""
    other = OTHER[BACKEND]
    if importlib.util.find_spec(other) is None:
        return {"skipped": f"{other} is not installed"}
    model = dense(keras)
    x, y = data()
    try:
        ad.gradient(ad.Implicit(other), lambda x, y: loss(model, x, y), ad.Params(model), x, y)
    except ad.ModeMismatchError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None, "message": ""}


def example_curve() -> list[float]:
    """The loss curve of examples/keras_three_backends.py on this backend (its training, in this
    process): the test compares the backends' curves as the example does."""
    spec = importlib.util.spec_from_file_location("keras_three_backends_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.train_here(epochs=2)


def main() -> int:
    keras = _keras()
    keras.utils.set_random_seed(0)
    results = {
        "backend": BACKEND,
        "gradient": check_gradient(keras),
        "sgd": check_sgd(keras, batchnorm=False),
        "sgd_batchnorm": check_sgd(keras, batchnorm=True),
        "train": check_train(keras),
        "checkpoint": check_checkpoint(keras),
        "mismatch": check_mismatch(keras),
        "example": example_curve(),
    }
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

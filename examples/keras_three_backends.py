"""One Keras model, trained by abstractdiff on each of Keras's three backends.

Keras picks its backend (``KERAS_BACKEND``) when it is imported, so each backend trains in
its own process: the same model (Dense, BatchNormalization, Dense), the same initial
weights (drawn with numpy and set with ``set_weights``), the same data and the same rule
(Adam), with ``ad.train(..., backend=ad.Implicit(<the Keras backend>))``.  The script
prints each backend's loss curve and exits nonzero when the curves differ by more than
float32 rounding::

    python examples/keras_three_backends.py                       # tensorflow, torch and jax
    python examples/keras_three_backends.py --backends torch,jax --epochs 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: Largest relative difference between two backends' losses (float32 rounding; 2.5e-7 measured on CPU).
RTOL = 1e-4
BACKENDS = ("tensorflow", "torch", "jax")


def initial_weights(seed: int = 0) -> list[np.ndarray]:
    """The model's weights, in ``get_weights`` order: Dense(8), BatchNormalization, Dense(1)."""
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(4, 8)) / 2).astype("float32"), np.zeros(8, "float32"),  # kernel, bias
        np.ones(8, "float32"), np.zeros(8, "float32"),  # gamma, beta
        np.zeros(8, "float32"), np.ones(8, "float32"),  # moving mean and variance (not trained)
        (rng.normal(size=(8, 1)) / 3).astype("float32"), np.zeros(1, "float32"),
    ]


def data(seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(128, 4)).astype("float32")
    y = (np.sin(x[:, :1] + x[:, 1:2]) + x[:, 2:3] * x[:, 3:]).astype("float32")
    return [(x[i: i + 32], y[i: i + 32]) for i in range(0, 128, 32)]


def train_here(epochs: int) -> list[float]:
    """Train in this process, on the Keras backend of ``KERAS_BACKEND``; the step losses."""
    import keras

    import abstractdiff as ad
    from abstractdiff import optim

    model = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.BatchNormalization(), keras.layers.Dense(1),
    ])
    model.set_weights(initial_weights())

    def loss(model, x, y):
        return keras.ops.mean((model(x, training=True) - y) ** 2)  # training: BatchNorm's batch statistics

    losses: list[float] = []
    state = optim.setup(optim.Adam(0.01), model)
    ad.train(loss, model, data(), state, backend=ad.Implicit(keras.config.backend()), epochs=epochs,
             callbacks=[lambda info: losses.append(float(ad.to_numpy(info.loss)))], progress=False)
    return losses


def train_in_subprocess(backend: str, epochs: int) -> subprocess.Popen:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--epochs", str(epochs)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def largest_difference(curves: dict[str, list[float]]) -> float:
    """The largest relative difference between any backend's losses and the first's."""
    first = np.asarray(next(iter(curves.values())))
    return max(float(np.max(np.abs(np.asarray(c) - first) / np.abs(first))) for c in curves.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated Keras backends")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(train_here(args.epochs)))
        return 0
    start = time.perf_counter()
    procs = {b: train_in_subprocess(b, args.epochs) for b in args.backends.split(",")}
    curves: dict[str, list[float]] = {}
    for b, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            print(f"{b}: training failed\n{err[-3000:]}")
            return 1
        curves[b] = json.loads(out.strip().splitlines()[-1])
    every = max(1, len(next(iter(curves.values()))) // 8)
    for b, losses in curves.items():
        print(f"{b:<11} loss " + " ".join(f"{v:.4f}" for v in losses[::every]) + f"  final {losses[-1]:.6f}")
    diff = largest_difference(curves)
    ok = diff <= RTOL
    print(f"{sum(map(len, curves.values())) // len(curves)} steps per backend in {time.perf_counter() - start:.1f} s; "
          f"largest relative difference between backends {diff:.1e} (tolerance {RTOL:g}): "
          f"{'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

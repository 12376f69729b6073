"""Train one MLP on scikit-learn's digits with every AD backend, and plot the loss curves.

    python examples/digits.py                       # every available backend, 400 steps
    python examples/digits.py --steps 50 --backends torch,jax /tmp/loss.png
    torchrun --standalone --nproc_per_node 2 examples/digits.py --distributed --backends jax

The model and the loss are written once with ``autoray`` and trained with
``ad.train``; only ``backend=`` changes between runs.  Same data, same initial
parameters, same rule: the loss curves lie on top of each other (the plot draws them
with different line styles so that each stays visible), and the final parameters agree
to float32 rounding.  The data set ships with scikit-learn (no download).
"""

from __future__ import annotations

import argparse
import time

import autoray as ar
import numpy as np

import abstractdiff as ad
from abstractdiff import optim

# Finite differences would need 2 x 2,410 function calls per step here; implicit mode
# is the same computation as explicit mode (see abstractdiff.parity for both).
SKIP = ("finite_differences", "implicit")


def load_data(seed: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = np.eye(10, dtype=np.float32)[digits.target]
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=digits.target)


def init(seed: int = 0, hidden: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w0": (rng.normal(size=(64, hidden)) / 8.0).astype(np.float32),
        "b0": np.zeros(hidden, dtype=np.float32),
        "w1": (rng.normal(size=(hidden, 10)) / np.sqrt(hidden)).astype(np.float32),
        "b1": np.zeros(10, dtype=np.float32),
    }


def logits(p, x):
    h = ar.do("tanh", x @ p["w0"] + p["b0"])
    return h @ p["w1"] + p["b1"]


def loss(p, x, y):
    """Softmax cross-entropy, with a stable log-sum-exp."""
    z = logits(p, x)
    m = ar.do("max", z, axis=1, keepdims=True)
    lse = m + ar.do("log", ar.do("sum", ar.do("exp", z - m), axis=1, keepdims=True))
    return -ar.do("mean", ar.do("sum", y * (z - lse), axis=1))


def batches(x, y, steps: int, size: int = 64, seed: int = 0):
    """``steps`` minibatches, the same sequence for every backend."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < steps:
        order = rng.permutation(len(x))
        out += [(x[i], y[i]) for i in np.array_split(order, len(x) // size)]
    return out[:steps]


SCHEDULES = {
    "constant": lambda steps: optim.schedules.constant(3e-3),
    "cosine": lambda steps: optim.schedules.cosine(3e-3, decay_steps=steps, alpha=0.01),
    "warmup_cosine": lambda steps: optim.schedules.warmup_cosine(0.0, 3e-3, max(1, steps // 10), steps + 1),
    "linear": lambda steps: optim.schedules.linear(3e-3, 3e-5, transition_steps=steps),
    "exponential": lambda steps: optim.schedules.exponential(3e-3, transition_steps=max(1, steps // 4), decay_rate=0.5),
    "piecewise": lambda steps: optim.schedules.piecewise(3e-3, {steps // 2: 0.3, 3 * steps // 4: 0.3}),
}


def learning_rate(schedule: str, steps: int) -> optim.schedules.Schedule:
    """The learning rate of ``--schedule`` over ``steps`` steps (every schedule peaks at 3e-3)."""
    return SCHEDULES[schedule](max(1, steps))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="examples/digits_loss.png", help="where to save the plot")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="constant",
                        help="the learning-rate schedule of Adam (peak 3e-3), over --steps steps")
    parser.add_argument("--backends", default=None, help="comma-separated; default: every available one")
    parser.add_argument("--distributed", action="store_true",
                        help="data-parallel over the processes of a torchrun launch (first backend, default torch)")
    parser.add_argument("--batch", type=int, default=64, help="rows per (global) batch")
    return parser


def run_distributed(args: argparse.Namespace) -> int:
    """One process of ``torchrun --standalone --nproc_per_node N examples/digits.py --distributed``:
    every process gets the same batches, trains on its block of rows, and the gradients
    are averaged (``ad.DataParallel``); rank 0 reports."""
    dp = ad.DataParallel(timeout=120)
    x_train, x_test, y_train, y_test = load_data()
    data = batches(x_train, y_train, args.steps, size=args.batch)
    name = (args.backends or "torch").split(",")[0]
    model = init()
    state = optim.setup(optim.Adam(lr=learning_rate(args.schedule, args.steps)), model)
    ad.train_step(loss, model, data[0], state, backend=name, distributed=dp)  # warm-up: compile, connect
    dp.barrier()
    start = time.perf_counter()
    state, model = ad.train(loss, model, data, state, backend=name, progress=False, distributed=dp)
    dp.barrier()
    seconds = time.perf_counter() - start
    if dp.is_main:
        params = ad.to_numpy(model)
        accuracy = float(np.mean(np.argmax(logits(params, x_test), axis=1) == np.argmax(y_test, axis=1)))
        print(f"{name} on {dp.world_size} process(es): {state.step} steps of {args.batch} rows in {seconds:.2f} s "
              f"({1000 * seconds / state.step:.2f} ms a step), test accuracy {accuracy:.3f}")
    dp.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.distributed:
        return run_distributed(args)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_train, x_test, y_train, y_test = load_data()
    data = batches(x_train, y_train, args.steps, size=args.batch)
    names = args.backends.split(",") if args.backends else [n for n in ad.available_backends() if n not in SKIP]
    curves: dict[str, list[float]] = {}
    finals: dict[str, dict[str, np.ndarray]] = {}
    for name in names:
        try:
            b = ad.backend(name)
        except ad.BackendUnavailableError as err:
            print(f"{name:<12} skipped: {err}")
            continue
        losses: list[float] = []
        model = init()
        state = optim.setup(optim.Adam(lr=learning_rate(args.schedule, args.steps)), model)
        start = time.perf_counter()
        state, model = ad.train(loss, model, data, state, backend=b, progress=False,
                                callbacks=[lambda info, losses=losses: losses.append(info.loss)])
        seconds = time.perf_counter() - start
        params = ad.to_numpy(model)
        accuracy = float(np.mean(np.argmax(logits(params, x_test), axis=1) == np.argmax(y_test, axis=1)))
        print(f"{name:<12} test accuracy {accuracy:.3f}   final loss {losses[-1]:.4f}   {seconds:.1f} s")
        curves[name], finals[name] = losses, params
    if not curves:
        print("no backend could run")
        return 1
    first = next(iter(finals.values()))
    spread = max(
        float(np.max(np.abs(p[k] - first[k])) / np.max(np.abs(first[k]))) for p in finals.values() for k in first
    )
    print(f"final parameters: largest relative difference between backends {spread:.1e}")

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":", "-."]
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(np.arange(1, len(losses) + 1), losses, styles[i % len(styles)], lw=2.5 - 0.4 * i, label=name)
    ax.set(xlabel="step", ylabel="cross-entropy (training batch)", yscale="log",
           title="digits MLP, Adam: one loss function, every backend")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

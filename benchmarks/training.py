"""Training steps: ``ad.train_step`` against each library's own training loop, timed side by side.

An MLP trained on one fixed random batch with Adam(1e-3) and an MSE loss, float32, at two
sizes (*small*: 32 -> 64 -> 1; *medium*: 784 -> 256 -> 256 -> 10; batch 128), each step's
returned state and model fed to the next:

* jax, explicit: the model a dict of jax arrays, ``ad.train_step(..., backend=ad.backend("jax"))``
  against optax ``adam(1e-3)`` in a ``jax.jit``-compiled step (``value_and_grad``,
  ``opt.update``, ``optax.apply_updates``);
* tensorflow, implicit Keras 3: a ``keras.Sequential`` with ``backend=ad.Implicit("tensorflow")``
  against a ``tf.function`` step (a ``GradientTape`` and ``keras.optimizers.Adam(1e-3).apply``);
* torch, implicit: a ``torch.nn.Sequential`` with ``backend=ad.Implicit("torch")`` against a
  ``torch.optim.Adam`` loop (``zero_grad``, ``backward``, ``step``).

``ad.train_step`` waits for each step once (its ``NonFiniteError`` check), so *native* converts
the loss to a Python number each step (``float(loss)``, ``loss.item()``) as a training loop
that logs it does; *native, no sync* leaves it on the device (jax, tensorflow), the loop's
fastest form; *native checked* (jax) is the optax step making ``ad.train_step``'s guarantee:
the jitted step also returns whether the loss, every gradient and every new parameter is
finite, and the loop reads that flag before the new values replace the old ones.  *op by
op* is ``ad.train_step`` with the whole-step compilation off (``abstractdiff._compiled_step._compiler``
returning None for that variant's calls): the gradient compiled, the optimiser's update one
library call per operation and leaf.

Timing: every variant warmed up (the first call compiles), then, in each of ``--repeats``
rounds, ``--steps`` steps of each variant in turn (interleaved, the garbage collector off,
each block waiting for its last step's result); the figure is the minimum over rounds of
the mean step time.

``python -m benchmarks.training [jax] [tensorflow] [torch]`` prints the table.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # before anything imports keras

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402

import abstractdiff as ad  # noqa: E402
import abstractdiff._compiled_step as cs  # noqa: E402
from abstractdiff import optim  # noqa: E402

LIBRARIES = ("jax", "tensorflow", "torch")
#: the packages each library's comparison needs
NEEDS = {"jax": ("jax", "optax"), "tensorflow": ("tensorflow", "keras"), "torch": ("torch",)}
SIZES = {"small": (32, (64,), 1), "medium": (784, (256, 256), 10)}
BATCH = 128
LR = 1e-3
VARIANTS = ("ours", "native", "ours op by op", "native no sync", "native checked")

Step = Callable[[], Any]


def _missing(library: str) -> str | None:
    absent = [m for m in NEEDS[library] if importlib.util.find_spec(m) is None]
    return f"{', '.join(absent)} not installed" if absent else None


def _data(size: str, seed: int = 0) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """``([(w, b) per layer], x, y)`` in float32, the same for every library."""
    din, hidden, dout = SIZES[size]
    rng = np.random.default_rng(seed)
    widths = [din, *hidden, dout]
    layers = [
        (rng.standard_normal((m, n)).astype(np.float32) * np.float32(np.sqrt(2.0 / m)), np.zeros(n, np.float32))
        for m, n in zip(widths[:-1], widths[1:])
    ]
    x = rng.standard_normal((BATCH, din)).astype(np.float32)
    y = rng.standard_normal((BATCH, dout)).astype(np.float32)
    return layers, x, y


def _initial_loss(size: str) -> float:
    layers, h, y = _data(size)
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        if i < len(layers) - 1:
            h = np.maximum(h, 0)
    return float(np.mean((h - y) ** 2))


def _without_compile(step: Step) -> Step:
    """``step`` with ``ad.train_step``'s whole-step compilation off for its calls only."""

    def call() -> Any:
        saved = cs._compiler
        cs._compiler = lambda b: None
        try:
            return step()
        finally:
            cs._compiler = saved

    return call


# ---------------------------------------------------------------- the cases
def _jax(size: str) -> tuple[dict[str, Step], dict[str, Callable[[], float]]]:
    """``(steps, last loss of each variant)``: each step advances its own chain."""
    import jax
    import jax.numpy as jnp
    import optax

    layers, x_np, y_np = _data(size)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)

    def fresh() -> dict[str, Any]:
        return {f"{k}{i}": jnp.asarray(a) for i, (w, b) in enumerate(layers) for k, a in (("w", w), ("b", b))}

    n = len(layers)

    def loss(model: dict[str, Any], x: Any, y: Any) -> Any:
        h = x
        for i in range(n):
            h = h @ model[f"w{i}"] + model[f"b{i}"]
            if i < n - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    b = ad.backend("jax")
    steps: dict[str, Step] = {}
    last: dict[str, Callable[[], float]] = {}

    def ours_chain() -> tuple[Step, Callable[[], float]]:
        model = fresh()
        holder = {"model": model, "state": optim.setup(optim.Adam(LR), model), "loss": None}

        def step() -> Any:
            holder["state"], holder["model"], holder["loss"] = ad.train_step(
                loss, holder["model"], (x, y), holder["state"], backend=b)
            return holder["loss"]

        return step, lambda: float(holder["loss"])

    steps["ours"], last["ours"] = ours_chain()
    op, last["ours op by op"] = ours_chain()
    steps["ours op by op"] = _without_compile(op)

    opt = optax.adam(LR)

    @jax.jit
    def native_step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def native_chain(sync: bool) -> tuple[Step, Callable[[], float]]:
        params = fresh()
        holder = {"params": params, "opt": opt.init(params), "loss": None}

        def step() -> Any:
            holder["params"], holder["opt"], holder["loss"] = native_step(holder["params"], holder["opt"], x, y)
            return float(holder["loss"]) if sync else holder["loss"]

        return step, lambda: float(holder["loss"])

    steps["native"], last["native"] = native_chain(True)
    steps["native no sync"], last["native no sync"] = native_chain(False)

    @jax.jit
    def checked_step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        finite = jnp.isfinite(value) & jnp.all(jnp.asarray(
            [jnp.isfinite(a).all() for a in jax.tree_util.tree_leaves((grads, new))]))
        return new, opt_state, value, finite

    def checked_chain() -> tuple[Step, Callable[[], float]]:
        params = fresh()
        holder = {"params": params, "opt": opt.init(params), "loss": None}

        def step() -> Any:
            new, opt_state, value, finite = checked_step(holder["params"], holder["opt"], x, y)
            if not bool(finite):  # before the new values replace the old ones, as ad.train_step's check
                raise FloatingPointError("a non-finite loss, gradient or parameter")
            holder["params"], holder["opt"], holder["loss"] = new, opt_state, value
            return value

        return step, lambda: float(holder["loss"])

    steps["native checked"], last["native checked"] = checked_chain()
    return steps, last


def _implicit_ours(fresh: Callable[[], Any], loss: Callable[..., Any], b: Any, x: Any,
                   y: Any) -> tuple[dict[str, Step], dict[str, Callable[[], float]]]:
    """``ad.train_step`` in implicit mode on a fresh model, compiled and op by op (the steps, and
    each one's last loss)."""
    steps: dict[str, Step] = {}
    last: dict[str, Callable[[], float]] = {}

    def ours_chain() -> tuple[Step, Callable[[], float]]:
        model = fresh()
        holder = {"state": optim.setup(optim.Adam(LR), model), "loss": None}

        def step() -> Any:
            holder["state"], _, holder["loss"] = ad.train_step(loss, model, (x, y), holder["state"], backend=b)
            return holder["loss"]

        return step, lambda: float(holder["loss"])

    steps["ours"], last["ours"] = ours_chain()
    op, last["ours op by op"] = ours_chain()
    steps["ours op by op"] = _without_compile(op)
    return steps, last


def _tensorflow(size: str) -> tuple[dict[str, Step], dict[str, Callable[[], float]]]:
    import keras
    import tensorflow as tf

    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(f"keras runs on {keras.backend.backend()!r} (KERAS_BACKEND), not tensorflow")
    layers, x_np, y_np = _data(size)
    x, y = tf.constant(x_np), tf.constant(y_np)
    din = x_np.shape[1]

    def fresh() -> Any:
        model = keras.Sequential(
            [keras.Input((din,))]
            + [keras.layers.Dense(w.shape[1], activation="relu" if i < len(layers) - 1 else None)
               for i, (w, _) in enumerate(layers)]
        )
        model.set_weights([a for pair in layers for a in pair])
        return model

    def loss(model: Any, x: Any, y: Any) -> Any:
        return keras.ops.mean((model(x) - y) ** 2)

    b = ad.Implicit("tensorflow")
    steps, last = _implicit_ours(fresh, loss, b, x, y)

    def native_chain(sync: bool) -> tuple[Step, Callable[[], float]]:
        model = fresh()
        opt = keras.optimizers.Adam(LR)
        opt.build(model.trainable_variables)
        holder: dict[str, Any] = {"loss": None}

        @tf.function
        def native_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                value = loss(model, x, y)
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return value

        def step() -> Any:
            holder["loss"] = native_step(x, y)
            return float(holder["loss"]) if sync else holder["loss"]

        return step, lambda: float(holder["loss"])

    steps["native"], last["native"] = native_chain(True)
    steps["native no sync"], last["native no sync"] = native_chain(False)
    return steps, last


def _torch(size: str) -> tuple[dict[str, Step], dict[str, Callable[[], float]]]:
    import torch

    layers, x_np, y_np = _data(size)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

    def fresh() -> Any:
        mods: list[Any] = []
        for i, (w, bias) in enumerate(layers):
            lin = torch.nn.Linear(*w.shape)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w.T.copy()))
                lin.bias.copy_(torch.from_numpy(bias))
            mods.append(lin)
            if i < len(layers) - 1:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods)

    def loss(model: Any, x: Any, y: Any) -> Any:
        return ((model(x) - y) ** 2).mean()

    b = ad.Implicit("torch")
    steps, last = _implicit_ours(fresh, loss, b, x, y)

    model = fresh()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    holder: dict[str, Any] = {"loss": None}

    def native_step() -> Any:
        opt.zero_grad()
        value = loss(model, x, y)
        value.backward()
        opt.step()
        holder["loss"] = value.item()
        return holder["loss"]

    steps["native"], last["native"] = native_step, lambda: float(holder["loss"])
    return steps, last


CASES = {"jax": _jax, "tensorflow": _tensorflow, "torch": _torch}


# ---------------------------------------------------------------- timing
def _finisher(library: str) -> Callable[[Any], Any]:
    """Wait for a step's result where the library dispatches asynchronously (jax), so that
    a block of steps is timed to its end; the other libraries' steps here return finished."""
    if library == "jax":
        import jax

        return jax.block_until_ready
    return lambda out: out


def time_steps(steps: dict[str, Step], finish: Callable[[Any], Any], warmup: int, n: int,
               repeats: int) -> dict[str, float]:
    """Seconds per step of each variant: the minimum over ``repeats`` interleaved rounds of
    the mean of ``n`` consecutive steps (the harness's interleaving, with a fixed block)."""
    for step in steps.values():  # the first calls compile
        for _ in range(warmup):
            out = step()
        finish(out)
    best = {name: float("inf") for name in steps}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, step in steps.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    out = step()
                finish(out)
                best[name] = min(best[name], (time.perf_counter() - t0) / n)
    finally:
        if gc_was_enabled:
            gc.enable()
    return best


def _entries() -> list[Any]:
    """The entries of ``ad.train_step``'s compiled-step cache."""
    return list(cs.STEPS._entries._entries.values())


def run_case(library: str, size: str, warmup: int, n: int, repeats: int) -> dict[str, Any]:
    steps, last = CASES[library](size)
    before = {id(e) for e in _entries()}
    timings = time_steps(steps, _finisher(library), warmup, n, repeats)
    # every chain took warmup + repeats * n steps from the same start: the losses agree
    losses = {name: get() for name, get in last.items()}
    ref = losses["native"]
    spread = max(abs(v - ref) for v in losses.values()) / _initial_loss(size)  # relative to where it started
    new = [e for e in _entries() if id(e) not in before]
    failed = sum(e.run is cs._FAILED for e in new)
    note = f"{len(new) - failed} step(s) compiled, {failed} failed (cs.STEPS holds {len(cs.STEPS)})"
    return {"library": library, "size": size, **{f"{k} s": v for k, v in timings.items()},
            "losses": losses, "loss spread": spread, "note": note}


def run(names: list[str], warmup: int = 10, n: int = 100, repeats: int = 7) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        reason = _missing(name)
        if reason:
            print(f"  skipping {name}: {reason}", file=sys.stderr, flush=True)
            continue
        for size in SIZES:
            print(f"  training step / {name} / {size} ...", file=sys.stderr, flush=True)
            rows.append(run_case(name, size, warmup, n, repeats))
            r = rows[-1]
            print(f"    {r['note']}; final losses differ by {r['loss spread']:.1e} of the first", file=sys.stderr)
    return rows


def _us(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    us = 1e6 * seconds
    return f"{us:,.1f}" if us < 1000 else f"{us:,.0f}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| library | size | ours (us/step) | native (us/step) | ratio | ours op by op (us/step) | ratio "
        "| native no sync (us/step) | native checked (us/step) | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ours, native, op, nosync, checked = (r.get(f"{v} s") for v in VARIANTS)
        cells = [r["library"], r["size"], _us(ours), _us(native), f"{ours / native:.2f}", _us(op),
                 f"{op / native:.2f}", _us(nosync) if nosync is not None else "n/a (syncs anyway)",
                 _us(checked), f"{ours / checked:.2f}" if checked is not None else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training", description=__doc__.split("\n\n")[0])
    parser.add_argument("library", nargs="*", help=f"of {', '.join(LIBRARIES)}; default: all installed")
    parser.add_argument("--steps", type=int, default=100, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=20, help="interleaved rounds (minimum taken)")
    parser.add_argument("--warmup", type=int, default=10, help="steps per variant before timing")
    opts = parser.parse_args(argv)
    unknown = sorted(set(opts.library) - set(LIBRARIES))
    if unknown:
        parser.error(f"unknown library {', '.join(unknown)} (choose from {', '.join(LIBRARIES)})")
    rows = run(opts.library or list(LIBRARIES), opts.warmup, opts.steps, opts.repeats)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

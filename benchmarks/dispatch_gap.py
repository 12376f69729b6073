"""What the Python between two compiled jax steps costs: the optax small-MLP step of
``benchmarks.training`` (``jax.jit``, Adam, batch 128), each step's result read before the
next is dispatched (as ``ad.train_step``'s finite check reads its report), with a fixed
number of microseconds of busy Python before each dispatch.

On a CPU, XLA runs a step on a worker thread, which spins for a few microseconds after a step
and then sleeps; a dispatch that finds it asleep waits for it to be woken.  A loop whose
Python between steps is longer than the spin pays that wake-up once per step, on top of
the Python itself: this is where ``ad.train_step`` (tens of microseconds of Python per step:
recognising the step's form, rebuilding the returned trees) loses to the bare optax loop on
a small model, and why a large model hides it.

``python -m benchmarks.dispatch_gap`` prints the table (the fastest of 9 interleaved rounds of
300 steps for each gap).
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import numpy as np

GAPS_US = (0, 5, 10, 20, 40)


def _step() -> tuple[Callable[[], Any], Callable[[Any], None]]:
    import jax
    import jax.numpy as jnp
    import optax

    rng = np.random.default_rng(0)
    params = {"w0": jnp.asarray(rng.standard_normal((32, 64)).astype(np.float32) * 0.25),
              "b0": jnp.zeros(64, jnp.float32),
              "w1": jnp.asarray(rng.standard_normal((64, 1)).astype(np.float32) * 0.18),
              "b1": jnp.zeros(1, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((128, 32)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((128, 1)).astype(np.float32))
    opt = optax.adam(1e-3)

    def loss(p: Any) -> Any:
        return jnp.mean((jax.nn.relu(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"] - y) ** 2)

    @jax.jit
    def step(p: Any, s: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    holder = [params, opt.init(params)]

    def run() -> Any:
        holder[0], holder[1], value = step(holder[0], holder[1])
        return value

    def read(value: Any) -> None:  # polled, as ad.train_step's jax sync
        while not value.is_ready():
            pass
        np.asarray(value)

    return run, read


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(rounds: int = 9, steps: int = 300) -> dict[int, float]:
    """``{gap in us: seconds per step}``."""
    step, read = _step()

    def loop(gap: float) -> None:
        for _ in range(steps):
            _busy(gap)
            read(step())

    for gap in GAPS_US:
        loop(gap * 1e-6)
    best = dict.fromkeys(GAPS_US, float("inf"))
    gc.disable()
    try:
        for _ in range(rounds):
            for gap in GAPS_US:
                start = time.perf_counter()
                loop(gap * 1e-6)
                best[gap] = min(best[gap], (time.perf_counter() - start) / steps)
    finally:
        gc.enable()
    return best


def table(best: dict[int, float]) -> list[str]:
    base = best[GAPS_US[0]]
    lines = ["| Python before each dispatch (us) | step (us) | over no gap, less the gap (us) |", "|---:|---:|---:|"]
    lines += [f"| {gap} | {t * 1e6:.1f} | {(t - base) * 1e6 - gap:.1f} |" for gap, t in best.items()]
    return lines


if __name__ == "__main__":
    print("\n".join(table(run())))

"""Crossing libraries: ``ad.differentiate_with`` around an identity kernel, against the caller's
own identity.

For each caller library and each kernel library, ``g = ad.differentiate_with(lambda t: t,
kernel)`` on 10^6 float32 elements allocated by the caller: the time of a value call ``g(x)``
and of a pullback through it (``dy`` back to ``x``, what a gradient does at the boundary),
against the same calls of a plain identity in the caller's library.  The kernel does no
work: the difference is what crossing costs (a copy of 4 MB is a few hundred
microseconds).  *shares* says whether the result lies in the caller's own memory
(``np.shares_memory`` of the value with ``x``, of the pullback with ``dy``): zero copy end to
end.

``python -m benchmarks.compose`` prints the table; ``python -m benchmarks`` adds it to
docs/benchmarks.md (``--no-compose`` skips it).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

import abstractdiff as ad

from .harness import _time_rounds

#: Callers and kernels.  autograd's arrays are numpy's: its value call is a plain numpy call.
LIBRARIES = ("torch", "jax", "tensorflow", "autograd")
SIZE = 10**6
#: The section's text in docs/benchmarks.md (markdown lines).
DESCRIPTION = [
    "`g = ad.differentiate_with(lambda t: t, kernel)` called from another library's code on 10^6 float32 "
    "elements that library allocated (numpy's `np.ones` for autograd): *value* is `g(x)`, *pullback* the "
    "pullback of `dy` through it (what a gradient does at the boundary: torch `autograd.grad` with "
    "`grad_outputs`, jax `jit` of `vjp`, tensorflow a `GradientTape` with `output_gradients`, autograd "
    "`make_vjp`), each against the same call of a plain identity in the caller's library (*native*). The "
    "kernel does no work, so the difference is the cost of crossing; a copy of the 4 MB costs a few hundred "
    "microseconds. *shares* is `np.shares_memory` of the result with the caller's `x` (value) or `dy` "
    "(pullback): no copy end to end. Median of interleaved rounds.",
    "",
    "What still copies: jax callers (`jax.pure_callback` copies the callback's result into a jax buffer); "
    "tensorflow callers in eager mode (`tf.numpy_function` copies its tensors to numpy and back); a numpy "
    "array into a jax kernel unless it happens to be aligned to 64 bytes (jax shares only such memory; "
    "numpy guarantees 16); the pullback of a jax kernel (jax's compiled pullback writes a new buffer).",
]


def _identity(t: Any) -> Any:
    return t


def _caller_arrays(caller: str) -> tuple[Any, Any]:
    """``x`` and ``dy``, allocated the caller library's own way."""
    if caller == "torch":
        import torch

        return torch.linspace(-1.0, 1.0, SIZE), torch.ones(SIZE)
    if caller == "jax":
        import jax.numpy as jnp

        return jnp.linspace(-1.0, 1.0, SIZE, dtype=jnp.float32), jnp.ones(SIZE, dtype=jnp.float32)
    if caller == "tensorflow":
        import tensorflow as tf

        return tf.linspace(-1.0, 1.0, SIZE), tf.ones(SIZE)
    return np.linspace(-1.0, 1.0, SIZE, dtype=np.float32), np.ones(SIZE, dtype=np.float32)


def _calls(caller: str, fun: Callable[[Any], Any], x: Any, dy: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The caller library's value call and pullback of ``fun`` at ``x`` (along ``dy``)."""
    if caller == "torch":
        import torch

        def pullback_torch() -> Any:
            leaf = x.detach().requires_grad_()
            return torch.autograd.grad(fun(leaf), leaf, dy)[0]

        return lambda: fun(x), pullback_torch
    if caller == "jax":
        import jax

        value = jax.jit(lambda t: fun(t))
        vjp = jax.jit(lambda t, d: jax.vjp(fun, t)[1](d)[0])
        return lambda: jax.block_until_ready(value(x)), lambda: jax.block_until_ready(vjp(x, dy))
    if caller == "tensorflow":
        import tensorflow as tf

        def pullback_tf() -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fun(x)
            return tape.gradient(y, x, output_gradients=dy)

        return lambda: fun(x), pullback_tf
    import autograd

    return lambda: fun(x), lambda: autograd.make_vjp(fun)(x)[0](dy)


def run_pair(caller: str, kernel: str, rounds: int, min_time: float) -> dict[str, Any]:
    """Medians (seconds) of the four calls, and whether the crossing shares memory."""
    x, dy = _caller_arrays(caller)
    view = ad.backend(caller).numpy_view
    g = ad.differentiate_with(_identity, kernel)
    native_value, native_pullback = _calls(caller, _identity, x, dy)
    value, pullback = _calls(caller, g, x, dy)
    y, dx = value(), pullback()
    np.testing.assert_array_equal(view(y), view(x))  # speed must not hide wrong numbers
    np.testing.assert_array_equal(view(dx), view(dy))
    assert view(y).dtype == view(dx).dtype == np.float32
    timings = _time_rounds({"native value": native_value, "value": value, "native pullback": native_pullback,
                            "pullback": pullback}, rounds, min_time)
    return {"caller": caller, "kernel": kernel, **{name: t for name, (t, _) in timings.items()},
            "value shares": bool(np.shares_memory(view(y), view(x))),
            "pullback shares": bool(np.shares_memory(view(dx), view(dy)))}


def run(names: list[str], rounds: int = 15, min_time: float = 0.05) -> list[dict[str, Any]]:
    """Every (caller, kernel) pair of two different libraries among ``names``."""
    return [run_pair(caller, kernel, rounds, min_time) for caller in names for kernel in names if caller != kernel]


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| caller | kernel | native value (us) | value (us) | overhead (us) | shares | native pullback (us) "
        "| pullback (us) | overhead (us) | shares |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        cells = []
        for part in ("value", "pullback"):
            native, crossing = 1e6 * r[f"native {part}"], 1e6 * r[part]
            shares = "yes" if r[f"{part} shares"] else "no"
            cells += [f"{native:,.1f}", f"{crossing:,.1f}", f"{crossing - native:+,.1f}", shares]
        lines.append(f"| {r['caller']} | {r['kernel']} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    names = [n for n in (sys.argv[1:] or LIBRARIES) if n in ad.available_backends()]
    print("\n".join(table(run(names))))

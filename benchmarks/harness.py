"""Native vs abstractdiff (unprepared, prepared) vs EagerPy, timed side by side.

Every variant computes ``value_and_gradient`` of the same autoray-written workload on
inputs already converted to the backend's arrays, so the ratio to native is the cost of
the interface alone.  Variants are interleaved round by round (A B C A B C ...) so that
machine noise hits them alike; the figure is the median per-call time over rounds.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import optree

import abstractdiff as ad

from .workloads import Workload

Call = Callable[[], Any]


@dataclass
class Result:
    backend: str
    workload: str
    variant: str
    median_us: float | None
    note: str = ""
    spread: float | None = None  # interquartile range over rounds, relative to the median


def _static_positions(args: tuple) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(args) if not hasattr(a, "shape"))


def _to(b: ad.Backend, tree: Any, dtype: str) -> Any:
    def leaf(a: Any) -> Any:
        if isinstance(a, np.ndarray):
            return b.asarray(a.astype(dtype) if a.dtype.kind == "f" else a)
        return a

    return optree.tree_map(leaf, tree)


# ---------------------------------------------------------------- natives
def native_torch(wl: Workload, x: Any, args: tuple) -> Call:
    import torch

    leaves, treedef = optree.tree_flatten(x)

    def call() -> Any:
        params = [p.detach().requires_grad_() for p in leaves]
        y = wl.f(optree.tree_unflatten(treedef, params), *args)
        return y, torch.autograd.grad(y, params)

    return call


def native_jax(wl: Workload, x: Any, args: tuple) -> Call:
    import jax

    static = _static_positions(args)
    vg = jax.jit(jax.value_and_grad(wl.f), static_argnums=tuple(1 + i for i in static))

    def call() -> Any:
        return jax.block_until_ready(vg(x, *args))

    return call


def native_tensorflow(wl: Workload, x: Any, args: tuple) -> Call:
    import tensorflow as tf

    @tf.function
    def vg(x: Any, *args: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = wl.f(x, *args)
        return y, tape.gradient(y, x)

    def call() -> Any:
        return vg(x, *args)

    return call


def native_autograd(wl: Workload, x: Any, args: tuple) -> Call:
    import autograd

    vg = autograd.value_and_grad(wl.f)

    def call() -> Any:
        return vg(x, *args)

    return call


def native_mlx(wl: Workload, x: Any, args: tuple) -> Call:
    import mlx.core as mx

    static = _static_positions(args)
    dynamic = [a for i, a in enumerate(args) if i not in static]

    def loss(x: Any, *dyn: Any) -> Any:
        it = iter(dyn)
        return wl.f(x, *[a if i in static else next(it) for i, a in enumerate(args)])

    vg = mx.compile(mx.value_and_grad(loss))

    def call() -> Any:
        out = vg(x, *dynamic)
        mx.eval(out)  # MLX is lazy: time the computation, not the graph building
        return out

    return call


def native_paddle(wl: Workload, x: Any, args: tuple) -> Call:
    import paddle

    leaves, treedef = optree.tree_flatten(x)

    def call() -> Any:
        params = [p.detach() for p in leaves]
        for p in params:
            p.stop_gradient = False
        y = wl.f(optree.tree_unflatten(treedef, params), *args)
        return y, paddle.grad(y, params)

    return call


def native_pytensor(wl: Workload, x: Any, args: tuple) -> Call:
    import pytensor
    import pytensor.tensor as pt

    leaves, treedef = optree.tree_flatten(x)
    static = _static_positions(args)
    sym_x = [pt.tensor(dtype=str(a.dtype), shape=a.shape) for a in leaves]
    sym_args = [a if i in static else pt.tensor(dtype=str(a.dtype), shape=a.shape) for i, a in enumerate(args)]
    y = wl.f(optree.tree_unflatten(treedef, sym_x), *sym_args)
    grads = pytensor.grad(y, sym_x)
    inputs = sym_x + [a for i, a in enumerate(sym_args) if i not in static]
    fn = pytensor.function(inputs, [y, *grads])  # compiled once: the idiomatic PyTensor call
    values = list(leaves) + [a for i, a in enumerate(args) if i not in static]

    def call() -> Any:
        return fn(*values)

    return call


NATIVE = {
    "torch": native_torch, "jax": native_jax, "tensorflow": native_tensorflow, "autograd": native_autograd,
    "mlx": native_mlx, "paddle": native_paddle, "pytensor": native_pytensor,
}


def eagerpy_call(wl: Workload, b: ad.Backend, x: Any, args: tuple) -> Call | str:
    """EagerPy's ``value_and_grad`` where it supports the backend.

    EagerPy differentiates a single tensor, so pytree workloads are raveled into one
    vector and unraveled inside the function (a few slices: small next to the work).
    """
    if b.name not in ("torch", "jax", "tensorflow"):
        return "EagerPy has no gradient for this backend"
    try:
        import eagerpy as ep
    except ImportError:
        return "eagerpy not installed"
    from autoray import do

    leaves, treedef = optree.tree_flatten(x)
    shapes = [tuple(v.shape) for v in leaves]
    sizes = [int(np.prod(s)) for s in shapes]
    flat = do("concatenate", [do("reshape", v, (-1,)) for v in leaves], axis=0)

    def f_flat(v: Any) -> Any:
        raw, parts, start = v.raw, [], 0
        for shape, size in zip(shapes, sizes):
            parts.append(do("reshape", raw[start : start + size], shape))
            start += size
        return ep.astensor(wl.f(optree.tree_unflatten(treedef, parts), *args))

    xv = ep.astensor(flat)

    def call() -> Any:
        y, g = ep.value_and_grad(f_flat, xv)
        if b.name == "jax":
            import jax

            jax.block_until_ready(g.raw)
        return y, g

    return call


# ------------------------------------------------------------------ timing
def _time_rounds(calls: dict[str, Call], rounds: int, min_time: float) -> dict[str, tuple[float, float]]:
    """``(median seconds per call, relative spread)`` per variant, interleaved round by round."""
    inner: dict[str, int] = {}
    for name, call in calls.items():  # warm up (compiles), then size the inner loop
        call()
        call()
        t0 = time.perf_counter()
        call()
        once = max(time.perf_counter() - t0, 1e-7)
        inner[name] = max(1, int(min_time / once))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, call in calls.items():
                n = inner[name]
                t0 = time.perf_counter()
                for _ in range(n):
                    call()
                samples[name].append((time.perf_counter() - t0) / n)
    finally:
        if gc_was_enabled:
            gc.enable()
    out = {}
    for name, s in samples.items():
        q1, _, q3 = statistics.quantiles(s, n=4) if len(s) > 1 else (s[0], s[0], s[0])
        median = statistics.median(s)
        out[name] = (median, (q3 - q1) / median)
    return out


def _check_agree(reference: Any, other: Any, rtol: float) -> None:
    ry, rg = ad.to_numpy(reference[0]), optree.tree_leaves(ad.to_numpy(reference[1]))
    oy, og = ad.to_numpy(other[0]), optree.tree_leaves(ad.to_numpy(other[1]))
    np.testing.assert_allclose(oy, ry, rtol=rtol)
    for a, b in zip(og, rg):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b))))


def _synchronizer(name: str) -> Callable[[Any], Any]:
    """Wait for the result where the library dispatches asynchronously (jax), as native does."""
    if name == "jax":
        import jax

        return jax.block_until_ready
    return lambda out: out


#: Backend options that make abstractdiff's variant compare like for like with the native
#: one: MLX's idiomatic fast call is ``mx.compile``d, and its backend compiles only when asked.
BACKEND_OPTIONS: dict[str, dict[str, Any]] = {"mlx": {"compile": True}}


def bench_backend(name: str) -> ad.Backend:
    return ad.backend(name, **BACKEND_OPTIONS.get(name, {}))


def run_backend(name: str, wl: Workload, dtype: str, rounds: int, min_time: float) -> list[Result]:
    b = bench_backend(name)
    x, args = _to(b, wl.x, dtype), _to(b, wl.args, dtype)
    calls: dict[str, Call] = {}
    results: list[Result] = []
    if name in NATIVE:
        calls["native"] = NATIVE[name](wl, x, args)
    sync = _synchronizer(name)
    prepared = ad.prepare_value_and_gradient(b, wl.f, x, *args)
    calls["abstractdiff"] = lambda: sync(ad.value_and_gradient(b, wl.f, x, *args))
    calls["abstractdiff prepared"] = lambda: sync(prepared(x, *args))
    ep_call = eagerpy_call(wl, b, x, args)
    if isinstance(ep_call, str):
        results.append(Result(name, wl.name, "eagerpy", None, ep_call))
    else:
        calls["eagerpy"] = ep_call
    # Speed must not hide wrong numbers: every variant agrees with the first one.
    rtol = 1e-4 if dtype == "float32" else 1e-9
    reference = calls["abstractdiff"]()
    for variant in ("native", "abstractdiff prepared"):
        if variant in calls:
            _check_agree(reference, calls[variant](), rtol)
    medians = _time_rounds(calls, rounds, min_time)
    results[:0] = [Result(name, wl.name, v, t * 1e6, spread=sp) for v, (t, sp) in medians.items()]
    return results

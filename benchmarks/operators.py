"""Jacobians and Hessian-vector products, prepared, against each library's own idiom.

Two workloads, written once with autoray:

* ``jacobian``: the dense Jacobian of ``f(x) = tanh(W x) + sin(x) * x`` from R^100 to
  R^100 (``W`` passed as an argument);
* ``hvp``: the Hessian-vector product of the GMM objective (d=10, K=25, n=1000) with
  respect to its parameter tree, along a fixed random tangent.

*native* is the library's idiomatic call: jax ``jit(jacrev(f))`` and ``jit`` of
``jvp(grad(f))``; torch ``torch.func.jacrev`` and ``torch.func.jvp`` of
``torch.func.grad``; tensorflow a ``tf.function`` with ``tape.jacobian`` and a
``ForwardAccumulator`` over a ``GradientTape``; autograd ``jacobian`` and
``hessian_vector_product``.  *prepared* is ``ad.prepare_jacobian`` / ``ad.prepare_hvp`` called
repeatedly.  Every variant's result is checked against the other before timing.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import optree
from autoray import numpy as anp

import abstractdiff as ad

from .harness import Call, _check_agree, _static_positions, _synchronizer, _time_rounds, _to, bench_backend
from .workloads import gmm

BACKENDS = ("jax", "torch", "tensorflow", "autograd")
#: The section's text in docs/benchmarks.md (markdown lines).
DESCRIPTION = [
    "Two workloads: `jacobian`, the dense Jacobian of `f(x) = tanh(W x) + sin(x) * x` from R^100 to R^100 "
    "(`W` passed as an argument); `hvp`, the Hessian-vector product of the GMM objective (d=10, K=25, "
    "n=1000) with respect to its parameter tree, along a fixed random tangent.",
    "",
    "*native* is the library's idiomatic call: jax `jit(jacrev(f))` and `jit` of `jvp(grad(f))`; torch "
    "`torch.func.jacrev` and `torch.func.jvp` of `torch.func.grad`; tensorflow a `tf.function` with "
    "`tape.jacobian` and one with a `ForwardAccumulator` over a `GradientTape`; autograd `jacobian` and "
    "`hessian_vector_product`. *prepared* is `ad.prepare_jacobian(...)` / `ad.prepare_hvp(...)` called "
    "repeatedly. Both variants' results agree (checked before timing).",
]
TARGET = 1.10  # prepared / native


def jacobian_f(x: Any, w: Any) -> Any:
    return anp.tanh(anp.matmul(w, x)) + anp.sin(x) * x


def jacobian_inputs(n: int = 100) -> tuple[np.ndarray, tuple]:
    rng = np.random.default_rng(1)
    return rng.normal(size=n), (rng.normal(size=(n, n)) / np.sqrt(n),)


# ----------------------------------------------------------------- natives
def _native_jacobian(name: str, f: Callable, x: Any, args: tuple) -> Call:
    if name == "jax":
        import jax

        jac = jax.jit(jax.jacrev(f))
        return lambda: jax.block_until_ready(jac(x, *args))
    if name == "torch":
        import torch.func

        jac = torch.func.jacrev(f)
        return lambda: jac(x, *args)
    if name == "tensorflow":
        import tensorflow as tf

        @tf.function
        def jac_tf(x: Any, *args: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = f(x, *args)
            return tape.jacobian(y, x)

        return lambda: jac_tf(x, *args)
    import autograd

    jac_ag = autograd.jacobian(f)
    return lambda: jac_ag(x, *args)


def _native_hvp(name: str, f: Callable, x: Any, v: Any, args: tuple) -> Call:
    static = _static_positions(args)
    dynamic = [a for i, a in enumerate(args) if i not in static]

    def bind(*dyn: Any) -> Callable[[Any], Any]:
        it = iter(dyn)
        full = [a if i in static else next(it) for i, a in enumerate(args)]
        return lambda p: f(p, *full)

    if name == "jax":
        import jax

        @jax.jit
        def hvp_jax(x: Any, v: Any, *dyn: Any) -> Any:
            return jax.jvp(jax.grad(bind(*dyn)), (x,), (v,))[1]

        return lambda: jax.block_until_ready(hvp_jax(x, v, *dynamic))
    if name == "torch":
        import torch.func

        g = torch.func.grad(bind(*dynamic))
        return lambda: torch.func.jvp(g, (x,), (v,))[1]
    if name == "tensorflow":
        import tensorflow as tf

        leaves, treedef = optree.tree_flatten(x)
        v_leaves = optree.tree_leaves(v)

        @tf.function
        def hvp_tf(leaves: list, v_leaves: list, *dyn: Any) -> Any:
            loss = bind(*dyn)
            with tf.autodiff.ForwardAccumulator(leaves, v_leaves) as acc:
                with tf.GradientTape() as tape:
                    tape.watch(leaves)
                    y = loss(optree.tree_unflatten(treedef, leaves))
                grads = tape.gradient(y, leaves)
            return acc.jvp(grads)

        return lambda: optree.tree_unflatten(treedef, hvp_tf(leaves, v_leaves, *dynamic))
    import autograd
    from autograd.misc.flatten import flatten

    flat_x, unflatten = flatten(x)
    flat_v, _ = flatten(v)
    hvp_ag = autograd.hessian_vector_product(lambda p: bind(*dynamic)(unflatten(p)))
    return lambda: unflatten(hvp_ag(flat_x, flat_v))


# ------------------------------------------------------------------- runs
def _call(sync: Callable[[Any], Any], prepared: Callable[..., Any], *inputs: Any) -> Call:
    return lambda: sync(prepared(*inputs))


def run(names: list[str], dtype: str, rounds: int, min_time: float) -> list[tuple[str, str, dict]]:
    """``(operator, backend, {variant: (median s, spread)})`` for each backend and operator."""
    rtol = 1e-4 if dtype == "float32" else 1e-9
    out = []
    x_np, args_np = jacobian_inputs()
    wl = gmm()
    rng = np.random.default_rng(2)
    v_np = optree.tree_map(lambda a: rng.normal(size=np.shape(a)), wl.x)
    for name in names:
        b = bench_backend(name)
        sync = _synchronizer(name)
        # jacobian
        x, args = _to(b, x_np, dtype), _to(b, args_np, dtype)
        jac = ad.prepare_jacobian(b, jacobian_f, x, *args)
        calls = {"native": _native_jacobian(name, jacobian_f, x, args), "prepared": _call(sync, jac, x, *args)}
        np.testing.assert_allclose(ad.to_numpy(calls["prepared"]()), ad.to_numpy(calls["native"]()), rtol=rtol,
                                   atol=rtol)
        out.append(("jacobian", name, _time_rounds(calls, rounds, min_time)))
        # hvp
        x, args, v = _to(b, wl.x, dtype), _to(b, wl.args, dtype), _to(b, v_np, dtype)
        hvp = ad.prepare_hvp(b, wl.f, x, v, *args)
        calls = {"native": _native_hvp(name, wl.f, x, v, args), "prepared": _call(sync, hvp, x, v, *args)}
        _check_agree((0.0, calls["prepared"]()), (0.0, calls["native"]()), rtol)
        out.append(("hvp", name, _time_rounds(calls, rounds, min_time)))
    return out


def table(results: list[tuple[str, str, dict]]) -> list[str]:
    lines = ["| operator | backend | native (us) | spread | prepared (us) | ratio |", "|---|---|---:|---:|---:|---:|"]
    for op, name, timings in results:
        native, spread = timings["native"]
        prepared, _ = timings["prepared"]
        lines.append(
            f"| {op} | {name} | {native * 1e6:,.1f} | ±{50 * spread:.0f}% | {prepared * 1e6:,.1f} | "
            f"{prepared / native:.2f} |"
        )
    return lines

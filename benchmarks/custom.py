"""Custom derivatives: ``ad.custom_vjp`` against each library's own mechanism, called directly.

One rule, a softplus whose reverse rule is ``ct * sigmoid(x)``, on 10^5 float32 elements:
the gradient of ``sum(softplus(x))`` taken by the library's own driver (``jax.jit`` of
``jax.grad``, torch ``autograd.grad``, a tensorflow ``GradientTape``, autograd ``grad``,
``mx.grad``, ``paddle.grad``), once through the rule written with the library's mechanism
(``jax.custom_vjp``, ``torch.autograd.Function``, ``tf.custom_gradient``, autograd
``primitive``/``defvjp``, ``mx.custom_function``, paddle ``PyLayer``) and once through the
same rule written once with ``ad.custom_vjp``.  Same operations, same driver: the
difference is what ``ad.custom_vjp`` costs.  Both results are checked equal first.

``python -m benchmarks.custom`` prints the table; ``python -m benchmarks`` adds it to
docs/benchmarks.md (``--no-custom`` skips it).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

import abstractdiff as ad

from .harness import _time_rounds

LIBRARIES = ("jax", "torch", "tensorflow", "autograd", "mlx", "paddle")
SIZE = 10**5
TARGET = 1.10
DESCRIPTION = [
    "The gradient of `sum(softplus(x))` on 10^5 float32 elements, whose softplus has the reverse rule "
    "`ct * sigmoid(x)`, by each library's own driver (`jax.jit(jax.grad)`, torch `autograd.grad`, a "
    "tensorflow `GradientTape` in eager mode, autograd `grad`, `mx.grad`, `paddle.grad`): *native* writes "
    "the rule with the library's mechanism (`jax.custom_vjp`, `torch.autograd.Function`, `tf.custom_gradient`, "
    "autograd `primitive`, `mx.custom_function`, paddle `PyLayer`), *ad.custom_vjp* the same operations once "
    f"for every library. Target: within {TARGET:.2f}x of native on jax, torch and tensorflow. Median of "
    "interleaved rounds.",
]


def _rule(ops: dict[str, Callable[[Any], Any]]) -> Any:
    """The rule written once, with ``ops`` of the library (its softplus and sigmoid)."""
    softplus, sigmoid = ops["softplus"], ops["sigmoid"]

    @ad.custom_vjp
    def rule(x):
        return softplus(x)

    rule.defvjp(lambda x: (softplus(x), x), lambda x, ct: (ct * sigmoid(x),))
    return rule


def _case(library: str) -> tuple[Any, Callable[[Any], Any], Callable[[Any], Any], Callable[[Any], Any]]:
    """``(x, to_numpy, native gradient call, ad.custom_vjp gradient call)``."""
    x64 = np.linspace(-4.0, 4.0, SIZE)
    if library == "jax":
        import jax
        import jax.numpy as jnp

        @jax.custom_vjp
        def native(x):
            return jax.nn.softplus(x)

        native.defvjp(lambda x: (jax.nn.softplus(x), x), lambda x, ct: (ct * jax.nn.sigmoid(x),))
        rule = _rule({"softplus": jax.nn.softplus, "sigmoid": jax.nn.sigmoid})
        x = jnp.asarray(x64, dtype=jnp.float32)
        grad_native = jax.jit(jax.grad(lambda x: native(x).sum()))
        grad_ad = jax.jit(jax.grad(lambda x: rule(x).sum()))
        return x, np.asarray, lambda x: jax.block_until_ready(grad_native(x)), \
            lambda x: jax.block_until_ready(grad_ad(x))
    if library == "torch":
        import torch

        class Native(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any) -> Any:
                ctx.save_for_backward(x)
                return torch.nn.functional.softplus(x)

            @staticmethod
            def backward(ctx: Any, ct: Any) -> Any:
                (x,) = ctx.saved_tensors
                return ct * torch.sigmoid(x)

        rule = _rule({"softplus": torch.nn.functional.softplus, "sigmoid": torch.sigmoid})

        def grad_of(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def grad(x: Any) -> Any:
                leaf = x.detach().requires_grad_()
                return torch.autograd.grad(f(leaf).sum(), leaf)[0]

            return grad

        return torch.tensor(x64, dtype=torch.float32), lambda t: t.numpy(), grad_of(Native.apply), grad_of(rule)
    if library == "tensorflow":
        import tensorflow as tf

        @tf.custom_gradient
        def native(x):
            return tf.math.softplus(x), lambda ct: ct * tf.sigmoid(x)

        rule = _rule({"softplus": tf.math.softplus, "sigmoid": tf.sigmoid})

        def grad_of_tf(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def grad(x: Any) -> Any:
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = tf.reduce_sum(f(x))
                return tape.gradient(y, x)

            return grad

        return tf.constant(x64, dtype=tf.float32), lambda t: t.numpy(), grad_of_tf(native), grad_of_tf(rule)
    if library == "autograd":
        import autograd
        import autograd.numpy as anp
        from autograd.extend import defvjp, primitive

        def softplus(x):
            return anp.logaddexp(x, 0.0)

        def sigmoid(x):
            return 0.5 * (anp.tanh(0.5 * x) + 1)

        native = primitive(lambda x: np.logaddexp(x, 0.0))
        defvjp(native, lambda ans, x: lambda ct: ct * sigmoid(x))
        rule = _rule({"softplus": softplus, "sigmoid": sigmoid})
        return x64.astype(np.float32), np.asarray, autograd.grad(lambda x: anp.sum(native(x))), \
            autograd.grad(lambda x: anp.sum(rule(x)))
    if library == "mlx":
        import mlx.core as mx
        import mlx.nn

        native = mx.custom_function(mlx.nn.softplus)

        @native.vjp
        def _(primals: Any, cotangents: Any, outputs: Any) -> Any:
            return cotangents * mx.sigmoid(primals)

        rule = _rule({"softplus": mlx.nn.softplus, "sigmoid": mx.sigmoid})
        grad_native = mx.grad(lambda x: native(x).sum())
        grad_ad = mx.grad(lambda x: rule(x).sum())

        def evaluated(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
            def call(x: Any) -> Any:
                out = f(x)
                mx.eval(out)
                return out

            return call

        return mx.array(x64.astype(np.float32)), np.asarray, evaluated(grad_native), evaluated(grad_ad)
    import paddle
    import paddle.nn.functional as pf

    class Native(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return pf.softplus(x)

        @staticmethod
        def backward(ctx: Any, ct: Any) -> Any:
            (x,) = ctx.saved_tensor()
            return ct * pf.sigmoid(x)

    rule = _rule({"softplus": pf.softplus, "sigmoid": pf.sigmoid})

    def grad_of_paddle(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def grad(x: Any) -> Any:
            leaf = x.detach()
            leaf.stop_gradient = False
            return paddle.grad([f(leaf).sum()], [leaf])[0]

        return grad

    return paddle.to_tensor(x64.astype(np.float32)), lambda t: t.numpy(), grad_of_paddle(Native.apply), \
        grad_of_paddle(rule)


def run_library(library: str, rounds: int, min_time: float) -> dict[str, Any]:
    x, to_numpy, native, custom = _case(library)
    expected = 0.5 * (np.tanh(0.5 * np.linspace(-4.0, 4.0, SIZE)) + 1)
    for call in (native, custom):  # speed must not hide wrong numbers
        np.testing.assert_allclose(to_numpy(call(x)), expected, rtol=1e-5, atol=1e-6)
    timings = _time_rounds({"native": lambda: native(x), "custom_vjp": lambda: custom(x)}, rounds, min_time)
    return {"library": library, **{name: t for name, (t, _) in timings.items()}}


def run(names: list[str], rounds: int = 15, min_time: float = 0.05) -> list[dict[str, Any]]:
    return [run_library(name, rounds, min_time) for name in names]


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| library | native (us) | ad.custom_vjp (us) | ratio |", "|---|---:|---:|---:|"]
    for r in rows:
        native, custom = 1e6 * r["native"], 1e6 * r["custom_vjp"]
        lines.append(f"| {r['library']} | {native:,.1f} | {custom:,.1f} | {custom / native:.2f} |")
    return lines


if __name__ == "__main__":
    names = [n for n in (sys.argv[1:] or LIBRARIES) if n in ad.available_backends()]
    print("\n".join(table(run(names))))

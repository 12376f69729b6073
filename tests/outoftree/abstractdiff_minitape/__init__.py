"""abstractdiff adapter for minitape: one module, registered through an entry point.

    [project.entry-points."abstractdiff.backends"]
    minitape = "abstractdiff_minitape:MinitapeBackend"

One primitive, minitape's reverse mode (``minitape.grad``), and the hooks for minitape's
arrays and variables; the core derives every operator (pushforward, jacobian, hessian,
hvp...), implicit mode (through the :meth:`swap` hook), the optimisers, ``ad.train`` and
checkpoints.  Everything else (``cast``, ``zeros_like``, ``read``, ``write``...) is the
hooks' numpy-like defaults, which reach minitape through autoray.

Nested use: when an input already requires grad, an abstractdiff operator is running
inside another one (a Hessian is the Jacobian of the gradient); the inputs are then
aliased rather than detached and the backward pass is recorded (``create_graph``), so the
outer derivative flows through the inner one.
"""

from __future__ import annotations

from typing import Any, Callable

import minitape as mt
import numpy as np
import optree

import abstractdiff as ad

__all__ = ["MinitapeBackend"]


def _detached(tree: Any) -> Any:
    return optree.tree_map(lambda v: v.detach() if isinstance(v, mt.Array) else v, tree)


class MinitapeBackend(ad.Backend):
    name = "minitape"
    modules = ("minitape",)

    def __init__(self, *, device: str | None = None):
        super().__init__(device=device)

    # ------------------------------------------------------------ primitive
    def flat_value_and_pullback(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, Callable]:
        nested = mt.is_grad_enabled() and any(isinstance(a, mt.Array) and a.requires_grad for a in (*xs, *data))
        # fresh leaves (the caller's arrays are never marked), or aliases inside an outer derivative
        leaves = [x.view() if nested and x.requires_grad else x.detach().requires_grad_() for x in xs]
        with mt.enable_grad():
            y, aux = fn(leaves, data)
        y = mt.asarray(y)  # f may return a numpy array or a number that does not depend on x

        def vjp(dy: Any) -> list:
            return mt.grad(y, leaves, dy, create_graph=nested)

        return (y, aux, vjp) if nested else (y.detach(), _detached(aux), vjp)

    # ------------------------------------------------------------ arrays
    def is_native(self, a: Any) -> bool:
        return isinstance(a, mt.Array)

    def from_numpy(self, a: np.ndarray) -> mt.Array:
        return mt.asarray(a)

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(mt.to_numpy(a.value if isinstance(a, mt.Parameter) else a))

    # ------------------------------------------------------------ variables
    def is_variable(self, v: Any) -> bool:
        return isinstance(v, mt.Parameter)

    def model_variables(self, obj: Any) -> tuple[list, int] | None:
        if not isinstance(obj, mt.Module):
            return None
        params = obj.parameters()
        trainable = [p for p in params if p.trainable]
        return trainable, len(params) - len(trainable)

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        return list(obj.named_parameters()) if isinstance(obj, mt.Module) else None

    def new_variable(self, value: Any) -> mt.Parameter:
        return mt.Parameter(value)

    def swap(self, var: mt.Parameter, value: Any) -> Any:
        return var.swap(value)

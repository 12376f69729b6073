"""Optimisation rules with explicit state: Optimisers.jl semantics in optax's shape.

A rule is an immutable set of hyperparameters.  Its state lives in a separate tree
built by :func:`setup`, mirroring the model, and :func:`update` returns the new state
and the new model::

    from abstractdiff import optim
    rule = optim.chain(optim.ClipNorm(1.0), optim.Adam(lr=1e-3))
    state = optim.setup(rule, model)
    state, model = optim.update(state, model, grads)

A rule defines two methods, ``init(x) -> leaf_state`` and ``apply(leaf_state, x, g) ->
(leaf_state, delta)``; the parameter becomes ``x - delta``.  The formulas use only
arithmetic operators (and ``autoray`` for ``sqrt``/``abs``/``sum``), so one definition
runs on numpy, torch, jax, tensorflow and autograd arrays and keeps their dtype.

The model is either a pytree of arrays (explicit mode: :func:`update` is pure and
returns new arrays) or holds variables (implicit mode: a ``torch.nn.Module``, a Keras
model, ``ad.variables(...)`` or ``ad.Params``; :func:`update` takes the ``ad.Grads``
from the implicit backend, assigns the new values in place and returns the model).

Hyperparameters may be schedules (:mod:`abstractdiff.optim.schedules`, functions of
``state.step``); :func:`adjust` changes them in a state, :func:`freeze`/:func:`thaw`
exclude subtrees from updates.
"""

from __future__ import annotations

from . import schedules
from ._rules import (
    AccumulateGradients,
    AdaBelief,
    Adagrad,
    Adam,
    AdamW,
    Chain,
    ClipGlobalNorm,
    ClipGrad,
    ClipNorm,
    Descent,
    Lion,
    Momentum,
    Nesterov,
    RMSProp,
    Rule,
    SignDecay,
    WeightDecay,
    chain,
)
from ._state import (
    Frozen,
    OptState,
    SetUpFor,
    _apply,
    _is_float_leaf,
    _is_grads,
    _is_params,
    _is_variable,
    adjust,
    arithmetic_scope,
    freeze,
    holds_variables,
    params_of,
    read,
    setup,
    thaw,
    update,
    write,
    x64_scope,
)

__all__ = [
    "AccumulateGradients",
    "AdaBelief",
    "Adagrad",
    "Adam",
    "AdamW",
    "Chain",
    "ClipGlobalNorm",
    "ClipGrad",
    "ClipNorm",
    "Descent",
    "Lion",
    "Momentum",
    "Nesterov",
    "OptState",
    "RMSProp",
    "Rule",
    "SignDecay",
    "WeightDecay",
    "adjust",
    "chain",
    "freeze",
    "setup",
    "thaw",
    "update",
]

# the helpers the training layer and checkpoints use (not public API)
_INTERNAL = (_apply, _is_float_leaf, _is_grads, _is_params, _is_variable, arithmetic_scope, holds_variables,
             params_of, read, write, x64_scope, Frozen, SetUpFor, schedules)

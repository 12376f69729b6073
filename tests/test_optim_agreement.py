"""The rules against the anchors: ``torch.optim`` and ``optax`` on the same gradient sequence.

50 steps in float64 from the same start; the trajectories agree to 1e-12 (relative to
the parameters' size).  Each case states the mapping of hyperparameters (the table in
docs/guide/training.md).  torch and optax are imported here only: the core never does.
"""

from __future__ import annotations

import numpy as np
import pytest

from abstractdiff import optim
from abstractdiff.optim import schedules

STEPS = 50
TOL = 1e-12


def gradients(shape=(3, 4), steps=STEPS):
    rng = np.random.default_rng(42)
    return rng.normal(size=shape), [rng.normal(size=shape) * (1 + 0.5 * np.sin(t)) for t in range(steps)]


def ours(rule, x0, gs):
    state, x, out = optim.setup(rule, x0), x0, []
    for g in gs:
        state, x = optim.update(state, x, g)
        out.append(x)
    return out


def with_torch(make, x0, gs):
    torch = pytest.importorskip("torch")
    p = torch.tensor(x0, dtype=torch.float64, requires_grad=True)
    opt, out = make(torch.optim, [p]), []
    for g in gs:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


def with_optax(make, x0, gs):
    optax = pytest.importorskip("optax")
    import jax
    import jax.numpy as jnp

    out = []
    with jax.enable_x64(True):  # local: the global configuration is left alone
        tx = make(optax)
        params = jnp.asarray(x0)
        state = tx.init(params)
        for g in gs:
            updates, state = tx.update(jnp.asarray(g), state, params)
            params = optax.apply_updates(params, updates)
            out.append(np.asarray(params))
    return out


def max_relative_difference(a, b) -> float:
    return max(float(np.abs(x - y).max() / max(1.0, np.abs(y).max())) for x, y in zip(a, b))


# (id, our rule, torch.optim factory or None, optax factory or None)
WARMUP = dict(init_value=0.0, peak_value=0.05, warmup_steps=10, decay_steps=40, end_value=0.001)
CASES = [
    ("Descent", optim.Descent(0.05), lambda o, p: o.SGD(p, lr=0.05), lambda ox: ox.sgd(0.05)),
    (
        "Momentum",  # v_ours = lr * buf_torch (lr constant); torch dampening=0
        optim.Momentum(0.05, 0.9),
        lambda o, p: o.SGD(p, lr=0.05, momentum=0.9),
        lambda ox: ox.sgd(0.05, momentum=0.9),
    ),
    (
        "Nesterov",
        optim.Nesterov(0.05, 0.9),
        lambda o, p: o.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda ox: ox.sgd(0.05, momentum=0.9, nesterov=True),
    ),
    (
        "WeightDecay+Momentum",  # torch's weight_decay is L2 added to the gradient
        optim.chain(optim.WeightDecay(0.01), optim.Momentum(0.05, 0.9)),
        lambda o, p: o.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
        lambda ox: ox.chain(ox.add_decayed_weights(0.01), ox.sgd(0.05, momentum=0.9)),
    ),
    (
        "RMSProp",  # optax puts eps inside the square root unless eps_in_sqrt=False
        optim.RMSProp(0.01, 0.9, 1e-8),
        lambda o, p: o.RMSprop(p, lr=0.01, alpha=0.9, eps=1e-8),
        lambda ox: ox.rmsprop(0.01, decay=0.9, eps=1e-8, eps_in_sqrt=False),
    ),
    (
        "Adam",
        optim.Adam(0.01, (0.9, 0.99), 1e-8),
        lambda o, p: o.Adam(p, lr=0.01, betas=(0.9, 0.99), eps=1e-8),
        lambda ox: ox.adam(0.01, b1=0.9, b2=0.99, eps=1e-8),
    ),
    (
        "AdamW",  # decay scaled by lr in all three: x -= lr * (u + wd * x)
        optim.AdamW(0.01, (0.9, 0.99), weight_decay=0.1, eps=1e-8),
        lambda o, p: o.AdamW(p, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
        lambda ox: ox.adamw(0.01, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1),
    ),
    (
        "Adagrad-torch",
        optim.Adagrad(0.1, eps=1e-10, initial_accumulator_value=0.1),
        lambda o, p: o.Adagrad(p, lr=0.1, eps=1e-10, initial_accumulator_value=0.1),
        None,
    ),
    (
        "Adagrad-optax",  # optax: g / sqrt(acc + eps); with eps = 0 that is ours with eps = 0
        optim.Adagrad(0.1, eps=0.0, initial_accumulator_value=0.1),
        None,
        lambda ox: ox.adagrad(0.1, initial_accumulator_value=0.1, eps=0.0),
    ),
    (
        "Lion",  # optax's lion decays weights by default (weight_decay=1e-3): turned off
        optim.Lion(0.01, (0.9, 0.99)),
        None,
        lambda ox: ox.lion(0.01, b1=0.9, b2=0.99, weight_decay=0.0),
    ),
    (
        "AdaBelief",
        optim.AdaBelief(0.01, (0.9, 0.99), eps=1e-16),
        None,
        lambda ox: ox.adabelief(0.01, b1=0.9, b2=0.99, eps=1e-16, eps_root=1e-16),
    ),
    (
        "ClipGlobalNorm+Descent",
        optim.chain(optim.ClipGlobalNorm(2.0), optim.Descent(0.05)),
        None,
        lambda ox: ox.chain(ox.clip_by_global_norm(2.0), ox.sgd(0.05)),
    ),
    (
        "ClipGrad+Descent",
        optim.chain(optim.ClipGrad(0.5), optim.Descent(0.05)),
        None,
        lambda ox: ox.chain(ox.clip(0.5), ox.sgd(0.05)),
    ),
    (
        "AccumulateGradients+Adam",  # optax accumulates in float32 unless told otherwise
        optim.chain(optim.AccumulateGradients(3), optim.Adam(0.01)),
        None,
        lambda ox: ox.MultiSteps(ox.adam(0.01), every_k_schedule=3, accumulator_dtype="float64"),
    ),
    (
        "Adam+warmup_cosine",  # optax's int32 step count makes its schedule float32: given a float64 one
        optim.Adam(schedules.warmup_cosine(**WARMUP)),
        None,
        lambda ox: ox.adam(lambda count: ox.warmup_cosine_decay_schedule(**WARMUP)(count.astype("float64"))),
    ),
]


PAIRS = [
    pytest.param(name, rule, anchor, make, id=f"{name}-{anchor}")
    for name, rule, torch_make, optax_make in CASES
    for anchor, make in (("torch", torch_make), ("optax", optax_make))
    if make is not None
]


@pytest.mark.parametrize("name,rule,anchor,make", PAIRS)
def test_trajectory_agrees_with_the_anchor(name, rule, anchor, make):
    x0, gs = gradients()
    theirs = (with_torch if anchor == "torch" else with_optax)(make, x0, gs)
    diff = max_relative_difference(ours(rule, x0, gs), theirs)
    print(f"{name:<26} {anchor:<6} {diff:.1e}")
    assert diff <= TOL, f"{name} vs {anchor}: {diff:.2e}"
    assert max_relative_difference([x0], [theirs[-1]]) > 1e-3, "the trajectory must move"

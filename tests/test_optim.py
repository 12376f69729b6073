"""The optimisation rules against hand-written numpy references, on every backend's arrays."""

from __future__ import annotations

import math

import autoray
import numpy as np
import optree
import pytest

import abstractdiff as ad
from abstractdiff import optim

ARRAY_LIBS = ["numpy", "torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor"]
RTOL = {"float64": 1e-12, "float32": 2e-6}


def lib_backend(lib: str):
    """The backend whose native arrays are ``lib``'s, or skip with the reason."""
    if lib == "numpy":
        return ad.backend("finite_differences")
    try:
        return ad.backend(lib)
    except ad.BackendUnavailableError as err:
        pytest.skip(str(err))


def close(got, want, dtype: str) -> None:
    got, want = np.asarray(ad.to_numpy(got), dtype=np.float64), np.asarray(want, dtype=np.float64)
    rtol = RTOL[dtype]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, float(np.abs(want).max())))


# ------------------------------------------------------------- references
# Written out independently of abstractdiff.optim, one loop per rule, in float64.
def ref_descent(x, gs, lr):
    out = []
    for g in gs:
        x = x - lr * g
        out.append(x)
    return out


def ref_momentum(x, gs, lr, rho):
    v, out = np.zeros_like(x), []
    for g in gs:
        v = rho * v + lr * g
        x = x - v
        out.append(x)
    return out


def ref_nesterov(x, gs, lr, rho):
    v, out = np.zeros_like(x), []
    for g in gs:
        d = -(rho**2) * v + (1 + rho) * lr * g
        v = rho * v - lr * g
        x = x - d
        out.append(x)
    return out


def ref_rmsprop(x, gs, lr, rho, eps):
    s, out = np.zeros_like(x), []
    for g in gs:
        s = rho * s + (1 - rho) * g**2
        x = x - lr * g / (np.sqrt(s) + eps)
        out.append(x)
    return out


def ref_adamw(x, gs, lr, b1, b2, eps, wd):
    m, s, out = np.zeros_like(x), np.zeros_like(x), []
    for t, g in enumerate(gs, start=1):
        m = b1 * m + (1 - b1) * g
        s = b2 * s + (1 - b2) * g**2
        u = (m / (1 - b1**t)) / (np.sqrt(s / (1 - b2**t)) + eps)
        x = x - lr * (u + wd * x)
        out.append(x)
    return out


def ref_adam(x, gs, lr, b1, b2, eps):
    m, s, out = np.zeros_like(x), np.zeros_like(x), []
    for t, g in enumerate(gs, start=1):
        m = b1 * m + (1 - b1) * g
        s = b2 * s + (1 - b2) * g**2
        x = x - lr * (m / (1 - b1**t)) / (np.sqrt(s / (1 - b2**t)) + eps)
        out.append(x)
    return out


def clip(g, omega, p):
    norm = np.abs(g).max() if math.isinf(p) else (np.abs(g) ** p).sum() ** (1 / p)
    return g * min(omega / norm, 1.0) if norm > 0 else g


def ref_clip_adam(x, gs, omega, p, lr):
    return ref_adam(x, [clip(g, omega, p) for g in gs], lr, 0.9, 0.999, 1e-8)


def ref_clip_descent(x, gs, omega, p, lr):
    return ref_descent(x, [clip(g, omega, p) for g in gs], lr)


def ref_adagrad(x, gs, lr, eps, acc0):
    acc, out = np.full_like(x, acc0), []
    for g in gs:
        acc = acc + g**2
        x = x - lr * g / (np.sqrt(acc) + eps)
        out.append(x)
    return out


def ref_adabelief(x, gs, lr, b1, b2, eps):
    m, s, out = np.zeros_like(x), np.zeros_like(x), []
    for t, g in enumerate(gs, start=1):
        m = b1 * m + (1 - b1) * g
        s = b2 * s + (1 - b2) * (g - m) ** 2 + eps
        x = x - lr * (m / (1 - b1**t)) / (np.sqrt(s / (1 - b2**t)) + eps)
        out.append(x)
    return out


def ref_lion(x, gs, lr, b1, b2):
    m, out = np.zeros_like(x), []
    for g in gs:
        x = x - lr * np.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
        out.append(x)
    return out


def ref_decay_momentum(x, gs, wd, kappa, lr, rho):
    """chain(WeightDecay(wd), SignDecay(kappa), Momentum(lr, rho))."""
    v, out = np.zeros_like(x), []
    for g in gs:
        v = rho * v + lr * (g + wd * x + kappa * np.sign(x))
        x = x - v
        out.append(x)
    return out


def ref_accumulate_adam(x, gs, n, lr):
    """chain(AccumulateGradients(n), Adam(lr)): Adam on the mean of each n gradients."""
    out, means = [], []
    for k in range(len(gs) // n):
        means.append(sum(gs[k * n : (k + 1) * n]) / n)
    steps = ref_adam(x, means, lr, 0.9, 0.999, 1e-8)
    for i in range(len(gs)):
        done = (i + 1) // n
        out.append(x if done == 0 else steps[done - 1])
    return out


def ref_scheduled_adam(x, gs, schedule):
    m, s, out = np.zeros_like(x), np.zeros_like(x), []
    for t, g in enumerate(gs, start=1):
        m = 0.9 * m + 0.1 * g
        s = 0.999 * s + 0.001 * g**2
        x = x - schedule(t - 1) * (m / (1 - 0.9**t)) / (np.sqrt(s / (1 - 0.999**t)) + 1e-8)
        out.append(x)
    return out


def cosine_lr(t):
    return 0.05 * 0.5 * (1 + math.cos(math.pi * min(t, 4) / 4))


# (id, rule, reference(x, gradients) -> x after each step)
CASES = [
    ("Descent", optim.Descent(lr=0.1), lambda x, gs: ref_descent(x, gs, 0.1)),
    ("Momentum", optim.Momentum(lr=0.05, rho=0.8), lambda x, gs: ref_momentum(x, gs, 0.05, 0.8)),
    ("Nesterov", optim.Nesterov(lr=0.05, rho=0.7), lambda x, gs: ref_nesterov(x, gs, 0.05, 0.7)),
    ("RMSProp", optim.RMSProp(lr=0.01, rho=0.85, eps=1e-6), lambda x, gs: ref_rmsprop(x, gs, 0.01, 0.85, 1e-6)),
    (
        "Adam",
        optim.Adam(lr=0.02, betas=(0.8, 0.99), eps=1e-7),
        lambda x, gs: ref_adam(x, gs, 0.02, 0.8, 0.99, 1e-7),
    ),
    (
        "AdamW",
        optim.AdamW(lr=0.02, betas=(0.85, 0.995), weight_decay=0.1, eps=1e-7),
        lambda x, gs: ref_adamw(x, gs, 0.02, 0.85, 0.995, 1e-7, 0.1),
    ),
    (
        "ClipNorm-2",
        optim.chain(optim.ClipNorm(0.5), optim.Descent(0.1)),
        lambda x, gs: ref_clip_descent(x, gs, 0.5, 2, 0.1),
    ),
    (
        "ClipNorm-1",
        optim.chain(optim.ClipNorm(0.7, p=1), optim.Adam(0.01)),
        lambda x, gs: ref_clip_adam(x, gs, 0.7, 1, 0.01),
    ),
    (
        "ClipNorm-inf",
        optim.chain(optim.ClipNorm(0.3, p=math.inf), optim.Descent(0.1)),
        lambda x, gs: ref_clip_descent(x, gs, 0.3, math.inf, 0.1),
    ),
]
CASES += [
    (
        "ClipGrad",
        optim.chain(optim.ClipGrad(0.5), optim.Descent(0.1)),
        lambda x, gs: ref_descent(x, [np.clip(g, -0.5, 0.5) for g in gs], 0.1),
    ),
    (
        "WeightDecay+SignDecay",
        optim.chain(optim.WeightDecay(0.1), optim.SignDecay(0.05), optim.Momentum(0.05, 0.8)),
        lambda x, gs: ref_decay_momentum(x, gs, 0.1, 0.05, 0.05, 0.8),
    ),
    (
        "AccumulateGradients",
        optim.chain(optim.AccumulateGradients(2), optim.Adam(0.02)),
        lambda x, gs: ref_accumulate_adam(x, gs, 2, 0.02),
    ),
    (
        "Adagrad",
        optim.Adagrad(lr=0.1, eps=1e-6, initial_accumulator_value=0.1),
        lambda x, gs: ref_adagrad(x, gs, 0.1, 1e-6, 0.1),
    ),
    (
        "AdaBelief",
        optim.AdaBelief(lr=0.02, betas=(0.8, 0.99), eps=1e-8),
        lambda x, gs: ref_adabelief(x, gs, 0.02, 0.8, 0.99, 1e-8),
    ),
    ("Lion", optim.Lion(lr=0.02, betas=(0.8, 0.95)), lambda x, gs: ref_lion(x, gs, 0.02, 0.8, 0.95)),
    (
        "Adam-cosine-schedule",
        optim.Adam(lr=optim.schedules.cosine(0.05, 4)),
        lambda x, gs: ref_scheduled_adam(x, gs, cosine_lr),
    ),
]
RULES = [c[1] for c in CASES]


def model_and_grads(dtype: str, steps: int = 5):
    rng = np.random.default_rng(0)
    model = {"a": rng.normal(size=3).astype(dtype), "b": rng.normal(size=(2, 2)).astype(dtype), "n": 7}
    grads = [
        {"a": rng.normal(size=3).astype(dtype), "b": rng.normal(size=(2, 2)).astype(dtype), "n": None}
        for _ in range(steps)
    ]
    return model, grads


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("lib", ARRAY_LIBS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rule_matches_numpy_reference(case, lib, dtype):
    name, rule, reference = case
    b = lib_backend(lib)
    model, grads = model_and_grads(dtype)
    native = lambda tree: {k: (b.convert(v) if isinstance(v, np.ndarray) else v) for k, v in tree.items()}  # noqa: E731
    m = native(model)
    state = optim.setup(rule, m)
    for g in grads:
        state, m = optim.update(state, m, native(g))
        assert b.is_native(m["a"]) and b.is_native(m["b"])
        assert ad.to_numpy(m["a"]).dtype == np.dtype(dtype), "dtype must be preserved"
    assert state.step == len(grads)
    assert m["n"] == 7
    for key in ("a", "b"):
        want = reference(model[key].astype(np.float64), [g[key].astype(np.float64) for g in grads])
        close(m[key], want[-1], dtype)


@pytest.mark.parametrize("lib", ARRAY_LIBS)
def test_jax_float64_is_kept_without_global_x64(lib):
    b = lib_backend(lib)
    model = {"w": b.convert(np.linspace(0.1, 1.0, 4))}
    state = optim.setup(optim.Adam(1e-3), model)
    state, new = optim.update(state, model, {"w": b.convert(np.ones(4))})
    assert ad.to_numpy(new["w"]).dtype == np.float64
    assert ad.to_numpy(state.tree["w"][1]).dtype == np.float64
    if lib == "jax":
        import jax

        assert not jax.config.jax_enable_x64, "the global jax configuration must not change"


def test_numpy_float64_with_jax_float64_gradients_stays_float64():
    # numpy float64 values (ad.Variable boxes, or a numpy model) with jax float64
    # gradients: the update computes in jax and must run in the local x64 scope
    jax = pytest.importorskip("jax")
    jb = ad.backend("jax")
    g = jb.convert(np.array([1.0, -2.0, 3.0]))
    assert ad.to_numpy(g).dtype == np.float64
    w = ad.Variable(np.ones(3))
    state = optim.setup(optim.Adam(0.1), [w])
    state, _ = optim.update(state, [w], ad.Grads([w], [g]))
    gn = ad.to_numpy(g)
    want = 1 - 0.1 * gn / (np.abs(gn) + 1e-8)  # Adam's first step; float32 would be off by ~1e-8
    assert ad.to_numpy(w.value).dtype == np.float64
    np.testing.assert_allclose(ad.to_numpy(w.value), want, rtol=1e-12)
    model = {"w": np.ones(3)}
    state = optim.setup(optim.Adam(0.1), model)
    state, new = optim.update(state, model, {"w": g})
    assert ad.to_numpy(new["w"]).dtype == np.float64
    assert ad.to_numpy(state.tree["w"][1]).dtype == np.float64
    np.testing.assert_allclose(ad.to_numpy(new["w"]), want, rtol=1e-12)
    assert not jax.config.jax_enable_x64, "the global jax configuration must not change"


@pytest.mark.parametrize("lib", ARRAY_LIBS)
@pytest.mark.parametrize("rule", RULES, ids=[c[0] for c in CASES])
def test_inputs_not_mutated(rule, lib):
    b = lib_backend(lib)
    model, grads = model_and_grads("float64", steps=2)
    native = lambda tree: {k: (b.convert(v) if isinstance(v, np.ndarray) else v) for k, v in tree.items()}  # noqa: E731
    m = native(model)
    state = optim.setup(rule, m)
    state, m = optim.update(state, m, native(grads[0]))  # a non-trivial state (Adam's t = 1)
    before_state = snapshot(state)
    before_model = snapshot(m)
    g = native(grads[1])
    before_g = snapshot(g)
    optim.update(state, m, g)
    for before, now in ((before_state, state), (before_model, m), (before_g, g)):
        after = snapshot(now)
        assert len(after) == len(before)
        for x, y in zip(after, before):
            if isinstance(x, np.ndarray):
                np.testing.assert_array_equal(x, y)
            else:
                assert x == y


def snapshot(tree):
    """Copies of every leaf of ``tree`` as numpy arrays (Python values as they are)."""
    return [np.array(v) if hasattr(v, "shape") else v for v in optree.tree_leaves(ad.to_numpy(tree))]


# ------------------------------------------------------------- convergence
def rosenbrock_grad(x):
    return np.array([-2 * (1 - x[0]) - 400 * x[0] * (x[1] - x[0] ** 2), 200 * (x[1] - x[0] ** 2)])


CONVERGE = [
    ("Descent", optim.Descent(1.5e-3), 0.05),
    ("Momentum", optim.Momentum(1e-3, 0.9), 1e-3),
    ("Nesterov", optim.Nesterov(1e-3, 0.9), 1e-3),
    ("RMSProp", optim.RMSProp(1e-3), 0.02),
    ("Adam", optim.Adam(1e-2), 0.01),
    ("AdamW", optim.AdamW(1e-2), 0.01),
    ("ClipNorm+Adam", optim.chain(optim.ClipNorm(1.0), optim.Adam(1e-2)), 0.01),
]


@pytest.mark.parametrize("rule,tol", [c[1:] for c in CONVERGE], ids=[c[0] for c in CONVERGE])
def test_converges_on_rosenbrock_and_parabola(rule, tol):
    x = np.zeros(2)
    state = optim.setup(rule, x)
    for _ in range(5000):
        state, x = optim.update(state, x, rosenbrock_grad(x))
    assert np.abs(x - 1).max() < tol, x
    target = np.array([1.0, -2.0, 3.0])
    p = np.zeros(3)
    state = optim.setup(rule, p)
    for _ in range(5000):
        state, p = optim.update(state, p, 2 * (p - target))
    np.testing.assert_allclose(p, target, atol=1e-3)


@pytest.mark.parametrize("lib", ["torch", "jax", "tensorflow", "autograd", "finite_differences"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_parabola_through_train_step_on_every_backend(lib, dtype):
    b = lib_backend(lib)
    target = np.array([1.0, -2.0, 3.0], dtype=dtype)

    def loss(model, c):
        return autoray.do("sum", (model["x"] - c) ** 2)

    model = {"x": np.zeros(3, dtype=dtype)}
    state = optim.setup(optim.Momentum(0.05, 0.5), model)
    for _ in range(200):
        state, model, value = ad.train_step(loss, model, (target,), state, backend=b)
    assert b.is_native(model["x"])
    assert ad.to_numpy(model["x"]).dtype == np.dtype(dtype)
    np.testing.assert_allclose(ad.to_numpy(model["x"]), target, atol=1e-4)
    assert float(ad.to_numpy(value)) < 1e-6


# ------------------------------------------------------------- details
def test_clipnorm_scales_to_omega_and_leaves_small_gradients():
    rule = optim.ClipNorm(omega=1.0)
    g = np.array([3.0, 4.0])
    _, out = rule.apply(None, g, g)
    np.testing.assert_allclose(out, [0.6, 0.8])
    _, out = rule.apply(None, g, g * 0.1)
    np.testing.assert_array_equal(out, g * 0.1)
    _, out = rule.apply(None, g, np.zeros(2))
    np.testing.assert_array_equal(out, [0.0, 0.0])
    _, out = optim.ClipNorm(2.0, p=math.inf).apply(None, g, g)
    np.testing.assert_allclose(out, [1.5, 2.0])


def test_chain_applies_in_order_and_keeps_each_state():
    rule = optim.chain(optim.ClipNorm(1.0), optim.Momentum(0.1, 0.5))
    state = optim.setup(rule, {"w": np.zeros(2)})
    assert state.tree["w"][0] is None and state.tree["w"][1].shape == (2,)
    state, model = optim.update(state, {"w": np.zeros(2)}, {"w": np.array([30.0, 40.0])})
    np.testing.assert_allclose(model["w"], [-0.06, -0.08])
    np.testing.assert_allclose(state.tree["w"][1], [0.06, 0.08])


def test_non_float_leaves_and_none_gradients_are_left_alone():
    model = {"w": np.ones(2), "i": np.arange(3), "s": "name", "k": 4}
    state = optim.setup(optim.Descent(0.5), model)
    state, new = optim.update(state, model, {"w": np.ones(2), "i": None, "s": None, "k": None})
    np.testing.assert_array_equal(new["w"], [0.5, 0.5])
    assert new["i"] is model["i"] and new["s"] == "name" and new["k"] == 4


def test_rules_are_immutable_hyperparameters():
    rule = optim.Adam(lr=0.1, betas=[0.9, 0.99])
    assert rule.betas == (0.9, 0.99)
    with pytest.raises(AttributeError):
        rule.lr = 1.0  # type: ignore[misc]
    assert rule == optim.Adam(lr=0.1, betas=(0.9, 0.99))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: optim.Descent(lr=-1.0), "lr must be"),
        (lambda: optim.Descent(lr=float("nan")), "lr must be"),
        (lambda: optim.Momentum(rho=1.0), "rho must be"),
        (lambda: optim.Nesterov(rho=-0.1), "rho must be"),
        (lambda: optim.RMSProp(eps=0.0), "eps must be"),
        (lambda: optim.Adam(betas=(0.9,)), "betas must be a pair"),
        (lambda: optim.Adam(betas=(0.9, 1.5)), r"betas\[1\] must be"),
        (lambda: optim.AdamW(weight_decay=-1.0), "weight_decay must be"),
        (lambda: optim.ClipNorm(omega=0.0), "omega must be"),
        (lambda: optim.ClipNorm(p=0), "p must be"),
    ],
)
def test_bad_hyperparameters_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_chain_rejects_non_rules():
    with pytest.raises(TypeError, match="must be an optim rule"):
        optim.chain(optim.Adam(), "sgd")


def test_setup_and_update_check_their_arguments():
    with pytest.raises(TypeError, match="rule must be an optim rule"):
        optim.setup("adam", {"w": np.ones(2)})
    state = optim.setup(optim.Descent(), {"w": np.ones(2)})
    with pytest.raises(TypeError, match="OptState"):
        optim.update({"w": None}, {"w": np.ones(2)}, {"w": np.ones(2)})
    with pytest.raises(ad.ShapeMismatchError, match="grads must have the structure"):
        optim.update(state, {"w": np.ones(2)}, {"v": np.ones(2)})
    with pytest.raises(ad.ShapeMismatchError, match="call optim.setup"):
        optim.update(state, {"w": np.ones(2), "v": np.ones(2)}, {"w": np.ones(2), "v": np.ones(2)})


def test_setup_imports_no_ad_library():
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, abstractdiff as ad\n"
        "from abstractdiff import optim\n"
        "s = optim.setup(optim.Adam(), {'w': np.ones(2)})\n"
        "optim.update(s, {'w': np.ones(2)}, {'w': np.ones(2)})\n"
        "print([m for m in ('torch', 'jax', 'tensorflow', 'autograd') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

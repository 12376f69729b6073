"""Schedules, adjust, freeze/thaw, whole-tree rules, implicit mode of the newer rules, and
their error messages."""

from __future__ import annotations

import math

import autoray
import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim
from abstractdiff._implicit import current_values
from abstractdiff.optim import schedules

from .test_optim import ARRAY_LIBS, RTOL, close, lib_backend

BACKENDS = ["finite_differences", "jax", "autograd", "torch", "tensorflow", "mlx", "paddle", "pytensor"]


# ------------------------------------------------------------------ schedules
def _optax_schedules():
    optax = pytest.importorskip("optax")
    return [
        ("constant", schedules.constant(0.3), optax.constant_schedule(0.3)),
        ("linear", schedules.linear(1.0, 0.1, 7, transition_begin=3), optax.linear_schedule(1.0, 0.1, 7, 3)),
        ("cosine", schedules.cosine(0.5, 9, alpha=0.1, exponent=2.0), optax.cosine_decay_schedule(0.5, 9, 0.1, 2.0)),
        (
            "exponential",
            schedules.exponential(1.0, 3, 0.7, transition_begin=2, end_value=0.3),
            optax.exponential_decay(1.0, 3, 0.7, 2, end_value=0.3),
        ),
        (
            "exponential-staircase-growth",
            schedules.exponential(0.1, 2, 1.5, staircase=True, end_value=0.5),
            optax.exponential_decay(0.1, 2, 1.5, staircase=True, end_value=0.5),
        ),
        (
            "warmup_cosine",
            schedules.warmup_cosine(0.0, 1.0, 4, 15, end_value=0.05),
            optax.warmup_cosine_decay_schedule(0.0, 1.0, 4, 15, end_value=0.05),
        ),
        (
            "piecewise",
            schedules.piecewise(0.5, {3: 0.5, 8: 0.1, 5: 2.0}),
            optax.piecewise_constant_schedule(0.5, {3: 0.5, 8: 0.1, 5: 2.0}),
        ),
    ]


def test_schedules_match_optax():
    import jax

    with jax.enable_x64(True):
        for name, ours, theirs in _optax_schedules():
            for t in range(25):
                want = float(theirs(np.int64(t)))
                got = ours(t)
                assert isinstance(got, float), name
                assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (name, t, got, want)


def test_warmup_without_warmup_steps_is_the_cosine():
    assert schedules.warmup_cosine(0.0, 2.0, 0, 10)(3) == schedules.cosine(2.0, 10)(3)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: schedules.constant("a"), "value must be a finite number"),
        (lambda: schedules.linear(1.0, 0.0, 0), "transition_steps must be an int >= 1"),
        (lambda: schedules.linear(1.0, 0.0, 3, transition_begin=-1), "transition_begin must be an int >= 0"),
        (lambda: schedules.cosine(1.0, 0), "decay_steps must be an int >= 1"),
        (lambda: schedules.cosine(float("nan"), 3), "init_value must be a finite number"),
        (lambda: schedules.exponential(1.0, 3, 0.0), "decay_rate must be > 0"),
        (lambda: schedules.exponential(1.0, 3, 0.5, staircase=1), "staircase must be a bool"),
        (lambda: schedules.warmup_cosine(0.0, 1.0, 5, 5), "decay_steps .* must be an int > warmup_steps"),
        (lambda: schedules.piecewise(1.0, {3: -0.5}), "scales must be >= 0"),
        (lambda: schedules.piecewise(1.0, {-1: 0.5}), "a boundary must be an int >= 0"),
    ],
)
def test_bad_schedule_arguments_are_rejected(make, match):
    with pytest.raises(ad.InvalidArgumentError, match=match):
        make()


def test_schedule_sees_the_step_count_from_zero_and_is_not_stored_resolved():
    seen = []

    def lr(step):
        seen.append(step)
        return 0.1

    state = optim.setup(optim.Descent(lr), np.zeros(1))  # setup checks lr(0)
    for _ in range(3):
        state, _ = optim.update(state, np.zeros(1), np.ones(1))
    assert seen == [0, 0, 1, 2]
    assert state.rule.lr is lr


def test_schedule_returning_a_non_number_is_a_clear_error():
    with pytest.raises(ad.InvalidArgumentError, match=r"schedule of lr returned 'fast' \(str\) at step 0"):
        optim.setup(optim.Adam(lambda step: "fast"), np.zeros(1))
    rule = optim.Adam(lambda step: 0.1 if step < 2 else None)
    state = optim.setup(rule, np.zeros(1))
    x = np.zeros(1)
    for _ in range(2):
        state, x = optim.update(state, x, np.ones(1))
    with pytest.raises(ad.InvalidArgumentError, match="returned None .* at step 2"):
        optim.update(state, x, np.ones(1))
    negative = optim.setup(optim.Descent(lambda step: 0.1 - step), np.zeros(1))
    negative, _ = optim.update(negative, np.zeros(1), np.ones(1))
    with pytest.raises(ad.InvalidArgumentError, match=r"lr must be a finite number >= 0, got -0.9 .*at step 1"):
        optim.update(negative, np.zeros(1), np.ones(1))


def test_only_schedulable_hyperparameters_take_a_callable():
    with pytest.raises(ad.InvalidArgumentError, match="rho must be"):
        optim.Momentum(0.1, rho=lambda t: 0.9)
    optim.AdamW(1e-3, weight_decay=schedules.linear(0.1, 0.0, 10))  # decay coefficients may be scheduled
    optim.WeightDecay(schedules.constant(0.1))


def test_weight_decay_schedule_is_evaluated():
    rule = optim.chain(optim.WeightDecay(schedules.piecewise(1.0, {1: 0.0})), optim.Descent(0.5))
    state, x = optim.setup(rule, np.array([2.0])), np.array([2.0])
    state, x = optim.update(state, x, np.zeros(1))
    np.testing.assert_allclose(x, [1.0])  # 2 - 0.5 * (0 + 1 * 2)
    state, x = optim.update(state, x, np.zeros(1))
    np.testing.assert_allclose(x, [1.0])  # decay 0 from step 1


def test_scheduled_training_resumes_identically_from_a_checkpoint(tmp_path):
    rule = optim.chain(optim.ClipGlobalNorm(5.0), optim.Adam(schedules.warmup_cosine(0.0, 0.1, 3, 12)))
    target = np.array([1.0, -2.0, 3.0])

    def loss(m, c):
        return autoray.do("sum", (m["w"] - c) ** 2)

    data = [(target,)] * 4
    model = {"w": np.zeros(3)}
    state, model = ad.train(loss, model, data, optim.setup(rule, model), backend="finite_differences", progress=False)
    ad.save_checkpoint(tmp_path / "c.npz", state, model)
    fresh = {"w": np.zeros(3)}
    s2, m2 = ad.load_checkpoint(tmp_path / "c.npz", like=(optim.setup(rule, fresh), fresh))
    assert s2.step == 4
    a = ad.train(loss, model, data, state, backend="finite_differences", progress=False)
    b = ad.train(loss, m2, data, s2, backend="finite_differences", progress=False)
    np.testing.assert_array_equal(a[1]["w"], b[1]["w"])
    assert a[0].step == b[0].step == 8


def test_checkpoint_format_is_unchanged_by_freezing(tmp_path):
    # frozen paths are structure, not leaves: a frozen state's file loads into an unfrozen
    # like (and the other way), as files written before freeze existed do
    model = {"a": np.ones(2), "b": np.ones(2)}
    state = optim.freeze(optim.setup(optim.Adam(0.1), model), "a")
    state, model = optim.update(state, model, {"a": np.ones(2), "b": np.ones(2)})
    ad.save_checkpoint(tmp_path / "c.npz", state, model)
    like = optim.setup(optim.Adam(0.1), model)
    s2, m2 = ad.load_checkpoint(tmp_path / "c.npz", like=(like, model))
    assert s2.step == 1 and s2.frozen == optim.Frozen() and s2.tree["b"][2] == 1 and s2.tree["a"][2] == 0
    s3, _ = ad.load_checkpoint(tmp_path / "c.npz", like=(optim.freeze(like, "a"), model))
    assert s3.frozen.paths == (("a",),)


# ------------------------------------------------------------------ adjust
def test_adjust_changes_every_rule_of_a_chain_and_keeps_the_state():
    rule = optim.chain(optim.ClipNorm(1.0), optim.Momentum(0.1, 0.9), optim.chain(optim.Adam(0.01)))
    model = {"w": np.zeros(2)}
    state = optim.setup(rule, model)
    state, model = optim.update(state, model, {"w": np.ones(2)})
    new = optim.adjust(state, lr=0.5)
    assert new.rule.rules[1].lr == 0.5 and new.rule.rules[2].rules[0].lr == 0.5 and new.rule.rules[0].omega == 1.0
    assert new.step == state.step and new.tree is state.tree
    assert state.rule.rules[1].lr == 0.1, "adjust returns a new state"
    assert optim.adjust(optim.Adam(0.1), lr=0.2, eps=1e-6) == optim.Adam(0.2, eps=1e-6)
    assert optim.adjust(state, lr=schedules.constant(0.3)).rule.rules[1].lr(7) == 0.3


def test_adjust_errors():
    state = optim.setup(optim.chain(optim.ClipNorm(1.0), optim.Adam()), np.zeros(1))
    with pytest.raises(ad.InvalidArgumentError, match=r"no rule .* named 'learning_rate'; its hyperparameters are"):
        optim.adjust(state, learning_rate=0.1)
    with pytest.raises(ad.InvalidArgumentError, match="lr must be a finite number >= 0"):
        optim.adjust(state, lr=-1.0)
    with pytest.raises(ad.InvalidArgumentError, match="name the hyperparameters"):
        optim.adjust(state)
    with pytest.raises(ad.InvalidArgumentError, match="named 'rules'"):
        optim.adjust(state, rules=())
    with pytest.raises(ad.ArgumentTypeError, match="OptState or a rule"):
        optim.adjust({"lr": 1}, lr=0.1)


# ------------------------------------------------------------------ freeze / thaw
def test_frozen_leaves_are_exactly_unchanged_and_keep_their_state():
    model = {"enc": {"w": np.ones(2), "b": np.ones(1)}, "dec": [np.ones(2), np.ones(2)]}
    grads = {"enc": {"w": np.ones(2), "b": np.ones(1)}, "dec": [np.ones(2), np.ones(2)]}
    state = optim.freeze(optim.setup(optim.Adam(0.1), model), "enc")
    state = optim.freeze(state, ("dec", 1))
    state, new = optim.update(state, model, grads)
    assert new["enc"]["w"] is model["enc"]["w"] and new["enc"]["b"] is model["enc"]["b"]
    assert new["dec"][1] is model["dec"][1]
    assert not np.array_equal(new["dec"][0], model["dec"][0])
    assert state.tree["enc"]["w"][2] == 0 and state.tree["dec"][0][2] == 1 and state.step == 1
    # thaw part of a frozen subtree: the rest stays frozen
    state = optim.thaw(state, ("enc", "w"))
    assert set(state.frozen.paths) == {("dec", 1), ("enc", "b")}
    state, new2 = optim.update(state, new, grads)
    assert not np.array_equal(new2["enc"]["w"], model["enc"]["w"]) and new2["enc"]["b"] is model["enc"]["b"]
    assert optim.thaw(state).frozen == optim.Frozen()
    assert set(optim.freeze(optim.freeze(state, "dec"), ("dec", 0)).frozen.paths) == {("enc", "b"), ("dec",)}


def test_freeze_in_implicit_mode_uses_params_order():
    vs = ad.variables([np.ones(2), np.ones(2)], ad.Implicit("finite_differences"))
    state = optim.freeze(optim.setup(optim.Descent(0.5), vs), 0)
    before = ad.to_numpy(vs)
    grads = ad.Grads(list(optim.params_of(vs)), [np.ones(2), np.ones(2)])
    state, _ = optim.update(state, vs, grads)
    after = ad.to_numpy(vs)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_allclose(after[1], [0.5, 0.5])


def test_freeze_errors():
    state = optim.setup(optim.Descent(), {"w": np.ones(2), "layers": [np.ones(1)]})
    with pytest.raises(ad.InvalidArgumentError, match=r"path \('v',\).*starting with one of 'layers', 'w'"):
        optim.freeze(state, "v")
    with pytest.raises(ad.InvalidArgumentError, match="no subtree at the path"):
        optim.freeze(state, ("layers", 3))
    with pytest.raises(ad.InvalidArgumentError, match="no subtree at the path"):
        optim.thaw(state, ("x",))
    with pytest.raises(ad.ArgumentTypeError, match="OptState"):
        optim.freeze({"w": 1}, "w")
    adam = optim.setup(optim.Adam(), {"w": np.ones(2)})
    deep = optim.freeze(adam, ("w", 0))  # a path into Adam's own (m, s, t) state
    with pytest.raises(ad.InvalidArgumentError, match=r"frozen path \('w', 0\) reaches no parameter"):
        optim.update(deep, {"w": np.ones(2)}, {"w": np.ones(2)})


# ------------------------------------------------------------------ whole-tree and accumulation
def ref_global_clip(gs, max_norm):
    norm = math.sqrt(sum(float((g**2).sum()) for g in gs))
    return [g * (max_norm / max(norm, max_norm)) for g in gs]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("lib", ARRAY_LIBS)
def test_clip_global_norm_uses_one_norm_over_the_tree(lib, dtype):
    b = lib_backend(lib)
    rng = np.random.default_rng(1)
    x = {"a": rng.normal(size=3).astype(dtype), "b": rng.normal(size=(2, 2)).astype(dtype)}
    rule = optim.chain(optim.ClipGlobalNorm(0.7), optim.Descent(0.1))
    m = {k: b.convert(v) for k, v in x.items()}
    state = optim.setup(rule, m)
    for scale in (3.0, 0.01):  # clipped, then left alone
        g = {k: (scale * rng.normal(size=v.shape)).astype(dtype) for k, v in x.items()}
        state, m = optim.update(state, m, {k: b.convert(v) for k, v in g.items()})
        want = ref_global_clip([g["a"].astype(np.float64), g["b"].astype(np.float64)], 0.7)
        x = {"a": x["a"] - 0.1 * want[0], "b": x["b"] - 0.1 * want[1]}
        assert b.is_native(m["a"]) and ad.to_numpy(m["a"]).dtype == np.dtype(dtype)
        for k in ("a", "b"):
            close(m[k], x[k], dtype)


def test_clip_global_norm_mixed_dtypes_and_zero_gradients():
    rule = optim.ClipGlobalNorm(1.0)
    _, out = rule.apply_tree([None, None], [None, None], [np.array([3.0]), np.array([4.0], dtype=np.float32)])
    np.testing.assert_allclose(out[0], [0.6]) and np.testing.assert_allclose(out[1], [0.8], rtol=1e-6)
    assert out[1].dtype == np.float32
    _, out = rule.apply_tree([None], [None], [np.zeros(2)])
    np.testing.assert_array_equal(out[0], [0.0, 0.0])


def test_accumulate_gradients_state_and_no_update_in_between():
    rule = optim.chain(optim.AccumulateGradients(3), optim.Momentum(1.0, 0.5))
    x = np.zeros(1)
    state = optim.setup(rule, x)
    first = x
    for g in (1.0, 2.0):
        state, x = optim.update(state, x, np.array([g]))
        assert x is first, "no update between the n-th steps: the same array"
    total, count = state.tree[0]
    np.testing.assert_array_equal(total, [3.0]) and count == 2
    np.testing.assert_array_equal(state.tree[1], [0.0]), "the later rule did not run"
    state, x = optim.update(state, x, np.array([6.0]))
    np.testing.assert_allclose(x, [-3.0])
    assert state.tree[0][1] == 0 and state.step == 3


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: optim.AccumulateGradients(-2), "n must be an int >= 1"),
        (lambda: optim.AccumulateGradients(0), "n must be an int >= 1"),
        (lambda: optim.AccumulateGradients(2.0), "n must be an int >= 1"),
        (lambda: optim.ClipGrad(0.0), "delta must be a number > 0"),
        (lambda: optim.ClipGlobalNorm(-1.0), "max_norm must be a number > 0"),
        (lambda: optim.WeightDecay(-0.1), "weight_decay must be a finite number >= 0"),
        (lambda: optim.SignDecay("a"), "kappa must be a finite number >= 0"),
        (lambda: optim.Adagrad(eps=-1.0), "eps must be a finite number >= 0"),
        (lambda: optim.Adagrad(eps=0.0), "cannot both be 0"),
        (lambda: optim.AdaBelief(betas=(0.9, 1.0)), r"betas\[1\] must be"),
        (lambda: optim.Lion(lr=-1.0), "lr must be"),
    ],
)
def test_bad_hyperparameters_of_the_newer_rules(make, match):
    with pytest.raises(ad.InvalidArgumentError, match=match):
        make()


# ------------------------------------------------------------------ implicit = explicit
IMPLICIT_RULES = [
    ("ClipGlobalNorm+WeightDecay+Adagrad", lambda: optim.chain(
        optim.ClipGlobalNorm(2.0), optim.WeightDecay(0.1), optim.Adagrad(0.1, initial_accumulator_value=0.1))),
    ("ClipGrad+SignDecay+AdaBelief", lambda: optim.chain(
        optim.ClipGrad(1.0), optim.SignDecay(0.01), optim.AdaBelief(0.05, eps=1e-8))),
    ("Accumulate+Lion", lambda: optim.chain(optim.AccumulateGradients(2), optim.Lion(0.05))),
    ("Adam-schedule", lambda: optim.Adam(schedules.exponential(0.1, 2, 0.5))),
]


def _quadratic(model, c):
    return autoray.do("sum", (current_values(model)["w"] - c) ** 2)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("make", [r[1] for r in IMPLICIT_RULES], ids=[r[0] for r in IMPLICIT_RULES])
def test_implicit_mode_matches_explicit_mode(make, name, dtype):
    b = lib_backend("numpy" if name == "finite_differences" else name)
    target = np.array([1.0, -2.0, 3.0], dtype=dtype)
    start = np.array([0.5, 0.2, -0.3], dtype=dtype)
    model = {"w": start}
    state = optim.setup(make(), model)
    vs = ad.variables({"w": start.copy()}, ad.Implicit(name))
    istate = optim.setup(make(), vs)
    for _ in range(5):
        state, model, _ = ad.train_step(_quadratic, model, (target,), state, backend=b.name)
        istate, vs, _ = ad.train_step(_quadratic, vs, (target,), istate, backend=ad.Implicit(name))
    got = ad.to_numpy(vs)["w"]
    assert got.dtype == np.dtype(dtype)
    if dtype == "float32" and ad.backend(b.name).compiler is not None:
        # the explicit steps ran as one compiled call, which computes the rule's scalar
        # arithmetic (Adam's 1 - b2**t) in float32 where the op-by-op step computes it in
        # Python floats: float32 rounding of the hyperparameters, not a tolerance on float64
        want = ad.to_numpy(model["w"])
        np.testing.assert_allclose(got, want, rtol=3e-5, atol=3e-5 * max(1.0, float(np.abs(want).max())))
    else:
        close(got, ad.to_numpy(model["w"]), dtype)
    assert istate.step == state.step == 5
    assert RTOL[dtype] > 0


def test_digits_example_takes_a_schedule(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    name = "autograd" if "autograd" in ad.available_backends() else "finite_differences"
    script = Path(__file__).resolve().parents[1] / "examples" / "digits.py"
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "loss.png"), "--steps", "3", "--backends", name,
         "--schedule", "cosine"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "loss.png").exists()

"""Prepared operators: same numbers as the unprepared ones, and every mismatch refused."""

from __future__ import annotations

import gc
from collections import namedtuple

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad

FD = "finite_differences"
Pair = namedtuple("Pair", "w b")


def loss(p, inputs, scale):
    residual = anp.sum(inputs * p.w, axis=1) + p.b  # autoray: runs on every backend's arrays
    return scale * anp.sum(residual**2)


def make(dtype=np.float64):
    rng = np.random.default_rng(0)
    p = Pair(rng.normal(size=3).astype(dtype), np.asarray(0.5, dtype=dtype))
    return p, rng.normal(size=(4, 3)).astype(dtype)


def test_prepared_value_and_gradient_matches_unprepared():
    p, inputs = make()
    vg = ad.prepare_value_and_gradient(FD, loss, p, inputs, 2.0)
    y, g = vg(p, inputs, 2.0)
    y0, g0 = ad.value_and_gradient(FD, loss, p, inputs, 2.0)
    assert float(y) == pytest.approx(float(y0), rel=1e-12)
    np.testing.assert_allclose(g.w, g0.w, rtol=1e-12)
    assert isinstance(g, Pair)
    # analytic: 2 * scale * inputs^T r, r = inputs w + b
    r = inputs @ p.w + p.b
    np.testing.assert_allclose(g.w, 4.0 * inputs.T @ r, rtol=1e-8)
    np.testing.assert_allclose(g.b, 4.0 * r.sum(), rtol=1e-8)


def test_prepared_gradient_and_aux():
    p, inputs = make()

    def with_aux(p, inputs):
        return loss(p, inputs, 1.0), {"n": inputs.shape[0]}

    grad = ad.prepare_gradient(FD, with_aux, p, inputs, has_aux=True)
    g, aux = grad(p, inputs)
    assert aux == {"n": 4}
    np.testing.assert_allclose(g.w, ad.gradient(FD, loss, p, inputs, 1.0).w, rtol=1e-12)
    (y, aux), g2 = ad.prepare_value_and_gradient(FD, with_aux, p, inputs, has_aux=True)(p, inputs)
    assert aux == {"n": 4} and np.shape(y) == ()


def test_prepared_pullback():
    x = np.array([1.0, 2.0, 3.0])
    pb = ad.prepare_pullback(FD, lambda x, a: a * x**2, x, np.array([1.0, 10.0, 100.0]))
    y, vjp = pb(x, np.array([1.0, 10.0, 100.0]))
    np.testing.assert_allclose(vjp(np.ones(3)), [2.0, 40.0, 600.0], rtol=1e-9)
    with pytest.raises(ad.ShapeMismatchError):
        vjp(np.ones(2))


def test_new_values_same_shapes_are_accepted():
    p, inputs = make()
    vg = ad.prepare_value_and_gradient(FD, loss, p, inputs, 2.0)
    p2 = Pair(p.w + 1.0, p.b * 3)
    _, g = vg(p2, inputs * 2, 2.0)
    np.testing.assert_allclose(g.w, ad.gradient(FD, loss, p2, inputs * 2, 2.0).w, rtol=1e-12)


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda p, i: ((Pair(np.ones(4), p.b), i, 2.0)), "x leaf 0 of shape/dtype"),
        (lambda p, i: ((Pair(p.w.astype(np.float32), p.b), i, 2.0)), "float32"),
        (lambda p, i: ((p, i[:2], 2.0)), "argument leaf 0 of shape/dtype"),
        (lambda p, i: ((p, i.astype(np.float32), 2.0)), "argument leaf 0"),
        (lambda p, i: ((p, i, 3.0)), "static argument leaf 1"),
        (lambda p, i: (({"w": p.w, "b": p.b}, i, 2.0)), "x of structure"),
        (lambda p, i: ((p, i, 2.0, 1.0)), "args of structure"),
    ],
)
def test_mismatch_is_refused_with_a_clear_error(change, fragment):
    p, inputs = make()
    vg = ad.prepare_value_and_gradient(FD, loss, p, inputs, 2.0)
    with pytest.raises(ad.ShapeMismatchError, match="prepare again") as err:
        vg(*change(p, inputs))
    assert isinstance(err.value, ValueError)
    assert fragment in str(err.value)


def test_prepared_operator_keeps_a_lambda_alive():
    x = np.array([1.0, 2.0])
    grad = ad.prepare_gradient(FD, lambda x: (x**3).sum(), x)
    gc.collect()
    np.testing.assert_allclose(grad(x), 3 * x**2, rtol=1e-9)


def test_prepared_input_is_not_mutated():
    p, inputs = make()
    before = (p.w.copy(), p.b.copy(), inputs.copy())
    ad.prepare_value_and_gradient(FD, loss, p, inputs, 2.0)(p, inputs, 2.0)
    for a, b in zip(before, (p.w, p.b, inputs)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["jax", "torch", "tensorflow", "autograd"])
def test_native_prepared_matches_and_checks(name):
    if name not in ad.available_backends():
        pytest.skip(f"{name} is not installed here")
    b = ad.backend(name)
    p, inputs = make(np.float32)
    vg = ad.prepare_value_and_gradient(b, loss, p, inputs, 2.0)
    y, g = vg(p, inputs, 2.0)  # numpy in: converted as the unprepared call does
    y0, g0 = ad.value_and_gradient(b, loss, p, inputs, 2.0)
    np.testing.assert_allclose(ad.to_numpy(g.w), ad.to_numpy(g0.w), rtol=1e-6)
    assert ad.to_numpy(g.w).dtype == np.float32
    native = Pair(b.asarray(p.w), b.asarray(p.b))
    _, g_native = vg(native, b.asarray(inputs), 2.0)  # native in: no conversion needed
    np.testing.assert_allclose(ad.to_numpy(g_native.w), ad.to_numpy(g0.w), rtol=1e-6)
    with pytest.raises(ad.ShapeMismatchError):
        vg(Pair(p.w.astype(np.float64), p.b), inputs, 2.0)
    with pytest.raises(ad.ShapeMismatchError):
        vg(Pair(b.asarray(np.ones(5, np.float32)), native.b), inputs, 2.0)


# ------------------------------------------------------- every operator has a twin
def cubic(x, a):
    return anp.sum(a * x**3)


PREPARED_CALLS = {
    # operator: (prepare, call of the prepared operator, the unprepared call)
    "value_and_pullback": (
        lambda b, x, a: ad.prepare_value_and_pullback(b, lambda x, a: a * x**2, x, a),
        lambda p, x, a: p(x, a)[1](np.ones(3)),
        lambda b, x, a: ad.value_and_pullback(b, lambda x, a: a * x**2, x, a)[1](np.ones(3)),
    ),
    "pushforward": (
        lambda b, x, a: ad.prepare_pushforward(b, lambda x, a: a * x**2, x, a),
        lambda p, x, a: p(x, a)(np.ones(3)),
        lambda b, x, a: ad.pushforward(b, lambda x, a: a * x**2, x, a)(np.ones(3)),
    ),
    "value_and_pushforward": (
        lambda b, x, a: ad.prepare_value_and_pushforward(b, lambda x, a: a * x**2, x, a),
        lambda p, x, a: p(x, a)[1](np.ones(3)),
        lambda b, x, a: ad.value_and_pushforward(b, lambda x, a: a * x**2, x, a)[1](np.ones(3)),
    ),
    "jacobian": (
        lambda b, x, a: ad.prepare_jacobian(b, lambda x, a: a * x**2, x, a),
        lambda p, x, a: p(x, a),
        lambda b, x, a: ad.jacobian(b, lambda x, a: a * x**2, x, a),
    ),
    "hessian": (
        lambda b, x, a: ad.prepare_hessian(b, cubic, x, a),
        lambda p, x, a: p(x, a),
        lambda b, x, a: ad.hessian(b, cubic, x, a),
    ),
    "hvp": (
        lambda b, x, a: ad.prepare_hvp(b, cubic, x, np.ones(3), a),
        lambda p, x, a: p(x, np.arange(3.0), a),
        lambda b, x, a: ad.hvp(b, cubic, x, np.arange(3.0), a),
    ),
}


@pytest.mark.parametrize("operator", list(PREPARED_CALLS))
def test_every_prepared_operator_matches_and_refuses_mismatches(operator):
    prepare, call, unprepared = PREPARED_CALLS[operator]
    x, a = np.array([1.0, 2.0, 3.0]), np.array([1.0, 0.5, 2.0])
    p = prepare(FD, x, a)
    np.testing.assert_allclose(ad.to_numpy(call(p, x + 1, a)), ad.to_numpy(unprepared(FD, x + 1, a)), rtol=1e-12)
    with pytest.raises(ad.ShapeMismatchError, match=rf"prepared {operator} was prepared for x leaf 0"):
        call(p, np.ones(4), a)
    with pytest.raises(ad.ShapeMismatchError, match="float32"):
        call(p, x.astype(np.float32), a)
    with pytest.raises(ad.ShapeMismatchError, match="argument leaf 0"):
        call(p, x, a[:2])


def test_prepared_derivative_and_its_checks():
    d = ad.prepare_derivative(FD, lambda t, k: np.sin(k * t), 0.5, 2)
    assert float(d(0.25, 2)) == pytest.approx(2 * np.cos(0.5), rel=1e-9)
    with pytest.raises(ad.ShapeMismatchError, match="static argument leaf 0"):
        d(0.25, 3)
    with pytest.raises(ad.ShapeMismatchError, match="derivative needs a scalar x"):
        ad.prepare_derivative(FD, lambda t: t * 2, np.ones(2))(np.ones(2))


def test_prepared_hvp_checks_v_on_every_call():
    h = ad.prepare_hvp(FD, cubic, np.ones(3), np.ones(3), np.ones(3))
    with pytest.raises(ad.ShapeMismatchError, match="v leaf"):
        h(np.ones(3), np.ones(2), np.ones(3))


def test_unprepared_operators_reuse_one_preparation_per_signature():
    b = type(ad.backend(FD))()
    x = np.array([1.0, 2.0])
    for _ in range(3):
        b.jacobian(lambda x: x**2, x)
        ad.jacobian(b, cubic, x, x)
    (fn,) = [fn for plans in b._plans._functions.values() for fn in plans.values() if fn.f is cubic]
    assert len(fn._preparations) == 1
    ad.jacobian(b, cubic, x.astype(np.float32), x)  # a new signature: a new preparation
    assert len(fn._preparations) == 2


def test_prepare_refuses_an_unknown_operator():
    with pytest.raises(ValueError, match="unknown operator 'grad'"):
        ad.backend(FD).prepare("grad", cubic, np.ones(2), (np.ones(2),))


# ------------------------------------------------------------ implicit mode
def test_prepared_implicit_operators():
    w = ad.Variable(np.array([1.0, -2.0]))
    b = ad.Implicit(FD)
    f = lambda a: anp.sum(a * w.value**2)  # noqa: E731
    ps = ad.Params([w])
    vg = ad.prepare_value_and_gradient(b, f, ps, np.array([3.0, 4.0]))
    y, gs = vg(ad.Params([w]), np.array([3.0, 4.0]))  # the same variables in a new Params
    assert float(y) == pytest.approx(19.0) and np.allclose(gs[w], [6.0, -16.0])
    np.testing.assert_allclose(ad.prepare_gradient(b, f, ps, np.ones(2))(ps, np.ones(2))[w], [2.0, -4.0])
    y, vjp = ad.prepare_pullback(b, lambda: w.value * 3, ps)(ps)
    np.testing.assert_allclose(vjp(np.ones(2))[w], [3.0, 3.0])
    with pytest.raises(ad.ShapeMismatchError, match="other variables"):
        vg(ad.Params([ad.Variable(np.ones(2))]), np.ones(2))
    with pytest.raises(ad.ShapeMismatchError, match="argument leaf 0"):
        vg(ps, np.ones(3))
    w.value = np.ones(2)  # same shape: accepted, and the new value is used
    np.testing.assert_allclose(vg(ps, np.ones(2))[1][w], [2.0, 2.0], rtol=1e-9)


def test_prepared_implicit_refuses_explicit_only_operators():
    w = ad.Variable(np.ones(2))
    with pytest.raises(ad.ModeMismatchError, match="jacobian is not available in implicit mode"):
        ad.prepare_jacobian(ad.Implicit(FD), lambda: w.value, ad.Params([w]))
    with pytest.raises(ad.ModeMismatchError, match="ad.Params"):
        ad.prepare_gradient(ad.Implicit(FD), lambda: w.value.sum(), np.ones(2))


# ---------------------------------------------- jax: jit's dispatcher does the checks
@pytest.mark.skipif("jax" not in ad.available_backends(), reason="jax is not installed here")
def test_jax_prepared_call_lets_jit_check_and_still_refuses_mismatches(monkeypatch):
    from abstractdiff._prepare import Signature

    b = ad.backend("jax")
    x, w = b.asarray(np.linspace(-1, 1, 4).astype(np.float32)), b.asarray(np.eye(4, dtype=np.float32) * 0.5)
    ops = {
        "gradient": (ad.prepare_gradient(b, lambda x, w: anp.sum(anp.tanh(w @ x) ** 2), x, w),
                     lambda p, x: p(x, w), lambda x: ad.gradient(b, lambda x, w: anp.sum(anp.tanh(w @ x) ** 2), x, w)),
        "jacobian": (ad.prepare_jacobian(b, lambda x, w: anp.sin(w @ x), x, w),
                     lambda p, x: p(x, w), lambda x: ad.jacobian(b, lambda x, w: anp.sin(w @ x), x, w)),
        "hvp": (ad.prepare_hvp(b, lambda x, w: anp.sum((w @ x) ** 3), x, x, w),
                lambda p, x: p(x, x, w), lambda x: ad.hvp(b, lambda x, w: anp.sum((w @ x) ** 3), x, x, w)),
    }
    checks = []
    original = Signature.check
    monkeypatch.setattr(Signature, "check", lambda self, *a: checks.append(1) or original(self, *a))
    for name, (prepared, call, unprepared) in ops.items():
        assert prepared._direct is not None, name
        np.testing.assert_allclose(np.asarray(call(prepared, x)), np.asarray(unprepared(x)), rtol=1e-6)
        before = len(checks)
        for k in range(3):  # same signature: jit's C++ dispatch alone, the Python check does not run
            np.testing.assert_allclose(np.asarray(call(prepared, x + k)), np.asarray(unprepared(x + k)), rtol=1e-6)
        assert len(checks) == before, name
        bad_inputs = (np.asarray(x, np.float64), b.asarray(np.ones(5, np.float32)), (x,), np.arange(4), x.astype(int))
        for bad in bad_inputs:
            with pytest.raises(ad.ShapeMismatchError):  # a retrace, where the check raises
                call(prepared, bad)
    # static arguments are jit's static arguments, compared by the core's exact key
    scaled = ad.prepare_gradient(b, lambda x, s: anp.sum(x) * s, x, 0.0)
    assert scaled._direct is not None
    np.testing.assert_allclose(np.asarray(scaled(x, 0.0)), np.zeros(4))
    for other in (3.0, -0.0, 0):  # another value, -0.0 (equal to 0.0 for jit's own cache), another type
        with pytest.raises(ad.ShapeMismatchError, match="static"):
            scaled(x, other)
    # a static leaf inside a container, aux and closures keep the core's check in Python
    assert ad.prepare_gradient(b, lambda p: anp.sum(p[0]) * p[1], (x, 2.0))._direct is None
    assert ad.prepare_value_and_pullback(b, lambda x: x * 2, x)._direct is None


@pytest.mark.skipif("tensorflow" not in ad.available_backends(), reason="tensorflow is not installed here")
def test_tensorflow_prepared_call_lets_the_input_signature_check(monkeypatch):
    import tensorflow as tf

    from abstractdiff._prepare import Signature

    b = ad.backend("tensorflow")
    x, w = tf.constant(np.linspace(-1, 1, 4), tf.float32), tf.constant(np.eye(4) * 0.5, tf.float32)

    def f(x, w):
        return tf.reduce_sum(tf.tanh(tf.linalg.matvec(w, x)) ** 2)

    grad = ad.prepare_gradient(b, f, x, w)
    hvp = ad.prepare_hvp(b, f, x, x, w)
    assert grad._direct is not None and hvp._direct is not None
    checks = []
    original = Signature.check
    monkeypatch.setattr(Signature, "check", lambda self, *a: checks.append(1) or original(self, *a))
    for k in range(3):
        np.testing.assert_allclose(grad(x + k, w).numpy(), ad.gradient(b, f, x + k, w).numpy(), rtol=1e-6)
        np.testing.assert_allclose(hvp(x, x + k, w).numpy(), ad.hvp(b, f, x, x + k, w).numpy(), rtol=1e-6)
    assert not checks  # TensorFlow compared the inputs with the signature itself
    for bad in (tf.cast(x, tf.float64), tf.ones(5), np.asarray(x, np.float64), (x,)):
        with pytest.raises(ad.ShapeMismatchError):
            grad(bad, w)


# ------------------------------------------------ the core's lean gradient call
@pytest.mark.parametrize("name", ["autograd", "finite_differences"])
def test_the_lean_gradient_call_checks_what_the_full_call_checks(name):
    """A prepared gradient of f(x, *arrays) on the backend's own arrays is one closure: the
    same results, zeros for an unconnected x, and any other form refused (or, unprepared,
    planned) as the full call does."""
    b = ad.backend(name)
    f = lambda x, a: (a * x**2).sum()  # noqa: E731
    x, a = np.array([1.0, 2.0]), np.array([3.0, 1.0])
    vg, g = ad.prepare_value_and_gradient(b, f, x, a), ad.prepare_gradient(b, f, x, a)
    assert vg.call.__name__ == "lean" and g.call.__name__ == "lean"
    y, grad = vg(x, a)
    np.testing.assert_allclose(float(y), 7.0, rtol=1e-6)
    np.testing.assert_allclose(grad, [6.0, 4.0], rtol=1e-5)
    np.testing.assert_allclose(g(x, a), grad)
    with pytest.raises(ad.ShapeMismatchError, match="shape/dtype"):
        g(np.ones(3), a)
    with pytest.raises(ad.ShapeMismatchError, match="shape/dtype"):
        g(x.astype(np.float32), a)
    with pytest.raises(ad.ShapeMismatchError):
        g(x)  # an argument fewer
    constant = ad.prepare_gradient(b, lambda x: np.float64(3.0), x)
    np.testing.assert_array_equal(constant(x), np.zeros(2))
    for n in (2, 3, 2, 5):  # unprepared: its own prepared call, any shape
        np.testing.assert_allclose(ad.gradient(b, lambda x: (x**2).sum(), np.ones(n)), 2 * np.ones(n), rtol=1e-5)


def test_the_lean_gradient_call_is_not_taken_for_aux_or_pytrees():
    b = ad.backend("autograd")
    x = np.array([1.0, 2.0])
    with_aux = ad.prepare_gradient(b, lambda x: ((x**2).sum(), 1), x, has_aux=True)
    tree = ad.prepare_gradient(b, lambda p: (p["w"] ** 2).sum(), {"w": x})
    assert with_aux.call == with_aux.check_and_run and tree.call == tree.check_and_run
    g, aux = with_aux(x)
    np.testing.assert_allclose(g, 2 * x)
    assert aux == 1


_SCALE = 2.0


def _scaled_cubes(x):
    return _SCALE * (x**3).sum()


@pytest.mark.parametrize("operator", ["gradient", "hvp"])
def test_a_prepared_call_refreshes_where_f_reads_a_changed_global(operator):
    """On a backend that reuses traces, the prepared call tests its capture watch first (the
    core's wrapper, or jax's direct call itself) and prepares again for the new value; hvp's
    refresh passes its tangent on."""
    global _SCALE
    b = ad.backend("jax")
    x, v = np.array([1.0, 2.0], np.float32), np.array([1.0, 0.0], np.float32)
    x, v = b.asarray(x), b.asarray(v)
    call = ad.prepare_gradient(b, _scaled_cubes, x) if operator == "gradient" else \
        ad.prepare_hvp(b, _scaled_cubes, x, v)
    run = (lambda: call(x)) if operator == "gradient" else (lambda: call(x, v))
    want = (lambda s: s * 3 * np.array([1.0, 4.0])) if operator == "gradient" else (lambda s: s * np.array([6.0, 0.0]))
    old = _SCALE
    try:
        np.testing.assert_allclose(ad.to_numpy(run()), want(2.0), rtol=1e-6)
        _SCALE = 5.0
        np.testing.assert_allclose(ad.to_numpy(run()), want(5.0), rtol=1e-6)
        assert call.unchanged is not None and call.unchanged()
    finally:
        _SCALE = old

"""ad.fori_loop, ad.scan and ad.while_loop: one loop in the core, the library's loop primitive
inside compiled backends (traced once), a Python loop elsewhere; every operator through them."""

from __future__ import annotations

import time

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff import testing
from abstractdiff._hooks import approximates
from abstractdiff._pytree import tree_leaves
from abstractdiff._registry import unavailable_reason

NAMES = ("autograd", "finite_differences", "jax", "mlx", "paddle", "pytensor", "tensorflow", "torch")
#: Backends whose compiled artefacts trace f once: the loop must be their loop primitive.
COMPILED = ("jax", "pytensor", "tensorflow")
#: Backend options for these tests (PyTensor's default Numba mode compiles for tens of seconds
#: while its disk cache is cold; FAST_COMPILE runs the same scan graph).
OPTIONS = {"pytensor": {"mode": "FAST_COMPILE"}}


def _backend(name: str) -> ad.Backend:
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return ad.backend(name, **OPTIONS.get(name, {}))


@pytest.fixture(params=NAMES)
def b(request: pytest.FixtureRequest) -> ad.Backend:
    return _backend(request.param)


def _close(got, want, b, exact=1e-10, approx=1e-5):
    tol = approx if approximates(b) else exact
    got, want = tree_leaves(ad.to_numpy(got)), tree_leaves(ad.to_numpy(want))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


# ------------------------------------------------------------------ an RK4 damped pendulum
def dynamics(state, p):
    theta, omega = state
    return omega, -p[0] * anp.sin(theta) - p[1] * omega


def rk4_step(state, p, h):
    def shift(s, k, a):
        return tuple(si + a * ki for si, ki in zip(s, k))

    k1 = dynamics(state, p)
    k2 = dynamics(shift(state, k1, h / 2), p)
    k3 = dynamics(shift(state, k2, h / 2), p)
    k4 = dynamics(shift(state, k3, h), p)
    return tuple(s + h / 6 * (a + 2 * b + 2 * c + d) for s, a, b, c, d in zip(state, k1, k2, k3, k4))


CALLS = {"body": 0}


def looped(x, steps, h=0.05):
    def body(i, s):
        CALLS["body"] += 1
        return rk4_step(s, x["p"], h)

    theta, omega = ad.fori_loop(0, steps, body, (x["theta"], x["omega"]))  # a pytree carry
    return theta + 0.3 * omega


def unrolled(x, steps, h=0.05):
    s = (x["theta"], x["omega"])
    for _ in range(steps):
        s = rk4_step(s, x["p"], h)
    return s[0] + 0.3 * s[1]


X = {"theta": np.array([0.3, 1.0, 2.0]), "omega": np.array([0.0, 0.5, -0.2]), "p": np.array([9.81, 0.2])}


@pytest.mark.parametrize("name", [n for n in NAMES if n not in COMPILED])  # compiled ones: the 60-step test
def test_rk4_jacobian_equals_the_unrolled_loop(name):
    b = _backend(name)
    want = ad.jacobian("autograd", unrolled, X, 4)
    _close(ad.jacobian(b, looped, X, 4), want, b)
    _close(ad.prepare_jacobian(b, looped, X, 4)(X, 4), want, b)


@pytest.mark.parametrize("name", COMPILED)
def test_rk4_60_steps_compile_once(name, capsys):
    b = _backend(name)
    CALLS["body"] = 0
    start = time.perf_counter()
    jac = ad.prepare_jacobian(b, looped, X, 60)(X, 60)
    first = time.perf_counter() - start
    _close(jac, ad.jacobian("autograd", unrolled, X, 60), b)
    assert CALLS["body"] < 20, CALLS  # traced a few times, not 60 (an unrolled loop: 60 per trace)
    with capsys.disabled():
        print(f"\n{name}: first prepared 60-step RK4 Jacobian {first:.2f} s")


def pendulum(x):
    """A scalar of four inputs (angle, speed, stiffness, damping) through three RK4 steps."""
    # a carry of 1-element arrays: PyTensor's FAST_COMPILE scan cannot push 0-d ones forward
    theta, omega = ad.fori_loop(0, 3, lambda i, s: rk4_step(s, x[2:], 0.1), (x[:1], x[1:2]))
    return anp.sum(theta + 0.3 * omega)


def pendulum_unrolled(x):
    s = (x[:1], x[1:2])
    for _ in range(3):
        s = rk4_step(s, x[2:], 0.1)
    return anp.sum(s[0] + 0.3 * s[1])


def rk4_scenarios(dtypes: tuple = ("float64", "float32")) -> list:
    """The conformance harness's scenario of a loop, one per dtype, with autograd's derivatives of
    the unrolled loop as references (float32 too where ``dtypes`` says so)."""
    if unavailable_reason("autograd") is not None:
        pytest.skip(unavailable_reason("autograd"))
    out = []
    for dt in dtypes:
        x = np.array([0.4, -0.2, 9.81, 0.3], dtype=dt)
        u, tangent = x.astype("float64"), np.array([0.3, -1.0, 0.5, 2.0], dtype=dt)
        h = np.asarray(ad.hessian("autograd", pendulum_unrolled, u))
        out.append(testing.Scenario(
            "rk4_fori_loop", pendulum, x, value=float(pendulum_unrolled(u)),
            gradient=np.asarray(ad.gradient("autograd", pendulum_unrolled, u)), hessian=h, tangent=tangent,
            description="an RK4 damped pendulum through ad.fori_loop",
        ))
    return out


def test_conformance_grid_through_a_loop(b):
    # float32 on the eager backends only: the compiled ones trace every operator again per dtype
    dtypes = ("float64",) if b.name in COMPILED else ("float64", "float32")
    report = testing.check_backend(b, rk4_scenarios(dtypes) + testing.loop_scenarios(dtypes))
    assert report.ok, report.failures


def test_numpy_values_run_a_python_loop():
    CALLS["body"] = 0
    np.testing.assert_allclose(looped(X, 3), unrolled(X, 3), rtol=1e-14)
    assert CALLS["body"] == 3


# ---------------------------------------------------------------------------- scan
def scanned(x, ts):
    def step(c, t):
        new = {"a": c["a"] * anp.cos(t * c["b"]), "b": c["b"] + 0.1 * t}
        return new, {"y": new["a"] * new["b"], "z": None}

    carry, ys = ad.scan(step, {"a": x[:2], "b": x[2]}, ts)
    return carry, ys


TS = np.array([0.1, 0.4, 0.7, 1.0])
XS = np.array([0.5, -0.3, 1.2])


def scan_reference(x, ts):
    c, ys = {"a": x[:2], "b": x[2]}, []
    for t in ts:
        c = {"a": c["a"] * anp.cos(t * c["b"]), "b": c["b"] + 0.1 * t}
        ys.append(c["a"] * c["b"])
    return c, ys


def test_scan_stacks_outputs_and_differentiates(b):
    carry, ys = scanned(XS, TS)
    c_ref, ys_ref = scan_reference(XS, TS)
    np.testing.assert_allclose(ys["y"], np.stack(ys_ref), rtol=1e-14)
    assert ys["z"] is None and ys["y"].shape == (4, 2)
    np.testing.assert_allclose(carry["b"], c_ref["b"], rtol=1e-14)

    def loss(x, ts):
        carry, ys = scanned(x, ts)
        return anp.sum(ys["y"] ** 2) + carry["b"] * anp.sum(carry["a"])

    def reference(x, ts):
        c, ys = scan_reference(x, ts)
        return sum(anp.sum(y**2) for y in ys) + c["b"] * anp.sum(c["a"])

    y, g = ad.value_and_gradient(b, loss, XS, TS)
    _close(y, reference(XS, TS), b)
    _close(g, ad.gradient("autograd", reference, XS, TS), b)


def test_tensorflow_scan_under_the_callers_forward_accumulator():
    # a TensorArray's handle has no tangent (tf.scan fails so): the adapter stacks ys densely here
    b = _backend("tensorflow")
    import tensorflow as tf

    def step(c, xk):
        z = 0.5 * c + xk
        return z, z * z

    @tf.function
    def jvp(x, t):
        with tf.autodiff.ForwardAccumulator(x, t) as acc:
            _, ys = ad.scan(step, tf.zeros((1,), tf.float64), x)
        return ys, acc.jvp(ys)

    x, t = np.array([[0.3], [-1.0], [0.8]]), np.array([[1.0], [0.5], [-2.0]])
    ys, tangent = jvp(tf.constant(x), tf.constant(t))
    # z = (0.3, -0.85, 0.375), its tangent (1, 1, -1.5): ys' tangent is 2 z dz
    want = np.array([[0.6], [-1.7], [-1.125]])
    _close(tangent, want, b)
    _close(ys, np.array([[0.09], [0.7225], [0.140625]]), b)
    _close(ad.pushforward(b, lambda x: ad.scan(step, x[0] * 0, x)[1], x)(t), want, b)


def test_scan_over_length_without_xs(b):
    def f(x):
        carry, ys = ad.scan(lambda c, _: (c * 1.5, anp.sum(c)), x, None, length=3)
        return anp.sum(ys) + anp.sum(carry)

    _close(ad.gradient(b, f, XS), np.full(3, 1 + 1.5 + 2.25 + 3.375), b)


# ------------------------------------------------------------------ second order, Batch
def step(c, p):
    return c + 0.1 * p * anp.sin(c) ** 2


def stepped(x, p):  # p as data, not a closure: the backend converts it to its arrays
    return ad.fori_loop(0, 3, lambda i, c: step(c, p), x)


def stepped_reference(x, p):
    for _ in range(3):
        x = step(x, p)
    return x


XP = (np.array([0.3, 1.0, -0.4]), np.array([1.0, 2.0, 3.0]))


# second order (hessian, hvp, value_gradient_and_hessian, prepared too): test_conformance_grid_through_a_loop


def test_batched_pullback_and_pushforward_through_a_loop(b):
    y, vjp = ad.value_and_pullback(b, stepped, *XP)
    vectors = [np.array([1.0, 0.0, 0.0]), np.array([0.0, 2.0, -1.0])]
    _close(list(vjp(ad.Batch(*vectors))), [ad.pullback("autograd", stepped_reference, *XP)(v) for v in vectors], b)
    if b.has_forward:
        got = ad.pushforward(b, stepped, *XP)(ad.Batch(*vectors))
        _close(list(got), [ad.pushforward("autograd", stepped_reference, *XP)(v) for v in vectors], b)


# ------------------------------------------------------------------------- while_loop
def doubling(x):
    # double until the sum passes 10: the number of steps depends on x (three here)
    _, out = ad.while_loop(lambda c: anp.sum(c[1]) < 10.0, lambda c: (c[0] + 1, 2.0 * c[1] + 0.1), (0, x))
    return out


W = np.array([0.5, 1.0])


def test_while_loop_values_and_forward_mode(b):
    if b.name == "pytensor":
        with pytest.raises(ad.InvalidArgumentError, match="fori_loop"):
            ad.pushforward(b, doubling, W)(np.ones(2))
        return
    np.testing.assert_allclose(doubling(W), [4.7, 8.7])
    if b.has_forward:
        _close(ad.pushforward(b, doubling, W)(np.array([1.0, -1.0])), np.array([8.0, -8.0]), b)


def test_while_loop_reverse_mode(b):
    f = lambda x: anp.sum(doubling(x))  # noqa: E731
    if b.name == "jax":
        with pytest.raises(ad.LoopDerivativeError, match="fori_loop"):
            ad.gradient(b, f, W)
    elif b.name != "pytensor":
        _close(ad.gradient(b, f, W), np.array([8.0, 8.0]), b)


# ---------------------------------------------------------------------- errors, numpy
def test_loop_errors():
    with pytest.raises(ad.ArgumentTypeError, match="Python int"):
        ad.fori_loop(0, 2.5, lambda i, c: c, 1.0)
    with pytest.raises(ad.InvalidArgumentError, match="length"):
        ad.scan(lambda c, x: (c, x), 0.0)
    with pytest.raises(ad.InvalidArgumentError, match="disagree"):
        ad.scan(lambda c, x: (c, x), 0.0, np.ones(3), length=2)
    with pytest.raises(ad.ShapeMismatchError, match="structure"):
        ad.fori_loop(0, 2, lambda i, c: (c, c), 1.0)
    with pytest.raises(ad.InvalidArgumentError, match="pair"):
        ad.scan(lambda c, x: c, 0.0, np.ones(3))
    assert ad.fori_loop(3, 3, lambda i, c: c + 1, 1.0) == 1.0

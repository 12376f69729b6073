"""Issue 45, item 10: errors that were a library's raw exception, on PyTensor and TensorFlow.

* PyTensor: a custom rule inside ``ad.fori_loop`` / ``ad.scan`` (``pytensor.scan``) raised
  autoray's ``ImportError`` (``couldn't find function 'sin' for backend 'abc'``) when
  differentiated: scan's gradient hands the rule nominal variables, whose class PyTensor
  makes in the module ``abc``.
* PyTensor: a Python sum over 32 or more elements of an array raised ``'Scratchpad' object
  has no attribute 'ufunc'`` in the modes that run numpy per op (FAST_COMPILE): PyTensor
  merges the additions into one Elemwise, and its Python ``perform`` takes 32 operands at most.
* PyTensor: forward mode and Hessians through ``ad.scan`` over a vector (0-d slices) raised
  "expected an ndarray": a scan without a mode compiles its inner graph with C thunks.
* TensorFlow: forward mode through a compiled ``ad.fori_loop`` / ``ad.scan`` whose body calls
  an ``ad.custom_vjp`` raised InaccessibleTensorError, and through an ``ad.custom_jvp`` it
  refused, saying reverse mode.
* TensorFlow: ``ad.Sparse("tensorflow")``'s Hessian raised XLA's ``LookupError`` (``gradient
  registry has no entry for: XlaDynamicUpdateSlice``, inside a ``StagingError``) through
  ``ad.fori_loop`` and on a banded quadratic form built with ``concatenate`` or ``pad``: the
  sparse products compile with XLA, whose context gives Slice a gradient that has no gradient.

Oracles: closed forms, and jax's own mechanisms (``jax.lax.fori_loop``, ``jax.hessian``).
"""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad

anp = pytest.importorskip("autoray").numpy


def _available(name: str) -> bool:
    return name in ad.available_backends()


needs_pytensor = pytest.mark.skipif(not _available("pytensor"), reason="PyTensor is not installed")
needs_tensorflow = pytest.mark.skipif(not _available("tensorflow"), reason="TensorFlow is not installed")


# ------------------------------------------------------------------ PyTensor
@pytest.fixture(scope="module")
def pt_backend():
    return ad.backend("pytensor", mode="FAST_COMPILE")  # numpy per op: compiles in milliseconds


def _two_cos_rules() -> dict:
    """sin with a rule that is not its derivative (2 cos): a result that follows the rule
    cannot come from PyTensor differentiating the value."""

    @ad.custom_vjp
    def vsin(x):
        return anp.sin(x)

    vsin.defvjp(lambda x: (anp.sin(x), (x,)), lambda res, g: (2.0 * g * anp.cos(res[0]),))

    @ad.custom_jvp
    def jsin(x):
        return anp.sin(x)

    jsin.defjvp(lambda p, t: (anp.sin(p[0]), 2.0 * anp.cos(p[0]) * t[0]))
    return {"custom_vjp": vsin, "custom_jvp": jsin}


RULES = _two_cos_rules()
X = np.array([0.3, 0.7, -0.4])
V = np.array([0.5, -1.0, 2.0])
STEPS = np.array([1.0, 0.5, 1.5])


def _fori_closed_form(x: np.ndarray) -> np.ndarray:
    """d/dx of sum(c_3 ** 2), c_{k+1} = 0.9 sin(c_k) + 0.1 c_k, under the rule sin' = 2 cos."""
    c, d = x.copy(), np.ones_like(x)
    for _ in range(3):
        d *= 1.8 * np.cos(c) + 0.1
        c = 0.9 * np.sin(c) + 0.1 * c
    return 2 * c * d


def _scan_closed_form(x: np.ndarray) -> np.ndarray:
    """d/dx of sum(c_n ** 2) + sum of the ys, c_{k+1} = sin(c_k) s_k, y_k = sum(sin(c_k)), rule sin' = 2 cos."""
    cs, c = [], x.copy()
    for s in STEPS:
        cs.append(c)
        c = np.sin(c) * s
    g = 2 * c  # reverse sweep: the carry's cotangent, plus each y's
    for ck, s in zip(reversed(cs), reversed(STEPS)):
        g = g * s * 2 * np.cos(ck) + 2 * np.cos(ck)
    return g


def _fori(rule):
    return lambda x: anp.sum(ad.fori_loop(0, 3, lambda i, c: 0.9 * rule(c) + 0.1 * c, x) ** 2)


def _scan(rule):
    def f(x):
        carry, ys = ad.scan(lambda c, s: (rule(c) * s, anp.sum(rule(c))), x, STEPS)
        return anp.sum(carry**2) + anp.sum(ys)

    return f


@needs_pytensor
@pytest.mark.parametrize("kind", sorted(RULES))
@pytest.mark.parametrize("loop", ["fori_loop", "scan"])
def test_pytensor_custom_rule_inside_a_loop_is_differentiated_with_the_rule(pt_backend, kind, loop):
    rule = RULES[kind]
    f, expected = (_fori(rule), _fori_closed_form(X)) if loop == "fori_loop" else (_scan(rule), _scan_closed_form(X))
    g = ad.to_numpy(ad.gradient(pt_backend, f, X))
    np.testing.assert_allclose(g, expected, rtol=1e-10)
    # forward mode too: PyTensor's pushforward is two pullbacks through the scan
    jv = ad.to_numpy(ad.pushforward(pt_backend, f, X)(V))
    np.testing.assert_allclose(jv, expected @ V, rtol=1e-10)


@needs_pytensor
def test_pytensor_second_derivative_of_a_custom_rule_inside_a_loop(pt_backend):
    # an exact rule (softplus, sigmoid) differentiated twice through pytensor.scan: the
    # Hessian of the loop, against jax.hessian of the same loop in jax.lax.fori_loop
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    @ad.custom_vjp
    def softplus(x):
        return anp.log(1.0 + anp.exp(x))

    softplus.defvjp(lambda x: (softplus(x), (x,)), lambda res, g: (g / (1.0 + anp.exp(-res[0])),))
    f = lambda x: anp.sum(ad.fori_loop(0, 3, lambda i, c: softplus(c) * 0.5 - 0.2 * c, x) ** 2)  # noqa: E731
    with jax.enable_x64(True):
        jf = lambda x: jnp.sum(jax.lax.fori_loop(0, 3, lambda i, c: jnp.logaddexp(0.0, c) * 0.5 - 0.2 * c, x) ** 2)  # noqa: E731
        expected = np.asarray(jax.hessian(jf)(jnp.asarray(X)))
    np.testing.assert_allclose(ad.to_numpy(ad.hessian(pt_backend, f, X)), expected, rtol=1e-9)


@needs_pytensor
def test_pytensor_forward_mode_and_hessian_through_scan_with_0d_values(pt_backend):
    # each step's slice of a vector is 0-d: forward mode (two pullbacks, a scan of the scan's
    # gradient) and the Hessian raised "expected an ndarray" from the scan's inner C thunks
    def f(x):
        carry, ys = ad.scan(lambda c, s: (anp.sin(c) * s, anp.sin(c)), x, STEPS)
        return anp.sum(carry**2) + anp.sum(ys)

    cs, c = [], X.copy()
    for s in STEPS:
        cs.append(c)
        c = np.sin(c) * s
    g, h = 2 * c, 2 * np.ones_like(c)  # gradient and (diagonal) Hessian, by a reverse sweep
    for ck, s in zip(reversed(cs), reversed(STEPS)):
        g, h = g * s * np.cos(ck) + np.cos(ck), h * (s * np.cos(ck)) ** 2 - (g * s + 1) * np.sin(ck)
    jv = ad.to_numpy(ad.pushforward(pt_backend, f, X)(V))
    np.testing.assert_allclose(jv, g @ V, rtol=1e-10)
    np.testing.assert_allclose(ad.to_numpy(ad.hessian(pt_backend, f, X)), np.diag(h), rtol=1e-10, atol=1e-12)
    # a 0-d carry of ad.fori_loop pushed forward: c_{k+1} = sin(c_k) x1, x1' = 0 for the carry
    loop = lambda x: ad.fori_loop(0, 3, lambda i, c: anp.sin(c) * x[1], x[0])  # noqa: E731
    c, dc0, dc1 = X[0], 1.0, 0.0
    for _ in range(3):
        c, dc0, dc1 = np.sin(c) * X[1], np.cos(c) * X[1] * dc0, np.cos(c) * X[1] * dc1 + np.sin(c)
    assert float(ad.to_numpy(ad.pushforward(pt_backend, loop, X[:2])(V[:2]))) == pytest.approx(
        dc0 * V[0] + dc1 * V[1], rel=1e-10)


@needs_pytensor
def test_pytensor_python_sum_over_many_elements_runs_in_fast_compile(pt_backend):
    # sum(...) over 40 elements: one Add of 40 operands after canonicalisation
    n = 40
    x = np.linspace(-1.0, 1.0, n)
    f = lambda x: sum((x[i] - x[i + 1]) ** 2 + x[i] ** 2 for i in range(n - 1))  # noqa: E731
    y, g = ad.value_and_gradient(pt_backend, f, x)
    d = x[:-1] - x[1:]
    expected = np.zeros(n)
    expected[:-1] += 2 * d + 2 * x[:-1]
    expected[1:] -= 2 * d
    assert float(y) == pytest.approx(np.sum(d**2 + x[:-1] ** 2), rel=1e-12)
    np.testing.assert_allclose(ad.to_numpy(g), expected, rtol=1e-12)


@needs_pytensor
def test_pytensor_pushforward_over_many_leaves_runs_in_fast_compile(pt_backend):
    # forward mode sums one term per leaf: 40 leaves, one wide Add
    x = {f"k{i:02d}": np.array(0.05 * i - 1.0) for i in range(40)}
    t = {k: np.array(1.0 + 0.01 * i) for i, k in enumerate(x)}
    total = sum(float(v) for v in x.values())
    f = lambda x: anp.sin(sum(x.values()))  # noqa: E731
    jv = ad.to_numpy(ad.pushforward(pt_backend, f, x)(t))
    assert float(jv) == pytest.approx(np.cos(total) * sum(float(v) for v in t.values()), rel=1e-12)


# ------------------------------------------------------------------ TensorFlow
def _tridiagonal(n: int) -> np.ndarray:
    return 2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)


def _quadratic_concatenate(x):
    zero = anp.zeros_like(x[:1])
    return anp.sum(x * (2 * x - anp.concatenate([zero, x[:-1]]) - anp.concatenate([x[1:], zero])))


def _quadratic_pad(x):
    return anp.sum((anp.pad(x, (1, 0)) - anp.pad(x, (0, 1))) ** 2)


@needs_tensorflow
@pytest.mark.parametrize("f", [_quadratic_concatenate, _quadratic_pad], ids=["concatenate", "pad"])
def test_tensorflow_sparse_hessian_of_a_banded_quadratic_form(f):
    # x^T T x with T tridiagonal (2, -1): the Hessian is 2 T, at n = 50 (the size)
    n = 50
    x = np.linspace(0.1, 1.0, n)
    h = ad.hessian(ad.Sparse("tensorflow"), f, x)
    np.testing.assert_allclose(h.toarray(), 2 * _tridiagonal(n), atol=1e-12)


@needs_tensorflow
def test_tensorflow_sparse_hessian_through_fori_loop():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def f(x):
        def body(i, c):
            return anp.tanh(c - 0.3 * anp.concatenate([anp.zeros_like(c[:1]), c[:-1]]))

        return anp.sum(ad.fori_loop(0, 3, body, x) ** 2)

    def jf(x):
        def body(i, c):
            return jnp.tanh(c - 0.3 * jnp.concatenate([jnp.zeros_like(c[:1]), c[:-1]]))

        return jnp.sum(jax.lax.fori_loop(0, 3, body, x) ** 2)

    x = np.linspace(-0.8, 0.9, 8)
    with jax.enable_x64(True):
        expected = np.asarray(jax.hessian(jf)(jnp.asarray(x)))
    assert np.count_nonzero(np.abs(expected) > 1e-12) < expected.size  # sparse: a lower band
    h = ad.hessian(ad.Sparse("tensorflow"), f, x)
    np.testing.assert_allclose(h.toarray(), expected, rtol=1e-9, atol=1e-12)
    dense = ad.to_numpy(ad.hessian("tensorflow", f, x))  # the dense route agreed before too
    np.testing.assert_allclose(dense, expected, rtol=1e-9, atol=1e-12)


@needs_tensorflow
@pytest.mark.parametrize("kind", sorted(RULES))
@pytest.mark.parametrize("loop", ["fori_loop", "scan"])
def test_tensorflow_forward_mode_through_a_compiled_loop_with_a_custom_rule(kind, loop):
    # tf.while_loop's forward mode (the gradient of its gradient, built with the loop) cannot
    # reach the tensors a custom_vjp's gradient reads (InaccessibleTensorError), and asks a
    # custom_jvp for a reverse rule it has not (a CustomRuleError naming reverse mode): the loop
    # runs as a traced Python loop then, which the accumulator differentiates through the rule
    rule = RULES[kind]
    f, expected = (_fori(rule), _fori_closed_form(X)) if loop == "fori_loop" else (_scan(rule), _scan_closed_form(X))
    b = ad.backend("tensorflow")  # compiled (tf.function)
    assert float(ad.to_numpy(ad.pushforward(b, f, X)(V))) == pytest.approx(expected @ V, rel=1e-10)
    if kind == "custom_vjp":
        np.testing.assert_allclose(ad.to_numpy(ad.gradient(b, f, X)), expected, rtol=1e-10)


@needs_tensorflow
def test_tensorflow_forward_mode_through_while_loop_with_a_custom_vjp_is_a_clear_error():
    # a Python loop needs the condition's value, which a graph has not: refused, saying what to do
    f = lambda x: anp.sum(ad.while_loop(lambda c: anp.sum(c) < 5.0, lambda c: RULES["custom_vjp"](c) + c, x))  # noqa: E731
    with pytest.raises(ad.LoopDerivativeError, match="ad.fori_loop or ad.scan with a bound"):
        ad.pushforward(ad.backend("tensorflow"), f, X[:2])(V[:2])


@needs_tensorflow
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # numpy reading the eager tensor
def test_tensorflow_sparse_numpy_call_on_a_traced_tensor_is_a_clear_error():
    # a numpy call on the traced x (numpy's dot of a numpy matrix and a tensor) needs a
    # concrete value: the dense route said so, the sparse one raised TensorFlow's NotImplementedError
    a = _tridiagonal(6)
    f = lambda x: anp.dot(x, np.dot(a, x))  # noqa: E731
    x = np.linspace(0.1, 1.0, 6)
    with pytest.raises(ad.TracedControlFlowError, match="compile=False"):
        ad.hessian(ad.Sparse("tensorflow"), f, x)

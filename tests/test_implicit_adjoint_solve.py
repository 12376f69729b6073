"""Second and third derivatives through ``ad.custom_root`` with the default linear solver
(BiCGSTAB), where it stops early on an exact answer (issue 45, oracle cases
``autograd-hessian-target_root`` and ``mlx-hessian-target_root``).

The backward solves ``(dF/dx)^T u = ct``.  A Hessian differentiates that backward, and used
to differentiate BiCGSTAB's iterations: BiCGSTAB solves a ``dF/dx`` with k distinct
eigenvalues in k steps and stops there, where the derivative of the iterate is not yet the
derivative of the solution (0.085 off below, on autograd, MLX and eager TensorFlow; a
traced solve runs its full count of iterations and was right by luck).  The adjoint solve is
now a custom function of its own, differentiated by the implicit function theorem (jax's
``custom_linear_solve``).  On TensorFlow a third derivative through it takes a Hessian by
``tape.jacobian``, whose pfor lost the rule of a custom function called in a backward on the
cotangent (0 for the third derivative of a custom_vjp ``a**3``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff._registry import unavailable_reason

#: (backend name, options): the compiled and the eager run where a backend has both (PyTensor,
#: wrong before too, takes 13 s to compile the Hessian: tests/test_oracle.py draws it)
BACKENDS = [("autograd", {}), ("jax", {}), ("mlx", {}), ("mlx", {"compile": False}), ("tensorflow", {}),
            ("tensorflow", {"compile": False}), ("torch", {})]
IDS = [name + ("-eager" if options.get("compile") is False else "") for name, options in BACKENDS]
THIRD = [("autograd", {}), ("tensorflow", {"compile": False}), ("torch", {})]

# dF/dx = diag(2 sqrt(a)) = 2 I: one distinct eigenvalue, which BiCGSTAB solves in one step (every
# backend 0.2 off before, compiled or not; a = (4, 1, 1), two distinct ones, was 0.085 off on
# autograd, MLX and eager TensorFlow: the saved oracle cases)
A = np.array([1.0, 1.0])
W = np.array([1.0, 2.0])


def _backend(name: str, options: dict) -> ad.Backend:
    pytest.importorskip({"pytensor": "pytensor", "mlx": "mlx.core"}.get(name, name))
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return ad.backend(name, **options)


@ad.custom_root(lambda x, a: x**2 - a)  # the default solve: BiCGSTAB
def _sqrt(init: Any, a: Any) -> Any:
    x, a = ad.stop_gradient((init, a))
    for _ in range(30):  # Newton: a solver the library never differentiates
        x = 0.5 * (x + a / x)
    return x


def _f(a: Any) -> Any:
    return anp.sum(anp.asarray(W, like=a) * _sqrt(anp.ones_like(a), a))


def _point(b: ad.Backend, name: str) -> Any:
    return b.asarray(A.astype(np.float32 if name == "mlx" else np.float64))  # MLX's CPU has no float64


def _tolerance(name: str) -> dict:
    return {"rtol": 1e-5, "atol": 1e-6} if name == "mlx" else {"rtol": 1e-9, "atol": 1e-12}


@pytest.mark.parametrize("name,options", BACKENDS, ids=IDS)
def test_the_hessian_through_an_early_stopped_default_solve(name: str, options: dict) -> None:
    b = _backend(name, options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = np.asarray(ad.to_numpy(ad.hessian(b, _f, _point(b, name))), dtype=float)
    # d2/da2 of w sqrt(a), elementwise: -w/4 a**-3/2 on the diagonal
    np.testing.assert_allclose(got, np.diag(-0.25 * W * A**-1.5), **_tolerance(name))


@pytest.mark.parametrize("name,options", THIRD, ids=[i for i, p in zip(IDS, BACKENDS) if p in THIRD])
def test_the_third_derivative_through_an_early_stopped_default_solve(name: str, options: dict) -> None:
    # the gradient of the Hessian's trace: the adjoint solve's own adjoint solve
    b = _backend(name, options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ad.gradient(b, lambda a: anp.trace(ad.hessian(b, _f, a)), _point(b, name))
    np.testing.assert_allclose(np.asarray(ad.to_numpy(got), dtype=float), 0.375 * W * A**-2.5, **_tolerance(name))


def test_forward_over_the_adjoint_solve_of_a_sum_on_torch() -> None:
    """The Jacobian (forward mode) of a Hessian through custom_root on torch: the adjoint solve
    takes the sum's cotangent, an expanded tensor, as an input, which torch's make_dual refused
    (found by an attack: a raw RuntimeError, right before the adjoint solve existed)."""
    b = _backend("torch", {})

    def f(a: Any) -> Any:
        return anp.sum(_sqrt(anp.ones_like(a), a))

    a = np.array([4.0, 9.0])
    want = np.zeros((2, 2, 2))
    want[0, 0, 0], want[1, 1, 1] = 0.375 * a**-2.5  # d3/da3 sqrt(a)
    got = ad.jacobian(b, lambda t: ad.hessian(b, f, t), a)
    np.testing.assert_allclose(np.asarray(ad.to_numpy(got)), want, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------- tensorflow: a rule inside a backward, under pfor
@ad.custom_vjp
def _times(v: Any, w: Any) -> Any:
    """``v * w``, its value with its gradient stopped: every derivative is the rule's."""
    return ad.stop_gradient(v) * ad.stop_gradient(w)


# the bwd calls _times on the cotangent: a custom function in a backward, on values that
# depend on the row of a Jacobian (pfor's loop index)
_times.defvjp(lambda v, w: (_times(v, w), (v, w)), lambda vw, ct: (_times(ct, vw[1]), _times(ct, vw[0])))


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
def test_a_rule_called_in_a_backward_keeps_its_rule_at_third_order_on_tensorflow(compile: bool) -> None:
    b = _backend("tensorflow", {"compile": compile})

    def cube(a: Any) -> Any:
        return _times(_times(a, a), a)

    x = b.asarray(np.array(1.5))
    # d3/da3 a**3 = 6, through the gradient of the Hessian (tape.jacobian), as through three gradients
    assert float(ad.gradient(b, lambda a: ad.hessian(b, cube, a), x)) == pytest.approx(6.0, rel=1e-12)
    assert float(ad.gradient(b, lambda a: ad.jacobian(b, lambda c: ad.gradient(b, cube, c), a), x)) == \
        pytest.approx(6.0, rel=1e-12)


def test_a_jacobian_that_cannot_keep_its_rule_is_refused_on_tensorflow() -> None:
    """Where the row-by-row Jacobian needs a second backward pass from a tape that is not
    persistent (an outer differentiation through a tensor the function captures, in a graph),
    the refusal is a CompositionError naming the fix, never pfor's silently wrong Jacobian."""
    pytest.importorskip("tensorflow")
    import tensorflow as tf
    from abstractdiff.adapters import tensorflow as tfa

    @tf.function(autograph=False)  # autograph would rewrap the error in a StagingError
    def jacobian_under_an_outer_tape(x: Any, a: Any) -> Any:
        with tf.GradientTape() as outer:
            outer.watch(a)
            with tf.GradientTape() as tape:  # not persistent, as _jacobian_tape makes it without nesting
                tape.watch(x)
                y = x * x * a
            rules = tfa._RULES_RECORDED[0] - 1  # as if y's function recorded a custom rule
            return tfa._jacobian_of(tape, y, x, rules)

    with pytest.raises(ad.CompositionError, match="Pass the watched tensor to f as an argument"):
        jacobian_under_an_outer_tape(tf.constant([1.0, 2.0]), tf.constant(3.0))

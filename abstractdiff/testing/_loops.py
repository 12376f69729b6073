"""The loop scenario family: functions that loop through ``ad.fori_loop`` and ``ad.scan``.

On a compiling backend these run on the library's loop primitive (the adapter's ``loops``
hook: ``jax.lax``, ``tf.while_loop``/``tf.scan``, PyTensor's ``scan``), elsewhere as a
Python loop; the references are closed forms, so both are graded against the same numbers:

- a ``fori_loop`` with a pytree carry, whose result is a polynomial of ``x`` (its Hessian is
  the second derivative through the loop);
- a ``scan`` over ``x``'s leading axis with stacked outputs (a vector function: Jacobian,
  pushforward, pullback) and a scalar of its outputs and final carry (gradient and Hessian).

``loop_scenarios(dtypes)`` builds them once per process and dtype.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..core import Memo
from ._scenarios import DTYPES, Scenario, _ar, _family, _rng, _tangent_like, _up

__all__ = ["loop_scenarios"]

#: The fori_loop's number of steps, and the scan's number of inputs and decay.
STEPS, LENGTH, DECAY = 5, 5, 0.5


def _functions() -> dict[str, Any]:
    """The looping functions, made once (compiling backends cache their traces per function)."""
    import abstractdiff as ad

    anp = _ar()

    def power_sums(x):
        """carry (c, s) -> (c x, s + c) from (1, 0): s = 1 + x + ... + x^4, c = x^5."""

        def body(i, carry):
            c, s = carry
            return c * x, s + c

        c, s = ad.fori_loop(0, STEPS, body, (x * 0 + 1, x * 0))
        return anp.sum(s + 0.5 * c)

    def decayed(x):
        """z_k = DECAY z_{k-1} + x_k, scanned over x; y_k = z_k^2 stacked; the final carry z_n."""

        def step(z, xk):
            z = DECAY * z + xk
            return z, z * z

        # 1-element slices, not 0-d ones: a carry of 0-d arrays is the case libraries special-case
        z, ys = ad.scan(step, x[:1] * 0, anp.reshape(x, (LENGTH, 1)))
        return anp.reshape(ys, (LENGTH,)), z

    def stacked(x, w):
        ys, z = decayed(x)
        return w * ys + z  # every output also reads the final carry

    def summed(x, w):
        ys, z = decayed(x)
        return anp.sum(w * ys) + 0.5 * anp.sum(z * z)

    return {"power_sums": power_sums, "stacked": stacked, "summed": summed}


def _polynomial() -> np.polynomial.Polynomial:
    return np.polynomial.Polynomial([1.0] * STEPS + [0.5])  # 1 + x + ... + x^4 + x^5 / 2


def _fori_loop(dt: str, fn: dict) -> Scenario:
    rng = _rng(41)
    x = rng.uniform(-1.2, 1.2, 4).astype(dt)
    u, p = _up(x), _polynomial()
    return Scenario(
        "fori_loop_pytree_carry", fn["power_sums"], x, value=np.sum(p(u)), gradient=p.deriv()(u),
        hessian=np.diag(p.deriv(2)(u)), tangent=_tangent_like(x, rng),
        description="ad.fori_loop with a (power, sum) carry: 1 + x + ... + x^4 + x^5/2",
    )


def _decay_matrix() -> np.ndarray:
    """L with z = L x: L[k, j] = DECAY^(k - j) for j <= k."""
    k, j = np.indices((LENGTH, LENGTH))
    return np.where(j <= k, DECAY ** (k - j).astype(float), 0.0)


def _scan_inputs(dt: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    rng = _rng(seed)
    return rng.uniform(-1, 1, LENGTH).astype(dt), rng.uniform(0.5, 1.5, LENGTH).astype(dt), rng


def _scan_stacked(dt: str, fn: dict) -> Scenario:
    x, w, rng = _scan_inputs(dt, 42)
    u, uw, m = _up(x), _up(w), _decay_matrix()
    z = m @ u
    jacobian = np.diag(2 * uw * z) @ m + np.outer(np.ones(LENGTH), m[-1])
    return Scenario(
        "scan_stacked_outputs", fn["stacked"], x, (w,), value=uw * z**2 + z[-1], jacobian=jacobian,
        tangent=_tangent_like(x, rng), cotangent=rng.uniform(-1, 1, LENGTH).astype(dt), requires=("stack",),
        description="ad.scan of z_k = z_(k-1)/2 + x_k over x, outputs w z_k^2 stacked, plus the final z",
    )


def _scan_summed(dt: str, fn: dict) -> Scenario:
    x, w, rng = _scan_inputs(dt, 43)
    u, uw, m = _up(x), _up(w), _decay_matrix()
    z, last = m @ u, m[-1]
    return Scenario(
        "scan_second_derivative", fn["summed"], x, (w,), value=np.sum(uw * z**2) + 0.5 * z[-1] ** 2,
        gradient=2 * m.T @ (uw * z) + last * z[-1], hessian=2 * m.T @ np.diag(uw) @ m + np.outer(last, last),
        tangent=_tangent_like(x, rng), requires=("stack",),
        description="sum(w z_k^2) + z_n^2/2 through ad.scan: its Hessian is a second derivative through the loop",
    )


_BUILDERS = (_fori_loop, _scan_stacked, _scan_summed)
_CACHE: Memo = Memo(name="testing: loop scenarios", keyed_on="dtype")


def loop_scenarios(dtypes: str | Sequence[str] = DTYPES) -> list[Scenario]:
    """The loop scenarios (``ad.fori_loop``, ``ad.scan``), one per (definition, dtype), built once.

    ``loop_scenarios(dtypes=("float64", "float32")) -> list[Scenario]``.  Their references are
    closed forms; grade any backend on them, finite differences included
    (``check_backend(b, loop_scenarios())``): a compiling backend runs them on its loop
    primitive, an eager one as Python loops.

    Example:
        >>> [s.name for s in loop_scenarios("float64")]
        ['fori_loop_pytree_carry', 'scan_stacked_outputs', 'scan_second_derivative']
    """
    def build(dt: str) -> list[Scenario]:
        fn = _functions()  # one set of functions per dtype, as each dtype is traced anew
        return [make(dt, fn) for make in _BUILDERS]

    return _family(dtypes, _CACHE, build)

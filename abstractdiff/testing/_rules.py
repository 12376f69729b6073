"""The "rule used" scenario family: functions whose derivatives come from ``ad.custom_vjp``,
``ad.custom_jvp``, ``ad.stop_gradient`` and ``ad.custom_root``.

Most rules here are deliberately unlike the true derivative (``3x`` for ``d(x**2)/dx``),
and each scenario's reference is the rule's: a backend that ignores a rule and
differentiates the function itself fails them.  So the finite-differences oracle, which
must ignore rules, cannot pass them by accident: it is not graded on this family
(``tests/test_custom.py`` checks that it gives the true derivative instead).  Two
scenarios have true rules whose point is numerical: a softplus stable at +-700, where the
naive derivative is ``nan``, and a ridge regression solved by a solver that stops its own
gradient, differentiated by the implicit function theorem against its closed form.

The scenarios are backend-neutral (autoray), so one definition runs on every backend.
``rule_scenarios(dtypes)`` builds them once per process and dtype.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..core import Memo
from ._scenarios import DTYPES, Scenario, _ar, _family, _rng, _tangent_like, _up

__all__ = ["REVERSE_OPERATORS", "FORWARD_OPERATORS", "rule_scenarios"]

#: What a reverse-mode rule (custom_vjp) serves everywhere: forward mode through one has
#: no rule on jax and torch (``CustomRuleError``), so it is graded where defined only.
REVERSE_OPERATORS = (
    "gradient", "value_and_gradient", "pullback", "hessian", "hvp",
    "value_gradient_and_hessian", "gradient_and_hvp",
)
#: What a forward-mode rule (custom_jvp) serves everywhere.
FORWARD_OPERATORS = ("pushforward",)


def _functions() -> dict[str, Any]:
    """The rules, made once (compiling backends cache their traces per function object)."""
    import abstractdiff as ad

    anp = _ar()

    @ad.custom_vjp
    def square(x):
        return x**2

    square.defvjp(lambda x: (x**2, x), lambda x, ct: (3 * ct * x,))  # the true one is 2 x ct

    @ad.custom_vjp
    def affine(p, y):
        return p["w"] * y + p["b"]

    def affine_fwd(p, y):
        return affine(p, y), (p["w"], y)

    def affine_bwd(res, ct):
        w, y = res
        return {"w": 2 * ct * y, "b": -ct}, 3 * ct * w  # the true ones: ct y, ct, ct w

    affine.defvjp(affine_fwd, affine_bwd)

    def sigmoid(x):
        return 0.5 * (anp.tanh(0.5 * x) + 1)  # finite everywhere, as are its derivatives

    @ad.custom_vjp
    def softplus(x):
        return anp.maximum(x, 0) + anp.log1p(anp.exp(-anp.abs(x)))

    softplus.defvjp(lambda x: (softplus(x), x), lambda x, ct: (ct * sigmoid(x),))

    @ad.custom_jvp
    def sine(x):
        return anp.sin(x)

    @sine.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return anp.sin(x), 2 * anp.cos(x) * t  # the true one: cos(x) t

    return {"square": square, "affine": affine, "softplus": softplus, "sine": sine, "ad": ad, "anp": anp}


def _rule_square(dt: str, fn: dict) -> Scenario:
    anp, square = fn["anp"], fn["square"]

    def f(x):
        return anp.sum(square(x) * 0.5 + x)

    rng = _rng(31)
    x = rng.uniform(-2, 2, 5).astype(dt)
    u = _up(x)
    return Scenario(
        "rule_square", f, x, value=np.sum(0.5 * u**2 + u), gradient=1.5 * u + 1, hessian=1.5 * np.eye(5),
        tangent=_tangent_like(x, rng), operators=REVERSE_OPERATORS,
        description="custom_vjp whose rule is 3x ct for x**2 (true: 2x ct)",
    )


def _rule_pytree(dt: str, fn: dict) -> Scenario:
    anp, affine = fn["anp"], fn["affine"]

    def f(x):
        return anp.sum(affine(x["p"], x["y"]) * x["c"])

    rng = _rng(32)
    x = {"p": {"w": rng.normal(size=3).astype(dt), "b": rng.normal(size=3).astype(dt)},
         "y": rng.normal(size=3).astype(dt), "c": rng.normal(size=3).astype(dt)}
    u = _up(x)
    w, b, y, c = u["p"]["w"], u["p"]["b"], u["y"], u["c"]
    gradient = {"p": {"w": 2 * c * y, "b": -c}, "y": 3 * c * w, "c": w * y + b}
    return Scenario(
        "rule_pytree", f, x, value=np.sum((w * y + b) * c), gradient=gradient,
        operators=("gradient", "value_and_gradient", "pullback"),
        description="two-argument custom_vjp with pytree cotangents ({'w','b'} and y), wrong on purpose",
    )


def _softplus(dt: str, fn: dict) -> Scenario:
    anp, softplus = fn["anp"], fn["softplus"]

    def f(x):
        return anp.sum(softplus(x))

    x = np.array([-700.0, -3.0, 0.0, 2.0, 700.0], dtype=dt)
    u = _up(x)
    s = 0.5 * (np.tanh(0.5 * u) + 1)
    return Scenario(
        "softplus_700", f, x, value=np.sum(np.maximum(u, 0) + np.log1p(np.exp(-np.abs(u)))), gradient=s,
        hessian=np.diag(s * (1 - s)), tangent=np.ones_like(x), operators=REVERSE_OPERATORS,
        description="a stable softplus at +-700 (its naive derivative is nan there)",
    )


def _rule_jvp(dt: str, fn: dict) -> Scenario:
    sine = fn["sine"]

    def f(x):
        return sine(x) * 1.0

    rng = _rng(33)
    x = rng.uniform(-2, 2, 4).astype(dt)
    u = _up(x)
    t = _tangent_like(x, rng)
    return Scenario(
        "rule_jvp", f, x, value=np.sin(u), jacobian=np.diag(2 * np.cos(u)), tangent=t,
        operators=FORWARD_OPERATORS, description="custom_jvp whose rule is 2 cos(x) t for sin (true: cos(x) t)",
    )


def _stopped(dt: str, fn: dict) -> Scenario:
    anp, ad = fn["anp"], fn["ad"]

    def f(x):
        return anp.sum(ad.stop_gradient(x) * x**2)

    rng = _rng(34)
    x = rng.uniform(-2, 2, 4).astype(dt)
    u = _up(x)
    return Scenario(
        "stop_gradient", f, x, value=np.sum(u**3), gradient=2 * u**2, hessian=np.diag(2 * u),
        tangent=_tangent_like(x, rng), description="stop_gradient(x) * x**2: the stopped factor is a constant",
    )


def _ridge(dt: str, fn: dict) -> Scenario:
    anp, ad = fn["anp"], fn["ad"]
    rng = _rng(35)
    a = rng.normal(size=(8, 4)).astype(dt)
    b = rng.normal(size=8).astype(dt)

    def optimality(w, lam, ata, atb):
        return anp.tensordot(ata, w, axes=1) - atb + lam * w  # the gradient of |Aw - b|^2 / 2 + lam |w|^2 / 2

    @ad.custom_root(optimality, solve="dense")
    def ridge(init, lam, ata, atb):
        # a solver that stops its own gradient: only the implicit function theorem differentiates it
        lam = ad.stop_gradient(lam)
        m = ata + lam * anp.eye(4, dtype=anp.get_dtype_name(ata), like=ata)
        return ad.stop_gradient(anp.linalg.solve(m, anp.reshape(atb, (4, 1)))[:, 0])

    def f(lam, ata, atb, init, weights):
        return anp.sum(ridge(init, lam, ata, atb) * weights)

    lam = np.asarray(0.7, dtype=dt)
    ua, ub, ul = a.astype(np.float64), b.astype(np.float64), float(lam)
    m = ua.T @ ua + ul * np.eye(4)
    w = np.linalg.solve(m, ua.T @ ub)
    weights = np.arange(1, 5)
    gradient = -weights @ np.linalg.solve(m, w)
    return Scenario(
        "ridge_custom_root", f, lam, ((a.T @ a).astype(dt), (a.T @ b).astype(dt), np.zeros(4, dt), weights.astype(dt)),
        value=weights @ w, gradient=np.asarray(gradient),
        operators=("gradient", "value_and_gradient", "pullback"),
        description="ridge regression by a solver that stops its gradient, ad.custom_root vs the closed form",
    )


_BUILDERS = (_rule_square, _rule_pytree, _softplus, _rule_jvp, _stopped, _ridge)
_CACHE: Memo = Memo(name="testing: custom rule scenarios", keyed_on="dtype")


def rule_scenarios(dtypes: str | Sequence[str] = DTYPES) -> list[Scenario]:
    """The "rule used" scenarios, one per (definition, dtype), built once per process.

    ``rule_scenarios(dtypes=("float64", "float32")) -> list[Scenario]``.  Their references
    are the rules', which are mostly unlike the true derivatives: grade exact backends on
    them (``check_backend(b, rule_scenarios())``), not finite differences.

    Example:
        >>> [s.name for s in rule_scenarios("float64")][:2]
        ['rule_square', 'rule_pytree']
    """
    def build(dt: str) -> list[Scenario]:
        fn = _functions()  # one set of functions per dtype, as each dtype is traced anew
        return [make(dt, fn) for make in _BUILDERS]

    return _family(dtypes, _CACHE, build)

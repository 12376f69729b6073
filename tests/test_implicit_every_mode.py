"""ad.custom_root and ad.custom_fixed_point in every mode and order, on every exact backend,
against closed forms (issue 45, items 1, 2 and 10): reverse, forward, forward over reverse,
reverse over reverse, forward over forward and third order, prepared and unprepared.

Each cell is either the closed form's number or an ``ad.CustomRuleError`` that the
``REFUSED`` table expects (strict: a refusal that starts to give a number fails, so the
table and the guide's table stay true).  Before this, second derivatives kept the solver's
output as a constant inside the backward (jax, mlx: 0.041950 for 0.669573), forward mode
differentiated the backward at a zero cotangent (0 on autograd, mlx, pytensor), and the
nan that flags a failed solve under a trace poisoned second derivatives (tensorflow).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff._registry import unavailable_reason

EXACT = ("autograd", "jax", "mlx", "paddle", "pytensor", "tensorflow", "torch")
MODES = ("gradient", "derivative", "hessian", "second_derivative", "hvp", "third", "jacobian", "prepared_hessian")
#: (backend, mode) pairs that refuse, each with the reason the library gives.
REFUSED: dict[tuple[str, ...], str] = {
    # jax: a custom_vjp has no forward rule (jax transposes a jvp rule only where the tangent
    # is linear as jax traces it, which an iterative solve's is not)
    ("jax", "derivative"): "forward mode",
    # tensorflow runs forward-mode rules with every tape and accumulator hidden
    ("tensorflow", "derivative"): "forward mode",
    ("tensorflow", "second_derivative"): "forward mode",
    ("tensorflow", "hvp"): "forward mode",
    # paddle cannot take a derivative inside a PyLayer's backward
    **{("paddle", mode): "paddle" for mode in ("hessian", "second_derivative", "hvp", "third", "prepared_hessian")},
    # pytensor builds forward mode by transposing the reverse rule (the backward's iterative
    # solve is not linear in its cotangent as computed: that was a silent 0)
    ("pytensor", "derivative"): "forward mode",
    ("pytensor", "second_derivative"): "forward mode",
}


#: Cells still wrong (or an unclear error) today, each an open bug of issue 45: xfail, strict,
#: so that a fix turns them into failures to remove from here (and the guide's table).
OPEN: dict[tuple[str, str, str], str] = {
}


#: Cells that are right but slow (PyTensor compiles the graphs of third order through the
#: default solve, and of the hessian cell's second derivatives through other routes): run
#: with ABSTRACTDIFF_SLOW_TESTS=1.
SLOW = {("pytensor", "sqrt", "third"): "about 4 minutes",
        # the same second derivatives as the hessian cell, through other routes: about 10 s each
        ("pytensor", "sqrt", "prepared_hessian"): "about 10 s", ("pytensor", "sqrt", "hvp"): "about 10 s"}


def _slow(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not os.environ.get("ABSTRACTDIFF_SLOW_TESTS"),
                              reason=f"right but slow ({reason}): set ABSTRACTDIFF_SLOW_TESTS=1 to run it")


def _exact_but_slow_on(slow: dict[str, str]) -> list:
    """EXACT, with the backends of ``slow`` (name -> why) run only with ABSTRACTDIFF_SLOW_TESTS=1."""
    return [pytest.param(n, marks=_slow(slow[n])) if n in slow else n for n in EXACT]


def _open(name: str, problem: str, mode: str) -> pytest.MarkDecorator | None:
    reason = OPEN.get((name, problem, mode))
    if reason is not None:
        return pytest.mark.xfail(strict=True, reason=f"open (issue 45): {reason}")
    slow = SLOW.get((name, problem, mode))
    return None if slow is None else _slow(slow)


def _refusal(name: str, problem: str, mode: str) -> str | None:
    return REFUSED.get((name, mode), REFUSED.get((name, mode, problem)))


def _backend(name: str) -> ad.Backend:
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return ad.backend(name, **({"mode": "FAST_COMPILE"} if name == "pytensor" else {}))


# ------------------------------------------------------------------ the problems
def _mv(a: Any, v: Any) -> Any:
    """A matrix times a vector in every library (TensorFlow's ``@`` takes matrices only)."""
    return anp.tensordot(a, v, axes=1)


def _sqrt() -> tuple[Callable, np.ndarray, list]:
    """x* = sqrt(a) from x**2 = a, a solver that stops its gradient; derivatives at a = 4."""

    @ad.custom_root(lambda x, a: x**2 - a)
    def sqrt(init, a):
        return ad.stop_gradient(a) ** 0.5

    a = 4.0
    # d^k/da^k a**0.5: 1/2 a**-1/2, -1/4 a**-3/2, 3/8 a**-5/2
    return (lambda a: sqrt(anp.ones_like(a), a)), np.array(a), [0.5 * a**-0.5, -0.25 * a**-1.5, 0.375 * a**-2.5]


_RNG = np.random.default_rng(1)
_X, _XV = _RNG.normal(size=(20, 3)), _RNG.normal(size=(10, 3))
_W_TRUE = np.array([1.0, -2.0, 0.5])
_Y, _YV = _X @ _W_TRUE + _RNG.normal(size=20), _XV @ _W_TRUE + _RNG.normal(size=10)


def _ridge() -> tuple[Callable, np.ndarray, list]:
    """The guide's ridge example (a Newton solver that stops its gradient, solve='dense'):
    the validation loss in the regularisation strength lam, and its closed-form derivatives."""

    def optimality(w, lam, x, y):
        return _mv(anp.transpose(x), _mv(x, w) - y) + lam * w

    @ad.custom_root(optimality, solve="dense")
    def ridge(init, lam, x, y):
        w, lam, x, y = ad.stop_gradient((init, lam, x, y))
        hessian = anp.tensordot(anp.transpose(x), x, axes=1) + lam * anp.eye(3, like=x)
        for _ in range(2):
            w = w - anp.linalg.solve(hessian, optimality(w, lam, x, y))
        return w

    def loss(lam):
        x, y, xv, yv = (anp.asarray(v, like=lam) for v in (_X, _Y, _XV, _YV))
        w = ridge(anp.zeros_like(x[0]), lam, x, y)
        return anp.sum((_mv(xv, w) - yv) ** 2)

    lam = 2.0
    m = np.linalg.inv(_X.T @ _X + lam * np.eye(3))
    w = m @ _X.T @ _Y
    w1, w2, w3 = -m @ w, 2 * m @ m @ w, -6 * m @ m @ m @ w  # d^k w*/dlam^k
    r = _XV @ w - _YV
    d1 = 2 * r @ _XV @ w1
    d2 = 2 * (_XV @ w1) @ (_XV @ w1) + 2 * r @ _XV @ w2
    d3 = 6 * (_XV @ w1) @ (_XV @ w2) + 2 * r @ _XV @ w3
    return loss, np.array(lam), [d1, d2, d3]


PROBLEMS = {"sqrt": _sqrt, "ridge": _ridge}


def _run(b: ad.Backend, mode: str, f: Callable, x: np.ndarray) -> Any:
    xb = b.asarray(x)
    one = b.asarray(np.ones_like(x))
    if mode == "gradient":
        return ad.gradient(b, f, xb)
    if mode == "derivative":
        return ad.derivative(b, f, xb)
    if mode == "hessian":
        return ad.hessian(b, f, xb)
    if mode == "prepared_hessian":
        prep = ad.prepare_hessian(b, f, xb)
        prep(xb)  # twice: the second call reuses what the first made
        return prep(xb)
    if mode == "second_derivative":
        return ad.second_derivative(b, f, xb)
    if mode == "hvp":
        return ad.hvp(b, f, xb, one)
    if mode == "third":  # reverse over reverse over reverse
        return ad.gradient(b, lambda a: ad.hessian(b, f, a), xb)
    if mode == "jacobian":  # a tall function: Jacobians pick forward mode where it is cheaper
        return ad.jacobian(b, lambda a: anp.stack([f(a), 2 * f(a), 3 * f(a)]), xb)
    raise AssertionError(mode)


def _expected(mode: str, derivatives: list) -> np.ndarray:
    order = {"gradient": 0, "derivative": 0, "jacobian": 0, "hessian": 1, "prepared_hessian": 1,
             "second_derivative": 1, "hvp": 1, "third": 2}[mode]
    value = derivatives[order]
    return np.array([value, 2 * value, 3 * value]) if mode == "jacobian" else np.array(value)


@pytest.mark.parametrize("name,problem,mode", [
    pytest.param(n, p, m, marks=[mark] if (mark := _open(n, p, m)) else [])
    for n in EXACT for p in sorted(PROBLEMS) for m in MODES
])
def test_custom_root_is_right_or_refused_in_every_mode(name: str, problem: str, mode: str) -> None:
    b = _backend(name)
    f, x, derivatives = PROBLEMS[problem]()
    refused = _refusal(name, problem, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if refused is not None:
            with pytest.raises(ad.CustomRuleError, match=refused):
                _run(b, mode, f, x)
            return
        got = np.asarray(ad.to_numpy(_run(b, mode, f, x)), dtype=float)
    np.testing.assert_allclose(got.reshape(-1), _expected(mode, derivatives).reshape(-1), rtol=1e-7, atol=1e-10)


# --------------------------------------------------------------- a DEQ layer, against jax
# PyTensor rewrites the 40 unrolled solver steps' graph for about a minute
@pytest.mark.parametrize("name", _exact_but_slow_on({"pytensor": "about a minute"}))
def test_the_hessian_of_a_deq_layer_in_its_bias(name: str) -> None:
    """x = tanh(W x + b) by the default (matrix-free) solve: its Hessian in b against jax's of
    the converged iteration (was wrong on mlx, nan on tensorflow and torch)."""
    jax = pytest.importorskip("jax")
    b = _backend(name)
    rng = np.random.default_rng(0)
    w, bias = rng.normal(size=(3, 3)) * 0.3, rng.normal(size=3)

    @ad.custom_fixed_point(lambda x, w, b: anp.tanh(_mv(w, x) + b))
    def deq(init, w, b):
        x = ad.stop_gradient(init)
        w, b = ad.stop_gradient((w, b))
        for _ in range(40):  # contracts by about 0.5 a step: converged to rounding
            x = anp.tanh(_mv(w, x) + b)
        return x

    def loss(b, w):
        x = deq(anp.zeros_like(b), w, b)
        return anp.sum(x**2) + anp.sum(x * b)

    with jax.enable_x64(True):
        import jax.numpy as jnp

        def reference(b, w):
            x = jnp.zeros_like(b)
            for _ in range(120):
                x = jnp.tanh(w @ x + b)
            return jnp.sum(x**2) + jnp.sum(x * b)

        want = np.asarray(jax.hessian(reference)(jnp.asarray(bias), jnp.asarray(w)))
    if (name, "hessian") in REFUSED:
        with pytest.raises(ad.CustomRuleError):
            ad.hessian(b, loss, bias, w)
        return
    got = np.asarray(ad.to_numpy(ad.hessian(b, loss, bias, w)), dtype=float)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


# -------------------------------------------------------------------------- error paths
def test_an_optimality_function_of_another_structure_is_named() -> None:
    """It returned a pair where x is one array: the error names optimality_fn, not the user's f."""
    b = _backend("autograd")

    @ad.custom_root(lambda x, a: (x**2 - a, x))
    def sqrt(init, a):
        return ad.stop_gradient(a) ** 0.5

    with pytest.raises(ad.CustomRuleError, match="optimality_fn.*structure"):
        ad.gradient(b, lambda a: sqrt(anp.ones_like(a), a), np.array(4.0))


def test_an_optimality_function_of_another_shape_is_named() -> None:
    b = _backend("autograd")

    @ad.custom_root(lambda x, a: anp.stack([x**2 - a, x - 2]))
    def sqrt(init, a):
        return ad.stop_gradient(a) ** 0.5

    with pytest.raises(ad.CustomRuleError, match="one equation per unknown"):
        ad.gradient(b, lambda a: sqrt(anp.ones_like(a), a), np.array(4.0))


# ------------------------------------------------------------ the guide's table, from REFUSED
GUIDE = "docs/guide/custom-derivatives.md"
_START = "<!-- custom-root-modes: generated by tests/test_implicit_every_mode.py -->"
_END = "<!-- end custom-root-modes -->"
_COLUMNS = {"gradient": "`gradient`, `pullback`", "derivative": "`derivative`, `pushforward`",
            "hessian": "`hessian` (reverse over reverse)", "hvp": "`hvp` (forward over reverse)",
            "second_derivative": "`second_derivative` (forward over forward)", "third": "third order",
            "jacobian": "`jacobian` of a tall function"}


def custom_root_table() -> str:
    """The guide's table of what ``ad.custom_root`` does in each mode on each backend: the
    cells this file checks (``right``: against the closed forms; ``refuses``: an
    ``ad.CustomRuleError``, the REFUSED table)."""

    def cell(name: str, mode: str) -> str:
        if any((name, p, mode) in OPEN for p in PROBLEMS):
            return "**wrong today** (an open bug)"
        refused = [p for p in sorted(PROBLEMS) if _refusal(name, p, mode) is not None]
        if not refused:
            return "right"
        return "refuses" if len(refused) == len(PROBLEMS) else "refuses with `solve=\"dense\"`"

    rows = ["| backend | " + " | ".join(_COLUMNS.values()) + " |", "|---" * (len(_COLUMNS) + 1) + "|"]
    rows += [f"| {name} | " + " | ".join(cell(name, mode) for mode in _COLUMNS) + " |" for name in EXACT]
    return "\n".join([_START, *rows, _END])


def test_the_guides_table_is_the_one_these_tests_check() -> None:
    from pathlib import Path

    text = (Path(__file__).parent.parent / GUIDE).read_text()
    start, end = text.index(_START), text.index(_END) + len(_END)
    assert text[start:end] == custom_root_table(), (
        f"{GUIDE}'s custom_root table differs from the REFUSED table of {__file__}: run "
        f"`python {__file__}` to write it again"
    )


if __name__ == "__main__":  # writes the guide's table from REFUSED
    from pathlib import Path

    path = Path(__file__).parent.parent / GUIDE
    text = path.read_text()
    start, end = text.index(_START), text.index(_END) + len(_END)
    path.write_text(text[:start] + custom_root_table() + text[end:])


@pytest.mark.parametrize("name", ["jax", "tensorflow", "mlx"])
def test_second_order_through_the_default_solve_under_a_trace(name: str) -> None:
    """Compiled, BiCGSTAB runs all its iterations after converging and its residuals keep
    shrinking: a derivative of its scalars divided by their squares, which underflowed to 0
    (jax's Hessian of this fixed point was nan). Found by the differential oracle."""
    jax = pytest.importorskip("jax")
    b = ad.backend(name, **({"compile": True} if name == "mlx" else {})) if unavailable_reason(name) is None \
        else pytest.skip(unavailable_reason(name))

    @ad.custom_fixed_point(lambda x, a: anp.cos(a * x))
    def fixed(init, a):
        x, a = ad.stop_gradient((init, a))
        for _ in range(7):  # Newton on x - cos(a x)
            x = x - (x - anp.cos(a * x)) / (1 + a * anp.sin(a * x))
        return x

    with jax.enable_x64(True):
        import jax.numpy as jnp

        def reference(a):
            x = jnp.ones_like(a)
            for _ in range(60):
                x = x - (x - jnp.cos(a * x)) / (1 + a * jnp.sin(a * x))
            return x

        want = float(jax.hessian(reference)(jnp.asarray(0.8)))
    got = ad.to_numpy(ad.hessian(b, lambda a: fixed(anp.ones_like(a), a), np.array(0.8)))
    np.testing.assert_allclose(float(got), want, rtol=1e-8)


@pytest.mark.parametrize("name", EXACT)
def test_a_pytree_solution(name: str) -> None:
    """x* a dict: the residuals are raveled in x's order for the operators (it was refused as
    f's pytree output), and the default solve recovers from its breakdown on this structured
    system by restarting (jax's compiled run stopped 5e-8 short, accepted by the loose check)."""
    b = _backend(name)

    @ad.custom_root(lambda x, a: {"u": x["u"] ** 2 - a, "v": x["v"] - 2 * x["u"]})
    def solve(init, a):
        a = ad.stop_gradient(a)
        return {"u": a**0.5, "v": 2 * a**0.5}

    a = np.array([4.0, 9.0])
    g = ad.gradient(b, lambda a: anp.sum(solve({"u": anp.ones_like(a), "v": anp.ones_like(a)}, a)["v"]), a)
    np.testing.assert_allclose(np.asarray(ad.to_numpy(g), dtype=float), a**-0.5, rtol=1e-10)


@pytest.mark.parametrize("name", _exact_but_slow_on({"pytensor": "about 40 s"}))
def test_the_hessian_of_a_cube_of_a_root(name: str) -> None:
    """sqrt(a)**3 at 9 (its second derivative 0.25): compiled jax gave nan (found by an attack)."""
    b = _backend(name)

    @ad.custom_root(lambda x, a: x**2 - a)
    def sqrt(init, a):
        return ad.stop_gradient(a) ** 0.5

    def f(a):
        return sqrt(anp.ones_like(a), a) ** 3

    if _refusal(name, "sqrt", "hessian"):
        with pytest.raises(ad.CustomRuleError):
            ad.hessian(b, f, np.array(9.0))
        return
    np.testing.assert_allclose(float(ad.to_numpy(ad.hessian(b, f, np.array(9.0)))), 0.25, rtol=1e-10)

"""The differential oracle: random compositions of abstractdiff's features, differentiated in
every mode and order on one backend, against jax's own derivative of the same math.

Why: each feature (a custom rule, an implicit solver, a loop...) is tested by hand where it
was written, mostly by its first reverse-mode derivative.  The bugs that got through lived
where two features meet, or in a mode nobody asked: the second derivative through a
``custom_root``, forward mode through one, a global read by a rule after it changed, a scan's
stacked outputs on the first step.  This module asks all of those questions at random.

How:

* **Blocks** (:data:`BLOCKS`): small maps ``v -> same shape`` written with autoray, each in
  two versions.  The *feature* version uses one feature (``ad.custom_vjp`` of ``sin`` with its
  exact ``bwd``, ``ad.custom_root`` of a square root solved by Newton's method behind
  ``ad.stop_gradient``, ``ad.scan`` recording its carry from a Python ``0.0``...).  The
  *reference* version is what jax differentiates natively: the closed form, ``lax.scan``,
  ``lax.stop_gradient``, jax's ``custom_jvp`` with the implicit function theorem for the
  fixed point, or for a rule that differs from its function on purpose (one that reads the
  global :data:`SCALE`, one whose Jacobian is dense) jax's own ``jax.custom_jvp`` of the same
  linear map.  Exact rules are graded at every order, the others at first order.
* **Cases** (:class:`Case`): one to three blocks chained, summed or multiplied, optionally
  inside an ``ad.fori_loop`` / ``ad.scan``; a point of shape ``()``, ``(2,)`` or ``(3,)``; one
  backend variant (compiled or not); one mode or order (:data:`MODES`: reverse, forward,
  forward-over-reverse, reverse-over-reverse, third order, through nested operators too);
  prepared or not; an ``ad.Sparse`` Jacobian or Hessian.  A case whose blocks read
  :data:`SCALE` or :data:`TARGET` is run twice, with the globals changed in between: the
  second call must see the new values.
* **Outcomes**: *right*; *clear* (an :class:`~abstractdiff.AbstractDiffError`: the library
  refused, which the rules allow); *unclear* (anything else raised); *wrong* (a number that
  differs from the reference, or a NaN); *n/a* (the case asked for something illegal: a
  ``bwd`` that converts traced values to numpy).  Wrong and unclear are failures.
* **Hypothesis** draws the cases (:func:`oracle_cases`), seeded, with no example database;
  :func:`run_oracle` runs them all (it does not stop at the first failure), reduces each
  failure to a smaller case that still fails (:func:`minimize`) and reports the counts.

Running the long hunt (``tests/test_oracle.py`` is the ``make test`` entry)::

    ABSTRACTDIFF_ORACLE_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_oracle.py -p no:cacheprovider -q -s

runs 2000 cases per backend and appends each new minimal failure to
``tests/oracle_failures.json``, which ``make test`` replays first.  From Python::

    from abstractdiff.testing import run_oracle
    report = run_oracle(["torch", "mlx"], examples=500, seed=7)
    print(report.summary())

jax must be installed (it computes every reference); no AD library (nor Hypothesis) is
imported before it is used.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

__all__ = [
    "BLOCKS", "MODES", "Case", "OracleReport", "Outcome", "exact_backends", "load_failures", "minimize", "oracle_cases",
    "run_case", "run_oracle", "save_failures",
]

#: A user's global, read by the rules of ``scaled_*`` (in their ``bwd`` / ``jvp`` alone) and
#: ``global_*`` (their function and rule).  The oracle sets it before each call of a case that
#: reads it, and restores it after.
SCALE = 2.0
#: Read by the optimality function (and the solver) of the ``target_root`` block.
TARGET = 1.0

#: The backend variants drawn per backend: compiled and not where the backend has both.
#: PyTensor runs in FAST_COMPILE (its default mode compiles each graph with Numba, ~1 s each).
VARIANTS: dict[str, tuple[dict[str, Any], ...]] = {
    "jax": ({}, {"compile": False}),
    "tensorflow": ({}, {"compile": False}),
    "mlx": ({}, {"compile": True}),
    "pytensor": ({"mode": "FAST_COMPILE"},),
}

#: Backends that are not exact (they ignore rules by design) or not array backends.
NOT_GRADED = ("finite_differences", "implicit")

SHAPES: tuple[tuple[int, ...], ...] = ((), (2,), (3,))


class NotApplicable(Exception):
    """Raised by a block when the case asks something a user may not write (a numpy
    conversion of traced values): the outcome is "n/a", neither right nor a failure."""


# ---------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One oracle case, small enough to read and to save as JSON (:meth:`to_json`).

    ``blocks`` are :data:`BLOCKS` names combined by ``combine`` (``"chain"``: ``b3(b2(b1(x)))``,
    ``"sum"``, ``"product"``), the result wrapped in ``loop`` (``"none"``, ``"fori"``,
    ``"scan"``); ``x`` holds the point's values (raveled) and ``shape`` its shape; ``mode`` is a
    :data:`MODES` name; ``sparse`` is ``""`` or ``"<sparsity>:<mode>"`` for an ``ad.Sparse``
    Jacobian or Hessian; ``switch`` the two values :data:`SCALE` and :data:`TARGET` take in
    the two calls of a case whose blocks read them (empty otherwise).
    """

    backend: str
    blocks: tuple[str, ...]
    mode: str
    shape: tuple[int, ...] = ()
    x: tuple[float, ...] = (0.5,)
    combine: str = "chain"
    loop: str = "none"
    prepared: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    sparse: str = ""
    switch: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["options"] = dict(self.options)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Case:
        data = dict(data)
        data["options"] = tuple(sorted(data.get("options", {}).items()))
        for key in ("blocks", "shape", "x", "switch"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)

    def label(self) -> str:
        """A one-line description, for reports."""
        parts = [self.backend + "".join(f",{k}={v}" for k, v in self.options), self.mode]
        parts.append(f" {self.combine} ".join(self.blocks) if len(self.blocks) > 1 else self.blocks[0])
        if self.loop != "none":
            parts.append(f"in {self.loop}")
        parts.append(f"x{list(self.shape)}={list(self.x)}")
        parts += ["prepared"] * self.prepared + [f"Sparse({self.sparse})"] * bool(self.sparse)
        if self.switch:
            parts.append(f"globals {self.switch[0]}->{self.switch[1]}")
        return " | ".join(parts)


@dataclass
class Outcome:
    """What one case gave: ``kind`` is ``"right"``, ``"clear"``, ``"unclear"``, ``"wrong"``,
    ``"n/a"`` or ``"slow"`` (stopped at the time limit); ``detail`` says what was raised or how
    the numbers differ."""

    case: Case
    kind: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.kind in ("wrong", "unclear")

    def describe(self) -> str:
        return f"{self.kind}: {self.case.label()}\n    {self.detail}"


@dataclass
class OracleReport:
    """The outcomes of a run: :attr:`counts` per kind, :attr:`failures` as ``(minimal,
    found)`` pairs of outcomes (the reduced failing case, and the drawn case it came from)."""

    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[tuple[Outcome, Outcome]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        kinds = ("right", "clear", "unclear", "wrong", "n/a", "slow")
        return {k: sum(o.kind == k for o in self.outcomes) for k in kinds}

    @property
    def ok(self) -> bool:
        return not any(o.failed for o in self.outcomes)

    def summary(self) -> str:
        lines = [f"{len(self.outcomes)} cases: " + ", ".join(f"{n} {k}" for k, n in self.counts.items())]
        lines += [f"  {name}: {s:.1f} s" for name, s in self.seconds.items()]
        for minimal, found in self.failures:
            lines.append(minimal.describe())
            if minimal.case != found.case:
                lines.append(f"    (reduced from: {found.case.label()})")
            lines.append(f"    json: {json.dumps(minimal.case.to_json())}")
        lines += [o.describe() for o in self.outcomes if o.kind == "slow"]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class Block:
    """A map ``v -> same shape`` in two versions: ``feature(shape)`` and ``reference(shape)``
    each return ``fn(v, d)`` (``d`` the case's data dict, see :func:`_data`).  ``tol`` is the
    relative tolerance of the comparison (iterative solvers converge to about 1e-12, and the
    implicit function theorem's linear solve loses a few more digits).  ``reads``: the globals
    the block reads.  ``max_order``: the highest derivative order it is graded at (1 for a rule
    that differs from its function on purpose: there the libraries' own mechanisms disagree
    at second order, see :data:`BLOCKS`); ``reverse_only``: graded in reverse mode alone (a
    ``bwd`` returning numpy arrays is legal only where it is handed concrete cotangents)."""

    name: str
    feature: Callable[[tuple[int, ...]], Callable]
    reference: Callable[[tuple[int, ...]], Callable]
    tol: float = 1e-6
    reads: tuple[str, ...] = ()
    max_order: int = 3
    reverse_only: bool = False

    def serves(self, mode: Mode) -> bool:
        """Whether the block is graded in ``mode``."""
        return mode.order <= self.max_order and (mode.reverse or not self.reverse_only)


def _anp() -> Any:
    from autoray import numpy as anp

    return anp


@functools.cache
def _rules() -> dict[str, Any]:
    """The custom functions, created once per process as a user defines them once (a
    compiling backend caches its traces per function object, so a stale cache shows)."""
    import abstractdiff as ad

    anp = _anp()

    def sin_fwd(v: Any) -> tuple:
        return anp.sin(v), v

    exact_sin = ad.custom_vjp(lambda v: anp.sin(v))
    exact_sin.defvjp(sin_fwd, lambda v, ct: (ct * anp.cos(v),))

    exact_cube = ad.custom_jvp(lambda v: v**3)
    exact_cube.defjvp(lambda p, t: (p[0] ** 3, 3 * p[0] ** 2 * t[0]))

    # rules that differ from their function on purpose, reading a global at each call
    scaled_sin = ad.custom_vjp(lambda v: anp.sin(v))
    scaled_sin.defvjp(sin_fwd, lambda v, ct: (SCALE * ct * anp.cos(v),))

    scaled_cube = ad.custom_jvp(lambda v: v**3)
    scaled_cube.defjvp(lambda p, t: (p[0] ** 3, SCALE * 3 * p[0] ** 2 * t[0]))

    # exact rules reading the same global: right at every order
    global_sin = ad.custom_vjp(lambda v: SCALE * anp.sin(v))
    global_sin.defvjp(lambda v: (SCALE * anp.sin(v), v), lambda v, ct: (SCALE * ct * anp.cos(v),))

    global_cube = ad.custom_jvp(lambda v: SCALE * v**3)
    global_cube.defjvp(lambda p, t: (SCALE * p[0] ** 3, SCALE * 3 * p[0] ** 2 * t[0]))

    # a rule whose Jacobian is dense where sin's is diagonal: diag(cos v) + 0.25 (a Sparse
    # pattern detected from the function misses the rule's entries)
    mixing_sin = ad.custom_vjp(lambda v: anp.sin(v))
    mixing_sin.defvjp(sin_fwd, lambda v, ct: (ct * anp.cos(v) + 0.25 * anp.sum(ct),))

    def numpy_bwd(v: Any, ct: Any) -> tuple:
        # a user's bwd computed with numpy: legal where the library hands bwd concrete arrays
        try:
            out = np.asarray(ct * anp.cos(v))
        except Exception as err:  # a tracer, a symbolic variable, a tensor that needs grad
            raise NotApplicable(f"bwd cannot convert {type(ct).__name__} to numpy") from err
        if out.dtype.kind != "f":
            raise NotApplicable(f"bwd converted {type(ct).__name__} to a {out.dtype} array")
        return (out,)

    numpy_sin = ad.custom_vjp(lambda v: anp.sin(v))
    numpy_sin.defvjp(sin_fwd, numpy_bwd)

    # implicit solvers: a starting point from the library's own power, polished by Newton's
    # method, all behind stop_gradient: the derivative comes from the implicit function
    # theorem alone (a good start keeps the traced graphs small; init is ones)
    def newton_sqrt(init: Any, a: Any) -> Any:
        x, a = ad.stop_gradient((init, a))
        x = x * a**0.5
        for _ in range(3):
            x = 0.5 * (x + a / x)
        return x

    def newton_cbrt(init: Any, a: Any) -> Any:
        x, a = ad.stop_gradient((init, a))
        x = x * a ** (1 / 3)
        for _ in range(3):
            x = (2 * x + a / x**2) / 3
        return x

    # matrix-vector products as sums and a column right-hand side: TensorFlow's tensors have
    # no .T and its matmul and solve take matrices only
    def mv(a: Any, w: Any) -> Any:
        return anp.sum(a * w, axis=1)

    def ridge_optimality(w: Any, lam: Any, X: Any, y: Any, eye: Any) -> Any:
        return mv(anp.transpose(X), mv(X, w) - y) + mv(eye * lam, w)

    def ridge_solver(init: Any, lam: Any, X: Any, y: Any, eye: Any) -> Any:
        w, lam, X, y, eye = ad.stop_gradient((init, lam, X, y, eye))
        hessian = anp.transpose(X) @ X + eye * lam
        column = (-1, 1)
        for _ in range(2):  # a quadratic: one Newton step is exact, the second polishes
            step = anp.linalg.solve(hessian, anp.reshape(ridge_optimality(w, lam, X, y, eye), column))
            w = w - anp.reshape(step, (-1,))
        return w

    def cos_map(x: Any, a: Any) -> Any:
        return anp.cos(a * x)

    def cos_solver(init: Any, a: Any) -> Any:
        x, a = ad.stop_gradient((init, a))
        for _ in range(7):  # Newton on x - cos(a x), monotone from x = 1 (the root, in (0.7, 1), is below)
            x = x - (x - anp.cos(a * x)) / (1 + a * anp.sin(a * x))
        return x

    def target_optimality(x: Any, a: Any) -> Any:
        return x**2 - TARGET * a

    def target_solver(init: Any, a: Any) -> Any:
        x, a = ad.stop_gradient((init, a))
        x = x * (TARGET * a) ** 0.5
        for _ in range(3):
            x = 0.5 * (x + TARGET * a / x)
        return x

    return {
        "exact_sin": exact_sin, "exact_cube": exact_cube, "scaled_sin": scaled_sin, "scaled_cube": scaled_cube,
        "global_sin": global_sin, "global_cube": global_cube,
        "mixing_sin": mixing_sin, "numpy_sin": numpy_sin,
        "root_sqrt": ad.custom_root(lambda x, a: x**2 - a)(newton_sqrt),
        "root_cbrt": ad.custom_root(lambda x, a: x**3 - a)(newton_cbrt),
        "ridge": ad.custom_root(ridge_optimality, solve="dense")(ridge_solver),
        "fixed_point": ad.custom_fixed_point(cos_map)(cos_solver),
        "target_root": ad.custom_root(target_optimality)(target_solver),
    }


@functools.cache
def _kernel(other: str) -> Any:
    """``sin(v) * v`` differentiated by backend ``other`` through ``ad.differentiate_with``."""
    import abstractdiff as ad

    anp = _anp()
    return ad.differentiate_with(lambda v: anp.sin(v) * v, other)


@functools.cache
def _jax_rules() -> dict[str, Any]:
    """The references of the rules that are not a closed form: jax's own ``custom_jvp`` of the
    same linear map (a jvp rule serves every mode and order in jax), and the fixed point of
    ``cos(a x)`` by jax's custom_jvp and the implicit function theorem."""
    import jax
    import jax.numpy as jnp

    def rule(value: Callable, tangent: Callable) -> Any:
        fn = jax.custom_jvp(value)
        fn.defjvp(lambda p, t: (value(p[0]), tangent(p[0], t[0])))
        return fn

    @jax.custom_jvp
    def fixed_point(a: Any) -> Any:
        x = jnp.ones_like(a)
        for _ in range(12):
            x = x - (x - jnp.cos(a * x)) / (1 + a * jnp.sin(a * x))
        return x

    @fixed_point.defjvp
    def _(p: tuple, t: tuple) -> tuple:
        (a,), (da,) = p, t
        x = fixed_point(a)  # itself differentiable: higher orders recurse through this rule
        # g(x, a) = x - cos(a x) = 0:  dx = -(dg/da) / (dg/dx) da
        return x, -(x * jnp.sin(a * x)) / (1 + a * jnp.sin(a * x)) * da

    return {
        "scaled_sin": rule(jnp.sin, lambda v, t: SCALE * t * jnp.cos(v)),
        "scaled_cube": rule(lambda v: v**3, lambda v, t: SCALE * 3 * v**2 * t),
        "mixing_sin": rule(jnp.sin, lambda v, t: t * jnp.cos(v) + 0.25 * jnp.sum(t)),
        "fixed_point": fixed_point,
    }


def _is_vector(shape: tuple[int, ...]) -> bool:
    return len(shape) > 0


def _rule_block(name: str, reference: Callable[[Any], Any] | None, **kw: Any) -> Block:
    """A block that applies rule ``name`` to ``v``; its reference is ``reference(jnp)`` (a
    closed form) or, when ``None``, the rule's jax twin from :func:`_jax_rules`."""

    def feature(shape: tuple[int, ...]) -> Callable:
        fn = _rules()[name]
        return lambda v, d: fn(v)

    def ref(shape: tuple[int, ...]) -> Callable:
        import jax.numpy as jnp

        fn = _jax_rules()[name] if reference is None else reference(jnp)
        return lambda v, d: fn(v)

    return Block(name, feature, ref, **kw)


def _root_block(name: str, theta: Callable[[Any, Any], Any], closed: Callable[[Any, Any], Any], **kw: Any) -> Block:
    """A solver block: ``solver(ones, theta(v))``; ``closed(jnp, theta)`` is its closed form."""

    def feature(shape: tuple[int, ...]) -> Callable:
        fn, anp = _rules()[name], _anp()
        return lambda v, d: fn(anp.ones_like(v), theta(anp, v))

    def ref(shape: tuple[int, ...]) -> Callable:
        import jax.numpy as jnp

        return lambda v, d: closed(jnp, theta(jnp, v))

    return Block(name, feature, ref, tol=1e-5, **kw)


def _ridge_block() -> Block:
    """Ridge regression with one penalty per weight, ``lam = 1 + v**2``: ``w* = (X^T X +
    diag(lam))^-1 X^T y`` by ``custom_root(solve="dense")``; a scalar ``v`` is one weight."""

    def flat(np_: Any, v: Any, shape: tuple[int, ...]) -> Any:
        return np_.reshape(v, (max(1, math.prod(shape)),))

    def feature(shape: tuple[int, ...]) -> Callable:
        fn, anp = _rules()["ridge"], _anp()

        def block(v: Any, d: dict) -> Any:
            lam = 1 + flat(anp, v, shape) ** 2
            return anp.reshape(fn(anp.zeros_like(lam), lam, d["X"], d["y"], d["I"]), shape)

        return block

    def ref(shape: tuple[int, ...]) -> Callable:
        import jax.numpy as jnp

        def block(v: Any, d: dict) -> Any:
            lam = 1 + flat(jnp, v, shape) ** 2
            X = d["X"]
            return jnp.reshape(jnp.linalg.solve(X.T @ X + d["I"] * lam, X.T @ d["y"]), shape)

        return block

    return Block("ridge", feature, ref, tol=1e-5)


def _loop_block(name: str, kind: str, step: str, float_init: bool) -> Block:
    """A loop that records its carry: ``scan`` over the elements (a scalar ``v`` scanned as
    ``v * k``, three steps) whose ``ys`` are the incoming carries, or a ``fori_loop`` with a
    pytree carry.  ``float_init``: the carry starts as a Python float (``0.0`` / ``1.0``), the
    case where a library must stack a number with arrays."""

    def make(np_: Any, scan: Callable, fori: Callable, shape: tuple[int, ...]) -> Callable:
        if kind == "scan":

            def update(c: Any, x: Any) -> Any:
                return c + np_.sin(x) if step == "sum" else c * (1 + 0.5 * np_.sin(x))

            def block(v: Any, d: dict) -> Any:
                xs = v if _is_vector(shape) else v * d["k"]
                start = 0.0 if step == "sum" else 1.0
                init = start if float_init else np_.zeros_like(xs[0]) + start
                c, ys = scan(lambda c, x: (update(c, x), c), init, xs)
                out = 0.5 * ys + 0.25 * c  # ys[0] is init: a constant
                return out if _is_vector(shape) else np_.mean(out)

            return block

        def body(i: Any, carry: tuple) -> tuple:
            c, u = carry
            return c * 0.5 + np_.mean(np_.sin(u)), u * np_.cos(c)

        def block(v: Any, d: dict) -> Any:
            init = 0.0 if float_init else np_.zeros_like(np_.sum(v))
            c, u = fori(0, 3, body, (init, v))
            return u + 0.25 * c

        return block

    def feature(shape: tuple[int, ...]) -> Callable:
        import abstractdiff as ad

        return make(_anp(), ad.scan, ad.fori_loop, shape)

    def ref(shape: tuple[int, ...]) -> Callable:
        import jax.numpy as jnp
        from jax import lax

        return make(jnp, lax.scan, lax.fori_loop, shape)

    return Block(name, feature, ref)


def _stop_block() -> Block:
    def feature(shape: tuple[int, ...]) -> Callable:
        import abstractdiff as ad

        anp = _anp()
        return lambda v, d: v * ad.stop_gradient(anp.sin(v)) + anp.cos(v)

    def ref(shape: tuple[int, ...]) -> Callable:
        import jax.numpy as jnp
        from jax import lax

        return lambda v, d: v * lax.stop_gradient(jnp.sin(v)) + jnp.cos(v)

    return Block("stop_gradient", feature, ref)


def _with_block(other: str) -> Block:
    def feature(shape: tuple[int, ...]) -> Callable:
        kernel = _kernel(other)
        return lambda v, d: kernel(v)

    def ref(shape: tuple[int, ...]) -> Callable:
        import jax.numpy as jnp

        return lambda v, d: jnp.sin(v) * v

    return Block(f"with_{other}", feature, ref)


def _theta_sqrt(np_: Any, v: Any) -> Any:
    return 1 + v**2


def _theta_cos(np_: Any, v: Any) -> Any:
    return 0.5 + 0.25 * np_.tanh(v)  # a in (0.25, 0.75): cos(a x) is a contraction


#: Every block, by name.  ``with_<backend>`` blocks (``ad.differentiate_with``) are added per
#: installed kernel backend by :func:`blocks_for`.
#:
#: ``scaled_*`` and ``mixing_sin`` have rules that differ from their functions on purpose, and
#: are graded at first order only: at second order the libraries' own mechanisms disagree on
#: what the derivative of the rule's function is (jax differentiates a ``custom_vjp``'s
#: ``fwd`` natively, ``J f'``; ``torch.autograd.Function`` and its peers apply the rule again,
#: ``J J``).  ``global_*`` are exact rules that read the same global, for every order.
BLOCKS: dict[str, Block] = {
    b.name: b
    for b in (
        _rule_block("exact_sin", lambda jnp: jnp.sin),
        _rule_block("exact_cube", lambda jnp: lambda v: v**3),
        _rule_block("scaled_sin", None, reads=("SCALE",), max_order=1),
        _rule_block("scaled_cube", None, reads=("SCALE",), max_order=1),
        _rule_block("global_sin", lambda jnp: lambda v: SCALE * jnp.sin(v), reads=("SCALE",)),
        _rule_block("global_cube", lambda jnp: lambda v: SCALE * v**3, reads=("SCALE",)),
        _rule_block("mixing_sin", None, max_order=1),
        _rule_block("numpy_sin", lambda jnp: jnp.sin, max_order=1, reverse_only=True),
        _root_block("root_sqrt", _theta_sqrt, lambda jnp, a: jnp.sqrt(a)),
        _root_block("root_cbrt", _theta_sqrt, lambda jnp, a: jnp.cbrt(a)),
        _root_block("fixed_point", _theta_cos, lambda jnp, a: _jax_rules()["fixed_point"](a)),
        _root_block("target_root", _theta_sqrt, lambda jnp, a: jnp.sqrt(TARGET * a), reads=("TARGET",)),
        _ridge_block(),
        _loop_block("scan_sum_float", "scan", "sum", True),
        _loop_block("scan_sum_array", "scan", "sum", False),
        _loop_block("scan_prod_float", "scan", "prod", True),
        _loop_block("scan_prod_array", "scan", "prod", False),
        _loop_block("fori_float", "fori", "", True),
        _loop_block("fori_array", "fori", "", False),
        _stop_block(),
    )
}

#: The backends a ``differentiate_with`` block may use as its kernel (cheap, exact ones).
KERNELS = ("autograd", "torch", "jax")


def _block(name: str) -> Block:
    if name.startswith("with_"):
        return _with_block(name[len("with_"):])
    return BLOCKS[name]


def blocks_for(backend: str) -> list[str]:
    """The block names drawn for ``backend``: every block, and a ``differentiate_with``
    kernel of each other installed backend of :data:`KERNELS`."""
    import abstractdiff as ad

    installed = ad.available_backends()
    return [*BLOCKS, *(f"with_{k}" for k in KERNELS if k != backend and k in installed)]


# ---------------------------------------------------------------------------------- composition
def _compose(case: Case, reference: bool) -> tuple[Callable, Callable, Callable]:
    """``(f, F, tall)`` of the case in one version: ``f(x, d)`` shaped like ``x``, the scalar
    ``F(x, d) = sum(w * f)`` and the tall ``tall(x, d) = stack([f, x * f])``."""
    if reference:
        import jax.numpy as np_
        from jax import lax

        fori, scan = lax.fori_loop, lax.scan
    else:
        import abstractdiff as ad

        np_, fori, scan = _anp(), ad.fori_loop, ad.scan
    # a tuple: a list is a mutable container, whose contents the trace caches document as
    # unseen (a rule reached through one and reading a changed global would be stale by design)
    parts = tuple((_block(n).reference if reference else _block(n).feature)(case.shape) for n in case.blocks)

    def inner(v: Any, d: dict) -> Any:
        if case.combine == "chain":
            for part in parts:
                v = part(v, d)
            return v
        outs = [part(v, d) for part in parts]
        out = outs[0]
        for o in outs[1:]:
            out = out + o if case.combine == "sum" else out * o
        return out

    def f(x: Any, d: dict) -> Any:
        if case.loop == "fori":
            return fori(0, 2, lambda i, v: 0.5 * (v + inner(v, d)), x)
        if case.loop == "scan":
            c, ys = scan(lambda c, _: (0.5 * (c + inner(c, d)), c), x, None, length=2)
            return c + 0.25 * np_.sum(ys, axis=0)
        return inner(x, d)

    def F(x: Any, d: dict) -> Any:
        return np_.sum(d["w"] * f(x, d))

    def tall(x: Any, d: dict) -> Any:
        y = f(x, d)
        return np_.stack([y, x * y])

    return f, F, tall


def _data(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The case's data (passed as an argument, never differentiated): weights ``w`` (F) and
    ``w2`` (nested modes), the hvp direction ``v``, the ridge problem ``X, y, I`` and the
    scalar scan's ``k``.  Fixed per shape, so a saved case replays exactly."""
    m = max(1, math.prod(shape))
    rng = np.random.default_rng(45 + m)
    return {
        "w": np.linspace(0.5, 1.5, m).reshape(shape) if shape else np.array(1.25),
        "w2": np.linspace(-1.0, 1.0, m + 1)[1:].reshape(shape) if shape else np.array(-0.75),
        "v": np.linspace(1.0, -0.5, m).reshape(shape) if shape else np.array(0.5),
        "X": rng.normal(size=(m + 2, m)),
        "y": rng.normal(size=m + 2),
        "I": np.eye(m),
        "k": np.array([1.0, 0.5, -0.75]),
    }


def _directions(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The cotangent ``u`` of a pullback and the tangent ``t`` of a pushforward."""
    m = max(1, math.prod(shape))
    u = np.linspace(-1.0, 0.5, m).reshape(shape) if shape else np.array(-0.8)
    t = np.linspace(0.3, 1.1, m).reshape(shape) if shape else np.array(0.7)
    return u, t


# ---------------------------------------------------------------------------------- modes
@dataclass(frozen=True)
class Mode:
    """A mode and order: ``run(b, fns, x, d, prepared)`` computes it with abstractdiff (returning
    a callable ``call(x, d)`` so that a prepared operator is prepared once and called for each
    value of the globals), ``reference(fns, x, d)`` with jax.  ``fns`` are :func:`_compose`'s
    ``(f, F, tall)``.  ``order`` is the derivative order, ``reverse`` whether it is reverse mode
    at first order (where a numpy ``bwd`` is legal), ``scalar`` whether it needs a scalar
    ``x``, ``sparse`` whether ``ad.Sparse`` computes it."""

    name: str
    order: int
    run: Callable[..., Callable]
    reference: Callable[..., Any]
    scalar: bool = False
    reverse: bool = False
    sparse: bool = False


def _op(name: str, which: int, *extra: str) -> Callable[..., Callable]:
    """A mode that is one operator ``ad.<name>`` of ``fns[which]``, with the extra arguments
    ``extra`` taken from the data (the hvp direction) before the data itself."""

    def run(b: Any, fns: tuple, x: Any, d: dict, prepared: bool) -> Callable:
        import abstractdiff as ad

        def args(d: dict) -> list:
            return [*(d[e] for e in extra), d]

        if prepared:
            prep = getattr(ad, f"prepare_{name}")(b, fns[which], x, *args(d))
            return lambda x, d: prep(x, *args(d))
        return lambda x, d: getattr(ad, name)(b, fns[which], x, *args(d))

    return run


def _pullback(b: Any, fns: tuple, x: Any, d: dict, prepared: bool) -> Callable:
    import abstractdiff as ad

    u, _ = _directions(np.shape(x))
    if prepared:
        prep = ad.prepare_pullback(b, fns[0], x, d)
        return lambda x, d: prep(x, d)[1](u)
    return lambda x, d: ad.pullback(b, fns[0], x, d)(u)


def _pushforward(b: Any, fns: tuple, x: Any, d: dict, prepared: bool) -> Callable:
    import abstractdiff as ad

    _, t = _directions(np.shape(x))
    if prepared:
        prep = ad.prepare_pushforward(b, fns[0], x, d)
        return lambda x, d: prep(x, d)(t)
    return lambda x, d: ad.pushforward(b, fns[0], x, d)(t)


def _nested(outer: str, build: Callable[[Any, tuple], Callable]) -> Callable[..., Callable]:
    """A mode that is ``ad.<outer>`` of a function calling another operator (``build(b, fns)``
    gives that function): the nesting a user writes for a third derivative."""

    def run(b: Any, fns: tuple, x: Any, d: dict, prepared: bool) -> Callable:
        inner = build(b, fns)
        if outer == "pushforward":
            return _pushforward(b, (inner,), x, d, prepared)
        return _op(outer, 0)(b, (inner,), x, d, prepared)

    return run


def _inner(kind: str) -> Callable[[Any, tuple], Callable]:
    """The function a nested mode differentiates: ``x -> sum(w2 * ad.gradient(F, x))``
    (``"gradient"``), ``x -> sum(w2 * ad.hvp(F, x, v))`` (``"hvp"``), ``x ->
    ad.second_derivative(f, x)`` (``"second_derivative"``) or the vector ``x ->
    ad.gradient(F, x)`` (``"gradient_vector"``), each computed with the case's backend."""

    def build(b: Any, fns: tuple) -> Callable:
        import abstractdiff as ad

        anp = _anp()
        f, F, _ = fns
        return {
            "gradient": lambda x, d: anp.sum(ad.gradient(b, F, x, d) * d["w2"]),
            "hvp": lambda x, d: anp.sum(ad.hvp(b, F, x, d["v"], d) * d["w2"]),
            "second_derivative": lambda x, d: ad.second_derivative(b, f, x, d),
            "gradient_vector": lambda x, d: ad.gradient(b, F, x, d),
        }[kind]

    return build


def _jax_ref(kind: str) -> Callable[..., Any]:
    """jax's native derivative of the reference ``fns`` for mode ``kind``."""

    def ref(fns: tuple, x: Any, d: dict) -> Any:
        import jax
        import jax.numpy as jnp

        f, F, tall = (functools.partial(g, d=d) for g in fns)
        u, t = (jnp.asarray(a) for a in _directions(x.shape))
        one = jnp.ones_like(x)

        def hvp(x: Any, v: Any) -> Any:
            return jax.jvp(jax.grad(F), (x,), (v,))[1]

        def second(x: Any) -> Any:
            return jax.jvp(lambda x: jax.jvp(f, (x,), (one,))[1], (x,), (one,))[1]

        table: dict[str, Callable[[], Any]] = {
            "gradient": lambda: jax.grad(F)(x),
            "pullback": lambda: jax.vjp(f, x)[1](u)[0],
            "pushforward": lambda: jax.jvp(f, (x,), (t,))[1],
            "derivative": lambda: jax.jvp(f, (x,), (one,))[1],
            "jacobian": lambda: jax.jacfwd(f)(x),
            "jacobian_tall": lambda: jax.jacfwd(tall)(x),
            "hvp": lambda: hvp(x, d["v"]),
            "hessian": lambda: jax.hessian(F)(x),
            "second_derivative": lambda: second(x),
            "gradient_of_gradient": lambda: jax.grad(lambda x: jnp.sum(jax.grad(F)(x) * d["w2"]))(x),
            "pushforward_of_gradient": lambda: jax.jvp(jax.grad(F), (x,), (t,))[1],
            "gradient_of_hvp": lambda: jax.grad(lambda x: jnp.sum(hvp(x, d["v"]) * d["w2"]))(x),
            "derivative_of_second_derivative": lambda: jax.jvp(second, (x,), (one,))[1],
        }
        return table[kind]()

    return ref


#: Every mode and order.  Reverse: gradient, pullback; forward: pushforward, derivative,
#: the tall Jacobian (which most backends take in forward mode); forward-over-reverse: hvp,
#: the pushforward of a gradient; reverse-over-reverse: hessian (on most backends), the
#: gradient of a gradient; third order: the gradient of an hvp, the derivative of a
#: second derivative.
MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("gradient", 1, _op("gradient", 1), _jax_ref("gradient"), reverse=True),
        Mode("pullback", 1, _pullback, _jax_ref("pullback"), reverse=True),
        Mode("pushforward", 1, _pushforward, _jax_ref("pushforward")),
        Mode("derivative", 1, _op("derivative", 0), _jax_ref("derivative"), scalar=True),
        Mode("jacobian", 1, _op("jacobian", 0), _jax_ref("jacobian"), sparse=True),
        Mode("jacobian_tall", 1, _op("jacobian", 2), _jax_ref("jacobian_tall"), sparse=True),
        Mode("hvp", 2, _op("hvp", 1, "v"), _jax_ref("hvp")),
        Mode("hessian", 2, _op("hessian", 1), _jax_ref("hessian"), sparse=True),
        Mode("second_derivative", 2, _op("second_derivative", 0), _jax_ref("second_derivative"), scalar=True),
        Mode("gradient_of_gradient", 2, _nested("gradient", _inner("gradient")), _jax_ref("gradient_of_gradient")),
        Mode("pushforward_of_gradient", 2, _nested("pushforward", _inner("gradient_vector")),
             _jax_ref("pushforward_of_gradient")),
        Mode("gradient_of_hvp", 3, _nested("gradient", _inner("hvp")), _jax_ref("gradient_of_hvp")),
        Mode("derivative_of_second_derivative", 3, _nested("derivative", _inner("second_derivative")),
             _jax_ref("derivative_of_second_derivative"), scalar=True),
    )
}

#: ``Case.sparse`` values: ``ad.Sparse(b, sparsity=..., mode=...)`` (detected pattern or one
#: dense probe; the products in forward or reverse mode).
SPARSE = ("detect:auto", "detect:forward", "detect:reverse", "dense-probe:auto")


def modes_for(shape: tuple[int, ...], blocks: Iterable[str]) -> list[str]:
    """The modes a case of this shape and these blocks may draw."""
    blocks = [_block(n) for n in blocks]
    return [m.name for m in MODES.values() if (not m.scalar or shape == ()) and all(b.serves(m) for b in blocks)]


# ---------------------------------------------------------------------------------- running
def _backend(case: Case) -> Any:
    import abstractdiff as ad

    b = ad.backend(case.backend, **dict(case.options))
    if case.sparse:
        sparsity, mode = case.sparse.split(":")
        b = ad.Sparse(b, sparsity=None if sparsity == "detect" else sparsity, mode=mode)
    return b


def _set_globals(scale: float | None, target: float | None = None) -> None:
    """Set :data:`SCALE` and :data:`TARGET` (both to ``scale`` unless ``target`` is given;
    ``None`` leaves them)."""
    global SCALE, TARGET
    if scale is not None:
        SCALE, TARGET = scale, scale if target is None else target


def _dense(value: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A result as a float64 numpy array: a scipy matrix (``ad.Sparse``) densified and shaped
    as the dense Jacobian or Hessian (it is documented as ``(y.size, x.size)``)."""
    import abstractdiff as ad

    if hasattr(value, "toarray"):
        return np.asarray(value.toarray(), dtype=np.float64).reshape(shape)
    return np.asarray(ad.to_numpy(value))


def _compare(got: Any, expected: np.ndarray, tol: float) -> str:
    """``""`` when ``got`` equals ``expected`` to ``tol`` relative to the reference's largest
    entry (so a derivative that should be zero is compared at the reference's scale), else
    what differs."""
    got = _dense(got, expected.shape)
    if got.shape != expected.shape:
        return f"shape {got.shape}, expected {expected.shape}"
    if got.dtype != np.float64:
        return f"dtype {got.dtype} for a float64 input"
    if not np.all(np.isfinite(got)):
        return f"non-finite result {got.tolist()}, expected {expected.tolist()}"
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    error = np.abs(got - expected)
    if np.all(error <= tol * (np.abs(expected) + scale)):
        return ""
    return f"got {np.round(got, 8).tolist()}, expected {np.round(expected, 8).tolist()} (max error {error.max():.3g})"


def _cause(err: BaseException) -> BaseException | None:
    """The :class:`NotApplicable` that ``err`` wraps, if any (libraries re-raise errors of a
    rule as their own)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, NotApplicable):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


class _Slow(BaseException):
    """Raised by the alarm of :func:`_time_limit` (a BaseException, so that no library's
    ``except Exception`` swallows it)."""


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (SIGALRM, main thread on POSIX; elsewhere no limit).
    The interruption lands between Python operations: a library's long native call (an XLA
    compilation) finishes first."""
    usable = seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def alarm(signum: int, frame: Any) -> None:
        raise _Slow

    previous = signal.signal(signal.SIGALRM, alarm)
    # and again every second: an alarm that lands in a finalizer or a weakref callback is
    # printed and ignored by Python
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(case: Case, time_limit: float | None = None) -> Outcome:
    """Run one case: the mode with abstractdiff and with jax, once, or twice (globals changed
    between the calls, and restored after) for blocks that read globals.  A case still running
    after ``time_limit`` seconds is stopped and reported as ``"slow"`` (not a failure: a long
    hunt goes on; the report lists it).

    Raises only when the *reference* fails (a bug of the oracle, never the library's)."""
    start = time.perf_counter()
    try:
        with _time_limit(time_limit):
            outcome = _run(case)
    except _Slow:
        outcome = Outcome(case, "slow", f"stopped after {time_limit} s")
    outcome.seconds = time.perf_counter() - start
    return outcome


def _run(case: Case) -> Outcome:
    import abstractdiff as ad

    mode = MODES[case.mode]
    tol = max(_block(n).tol for n in case.blocks)
    x = np.asarray(case.x, dtype=np.float64).reshape(case.shape)
    d = _data(case.shape)
    values = list(case.switch) if case.switch else [None]
    saved = SCALE, TARGET
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the libraries' notes on retracing and precision
            expected = [_expected(case, x, d, value) for value in values]
            try:
                _set_globals(values[0])
                call = mode.run(_backend(case), _compose(case, False), x, d, case.prepared)
                for value, want in zip(values, expected):
                    _set_globals(value)  # the prepared operator, or the next call, must see it
                    problem = _compare(call(x, d), want, tol)
                    if problem:
                        where = "" if value is None else f"with SCALE = TARGET = {value}: "
                        return Outcome(case, "wrong", where + problem)
            except Exception as err:
                if _cause(err) is not None:
                    return Outcome(case, "n/a", str(_cause(err)))
                kind = "clear" if isinstance(err, ad.AbstractDiffError) else "unclear"
                return Outcome(case, kind, f"{type(err).__name__}: {' '.join(str(err).split())[:300]}")
    finally:
        _set_globals(*saved)
    return Outcome(case, "right")


def _expected(case: Case, x: np.ndarray, d: dict, value: float | None) -> np.ndarray:
    """jax's answer for ``case`` with the globals at ``value``, in float64 (jax's x64 scoped to
    this computation: the global flag is never changed)."""
    import jax
    import jax.numpy as jnp

    _set_globals(value)
    with jax.enable_x64(True):
        dj = {k: jnp.asarray(a) for k, a in d.items()}
        expected = np.asarray(MODES[case.mode].reference(_compose(case, True), jnp.asarray(x), dj))
    if expected.dtype != np.float64 or not np.all(np.isfinite(expected)):  # the oracle's own bug
        raise AssertionError(f"the reference of {case.label()} is {expected!r}")
    return expected


# ---------------------------------------------------------------------------------- drawing
def variants_for(backend: str) -> tuple[dict[str, Any], ...]:
    return VARIANTS.get(backend, ({},))


def oracle_cases(backend: str) -> Any:
    """A Hypothesis strategy of :class:`Case` for ``backend``: one to three blocks, a
    combination, a loop around them, a shape, a point, a mode, prepared or not, a variant
    of the backend, an ``ad.Sparse`` for Jacobians and Hessians, and two values of the
    globals where a block reads them.  Simpler choices come first, so Hypothesis shrinks
    toward them."""
    from hypothesis import strategies as st

    names = blocks_for(backend)
    variants = variants_for(backend)

    @st.composite
    def draw_case(draw: Callable) -> Case:
        mode = MODES[draw(st.sampled_from(list(MODES)))]  # first: each mode as often
        shape = () if mode.scalar else draw(st.sampled_from(SHAPES))
        size = max(1, math.prod(shape))
        x = tuple(k / 10 for k in draw(st.lists(st.integers(-10, 10), min_size=size, max_size=size)))
        # a third derivative through three solvers takes minutes on some backends: two blocks
        allowed = [n for n in names if _block(n).serves(mode)]
        blocks = tuple(draw(st.lists(st.sampled_from(allowed), min_size=1, max_size=3 if mode.order < 3 else 2)))
        combine = draw(st.sampled_from(("chain", "sum", "product"))) if len(blocks) > 1 else "chain"
        loop = draw(st.sampled_from(("none", "none", "fori", "scan")))
        sparse = draw(st.sampled_from(("",) + SPARSE)) if mode.sparse else ""
        switch: tuple[float, ...] = ()
        if any(_block(n).reads for n in blocks):
            switch = tuple(draw(st.lists(st.sampled_from((1.0, 1.5, 2.0, 3.0)), min_size=2, max_size=2,
                                         unique=True)))
        return Case(
            backend=backend, blocks=blocks, mode=mode.name, shape=shape, x=x, combine=combine, loop=loop,
            prepared=draw(st.booleans()), options=tuple(sorted(draw(st.sampled_from(variants)).items())),
            sparse=sparse, switch=switch,
        )

    return draw_case()


def _draw(backend: str, examples: int, seed: int) -> list[Case]:
    """``examples`` cases drawn by Hypothesis, seeded (no example database, no shrinking: the
    body never fails; :func:`minimize` reduces failures instead).  Hypothesis mutates the
    examples it has drawn, so many differ in the point alone: those are left out (a case
    costs a trace or a compilation, a new point of the same case rarely finds a new bug),
    from up to four times as many drawn."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    cases: dict[tuple, Case] = {}

    @seeded(seed)
    @settings(max_examples=4 * examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False, print_blob=False)
    @given(oracle_cases(backend))
    def collect(case: Case) -> None:
        if len(cases) < examples:
            cases.setdefault(replace(case, x=()), case)

    collect()
    return list(cases.values())


def _simpler(case: Case) -> Iterable[Case]:
    """Cases one step simpler than ``case``, simplest first."""
    for i in range(len(case.blocks)):
        if len(case.blocks) > 1:
            rest = case.blocks[:i] + case.blocks[i + 1:]
            switch = case.switch if any(_block(n).reads for n in rest) else ()
            yield replace(case, blocks=rest, combine=case.combine if len(rest) > 1 else "chain", switch=switch)
    if case.loop != "none":
        yield replace(case, loop="none")
    if case.combine != "chain":
        yield replace(case, combine="chain")
    if case.prepared:
        yield replace(case, prepared=False)
    if case.sparse:
        yield replace(case, sparse="")
    if case.options and dict(case.options) != variants_for(case.backend)[0]:
        yield replace(case, options=tuple(sorted(variants_for(case.backend)[0].items())))
    if case.shape and MODES[case.mode].scalar is False and len(case.x) > 1:
        yield replace(case, shape=(), x=case.x[:1])


def minimize(outcome: Outcome, budget: int = 12, time_limit: float | None = None) -> Outcome:
    """A smaller case that still fails the same way (``wrong`` stays ``wrong``, ``unclear``
    stays ``unclear``), by removing one thing at a time while it keeps failing; at most
    ``budget`` more cases run."""
    current = outcome
    progress = True
    while progress and budget > 0:
        progress = False
        for candidate in _simpler(current.case):
            if candidate.mode not in modes_for(candidate.shape, candidate.blocks):
                continue
            if budget <= 0:
                break
            budget -= 1
            tried = run_case(candidate, time_limit)
            if tried.kind == current.kind:
                current, progress = tried, True
                break
    return current


def _signature(case: Case, kind: str) -> tuple:
    """What makes two failures the same, for reporting each once."""
    return case.backend, case.options, tuple(sorted(case.blocks)), case.loop, case.mode, case.prepared, \
        case.sparse, case.shape == (), kind


def run_oracle(
    backends: Sequence[str] | None = None,
    examples: int = 50,
    seed: int = 45,
    minimize_budget: int = 12,
    saved: Sequence[Case] = (),
    save_to: str | os.PathLike | None = None,
    time_limit: float | None = 60.0,
) -> OracleReport:
    """Run the oracle: the ``saved`` cases first, then ``examples`` drawn cases per backend.

    ``run_oracle(backends=None, examples=50, seed=45) -> OracleReport``.  ``backends``: names
    of installed backends (default :func:`exact_backends`: every exact one, jax included, whose
    features are then checked against jax's own mechanisms).  Every case runs, whatever fails;
    each failure is reduced (:func:`minimize`, at most ``minimize_budget`` more runs) and
    reported once per kind of case.  A case running past ``time_limit`` seconds is stopped and
    counted as slow.  ``save_to``: a JSON file in ``tests/oracle_failures.json``'s format, to
    which the new minimal failures are appended.  The long hunt: ``examples=2000``.
    """
    report = OracleReport()
    seen: set[tuple] = set()
    for name in backends if backends is not None else exact_backends():
        start = time.perf_counter()
        cases = [c for c in saved if c.backend == name] + _draw(name, examples, seed)
        for case in cases:
            outcome = run_case(case, time_limit)
            report.outcomes.append(outcome)
            if outcome.failed and _signature(case, outcome.kind) not in seen:
                seen.add(_signature(case, outcome.kind))
                minimal = minimize(outcome, minimize_budget, time_limit) if minimize_budget else outcome
                if minimal is outcome or _signature(minimal.case, minimal.kind) not in seen:
                    seen.add(_signature(minimal.case, minimal.kind))
                    report.failures.append((minimal, outcome))
        report.seconds[name] = time.perf_counter() - start
    if save_to is not None and report.failures:
        save_failures(save_to, [minimal for minimal, _ in report.failures])
    return report


def exact_backends() -> list[str]:
    """The installed backends the oracle grades: every one but finite differences (it ignores
    rules by design) and the implicit adapter (it differentiates variables, not arrays)."""
    import abstractdiff as ad

    return [n for n in ad.available_backends() if n not in NOT_GRADED]


def load_failures(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The saved entries of ``path`` (``[]`` when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return json.load(fh)["cases"]


def save_failures(path: str | os.PathLike, outcomes: Sequence[Outcome]) -> int:
    """Append the cases of ``outcomes`` that ``path`` does not hold yet; returns how many.
    Under a lock (in the temporary directory), so the pytest-xdist workers of a long hunt can
    append at once."""
    import hashlib
    import tempfile

    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: appends are not locked
        fcntl = None
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    with open(os.path.join(tempfile.gettempdir(), f"abstractdiff-oracle-{digest}.lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        entries = load_failures(path)
        known = {json.dumps(e["case"], sort_keys=True) for e in entries}
        added = 0
        for o in outcomes:
            key = json.dumps(o.case.to_json(), sort_keys=True)
            if key not in known:
                known.add(key)
                entries.append({"case": o.case.to_json(), "found": f"{o.kind}: {o.detail}"[:300], "note": ""})
                added += 1
        with open(path, "w") as fh:
            json.dump({"cases": entries}, fh, indent=1)
            fh.write("\n")
    return added

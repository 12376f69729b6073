"""Test scenarios: a function, a point, and analytic reference results per operator.

Scenario functions are backend-neutral (``autoray``), so the same scenario runs on numpy,
torch, jax, tensorflow and autograd.  Each built-in scenario is defined once as a
builder ``dtype -> Scenario``; :func:`default_scenarios` instantiates it per dtype.
References are computed in float64 numpy from the (possibly float32) inputs, so a
float32 run is compared with the exact derivative at exactly the point it was given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..core import OPERATORS as OPERATORS_TABLE
from ..core import ArgumentTypeError, InvalidArgumentError, Memo, is_array, is_float_dtype, operators_where, pytree

__all__ = [
    "COMBINED", "OPERATORS", "Scenario", "Switching", "default_scenarios", "scenario_names", "switching_scenarios",
]

#: Every operator the harness grades, in the operator table's order.
OPERATORS: tuple[str, ...] = operators_where(graded=True)

#: Second-order operators get the looser tolerance.
SECOND_ORDER = frozenset(operators_where(graded=True, order=2))

#: The combined operators, and the references each one's result is checked against.
COMBINED: dict[str, tuple[str, ...]] = {
    name: op.parts for name, op in OPERATORS_TABLE.items() if op.graded and len(op.parts) > 1
}


def _is_float_leaf(a: Any) -> bool:
    return is_array(a) and is_float_dtype(a.dtype)


def _none_leaf(tree: Any) -> Any:
    return pytree.tree_map(lambda _: None, tree, none_is_leaf=True)


@dataclass(eq=False)
class Scenario:
    """One differentiation test case: ``f(x, *args)`` with reference results.

    ``Scenario(name, f, x, args=(), *, value=, gradient=, jacobian=, hessian=, hvp=,
    pullback=, pushforward=, derivative=, second_derivative=, tangent=, cotangent=, operators=)``

    References are numpy arrays (trees shaped like ``x`` for gradient, jacobian, hvp
    and pullback; for a pytree ``x``, ``hessian`` is jax.hessian's nested layout, a tree
    like ``x`` of trees like ``x`` holding the blocks).  Leave out the ones that do not
    apply; the applicable operators are those with a reference (a combined operator
    such as ``value_gradient_and_hessian`` needs each of its parts, :data:`COMBINED`;
    ``pullback``/``pushforward`` are derived from ``gradient`` or ``jacobian`` when a
    cotangent/tangent is given, ``hvp`` from ``hessian`` and ``tangent``).  Pass
    ``operators=`` to restrict them.  Non-float leaves of ``x`` (ints, integer arrays,
    None) must come back as ``None`` in gradient-shaped results; a float leaf that ``f``
    ignores must get zeros.

    Example:
        >>> import numpy as np
        >>> from autoray import numpy as anp
        >>> s = Scenario("square", lambda x: anp.sum(x**2), np.array([1.0, 2.0]),
        ...              value=5.0, gradient=np.array([2.0, 4.0]))
        >>> s.operators, s.dtype, s.id
        (('gradient', 'value_and_gradient', 'pullback'), 'float64', 'square[float64]')
    """

    name: str
    f: Callable[..., Any]
    x: Any
    args: tuple = ()
    value: Any = None
    gradient: Any = None
    jacobian: Any = None
    hessian: Any = None
    hvp: Any = None
    pullback: Any = None
    pushforward: Any = None
    derivative: Any = None
    second_derivative: Any = None
    tangent: Any = None
    cotangent: Any = None
    operators: Sequence[str] | None = None
    description: str = ""
    #: portable functions (autoray names) ``f`` needs beyond elementwise arithmetic and
    #: reductions; :func:`~abstractdiff.testing.check_backend` reports a scenario whose
    #: library lacks one as not run, naming it, rather than as a failure of the adapter
    requires: tuple[str, ...] = ()
    _derived: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.args = tuple(self.args)
        if not callable(self.f):
            raise ArgumentTypeError(f"Scenario {self.name!r}: f must be callable, got {type(self.f).__name__}")
        floats = [a for a in pytree.tree_leaves(self.x) if _is_float_leaf(a)]
        if not floats:
            raise InvalidArgumentError(
                f"Scenario {self.name!r}: x has no float array leaf; use numpy float arrays "
                f"(np.asarray(v, dtype=np.float64)), not Python floats"
            )
        dtypes = {np.dtype(a.dtype).name for a in floats}
        if len(dtypes) != 1:
            raise InvalidArgumentError(
                f"Scenario {self.name!r}: float leaves of x mix dtypes {sorted(dtypes)}; use one dtype"
            )
        self.dtype: str = dtypes.pop()
        self._derive()
        if self.operators is not None:
            unknown = set(self.operators) - set(OPERATORS)
            if unknown:
                raise InvalidArgumentError(
                    f"Scenario {self.name!r}: unknown operators {sorted(unknown)}; known: {OPERATORS}"
                )
            missing = [op for op in self.operators if op not in self._available()]
            if missing:
                raise InvalidArgumentError(f"Scenario {self.name!r}: no reference result for operators {missing}")
            self.operators = tuple(op for op in OPERATORS if op in self.operators)
        else:
            self.operators = self._available()

    @property
    def id(self) -> str:
        """``name[dtype]``, the name used in reports."""
        return f"{self.name}[{self.dtype}]"

    @property
    def is_scalar_output(self) -> bool:
        return self.value is not None and np.ndim(self.value) == 0

    def reference(self, part: str) -> Any:
        """The reference result ``part`` ("value", "gradient", "pullback", ...)."""
        own = getattr(self, part)
        return own if own is not None else self._derived.get(part)

    # ------------------------------------------------------------------ internal
    def _float_paths(self) -> list[bool]:
        return [_is_float_leaf(a) for a in pytree.tree_leaves(self.x, none_is_leaf=True)]

    def _map_floats(self, fn: Callable[..., Any], *trees: Any) -> Any:
        """A tree like ``x``: ``fn(leaves...)`` at float leaves, None elsewhere."""
        leaves, treedef = pytree.tree_flatten(self.x, none_is_leaf=True)
        others = [treedef.flatten_up_to(t) for t in trees]
        out = [fn(*(o[i] for o in others)) if _is_float_leaf(a) else None for i, a in enumerate(leaves)]
        return pytree.tree_unflatten(treedef, out)

    def _derive(self) -> None:
        d = self._derived
        x_leaves = pytree.tree_leaves(self.x, none_is_leaf=True)
        if self.gradient is not None:
            if self.cotangent is None:
                self.cotangent = np.asarray(0.75, dtype=self.dtype)
            d["pullback"] = self._map_floats(lambda g: np.asarray(self.cotangent, np.float64) * g, self.gradient)
            if self.tangent is not None:
                d["pushforward"] = _tree_dot(self, self.gradient, self.tangent)
        if self.jacobian is not None and self.value is not None:
            ny = np.ndim(self.value)
            if self.cotangent is not None:
                cot = np.asarray(self.cotangent, np.float64)
                d["pullback"] = self._map_floats(lambda j: np.tensordot(cot, j, axes=ny), self.jacobian)
            if self.tangent is not None:
                total = np.zeros(np.shape(self.value))
                jl = pytree.tree_flatten(self.x, none_is_leaf=True)[1].flatten_up_to(self.jacobian)
                tl = pytree.tree_flatten(self.x, none_is_leaf=True)[1].flatten_up_to(self.tangent)
                for a, j, t in zip(x_leaves, jl, tl):
                    if _is_float_leaf(a):
                        total = total + np.tensordot(j, np.asarray(t, np.float64), axes=np.ndim(a))
                d["pushforward"] = total
        if self.hessian is not None and self.tangent is not None and _is_float_leaf(self.x):
            n = int(np.size(self.x))
            h = np.reshape(self.hessian, (n, n))
            d["hvp"] = np.reshape(h @ np.reshape(np.asarray(self.tangent, np.float64), n), np.shape(self.x))
        elif self.hessian is not None and self.tangent is not None:
            d["hvp"] = self._map_floats(lambda row: _block_product(self, row), self.hessian)

    def _available(self) -> tuple[str, ...]:
        ops = []
        have = {p: self.reference(p) is not None for p in ("gradient", "pullback", "pushforward", "hvp")}
        if have["gradient"]:
            ops.append("gradient")
            if self.value is not None:
                ops.append("value_and_gradient")
        if have["pullback"] and self.value is not None:
            ops.append("pullback")
        if have["pushforward"] and self.value is not None:
            ops.append("pushforward")
        if self.derivative is not None:
            ops.append("derivative")
        if self.second_derivative is not None:
            ops.append("second_derivative")
        if self.jacobian is not None:
            ops.append("jacobian")
        if self.hessian is not None:
            ops.append("hessian")
        if have["hvp"] and self.tangent is not None:
            ops.append("hvp")
        for op, parts in COMBINED.items():
            if op != "value_and_gradient" and all(self.reference(p) is not None for p in parts):
                ops.append(op)
        if "gradient_and_hvp" in ops and "hvp" not in ops:
            ops.remove("gradient_and_hvp")  # an hvp reference without a tangent to apply it to
        return tuple(op for op in OPERATORS if op in ops)


def _block_product(s: Scenario, row: Any) -> np.ndarray:
    """``sum_j H[i][j] . t_j``: one leaf of the Hessian-vector product from a row of blocks."""
    treedef = pytree.tree_flatten(s.x, none_is_leaf=True)[1]
    leaves = pytree.tree_leaves(s.x, none_is_leaf=True)
    total: Any = 0.0
    for leaf, block, t in zip(leaves, treedef.flatten_up_to(row), treedef.flatten_up_to(s.tangent)):
        if _is_float_leaf(leaf):
            total = total + np.tensordot(np.asarray(block, np.float64), np.asarray(t, np.float64), axes=np.ndim(leaf))
    return np.asarray(total)


def _tree_dot(s: Scenario, a: Any, b: Any) -> np.ndarray:
    treedef = pytree.tree_flatten(s.x, none_is_leaf=True)[1]
    total = 0.0
    leaves = pytree.tree_leaves(s.x, none_is_leaf=True)
    for leaf, u, v in zip(leaves, treedef.flatten_up_to(a), treedef.flatten_up_to(b)):
        if _is_float_leaf(leaf):
            total += float(np.sum(np.asarray(u, np.float64) * np.asarray(v, np.float64)))
    return np.asarray(total)


# --------------------------------------------------------------------------- builders
# Each builder takes a dtype name and returns a Scenario.  Inputs are drawn in float64
# and cast; references use the cast values upcast to float64 (``_up``).


def _ar() -> Any:
    from autoray import numpy as anp

    return anp


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _up(tree: Any) -> Any:
    return pytree.tree_map(lambda a: np.asarray(a, np.float64) if _is_float_leaf(a) else a, tree, none_is_leaf=True)


def _tangent_like(x: Any, rng: np.random.Generator) -> Any:
    """Random float leaves shaped like ``x``; non-float leaves kept as they are."""
    return pytree.tree_map(
        lambda a: rng.uniform(-1, 1, np.shape(a)).astype(a.dtype) if _is_float_leaf(a) else a, x, none_is_leaf=True
    )


def _scalar_input(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        return anp.sin(x) * x**2

    x = np.asarray(0.7, dtype=dt)
    u = float(x)
    d1 = math.cos(u) * u**2 + 2 * u * math.sin(u)
    d2 = (2 - u**2) * math.sin(u) + 4 * u * math.cos(u)
    t = np.asarray(-0.6, dtype=dt)
    return Scenario(
        "scalar_input", f, x, value=np.asarray(math.sin(u) * u**2), gradient=np.asarray(d1),
        derivative=np.asarray(d1), second_derivative=np.asarray(d2), jacobian=np.asarray(d1), hessian=np.asarray(d2),
        tangent=t,
        description="scalar x, scalar output: every operator",
    )


def _scalar_to_vector(dt: str) -> Scenario:
    anp = _ar()

    def f(x, c):
        return anp.sin(x) * c + x**2

    x = np.asarray(0.3, dtype=dt)
    c = np.asarray([1.0, -2.0, 0.5], dtype=dt)
    u, cu = float(x), _up(c)
    d = math.cos(u) * cu + 2 * u
    d2 = -math.sin(u) * cu + 2
    return Scenario(
        "scalar_to_vector", f, x, (c,), value=math.sin(u) * cu + u**2, derivative=d, second_derivative=d2, jacobian=d,
        tangent=np.asarray(1.3, dtype=dt), cotangent=np.asarray([0.2, -1.0, 0.7], dtype=dt),
        description="scalar x, vector output with data in args: derivative, jacobian",
    )


def _sum_squares(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        return anp.sum(x**2)

    rng = _rng(1)
    x = rng.uniform(-2, 2, 5).astype(dt)
    u = _up(x)
    return Scenario(
        "sum_squares", f, x, value=np.sum(u**2), gradient=2 * u, hessian=2 * np.eye(5),
        tangent=_tangent_like(x, rng), description="array x, polynomial",
    )


def _transcendental(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        return anp.sum(anp.exp(x) * anp.sin(x) + anp.log(1.0 + x**2) + anp.tanh(x) + anp.sqrt(1.0 + x**2))

    rng = _rng(2)
    x = rng.uniform(-1.5, 1.5, 6).astype(dt)
    u = _up(x)
    s = np.sqrt(1 + u**2)
    th = np.tanh(u)
    value = np.sum(np.exp(u) * np.sin(u) + np.log(1 + u**2) + th + s)
    grad = np.exp(u) * (np.sin(u) + np.cos(u)) + 2 * u / (1 + u**2) + (1 - th**2) + u / s
    hdiag = 2 * np.exp(u) * np.cos(u) + 2 * (1 - u**2) / (1 + u**2) ** 2 - 2 * th * (1 - th**2) + 1 / s**3
    return Scenario(
        "elementwise_transcendental", f, x, value=value, gradient=grad, hessian=np.diag(hdiag),
        tangent=_tangent_like(x, rng), description="exp, sin, log, tanh, sqrt",
    )


def _reductions(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        return anp.sum(anp.sum(x, axis=0) ** 2) + anp.mean(x**3) + anp.prod(1.0 + 0.1 * x)

    rng = _rng(3)
    x = rng.uniform(-1, 1, (3, 4)).astype(dt)
    u = _up(x)
    col = u.sum(axis=0)
    p = np.prod(1 + 0.1 * u)
    w = 1 / (1 + 0.1 * u)
    value = np.sum(col**2) + np.mean(u**3) + p
    grad = 2 * np.broadcast_to(col, u.shape) + 3 * u**2 / u.size + 0.1 * p * w
    wf = w.reshape(-1)
    h = 2 * np.kron(np.ones((3, 3)), np.eye(4)) + np.diag(6 * u.reshape(-1) / u.size)
    h += 0.01 * p * (np.outer(wf, wf) - np.diag(wf**2))
    return Scenario(
        "reductions", f, x, value=value, gradient=grad, hessian=h.reshape(3, 4, 3, 4),
        tangent=_tangent_like(x, rng), description="sum over an axis, mean, prod on a matrix",
    )


def _matmul(dt: str) -> Scenario:
    anp = _ar()

    def f(w, a, b):
        return anp.sum((a @ w - b) ** 2)

    rng = _rng(4)
    w = rng.uniform(-1, 1, (3, 2)).astype(dt)
    a = rng.uniform(-1, 1, (5, 3)).astype(dt)
    b = rng.uniform(-1, 1, (5, 2)).astype(dt)
    uw, ua, ub = _up(w), _up(a), _up(b)
    r = ua @ uw - ub
    gram = ua.T @ ua
    hess = 2 * np.einsum("ac,bd->abcd", gram, np.eye(2))
    return Scenario(
        "matmul_least_squares", f, w, (a, b), value=np.sum(r**2), gradient=2 * ua.T @ r, hessian=hess,
        tangent=_tangent_like(w, rng), description="matrix x, matmul with data in args",
    )


def _logsumexp(dt: str) -> Scenario:
    anp = _ar()

    def f(x, shift):
        z = x + shift
        m = anp.max(z)
        return m + anp.log(anp.sum(anp.exp(z - m))) - shift

    # A shift past log(finfo.max) makes the naive exp overflow: only the max-shifted
    # formula is finite, and its gradient must still be softmax(x).
    shift = np.asarray(math.floor(math.log(float(np.finfo(dt).max))) + 10.0, dtype=dt)
    rng = _rng(5)
    x = rng.uniform(-2, 2, 6).astype(dt)
    u = _up(x)
    p = np.exp(u - u.max()) / np.sum(np.exp(u - u.max()))
    value = u.max() + np.log(np.sum(np.exp(u - u.max())))
    return Scenario(
        "logsumexp", f, x, (shift,), value=value, gradient=p, hessian=np.diag(p) - np.outer(p, p),
        tangent=_tangent_like(x, rng), description="max-shifted logsumexp where the naive one overflows",
    )


def _mlp_grad(params: dict, xs: np.ndarray, ys: np.ndarray) -> tuple[Any, dict]:
    # Written with operations valid on complex arrays: the hvp reference is the complex
    # step of this gradient (exact to rounding for analytic functions).
    w1, b1 = params["hidden"]["w"], params["hidden"]["b"]
    w2, b2 = params["out"]["w"], params["out"]["b"]
    h = np.tanh(xs @ w1 + b1)
    out = h @ w2 + b2
    r = out - ys
    loss = np.sum(r**2) / r.size
    dout = 2 * r / r.size
    dz = (dout @ w2.T) * (1 - h**2)
    grads = {"hidden": {"w": xs.T @ dz, "b": dz.sum(axis=0)}, "out": {"w": h.T @ dout, "b": dout.sum(axis=0)}}
    return loss, grads


def _mlp(dt: str) -> Scenario:
    anp = _ar()

    def f(params, xs, ys):
        h = anp.tanh(xs @ params["hidden"]["w"] + params["hidden"]["b"])
        out = h @ params["out"]["w"] + params["out"]["b"]
        return anp.mean((out - ys) ** 2)

    rng = _rng(6)
    params = {
        "hidden": {"w": rng.normal(0, 0.7, (3, 4)).astype(dt), "b": rng.normal(0, 0.1, 4).astype(dt)},
        "out": {"w": rng.normal(0, 0.7, (4, 2)).astype(dt), "b": rng.normal(0, 0.1, 2).astype(dt)},
    }
    xs = rng.normal(0, 1, (8, 3)).astype(dt)
    ys = rng.normal(0, 1, (8, 2)).astype(dt)
    tangent = _tangent_like(params, rng)
    up, uxs, uys = _up(params), _up(xs), _up(ys)
    loss, grads = _mlp_grad(up, uxs, uys)
    step = 1e-30
    moved = pytree.tree_map(lambda p, t: p + 1j * step * np.asarray(t, np.float64), up, tangent)
    hvp = pytree.tree_map(lambda g: np.imag(g) / step, _mlp_grad(moved, uxs, uys)[1])
    return Scenario(
        "mlp_loss", f, params, (xs, ys), value=loss, gradient=grads, hvp=hvp, tangent=tangent,
        description="two-layer tanh MLP, mean squared error, nested dict parameters",
    )


def _pytree_mixed(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        a, (b, p) = x["a"], x["b"]
        t = anp.take(a, x["index"], axis=0)
        return anp.sum(a**p) / p + anp.sum(t) * anp.sum(anp.sin(b))

    rng = _rng(7)
    x = {
        "a": rng.uniform(0.5, 1.5, 3).astype(dt),
        "b": (rng.uniform(-1, 1, (2, 2)).astype(dt), 3),
        "index": np.array([2, 0, 2], dtype=np.int64),
        "nothing": None,
        "unused": rng.uniform(-1, 1, 2).astype(dt),
    }
    a, b, p = _up(x["a"]), _up(x["b"][0]), 3
    count = np.bincount(x["index"], minlength=3).astype(np.float64)
    tsum, ssum = np.sum(a[x["index"]]), np.sum(np.sin(b))
    grad = {"a": a ** (p - 1) + ssum * count, "b": (tsum * np.cos(b), None), "index": None, "nothing": None,
            "unused": np.zeros(2)}
    tangent = _tangent_like(x, rng)
    va, vb = _up(tangent["a"]), _up(tangent["b"][0])
    hvp = {
        "a": (p - 1) * a ** (p - 2) * va + count * np.sum(np.cos(b) * vb),
        "b": (np.cos(b) * np.sum(count * va) - tsum * np.sin(b) * vb, None),
        "index": None, "nothing": None, "unused": np.zeros(2),
    }
    return Scenario(
        "pytree_mixed", f, x, value=np.sum(a**p) / p + tsum * ssum, gradient=grad, hvp=hvp, tangent=tangent,
        description="dict/tuple pytree with an int leaf, an int array, None and an unused float leaf",
    )


def _nested_tuple(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        u, (c, w) = x[0], x[1]
        return c * anp.sum(u**2) + anp.sum(anp.exp(w)) * c**2

    rng = _rng(8)
    x = (rng.uniform(-1, 1, 3).astype(dt), [np.asarray(0.8, dtype=dt), rng.uniform(-1, 1, 2).astype(dt)])
    u, c, w = _up(x[0]), float(x[1][0]), _up(x[1][1])
    ew = np.exp(w)
    tangent = _tangent_like(x, rng)
    tu, tc, tw = _up(tangent[0]), float(tangent[1][0]), _up(tangent[1][1])
    grad = (2 * c * u, [np.asarray(np.sum(u**2) + 2 * c * np.sum(ew)), c**2 * ew])
    hvp = (
        2 * c * tu + 2 * u * tc,
        [
            np.asarray(2 * np.sum(u * tu) + 2 * np.sum(ew) * tc + 2 * c * np.sum(ew * tw)),
            2 * c * ew * tc + c**2 * ew * tw,
        ],
    )
    return Scenario(
        "nested_tuple", f, x, value=c * np.sum(u**2) + np.sum(ew) * c**2, gradient=grad, hvp=hvp, tangent=tangent,
        description="tuple holding a list with a 0-d leaf: mixed second derivatives",
    )


def _unconnected_vector(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        return anp.tanh(x["used"]) * 2.0

    rng = _rng(9)
    x = {"used": rng.uniform(-1, 1, 3).astype(dt), "unused": rng.uniform(-1, 1, 2).astype(dt)}
    u = _up(x["used"])
    jac = {"used": np.diag(2 * (1 - np.tanh(u) ** 2)), "unused": np.zeros((3, 2))}
    return Scenario(
        "unconnected_vector", f, x, value=2 * np.tanh(u), jacobian=jac, tangent=_tangent_like(x, rng),
        cotangent=rng.uniform(-1, 1, 3).astype(dt), description="vector output; one leaf does not affect it (zeros)",
    )


def _vector_output(dt: str) -> Scenario:
    anp = _ar()

    def f(x, a):
        return anp.sum(a * anp.tanh(x), axis=1) + x[0] * x[2]

    rng = _rng(10)
    x = rng.uniform(-1, 1, 3).astype(dt)
    a = rng.uniform(-1, 1, (4, 3)).astype(dt)
    u, ua = _up(x), _up(a)
    jac = ua * (1 - np.tanh(u) ** 2)
    jac[:, 0] += u[2]
    jac[:, 2] += u[0]
    return Scenario(
        "vector_output", f, x, (a,), value=np.sum(ua * np.tanh(u), axis=1) + u[0] * u[2], jacobian=jac,
        tangent=_tangent_like(x, rng), cotangent=rng.uniform(-1, 1, 4).astype(dt),
        description="R^3 -> R^4 with broadcasting and indexing",
    )


def _matrix_output(dt: str) -> Scenario:
    anp = _ar()

    def f(w, a):
        return anp.sin(a @ w)

    rng = _rng(11)
    w = rng.uniform(-1, 1, (3, 2)).astype(dt)
    a = rng.uniform(-1, 1, (4, 3)).astype(dt)
    uw, ua = _up(w), _up(a)
    z = ua @ uw
    jac = np.einsum("ik,ia,kb->ikab", np.cos(z), ua, np.eye(2))
    return Scenario(
        "matrix_output", f, w, (a,), value=np.sin(z), jacobian=jac, tangent=_tangent_like(w, rng),
        cotangent=rng.uniform(-1, 1, (4, 2)).astype(dt), description="matrix -> matrix through matmul",
    )


def _rosenbrock(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        return anp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)

    rng = _rng(12)
    x = rng.uniform(-1.2, 1.2, 4).astype(dt)
    u = _up(x)
    n = u.size
    value = np.sum(100 * (u[1:] - u[:-1] ** 2) ** 2 + (1 - u[:-1]) ** 2)
    g = np.zeros(n)
    g[:-1] += -400 * u[:-1] * (u[1:] - u[:-1] ** 2) - 2 * (1 - u[:-1])
    g[1:] += 200 * (u[1:] - u[:-1] ** 2)
    h = np.zeros((n, n))
    for i in range(n):
        if i < n - 1:
            h[i, i] += 1200 * u[i] ** 2 - 400 * u[i + 1] + 2
            h[i, i + 1] = h[i + 1, i] = -400 * u[i]
        if i > 0:
            h[i, i] += 200
    return Scenario(
        "rosenbrock", f, x, value=value, gradient=g, hessian=h, tangent=_tangent_like(x, rng),
        description="second order with off-diagonal Hessian terms and slicing",
    )


def _pytree_hessian(dt: str) -> Scenario:
    anp = _ar()

    def f(x):
        m, v = x["m"], x["v"]
        r = anp.sum(m * v, axis=1)  # m @ v, written so that every backend broadcasts it the same way
        return 0.5 * anp.sum(r**2) + anp.sum(m**3) / 3.0 + x["k"] * anp.sum(anp.exp(v))

    rng = _rng(13)
    x = {"m": rng.uniform(-1, 1, (2, 3)).astype(dt), "v": rng.uniform(-1, 1, 3).astype(dt), "k": 2}
    m, v, k = _up(x["m"]), _up(x["v"]), x["k"]
    r = m @ v
    ev = np.exp(v)
    grad = {"m": np.outer(r, v) + m**2, "v": m.T @ r + k * ev, "k": None}
    # d2f/dm_ab dm_cd = delta_ac v_b v_d + 2 m_ab delta_ac delta_bd, d2f/dm_ab dv_d = m_ad v_b + r_a delta_bd
    h_mm = np.einsum("ac,bd->abcd", np.eye(2), np.outer(v, v))
    h_mm += np.einsum("ab,ac,bd->abcd", 2 * m, np.eye(2), np.eye(3))
    h_mv = np.einsum("ad,b->abd", m, v) + np.einsum("a,bd->abd", r, np.eye(3))
    hess = {
        "m": {"m": h_mm, "v": h_mv, "k": None},
        "v": {"m": np.transpose(h_mv, (2, 0, 1)), "v": m.T @ m + np.diag(k * ev), "k": None},
        "k": None,
    }
    return Scenario(
        "pytree_hessian", f, x, value=0.5 * np.sum(r**2) + np.sum(m**3) / 3 + k * np.sum(ev), gradient=grad,
        hessian=hess, tangent=_tangent_like(x, rng),
        description="block Hessian of a (2, 3) matrix and a (3,) vector leaf, with an int leaf (None blocks)",
    )


# ------------------------------------------------------------------- linear algebra
# Nonlinear scalar losses at n >= 4: a cotangent that depends on the solution, and sizes past
# 3x3, are where libraries' linear-algebra derivatives have been wrong (paddle's triangular
# solve, MLX's det and slogdet past n = 3).  The gradients are closed forms; the
# Hessian-vector products are complex steps of them (every formula below is analytic,
# so its complex step is exact to rounding, as in _mlp).


def _spd(b: np.ndarray) -> np.ndarray:
    """``B B^T + n I``: symmetric positive definite for any ``B``."""
    return b @ b.T + len(b) * np.eye(len(b))


def _complex_step(grad: Callable[[np.ndarray], Any], x: Any, tangent: Any) -> Any:
    """``H t`` from a closed-form gradient written with analytic operations only."""
    step = 1e-30
    moved = pytree.tree_map(lambda a, t: np.asarray(a, np.float64) + 1j * step * np.asarray(t, np.float64),
                            x, tangent)
    return pytree.tree_map(lambda g: np.imag(g) / step, grad(moved))


def _cholesky_analytic(a: np.ndarray) -> np.ndarray:
    """Cholesky without conjugation (numpy's conjugates complex input): analytic, for the complex step."""
    n = len(a)
    lower = np.zeros_like(a)
    for j in range(n):
        lower[j, j] = np.sqrt(a[j, j] - np.sum(lower[j, :j] ** 2))
        for i in range(j + 1, n):
            lower[i, j] = (a[i, j] - np.sum(lower[i, :j] * lower[j, :j])) / lower[j, j]
    return lower


def _cholesky_sin_grad(b: np.ndarray) -> np.ndarray:
    """d sum(sin(L)) / dB for L = cholesky(B B^T + n I) (Murray 2016, eq. 10, through A = B B^T + n I)."""
    lower = _cholesky_analytic(_spd(b))
    bar_l = np.tril(np.cos(lower))  # L's upper triangle is constant zero: no cotangent
    phi = np.tril(lower.T @ bar_l)
    phi[np.diag_indices(len(b))] *= 0.5
    inv = np.linalg.inv(lower)
    bar_a = inv.T @ phi @ inv
    return (bar_a + bar_a.T) @ b  # dA = dB B^T + B dB^T: the symmetric part, twice


def _spd_factor(dt: str, seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(B, n I, B in float64, a tangent)``: the input of a scenario on the SPD matrix B B^T + n I."""
    rng = _rng(seed)
    b = rng.uniform(-1, 1, (n, n)).astype(dt)
    return b, (n * np.eye(n)).astype(dt), _up(b), _tangent_like(b, rng)


def _cholesky(dt: str) -> Scenario:
    anp = _ar()

    def f(b, shift):
        return anp.sum(anp.sin(anp.linalg.cholesky(b @ anp.transpose(b) + shift)))

    b, shift, ub, tangent = _spd_factor(dt, seed=14, n=4)
    return Scenario(
        "cholesky_sin", f, b, (shift,), value=np.sum(np.sin(np.linalg.cholesky(_spd(ub)))),
        gradient=_cholesky_sin_grad(ub), hvp=_complex_step(_cholesky_sin_grad, ub, tangent), tangent=tangent,
        description="sum(sin(cholesky(B B^T + n I))), n = 4: a cotangent that depends on L",
        requires=("linalg.cholesky",),
    )


def _triangular_grad(x: dict) -> dict:
    """d sum(X**2) for X = solve_triangular(tril(L), B, lower=True): dB = L^{-T} 2X, dL = -tril(dB X^T)."""
    lower = np.tril(x["l"])
    sol = np.linalg.solve(lower, x["b"])
    bar_b = np.linalg.solve(lower.T, 2 * sol)
    return {"l": -np.tril(bar_b @ sol.T), "b": bar_b}


def _triangular_solve(dt: str) -> Scenario:
    anp = _ar()
    from autoray import do

    def f(x):
        sol = do("linalg.solve_triangular", anp.tril(x["l"]), x["b"], lower=True)  # a portable name
        return anp.sum(sol**2)

    rng = _rng(15)
    n = 4
    x = {"l": (np.tril(rng.uniform(-0.5, 0.5, (n, n))) + 1.5 * np.eye(n)).astype(dt),
         "b": rng.uniform(-1, 1, (n, 3)).astype(dt)}
    u = _up(x)
    tangent = _tangent_like(x, rng)
    sol = np.linalg.solve(np.tril(u["l"]), u["b"])
    return Scenario(
        "triangular_solve_squares", f, x, value=np.sum(sol**2), gradient=_triangular_grad(u),
        hvp=_complex_step(_triangular_grad, u, tangent), tangent=tangent,
        description="sum(solve_triangular(L, B, lower=True)**2), n = 4, with respect to L and B",
        requires=("tril", "linalg.solve_triangular"),
    )


def _slogdet_grad(b: np.ndarray) -> np.ndarray:
    """d logdet(A) / dB = 2 A^{-1} B for A = B B^T + n I (d logdet(A) / dA = A^{-T}, A symmetric)."""
    return 2 * np.linalg.solve(_spd(b), b)


def _slogdet(dt: str) -> Scenario:
    anp = _ar()

    def f(b, shift):
        return anp.linalg.slogdet(b @ anp.transpose(b) + shift)[1]

    b, shift, ub, tangent = _spd_factor(dt, seed=16, n=5)
    return Scenario(
        "slogdet_spd", f, b, (shift,), value=np.linalg.slogdet(_spd(ub))[1], gradient=_slogdet_grad(ub),
        hvp=_complex_step(_slogdet_grad, ub, tangent), tangent=tangent,
        description="log|det(B B^T + n I)|, n = 5",
        requires=("linalg.slogdet",),
    )


_BUILDERS: tuple[Callable[[str], Scenario], ...] = (
    _scalar_input,
    _scalar_to_vector,
    _sum_squares,
    _transcendental,
    _reductions,
    _matmul,
    _logsumexp,
    _mlp,
    _pytree_mixed,
    _nested_tuple,
    _unconnected_vector,
    _vector_output,
    _matrix_output,
    _rosenbrock,
    _pytree_hessian,
    _cholesky,
    _triangular_solve,
    _slogdet,
)

DTYPES: tuple[str, ...] = ("float64", "float32")


_CACHE: Memo = Memo(name="testing: default scenarios", keyed_on="dtype")


def _family(dtypes: str | Sequence[str], cache: dict, build: Callable[[str], list]) -> list[Scenario]:
    """A scenario family's scenarios for ``dtypes`` (a name or several), each dtype's list
    made by ``build(dtype)`` once per process and kept in ``cache``: compiling backends (jax,
    tensorflow) cache their traces per function object, so reusing the scenarios' functions
    makes a second check cheap."""
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    for dt in dtypes:
        if dt not in DTYPES:
            raise InvalidArgumentError(f"unsupported scenario dtype {dt!r}; choose from {DTYPES}")
    out = []
    for dt in dtypes:
        if dt not in cache:
            cache[dt] = build(dt)
        out.extend(cache[dt])
    return out


def default_scenarios(dtypes: str | Sequence[str] = DTYPES, names: Sequence[str] | None = None) -> list[Scenario]:
    """The built-in scenarios, one per (definition, dtype).

    ``default_scenarios(dtypes=("float64", "float32"), names=None) -> list[Scenario]``;
    ``names`` selects scenarios by their base name.  The scenario objects are built
    once per process and shared (treat them as read-only).

    Example:
        >>> [s.id for s in default_scenarios("float32", names=["rosenbrock"])]
        ['rosenbrock[float32]']
    """
    out = _family(dtypes, _CACHE, lambda dt: [build(dt) for build in _BUILDERS])
    if names is not None:
        known = {s.name for s in out}
        unknown = sorted(set(names) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown scenario names {unknown}; known: {sorted(known)}")
        out = [s for s in out if s.name in names]
    return out


def scenario_names() -> list[str]:
    """Base names of the built-in scenarios: ``scenario_names() -> list[str]``.

    Example:
        >>> from abstractdiff import testing
        >>> "rosenbrock" in testing.scenario_names()
        True
    """
    return [s.name for s in default_scenarios("float64")]


# ------------------------------------------------------------------- switching family
@dataclass(eq=False)
class Switching:
    """One function object called in sequence at several input signatures.

    ``Switching(name, steps)``: every step is a :class:`Scenario` with the *same* ``f``
    (float64, then float32, then float64 again, then a new shape), so a cache that keys
    on the function alone, forgetting the dtype, the shape or the backend's options,
    returns a wrong value or dtype at some step.  :func:`check_backend` runs every
    operator and every prepared operator at every step, in order.
    """

    name: str
    steps: list[Scenario]
    description: str = ""

    def __post_init__(self) -> None:
        if len({id(s.f) for s in self.steps}) != 1:
            raise InvalidArgumentError(f"Switching {self.name!r}: every step must share one function object")


def _sech2(u: np.ndarray) -> np.ndarray:
    return 1.0 - np.tanh(u) ** 2


def _poly_tanh(f: Callable[..., Any], dt: str, n: int, seed: int) -> Scenario:
    rng = _rng(seed)
    x = rng.uniform(-1, 1, n).astype(dt)
    u = _up(x)
    s = float(np.sum(u**2))
    t, q = np.tanh(u), _sech2(u)
    value = np.sum(u**2 * t) + 0.25 * s**2
    grad = 2 * u * t + u**2 * q + s * u
    hess = np.diag(2 * t + 4 * u * q - 2 * u**2 * q * t + s) + 2 * np.outer(u, u)
    return Scenario(
        "switching_poly_tanh", f, x, value=value, gradient=grad, jacobian=grad, hessian=hess,
        tangent=_tangent_like(x, rng), description="sum(x^2 tanh x) + (sum x^2)^2 / 4",
    )


def _elementwise(f: Callable[..., Any], dt: str, n: int, seed: int) -> Scenario:
    rng = _rng(seed)
    x = rng.uniform(-1, 1, n).astype(dt)
    c = rng.uniform(-2, 2, n).astype(dt)
    u, cu = _up(x), _up(c)
    return Scenario(
        "switching_elementwise", f, x, (c,), value=np.sin(u) * cu + u**2, jacobian=np.diag(np.cos(u) * cu + 2 * u),
        tangent=_tangent_like(x, rng), cotangent=rng.uniform(-1, 1, n).astype(dt),
        description="sin(x) * c + x^2 with data in args: jacobian, pullback, pushforward",
    )


def _scalar_switch(f: Callable[..., Any], dt: str, value: float) -> Scenario:
    x = np.asarray(value, dtype=dt)
    u = float(x)
    d1 = math.cos(u) * u**2 + 2 * u * math.sin(u)
    d2 = (2 - u**2) * math.sin(u) + 4 * u * math.cos(u)
    return Scenario(
        "switching_scalar", f, x, value=np.asarray(math.sin(u) * u**2), gradient=np.asarray(d1),
        derivative=np.asarray(d1), second_derivative=np.asarray(d2), jacobian=np.asarray(d1), hessian=np.asarray(d2),
        tangent=np.asarray(0.5, dtype=dt), description="scalar x: derivative and every other operator",
    )


#: (dtype, size) of the steps: float64, float32, float64 again, then a new shape.
SWITCHING_STEPS: tuple[tuple[str, int], ...] = (("float64", 4), ("float32", 4), ("float64", 4), ("float64", 6))


def switching_scenarios() -> list[Switching]:
    """The switching family: each entry one function object, called at every step of
    :data:`SWITCHING_STEPS` (a scalar ``x`` cannot change shape: its steps change dtype and value).

    ``switching_scenarios() -> list[Switching]``; fresh function objects on every call, so
    that one check never sees another's caches.

    Example:
        >>> [(s.name, len(s.steps)) for s in switching_scenarios()]
        [('switching_poly_tanh', 4), ('switching_elementwise', 4), ('switching_scalar', 4)]
    """
    anp = _ar()

    def poly_tanh(x):
        s2 = anp.sum(x * x)
        return anp.sum(x * x * anp.tanh(x)) + 0.25 * s2 * s2

    def elementwise(x, c):
        return anp.sin(x) * c + x**2

    def scalar(x):
        return anp.sin(x) * x**2

    families = [
        Switching("switching_poly_tanh", [_poly_tanh(poly_tanh, dt, n, 11 + i) for i, (dt, n) in
                                          enumerate(SWITCHING_STEPS)]),
        Switching("switching_elementwise", [_elementwise(elementwise, dt, n, 21 + i) for i, (dt, n) in
                                            enumerate(SWITCHING_STEPS)]),
        Switching("switching_scalar", [_scalar_switch(scalar, dt, 0.4 + 0.1 * i) for i, (dt, _) in
                                       enumerate(SWITCHING_STEPS)]),
    ]
    for family in families:  # one report row per step: switching_poly_tanh@2[float64]...
        for i, step in enumerate(family.steps):
            step.name = f"{family.name}@{i}"
    return families

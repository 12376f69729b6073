"""Hypothesis strategies for the property-based net (``tests/test_properties.py``).

A :class:`Case` is one differentiation problem drawn by Hypothesis: a pytree ``x`` of float
arrays (0-d to 3-d, contiguous or not) and int leaves, data arguments, a static Python
float, and a function ``f(x, c, d)`` written as the source of a lambda over the portable
``autoray.numpy`` calls.  The function is kept as source so that a failing example prints
as code that reproduces it, and so that "a freshly defined but identical function" is the
same source evaluated again.  Each case carries several input sets of the same form (the
first call's, a second call's with other data and statics, a second call's with the same
statics) so that the tests can check caches against fresh calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from autoray import numpy as anp
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

FLOAT_DTYPES = ("float32", "float64")
# How a float leaf is laid out in memory: the finite-difference oracle and the adapters'
# conversions have mishandled each of the non-contiguous ones.
LAYOUTS = ("contiguous", "transposed", "reversed", "strided", "broadcast")
UNARY = ("sin", "exp", "tanh", "square", "leaky", "maximum", "data")
REDUCTIONS = ("sum", "mean", "sum_axis", "transpose", "take")
SCALES = ("one", "static", "int_leaf")
#: Kinks of the piecewise functions: where(E > 0, ...) at 0, maximum(E, 0.1) at 0.1.  A drawn
#: point this close to one is rejected: derivatives there are conventions, not facts.
KINK_MARGIN = 0.05
#: Intermediate values above this are rejected (exp of exp): the float32 oracle loses them.
MAX_MAGNITUDE = 30.0


# ------------------------------------------------------------------ the function
def _expr_src(e: tuple, a: str) -> str:
    """Source of the elementwise expression ``e`` applied to the array expression ``a``."""
    op = e[0]
    if op == "a":
        return a
    if op == "mul":
        return f"({_expr_src(e[1], a)} * {_expr_src(e[2], a)})"
    inner = _expr_src(e[1], a)
    if op == "square":
        return f"({inner} ** 2)"
    if op == "leaky":
        return f"anp.where({inner} > 0, {inner}, 0.3 * {inner})"
    if op == "maximum":
        return f"anp.maximum({inner}, 0.1)"
    if op == "data":
        return f"({inner} * d[{e[2]!r}])"
    return f"anp.{op}({inner})"


def _expr_numpy(e: tuple, a: np.ndarray, d: dict, watch: list) -> np.ndarray:
    """``e`` evaluated in float64 numpy, appending to ``watch`` each distance to a kink and magnitude."""
    op = e[0]
    if op == "a":
        out = a
    elif op == "mul":
        out = _expr_numpy(e[1], a, d, watch) * _expr_numpy(e[2], a, d, watch)
    else:
        v = _expr_numpy(e[1], a, d, watch)
        if op == "leaky":
            watch.append(("kink", np.min(np.abs(v), initial=np.inf)))
            out = np.where(v > 0, v, 0.3 * v)
        elif op == "maximum":
            watch.append(("kink", np.min(np.abs(v - 0.1), initial=np.inf)))
            out = np.maximum(v, 0.1)
        elif op == "data":
            out = v * d[e[2]]
        elif op == "square":
            out = v**2
        else:
            out = getattr(np, op)(v)
    watch.append(("size", np.max(np.abs(out), initial=0.0)))
    return out


@dataclass
class Term:
    """One leaf's contribution: a reduction of an elementwise expression of the leaf, scaled."""

    path: tuple
    expr: tuple
    reduction: str
    axis: int = 0
    index: str = ""  # source of the int index array ``take`` uses
    scale: str = ""  # source of the scale factor ("" for none)

    def array_src(self) -> str:
        return _expr_src(self.expr, _path_src(self.path))

    def scalar_src(self) -> str:
        e = self.array_src()
        if self.reduction == "mean":
            r = f"anp.mean({e})"
        elif self.reduction == "sum_axis":
            r = f"anp.sum(anp.sum({e}, axis={self.axis}))"
        elif self.reduction == "transpose":
            r = f"anp.sum(anp.transpose({e}) * d['t{id_of(self.path)}'])"
        elif self.reduction == "take":
            r = f"anp.sum(anp.take(anp.reshape({e}, (-1,)), {self.index}, axis=0))"
        else:
            r = f"anp.sum({e})"
        return f"{r} * {self.scale}" if self.scale else r

    def vector_src(self) -> str:
        flat = f"anp.reshape({self.array_src()}, (-1,))"
        return f"anp.take({flat}, {self.index}, axis=0)" if self.reduction == "take" else flat


def id_of(path: tuple) -> str:
    return "_".join(str(k) for k in path) or "root"


# --------------------------------------------------------------------- the case
@dataclass
class Inputs:
    """One call's arguments: ``f(x, c, d)``."""

    x: Any
    c: float
    d: dict


@dataclass
class Case:
    """One drawn problem; ``repr`` prints code that reproduces it."""

    dtype: str
    skeleton: Any  # x with a LeafSpec at each leaf
    terms: list
    vector: bool  # f returns a 1-d array (jacobian, pullback) rather than a scalar
    first: Inputs | None
    second: Inputs | None  # other values of everything, statics included
    same_static: Inputs | None  # other array values, the same statics (what a prepared operator accepts)
    tangent: Any  # v for hvp, shaped like x (its int leaves are filled in per call by tangent_for)
    cotangent: np.ndarray  # dy for pullback, shaped like f's output

    @property
    def source(self) -> str:
        if self.vector:
            head, rest = self.terms[0], self.terms[1:]
            body = head.vector_src()
            if rest:
                body = f"{body} * ({' + '.join(t.scalar_src() for t in rest)})"
            body = f"{body} * c"
        else:
            parts = [t.scalar_src() for t in self.terms]
            if len(self.terms) >= 2:  # a product of two leaves' terms: mixed second derivatives
                parts.append(f"{self.terms[0].scalar_src()} * {self.terms[1].scalar_src()}")
            body = " + ".join(parts)
        return f"lambda x, c, d: {body}"

    def tangent_for(self, inp: Inputs) -> Any:
        """``v`` for a call with ``inp``: the drawn float leaves, ``inp.x``'s other leaves."""
        return _map(self.skeleton, lambda p, s: _get(self.tangent, p) if s.kind == "float" else _get(inp.x, p))

    def function(self):
        """A freshly defined ``f``: a new function object on every call."""
        return eval(self.source, {"anp": anp})  # noqa: S307 - our own generated source

    def _repr_pretty_(self, p, cycle) -> None:  # how Hypothesis prints a failing example
        p.text(repr(self))

    def __repr__(self) -> str:
        def show(inp: Inputs) -> str:
            return f"x={_tree_src(inp.x)}, c={inp.c!r}, d={_tree_src(inp.d)}"

        return (
            f"\n  f = {self.source}\n  first:  {show(self.first)}\n  second: {show(self.second)}"
            f"\n  same_static: {show(self.same_static)}\n  v={_tree_src(self.tangent_for(self.first))}"
            f"\n  dy={_tree_src(self.cotangent)}\n"
        )


def _array_src(a: np.ndarray) -> str:
    """``a`` as code that rebuilds it, layout included."""
    vals = np.array2string(np.array(a, order="C"), separator=", ", precision=17, threshold=10**6).replace("\n", "")
    dt = f"np.{a.dtype}"
    if a.ndim == 0 or a.flags.c_contiguous and a.base is None:
        return f"np.array({vals}, {dt})"
    if a.strides and 0 in a.strides:
        return f"np.broadcast_to(np.array({vals}, {dt})[:1], {a.shape})"
    if a.flags.f_contiguous and a.ndim >= 2:
        return f"np.ascontiguousarray(np.array({vals}, {dt}).T).T"
    if a.strides[0] < 0:
        return f"np.array({vals}, {dt})[::-1].copy()[::-1]"
    return f"np.repeat(np.array({vals}, {dt}), 2, axis=-1)[..., ::2]"


def _tree_src(t: Any) -> str:
    if isinstance(t, np.ndarray):
        return _array_src(t)
    if isinstance(t, dict):
        return "{" + ", ".join(f"{k!r}: {_tree_src(v)}" for k, v in t.items()) + "}"
    if isinstance(t, list):
        return "[" + ", ".join(_tree_src(v) for v in t) + "]"
    if isinstance(t, tuple):
        return "(" + "".join(_tree_src(v) + ", " for v in t) + ")"
    return repr(t)


# ------------------------------------------------------------------ pytrees
@dataclass(frozen=True)
class LeafSpec:
    kind: str  # "float" (differentiated), "int" (a static Python int), "index" (an int64 array)
    shape: tuple = ()
    layout: str = "contiguous"


def _float_leaf() -> st.SearchStrategy:
    return st.builds(
        LeafSpec, st.just("float"), hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3),
        # zero-size x (which hung MLX, issue 24 item 7) is tested by each adapter's own tests
        st.sampled_from(LAYOUTS),
    )


def _leaf() -> st.SearchStrategy:
    others = st.builds(LeafSpec, st.sampled_from(("int", "index")), st.tuples(st.integers(1, 3)))
    return st.one_of(_float_leaf(), _float_leaf(), others)


def _container(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.dictionaries(st.sampled_from(("a", "b", "c")), children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3).map(tuple),
    )


def skeletons() -> st.SearchStrategy:
    """Pytrees of depth at most 2 with at least one float leaf."""
    depth1 = _container(_leaf())
    depth2 = _container(st.one_of(_leaf(), depth1))
    return st.one_of(_float_leaf(), depth1, depth2).filter(lambda t: any(s.kind == "float" for _, s in _leaves(t)))


def leaf_specs(skeleton: Any) -> list:
    """``[(path, LeafSpec)]`` of a skeleton, in order."""
    return _leaves(skeleton)


def leaf_at(tree: Any, path: tuple) -> Any:
    return _get(tree, path)


def _leaves(t: Any, path: tuple = ()) -> list:
    if isinstance(t, LeafSpec):
        return [(path, t)]
    items = t.items() if isinstance(t, dict) else enumerate(t)
    return [leaf for k, v in items for leaf in _leaves(v, (*path, k))]


def _map(t: Any, fn, path: tuple = ()) -> Any:
    if isinstance(t, LeafSpec):
        return fn(path, t)
    if isinstance(t, dict):
        return {k: _map(v, fn, (*path, k)) for k, v in t.items()}
    out = [_map(v, fn, (*path, i)) for i, v in enumerate(t)]
    return tuple(out) if isinstance(t, tuple) else out


# --------------------------------------------------------------- array values
def _values(draw, shape: tuple, dtype: str) -> np.ndarray:
    width = 32 if dtype == "float32" else 64
    # zero, or at least 1e-8 in magnitude: products of the functions' few factors then stay far
    # from the subnormal range, where no finite-difference step resolves a derivative (the
    # oracle refuses with FiniteDifferenceAccuracyError, rightly, and has nothing to compare)
    elements = st.floats(-1.5, 1.5, width=width, allow_subnormal=False).map(lambda v: 0.0 if abs(v) < 1e-8 else v)
    return draw(hnp.arrays(np.dtype(dtype), shape, elements=elements))


def _laid_out(values: np.ndarray, layout: str) -> np.ndarray:
    """An array equal to ``values`` (broadcast: to its first row) in the given memory layout."""
    if values.ndim == 0 or layout == "contiguous":
        return values.copy()
    if layout == "transposed":
        return np.ascontiguousarray(values.T).T
    if layout == "reversed":
        return values[::-1].copy()[::-1]
    if layout == "strided":
        return np.repeat(values, 2, axis=-1)[..., ::2]
    return np.broadcast_to(values[:1], values.shape)


def _index(draw, length: int, bound: int) -> np.ndarray:
    return np.array(draw(st.lists(st.integers(0, bound - 1), min_size=length, max_size=length)), dtype=np.int64)


# ---------------------------------------------------------------------- cases
def _expressions(data_keys: list) -> st.SearchStrategy:
    def extend(inner):
        unary = st.tuples(st.sampled_from(UNARY[:-1]), inner)
        options = [unary, st.tuples(st.just("mul"), inner, inner)]
        if data_keys:
            options.append(st.tuples(st.just("data"), inner, st.sampled_from(data_keys)))
        return st.one_of(*options)

    return st.recursive(st.just(("a",)), extend, max_leaves=3)


def _path_src(path: tuple) -> str:
    return "x" + "".join(f"[{k!r}]" for k in path)


def _draw_term(draw, path: tuple, spec: LeafSpec, leaves: list, data_specs: dict) -> Term:
    """One leaf's term; the data arguments it needs are added to ``data_specs``
    (key -> ``("w", shape)`` for a float array, ``("i", (length, bound))`` for an index array)."""
    name = id_of(path)
    data_specs[f"w{name}"] = ("w", spec.shape)
    expr = draw(_expressions([f"w{name}"]))
    reduction = draw(st.sampled_from(REDUCTIONS))
    if reduction in ("sum_axis", "transpose") and not spec.shape:
        # new, not abstractdiff's: autoray's torch transpose of a 0-d tensor raises TypeError
        # (``x.permute()`` with no dims); and a 0-d has no axis to sum over
        reduction = "sum"
    axis = draw(st.integers(0, len(spec.shape) - 1)) if reduction == "sum_axis" else 0
    if reduction == "transpose":
        data_specs[f"t{name}"] = ("w", spec.shape[::-1])
    index = ""
    if reduction == "take":
        x_indices = [p for p, s in leaves if s.kind == "index"]
        if x_indices and draw(st.booleans()):  # an int array leaf of x as the index
            index = _path_src(draw(st.sampled_from(x_indices)))
        else:
            data_specs[f"i{name}"] = ("i", (draw(st.integers(1, 3)), int(np.prod(spec.shape))))
            index = f"d['i{name}']"
    ints = [p for p, s in leaves if s.kind == "int"]
    scale = draw(st.sampled_from(SCALES if ints else SCALES[:2]))
    scale = _path_src(draw(st.sampled_from(ints))) if scale == "int_leaf" else {"one": "", "static": "c"}[scale]
    return Term(path, expr, reduction, axis, index, scale)


def _draw_inputs(draw, case: Case, data_specs: dict, c: float | None = None, ints_from: Any = None) -> Inputs:
    """Values for ``case``'s form; ``c`` and the int leaves of ``ints_from`` kept where given."""
    floats = [s for _, s in _leaves(case.skeleton) if s.kind == "float"]
    bound = min(int(np.prod(s.shape)) for s in floats)  # an x index leaf can index any float leaf

    def leaf(path, spec):
        if spec.kind == "float":
            return _laid_out(_values(draw, spec.shape, case.dtype), spec.layout)
        if spec.kind == "int":
            return draw(st.integers(1, 3)) if ints_from is None else _get(ints_from, path)
        return _index(draw, spec.shape[0], bound)

    x = _map(case.skeleton, leaf)
    d = {k: _values(draw, shape, case.dtype) if kind == "w" else _index(draw, *shape)
         for k, (kind, shape) in data_specs.items()}
    return Inputs(x, draw(st.sampled_from((0.5, 2.0, -1.5))) if c is None else c, d)


@st.composite
def cases(draw, vector: bool = False, dtype: str | None = None) -> Case:
    """A :class:`Case`; ``vector=True`` for a function with a 1-d output (jacobian, pullback)."""
    dtype = dtype or draw(st.sampled_from(FLOAT_DTYPES))
    skeleton = draw(skeletons())
    leaves = _leaves(skeleton)
    floats = [(p, s) for p, s in leaves if s.kind == "float"]
    chosen = draw(st.lists(st.sampled_from(floats), min_size=1, max_size=3, unique_by=lambda ps: ps[0]))
    data_specs: dict[str, tuple] = {}
    terms = [_draw_term(draw, path, spec, leaves, data_specs) for path, spec in chosen]
    data_specs = {k: v for k, v in data_specs.items() if any(f"d[{k!r}]" in _term_src(t) for t in terms)}
    tangent = _map(skeleton, lambda p, s: _values(draw, s.shape, dtype) if s.kind == "float" else None)
    case = Case(dtype, skeleton, terms, vector, None, None, None, tangent, np.zeros(0))
    case.first = _draw_inputs(draw, case, data_specs)
    case.second = _draw_inputs(draw, case, data_specs)
    case.same_static = _draw_inputs(draw, case, data_specs, c=case.first.c, ints_from=case.first.x)
    for inp in (case.first, case.second, case.same_static):
        _check_well_posed(case, inp)
    if vector:
        out_len = int(np.size(case.function()(case.first.x, case.first.c, case.first.d)))
        case.cotangent = _values(draw, (out_len,), dtype)
    return case


def _term_src(t: Term) -> str:
    return t.scalar_src() + t.vector_src()


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _check_well_posed(case: Case, inp: Inputs) -> None:
    """Reject a point near a kink or with huge intermediates (see ``KINK_MARGIN``)."""
    d64 = {k: np.asarray(v, np.float64) for k, v in inp.d.items()}
    for t in case.terms:
        watch: list = []
        _expr_numpy(t.expr, np.asarray(_get(inp.x, t.path), np.float64), d64, watch)
        assume(all(v >= KINK_MARGIN for kind, v in watch if kind == "kink"))
        assume(all(v <= MAX_MAGNITUDE for kind, v in watch if kind == "size"))

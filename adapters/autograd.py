"""HIPS autograd: reverse mode by tracing numpy code on the CPU; no compilation.

An adapter of the protocol (:class:`abstractdiff.protocol.Adapter`): ``ad.backend("autograd")``
is the core's backend holding an :class:`AutogradAdapter`.  autograd re-traces the function on
every call (there is nothing to cache), boxes the list of float leaves as one container (a
single leaf bare), and differentiates through ``autograd.numpy`` ops only; backend-neutral
functions reach those through ``autoray``.  Fast routes: the gradient (one pullback seeded
with one, the scalar check inside the trace), autograd's own Hessian and its reverse-over-
reverse HVP; every other operator is the core's.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import autograd
import autograd.extend
import autograd.numpy as anp
import numpy as np
from autograd.core import make_jvp, make_vjp
from autograd.numpy.numpy_boxes import ArrayBox
from autograd.tracer import Box, getval

from abstractdiff import _pytree as pytree
from abstractdiff._arrays import check_scalar, shape_of, size_of
from abstractdiff._custom import mode_refusal
from abstractdiff._errors import AbstractDiffError, ArgumentTypeError
from abstractdiff.protocol import Adapter

FlatFn = Callable[[list, list], tuple]

_MISSING_JVP = re.compile(r"JVP of .* not defined")
# What numpy says when it meets an ArrayBox it cannot use: np.array(box, dtype=float),
# item assignment, float(box).
_BOX_MISUSE = re.compile(r"ArrayBox|setting an array element with a sequence")
_BOX_HINT = (
    "autograd backend: f received autograd ArrayBox values (the traced inputs) and a plain "
    "numpy operation could not handle them. Write f with autograd.numpy or autoray "
    "(`from autoray import numpy as anp`) instead of numpy conversions such as "
    "np.array(x, dtype=...) or float(x), and build arrays with anp.stack/anp.where: "
    "autograd has no in-place assignment (x[i] = ...)."
)


def _cast(g: Any, like: Any) -> Any:
    """``g`` with the dtype of ``like``: numpy upcasts float32 when mixed with float64 constants."""
    if not isinstance(g, Box):
        g = np.asarray(g)
    return g if g.dtype == like.dtype else g.astype(like.dtype)


class _Traced:
    """``fn`` as autograd's unary function of the boxed list of float leaves.

    A single leaf is traced bare: the list container costs a getitem node per leaf and
    makes a small gradient ~30% slower.

    Keeps ``aux`` and strips from it the boxes of this trace only, so that nested use
    still sees the outer trace's boxes.
    """

    def __init__(self, backend: AutogradAdapter, fn: FlatFn, data: list, n: int, scalar: str | None = None):
        self.backend, self.fn, self.data, self.n, self.scalar = backend, fn, data, n, scalar
        self.aux: Any = None

    def __call__(self, boxed: Any) -> Any:
        self.backend.trace_count += 1
        xs = [boxed[i] for i in range(self.n)] if self.n != 1 else [boxed]
        y, aux = self.fn(xs, self.data)
        if self.scalar is not None:
            check_scalar(y, self.scalar)
        level = getattr(boxed, "_trace", None)
        # autograd warns ("Output seems independent of input") when y, or for second order
        # the gradient, does not depend on the traced inputs; silencing that per call would
        # reset the process-wide warning registry.  Adding a zero that depends on the inputs
        # keeps the values and connects the graph: unconnected gradients come out as zeros.
        if self.scalar in ("hessian", "hvp"):
            y = y + 0.0 * sum(anp.sum(x * x) for x in xs)  # x*x: its gradient depends on x too
        elif not (isinstance(y, Box) and y._trace == level):
            y = y + 0.0 * anp.sum(xs[0])
        if aux is not None:
            self.aux = pytree.tree_map(lambda a: a._value if isinstance(a, Box) and a._trace == level else a, aux)
        return y


def _run(transform: Callable[[], Any]) -> Any:
    """Run an autograd transform, adding a hint to errors that come from numpy misuse."""
    try:
        return transform()
    except (TypeError, ValueError) as err:
        if _BOX_MISUSE.search(str(err)) and _BOX_HINT not in getattr(err, "__notes__", ()):
            err.add_note(_BOX_HINT)  # the user's exception itself, type unchanged
        raise


def _items(seq: Any) -> tuple:
    """A tuple, or autograd's box of one, as a tuple of its (boxed) items."""
    return tuple(seq[i] for i in range(len(seq)))


def _packed(xs: list) -> Any:
    return xs[0] if len(xs) == 1 else list(xs)


def _unpacked(gs: Any, n: int) -> list:
    return [gs] if n == 1 else list(gs)


def _primal(y: Any, xs: list, data: list) -> Any:
    """``f``'s value: a nested trace's box as it is, else an array no wider than the inputs'
    floats (numpy 2 promotes float32 arrays with float64 scalars such as ``np.log(2)``,
    where the other libraries keep float32: the dtype promise holds for values too)."""
    if isinstance(y, Box):
        return y
    y = np.asarray(y)
    if y.dtype.kind != "f" or any(getattr(x, "dtype", None) == y.dtype for x in xs):
        return y  # the common case, decided cheaply: y is no wider than an input
    floats = [a.dtype for a in (*xs, *data) if not isinstance(a, Box) and np.asarray(a).dtype.kind == "f"]
    if y.dtype.kind == "f" and floats:
        dtype = np.result_type(*floats)
        if dtype.itemsize < y.dtype.itemsize:  # widened by a Python or numpy scalar only
            y = y.astype(dtype)
    return y


class _CustomRule:
    """``rule``'s function of this library's arrays: one autograd primitive, ``_rule_op``,
    returning the tuple of outputs.

    autograd calls a primitive's vjp (or jvp) maker while tracing, once per trace, with the
    inputs unboxed for that trace only: at the oldest trace they are plain and the residuals
    of the primitive's own forward are reused; at a newer one they are still boxed by the
    older traces, so ``rule.forward`` reruns on the boxes and the residuals, hence the
    backward, stay differentiable (second order).
    """

    def __init__(self, rule: Any):
        self.rule = rule
        self.last: Any = None  # (outputs, residuals) of the latest forward; `ans is outputs` ties them

    def __call__(self, *inputs: Any) -> tuple:
        if not any(isinstance(a, Box) for a in inputs):
            return tuple(self.rule.value(*inputs))  # nothing traces: no residuals, no primitive
        return _items(_rule_op(*inputs, rule=self))

    def forward(self, inputs: tuple) -> tuple:
        if not self.rule.has_vjp:
            return tuple(self.rule.value(*inputs))
        outs, res = self.rule.forward(*inputs)
        self.last = (outs := tuple(outs), res)
        return outs

    def residuals(self, ans: Any, args: tuple) -> Any:
        saved, self.last = self.last, None  # a swap: another thread's forward only costs a rerun
        return saved[1] if saved is not None and saved[0] is ans else self.rule.forward(*args)[1]

    def vjp(self, argnums: tuple, ans: Any, args: tuple) -> Callable:
        rule = self.rule
        if not rule.has_vjp:
            return self.refuse  # raised when a backward runs, not while tracing
        res = self.residuals(ans, args)
        return lambda cts: [rule.backward(res, _items(cts))[i] for i in argnums]

    def refuse(self, cts: Any) -> Any:
        raise self.rule.no_vjp_error()

    def jvp(self, argnums: tuple, gs: list, ans: Any, args: tuple) -> tuple:
        ts = [autograd.extend.vspace(a).zeros() for a in args]  # inputs with no tangent
        for i, g in zip(argnums, gs):
            ts[i] = g
        if self.rule.has_jvp:
            self.last = None
            return tuple(self.rule.jvp(tuple(args), tuple(ts))[1])
        # a custom_vjp rule: the backward is linear in its cotangents, so the output tangent
        # is the gradient of <backward(cts), t> in cts (the vjp of the vjp, as jax transposes)
        res = self.residuals(ans, args)
        dot = lambda cts: sum(anp.sum(c * t) for c, t in zip(self.rule.backward(res, _items(cts)), ts))  # noqa: E731
        return tuple(autograd.grad(dot)(autograd.extend.vspace(ans).zeros()))


# One primitive for every rule, which it gets as an argument: autograd's tables of rules are
# global, so a primitive per rule would keep every rule alive.
@autograd.extend.primitive
def _rule_op(*inputs: Any, rule: _CustomRule) -> tuple:
    return rule.forward(inputs)


autograd.extend.defvjp_argnums(_rule_op, lambda argnums, ans, args, kw: kw["rule"].vjp(argnums, ans, args))
autograd.extend.defjvp_argnums(_rule_op, lambda argnums, gs, ans, args, kw: kw["rule"].jvp(argnums, gs, ans, args))


class AutogradAdapter(Adapter):
    name = "autograd"
    extra = "autograd"
    modules = ("autograd",)
    fast_routes = {"value_and_gradient": "value_and_gradient", "hessian": "hessian", "hvp": "hvp"}

    def __init__(self, *, device: str = "cpu", **options: Any):
        if options:
            raise ArgumentTypeError(
                f"autograd backend got unexpected option(s) {', '.join(map(repr, options))}; its only "
                f"options are device='cpu' and chunk_size (autograd runs eagerly on the CPU: there is "
                f"nothing to compile)"
            )
        super().__init__(device=device)
        #: Python executions of ``f`` under autograd tracing (autograd traces every call).
        self.trace_count = 0

    def is_native(self, a: Any) -> bool:
        return isinstance(a, (np.ndarray, ArrayBox))

    def snapshot(self, a: Any) -> Any:
        return a.copy() if isinstance(a, np.ndarray) else a  # a traced ArrayBox is never written in place

    def to_numpy(self, a: Any) -> np.ndarray:
        while isinstance(a, Box):  # an ArrayBox: unwrap to the primal value
            a = a._value
        return np.asarray(a)

    # ------------------------------------------------------------- composition
    def custom_function(
        self,
        value: Callable[..., np.ndarray],
        vjps: Sequence[Callable[..., Any]],
        jvps: Sequence[Callable[..., Any]],
        out: tuple[int, str],
    ) -> Callable[..., Any]:
        # an autograd primitive: defvjp's rules take (ans, *inputs) and return the pullback of
        # one input, defjvp's take (tangent, ans, *inputs); the core's rules are primitives too
        @autograd.extend.primitive
        def op(*inputs: np.ndarray) -> np.ndarray:
            return value(*inputs)

        autograd.extend.defvjp(op, *[(lambda ans, *xs, r=r: lambda g: r(g, *xs)) for r in vjps])
        autograd.extend.defjvp(op, *[(lambda g, ans, *xs, r=r: r(g, *xs)) for r in jvps])
        return op

    def custom_rule(self, rule: Any) -> Callable[..., tuple]:
        if rule.stops_gradient:  # ad.stop_gradient: unboxed from every trace, a constant to all of them
            return lambda *inputs: tuple(map(getval, inputs))
        return _CustomRule(rule)

    # ------------------------------------------------------------- primitives
    def _trace_reverse(self, fn: FlatFn, xs: list, data: list, scalar: str | None = None):
        traced = _Traced(self, fn, data, len(xs), scalar)
        vjp, y = _run(lambda: make_vjp(traced, _packed(xs)))
        return _primal(y, xs, data), traced.aux, vjp

    def value_and_pullback(self, fn: FlatFn, xs: list, data: list, scalar: str | None = None):
        y, aux, vjp = self._trace_reverse(fn, xs, data, scalar)

        def pullback(dy: Any) -> list:
            # The backward pass runs no user code: no _run needed.
            return [_cast(g, x) for g, x in zip(_unpacked(vjp(dy), len(xs)), xs)]

        return y, aux, pullback

    def value_and_pushforward(self, fn: FlatFn, xs: list, data: list):
        # autograd's forward mode re-runs f for each tangent, so the value comes from a
        # plain call.  Some primitives (numpy.linalg) have no JVP rule: for them the
        # tangent is a reverse-of-reverse product (vjp is linear in its cotangent, so
        # the vjp of the vjp is the jvp), as autograd's make_jvp_reversemode does.
        y, aux = _run(lambda: fn(xs, data))
        y = _primal(y, xs, data)
        state = {"reverse": None}

        def pushforward(ts: list) -> Any:
            if state["reverse"] is None:
                try:
                    _, dy = _run(lambda: make_jvp(_Traced(self, fn, data, len(xs)), _packed(xs))(_packed(ts)))
                    return _cast(dy, y)
                except NotImplementedError as err:
                    if not _MISSING_JVP.search(str(err)):
                        raise
                    _, _, vjp = self._trace_reverse(fn, xs, data)
                    try:
                        state["reverse"] = _run(lambda: make_vjp(vjp, np.zeros(shape_of(y), dtype=y.dtype))[0])
                    except AbstractDiffError:
                        raise
                    except Exception as again:  # noqa: BLE001 - the reverse route's own failure, named
                        raise mode_refusal("forward", (
                            f"forward mode through f meets an operation autograd has no forward-mode rule for "
                            f"({err}), and the reverse-of-reverse route autograd takes instead failed too "
                            f"({type(again).__name__}: {again}); use reverse mode (gradient, pullback, hessian), "
                            f"or another backend"
                        )) from again
            return _cast(state["reverse"](_packed(ts)), y)

        return y, aux, pushforward

    # ------------------------------------------------------------ fast routes
    def value_and_gradient(self, fn: FlatFn, xs: list, data: list):
        # The scalar check runs inside the trace, before autograd's own (a TypeError).
        y, aux, vjp = self.value_and_pullback(fn, xs, data, scalar="gradient")
        return y, aux, vjp(np.ones((), dtype=y.dtype))

    # the Jacobian is the core's: chunks of chunk_size basis rows, one batched pullback each
    # (autograd has no vmap, so a batch is a loop of vjps of one trace, as autograd.jacobian's);
    # with chunk_size set, so is the Hessian (autograd.hessian has no chunks)

    def hessian(self, fn: FlatFn, xs: list, data: list) -> Any:
        (x,) = xs
        traced = _Traced(self, fn, data, 1, scalar="hessian")
        if size_of(x) == 0:  # autograd.hessian stacks no rows and fails; an empty x's Hessian is known
            _run(lambda: traced(x))  # f still runs once, so its output is checked as for any x
            return np.zeros(shape_of(x) * 2, dtype=x.dtype)
        h = _run(lambda: autograd.hessian(traced)(x))
        return _cast(h, x)

    def hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> list:
        # make_hvp: the vjp of the gradient (reverse-over-reverse); H is symmetric.
        traced = _Traced(self, fn, data, len(xs), scalar="hvp")
        hvp, _ = _run(lambda: autograd.make_hvp(traced)(_packed(xs)))
        return [_cast(h, x) for h, x in zip(_unpacked(hvp(_packed(tangents)), len(xs)), xs)]

"""PyTensor: symbolic graphs, differentiated symbolically and compiled once per input signature.

PyTensor (PyMC's graph compiler) has no eager arrays: ``f`` runs once on symbolic
inputs (``pt.tensor`` placeholders with static shapes, one per float leaf of ``x`` and
one per data leaf), the operator's graph is built from the result
(``pytensor.grad``, ``pytensor.gradient.pullback`` / ``pushforward`` / ``jacobian`` /
``hessian_vector_product``) and compiled with ``pytensor.function``.  The compiled
function is kept in the flat function's typed cache (``fn.artefacts(backend,
operator)``), one variant per input signature (every leaf's shape and dtype), so new
data of the same signature runs the compiled code without calling ``f``; values ``f``
reads from globals and closures are frozen into the graph (``reuses_traces``: the core
keys its plans on them).  ``compilations`` and ``trace_count`` count the work done.
``mode=`` picks the ``pytensor.function`` mode: ``None`` (PyTensor's configured default;
in PyTensor 3 that is Numba: the fastest calls, seconds to compile a new graph while
Numba's disk cache is cold) or ``"FAST_COMPILE"`` (numpy per op: compiles in tens of
milliseconds, calls several times slower), among those in ``_MODES``.  An adapter of the
protocol (:class:`abstractdiff.protocol.Adapter`): ``ad.backend("pytensor")`` is the core's
backend holding a :class:`PyTensorAdapter`, whose fast routes are the compiled gradient,
Jacobian, Hessian and HVP graphs.

Runtime arrays are numpy arrays; results come back as numpy arrays of the inputs'
dtype (a Python float constant in float32 code, ``0.1 * x``, makes PyTensor compute in
float64: the value is cast back, and gradients take their input's dtype).  PyTensor's
global ``floatX`` is never read or changed.  Symbolic values are native too: an
abstractdiff operator called inside a function PyTensor is tracing builds its graph
into the outer one (nested use), without compiling.

Threads: a compiled function computes in storage of its own, so calls of one compiled
function from several threads are serialised (other compiled functions run in parallel),
and compilations are serialised (PyTensor's configuration is initialised on first read).

Implicit mode: ``pytensor.shared`` variables are PyTensor's variables
(``ad.variables(tree, "pytensor")`` makes them); ``f()`` builds a graph that reads them,
and ``pytensor.grad`` differentiates it with respect to them, compiled once per ``f``,
variables and argument signature.  PyTensor has no module or model type of its own:
``ad.Params`` takes a list or dict of shared variables.
"""

from __future__ import annotations

import copy
import re
import threading
import warnings
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.mode import Mode, get_mode
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.gradient import (
    DisconnectedType,
    NullTypeGradError,
    disconnected_grad,
    disconnected_type,
    grad_undefined,
    hessian_vector_product,
    jacobian,
    pullback,
)
from pytensor.graph.basic import Apply, Constant, NominalVariable, Variable
from pytensor.graph.op import Op
from pytensor.graph.replace import graph_replace
from pytensor.graph.rewriting.basic import in2out, node_rewriter
from pytensor.graph.traversal import apply_ancestors, graph_inputs
from pytensor.link.basic import PerformLinker
from pytensor.link.vm import VMLinker
from pytensor.scan.op import Scan
from pytensor.tensor.blockwise import Blockwise
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.exceptions import NotScalarConstantError
from pytensor.tensor.sharedvar import TensorSharedVariable
from pytensor.tensor.variable import TensorConstant, TensorVariable

from abstractdiff import _pytree as pytree
from abstractdiff._arrays import check_scalar
from abstractdiff._cache import Memo
from abstractdiff._custom import mode_refusal
from abstractdiff._errors import (
    ArgumentTypeError,
    CompositionError,
    InvalidArgumentError,
    NonDifferentiableInputError,
    NonScalarOutputError,
    TracedControlFlowError,
)
from abstractdiff._tree import PlanCache, artefacts, check_output, flatten_call, split_aux
from abstractdiff.protocol import Adapter

# What PyTensor raises when Python needs a concrete value of a symbolic one: bool() (an
# `if`), int() (an index, a range), float().
_CONCRETE = re.compile(r"TensorVariables? cannot be converted to Python (boolean|integer|float)")
_SYMBOLIC_HINT = (
    "pytensor backend: f received symbolic PyTensor variables (PyTensor builds f's graph once and "
    "compiles it) and an operation needed their numbers. Write f with autoray (`from autoray import "
    "numpy as anp`) or pytensor.tensor rather than numpy calls, float() or .item()."
)
# The refusal of a derivative through differentiate_with's boundary
# (abstractdiff._compose.boundary_error), inside the NullTypeGradError PyTensor raises with it.
_REFUSED = re.compile(r"(an? \w+ derivative through differentiate_with's boundary.*)", re.DOTALL)
# PyTensor's Numba mode runs an Op without a Numba implementation in object mode, and warns;
# for a kernel of another library that is the only way, so the warning says nothing.
_OBJECT_MODE = r"Numba will use object mode to run _CustomOp"


# PyTensor's configuration initialises a parameter on its first read, and a second thread
# reading it meanwhile raises "Can't change the value of <name> config parameter after
# initialization!"; compilation reads many of them.  Compiling happens once per input
# signature: all compilations are serialised (re-entrant: compiling a graph may run a
# foreign kernel that compiles a PyTensor function of its own).
_COMPILING = threading.RLock()

#: The ``mode=`` options: PyTensor's compilation modes whose functions take and return numpy
#: arrays.  FAST_RUN (PyTensor 3's default) compiles with Numba: the fastest calls, the
#: slowest first compilation; FAST_COMPILE runs numpy per op without rewrites: compiles
#: in a fraction of the time, runs several times slower.
_MODES = ("FAST_RUN", "FAST_COMPILE", "NUMBA", "C", "CVM")


# An Elemwise runs in Python (numpy) with at most 32 operands: its ``perform`` (what the
# modes without compiled kernels run: FAST_COMPILE; C and CVM where no compiler is found)
# builds no ufunc for more and fails with "'Scratchpad' object has no attribute 'ufunc'".
# PyTensor's canonicalisation (FAST_COMPILE's too) merges a chain of additions into one: a
# Python sum over 32 or more elements of an array (``sum(x[i] ** 2 for i in ...)``), or a
# pushforward over that many leaves, makes such a node.
_ELEMWISE_OPERANDS = 32


@node_rewriter([Elemwise])
def _split_wide_elemwise(fgraph: Any, node: Apply) -> list | None:
    """An associative Elemwise (add, mul, maximum...) of too many operands for ``perform``, as a
    tree of narrower ones of the same scalar op (no in-place pattern: a fresh Elemwise)."""
    op, out = node.op, node.outputs
    if len(node.inputs) + len(out) <= _ELEMWISE_OPERANDS or len(out) != 1 or not getattr(
            op.scalar_op, "associative", False):
        return None
    narrow, terms = Elemwise(op.scalar_op), list(node.inputs)
    width = _ELEMWISE_OPERANDS - 1
    while len(terms) > 1:
        terms = [narrow(*terms[i : i + width]) if len(terms[i : i + width]) > 1 else terms[i]
                 for i in range(0, len(terms), width)]
    return [out[0].type.filter_variable(pt.cast(terms[0], out[0].dtype))]


def _scans_in(mode: list) -> Any:
    """A rewrite giving each ``pytensor.scan`` without a mode of its own the compiled function's
    mode (``mode[0]``) for its inner graph.  Without one, Scan compiles its inner graph with
    C thunks ("cvm") whatever the function's mode, and its Python perform hands them a 0-d
    output as a numpy scalar: forward mode through a scan over a vector (each step's slice
    0-d; forward mode is two pullbacks, a scan of the scan's gradient) raised "expected an
    ndarray" in FAST_COMPILE."""

    def in_mode(scan: Scan) -> Scan | None:
        if scan.mode is not None:
            return None
        op = copy.copy(scan)  # Scan's equality ignores its mode; a fresh op compiles its own inner function
        op.mode, op._fn = mode[0], None
        return op

    @node_rewriter([Scan, Blockwise])
    def scan_in_mode(fgraph: Any, node: Apply) -> list | None:
        op = node.op
        if isinstance(op, Blockwise):  # a vectorised scan (a Jacobian's or Hessian's rows)
            core = in_mode(op.core_op) if isinstance(op.core_op, Scan) else None
            if core is None:
                return None
            op = copy.copy(op)
            op.core_op = core
        else:
            op = in_mode(op)
            if op is None:
                return None
        return op.make_node(*node.inputs).outputs

    return scan_in_mode


# a resolved mode's id -> (it, it with the rewrites above)
_RUNNABLE: Memo = Memo(name="pytensor runnable modes", keyed_on="a resolved PyTensor mode (its id, checked)")


def _runnable(mode: str | None) -> Any:
    """``mode`` (None: PyTensor's configured one, read now) as compiled: where it runs ops in
    Python (FAST_COMPILE; CVM without a C compiler), with the rewrites that split wide Elemwise
    nodes and (a VM's) compile scans' inner graphs in it too (nested scans included)."""
    resolved = get_mode(mode)
    linker = getattr(resolved, "linker", None)
    python = isinstance(linker, PerformLinker) or isinstance(linker, VMLinker) and (
        linker.c_thunks is False or not pytensor.config.cxx)  # C thunks (CVM with a compiler) take any width
    if not isinstance(resolved, Mode) or not python:
        return resolved  # Numba, C: its own kernels (not a Mode: whatever PyTensor makes of it, unchanged)
    entry = _RUNNABLE.get(id(resolved))
    if entry is None or entry[0] is not resolved:
        # the split after the canonicalisations and PyTensor's py_only rewrites (49.1), before the
        # in-place ones (49.5); the scans' mode once Blockwise ops without batch dimensions are
        # unwrapped (60: a Hessian's vectorised scans), new scans and in-place ones included
        # (scans only where the linker is a VM: Scan's perform needs one for its preallocated outputs)
        cell: list = []
        rewrites = [(in2out(_split_wide_elemwise), 49.2)]
        if isinstance(linker, VMLinker):
            rewrites.append((in2out(_scans_in(cell)), 61))
        runnable = resolved.register(*rewrites).excluding("local_greedy_distributor")
        cell.append(runnable)
        entry = _RUNNABLE[id(resolved)] = (resolved, runnable)
    return entry[1]


def _is_symbolic(a: Any) -> bool:
    return isinstance(a, Variable) and not isinstance(a, SharedVariable)


def _signature(arrays: list) -> tuple:
    # numpy leaves by shape and dtype; symbolic ones (nested use) by their type
    return tuple([(a.shape, a.dtype) if isinstance(a, np.ndarray) else a.type for a in arrays])


def _as_input(a: Any) -> Any:
    """``a`` as a compiled function's input: a numpy scalar (what indexing a stacked batch of
    scalar tangents or cotangents gives, ``np.float64``) or a Python number as a 0-d array;
    the signature, the placeholders and ``trust_input`` take arrays or symbolic values."""
    return a if isinstance(a, (np.ndarray, Variable)) else np.asarray(a)


def _placeholder(a: Any) -> TensorVariable:
    """A fresh symbolic input shaped and typed like ``a`` (static shape: the signature has it)."""
    if isinstance(a, Variable):
        return a.type()
    return pt.tensor(dtype=a.dtype.name, shape=a.shape)


def _float_dtype(*groups: list) -> str | None:
    """The dtype results are given: numpy's promotion of the float inputs (float32 stays float32)."""
    floats = [np.dtype(a.dtype) for group in groups for a in group if np.dtype(a.dtype).kind == "f"]
    return np.result_type(*floats).name if floats else None


def _like(v: Any, dtype: str) -> Any:
    return v if v.dtype == dtype else v.astype(dtype)


def _narrow(v: Any, dtype: str | None) -> Any:
    """A float value wider than the inputs' floats in their dtype: PyTensor makes a Python float
    that float32 cannot hold exactly (``0.1 * x``) a float64 constant, and computes in float64."""
    if dtype is None or not v.dtype.startswith("float") or np.dtype(v.dtype).itemsize <= np.dtype(dtype).itemsize:
        return v
    return v.astype(dtype)


def _pushforward(y: TensorVariable, wrt: list, tangents: list) -> TensorVariable:
    """``J t`` by two pullbacks: the derivative of ``<J^T u, t>`` in ``u``, the same at every ``u``.

    PyTensor's own ``pushforward`` (3.0.7) seeds its first pullback with ``y.zeros_like()``
    and loses terms with it: through ``solve_triangular`` the matrix's tangent is dropped, a
    silently wrong derivative.  A root variable as the seed keeps every term; it is replaced
    by zeros once the graph is built (the result does not depend on its value)."""
    _refuse_forward_through_solvers(y)
    u = y.type()
    grads = pullback(y, wrt, u, disconnected_inputs="ignore", return_disconnected="zero")
    inner = pt.add(*[pt.sum(g * t) for g, t in zip(grads, tangents)])
    dy = pytensor.grad(inner, u, disconnected_inputs="ignore", return_disconnected="zero")
    return graph_replace(dy, {u: pt.zeros_like(y)}, strict=False)


def _refuse_forward_through_solvers(y: TensorVariable) -> None:
    """Forward mode by two pullbacks differentiates a rule's backward in its cotangent, at zero:
    a rule that solves a linear system in its backward (``ad.custom_root``'s BiCGSTAB) is not
    linear in the cotangent as computed, and that derivative is silently 0.  Refused instead
    (the core's Jacobian then takes reverse mode)."""
    for node in apply_ancestors([y]):
        if isinstance(node.op, _RuleOp) and node.op.rule.takes_derivatives:
            raise mode_refusal("forward", (
                f"{node.op.rule.name}: the pytensor backend builds forward mode by transposing the reverse "
                f"rule, which an implicit solver's (ad.custom_root) is not linear in as computed: use reverse "
                f"mode (gradient, pullback, hessian, a reverse Jacobian), or another backend"))


def _check_scalar(y: TensorVariable, operator: str) -> None:
    if y.type.ndim == 0:
        return
    try:  # the core's message, from the static shape (a symbolic one has no numbers)
        check_scalar(np.broadcast_to(np.zeros((), y.dtype), y.type.shape), operator)
    except TypeError:  # a dimension unknown until run time (a graph of the user's own)
        raise NonScalarOutputError(
            f"{operator} needs f to return a scalar (shape ()), but f returned an array with "
            f"{y.type.ndim} dimension(s); reduce it to a scalar (e.g. .sum())"
        ) from None


def _split_aux(aux: Any) -> tuple[list, Any]:
    """The symbolic leaves of ``aux`` (compiled as extra outputs) and how to put it back together."""
    if aux is None:
        return [], None
    leaves, treedef = pytree.tree_flatten(aux)
    where = [i for i, leaf in enumerate(leaves) if _is_symbolic(leaf)]
    template = [None if i in where else leaf for i, leaf in enumerate(leaves)]
    return [leaves[i] for i in where], (treedef, template, where)


def _merge_aux(meta: Any, values: list) -> Any:
    if meta is None:
        return None
    treedef, template, where = meta
    leaves = list(template)
    for i, v in zip(where, values):
        leaves[i] = v
    return pytree.tree_unflatten(treedef, leaves)


class _Compiled:
    """A compiled operator: ``(outputs, aux)`` from the flat list of input arrays.

    A ``pytensor.function`` computes in storage cells of its own (inputs, intermediates,
    outputs; freed after each call): two threads calling one function at once read each
    other's inputs and find freed cells (``'NoneType' object has no attribute 'shape'``, or a
    silently wrong result).  Calls of one compiled function are therefore serialised; other
    compiled functions run in parallel."""

    __slots__ = ("function", "n", "aux", "lock")

    def __init__(self, function: Any, n: int, aux: Any):
        self.function, self.n, self.aux = function, n, aux
        self.lock = threading.Lock()

    def __call__(self, arrays: list) -> tuple[list, Any]:
        with self.lock:  # a copy of the list: a VM may return one list object every call
            out = list(self.function(*arrays))
        if self.aux is None:
            return out, None
        return out[: self.n], _merge_aux(self.aux, out[self.n :])


class _ImplicitCall:
    """``f(*args)`` of implicit mode as a flat function: it reads shared variables, not ``xs``."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any):
        self.fn = fn

    def __call__(self, xs: list, data: list) -> tuple[Any, Any]:
        _, args = self.fn.rebuild([], data)
        y, aux = split_aux(self.fn.f(*args), self.fn.has_aux)
        return check_output(y), aux


def _typed(values: list, like: list) -> list:
    # scan needs a step to return its carry's exact types (dtype and static shape)
    return [c.type.filter_variable(pt.cast(v, c.dtype)) for v, c in zip(values, like)]


def _scanned(step: Callable, **options: Any) -> list:
    return pytensor.scan(step, return_list=True, return_updates=False, **options)


class _Loops:
    """ad.fori_loop and ad.scan as one ``pytensor.scan`` on symbolic values (numpy values take
    the core's Python loop); the body is traced once and values it reads by closure are found
    by scan itself."""

    def fori_loop(self, lower: int, upper: int, body: Callable, init: list) -> list:
        init = [pt.as_tensor_variable(c) for c in init]
        out = _scanned(lambda i, *c: _typed(body(i, list(c)), init), sequences=[pt.arange(lower, upper)],
                       outputs_info=init)
        return [o[-1] for o in out]

    def scan(self, f: Callable, init: list, xs: list, length: int) -> tuple:
        init, xs = [pt.as_tensor_variable(c) for c in init], [pt.as_tensor_variable(x) for x in xs]
        ys = f(init, [x[0] for x in xs])[1]  # one step traced apart: how many ys (its graph is dropped)

        def step(*args: Any) -> list:
            new, y = f(list(args[len(xs):]), list(args[:len(xs)]))
            return [*_typed(new, init), *y]

        out = _scanned(step, sequences=xs, outputs_info=[*init, *[None] * len(ys)], n_steps=length)
        return [o[-1] for o in out[:len(init)]], out[len(init):]

    def while_loop(self, cond: Callable, body: Callable, init: list) -> list:
        raise InvalidArgumentError(
            "ad.while_loop cannot run on symbolic PyTensor values: pytensor.scan needs a number of steps "
            "(it allocates them); use ad.fori_loop or ad.scan with a bound"
        )


class PyTensorAdapter(Adapter):
    name = "pytensor"
    extra = "pytensor"
    modules = ("pytensor",)
    # f runs once per input signature and the compiled graph is reused: what f reads by
    # closure or global is frozen in it, so the core keys plans on those values
    reuses_traces = True
    # One symbolic graph of the whole Jacobian (Hessian); with chunk_size set the core skips
    # those two routes and builds them from chunks of batched pullbacks or pushforwards
    fast_routes = {"prepare_value_and_gradient": "prepare_value_and_gradient", "jacobian": "jacobian",
                   "hessian": "hessian", "hvp": "hvp"}

    def __init__(self, *, device: str = "cpu", mode: str | None = None):
        if mode is not None and not isinstance(mode, str):
            raise ArgumentTypeError(f"mode must be a PyTensor mode name or None, got {mode!r}")
        if mode is not None and mode not in _MODES:
            raise InvalidArgumentError(
                f"mode must be None (PyTensor's configured default) or one of {', '.join(_MODES)}, got {mode!r}; "
                f"the JAX, PYTORCH and MLX modes run another library's arrays"
            )
        super().__init__(device=device, mode=mode)
        #: The ``pytensor.function`` mode; None: PyTensor's configured default (never changed here).
        self.mode = mode
        #: Graphs compiled with ``pytensor.function`` (a repeated call of one signature adds none).
        self.compilations = 0
        #: Python executions of user functions on symbolic inputs.
        self.trace_count = 0
        self.variables = _Variables(self)
        self.loops = _Loops()  # the loop hooks (ad.scan...): pytensor.scan

    # ---------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        # numpy arrays at run time, symbolic tensors while PyTensor traces f (nested use);
        # a shared variable is a variable, read through to_numpy like other libraries' ones
        if type(a) is np.ndarray:
            return a.dtype.isnative  # other byte orders go through from_numpy
        return isinstance(a, TensorVariable) and not isinstance(a, SharedVariable)

    def from_numpy(self, a: np.ndarray) -> np.ndarray:
        # compiled functions trust their inputs' types: the machine's byte order, a base ndarray
        return np.asarray(a, dtype=a.dtype.newbyteorder("=")) if not a.dtype.isnative else np.asarray(a)

    def to_numpy(self, a: Any) -> np.ndarray:
        if isinstance(a, SharedVariable):
            return np.asarray(a.get_value())
        if isinstance(a, TensorConstant):
            return np.asarray(a.data)
        if isinstance(a, Variable):
            raise ArgumentTypeError(
                f"a symbolic PyTensor value ({a}) has no numbers before its graph is compiled and run; "
                f"convert the results of abstractdiff's operators, not values inside f"
            )
        return np.asarray(a)

    def cast(self, a: Any, dtype: str) -> Any:
        return a.astype(dtype)

    def zeros_like(self, a: Any) -> Any:
        return pt.zeros_like(a) if isinstance(a, Variable) else np.zeros_like(a)

    def ones_like(self, a: Any) -> Any:
        return pt.ones_like(a) if isinstance(a, Variable) else np.ones_like(a)

    # ------------------------------------------------------------- composition
    def custom_function(
        self,
        value: Callable[..., np.ndarray],
        vjps: Sequence[Callable[..., Any]],
        jvps: Sequence[Callable[..., Any]],
        out: tuple[int, str],
    ) -> Callable[..., Any]:
        # an Op: PyTensor differentiates the graph symbolically, so the rules build graphs too
        return _CustomOp(value, tuple(vjps), tuple(jvps), out)

    def custom_rule(self, rule: Any) -> Callable[..., tuple]:
        if rule.stops_gradient:  # ad.stop_gradient
            return lambda *inputs: tuple(map(self._stop_gradient, inputs))

        def h(*inputs: Any) -> tuple:
            if not any(isinstance(a, Variable) for a in inputs):  # numbers: the value, nothing to differentiate
                return _evaluate(rule.value(*inputs))
            inputs = [pt.as_tensor_variable(a) for a in inputs]
            inner = [a.type() for a in inputs]
            outputs = [pt.as_tensor_variable(o) for o in rule.value(*inner)]
            # symbolic values the rule closes over (of the graph being traced): inputs it does not differentiate
            own = set(map(id, inner))
            free = [v for v in graph_inputs(outputs)
                    if id(v) not in own and not isinstance(v, (Constant, SharedVariable))]
            return tuple(_RuleOp(rule, inner, outputs, free, self.mode)(*inputs, *free, return_list=True))

        return h

    def _stop_gradient(self, a: Any) -> Any:
        # disconnected_grad rather than zero_grad: ZeroGrad's R-op is a float64 zeros(1), not
        # zeros shaped and typed like its input; a numpy array has no derivative to stop
        return disconnected_grad(a) if isinstance(a, Variable) else a

    # ------------------------------------------------------------ compiling
    def _trace(self, body: Callable, call: Callable, wrt: list, *groups: list) -> tuple[list, Any]:
        """``body(call, wrt, *groups)``: the operator's graph from one symbolic run of ``f``."""
        self.trace_count += 1
        try:
            return body(call, wrt, *groups)
        except NullTypeGradError as err:
            refused = _REFUSED.search(str(err))
            if refused is None:
                raise
            raise CompositionError(refused.group(1)) from err  # a derivative a custom function refused
        except TypeError as err:
            match = _CONCRETE.search(str(err))
            if match is None:
                raise
            shapes = (
                " A PyTensor array's .shape is symbolic too: read static sizes with autoray.shape(x) "
                "(x.type.shape), which gives Python ints." if match.group(1) == "integer" else ""
            )
            raise TracedControlFlowError(
                f"f used a symbolic PyTensor value where Python needs a concrete {match.group(1)} (an if/while "
                f"on an array, int(), float() or a Python index): PyTensor runs f once on symbolic inputs to "
                f"build a graph, then compiles it. Write the branch with autoray's where (anp.where(cond, a, b)) "
                f"or pytensor.tensor.switch, or pass the value that decides it as a static Python number in "
                f"args.{shapes}"
            ) from err
        except (ValueError, AttributeError) as err:
            if "TensorVariable" in str(err) or "setting an array element with a sequence" in str(err):
                err.add_note(_SYMBOLIC_HINT)  # f's own exception, type and message unchanged
            raise

    def _graph(self, call: Callable, body: Callable, groups: tuple, wrt: list | None) -> tuple[list, list, int, Any]:
        """Placeholders for ``groups``, and the outputs (operator outputs, then aux leaves) built on them."""
        inputs = [[_placeholder(a) for a in group] for group in groups]
        outputs, aux = self._trace(body, call, inputs[0] if wrt is None else wrt, *inputs[1:])
        aux_outputs, meta = _split_aux(aux)
        return [p for group in inputs for p in group], list(outputs) + aux_outputs, len(outputs), meta

    def _compile(self, call: Callable, body: Callable, groups: tuple, wrt: list | None = None) -> _Compiled:
        inputs, outputs, n, meta = self._graph(call, body, groups, wrt)
        # trust_input: the signature this variant is keyed on fixes every input's type
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_OBJECT_MODE, category=UserWarning)
            with _COMPILING:
                function = pytensor.function(inputs, outputs, mode=_runnable(self.mode), on_unused_input="ignore",
                                             trust_input=True)
        self.compilations += 1
        return _Compiled(function, n, meta)

    def _inline(self, call: Callable, body: Callable, groups: tuple, wrt: list | None = None) -> tuple[list, Any]:
        """Nested use: the operator's graph built into the graph PyTensor is tracing, not compiled."""
        inputs, outputs, n, meta = self._graph(call, body, groups, wrt)
        values = [a if isinstance(a, Variable) else pt.as_tensor_variable(a) for group in groups for a in group]
        outputs = graph_replace(outputs, dict(zip(inputs, values)), strict=False) if outputs else []
        return outputs[:n], _merge_aux(meta, outputs[n:])

    def _run(self, fn: Any, operator: str, body: Callable, *groups: list, wrt: list | None = None,
             call: Callable | None = None) -> tuple[list, Any]:
        """``body``'s outputs for these inputs (``groups``: xs, data, extra), compiled once per input
        signature and kept in ``fn``'s artefacts, or built into the graph being traced (nested use).

        Implicit mode passes ``wrt`` (the shared variables; ``xs`` is empty) and ``call``, the
        function of the arguments that reads them."""
        groups = tuple([_as_input(a) for a in group] for group in groups)
        arrays = [a for group in groups for a in group]
        call = fn if call is None else call
        if any(isinstance(a, Variable) for a in arrays):
            return self._inline(call, body, groups, wrt)
        variant = _signature(arrays)
        if wrt is not None:  # the variables' identities too: the compiled graph holds them, so the ids stay theirs
            variant = (tuple(map(id, wrt)), variant)
        compiled = artefacts(fn, self.backend, operator).get(variant, lambda: self._compile(call, body, groups, wrt))
        return compiled(arrays)

    # ----------------------------------------------------------- graph bodies
    # Each: body(call, wrt, data, *extra) -> (outputs, aux), on symbolic values; `call` is
    # the flat function, `wrt` what is differentiated (placeholders, or shared variables).
    @staticmethod
    def _value(call: Callable, wrt: list, data: list, operator: str | None = None) -> tuple[Any, Any]:
        y, aux = call(wrt, data)
        dtype = _float_dtype(wrt, data)
        y = _narrow(pt.as_tensor_variable(y), dtype)
        if aux is not None and dtype is not None:
            aux = pytree.tree_map(lambda a: _narrow(a, dtype) if _is_symbolic(a) else a, aux)
        if operator is not None:
            _check_scalar(y, operator)
        return y, aux

    @staticmethod
    def _grads(y: Any, wrt: list) -> list:
        grads = pytensor.grad(y, wrt, disconnected_inputs="ignore", return_disconnected="zero")
        return [_like(g, x.dtype) for g, x in zip(grads, wrt)]

    def _value_body(self, call: Callable, wrt: list, data: list) -> tuple[list, Any]:
        y, aux = self._value(call, wrt, data)
        return [y], aux

    def _gradient_body(self, call: Callable, wrt: list, data: list) -> tuple[list, Any]:
        y, aux = self._value(call, wrt, data, "gradient")
        return [y, *self._grads(y, wrt)], aux

    def _vjp_body(self, call: Callable, wrt: list, data: list, dy: list) -> tuple[list, Any]:
        y, _ = self._value(call, wrt, data)
        grads = pullback(y, wrt, dy[0], disconnected_inputs="ignore", return_disconnected="zero")
        return [_like(g, x.dtype) for g, x in zip(grads, wrt)], None

    def _jvp_body(self, call: Callable, wrt: list, data: list, tangents: list) -> tuple[list, Any]:
        y, _ = self._value(call, wrt, data)
        return [_like(_pushforward(y, wrt, tangents), y.dtype)], None

    def _jacobian_body(self, call: Callable, wrt: list, data: list) -> tuple[list, Any]:
        y, _ = self._value(call, wrt, data)
        # reverse mode, one vectorised pullback over the rows of the identity
        jacs = jacobian(y, wrt, disconnected_inputs="ignore", vectorize=True)
        return [y, *(_like(j, y.dtype) for j in jacs)], None

    def _hessian_body(self, call: Callable, wrt: list, data: list) -> tuple[list, Any]:
        y, _ = self._value(call, wrt, data, "hessian")
        (x,) = wrt
        (g,) = self._grads(y, wrt)
        return [_like(jacobian(g, x, disconnected_inputs="ignore", vectorize=True), x.dtype)], None

    def _hvp_body(self, call: Callable, wrt: list, data: list, tangents: list) -> tuple[list, Any]:
        y, _ = self._value(call, wrt, data, "hvp")
        # reverse over reverse: the gradient of <gradient, tangent>
        hv = hessian_vector_product(y, wrt, tangents, disconnected_inputs="ignore")
        return [_like(h, x.dtype) for h, x in zip(hv, wrt)], None

    # ------------------------------------------------------------- primitives
    def value_and_pullback(self, fn: Any, xs: list, data: list) -> tuple[Any, Any, Callable]:
        (y,), aux = self._run(fn, "value", self._value_body, xs, data)

        def vjp(dy: Any) -> list:
            return self._run(fn, "vjp", self._vjp_body, xs, data, [dy])[0]

        return y, aux, vjp

    def value_and_pushforward(self, fn: Any, xs: list, data: list) -> tuple[Any, Any, Callable]:
        (y,), aux = self._run(fn, "value", self._value_body, xs, data)

        def jvp(tangents: list) -> Any:
            return self._run(fn, "jvp", self._jvp_body, xs, data, list(tangents))[0][0]

        return y, aux, jvp

    # ------------------------------------------------------------ fast routes
    def prepare_value_and_gradient(self, fn: Any, xs: list, data: list) -> Callable:
        def run(xs: list, data: list) -> tuple[Any, Any, list]:
            outputs, aux = self._run(fn, "value_and_gradient", self._gradient_body, xs, data)
            return outputs[0], aux, outputs[1:]

        return run

    def jacobian(self, fn: Any, xs: list, data: list) -> tuple[Any, list]:
        outputs, _ = self._run(fn, "jacobian", self._jacobian_body, xs, data)
        return outputs[0], list(outputs[1:])

    def hessian(self, fn: Any, xs: list, data: list) -> Any:
        return self._run(fn, "hessian", self._hessian_body, xs, data)[0][0]

    def hvp(self, fn: Any, xs: list, data: list, tangents: list) -> list:
        return self._run(fn, "hvp", self._hvp_body, xs, data, list(tangents))[0]

    # ------------------------------------------------------------ compile step
    def direct_prepared(self, prepared: Any, xs: list, data: list) -> Callable[..., Any] | None:
        # The gradient of f(x, *arrays) without aux: the graph compiled for these inputs' shapes
        # and dtypes is the whole call, behind a test of each input against them (the function
        # trusts its inputs).  Anything else goes to the core's checked call: its
        # ShapeMismatchError, or (an unprepared operator's, any shape) the graph of that shape.
        fn, arrays = prepared.fn, xs + data
        if (prepared.operator not in ("value_and_gradient", "gradient") or fn.has_aux or not fn._array_args
                or any(type(a) is not np.ndarray for a in arrays)):
            return None
        store, variant, checked = artefacts(fn, self.backend, "value_and_gradient"), _signature(arrays), \
            prepared.check_and_run
        (shape, dtype), forms, value = variant[0], variant[1:], prepared.operator == "value_and_gradient"
        compiled = store.peek(variant)  # else compiled by the first (checked) call, as without this route

        def direct(x: Any, *args: Any) -> Any:
            nonlocal compiled
            if compiled is not None and type(x) is np.ndarray and x.shape == shape and x.dtype == dtype and (
                not forms if not args else len(args) == len(forms) and all(
                    type(a) is np.ndarray and a.shape == s and a.dtype == d for a, (s, d) in zip(args, forms))
            ):
                with compiled.lock:
                    y, g = compiled.function(x, *args)
                return (y, g) if value else g
            out = checked(x, *args)
            if compiled is None:
                compiled = store.peek(variant)
            return out

        return direct


class _Variables:
    """PyTensor's variables, ``pytensor.shared`` ones, and implicit mode's routes, which compile
    graphs reading them with the adapter's machinery (the adapter's ``variables`` hook object)."""

    def __init__(self, adapter: PyTensorAdapter):
        self.adapter = adapter
        self._implicit_plans = PlanCache()

    def is_variable(self, v: Any) -> bool:
        return isinstance(v, SharedVariable)

    def check_variable(self, v: Any, where: str) -> None:
        if not isinstance(v, TensorSharedVariable):
            raise NonDifferentiableInputError(
                f"{where} is a PyTensor shared variable of type {v.type}, not a tensor; only float tensor "
                f"shared variables can be parameters"
            )
        if np.dtype(v.dtype).kind != "f":
            raise NonDifferentiableInputError(
                f"{where} is a PyTensor shared variable of dtype {v.dtype}; only float variables can be parameters"
            )

    def read(self, var: Any) -> np.ndarray:
        return var.get_value()  # a copy (borrow=False)

    def write(self, var: Any, value: Any) -> None:
        value = np.asarray(value)
        old = var.get_value(borrow=True)
        if value.shape != old.shape or value.dtype != old.dtype:
            raise ArgumentTypeError(
                f"cannot assign a {value.dtype} array of shape {value.shape} to a PyTensor shared variable "
                f"holding {old.dtype} of shape {old.shape}"
            )
        var.set_value(value)  # copied (borrow=False): the caller keeps its array

    def current_value(self, var: Any) -> Any:
        return var  # the graph reads the shared variable itself

    def new_variable(self, value: Any) -> Any:
        value = self.adapter.to_numpy(value)
        return pytensor.shared(value.copy(), shape=value.shape)

    def _implicit(self, f: Callable[..., Any], args: tuple, has_aux: bool) -> tuple[Any, list, _ImplicitCall]:
        # f's plan: per f, argument structure, static leaves and what f reads from globals and
        # closures (a compiled graph freezes those), as in explicit mode; the array leaves of
        # args become symbolic inputs
        backend = self.adapter.backend
        fn, _, data = flatten_call(self._implicit_plans, f, None, args, has_aux, True, backend._check_static)
        return fn, [backend.asarray(d) for d in data], _ImplicitCall(fn)

    def implicit_value_and_gradient(self, f: Callable[..., Any], variables: list, args: tuple, has_aux: bool) -> tuple:
        fn, data, call = self._implicit(f, args, has_aux)
        adapter = self.adapter
        outputs, aux = adapter._run(fn, "value_and_gradient", adapter._gradient_body, [], data, wrt=variables,
                                    call=call)
        return outputs[0], aux, outputs[1:]

    def implicit_value_and_pullback(self, f: Callable[..., Any], variables: list, args: tuple) -> tuple:
        fn, data, call = self._implicit(f, args, False)
        adapter = self.adapter
        (y,), _ = adapter._run(fn, "value", adapter._value_body, [], data, wrt=variables, call=call)

        def vjp(dy: Any) -> list:
            dy = adapter.backend.cotangent(dy, y)
            return adapter._run(fn, "vjp", adapter._vjp_body, [], data, [dy], wrt=variables, call=call)[0]

        return y, vjp


# ---------------------------------------------------------------------------------------
# differentiate_with: the custom-derivative hook as a PyTensor Op.
_LIVE_OPS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _live_op(key: int) -> Any:
    return _LIVE_OPS[key]


def _connected(t: Any) -> bool:
    # PyTensor marks an input without a tangent with a DisconnectedType variable
    return t is not None and not isinstance(t.type, DisconnectedType)


class _CustomOp(Op):
    """An Op of 1-D vectors computing ``value`` on numpy arrays (outside PyTensor: another
    library's kernel), differentiated by the rules ``vjps`` and ``jvps``, which build graphs
    of other such Ops.  One per ``custom_function`` call: Ops compare by identity."""

    def __init__(self, value: Callable[..., np.ndarray], vjps: tuple, jvps: tuple, out: tuple[int, str]):
        self.value, self.vjps, self.jvps, self.out = value, vjps, jvps, out

    def __reduce__(self) -> tuple:
        # Numba's object mode pickles the Op it calls back (within this process); the rules
        # hold another library's functions and locks, so the Op pickles as a reference
        _LIVE_OPS[id(self)] = self
        return _live_op, (id(self),)

    def __str__(self) -> str:
        return f"{type(self).__name__}{{{getattr(self.value, '__name__', 'value')}}}"

    def make_node(self, *inputs: Any) -> Apply:
        size, dtype = self.out
        return Apply(self, [pt.as_tensor_variable(a) for a in inputs], [pt.vector(dtype=dtype, shape=(size,))])

    def perform(self, node: Any, inputs: list, outputs: list) -> None:
        out = np.asarray(self.value(*inputs), dtype=self.out[1])
        # PyTensor owns an Op's output, and its inplace rewrites may write into it: the
        # kernel's read-only memory (jax, tensorflow), or an input's (a kernel returning its
        # input), is copied; the Op declares no view_map
        if not out.flags.writeable or any(np.may_share_memory(out, a) for a in inputs):
            out = out.copy()
        outputs[0][0] = out

    def infer_shape(self, fgraph: Any, node: Any, shapes: list) -> list:
        return [(self.out[0],)]

    def pullback(self, inputs: list, outputs: list, cotangents: list) -> list:
        # PyTensor asks for every input's cotangent at once, also for inputs the cost does not
        # reach (its forward mode, a double pullback, differentiates a pullback in its linear
        # argument only): a refused derivative becomes a NullType, an error only where it is used
        # (PyTensor raises NullTypeGradError with the refusal, which _trace turns back into it)
        grads = []
        for i, (rule, x) in enumerate(zip(self.vjps, inputs)):
            try:
                grads.append(rule(cotangents[0], *inputs))
            except CompositionError as err:
                grads.append(grad_undefined(self, i, x, str(err)))
        return grads

    def pushforward(self, inputs: list, outputs: list, tangents: list) -> list:
        terms = [rule(t, *inputs) for rule, t in zip(self.jvps, tangents) if _connected(t)]
        return [pt.add(*terms) if terms else disconnected_type()]


# ---------------------------------------------------------------------------------------
# custom_vjp / custom_jvp: the core's rule as an OpFromGraph whose derivatives are the rule's.
def _evaluate(outputs: Sequence[Any]) -> tuple:
    """The rule's value on numpy inputs as numpy arrays: a rule written with pytensor.tensor
    gives a graph of constants, run once in FAST_COMPILE (numpy per op: no Numba compilation)."""
    symbolic = [o for o in outputs if isinstance(o, Variable)]
    if symbolic:
        with _COMPILING:
            values = iter(pytensor.function([], symbolic, mode=_runnable("FAST_COMPILE"))())
        outputs = [next(values) if isinstance(o, Variable) else o for o in outputs]
    return tuple(np.asarray(o) for o in outputs)


def _transpose(linear: Callable[[list, list], Sequence[Any]], primals: list, like: list, cotangents: list) -> list:
    """The transpose of ``linear(primals, t)``, linear in ``t`` (shaped like ``like``), applied to
    ``cotangents``: its pullback built on root stand-ins, replaced once built.  The point ``t``
    becomes zeros (a linear map's derivative is the same everywhere; a zeros point would let
    PyTensor drop terms); ``primals`` and ``cotangents`` go in untouched (graph_replace copies
    the other variables of the graph it rebuilds, and PyTensor's forward mode differentiates
    with respect to the very cotangent it passed)."""
    stand, points, seeds = ([a.type() for a in group] for group in (primals, like, cotangents))
    grads = pullback(list(linear(stand, points)), points, seeds, disconnected_inputs="ignore",
                     return_disconnected="zero")
    replace = dict(zip(stand + seeds, primals + cotangents)) | {p: pt.zeros_like(a) for p, a in zip(points, like)}
    return graph_replace(grads, replace, strict=False)


def _known_zero(t: Any) -> bool:
    try:
        return pt.get_underlying_scalar_constant_value(t) == 0
    except NotScalarConstantError:
        return False


_CLOSED_OVER = "a custom rule has no derivative for {}, which its value reads without taking it as an input"


def _on_plain(build: Callable[..., list], *groups: list) -> list:
    """``build(*groups)`` built on ordinary root variables standing in for PyTensor's nominal
    ones, which are replaced back once it is built.

    ``pytensor.scan`` differentiates its inner graph on ``NominalVariable`` inputs, whose
    classes PyTensor makes on the fly (``abc.NominalTensorVariable``); autoray picks a library
    by the module of an array's class, so a rule written with autoray (``anp.sin``) would find
    no library ``abc`` and raise its ImportError (a custom function inside ``ad.fori_loop`` or
    ``ad.scan``).  The rule's graph does not depend on which variables it is built on."""
    stands: dict[int, tuple[Any, Any]] = {}

    def plain(v: Any) -> Any:
        if not isinstance(v, NominalVariable):
            return v
        if id(v) not in stands:
            stands[id(v)] = (v, v.type())
        return stands[id(v)][1]

    out = build(*([plain(v) for v in group] for group in groups))
    if not stands:
        return out
    return graph_replace(out, {stand: v for v, stand in stands.values()}, strict=False)


class _RuleOp(OpFromGraph):
    """``rule.value`` as an inlined graph (merged with the residuals' recomputation when
    compiled) whose pullback is ``rule.backward`` (or the transposed ``rule.jvp``) and whose
    pushforward is ``rule.jvp`` (or the transposed pullback), built on the node's inputs in
    differentiable ops: higher derivatives differentiate them, residuals included.

    Ops compare by identity: two rules with one value graph have different derivatives, and
    OpFromGraph's own comparison would run the rule on dummy inputs."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __init__(self, rule: Any, inputs: list, outputs: list, free: list, mode: str | None):
        self.rule, self.n = rule, len(inputs)
        # A Blockwise of this Op (a vectorised Jacobian or Hessian) is not inlined: it compiles
        # the inner graph, in the backend's mode (else PyTensor's default, Numba: minutes for
        # a Hessian through ad.custom_root), and with arguments the value may ignore (the rule
        # defines their derivative: custom_root's ``attached(x, theta)`` is x)
        super().__init__(inputs + free, outputs, inline=True, on_unused_input="ignore", mode=_runnable(mode))

    def connection_pattern(self, node: Any) -> list:
        # every output depends on every input (shared variables the value reads included): the
        # rule, not the value graph, says how
        return [[True] * len(node.outputs)] * len(node.inputs)

    def pullback(self, inputs: list, outputs: list, cotangents: list) -> list:
        rule = self.rule
        grads = _on_plain(self._rule_pullback, inputs[: self.n], outputs, cotangents)
        # a value the rule closes over (a shared variable, a symbolic value): the rule has no derivative for it
        undefined = [grad_undefined(self, i, v, f"{rule.name}: {_CLOSED_OVER.format(v)}")
                     for i, v in enumerate(inputs) if i >= self.n]
        return grads + undefined

    def _rule_pullback(self, args: list, outputs: list, cotangents: list) -> list:
        rule = self.rule.with_inputs(args)  # (a node rebuilt on other inputs keeps the Op)
        cts = [c if _connected(c) else pt.zeros_like(o) for c, o in zip(cotangents, outputs)]
        if rule.has_vjp:
            grads = rule.backward(rule.forward(*args)[1], tuple(cts))
        else:  # a linear jvp rule's transpose, as jax transposes a custom_jvp
            grads = _transpose(lambda xs, t: rule.jvp(tuple(xs), tuple(t))[1], args, args, cts)
        return [_like(pt.as_tensor_variable(g), x.dtype) for g, x in zip(grads, args)]

    def pushforward(self, inputs: list, outputs: list, tangents: list) -> list:
        rule, args = self.rule, inputs[: self.n]
        for v, t in zip(inputs[self.n :], tangents[self.n :]):
            if _connected(t) and not _known_zero(t):  # roots not differentiated get zeros tangents
                raise NullTypeGradError(f"{rule.name}: {_CLOSED_OVER.format(v)}")
        ts = [t if _connected(t) else pt.zeros_like(x) for t, x in zip(tangents, args)]
        return _on_plain(self._rule_pushforward, args, outputs, ts)

    def _rule_pushforward(self, args: list, outputs: list, tangents: list) -> list:
        rule = self.rule.with_inputs(args)  # (a node rebuilt on other inputs keeps the Op)
        if rule.has_jvp:
            out = rule.jvp(tuple(args), tuple(tangents))[1]
        else:  # the pullback's transpose: two applications of the vjp rule
            out = _transpose(lambda xs, u: self._rule_pullback(xs, outputs, u), args, outputs, tangents)
        return [_like(pt.as_tensor_variable(t), o.dtype) for t, o in zip(out, outputs)]

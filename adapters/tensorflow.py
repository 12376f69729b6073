"""TensorFlow: ``tf.GradientTape`` (reverse), ``tf.autodiff.ForwardAccumulator`` (forward).

An adapter of the protocol (:class:`abstractdiff.protocol.Adapter`): ``ad.backend("tensorflow")``
is the core's backend holding a :class:`TensorFlowAdapter`.  Each operator has one body
written for a tape; with ``compile=True`` (the default) the body runs inside a
``tf.function`` kept in the flat function's artefacts (``fn.artefacts(backend, operator)``),
otherwise eagerly.  When the inputs are already symbolic (an abstractdiff operator called
inside a function that TensorFlow is tracing) the body runs directly in that graph: nested
tapes then differentiate through it.  Fast routes: the gradient, the Jacobian (one tape's
``jacobian``, pfor-vectorised), its prepared form, the Hessian and the HVP; the compile step
(:meth:`TensorFlowAdapter.direct_prepared`) compiles a whole prepared call.  Variables:
``tf.Variable`` and Keras 3 variables (:class:`_Variables`).
"""

from __future__ import annotations

import contextvars
import functools
import re
from typing import Any, Callable, NoReturn, Sequence

import numpy as np
import optree
import tensorflow as tf
from tensorflow.python import pywrap_tfe  # whether tapes and accumulators watch a loop's carry
from tensorflow.python.eager import record as _record  # recording ops on tapes and accumulators
from tensorflow.python.framework.errors_impl import InaccessibleTensorError

import abstractdiff._operators
from abstractdiff._arrays import check_scalar, signature
from abstractdiff._backend import OPERATOR_METHODS, AdapterBackend
from abstractdiff._cache import LRU
from abstractdiff._compose import ForeignKernel
from abstractdiff._derived import DerivedOperators
from abstractdiff._errors import (
    AbstractDiffError,
    ArgumentTypeError,
    CompositionError,
    CustomRuleError,
    LoopDerivativeError,
    TracedControlFlowError,
)
from abstractdiff._hooks import AdapterHooks
from abstractdiff._tree import Artefacts, AuxStatics, HasArtefacts, check_output, split_aux
from abstractdiff.protocol import Adapter

from . import _keras

_ZERO = tf.UnconnectedGradients.ZERO


def _is_array(leaf: Any) -> bool:
    # what a tf.function returns as a tensor; a tf.Variable in aux is handed back as itself
    return isinstance(leaf, (tf.Tensor, np.ndarray, np.generic))


def _traced_value_error(err: BaseException) -> TracedControlFlowError | None:
    """Our error for a tf error that only happens because f is being traced, else None."""
    # Only errors that tracing causes: f's own mistakes (an AttributeError such as x.sum()
    # or x.T on a tensor, which fails eagerly too) pass through unchanged, and so do our own
    # errors (a CompositionError naming traced data), whose message already says what to do.
    if isinstance(err, AbstractDiffError):
        return None
    message = str(err)
    if isinstance(err, tf.errors.OperatorNotAllowedInGraphError) or (
        isinstance(err, (TypeError, NotImplementedError))
        and ("SymbolicTensor" in message or "symbolic tf.Tensor" in message)
    ):
        return TracedControlFlowError(
            f"f used a traced TensorFlow value as a concrete Python value (an if/while on a "
            f"tensor, float(), .numpy() or a numpy call) while compiled with tf.function: "
            f"{type(err).__name__}: {message.split('. ')[0].strip()}. Pass "
            f"compile=False (ad.backend('tensorflow', compile=False)) to run eagerly, or "
            f"write the branch with tf.where / autoray's where"
        )
    return None


# TensorFlow's own words for an op given two dtypes: graph (TypeError) and eager (InvalidArgumentError)
_DTYPE_CLASH = re.compile(r"has type \w+ that does not match type \w+|expected to be a \w+ tensor but is a \w+ tensor")


def _float_leaves(fn: Any, xs: list, data: list) -> list[tuple[str, str]]:
    """``(where, dtype)`` of the float leaves of ``xs`` and ``data``: ``x['a']`` by its path in x
    where ``fn`` is the core's flat function, else by position."""
    try:
        paths = optree.treespec_paths(fn.x_treedef)
        x_names = [f"x{''.join(f'[{k!r}]' for k in paths[i])}" for i in fn.diff_index]
    except (AttributeError, IndexError, TypeError):  # one of the core's derived functions
        x_names = [f"x leaf {i}" for i in range(len(xs))]
    named = [*zip(x_names, xs), *((f"argument leaf {i}", a) for i, a in enumerate(data))]
    return [(where, a.dtype.name) for where, a in named if getattr(getattr(a, "dtype", None), "is_floating", False)]


def _mixed_dtypes_error(err: BaseException, fn: Any, xs: list, data: list) -> ArgumentTypeError | None:
    """Our error for an op that met two float dtypes when ``f``'s own inputs carry two: TensorFlow
    never promotes dtypes (numpy, jax and torch do), so ``f`` has to cast; else None."""
    floats = _float_leaves(fn, xs, data)
    if not _DTYPE_CLASH.search(str(err)) or len({dtype for _, dtype in floats}) < 2:
        return None
    listed = ", ".join(f"{where}: {dtype}" for where, dtype in floats)
    first = str(err).strip().splitlines()[0]
    return ArgumentTypeError(
        f"f combined tensors of two float dtypes, which TensorFlow does not promote "
        f"({type(err).__name__}: {first}); its inputs are {listed}. Cast inside f where the "
        f"leaves meet (tf.cast(v, tf.float64), or autoray's ar.astype(v, 'float64')), or pass "
        f"these inputs in one dtype (each leaf of x keeps its own dtype through the operators)"
    )


def _check_scalar(y: Any, operator: str) -> None:
    # at trace time, before the tape is asked; a shape left unknown by the user's own
    # tf.function (nested use) cannot be checked here
    if y.shape.is_fully_defined():
        check_scalar(y, operator)


def _watched(tape: tf.GradientTape, xs: list) -> list:
    tape.watch(xs)
    return xs


def _dense(g: Any) -> Any:
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _gradients(tape: tf.GradientTape, y: Any, xs: list, dy: Any = None) -> list:
    """``tape.gradient``: zeros for an unconnected leaf, and dense tensors where TensorFlow
    gives ``IndexedSlices`` (the gradient of ``tf.gather``, autoray's ``take``), which are no
    arrays to the caller and which a forward accumulator cannot differentiate again."""
    return [_dense(g) for g in tape.gradient(y, xs, output_gradients=dy, unconnected_gradients=_ZERO)]


#: How many custom rules (ad.custom_vjp, ad.custom_root...) have been recorded on tapes so far: a
#: Jacobian whose function recorded one is taken row by row where it is differentiated again
#: (see _jacobian_of)
_RULES_RECORDED = [0]


def _jacobian_of(tape: tf.GradientTape, y: Any, x: Any, rules_before: int) -> Any:
    """``tape.jacobian(y, x)`` (zeros where unconnected), pfor-vectorised, or row by row (the
    tape is then persistent: :func:`_jacobian_tape`) where pfor would be silently wrong: when
    the Jacobian is differentiated again (a tape or an accumulator outside ``tape`` watches
    ``y``: call this after leaving ``tape``'s context) and ``y``'s function recorded a custom
    rule since ``rules_before``.  pfor rewrites each op that depends on the row index into a
    plain op, and the IdentityN of a custom gradient (``tf.custom_gradient`` in a graph, how a
    rule's outputs are differentiated there) loses its gradient override: a rule called in a
    backward on the cotangent (ad.custom_root's adjoint solve, a custom_vjp whose bwd calls
    another) is differentiated through its forward value there, not by its rule (a third
    derivative of 0 where the rule stops the forward's gradient).  The rows are a Python loop,
    one backward pass each: TensorFlow's own row loop (``experimental_use_pfor=False``) is a
    tf.while_loop, where a rule that takes derivatives cannot run."""
    n = y.shape.num_elements()
    if _RULES_RECORDED[0] == rules_before or not _differentiated(y):
        return tape.jacobian(y, x, unconnected_gradients=_ZERO)
    refusal = CompositionError(
        "TensorFlow cannot take this Jacobian (or a Hessian's second pass) through a custom rule while an "
        "outer tape or accumulator differentiates it again through a tensor f captures rather than one of "
        "its inputs (or where the output's size is unknown): its vectorised Jacobian would lose the rule. "
        "Pass the watched tensor to f as an argument, or use another backend for this derivative"
    )
    if n is None:
        raise refusal
    sources = x if isinstance(x, list) else [x]
    eye = tf.reshape(tf.eye(n, dtype=y.dtype), [n, *y.shape])
    try:
        rows = [_gradients(tape, y, sources, eye[i]) for i in range(n)]  # rows[i][k]: d y_i / d sources[k]
    except RuntimeError as err:  # a tape _jacobian_tape did not make persistent: one gradient only
        raise refusal from err
    out = [tf.reshape(tf.stack([row[k] for row in rows]) if n else tf.zeros([0], s.dtype),
                      y.shape.concatenate(s.shape)) for k, s in enumerate(sources)]
    return out if isinstance(x, list) else out[0]


def _jacobian_tape(xs: list) -> tf.GradientTape:
    """The tape of a Jacobian for :func:`_jacobian_of`: persistent where that Jacobian may be
    differentiated again (eagerly, or under another tape or an accumulator watching ``xs``),
    which its row loop needs.  Not otherwise: in a graph a persistent tape counts as a second
    differentiation and turns every ad.fori_loop/ad.scan under it into a Python loop (see
    _graph_loop), which under an outer differentiation they are already."""
    tensors = [v for v in xs if tf.is_tensor(v)]
    nested = not pywrap_tfe.TFE_Py_TapeSetIsEmpty() or pywrap_tfe.TFE_Py_TapeSetPossibleGradientTypes(tensors) > 0
    return tf.GradientTape(persistent=tf.executing_eagerly() or nested)


def _implicit_output(out: Any) -> Any:
    y = check_output(out)
    return y if tf.is_tensor(y) else tf.constant(np.asarray(y))


_EAGER = type(tf.constant(0.0))  # TensorFlow's eager tensor type
#: Prepared operators whose results are tensors only (no closures), which a tf.function can return.
_DIRECT_OPERATORS = frozenset({
    "gradient", "value_and_gradient", "jacobian", "value_and_jacobian", "hessian", "value_gradient_and_hessian",
    "hvp", "gradient_and_hvp", "derivative", "value_and_derivative", "second_derivative",
    "value_derivative_and_second_derivative",
})



def _abstractdiff_error(err: BaseException) -> BaseException | None:
    """``err`` if it is one of ours, or ours that autograph wrapped (it keeps the original
    as the new error's context), else None."""
    while err is not None:
        if isinstance(err, AbstractDiffError):
            return err
        if not hasattr(err, "ag_error_metadata") and "while vectorizing" not in str(err):  # pfor's wrapping too
            return None
        err = err.__cause__ or err.__context__
    return None


def _raise_ours(err: BaseException, traced: bool = False) -> NoReturn:
    """Raise for ``err``, caught from a compiled call: ours as itself (autograph or pfor wrap
    it), what only tracing causes (``traced``) as :func:`_traced_value_error`, else ``err``."""
    if traced and (mapped := _traced_value_error(err)) is not None:
        raise mapped from err
    ours = _abstractdiff_error(err)
    if ours is None or ours is err:
        raise err
    raise ours from None


def _graph_boundary(outputs: list, grad: Callable) -> Callable:
    """A custom rule's ``outputs`` as a ``tf.custom_gradient`` of its inputs whose gradient is
    ``grad``: the graph's own gradient (IdentityN), for the symbolic gradients of a
    tf.function called under a tape and for tf.gradients (made in graphs only)."""

    @tf.custom_gradient
    def boundary(*_: Any) -> tuple:
        return [tf.identity(o) for o in outputs], grad

    return boundary


def _differentiated(x: Any) -> bool:
    """Whether a tape or a forward accumulator is watching ``x`` now (TensorFlow's own test
    for whether a function's gradient may be differentiated again)."""
    return pywrap_tfe.TFE_Py_TapeSetPossibleGradientTypes([x]) != 0


def _refusal(kernel: Any, watched: bool) -> CompositionError:
    """The refusal of a derivative of the boundary's gradient: a second derivative (``watched``),
    or forward mode in a graph, which the adapter's compiled operators rerun eagerly."""
    what = "second derivatives are" if watched else "forward mode inside tf.function is (eagerly it works)"
    calling = f"a {kernel.backend.name} kernel" if isinstance(kernel, ForeignKernel) else "a custom function"
    err = CompositionError(
        f"through differentiate_with's boundary (tensorflow code calling {calling}), {what} not "
        f"supported: use reverse mode once through it, or write the kernel in tensorflow (a "
        f"tensorflow kernel nests natively)"
    )
    err.eager_would_work = not watched  # forward mode alone, traced: f reruns eagerly
    return err


def _refusing(t: Any, kernel: Any, watched: bool) -> Any:
    """``t``, whose gradient raises :func:`_refusal`."""

    @tf.custom_gradient
    def identity(t: Any) -> Any:
        # not converted by autograph, which would wrap the error in a StagingError
        @tf.autograph.experimental.do_not_convert
        def refuse(_: Any) -> Any:
            raise _refusal(kernel, watched)

        return tf.identity(t), refuse

    return identity(t)


class _Variables:
    """The variable hooks (the adapter's ``variables``): ``tf.Variable`` (and ``tf.Module``);
    Keras 3 variables (on the tensorflow Keras backend), which wrap one, are added by
    :class:`_keras.WithKerasVariables`."""

    def __init__(self, adapter: TensorFlowAdapter):
        self.adapter = adapter  # its ``backend`` (the holder), set after construction, for core services

    def is_variable(self, v: Any) -> bool:
        return isinstance(v, tf.Variable)

    def check_variable(self, v: Any, where: str) -> None:
        AdapterHooks.check_variable(self.adapter.backend, v, where)  # the core's dtype check

    def model_variables(self, obj: Any) -> tuple[list, int] | None:
        # tf.Module (not a tf.Variable, which has .variables too)
        if isinstance(obj, tf.Variable) or not (hasattr(obj, "trainable_variables") and hasattr(obj, "variables")):
            return None
        trainable = list(obj.trainable_variables)
        ids = {id(v) for v in trainable}
        return trainable, len([v for v in obj.variables if id(v) not in ids])

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        return None if self.model_variables(obj) is None else [("", v) for v in obj.variables]

    def read(self, var: Any) -> Any:
        return var.read_value()

    def write(self, var: Any, value: Any) -> None:
        var.assign(value)

    current_value = read  # read_value is recorded on the tape

    def new_variable(self, value: Any) -> Any:
        return tf.Variable(value)

    def implicit_value_and_gradient(self, f: Callable[..., Any], variables: list, args: tuple, has_aux: bool) -> tuple:
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(variables)
            y, aux = split_aux(f(*args), has_aux)
            y = _implicit_output(y)
        check_scalar(y)
        return y, aux, _gradients(tape, y, variables)

    def implicit_value_and_pullback(self, f: Callable[..., Any], variables: list, args: tuple) -> tuple:
        # persistent: the pullback may be called more than once
        with tf.GradientTape(watch_accessed_variables=False, persistent=True) as tape:
            tape.watch(variables)
            y = _implicit_output(f(*args))

        def vjp(dy: Any) -> list:
            return _gradients(tape, y, variables, tf.cast(self.adapter.backend.cotangent(dy, y), y.dtype))

        return y, vjp


def _typed(values: list, like: list) -> list:
    return [tf.cast(v, c.dtype) for v, c in zip(values, like)]  # tf.while_loop keeps the carry's dtypes


def _weak(value: Any) -> bool:
    """Whether ``value`` is a Python number (not a bool): jax's weakly typed value, whose dtype
    is the one the loop's step gives it (``0.0 + x`` is float64 for a float64 ``x``)."""
    return isinstance(value, (int, float, complex)) and not isinstance(value, bool)


def _dtypes_settled(step: Callable[[list], list], carry: list) -> list:
    """``carry`` as tensors, each Python number in it of the dtype one ``step`` makes of it.

    A tf.while_loop keeps its carry's dtypes.  A carry that starts as a Python number
    (``fori_loop(0, n, body, (0.0, x))``) takes its dtype from the step in jax (a weakly typed
    value, promoted to the body's output dtype before the loop) and in the core's Python loop
    (TensorFlow converts a Python number to the other operand's dtype): converted first,
    ``0.0`` would be float32 and the step would add it to float64 tensors, which TensorFlow
    does not promote.  So, as jax does, the step is traced once with the Python numbers as they
    are, in a graph of its own that never runs (nothing of it reaches the caller's graph: not
    a stateful op either), and the loop starts from them in the dtypes it gave them."""
    if not any(map(_weak, carry)):
        return [tf.convert_to_tensor(c) for c in carry]
    probe = tf.function(lambda: [tf.convert_to_tensor(v) for v in step(list(carry))], autograph=False)
    dtypes = [t.dtype for t in probe.get_concrete_function().structured_outputs]
    return [tf.constant(np.asarray(c).astype(d.as_numpy_dtype)) if _weak(c) else tf.convert_to_tensor(c)
            for c, d in zip(carry, dtypes)]


def _in_while_body() -> bool:
    """Whether ops are being built into a tf.while_loop's body (the innermost graph or one it
    is nested in)."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if type(graph).__name__ == "WhileBodyFuncGraph":
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


# pfor (tf.vectorized_map, our batched forward mode) cannot vectorise the forward mode of a
# tf.while_loop built in another one's body: the accumulators of the inner loop's gradient lose
# their handle data in the outer loop's ("ValueError: Required handle data not set", TensorFlow
# 2.x).  So under it only one of two nested loops is a tf.while_loop, the other the core's
# Python loop, which pfor vectorises op by op: an inner ad.fori_loop or ad.scan runs as one
# (_graph_loop); an inner ad.while_loop, which needs a loop, asks the ad.fori_loop or ad.scan
# it is in to run as one (_ENCLOSING), and raises where it is in no such loop.
#: Set while our batched forward mode (tf.vectorized_map over a ForwardAccumulator) traces f.
_VECTORIZED_FORWARD = contextvars.ContextVar("abstractdiff_tensorflow_vectorized_forward", default=False)
#: While an ad.fori_loop or ad.scan builds its tf.while_loop: a list that an ad.while_loop in its
#: body appends to, asking it to run as a Python loop instead (under _VECTORIZED_FORWARD).
_ENCLOSING: contextvars.ContextVar[list | None] = contextvars.ContextVar("abstractdiff_tensorflow_loop", default=None)


def _graph_loop(leaves: list) -> bool:
    # eagerly, and under two differentiations at once (a ForwardAccumulator cannot go through
    # tf.while_loop's gradient), the core's Python loop, which the tapes record as it runs
    tensors = [v for v in leaves if tf.is_tensor(v)]
    if tf.executing_eagerly() or pywrap_tfe.TFE_Py_TapeSetPossibleGradientTypes(tensors) >= 2:
        return False
    return not (_VECTORIZED_FORWARD.get() and _in_while_body())  # nested, vectorised: see above


def _bounded_while(build: Callable[[], Any]) -> Any:
    """``_forward_while(build)`` for ad.fori_loop and ad.scan, or NotImplemented (the core's
    Python loop) where an ad.while_loop in the body asked for it (see _ENCLOSING)."""
    inner: list = []
    token = _ENCLOSING.set(inner)
    try:
        out = _forward_while(build)
    finally:
        _ENCLOSING.reset(token)
    return NotImplemented if inner else out


def _write(stack: Any, i: Any, y: Any) -> Any:
    """``y`` as row ``i`` of a TensorArray or of a dense tensor."""
    return stack.write(i, y) if isinstance(stack, tf.TensorArray) else tf.tensor_scatter_nd_update(stack, [[i]], [y])


# What building a tf.while_loop raises where TensorFlow's forward mode cannot go through it
# (see _forward_while); a Python loop of the same steps can.
_UNBUILDABLE = (InaccessibleTensorError, CustomRuleError)


def _forward_while(build: Callable[[], Any]) -> Any:
    """``build()`` (a tf.while_loop), or NotImplemented (the core's Python loop, which the
    accumulator records op by op, each custom rule's jvp included) where TensorFlow cannot
    build its forward mode.

    A ForwardAccumulator takes a While op's tangents from the gradient of its gradient, built
    as soon as the loop is.  A custom gradient in the body (a custom rule's, or the user's
    tf.custom_gradient) closes over the body's tensors, which that second loop cannot reach
    (InaccessibleTensorError); an ad.custom_jvp's rule has no gradient to give it (its
    CustomRuleError, which says reverse mode).  Both are raised while the loop is built,
    before it runs.  An error of the body itself is raised again by the Python loop."""
    try:
        return build()
    except _UNBUILDABLE:
        return NotImplemented


class _Loops:
    """ad.fori_loop, ad.scan and ad.while_loop as one tf.while_loop in a graph (tf.function);
    a carry that starts as a Python number takes the dtype the step gives it (_dtypes_settled)."""

    def fori_loop(self, lower: int, upper: int, body: Callable, init: list) -> Any:
        if not _graph_loop(init):
            return NotImplemented
        first = tf.constant(lower)
        loop = (first, _dtypes_settled(lambda c: body(first, c), init))
        step = lambda i, c: (i + 1, _typed(body(i, list(c)), c))  # noqa: E731
        out = _bounded_while(lambda: tf.while_loop(lambda i, _: i < upper, step, loop,
                                                   maximum_iterations=upper - lower))
        return out if out is NotImplemented else out[1]

    def scan(self, f: Callable, init: list, xs: list, length: int) -> Any:
        if not _graph_loop(init + xs):
            return NotImplemented
        xs = [tf.convert_to_tensor(x) for x in xs]
        init = _dtypes_settled(lambda c: f(c, [x[0] for x in xs])[0], init)
        first, ys = f(init, [x[0] for x in xs])  # step 0 outside the loop: it tells ys' dtypes and shapes
        first, ys = _typed(first, init), [tf.convert_to_tensor(y) for y in ys]
        # A TensorArray's handle has no tangent, so forward mode (a ForwardAccumulator: ours or
        # the caller's) fails on it, as on tf.scan; where step 0's values carry a tangent, ys
        # are stacked in dense tensors (a copy per step, ~1.5x slower), else in TensorArrays.
        dense = pywrap_tfe.TFE_Py_PackJVPs(init + xs + first + ys)[1]
        arrays = [_write(tf.zeros(tf.concat([[length], tf.shape(y)], 0), y.dtype) if dense else
                         tf.TensorArray(y.dtype, size=length, element_shape=y.shape), 0, y) for y in ys]

        def step(i: Any, c: list, arrays: list) -> tuple:
            new, y = f(list(c), [tf.gather(x, i) for x in xs])
            return i + 1, _typed(new, c), [_write(a, i, v) for a, v in zip(arrays, y)]

        loop = (tf.constant(1), first, arrays)
        out = _bounded_while(lambda: tf.while_loop(lambda i, *_: i < length, step, loop,
                                                   maximum_iterations=length - 1))
        if out is NotImplemented:
            return out  # the core's Python loop, step 0 again
        _, carry, arrays = out
        return carry, [a if dense else a.stack() for a in arrays]

    def while_loop(self, cond: Callable, body: Callable, init: list) -> Any:
        if tf.executing_eagerly():
            return NotImplemented
        if _VECTORIZED_FORWARD.get() and _in_while_body():  # see _ENCLOSING
            enclosing = _ENCLOSING.get()
            if enclosing is None:
                raise LoopDerivativeError(
                    "TensorFlow cannot vectorise the forward-mode derivative of ad.while_loop inside another "
                    "while loop's body (tf.vectorized_map, which batched forward mode and ad.Sparse's products "
                    "use, fails on the nested loops' gradient: 'Required handle data not set'). Make one of the "
                    "two loops an ad.fori_loop or ad.scan with a bound (it then runs as a traced Python loop), "
                    "or use ad.backend('tensorflow', compile=False)"
                )
            enclosing.append(True)
        init = _dtypes_settled(body, init)
        token = _ENCLOSING.set(None)  # a while_loop in this one's body cannot ask it to unroll
        try:
            return tf.while_loop(lambda c: cond(list(c)), lambda c: (_typed(body(list(c)), c),), (init,))[0]
        except _UNBUILDABLE as err:  # see _forward_while; a Python loop needs cond's value
            raise LoopDerivativeError(
                "TensorFlow cannot build the forward-mode derivative of ad.while_loop here: it takes a "
                "tf.while_loop's tangents from the loop's gradient, which cannot go through the custom rule in "
                f"its body inside tf.function ({type(err).__name__}: {str(err).splitlines()[0][:200]}). Use "
                "ad.fori_loop or ad.scan with a bound (they run as a traced Python loop then), reverse mode, or "
                "ad.backend('tensorflow', compile=False)"
            ) from err
        finally:
            _ENCLOSING.reset(token)


#: Compiled functions kept per step function (one per signature: group lengths, dtypes, shapes).
_CONCRETE_PER_STEP = 16


class TensorFlowAdapter(Adapter):
    name = "tensorflow"
    extra = "tensorflow"
    modules = ("tensorflow", "keras", "tf_keras")
    fast_routes = {
        "value_and_gradient": "value_and_gradient", "jacobian": "jacobian", "prepare_jacobian": "prepare_jacobian",
        "hessian": "hessian", "hvp": "hvp",
    }

    def __init__(self, *, device: str = "cpu", compile: bool = True):
        if not isinstance(compile, bool):
            raise ArgumentTypeError(f"compile must be True or False, got {compile!r}")
        super().__init__(device=device, compile=compile)
        self.compile = compile
        self.reuses_traces = bool(compile)  # a compiled trace freezes what f reads (see Adapter.reuses_traces)
        # the core's canonical "cuda:N" is TensorFlow's "/GPU:N"
        self.tf_device = "/CPU:0" if self.device == "cpu" else f"/GPU:{self.device.partition(':')[2]}"
        #: Number of times a tf.function body was traced (tests assert it stays put).
        self.trace_count = 0
        self.variables = _keras.WithKerasVariables(_Variables(self), "tensorflow")
        self.loops = _Loops()  # the loop hooks (ad.scan...): tf.while_loop in graphs
        self.compiler = self._compiler if compile else None  # whole train_steps, sparse calls: a tf.function

    def _compiler(self, step: Callable, assigns_variables: bool = False) -> Callable:
        # A graph assigns tf.Variables (and Keras 3 variables) itself.  One concrete function
        # per signature (each group's length, each tensor's dtype and shape: all the trace
        # depends on besides what the caller keys), called flat: tf.function's own dispatch
        # costs ~20 us per tensor argument, and a whole step's state is dozens of tensors.
        # XLA (jit_compile) fuses the step's elementwise passes; a graph XLA cannot compile
        # (an op without an XLA kernel) fails at its first call, before it runs, and runs
        # as a plain graph from then on.  A graph that cannot even be traced for XLA runs as
        # a plain graph too: in an XLA context TensorFlow builds some gradients from XLA ops
        # that have no gradient themselves (Slice's is XlaDynamicUpdateSlice, met by the
        # gradients of concatenate, pad and tf.while_loop), so forward over reverse (a sparse
        # Hessian's products) raises a LookupError there and works in a plain graph.
        # Once more signatures than the cache holds have been seen (a step cycling through
        # many batch shapes), new ones are plain graphs: XLA keeps every executable it
        # compiled until the process ends, so each evicted and retraced XLA function grew the
        # process (about 1.2 MB a step), while a plain graph is freed with its function.  Each
        # shape keeps its own exact trace: a graph of unknown sizes (tf.function's
        # reduce_retracing) would be shared, but a loss that reads a size in Python
        # (`if x.shape[0] == 5`) would silently compute something else in it.
        concrete: LRU[tuple, list] = LRU(  # signature -> [concrete function, whether it ran]
            _CONCRETE_PER_STEP, name="tensorflow compiled steps",
            keyed_on="the step; group lengths, dtypes and shapes",
        )
        xla = [True]

        def build(sizes: tuple, flat: list) -> list:
            if len(concrete) >= _CONCRETE_PER_STEP:
                xla[0] = False
            return self._traced_concrete(step, sizes, flat, xla[0])

        def run(*groups: Any) -> Any:
            sizes = tuple(len(g) if isinstance(g, list) else -1 for g in groups)
            flat = [a if isinstance(a, tf.Tensor) else tf.convert_to_tensor(a)
                    for g in groups for a in (g if isinstance(g, list) else (g,))]
            key = (sizes, signature(flat))
            entry = concrete.get_or_build(key, lambda: build(sizes, flat))
            try:  # (the call's public form would re-parse its arguments)
                out = entry[0]._call_flat(flat, entry[0].captured_inputs)
            except tf.errors.OpError:  # XLA cannot compile it (a real error is raised again below)
                if entry[1]:
                    raise
                entry[0] = self._concrete(step, sizes, flat, False)
                out = entry[0]._call_flat(flat, entry[0].captured_inputs)
            entry[1] = True
            return out

        return run

    def _traced_concrete(self, step: Callable, sizes: tuple, flat: list, xla: bool = True) -> list:
        """``[concrete function, whether it ran]``: traced for XLA (where ``xla``), else (a trace
        only XLA's context fails, see :meth:`_compiler`) as a plain graph, which counts as having
        run (an error at its call is the step's own).  An error of the plain trace is ``f``'s:
        raised as ours where it is one (autograph and pfor wrap it in a StagingError) or one
        that only tracing causes (a numpy call on a traced tensor)."""
        if xla:
            try:
                return [self._concrete(step, sizes, flat, True), False]
            except Exception as err:  # noqa: BLE001 - retraced as a plain graph, which says what is wrong
                if (ours := _abstractdiff_error(err)) is not None:
                    raise ours from None  # a refusal (a custom rule's): the same in a plain graph
        try:
            return [self._concrete(step, sizes, flat, False), True]
        except Exception as err:
            _raise_ours(err, traced=True)

    def _concrete(self, step: Callable, sizes: tuple, flat: list, xla: bool) -> Any:
        bounds = np.cumsum([0, *(n if n >= 0 else 1 for n in sizes)]).tolist()

        def traced(*flat: Any) -> Any:
            with tf.device(self.tf_device):  # baked into the graph at trace time
                return step(*(list(flat[a:b]) if n >= 0 else flat[a] for n, a, b in zip(sizes, bounds, bounds[1:])))

        specs = map(tf.TensorSpec.from_tensor, flat)
        return tf.function(traced, autograph=False, jit_compile=xla).get_concrete_function(*specs)

    # ---------------------------------------------------------------- devices
    def devices(self) -> list[str]:
        # canonical names: TensorFlow's GPU builds run on CUDA, so its "/GPU:N" is "cuda:N"
        return ["cpu"] + [f"cuda:{i}" for i in range(len(tf.config.list_logical_devices("GPU")))]

    # ---------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        return isinstance(a, (tf.Tensor, tf.Variable))

    def from_numpy(self, a: np.ndarray) -> Any:
        with tf.device(self.tf_device):  # eager constants are made on the host: identity copies them to the device
            return tf.convert_to_tensor(a) if self.device == "cpu" else tf.identity(a)

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a.numpy())

    def from_dlpack(self, a: Any) -> Any:
        # Shares contiguous memory aligned to 64 bytes (TensorFlow imports any, but its kernels
        # then abort the process on misaligned memory: numpy's large arrays are aligned to 16)
        # by the old DLPack capsule, which numpy will not make of read-only memory.  The rest
        # copies, as does any device other than the CPU.
        if self.device == "cpu" and hasattr(a, "__dlpack__"):
            try:
                view = a if isinstance(a, np.ndarray) else np.from_dlpack(a)
                if view.flags.c_contiguous and view.__array_interface__["data"][0] % 64 == 0:
                    return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
            except (BufferError, TypeError, RuntimeError, tf.errors.InvalidArgumentError):
                pass
        return super().from_dlpack(a)

    def numpy_view(self, a: Any) -> np.ndarray:
        return np.asarray(a)  # an eager CPU tensor's memory, read-only (.numpy() copies)

    def snapshot(self, a: Any) -> Any:
        # tensors are immutable; a variable is not: keep its current value
        return tf.identity(a) if isinstance(a, tf.Variable) else a

    def cast(self, a: Any, dtype: str) -> Any:
        return tf.cast(a, dtype)

    def asarray_like(self, a: np.ndarray, like: Any) -> Any:
        with tf.device(like.device):
            return tf.identity(tf.convert_to_tensor(a))

    # ---------------------------------------------------------------- running
    def _run(self, fn: Any, kind: str, body: Callable, *groups: list) -> tuple:
        """``body(fn, *groups) -> (outputs, aux)``, compiled and cached in ``fn``'s artefacts."""
        try:
            return self._run_body(fn, kind, body, *groups)
        except Exception as err:
            _raise_ours(err)  # autograph rewraps an error it cannot rebuild in a StagingError

    def _run_body(self, fn: Any, kind: str, body: Callable, *groups: list) -> tuple:
        if not (self.compile and tf.executing_eagerly()):
            with tf.device(self.tf_device):
                return body(fn, *groups)
        store = fn.artefacts(self.backend, kind) if isinstance(fn, HasArtefacts) else Artefacts(kind)
        if store.peek("eager"):  # f calls a foreign kernel whose forward mode works eagerly only
            with tf.device(self.tf_device):
                return body(fn, *groups)
        # tf.function retraces per input signature itself; the device is baked into the
        # graph at trace time and is one of the backend's options (part of the store's key)
        # flat positional tensors: a tf.function call with nested lists costs ~35 us more
        sizes = tuple(map(len, groups))
        compiled, statics = store.get(("tf.function", sizes), lambda: self._compiled(fn, body, sizes))
        try:
            outputs, aux_arrays = compiled(*[a for group in groups for a in group])
        except Exception as err:
            if getattr(_abstractdiff_error(err), "eager_would_work", False):
                store.put("eager", True)
                with tf.device(self.tf_device):
                    return body(fn, *groups)
            _raise_ours(err, traced=True)
        if not getattr(fn, "has_aux", True):
            return outputs, None
        # tf.function can only return tensors: aux's other leaves (ints, strings,
        # variables) were set aside at trace time, per input signature.
        return outputs, statics.join(signature(*groups), aux_arrays)

    def _compiled(self, fn: Any, body: Callable, sizes: tuple[int, ...]) -> tuple:
        statics = AuxStatics(_is_array)
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]

        def traced(*flat: Any) -> tuple:
            groups = [list(flat[a:b]) for a, b in zip(bounds, bounds[1:])]
            self.trace_count += 1
            # The device scope is entered at trace time and baked into the graph: entering
            # it around every call of the compiled function would cost ~10 us per call.
            with tf.device(self.tf_device):
                outputs, aux = body(fn, *groups)
            return outputs, statics.split(signature(*groups), aux)

        # autograph off: it would silently rewrite some Python control flow on tensors and
        # not other, where jax and torch.compile reject it; one rule for every backend.
        return tf.function(traced, autograph=False), statics

    # ----------------------------------------------------------- bodies
    @staticmethod
    def _call(fn: Any, xs: list, data: list) -> tuple:
        try:
            y, aux = fn(xs, data)
        except (TypeError, tf.errors.InvalidArgumentError) as err:
            mixed = _mixed_dtypes_error(err, fn, xs, data)
            if mixed is None:
                raise
            raise mixed from err
        return tf.convert_to_tensor(y), aux

    def _gradient(self, fn: Any, xs: list, data: list) -> tuple:
        with tf.GradientTape() as tape:
            y, aux = self._call(fn, _watched(tape, xs), data)
            _check_scalar(y, "gradient")
        return (y, _gradients(tape, y, xs)), aux

    def _vjp(self, fn: Any, xs: list, data: list, dy: list) -> tuple:
        with tf.GradientTape() as tape:
            y, _ = self._call(fn, _watched(tape, xs), data)
        return _gradients(tape, y, xs, dy[0]), None

    def _jvp(self, fn: Any, xs: list, data: list, ts: list) -> tuple:
        with tf.autodiff.ForwardAccumulator(xs, ts) as acc:
            y, _ = self._call(fn, xs, data)
        return acc.jvp(y, unconnected_gradients=_ZERO), None

    def _batched_vjp(self, fn: Any, xs: list, data: list, dys: list) -> tuple:
        # one tape, its gradient vectorised over the batch by pfor (tape.jacobian's own route)
        rules = _RULES_RECORDED[0]
        with tf.GradientTape(persistent=True) as tape:
            y, _ = self._call(fn, _watched(tape, xs), data)

        def vjp(dy: Any) -> list:
            return _gradients(tape, y, xs, dy)

        n = dys[0].shape[0]
        if _RULES_RECORDED[0] != rules and n is not None and (_differentiated(y) or _differentiated(dys[0])):
            # one pullback at a time, where pfor would be silently wrong (see _jacobian_of)
            rows = [vjp(dys[0][i]) for i in range(n)]
            return [tf.stack([row[k] for row in rows]) if n else tf.zeros([0, *x.shape], x.dtype)
                    for k, x in enumerate(xs)], None
        return tf.vectorized_map(vjp, dys[0]), None

    def _batched_jvp(self, fn: Any, xs: list, data: list, ts: list) -> tuple:
        def jvp(ts: list) -> Any:
            token = _VECTORIZED_FORWARD.set(True)  # nested loops unrolled: see _graph_loop
            try:
                with tf.autodiff.ForwardAccumulator(xs, ts) as acc:
                    y, _ = self._call(fn, xs, data)
                return acc.jvp(y, unconnected_gradients=_ZERO)
            finally:
                _VECTORIZED_FORWARD.reset(token)

        return tf.vectorized_map(jvp, ts), None

    def _jacobian(self, fn: Any, xs: list, data: list) -> tuple:
        rules = _RULES_RECORDED[0]
        with _jacobian_tape(xs) as tape:
            y, _ = self._call(fn, _watched(tape, xs), data)
        return (y, _jacobian_of(tape, y, xs, rules)), None

    def _jacobian_only(self, fn: Any, xs: list, data: list) -> tuple:
        # what a prepared jacobian needs: no value, and one source rather than a list of one
        rules = _RULES_RECORDED[0]
        with _jacobian_tape(xs) as tape:
            y, _ = self._call(fn, _watched(tape, xs), data)
        if len(xs) == 1:
            return [_jacobian_of(tape, y, xs[0], rules)], None
        return _jacobian_of(tape, y, xs, rules), None

    def _hessian(self, fn: Any, xs: list, data: list) -> tuple:
        rules = _RULES_RECORDED[0]
        with _jacobian_tape(xs) as outer:
            with tf.GradientTape() as inner:
                y, _ = self._call(fn, _watched(inner, _watched(outer, xs)), data)
                _check_scalar(y, "hessian")
            (g,) = _gradients(inner, y, xs)
        return _jacobian_of(outer, g, xs[0], rules), None

    def _hvp(self, fn: Any, xs: list, data: list, ts: list) -> tuple:
        # forward-over-reverse: one gradient pass carrying a tangent
        with tf.autodiff.ForwardAccumulator(xs, ts) as acc:
            with tf.GradientTape() as tape:
                y, _ = self._call(fn, _watched(tape, xs), data)
                _check_scalar(y, "hvp")
            grads = _gradients(tape, y, xs)
        return [_dense(acc.jvp(g, unconnected_gradients=_ZERO)) for g in grads], None

    # ------------------------------------------------------------- composition
    def custom_function(self, value: Callable, vjps: Sequence[Callable], jvps: Sequence[Callable],
                        out: tuple[int, str]) -> Callable[..., Any]:
        # tf.custom_gradient around tf.numpy_function (which runs inside tf.function too): the
        # value forward and the rules' cotangents as the gradient.  Forward mode
        # (ForwardAccumulator) differentiates the gradient function with respect to its
        # upstream gradient ("double backward"), so it needs no jvp rule: the core's pullback
        # node's own gradient with respect to dy is the pushforward.  A gradient's gradient
        # with respect to the primal input x (every node's first input) would be a second
        # derivative: when anything could still differentiate x (a tape or an accumulator
        # watching it when the gradient is built), or in a graph (where TensorFlow's forward
        # mode does not reach a numpy_function's custom gradient and would find zeros), the
        # cotangents pass through _refusing, whose gradient raises rather than be silently zero.
        size, dtype = out
        kernel = getattr(value, "__self__", None)  # the ForeignKernel, for the refusal's wording

        @tf.custom_gradient
        def function(*inputs: Any) -> Any:
            y = tf.numpy_function(value, list(inputs), tf.as_dtype(dtype), stateful=False)
            y.set_shape((size,))
            # eagerly, a cotangent of x that no tape or accumulator watched when the value was
            # computed is never asked for: the pullback node's (a Hessian's) is not computed
            x_asked = not tf.executing_eagerly() or _differentiated(inputs[0])

            def gradient(g: Any) -> list:
                watched, eager = _differentiated(inputs[0]), tf.executing_eagerly()
                cotangents = [vjp(g, *inputs) if i or x_asked else None for i, vjp in enumerate(vjps)]
                if watched or not eager:
                    cotangents = [_refusing(c, kernel, watched) if c is not None else None for c in cotangents]
                return cotangents

            return y, gradient

        return function

    def custom_rule(self, rule: Any) -> Callable[..., tuple]:
        if rule.stops_gradient:  # ad.stop_gradient
            return lambda *inputs: tuple(map(tf.stop_gradient, inputs))
        # tf.custom_gradient alone is not enough: a ForwardAccumulator keeps the first tangent
        # it gets for a tensor, which is the native one of the identity custom_gradient puts on
        # the outputs (forward mode would silently differentiate the value, not the rule), and
        # it cannot take a jvp rule.  So the outputs are made with all recording stopped and
        # recorded once, on every tape and accumulator, with the backward and (for a jvp
        # rule) a forward function; without one an accumulator transposes the backward
        # (double vjp), which is the vjp rule's own derivative.  The custom_gradient made
        # under the stopped recording is the graph's gradient (IdentityN), for the symbolic
        # gradients of a tf.function called under a tape and tf.gradients.
        def backward(*cotangents: Any, residuals: Any = None, outputs: Sequence = ()) -> list:
            if not rule.has_vjp:
                raise rule.no_vjp_error()
            cotangents = tuple(tf.zeros_like(o) if c is None else c for o, c in zip(outputs, cotangents))
            return list(rule.backward(residuals, cotangents))

        # TensorFlow runs a jvp function with every tape and accumulator hidden, new ones too: a
        # rule that differentiates inside its jvp (ad.custom_root's) would get zeros there
        rule.derivatives_in_jvp = False
        if rule.takes_derivatives and _in_while_body():
            # a rule that differentiates inside itself (ad.custom_root's) loses the implicit part
            # of its derivative when it is built into a tf.while_loop's body: the loop hooks
            # catch this refusal and run the core's Python loop instead (see _forward_while)
            raise CustomRuleError(f"{rule.name}: a rule that takes derivatives cannot run inside tf.while_loop")

        def h(*inputs: Any) -> tuple:
            inputs = [tf.convert_to_tensor(a) for a in inputs]
            if tf.executing_eagerly() and not _record.could_possibly_record():  # nothing can differentiate
                return tuple(rule.value(*inputs))
            if rule.has_vjp:
                # recorded: the residuals stay connected to the inputs, so a tape over the
                # backward gets its second derivative right
                outputs, residuals = rule.forward(*inputs)
            else:
                with _record.stop_recording():
                    outputs, residuals = rule.value(*inputs), None
            outputs = [tf.convert_to_tensor(o) for o in outputs]
            grad = functools.partial(backward, residuals=residuals, outputs=outputs)

            def jvp(*tangents: Any) -> list:  # TensorFlow passes zeros for a missing tangent
                return list(rule.jvp(tuple(inputs), tangents)[1])

            with _record.stop_recording():  # eager: new tensors for the recorded op, nothing more
                results = [tf.identity(o) for o in outputs] if tf.executing_eagerly() else \
                    _graph_boundary(outputs, grad)(*inputs)
            _record.record_operation(rule.name, results, inputs, grad, jvp if rule.has_jvp else None)
            _RULES_RECORDED[0] += 1
            return tuple(results)

        return h

    # ------------------------------------------------------- flat operators
    def value_and_pullback(self, fn: Any, xs: list, data: list) -> tuple:
        if not (self.compile and tf.executing_eagerly()):
            # A persistent tape answers any number of pullbacks (the core's jacobian
            # asks one per output element) without running f again.
            with tf.device(self.tf_device), tf.GradientTape(persistent=True) as tape:
                y, aux = self._call(fn, _watched(tape, xs), data)

            def vjp(dy: Any) -> list:
                with tf.device(self.tf_device):
                    return _gradients(tape, y, xs, dy)

            return y, aux, vjp
        # Compiled: tf.function cannot hand back a tape, so each pullback reruns f
        # with its tape inside one compiled call.
        y, aux = self._run(fn, "value", self._call, xs, data)

        def compiled_vjp(dy: Any) -> list:
            return self._run(fn, "vjp", self._vjp, xs, data, [dy])[0]

        return y, aux, compiled_vjp

    def value_and_pushforward(self, fn: Any, xs: list, data: list) -> tuple:
        y, aux = self._run(fn, "value", self._call, xs, data)

        def jvp(ts: list) -> Any:
            return self._run(fn, "jvp", self._jvp, xs, data, ts)[0]

        return y, aux, jvp

    # Batched: tf.vectorized_map (pfor) over the batch, inside one tf.function per call.
    # Eager (compile=False) keeps f eager: the default loop over the batch.
    def value_and_batched_pullback(self, fn: Any, xs: list, data: list) -> tuple:
        if not self.compile and tf.executing_eagerly():
            return DerivedOperators.flat_value_and_batched_pullback(self.backend, fn, xs, data)
        y, aux = self._run(fn, "value", self._call, xs, data)

        def vjps(dys: Any) -> list:
            return list(self._run(fn, "batched vjp", self._batched_vjp, xs, data, [dys])[0])

        return y, aux, vjps

    def value_and_batched_pushforward(self, fn: Any, xs: list, data: list) -> tuple:
        if not self.compile and tf.executing_eagerly():
            return DerivedOperators.flat_value_and_batched_pushforward(self.backend, fn, xs, data)
        y, aux = self._run(fn, "value", self._call, xs, data)

        def jvps(ts: list) -> Any:
            return self._run(fn, "batched jvp", self._batched_jvp, xs, data, list(ts))[0]

        return y, aux, jvps

    def value_and_gradient(self, fn: Any, xs: list, data: list) -> tuple:
        (y, grads), aux = self._run(fn, "gradient", self._gradient, xs, data)
        return y, aux, grads

    # with chunk_size set, the Jacobians are the core's chunks of batched (pfor) calls
    def jacobian(self, fn: Any, xs: list, data: list) -> tuple:
        return self._run(fn, "jacobian", self._jacobian, xs, data)[0]

    def direct_prepared(self, prepared: Any, xs: list, data: list) -> Callable[..., Any] | None:
        # A tf.function with an input_signature of the preparation's shapes and dtypes:
        # TensorFlow checks each call against it itself, and a call it refuses goes
        # through the core's check, which says what changed (ShapeMismatchError).  For
        # f(x, *arrays) with tensors only (TensorFlow would convert numpy inputs to the
        # signature's dtype, where the check must refuse another dtype), no aux, no closures.
        fn = prepared.fn
        if not (
            self.compile
            and prepared.operator in _DIRECT_OPERATORS
            and not prepared.has_aux
            and fn._array_args
            and all(isinstance(a, tf.Tensor) for a in (*xs, *data))
        ):
            return None
        signature, preparation = prepared.signature, prepared.preparation
        offset = 1 if prepared.operator in ("hvp", "gradient_and_hvp") else 0
        specs = [tf.TensorSpec(a.shape, a.dtype) for a in xs]
        specs += specs[:1] * offset + [tf.TensorSpec(a.shape, a.dtype) for a in data]
        n_rest = len(specs) - 1

        def call(x: Any, *rest: Any) -> Any:
            self.trace_count += 1
            with tf.device(self.tf_device):
                return preparation.run([x], list(rest[offset:]), *rest[:offset])

        compiled = tf.function(call, input_signature=specs, autograph=False)

        def checked(x: Any, *rest: Any) -> Any:
            xs, data = signature.check(x, rest[offset:])
            return preparation.run(xs, data, *rest[:offset])

        eager_only = False  # f calls a foreign kernel whose forward mode works eagerly only

        def direct(x: Any, *rest: Any) -> Any:
            nonlocal eager_only
            if not eager_only and type(x) is _EAGER and len(rest) == n_rest and all(type(a) is _EAGER for a in rest):
                try:
                    return compiled(x, *rest)
                except (TypeError, ValueError):
                    pass  # refused by the signature (or raised by f): the core's route says why
                except Exception as err:
                    if not getattr(_abstractdiff_error(err), "eager_would_work", False):
                        raise
                    eager_only = True
            return checked(x, *rest)

        return direct

    def prepare_jacobian(self, fn: Any, xs: list, data: list) -> Callable[[list, list], list]:
        general = lambda xs, data: list(self._run(fn, "jacobian only", self._jacobian_only, xs, data)[0])  # noqa: E731
        if not (self.compile and isinstance(fn, HasArtefacts)):
            return general
        # the compiled tf.function looked up once, not per call
        store = fn.artefacts(self.backend, "jacobian only")
        sizes = (len(xs), len(data))
        compiled, _ = store.get(("tf.function", sizes), lambda: self._compiled(fn, self._jacobian_only, sizes))

        def run(xs: list, data: list) -> list:
            if not tf.executing_eagerly() or len(xs) + len(data) != sum(sizes):  # (another signature)
                return general(xs, data)
            try:
                return list(compiled(*xs, *data)[0])
            except Exception as err:
                _raise_ours(err, traced=True)  # (a custom rule's refusal, which pfor wraps)

        return run

    def hessian(self, fn: Any, xs: list, data: list) -> Any:
        return self._run(fn, "hessian", self._hessian, xs, data)[0]

    def hvp(self, fn: Any, xs: list, data: list, tangents: list) -> list:
        return self._run(fn, "hvp", self._hvp, xs, data, tangents)[0]


# TensorFlow's autograph rewrites the Python source of every function called inside a
# user's tf.function, abstractdiff's operators included, and has been seen to mix up
# converted methods.  They need no rewriting (they call TensorFlow ops directly), so mark
# them the way tf.autograph.experimental.do_not_convert does: autograph calls such
# functions as they are.
for _name in abstractdiff._operators.__all__:
    getattr(abstractdiff._operators, _name).autograph_info__ = frozenset()
for _name in OPERATOR_METHODS:  # the public methods of the backend holding this adapter
    getattr(AdapterBackend, _name).autograph_info__ = frozenset()

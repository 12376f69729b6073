"""MLX: ``mx.vjp``/``mx.jvp`` as primitives (batched by ``mx.vmap``), ``mx.value_and_grad`` and
``mx.vmap`` as native routes, and ``mx.compile`` as the compiled one (``compile=True``), cached
per flat function.

An adapter of the protocol (:class:`abstractdiff.protocol.Adapter`): ``ad.backend("mlx")`` is
the core's backend holding an :class:`MLXAdapter`.  Fast routes (each measured faster than the
core's derivation from the batched primitives): the prepared gradient (``mx.value_and_grad``,
which the core also runs per call), the Jacobian and the Hessian (one ``mx.vmap`` over a basis,
traced with the value) and the HVP (one ``mx.jvp`` of ``mx.grad``, no value of the gradient);
variables: the arrays of ``mlx.nn`` modules (:class:`_Variables`).

Six MLX habits shape this module:

* MLX is lazy: an operation builds a graph and computes nothing until ``mx.eval`` (or a
  conversion) asks for it.  Every result is evaluated before it is returned, together
  with the inputs (a parameter updated lazily and never read would otherwise grow a
  chain of graphs step after step).  Inside an outer MLX transform (an operator called
  from a function that ``mx.grad``, ``mx.vmap`` or ``mx.compile`` is tracing, ours or the
  user's) nothing is evaluated: MLX detaches what it evaluates, which would silently cut
  the outer derivative to zero.
* ``mx.array(numpy_float64_array)`` is float32 (MLX's default float): conversions name
  the dtype.  float64 runs on the CPU (Metal has none), but MLX's CPU kernels for sin,
  cos, exp, erf and sigmoid are float32-accurate polynomials, float64 included: the
  portable translations compute them exactly (:mod:`abstractdiff.portable.mlx`).
* A pullback cannot be kept: ``mx.vjp`` takes its cotangents when it is called, so the
  pullback runs ``f`` again for each cotangent, and Jacobians and Hessians are one
  ``mx.vmap`` over a basis.  MLX lacks some JVP rules (cumprod, scatter: the derivatives
  of prod and of indexing); forward-mode routes then run in reverse mode instead.
* MLX has no variable objects: an ``nn.Module`` holds immutable arrays in nested dicts
  and lists.  :class:`MLXParameter` stands for one array of a module (the innermost
  module holding it, and the path inside that module), one object per array for the
  module's life, so that ``ad.Params(model)`` gives the same variables every time and
  ``ad.Grads`` lookups work.  Implicit mode differentiates them natively and eagerly: the
  traced values are swapped into the modules, ``f`` runs under ``mx.value_and_grad``, and
  the old arrays are put back whatever happens; frozen parameters are left out (counted).
  (A compiled trace would hold the module's other arrays, frozen ones and buffers, as
  constants, and miss a later write to them, a checkpoint's.)
* ``numpy_array * mlx_array`` is a numpy array: numpy converts the MLX array and its
  derivative is lost without an error; a numpy value returned by ``f`` is refused (the
  core's one policy, :func:`abstractdiff._tree.check_output`).
* MLX 0.32's ``mx.vjp``, ``mx.jvp`` and ``mx.grad`` clear the "traced" mark of every array
  their function's graph reaches (its outputs, and the arrays it closes over): an array of an
  outer transform (``ad.second_derivative``'s, the user's ``mx.grad``) that an inner transform
  closes over, or that an inner transform returned, is from then on a plain value to MLX.
  Evaluated (by ``mx.eval``, ``np.array``, ``float``), it is detached from the outer graph;
  and even unevaluated, MLX drops the outer derivative through an inner transform closing
  over it where the same function ran once before (``ad.derivative`` of
  ``ad.second_derivative`` through ``ad.custom_root``, or of ``ad.pushforward`` in its
  non-differentiated arguments, came out 0).  So each transform here takes the arrays of
  ``data`` (the arguments not differentiated) that an outer transform may trace as primals of
  its own, with zero tangents or unused cotangents (:func:`_outer_traced`, :func:`_primals`),
  never through a closure; nothing is evaluated while one of this adapter's transforms runs
  (:func:`_evaluated`), and a value read there (:meth:`MLXAdapter.to_numpy`) is read where
  MLX keeps the graph.  A closure of the user's own over an array of the user's own
  transform (``mx.grad`` over ``s`` of an operator of ``lambda t: f(t, s)``) is beyond the
  adapter's reach.

``compile=False`` (the default) runs ``f`` eagerly under MLX's transforms, every call;
Python control flow on values (``if x.sum() > 0``) works in every operator.
``compile=True`` runs each operator through ``mx.compile``, traced once per flat function,
operator and input shapes/dtypes: about 3x faster on small functions (61 us against 171 us
for a 10-element gradient) and 1.8x on the GMM objective, but on Linux MLX compiles each new
fused kernel with the system C++ compiler on first use, about 0.4 s per kernel (cached on
disk in ``$TMPDIR/mlx``; the conformance grid took 268 s cold, against 0.5 s eagerly).  A
compiled trace freezes what ``f`` reads from globals and closures (the core keys its plans
on them, ``reuses_traces``), but not an in-place update of a captured array (``W[0] = 1``
keeps the array's identity): pass such arrays as arguments.  Control flow on traced values
fails there with :class:`~abstractdiff.TracedControlFlowError`.  Where MLX's compiler itself
fails on a function that runs eagerly (MLX 0.32 raises ``IndexError: _Map_base::at`` on some
second derivatives through custom functions), that input signature runs uncompiled
(:class:`_CompiledOrEager`): the same values, at eager speed.  MLX 0.32's own
``mx.linalg.solve`` of a 1x1 float64 system corrupts the heap when compiled (its LU kernel
records its output's size in bytes, not elements; see ``_solve_value`` in
:mod:`abstractdiff.portable.mlx`): the portable ``linalg.solve`` (autoray's numpy interface,
``custom_root(solve="dense")``) routes around it, a call of ``mx.linalg.solve`` itself does not.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import weakref
from typing import Any, Callable, ContextManager, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from abstractdiff import _pytree as pytree
from abstractdiff._arrays import bfloat16_numpy, check_scalar, signature
from abstractdiff._cache import WeakLRU
from abstractdiff._derived import DerivedOperators
from abstractdiff._errors import (
    ArgumentTypeError,
    CollectedError,
    CompositionError,
    CustomRuleError,
    InvalidArgumentError,
    TracedControlFlowError,
)
from abstractdiff._implicit import HeldVariable
from abstractdiff._tree import AuxStatics, HasArtefacts, artefacts, check_output, split_aux
from abstractdiff.portable.mlx import _one
from abstractdiff.protocol import Adapter

FlatFn = Callable[[list, list], tuple]

# What MLX says when f asks for a concrete value inside mx.compile or mx.vmap: an
# if/float()/.item()/np.array on a traced value.
_EVAL_IN_TRANSFORM = "during function transformations"
# What mx.async_eval says inside any transform (grad, vjp, jvp, vmap, compile).
_IN_TRANSFORM = "inside a graph transformation"

def _mx_dtype(name: str) -> Any:
    """The MLX dtype of a numpy dtype name (mx.array(a) alone would make float64 float32): MLX
    names its dtypes as numpy does, but for bool_ (an older MLX lacks float64)."""
    dtype = getattr(mx, "bool_" if name == "bool" else name, None)
    if not isinstance(dtype, mx.Dtype):
        raise ArgumentTypeError(f"mlx backend: MLX has no dtype {name!r} (see mlx.core.Dtype)")
    return dtype


def _evaluated(*trees: Any) -> Any:
    """Compute every array of ``trees`` now (MLX is lazy), unless an outer transform is tracing;
    returns the first tree.

    Inside ``mx.grad``, ``mx.vjp``, ``mx.vmap``, ``mx.compile``... (an operator called from a
    function being differentiated) evaluating would cut the outer graph: MLX detaches what
    it evaluates, and the outer derivative silently becomes zero.  ``mx.async_eval`` refuses
    to run there, which is how we know; the outer transform evaluates its own outputs.  Inside
    one of this adapter's own transforms (``_TRANSFORMING``) nothing is evaluated either,
    without asking MLX: MLX's answer comes from marks that a nested transform may have cleared
    (see the module docstring).
    """
    if _TRANSFORMING[0]:
        return trees[0]
    if _FOREIGN_KERNELS[0]:
        # A foreign kernel evaluates its inputs, so they are "available": mx.async_eval
        # detaches such arrays while it walks the graph, even when it then refuses, and
        # the refusal itself would cut the outer graph.  Ask without side effects instead
        # (slower: only once a process has built a foreign kernel for mlx code).
        if not _in_transform():
            mx.eval(*trees)
        return trees[0]
    try:
        mx.async_eval(*trees)
    except ValueError as err:
        if _IN_TRANSFORM not in str(err):
            raise
    else:
        mx.eval(*trees)
    return trees[0]


#: How many of this adapter's transforms (MLXAdapter._call) are running now: an operator
#: called inside one is nested in a derivative being taken, whatever MLX's marks say.  (A count
#: shared by threads errs towards "nested": no evaluation, primals rather than closures, both
#: right at top level too.)
_TRANSFORMING = [0]


def _outer_traced(arrays: Sequence[Any]) -> tuple[int, ...]:
    """The positions of the MLX arrays among ``arrays`` that an outer transform may trace (ours
    or the user's): a transform built here takes these as primals, never through a closure,
    whose traversal would clear their marks (see the module docstring).

    Inside one of this adapter's transforms, every MLX array: MLX's marks are not to be
    trusted there (a nested transform clears those of its own outputs too), and an array
    whose mark was cleared would be evaluated, and detached, by the question.  Outside them,
    MLX is asked: ``mx.async_eval`` refuses a traced array and evaluates the others, which a
    top-level call evaluates anyway; where a foreign kernel has run it cannot be asked (see
    :func:`_evaluated`), and every array is taken as traced inside a transform."""
    if _TRANSFORMING[0] or _FOREIGN_KERNELS[0] and _in_transform():
        return tuple(i for i, a in enumerate(arrays) if isinstance(a, mx.array))
    if _FOREIGN_KERNELS[0]:
        return ()
    traced = []
    for i, a in enumerate(arrays):
        if isinstance(a, mx.array):
            try:
                mx.async_eval(a)
            except ValueError as err:
                if _IN_TRANSFORM not in str(err):
                    raise
                traced.append(i)
    return tuple(traced)


#: whether custom_function has built a boundary (differentiate_with, mlx code calling a kernel) here
_FOREIGN_KERNELS = [False]


def _in_vjp_rule(action: Callable[[], Any]) -> Any:
    """``action()`` run inside a custom vjp rule, where MLX keeps the graph (see :func:`_concrete`)."""
    done, probe = [], mx.custom_function(lambda z: z)

    @probe.vjp
    def rule(_primals: Any, cotangent: Any, _output: Any) -> Any:
        done.append(action())
        return cotangent

    mx.vjp(probe, [mx.array(0.0)], [mx.array(0.0)])
    return done[0]


def _in_transform() -> bool:
    """Whether an MLX transform is tracing, with no side effect on the graph: an array made
    inside a custom vjp rule is a tracer exactly while a transform traces, and
    mx.async_eval refuses a tracer."""
    try:
        mx.async_eval(_in_vjp_rule(lambda: mx.zeros((1,)) + 0))
    except ValueError as err:
        if _IN_TRANSFORM not in str(err):
            raise
        return True
    return False


def _empty(xs: list) -> bool:
    """Whether ``x`` has leaves, none of them with an element: every derivative is empty."""
    return bool(xs) and all(x.size == 0 for x in xs)


def _gpus() -> list[str]:
    """MLX's GPUs by their canonical names: ``"cuda:N"`` for NVIDIA GPUs (the ``mlx[cuda]``
    build), ``"mps:0"`` for Apple's Metal GPU (MLX uses one)."""
    cuda, metal = getattr(mx, "cuda", None), getattr(mx, "metal", None)  # an older MLX lacks mx.cuda
    if cuda is not None and cuda.is_available():
        try:
            count = int(mx.device_count(mx.gpu))
        except (AttributeError, RuntimeError, ValueError):  # an MLX without this query
            count = 1
        return [f"cuda:{i}" for i in range(count)]
    return ["mps:0"] if metal is not None and metal.is_available() else []


# ---------------------------------------------------------------------------------------
# Parameters of mlx.nn modules
class MLXParameter(HeldVariable):
    """One array of an ``mlx.nn.Module``, as a variable: what ``ad.Params(model)`` holds.

    MLX has no variable objects; a module holds immutable arrays in nested dicts and
    lists, and assigning a new array replaces the old one.  A parameter names the
    innermost module holding the array (weakly: the module owns its parameters, not the
    other way round) and the path inside it, so a submodule shared by two parents gives
    one parameter.  One object per (module, path) for the module's life (see
    :func:`parameter`): ``gs[p]`` finds the gradient of ``p`` in every ``ad.Grads``.
    Read and write it with ``p.value``, or with ``ad.optim.read``/``write``.
    """

    __slots__ = ("_module", "path", "name")

    def __init__(self, module: nn.Module, path: tuple, name: str):
        self._module = weakref.ref(module)
        self.path = path
        self.name = name

    @property
    def module(self) -> nn.Module:
        if (module := self._module()) is None:
            raise CollectedError(f"the module holding MLX parameter {self.name!r} was garbage collected")
        return module

    def _container(self) -> tuple[Any, Any]:
        node: Any = self.module
        try:
            for key in self.path[:-1]:
                node = node[key]
            node[self.path[-1]]
        except (KeyError, IndexError, TypeError):
            raise InvalidArgumentError(f"the module no longer holds MLX parameter {self.name!r} (its structure "
                                       f"changed); take ad.Params(model) again") from None
        return node, self.path[-1]

    def _get(self) -> Any:
        node, key = self._container()
        return node[key]

    def _set(self, value: Any) -> Any:
        node, key = self._container()
        old, node[key] = node[key], value
        return old

    def _coerce(self, new: Any, old: Any) -> Any:
        return new if isinstance(new, mx.array) else _from_numpy(np.asarray(new), old.dtype)


# innermost module (held weakly) -> {path: MLXParameter}; an entry dies with its module.  Not
# a cache (name=None: never cleared): a parameter's box is its identity, which Params and
# Grads hold.
_PARAMETERS: WeakLRU[dict] = WeakLRU(name=None, keyed_on="an MLX module (held weakly)")


def parameter(module: nn.Module, path: tuple, name: str) -> MLXParameter:
    """The one :class:`MLXParameter` of ``module`` at ``path`` (made on first request)."""
    table = _PARAMETERS.get_or_put((module,), dict)
    if (found := table.get(path)) is None:
        found = table.setdefault(path, MLXParameter(module, path, name))
    return found


def _locate(root: nn.Module, name: str) -> tuple[nn.Module, tuple]:
    """The innermost module holding the array named ``name`` (MLX's dotted names) and its path there."""
    owner, path, node = root, (), root
    for part in name.split("."):
        if isinstance(node, nn.Module):
            owner, path = node, ()
        key: Any = int(part) if isinstance(node, list) else part
        node = node[key]
        path += (key,)
    return owner, path


def module_parameters(model: nn.Module) -> list[tuple[str, MLXParameter, bool]]:
    """``(name, parameter, trainable)`` for every array of ``model``, once each, in MLX's order.

    What counts as a parameter and as trainable is MLX's own answer (``parameters()``,
    ``trainable_parameters()``, which honour ``freeze``); a submodule reached twice (shared
    weights) gives its parameters once.
    """
    trainable = {name for name, _ in tree_flatten(model.trainable_parameters())}
    out: list[tuple[str, MLXParameter, bool]] = []
    index: dict[int, int] = {}
    for name, _ in tree_flatten(model.parameters()):
        p = parameter(*_locate(model, name), name)
        i = index.get(id(p))
        if i is None:
            index[id(p)] = len(out)
            out.append((name, p, name in trainable))
        elif name in trainable:  # shared: trainable if any of its places is
            out[i] = (out[i][0], p, True)
    return out


def _to_numpy(a: Any) -> np.ndarray:
    return bfloat16_numpy(np.array(a.astype(mx.float32))) if a.dtype == mx.bfloat16 else np.array(a)


def _from_numpy(a: np.ndarray, dtype: Any) -> Any:
    """A numpy array as a new MLX array of ``dtype`` (``mx.array(a)`` alone makes float64 float32).

    Two of MLX's imports of numpy memory fail: DLPack refuses negative strides (``x[::-1]``),
    which are copied to C order first (a new array: the caller's is untouched), and a
    zero-size array imported from numpy can send MLX's reduction kernels into an endless
    loop (``mx.var(mx.array(np.zeros((0, 3))), axis=0)`` hangs in most runs): it has no
    values to copy, so it is made by MLX itself.
    """
    if a.size == 0:
        return mx.zeros(a.shape, dtype=dtype)
    if any(s < 0 for s in a.strides):
        a = a.copy(order="C")  # not ascontiguousarray: it returns a one-element x[::-1] with its stride
    return mx.array(a, dtype=dtype)


# ---------------------------------------------------------------------------------------
class _CompiledOrEager:
    """``mx.compile(fn)``, but ``fn`` itself for the input signatures MLX's compiler fails on.

    MLX 0.32's compiler fails on some graphs that run right eagerly: a second derivative
    (``mx.vjp`` of an ``mx.vjp``) through ``mx.custom_function`` kernels (the portable float64
    ``sin``), of a function computing the same subexpression twice, comes out of its
    simplification passes with a tape that ``compile_replace`` cannot map, and the call raises
    C++'s ``out_of_range`` as ``IndexError: _Map_base::at``.  The compiled trace is only an
    optimisation of ``fn``: ``fn`` run as it is (under the caller's transforms and stream) is
    the same function, so it gives the result instead.  The failing entry stays in MLX's compile
    cache, so its signature (shapes and dtypes) runs eagerly from then on; other signatures are
    still compiled.  An ``IndexError`` of ``fn``'s own is raised again by its eager run."""

    __slots__ = ("fn", "compiled", "eager")

    def __init__(self, fn: Callable[..., Any]):
        self.fn, self.compiled, self.eager = fn, mx.compile(fn), set()

    def __call__(self, *args: Any) -> Any:
        if self.eager and _signature_of(args) in self.eager:
            return self.fn(*args)
        try:
            return self.compiled(*args)
        except IndexError:  # how MLX's bindings raise the compiler's C++ out_of_range
            out = self.fn(*args)
            self.eager.add(_signature_of(args))
            return out


def _signature_of(args: tuple) -> tuple:
    """What MLX's compile cache keys a call on: the arrays' shapes and dtypes (other leaves by type)."""
    leaves = [v for _, v in tree_flatten(list(args))]
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, mx.array) else type(a) for a in leaves)


class _Traced:
    """``fn`` as MLX's transforms take it: arrays in, arrays out.

    Counts its executions (the adapter's ``trace_count``), converts ``y`` to an MLX array,
    checks it is a scalar where the operator needs one (before MLX's own message about
    cotangent shapes), and sets aside the leaves of ``aux`` that are not MLX arrays (ints,
    strings, numpy constants: ``mx.compile`` returns arrays only), per input signature,
    for :meth:`aux` to put back: aux comes back unchanged.
    """

    def __init__(self, adapter: MLXAdapter, fn: FlatFn, operator: str | None = None):
        self.adapter, self.fn, self.operator = adapter, fn, operator
        # None is a leaf of aux here: f's None values come back as they were
        self.statics = AuxStatics(adapter.is_native, functools.partial(pytree.tree_flatten, none_is_leaf=True))

    def __call__(self, xs: list, data: list) -> tuple[Any, list]:
        self.adapter.trace_count += 1
        y, aux = self.fn(list(xs), list(data))
        y = self.adapter._output(y)
        if self.operator is not None:
            check_scalar(y, self.operator)
        return y, [] if aux is None else self.statics.split(signature(xs, data), aux)

    def value(self, data: list) -> Callable[..., Any]:
        """``*xs -> y``, as ``mx.vjp``/``mx.jvp`` take it."""
        return lambda *xs: self(list(xs), data)[0]

    def aux(self, xs: list, data: list, arrays: list) -> Any:
        return self.statics.join(signature(xs, data), arrays) if getattr(self.fn, "has_aux", True) else None


class _Variables:
    """The variable hooks (the adapter's ``variables``): :class:`MLXParameter`, the arrays
    of ``mlx.nn`` modules, differentiated natively and eagerly (the module docstring)."""

    def __init__(self, adapter: MLXAdapter):
        self.adapter = adapter  # its scope, errors, trace count, and its backend (the holder)

    def is_variable(self, v: Any) -> bool:
        return isinstance(v, MLXParameter)

    def model_variables(self, obj: Any) -> tuple[list, int] | None:
        if not isinstance(obj, nn.Module):
            return None
        found = module_parameters(obj)
        trainable = [p for _, p, t in found if t]
        return trainable, len(found) - len(trainable)

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        # every array of the module, frozen ones too, with MLX's dotted names
        return [(name, p) for name, p, _ in module_parameters(obj)] if isinstance(obj, nn.Module) else None

    # read, write and current_value: the core's, through MLXParameter.value
    def new_variable(self, value: Any) -> Any:
        from abstractdiff._implicit import Variable

        # MLX has no variables of its own: a box, holding a new array object (see snapshot)
        return Variable(mx.array(value))

    def swap(self, var: Any, value: Any) -> Any:
        return var._set(value)

    # f with the traced values swapped into the variables, as a flat function of them: the
    # explicit routes differentiate it eagerly (it has no artefacts, so nothing is compiled)
    def implicit_value_and_gradient(self, f: Callable[..., Any], variables: list, args: tuple, has_aux: bool) -> tuple:
        value, values = self._implicit_value(f, variables, args, has_aux)
        return self.adapter.prepare_value_and_gradient(value, values, [])(values, [])

    def implicit_value_and_pullback(self, f: Callable[..., Any], variables: list, args: tuple) -> tuple:
        value, values = self._implicit_value(f, variables, args, False)
        y, _, vjp = self.adapter.value_and_pullback(value, values, [])
        return y, lambda dy: vjp(self.adapter.backend.cotangent(dy, y))  # the core's check of dy

    def _implicit_value(self, f: Callable[..., Any], variables: list, args: tuple,
                        has_aux: bool) -> tuple[FlatFn, list]:
        """``(values, []) -> (y, aux)``: ``f(*args)`` with ``values`` swapped into the variables."""
        values = [v._get() for v in variables]
        args = self._fit_data(values, args)

        def value(traced: list, _: list) -> tuple[Any, Any]:
            old = [v._set(t) for v, t in zip(variables, traced)]
            try:
                y, aux = split_aux(f(*args), has_aux)
            finally:
                for v, o in zip(reversed(variables), reversed(old)):
                    v._set(o)
            return check_output(y, traced), aux

        return value, values

    @staticmethod
    def _fit_data(values: list, args: tuple) -> tuple:
        # float data in the parameters' float dtype (as the torch adapter does): a float64
        # batch would otherwise promote a float32 model's loss to float64
        dtype = values[0].dtype

        def fit(a: Any) -> Any:
            floating = isinstance(a, mx.array) and a.dtype != dtype and mx.issubdtype(a.dtype, mx.floating)
            return a.astype(dtype) if floating else a

        return pytree.tree_map(fit, args) if args else args


class MLXAdapter(Adapter):
    name = "mlx"
    extra = "mlx"
    modules = ("mlx",)
    fast_routes = {"prepare_value_and_gradient": "prepare_value_and_gradient", "jacobian": "jacobian",
                   "hessian": "hessian", "hvp": "hvp"}

    def __init__(self, *, device: str = "cpu", compile: bool = False):
        if not isinstance(compile, bool):
            raise ArgumentTypeError(f"compile must be True or False, got {compile!r}")
        super().__init__(device=device, compile=compile)
        self.compile = self.reuses_traces = compile  # a compiled trace freezes what f reads (Adapter.reuses_traces)
        # a canonical name (devices()) as MLX's device: "cuda:N" and "mps:0" are both GPU N of mx.gpu
        kind, _, index = self.device.partition(":")
        self.mx_device = mx.Device(mx.cpu) if kind == "cpu" else mx.Device(mx.gpu, int(index))
        #: Python executions of user functions under this backend's transforms; a compiled
        #: call that reuses its trace leaves it unchanged (tests count retraces).
        self.trace_count = 0
        self.variables = _Variables(self)
        self.compiler = self._compiler if compile else None  # whole train_steps, sparse calls: one mx.compile

    def _compiler(self, step: Callable, assigns_variables: bool = False) -> Callable | None:
        # arrays are values: implicit mode's variables are assigned in Python, op by op
        compiled, native = _CompiledOrEager(step), lambda a: self.from_numpy(a) if isinstance(a, np.ndarray) else a
        arg = lambda a: list(map(native, a)) if type(a) is list else native(a)  # noqa: E731
        return None if assigns_variables else lambda *args: self._call(compiled, *map(arg, args))

    # ---------------------------------------------------------------- devices
    def devices(self) -> list[str]:
        return ["cpu", *_gpus()]

    def _scope(self) -> ContextManager[Any]:
        # Every operation runs on the backend's device, whatever the user's default device
        # (on macOS the default is the GPU, which has no float64); a stream context is local.
        return mx.stream(self.mx_device)

    # ---------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        return isinstance(a, mx.array)

    def from_numpy(self, a: np.ndarray) -> Any:
        return _from_numpy(a, _mx_dtype(a.dtype.name))

    def to_numpy(self, a: Any) -> np.ndarray:
        a = a.value if isinstance(a, MLXParameter) else a
        if _TRANSFORMING[0]:
            # a value read inside one of this adapter's transforms (custom_root's convergence
            # test): read where MLX keeps the graph, since an array whose mark a nested
            # transform cleared would be detached from the outer graph by its evaluation
            return _in_vjp_rule(lambda: _to_numpy(a))
        return _to_numpy(a)

    def numpy_view(self, a: Any) -> np.ndarray:
        # the array's own memory (np.array copies), read-only: MLX arrays are immutable.
        # (mx.from_dlpack copies CPU memory, and float64 to float32: from_numpy stays.)
        if a.dtype == mx.bfloat16:
            return _to_numpy(a)
        view = np.array(a, copy=False)
        view.flags.writeable = False
        return view

    def cast(self, a: Any, dtype: str) -> Any:
        return a.astype(_mx_dtype(dtype))

    def snapshot(self, a: Any) -> Any:
        # MLX arrays take in-place updates (a[0] = 1 rebinds the array object to a new
        # graph node); a new array object on the same node keeps the point, costs nothing
        # and stays differentiable.
        return mx.array(a) if isinstance(a, mx.array) else super().snapshot(a)

    def scope(self, arrays: Sequence[Any]) -> ContextManager[Any]:
        # the optimisers' arithmetic: float64 only exists on the CPU (Metal has none)
        float64 = any(isinstance(a, mx.array) and a.dtype == mx.float64 for a in arrays)
        return mx.stream(mx.cpu) if float64 else contextlib.nullcontext()

    def _output(self, y: Any) -> Any:
        """``f``'s value as an MLX array: the core's check_output has refused a numpy value
        while MLX arrays are differentiated, and made a Python number a 0-d numpy array."""
        return y if isinstance(y, mx.array) else self.from_numpy(np.asarray(y))

    # ------------------------------------------------------------- composition
    def custom_function(
        self,
        value: Callable[..., np.ndarray],
        vjps: Sequence[Callable[..., Any]],
        jvps: Sequence[Callable[..., Any]],
        out: tuple[int, str],
    ) -> Callable[..., Any]:
        # mx.custom_function: its vjp rule takes (primals, cotangent, output) and returns one
        # cotangent per primal, its jvp rule (primals, tangents), where an input MLX does not
        # differentiate has a None tangent; a single primal, tangent or cotangent comes bare
        _FOREIGN_KERNELS[0] = True
        op = _custom_value(value, _mx_dtype(out[1]))

        @op.vjp
        def vjp(primals: Any, cotangent: Any, _output: Any) -> Any:
            inputs = _listed(primals)
            cotangents = [rule(_one(cotangent), *inputs) for rule in vjps]
            return cotangents[0] if len(cotangents) == 1 else tuple(cotangents)

        @op.jvp
        def jvp(primals: Any, tangents: Any) -> Any:
            inputs = _listed(primals)
            parts = [rule(t, *inputs) for rule, t in zip(jvps, _listed(tangents)) if t is not None]
            return sum(parts[1:], parts[0])  # MLX asks for a jvp only along some input's tangent

        return op

    def custom_rule(self, rule: Any) -> Callable[..., tuple]:
        if rule.stops_gradient:  # ad.stop_gradient; a numpy leaf beside MLX arrays is a constant already
            return lambda *inputs: tuple(mx.stop_gradient(a) if isinstance(a, mx.array) else a for a in inputs)
        # The backward recomputes rule.forward from the primals MLX hands it (the traced
        # inputs under an outer transform), so that the residuals depend on the inputs in
        # the graph a second derivative differentiates; the value alone costs rule.value.
        def vjp(xs: list, cotangents: list) -> Sequence:
            if not rule.has_vjp:  # MLX cannot transpose a jvp rule
                raise rule.no_vjp_error()
            with _rule_running(rule, "bwd"):
                return _arrays(rule, rule.backward(rule.forward(*xs)[1], tuple(cotangents)), "bwd's cotangent")

        def jvp(xs: list, tangents: list) -> Sequence:
            if rule.has_jvp:
                with _rule_running(rule, "the jvp rule"):
                    return _arrays(rule, rule.jvp(tuple(xs), tuple(tangents))[1], "the jvp rule's tangent_out")
            # the backward is linear in the cotangents: the pullback of u -> J^T u is the
            # JVP, t -> J t (as _jvp's reverse route), not a derivative of rule.value.  The
            # inputs are primals of that mx.vjp, not values its function closes over: MLX
            # 0.32 drops the derivative of a closed-over input for an outer mx.jvp once its
            # value was computed before (a third derivative, ad.derivative of
            # ad.second_derivative, came out silently zero).  Only the cotangents' part is
            # read, and MLX is lazy: the inputs' part is never computed.
            zeros = [mx.zeros_like(y) for y in rule.value(*xs)]  # any cotangent: J^T u is linear in u
            k = len(zeros)

            def backward(*args: Any) -> list:
                return list(_arrays(rule, rule.backward(rule.forward(*args[k:])[1], args[:k]), "bwd's cotangent"))

            with _rule_running(rule, "bwd"):
                return mx.vjp(backward, [*zeros, *xs], tangents)[1][:k]

        return _rule_function(lambda xs: rule.value(*xs), vjp, jvp)

    # ------------------------------------------------------------ compilation
    def _library_error(self, err: ValueError) -> Exception:
        """Our error for MLX's refusal to evaluate a traced value or to differentiate a
        primitive that has no reverse rule, else ``err`` itself."""
        if (missing := _NO_VJP.search(str(err))) is not None:
            return _no_vjp_error(missing.group(1))
        if _EVAL_IN_TRANSFORM not in str(err):
            return err
        fix = ("pass compile=False (ad.backend('mlx', compile=False)) to run f eagerly, where such branches work, or"
               if self.compile else "f runs inside an mx.compile or mx.vmap of yours here;")
        return TracedControlFlowError(
            f"f used a traced MLX value where Python needs a concrete value (an if/while on an array, "
            f"float(), .item(), np.array()) inside mx.compile or mx.vmap ({err}); {fix} write the branch "
            f"with mx.where / autoray's where"
        )

    def _compiled(self, fn: Any, operator: str, build: Callable[[_Traced], Callable]) -> tuple[Callable, _Traced]:
        """``(call, traced)``: ``build(traced)`` (compiled once per flat function with ``compile=True``)."""
        kind = operator.partition(" ")[0]  # "hessian (reverse)" checks as "hessian" does
        scalar = kind if kind in ("gradient", "hessian", "hvp") else None
        if not (self.compile and isinstance(fn, HasArtefacts)):
            traced = _Traced(self, fn, scalar)
            return build(traced), traced

        def make() -> tuple[Callable, _Traced]:
            traced = _Traced(self, fn, scalar)
            return _CompiledOrEager(build(traced)), traced

        # mx.compile retraces per input shapes and dtypes itself; the device is an option of
        # the backend (part of the store's key) and is baked into the trace
        return fn.artefacts(self.backend, operator).get("mx.compile", make)

    def _call(self, call: Callable, *args: Any) -> Any:
        _TRANSFORMING[0] += 1
        try:
            with self._scope():
                return call(*args)
        except ValueError as err:
            raise self._library_error(err) from err
        finally:
            _TRANSFORMING[0] -= 1

    def _forward_or_reverse(self, fn: Any, operator: str, build: Callable[[_Traced, bool, tuple], Callable],
                            lift: tuple[int, ...], *args: Any) -> Any:
        """``build(traced, reverse, lift)``'s function called on ``args``: the forward-mode
        route, or its reverse-mode twin where MLX lacks a JVP rule (cumprod, scatter: the
        derivatives of prod and of indexing), remembered per flat function.  ``lift``: the
        positions in ``[*xs, *data]`` of the arrays an outer transform traces (see
        :func:`_outer_traced`), each its own trace."""
        route = artefacts(fn, self.backend, f"{operator}: route")
        traced_as = f" lifting {lift}" if lift else ""
        if route.peek("reverse") is None:
            call, _ = self._compiled(fn, operator + traced_as, lambda traced: build(traced, False, lift))
            try:
                return self._call(call, *args)
            except (RuntimeError, ValueError) as err:  # MLX raises either, by primitive
                if _NO_JVP.search(str(err)) is None:
                    raise
                route.put("reverse", True)
        call, _ = self._compiled(fn, f"{operator} (reverse){traced_as}", lambda traced: build(traced, True, lift))
        return self._call(call, *args)

    # ------------------------------------------------------------- primitives
    # The batched forms are one mx.vmap of the primitive's transform over the stacked
    # cotangents or tangents: the core's Jacobians and Hessians are one call per chunk.
    def value_and_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        return self._value_and_linear(fn, xs, data, "vjp", lambda traced, _, lift: _vjp(traced, lift))

    def value_and_batched_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        return self._value_and_linear(fn, xs, data, "batched vjp",
                                      lambda traced, _, lift: _batched(_vjp(traced, lift)))

    def value_and_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        return self._value_and_linear(fn, xs, data, "jvp", _jvp)

    def value_and_batched_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        return self._value_and_linear(fn, xs, data, "batched jvp",
                                      lambda traced, r, lift: _batched(_jvp(traced, r, lift)))

    def _value_and_linear(self, fn: FlatFn, xs: list, data: list, operator: str,
                          build: Callable[[_Traced, bool, tuple], Callable]) -> tuple[Any, Any, Callable]:
        """``(y, aux, apply)``: ``apply(v)`` is ``build``'s transform (a pullback or a
        pushforward, batched or not) at ``xs``, run on ``v``."""
        lift = _outer_traced([*xs, *data])  # before f runs: its transforms may clear the marks
        forward, traced = self._compiled(fn, "value", lambda traced: traced)
        y, aux = self._call(forward, xs, data)
        # a batched form's value is evaluated with its first batch, in one graph: the core's
        # Jacobian may read only y's shape (known unevaluated) before switching mode
        pending = [y, aux, xs, data]
        if not operator.startswith("batched"):
            _evaluated(*pending)
            pending = []
        pullback = "vjp" in operator

        def apply(v: Any) -> Any:
            # an x without elements: known without MLX (see _value_and_gradient_past_empty),
            # with the batch axis of v, if any
            if pullback and _empty(xs):
                return [mx.zeros((*v.shape[: v.ndim - y.ndim], *x.shape), x.dtype) for x in xs]
            if _empty(xs):
                return mx.zeros((*v[0].shape[: v[0].ndim - xs[0].ndim], *y.shape), y.dtype)
            if pullback:
                call, _ = self._compiled(fn, operator + (f" lifting {lift}" if lift else ""),
                                         lambda traced: build(traced, False, lift))
                return _evaluated(self._call(call, xs, data, v), *pending)
            out = self._forward_or_reverse(fn, operator, build, lift, xs, data, list(v))
            if out.dtype != y.dtype:  # a float64 tangent must not widen a float32 result
                out = out.astype(y.dtype)
            return _evaluated(out, *pending)

        return y, traced.aux(xs, data, aux), apply

    # ---------------------------------------------- fast derived operators
    def prepare_value_and_gradient(self, fn: FlatFn, xs: list, data: list) -> Callable:
        if any(x.size == 0 for x in xs):  # a prepared operator is called with these shapes only
            return lambda xs, data: self._value_and_gradient_past_empty(fn, xs, data)
        compiled, traced = self._compiled(fn, "gradient", mx.value_and_grad)

        def run(xs: list, data: list) -> tuple[Any, Any, list]:
            # mx.value_and_grad hands the arguments it does not differentiate to f as they are:
            # those an outer transform traces are differentiated too (see _outer_traced)
            lift = _outer_traced(data) if data else ()
            if lift:
                call, _ = self._compiled(fn, f"gradient lifting {lift}", lambda traced: _value_and_grad(traced, lift))
            else:
                call = compiled
            (y, aux), grads = self._call(call, xs, data)  # on the device's stream (evaluated lazily)
            _evaluated(y, aux, grads, xs, data)
            return y, traced.aux(xs, data, aux), grads

        return run

    def _value_and_gradient_past_empty(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, list]:
        """``value_and_gradient`` where leaves of ``x`` have no elements: their gradients are
        zeros of their shape, known without MLX, and only the other leaves reach ``mx.vjp``
        (eagerly).  MLX's kernels over zero-size arrays have looped forever (see
        :func:`_from_numpy`): a derivative known without them need not risk it."""
        kept = [i for i, x in enumerate(xs) if x.size]

        def sub(part: list, data: list) -> tuple:  # fn of the leaves with elements
            full = list(xs)
            for i, v in zip(kept, part):
                full[i] = v
            return fn(full, data)

        y, aux, vjp = self.value_and_pullback(sub, [xs[i] for i in kept], data)
        check_scalar(y, "gradient")
        grads = [mx.zeros(x.shape, x.dtype) for x in xs]
        for i, g in zip(kept, vjp(mx.ones_like(y)) if kept else []):
            grads[i] = g
        return y, aux, _evaluated(grads)

    # jacobian and hessian are taken only without chunk_size: mx.vmap over the whole basis has
    # no chunks, the core's are chunks of batched primitive calls.  An x with no element goes to
    # the core's derivation, whose primitives know the (empty) derivatives without MLX.
    def jacobian(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, list]:
        if _empty(xs):
            return DerivedOperators.flat_jacobian(self.backend, fn, xs, data)
        y, jacs = self._forward_or_reverse(fn, "jacobian", _jacobian, _outer_traced([*xs, *data]), xs, data)
        _evaluated(y, jacs, xs, data)
        return y, list(jacs)

    def hessian(self, fn: FlatFn, xs: list, data: list) -> Any:
        if _empty(xs):
            return DerivedOperators.flat_hessian(self.backend, fn, xs, data)
        lift = _outer_traced([*xs, *data])
        return _evaluated(self._forward_or_reverse(fn, "hessian", _hessian, lift, xs[0], data), xs, data)

    def hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> list:
        if _empty(xs):
            return DerivedOperators.flat_hvp(self.backend, fn, xs, data, tangents)
        lift = _outer_traced([*xs, *data])
        return list(_evaluated(self._forward_or_reverse(fn, "hvp", _hvp, lift, xs, data, list(tangents)), xs, data))


# ---------------------------------------------------------------------------------------
# The transforms each operator compiles, built from a _Traced f.  MLX cannot keep a
# pullback or a linearisation between calls (mx.vjp/mx.jvp take the cotangents and
# tangents when called), so each runs f again; Jacobians and Hessians vectorise over a
# basis with mx.vmap.  With reverse=True, forward mode is replaced by reverse mode.
_NO_JVP = re.compile(r"JVP\]? (is )?not (yet )?implemented", re.IGNORECASE)
#: What MLX says when a primitive has no reverse rule ("[Primitive::vjp] Not implemented for QRF.")
_NO_VJP = re.compile(r"vjp\] Not implemented for (\w+)")
#: MLX's primitives without a reverse rule, and the functions that reach them
_PRIMITIVE_FUNCTIONS = {
    "QRF": "mx.linalg.qr", "LUF": "mx.linalg.lu, lu_factor, det or slogdet", "SVD": "mx.linalg.svd",
    "Inverse": "mx.linalg.inv or tri_inv", "Cholesky": "mx.linalg.cholesky", "Eigh": "mx.linalg.eigh or eigvalsh",
    "Eig": "mx.linalg.eig or eigvals",
}


def _no_vjp_error(primitive: str) -> CompositionError:
    """The error for a primitive MLX cannot differentiate in reverse mode, and what to do instead."""
    where = _PRIMITIVE_FUNCTIONS.get(primitive)
    return CompositionError(
        f"mlx backend: MLX has no derivative (no vjp rule) of its {primitive} primitive"
        f"{f' (from {where})' if where else ''}, which f uses (MLX: \"[Primitive::vjp] Not implemented for "
        f"{primitive}\"). Write f with the portable functions (docs/guide/portable.md: through autoray the mlx "
        f"backend gives linalg.inv, solve, solve_triangular, cholesky, eigh, det and slogdet derivatives of "
        f"every order), or differentiate it with another backend: ad.backend('finite_differences') for a first "
        f"derivative, ad.SecondOrder(\"finite_differences\", b) where only a second-order operator fails"
    )


def _primals(value: Callable[[list, list], Any], xs: list, data: list, lift: tuple[int, ...]
             ) -> tuple[Callable[..., Any], list]:
    """``(g, primals)`` with ``g(*primals) == value(xs, data)``: the arrays of ``data`` that an
    outer transform traces (``lift``, positions in ``[*xs, *data]``: see :func:`_outer_traced`)
    are primals after ``xs``, not values ``g`` closes over.  Integer ones are stopped inside
    (MLX refuses some derivatives in them: a gather's indices); a float one is differentiated,
    its tangent zero or its cotangent unused, so that the outer transform still sees the
    derivative through it."""
    k = len(xs)
    lifted = [i - k for i in lift if i >= k]
    if not lifted:
        return (lambda *a: value(list(a), data)), list(xs)

    def g(*a: Any) -> Any:
        full = list(data)
        for i, d in zip(lifted, a[k:]):
            full[i] = d if mx.issubdtype(d.dtype, mx.inexact) else mx.stop_gradient(d)
        return value(list(a[:k]), full)

    return g, [*xs, *(data[i] for i in lifted)]


def _zeros(primals: list, k: int) -> list:
    """Zero tangents for the lifted primals after the first ``k`` (see :func:`_primals`)."""
    return [mx.zeros_like(p) for p in primals[k:]]


def _vjp(traced: _Traced, lift: tuple[int, ...] = ()) -> Callable:
    def vjp(xs: list, data: list, dy: Any) -> list:
        g, primals = _primals(lambda xs, data: traced(xs, data)[0], xs, data, lift)
        return mx.vjp(g, primals, [dy])[1][: len(xs)]

    return vjp


def _value_and_grad(traced: _Traced, lift: tuple[int, ...]) -> Callable:
    """``mx.value_and_grad(traced)`` with the arrays of ``data`` at ``lift`` (positions in
    ``data``) primals too, their gradients unused (see :func:`_primals`)."""
    def value_and_grad(xs: list, data: list) -> tuple:
        k = len(xs)
        g, primals = _primals(traced, xs, data, tuple(k + i for i in lift))
        (y, aux), grads = mx.value_and_grad(lambda p: g(*p))(primals)
        return (y, aux), grads[:k]

    return value_and_grad


def _batched(one: Callable) -> Callable:
    """``one(xs, data, v)`` over a stack of ``v`` (leading axis), by ``mx.vmap``."""
    return lambda xs, data, vs: mx.vmap(lambda v: one(xs, data, v))(vs)


def _jvp(traced: _Traced, reverse: bool, lift: tuple[int, ...] = ()) -> Callable:
    def jvp(xs: list, data: list, ts: list) -> Any:
        k = len(xs)
        g, primals = _primals(lambda xs, data: traced(xs, data)[0], xs, data, lift)
        if not reverse:
            return mx.jvp(g, primals, [*ts, *_zeros(primals, k)])[1][0]
        # u -> J^T u is linear in u: its pullback, t -> J t, is the JVP, made of VJP rules only.
        # The outer mx.vjp's function closes over the primals: where an outer transform traces
        # one of them, they are its primals too, their cotangents unused
        zeros = mx.zeros_like(g(*primals))
        if not lift:
            return mx.vjp(lambda u: mx.vjp(g, primals, [u])[1], [zeros], ts)[1][0]
        return mx.vjp(lambda u, *p: mx.vjp(g, list(p), [u])[1][:k], [zeros, *primals], ts)[1][0]

    return jvp


def _jacobian(traced: _Traced, reverse: bool, lift: tuple[int, ...] = ()) -> Callable:
    vjps, jvps = _batched(_vjp(traced, lift)), _batched(_jvp(traced, False, lift))

    def jacobian(xs: list, data: list) -> tuple[Any, list]:
        y = traced.value(data)(*xs)
        n_in, n_out = sum(x.size for x in xs), y.size
        if reverse or n_out <= n_in:  # one reverse pass per output element
            # shapes as tuples: MLX 0.32 crashes on a.reshape() with no argument (a 0-d result)
            rows = vjps(xs, data, mx.eye(n_out, dtype=y.dtype).reshape((n_out, *y.shape)))
            return y, [r.reshape((*y.shape, *x.shape)) for r, x in zip(rows, xs)]
        # one forward pass per input element: the input basis, cut into the leaves
        cuts = [(x, end - x.size, end) for x, end in zip(xs, itertools.accumulate(x.size for x in xs))]
        eye = mx.eye(n_in)
        cols = jvps(xs, data, [eye[:, a:b].astype(x.dtype).reshape((n_in, *x.shape)) for x, a, b in cuts])
        flat = cols.reshape((n_in, n_out)).T.astype(y.dtype)
        return y, [flat[:, a:b].reshape((*y.shape, *x.shape)) for x, a, b in cuts]

    return jacobian


def _hessian(traced: _Traced, reverse: bool, lift: tuple[int, ...] = ()) -> Callable:
    hvps = _batched(_hvp(traced, reverse, lift))

    def hessian(x: Any, data: list) -> Any:
        n = x.size
        h = hvps([x], data, [mx.eye(n, dtype=x.dtype).reshape((n, *x.shape))])[0].reshape((n, n))
        # reverse: row i is e_i^T H; forward over reverse: H e_i, column i, transposed into place
        return (h if reverse else h.T).reshape((*x.shape, *x.shape))

    return hessian


def _hvp(traced: _Traced, reverse: bool, lift: tuple[int, ...] = ()) -> Callable:
    def hvp(xs: list, data: list, ts: list) -> list:
        k = len(xs)
        g, primals = _primals(lambda xs, data: traced(xs, data)[0], xs, data, lift)
        grad = mx.grad(lambda p: g(*p))
        # reverse: H is symmetric, the pullback of the gradient is the product; else forward
        # over reverse, one jvp of the gradient, no Hessian built
        if reverse:
            return mx.vjp(lambda *p: grad(list(p))[:k], primals, ts)[1][:k]
        return mx.jvp(lambda *p: grad(list(p))[:k], primals, [*ts, *_zeros(primals, k)])[1]

    return hvp


# ---------------------------------------------------------------------------------------
# Composition (ad.differentiate_with): the core's boundary functions as MLX custom
# functions (custom_function).  Their values need concrete inputs, which MLX has under
# mx.grad/vjp/jvp.  Under mx.vmap (the backend's jacobian and hessian batch tangents and
# cotangents over a basis) the batched arguments are traced; each boundary function is
# linear in all its inputs but the first (x), so a traced one is applied through the
# function's matrix in it, one call per basis vector.  A traced x (mx.compile, or an
# mx.vmap over x itself) raises.
def _custom_value(value: Callable[..., np.ndarray], dtype: Any) -> Any:
    """``value(x, *rest)``, a numpy function of flat vectors linear in each of ``rest``, as
    an MLX custom function returning ``dtype`` (its derivative rules set by the caller).
    Under mx.vmap it runs once per batch element: MLX's own batching would replace it by
    the graph of its value, and a nested transform would differentiate that graph,
    silently, instead of calling the rules."""
    kernel = getattr(value, "__self__", None)  # the boundary's functions are ForeignKernel methods
    what = f"a {kernel.backend.name} kernel" if hasattr(kernel, "backend") else "another library's function"

    def call(*args: Any) -> Any:
        values = _concrete(args)
        if values[0] is None:
            raise CompositionError(
                f"mlx code calling {what} through differentiate_with inside mx.compile, or inside an "
                f"mx.vmap over the kernel's input (per-sample derivatives), is not supported: the kernel "
                f"needs concrete values of its input (the mlx backend's jacobian and hessian, whose mx.vmap "
                f"runs over tangents, work); use compile=False, and a loop over the samples"
            )
        return _through_traced(value, values, args, dtype)

    op = mx.custom_function(call)

    @op.vmap
    def batched(inputs: Any, axes: Any) -> tuple:
        inputs, axes = _listed(inputs), _listed(axes)
        moved = [a if d is None else mx.moveaxis(a, d, 0) for a, d in zip(inputs, axes)]
        size = next(a.shape[0] for a, d in zip(moved, axes) if d is not None)
        return mx.stack([op(*[a if d is None else a[k] for a, d in zip(moved, axes)]) for k in range(size)]), 0

    return op


def _listed(a: Any) -> list:
    # mx.custom_function hands one primal, tangent, cotangent or vmap axis over bare
    return list(a) if isinstance(a, (list, tuple)) else [a]


def _arrays(rule: Any, values: Sequence, what: str) -> tuple:
    """A rule's cotangents or tangents, refused where one is a numpy array: MLX silently drops
    a numpy array a custom function's rule returns (the gradient came out as the cotangent
    itself), and converted, it would be a constant to MLX, whose outer transforms cannot say
    that they differentiate the rule (mx.jvp of mx.grad runs it on plain arrays): a second
    derivative would silently lose whatever the rule computed it from."""
    if any(isinstance(v, (np.ndarray, np.generic)) for v in values):
        raise CustomRuleError(
            f"{rule.name}: {what} is a numpy array, but the function was called with mlx arrays: numpy arrays "
            f"carry no derivative, so a second derivative through the rule would silently lose whatever {what} "
            f"was computed from; compute it with MLX (autoray's numpy interface works on every backend), or "
            f"return None for zero"
        )
    return tuple(values)


@contextlib.contextmanager
def _rule_running(rule: Any, what: str) -> Iterator[None]:
    """MLX's refusal to evaluate a traced array, where the user's rule asked for one, as the
    rule's error: MLX traces the rule's inputs where it differentiates the rule itself."""
    try:
        yield
    except ValueError as err:
        if _EVAL_IN_TRANSFORM not in str(err):
            raise
        raise CustomRuleError(
            f"{rule.name}: {what} needs the value of a traced MLX array (np.asarray, float(), .item(), a "
            f"numpy call), which MLX has only where it does not differentiate the rule itself: a second "
            f"derivative (hessian, hvp, an operator inside another), forward mode through a custom_vjp, or "
            f"compile=True; write {what} with MLX operations (autoray's numpy interface works on every backend)"
        ) from err


def _rule_function(value: Callable[[list], Sequence], vjp: Callable[[list, list], Sequence], jvp: Callable) -> Any:
    """``*xs -> tuple(value(xs))`` as an MLX custom function whose derivatives are
    ``vjp(primals, cotangents)`` and ``jvp(primals, tangents)`` (lists, no None), the rules
    of :meth:`MLXAdapter.custom_rule`.  Under mx.vmap it is such a function again, of the
    rules vmapped: MLX's own batching would return the graph of the value, and a derivative
    taken outside the vmap would differentiate that graph instead of calling the rules."""
    op = mx.custom_function(lambda *xs: tuple(value(list(xs))))  # a tuple in, a tuple out

    @op.vjp
    def vjp_rule(primals: Any, cotangents: Any, outputs: Any) -> tuple:
        cts = [mx.zeros_like(o) if c is None else c for c, o in zip(_listed(cotangents), _listed(outputs))]
        return tuple(vjp(_listed(primals), cts))

    @op.jvp
    def jvp_rule(primals: Any, tangents: Any) -> tuple:
        xs = _listed(primals)
        return tuple(jvp(xs, [mx.zeros_like(x) if t is None else t for x, t in zip(xs, _listed(tangents))]))

    @op.vmap
    def vmap_rule(inputs: Any, axes: Any) -> tuple:
        inputs, axes = _listed(inputs), _listed(axes)
        size = next(a.shape[d] for a, d in zip(inputs, axes) if d is not None)
        # every input batched on axis 0 (broadcast_to copies nothing), so that each rule
        # is one mx.vmap of itself; MLX sums an unbatched input's cotangent over the batch
        xs = [mx.broadcast_to(a, (size, *a.shape)) if d is None else mx.moveaxis(a, d, 0) for a, d in zip(inputs, axes)]

        each = lambda rule: lambda *a: tuple(rule(list(a[: len(xs)]), list(a[len(xs):])))  # noqa: E731

        outputs = _rule_function(lambda xs: mx.vmap(lambda *a: tuple(value(list(a))))(*xs),
                                 lambda xs, cts: mx.vmap(each(vjp))(*xs, *cts),
                                 lambda xs, ts: mx.vmap(each(jvp))(*xs, *ts))(*xs)
        return outputs, (0,) * len(outputs)

    return op


def _concrete(arrays: tuple) -> list[np.ndarray | None]:
    """The arrays' values, ``None`` for one MLX traces (inside mx.vmap or mx.compile).

    Evaluated inside a custom vjp rule, where MLX keeps the graph: an evaluation elsewhere
    (in a jvp rule) detaches the arrays an inner transform has marked done with, cutting
    an outer transform's graph, and a third derivative would come out silently zero."""
    def value(a: Any) -> np.ndarray | None:
        try:
            return np.array(a)
        except ValueError as err:
            if _EVAL_IN_TRANSFORM not in str(err):
                raise
            return None

    return _in_vjp_rule(lambda: [value(a) for a in arrays])


def _through_traced(compute: Callable[..., np.ndarray], values: list, args: tuple, dtype: Any) -> Any:
    """``compute(*values)`` as an MLX array, where ``values[i] is None`` for a traced
    ``args[i]`` (one ``compute`` is linear in): ``sum_k args[i][k] * compute(..., e_k, ...)``."""
    i = next((i for i, v in enumerate(values) if v is None), None)
    if i is None:
        return mx.array(compute(*values), dtype=dtype)
    rows = [_through_traced(compute, [*values[:i], e, *values[i + 1:]], args, dtype) for e in np.eye(args[i].size)]
    return args[i].astype(dtype) @ mx.stack(rows)


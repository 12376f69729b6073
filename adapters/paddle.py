"""PaddlePaddle: reverse mode with ``paddle.grad``, forward mode by the double-vjp trick.

An adapter of the protocol (:class:`abstractdiff.protocol.Adapter`): ``ad.backend("paddle")``
is the core's backend holding a :class:`PaddleAdapter`.  Its fast routes are the Hessian,
second derivative and HVP by ``paddle.grad`` directly, and a prepared gradient of plain
tensors is one closure (:meth:`PaddleAdapter.direct_prepared`); its variable hooks
(:class:`_Variables`) take ``paddle.nn.Layer`` parameters.

Reverse mode (gradient, pullback, Jacobian rows, Hessian rows, and the Hessian-vector
product as reverse over reverse) runs ``paddle.grad`` on detached copies of the inputs
with ``stop_gradient=False``: the caller's tensors keep their ``stop_gradient`` flag, and
nothing calls ``.backward()`` or writes any ``.grad``.

Forward mode is the double-vjp trick (https://j-towns.github.io/2017/06/12/A-new-trick.html):
the pullback ``u -> J^T u`` is linear in the cotangent ``u``, so its own pullback at ``t``
is ``J t``.  ``paddle.incubate.autograd.jvp`` does this in dynamic mode too (its
primitive-based forward mode needs static graphs), but it fails on ``sum(x**2)`` in
paddle 3.3 ("The output DenseTensor DX can not be nullptr"), runs ``f`` again for every
tangent and is a beta API.  Here one forward pass and one ``J^T u`` graph serve every
tangent of a pushforward, with a way around each of paddle's failures
(:data:`_DOUBLE_VJP_ROUTES`).

paddle 3.3 has no second derivative for some ops (max, prod, softmax, diagonal, tril...): the
autoray translations (:mod:`abstractdiff.portable.paddle`) give the usual numpy names
twice-differentiable versions, and a second derivative through the others raises a
:class:`~abstractdiff.CompositionError` naming the op and the fixes (see :func:`abstractdiff.portable.paddle.explained`,
which also names the dtype of a kernel paddle's CPU build lacks: float16).  paddle's gradients
of ``linalg.solve`` and ``triangular_solve`` are wrong or crash with a constant operand: the
translations use an explicit adjoint.

Nested use: when an input already has ``stop_gradient=False`` and grad mode is on, we are
inside an outer differentiation (an abstractdiff operator called in a function being
differentiated, or the caller's own ``paddle.grad``); inputs are then aliased rather than
detached and derivatives are built with ``create_graph=True``.

``compile=True`` converts the user's function with ``paddle.jit.to_static`` (its AST mode,
``full_graph=True``) once per function, input structure and static leaves, and
differentiates the program in dynamic mode.  For float32 first-order reverse mode only:
float64, forward mode, second order and nested use run ``f`` eagerly (see
:meth:`PaddleAdapter._forward` for why).  A function paddle cannot convert (a lambda, one
without source) runs eagerly, with a warning.  On the CPU the program is not faster than
dynamic mode: ``compile=False`` is the default.

Paddle's global mode is left alone: if the user switched paddle to static mode
(``paddle.enable_static()``), each operator, hook and returned closure runs inside a
dynamic-mode scope and paddle is back in static mode when it returns.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from abstractdiff import _errors
from abstractdiff import _pytree as pytree
from abstractdiff._arrays import bfloat16_numpy, check_scalar, size_of
from abstractdiff._derived import DerivedOperators
from abstractdiff._errors import ArgumentTypeError, CompositionError, ModeMismatchError, NonDifferentiableInputError
from abstractdiff._tree import Artefacts, FlatFunction, artefacts, check_output, split_aux
from abstractdiff.portable.paddle import MISSING_INPUT_GRADIENT, _arrays, _fresh, _needs_grad, explained
from abstractdiff.protocol import Adapter, FlatFn


def _import_paddle() -> types.ModuleType:
    """``import paddle``, safely after TensorFlow.

    With TensorFlow already imported, loading libpaddle crashes the process (a segfault
    while the extension module initialises; TensorFlow 2.21 and paddle 3.3 on Linux): a
    clash of native symbols between the two, which ``RTLD_DEEPBIND`` (libpaddle resolves
    its symbols in its own libraries first) avoids.  The flag is set only for this import,
    only when TensorFlow is loaded, and restored afterwards.  A user who imports paddle
    themselves after TensorFlow still crashes, inside paddle: import paddle first, or create
    the backend (``ad.backend("paddle")``) before importing paddle.
    """
    old = sys.getdlopenflags()
    if "tensorflow" in sys.modules and hasattr(os, "RTLD_DEEPBIND"):
        sys.setdlopenflags(old | os.RTLD_DEEPBIND)
    try:
        with warnings.catch_warnings():
            # paddle warns at import time that ccache (for compiling C++ extensions) is missing
            warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
            import paddle
    finally:
        sys.setdlopenflags(old)  # unchanged where the flag was not set
    return paddle


paddle = _import_paddle()

_ARRAYS = _arrays()

# Tensors this adapter made from numpy arrays (held weakly): nobody else holds them, so
# nobody can write into them (see snapshot).
_OWN: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


_NOTHING = contextlib.nullcontext()


def _dynamic_mode() -> contextlib.AbstractContextManager[Any]:
    """A dynamic-mode scope if the user switched paddle to static mode, else nothing.

    Every operator runs in dynamic mode; ``paddle.enable_static()`` is a global switch of
    the user's, which this scope leaves as it was when it exits.
    """
    return _NOTHING if paddle.in_dynamic_mode() else paddle.base.dygraph.guard()


def _dynamic(method: Callable) -> Callable:
    """A method that runs in dynamic mode (see :func:`_dynamic_mode`)."""

    @functools.wraps(method)
    def in_dynamic_mode(*args: Any, **kwargs: Any) -> Any:
        if paddle.in_dynamic_mode():  # the common case: no context manager to enter
            return method(*args, **kwargs)
        with paddle.base.dygraph.guard():
            return method(*args, **kwargs)

    return in_dynamic_mode


def _recording() -> contextlib.AbstractContextManager[Any]:
    """Grad mode on (the caller may be under ``paddle.no_grad()``), in dynamic mode."""
    # the common case: nothing to enter
    return _NOTHING if paddle.in_dynamic_mode() and paddle.is_grad_enabled() else _recording_scope()


@contextlib.contextmanager
def _recording_scope() -> Iterator[None]:
    with _dynamic_mode(), paddle.enable_grad():
        yield


#: The routes of the double-vjp trick, in the order they are tried.  paddle 3.3's second
#: pullback fails in two ways: asked for ``u`` alone, some double-grad kernels want the
#: input's gradient too ("The output DenseTensor DX can not be nullptr": pow, so x**2, and
#: paddle.incubate.autograd.jvp with it); asked for the inputs too, it fails where ``J^T u``
#: does not depend on them ("Unable to fill empty grad inputs": concat).  And an op without
#: a second derivative (softmax, sort...) fails both: the last route builds ``J`` by pullbacks.
_DOUBLE_VJP_ROUTES = ("u and inputs", "u", "jacobian")

def _operator(method: Callable, dynamic: bool = True) -> Callable:
    """An operator (a method or a returned closure): in dynamic mode (see :func:`_dynamic`; or
    ``dynamic=False``, where it checks itself), with paddle's errors about what it lacks made
    abstractdiff's, or given a note (:func:`abstractdiff.portable.paddle.explained`)."""
    method = _dynamic(method) if dynamic else method

    @functools.wraps(method)
    def operator(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as err:
            ours = None if isinstance(err, CompositionError) else _refusal(err) or explained(err)
            if ours is None:
                raise
            raise ours from err

    return operator


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, paddle.Tensor) else v, tree)


#: paddle's backward engine is not safe to run from two threads at once (double frees and
#: segfaults in pullback, hvp and second derivatives, issue 24 item 6); re-entrant, because a
#: PyLayer's backward may call paddle.grad again on the same thread.
_GRAD_LOCK = threading.RLock()


def _grad(ys: list, inputs: list, dys: list | None = None, *, retain_graph: bool = False,
          create_graph: bool = False, hidden: list = ()) -> list:  # type: ignore[assignment]
    """``paddle.grad`` of ``ys`` (cotangents ``dys``) for ``inputs``; ``None`` where unconnected.

    ``hidden``: leaves of operators nested in the recorded function.  paddle 3.3's
    double-grad kernel of pow needs the gradient of its input even when nobody asked for it
    (an outer derivative with respect to ``a`` of an inner gradient of ``a * sum(x**2)``
    with respect to ``x``); asked for the hidden leaves too, it computes them, and they are
    dropped.
    """
    if all([y.stop_gradient for y in ys]):  # nothing differentiable reaches ys
        return [None] * len(inputs)
    if getattr(_refused, "depth", 0):  # paddle 3.3 crashes the process on paddle.grad in a PyLayer's backward
        err = _errors.CustomRuleError("the paddle backend cannot take a derivative inside a custom rule's "
                                      "backward (paddle.grad there crashes paddle 3.3): a second derivative "
                                      "through ad.custom_root, or a bwd that calls an operator")
        err.route = True  # the double-vjp trick's refusal: its last route, pullbacks only, may work
        raise err
    with _GRAD_LOCK:
        if hidden:
            try:  # the graph is kept, for the second attempt
                return paddle.grad(ys, inputs, dys, retain_graph=True, create_graph=create_graph, allow_unused=True)
            except RuntimeError as err:
                if MISSING_INPUT_GRADIENT not in str(err):
                    raise
        grads = paddle.grad(ys, [*inputs, *hidden], dys, retain_graph=retain_graph or create_graph,
                            create_graph=create_graph, allow_unused=True)
    return grads[: len(inputs)]


class _Frames(threading.local):
    """Per thread, the operators whose ``f`` is running: each collects the leaves of the
    operators nested in it (see :func:`_grad`)."""

    def __init__(self) -> None:
        self.stack: list[list] = []

    def run(self, f: Callable[..., Any], *args: Any) -> tuple[Any, list]:
        """``f(*args)``, and the leaves of the operators nested in it."""
        hidden: list = []
        self.stack.append(hidden)
        try:
            return f(*args), hidden
        finally:
            self.stack.pop()


_frames = _Frames()


class _Recorded:
    """One recorded run of ``f``: its output ``y`` and ``aux``, the leaves it was run on,
    whether it is nested in an outer derivative, and the leaves of operators nested in it."""

    __slots__ = ("y", "aux", "leaves", "nested", "hidden")

    def __init__(self, y: Any, aux: Any, leaves: list, nested: bool, hidden: list):
        self.y, self.aux, self.leaves, self.nested, self.hidden = y, aux, leaves, nested, hidden

    def grad(self, ys: list, inputs: list, dys: list | None = None, **graph: bool) -> list:
        """:func:`_grad` with this run's hidden leaves (``graph``: retain_graph, create_graph)."""
        return _grad(ys, inputs, dys, hidden=self.hidden, **graph)

    def outputs(self) -> tuple[Any, Any]:
        """``(y, aux)`` as the operator returns them: in the outer graph when nested, else plain values."""
        return (self.y, self.aux) if self.nested else (self.y.detach(), _detached(self.aux))  # None stays None

    def rows(self, z: Any, create_graph: bool) -> Iterator[list]:
        """The pullbacks of ``z`` at each one-hot cotangent in turn (the rows of its Jacobian), the graph kept."""
        basis = paddle.eye(size_of(z), dtype=z.dtype)
        for i in range(size_of(z)):
            yield self.grad([z], self.leaves, [basis[i].reshape(z.shape)], retain_graph=True, create_graph=create_graph)

    @_operator  # once, here: a closure decorated per call would cost each pullback more than its checks
    def pullback(self, dy: Any) -> list:
        """``dy -> J^T dy``; the graph is kept: the pullback may be called again (a Jacobian row by row)."""
        with _recording():
            return self.grad([self.y], self.leaves, [dy], retain_graph=True, create_graph=self.nested)


class _Variables:
    """The variable hooks (the adapter's ``variables``): a paddle parameter is a leaf tensor
    with stop_gradient=False (a Layer's parameters, paddle.create_parameter, or any float
    tensor whose flag the user cleared)."""

    def __init__(self, adapter: PaddleAdapter):
        self.adapter = adapter  # its ``backend`` (the holder), set after construction, for core services

    def is_variable(self, v: Any) -> bool:
        return isinstance(v, paddle.Tensor)

    def check_variable(self, v: Any, where: str) -> None:
        # stop_gradient first: an integer tensor cannot be differentiated, so it is data
        if v.stop_gradient:
            raise ModeMismatchError(f"{where} is a paddle tensor with stop_gradient=True (frozen, or data); set "
                                    f"stop_gradient = False on it (or create it with ad.variables(tree, 'paddle'))")
        if not v.is_leaf:
            raise ModeMismatchError(f"{where} is a paddle tensor computed from other tensors (not a leaf); parameters "
                                    f"must be leaf tensors: use the tensors it was computed from, or a detached copy "
                                    f"with stop_gradient = False")
        if not v.is_floating_point():
            raise NonDifferentiableInputError(f"{where} is a paddle tensor of dtype {v.dtype}; only float tensors can "
                                              f"be parameters")

    def model_variables(self, obj: Any) -> tuple[list, int] | None:
        if not isinstance(obj, paddle.nn.Layer):
            return None
        params = obj.parameters()  # shared parameters once
        trainable = [p for p in params if not p.stop_gradient]
        return trainable, len(params) - len(trainable)

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        # parameters (frozen ones too) and buffers (BatchNorm's running statistics), with
        # state_dict's names; paddle's state_dict holds the tensors themselves
        return list(obj.state_dict().items()) if isinstance(obj, paddle.nn.Layer) else None

    def forward_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        # every buffer, the non-persistable ones (register_buffer(..., persistable=False)) too
        return list(obj.named_buffers()) if isinstance(obj, paddle.nn.Layer) else None

    def read(self, var: Any) -> Any:
        return var.detach()

    @_dynamic
    def read_kept(self, var: Any) -> Any:
        return var.detach().clone()  # detach() shares memory that set_value writes

    @_dynamic
    def write(self, var: Any, value: Any) -> None:
        with paddle.no_grad():
            var.set_value(value)

    def current_value(self, var: Any) -> Any:
        return var

    @_dynamic
    def new_variable(self, value: Any) -> Any:
        return paddle.create_parameter(list(value.shape), value.dtype,
                                       default_initializer=paddle.nn.initializer.Assign(value.detach()))

    @_operator
    def implicit_value_and_gradient(self, f: Callable[..., Any], variables: list, args: tuple, has_aux: bool) -> tuple:
        args = self._fit_to(variables, args)
        with _recording():
            y, aux = split_aux(f(*args), has_aux)
            y = self.adapter._tensor(check_output(y, variables))
            check_scalar(y)
            grads = _grad([y], variables)
        return y.detach(), _detached(aux), self.adapter.backend.complete(grads, variables)

    @_operator
    def implicit_value_and_pullback(self, f: Callable[..., Any], variables: list, args: tuple) -> tuple:
        args = self._fit_to(variables, args)
        with _recording():
            y = self.adapter._tensor(check_output(f(*args), variables))

        @_operator
        def vjp(dy: Any) -> list:
            dy = paddle.cast(self.adapter.backend.cotangent(dy, y), y.dtype)
            with _recording():
                grads = _grad([y], variables, [dy], retain_graph=True)
            return self.adapter.backend.complete(grads, variables)

        return y.detach(), vjp

    @staticmethod
    def _fit_to(variables: list, args: tuple) -> tuple:
        # Data goes to the model's place and float data to the widest float dtype of the
        # model's variables: a float64 batch for a float32 layer would fail in paddle's
        # matmul, and the first variable's dtype would narrow the data a wider (float64)
        # variable meets, losing its precision.
        place = variables[0].place
        floats = [v for v in variables if v.is_floating_point()]
        dtype = max(floats, key=lambda v: v.element_size()).dtype if floats else None

        def fit(a: Any) -> Any:
            if not isinstance(a, paddle.Tensor):
                return a
            if dtype is not None and a.is_floating_point() and a.dtype != dtype:
                a = paddle.cast(a, dtype)
            return a if a.place == place else a.to(place)

        return pytree.tree_map(fit, args)


class PaddleAdapter(Adapter):
    name = "paddle"
    extra = "paddle"
    modules = ("paddle",)
    fast_routes = {"hessian": "hessian", "second_derivative": "second_derivative", "hvp": "hvp"}

    def __init__(self, *, device: str = "cpu", compile: bool = False):
        if not isinstance(compile, bool):
            raise ArgumentTypeError(f"compile must be True or False, got {compile!r}")
        super().__init__(device=device, compile=compile)
        self.compile = compile
        self.reuses_traces = compile  # a compiled program freezes what f reads (see Adapter.reuses_traces)
        if compile:
            # Have paddle.jit.to_static call autoray, abstractdiff and this module as they are.
            # to_static rewrites the source of every function f calls, and fails on autoray's
            # dispatch (a dict assignment in a try block: "'UndefinedVar' object does not support
            # item assignment"), so backend-neutral functions would never compile.  Both are plain
            # Python that must run while paddle traces; paddle's public ignore_module says so, as
            # paddle itself does for numpy, copy or inspect.  This adds to paddle's list of
            # modules it does not rewrite, which no user setting controls, and changes nothing else.
            import autoray

            import abstractdiff

            paddle.jit.ignore_module([autoray, abstractdiff, sys.modules[__name__]])
        # the core's canonical "cpu" or "cuda:N" as paddle's place
        kind, _, index = self.device.partition(":")
        self.place = paddle.CPUPlace() if kind == "cpu" else paddle.CUDAPlace(int(index))
        #: How many times paddle.jit.to_static traced a user function for this backend (a
        #: test hook: a repeated call with the same function, structure, shapes, dtypes
        #: and static leaves must not add one).
        self.trace_count = 0
        self.variables = _Variables(self)

    # ---------------------------------------------------------------- devices
    def devices(self) -> list[str]:
        gpus = paddle.device.cuda.device_count() if paddle.device.is_compiled_with_cuda() else 0
        return ["cpu", *(f"cuda:{i}" for i in range(gpus))]

    # ---------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        return isinstance(a, _ARRAYS)

    @_dynamic
    def from_numpy(self, a: np.ndarray) -> Any:
        t = paddle.to_tensor(a, place=self.place)  # a copy, in a's dtype
        _OWN[id(t)] = t
        return t

    @_dynamic
    def from_dlpack(self, a: Any) -> Any:
        # shares memory on the CPU; numpy will not export read-only memory this way (a copy)
        if self.device == "cpu":
            with contextlib.suppress(BufferError, RuntimeError, TypeError, ValueError):
                return paddle.utils.dlpack.from_dlpack(a)
        return super().from_dlpack(a)

    @_dynamic
    def numpy_view(self, a: Any) -> np.ndarray:
        if a.place.is_cpu_place() and a.dtype != paddle.bfloat16:
            return np.from_dlpack(a)  # its memory (.numpy() copies)
        return self.to_numpy(a)

    @_dynamic
    def to_numpy(self, a: Any) -> np.ndarray:
        if a.dtype == paddle.bfloat16:  # paddle's numpy() of bfloat16 is its raw uint16 bits
            return bfloat16_numpy(a.detach().astype("float32").numpy())
        return a.numpy()

    @_dynamic
    def cast(self, a: Any, dtype: str) -> Any:
        return paddle.cast(a, dtype)

    @_dynamic
    def zeros_like(self, a: Any) -> Any:
        return paddle.zeros_like(a)

    @_dynamic
    def ones_like(self, a: Any) -> Any:
        return paddle.ones_like(a)

    def snapshot(self, a: Any) -> Any:
        # A caller's tensor can be written in place later (set_value, x[i] = ...), and
        # paddle's inplace-version check does not catch every such write: a pullback would
        # silently use the new values.  clone() is differentiable: nested use keeps its graph.
        if not isinstance(a, paddle.Tensor) or _OWN.get(id(a)) is a:
            return a
        with _dynamic_mode():
            return a.clone()

    def scope(self, arrays: Any) -> contextlib.AbstractContextManager[Any]:
        # the optimisers' arithmetic on paddle tensors needs dynamic mode too
        return _dynamic_mode()

    @_dynamic
    def asarray_like(self, a: np.ndarray, like: Any) -> Any:
        t = paddle.to_tensor(a, place=like.place)
        if not like.stop_gradient and t.is_floating_point():
            t.stop_gradient = False
        return t

    # ---------------------------------------------------------------- helpers
    def _tensor(self, y: Any) -> Any:
        """``f``'s output as a paddle tensor: a Python number (a constant) reaches here as the
        0-d array the core's check_output made of it; the core refused numpy's own values."""
        return y if isinstance(y, paddle.Tensor) else self.backend.asarray(np.asarray(y))

    def _record(self, fn: FlatFn, xs: list, data: list, compiled: bool = False) -> _Recorded:
        """``f`` run on fresh leaves for ``xs``, recording its graph (``compiled``: through
        ``to_static`` where it may, see :meth:`_forward`)."""
        # Symbolic values: an operator called inside a function paddle.jit.to_static traces.  The
        # operators differentiate in dynamic mode; ops they would add to a program being built
        # leave it broken, and paddle 3.3 then aborts the process when it destroys the program.
        if any(isinstance(a, paddle.pir.Value) for a in (*xs, *data)):
            raise ModeMismatchError("paddle backend: an abstractdiff operator was called on symbolic values, inside "
                                    "a function that paddle.jit.to_static is converting (compile=True, or your own "
                                    "to_static); the paddle backend differentiates in dynamic mode: call the "
                                    "operator outside the converted function, or use ad.backend('paddle') "
                                    "(compile=False) for functions that call abstractdiff operators")
        nested = paddle.is_grad_enabled() and any(_needs_grad(t) for t in (*xs, *data))  # in an outer derivative
        # assign keeps the outer graph and gives each input its own node, so that the same
        # tensor passed twice gets two partial derivatives.
        leaves = [paddle.assign(x) if nested and not x.stop_gradient else _fresh(x) for x in xs]
        forward = self._forward(fn, xs, data) if compiled and not nested else fn
        outer = _frames.stack[-1] if _frames.stack else None
        with _recording():
            (y, aux), hidden = _frames.run(forward, leaves, data)
        if nested and outer is not None:  # our leaves are hidden from the operator we run inside
            outer += [*leaves, *hidden]
        return _Recorded(self._tensor(y), aux, leaves, nested, hidden)

    # ------------------------------------------------------------- compilation
    def _forward(self, fn: FlatFn, xs: list, data: list) -> FlatFn:
        """``fn``, or its twin calling the ``to_static`` program of ``f``, cached in ``fn``'s artefacts.

        For first-order reverse mode only: the gradient of a to_static program is not itself
        differentiable (paddle 3.3 returns zeros, silently, for a derivative of it), so
        forward mode (the double-vjp trick), second order and nested use run ``f`` eagerly.
        And for float32 (and narrower) only: paddle 3.3's programs hold Python scalars as
        float32 (``x * 0.1`` or ``x / 3`` on float64 differ from dynamic mode by ~1e-8), so
        float64 inputs run eagerly too.
        """
        if not self.compile or not isinstance(fn, FlatFunction) or any(
                a.dtype == paddle.float64 for a in (*xs, *data) if isinstance(a, paddle.Tensor)):
            return fn
        store = fn.artefacts(self.backend, "paddle.jit.to_static")
        return store.get("forward", lambda: self._compiled(fn, store))

    def _compiled(self, fn: FlatFunction, store: Artefacts) -> FlatFn:
        """``fn``'s twin calling the ``to_static`` program of ``f`` (a function or method), else ``fn``.

        to_static(f) holds f strongly: kept in fn's artefacts it would keep f alive, and with
        it the plan cache entry that is meant to die with f.  A twin function sharing f's
        code, globals and closure converts to the same program without holding f (or, for a
        method, its owner).  Other callables (a partial, a callable object) have no such twin:
        they run eagerly.
        """
        f = fn.f
        func, owner = (f.__func__, f.__self__) if isinstance(f, types.MethodType) else (f, None)
        if not isinstance(func, types.FunctionType):
            return fn
        twin = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
        twin.__kwdefaults__ = func.__kwdefaults__
        static = paddle.jit.to_static(twin, full_graph=True)
        owner_ref = None if owner is None else weakref.ref(owner)
        call = static if owner_ref is None else lambda *args: static(owner_ref(), *args)
        program = FlatFunction(call, fn.x_treedef, fn.args_treedef, fn.template, fn.diff_index, fn.data_index,
                               fn.n_x_leaves, fn.has_aux)

        def forward(xs: list, data: list, _keep: Any = call) -> tuple[Any, Any]:
            # to_static keeps one program per input signature; a new one is a trace
            before = static.get_traced_count()
            try:
                out = program(xs, data)
            except Exception as err:
                # paddle converts Python source, and not every function (a lambda, a function
                # without source, code it cannot translate): run f eagerly; an error that is
                # f's own raises again here, unchanged.
                out = fn(xs, data)
                # paddle puts the original error last, after the transformed code
                lines = [line.strip() for line in str(err).splitlines() if line.strip()]
                warnings.warn(f"paddle.jit.to_static could not convert {fn!r} ({type(err).__name__}: "
                              f"{lines[-1] if lines else ''}); running it eagerly from now on", RuntimeWarning, 2)
                store.put("forward", fn)
                return out
            self.trace_count += static.get_traced_count() - before
            return out

        return forward

    # ------------------------------------------------------------- composition
    def custom_function(self, value: Callable[..., np.ndarray], vjps: Sequence[Callable[..., Any]],
                        jvps: Sequence[Callable[..., Any]], out: tuple[int, str]) -> Callable[..., Any]:
        # paddle differentiates only through vjps: its forward mode here is the double-vjp
        # trick, the derivative of a pullback in its cotangent, so the jvps go unused.  One
        # PyLayer per differentiable input (see _Closure), summed: the first gives the value,
        # the others zeros; each one's derivative is its vjp(cotangent, *inputs).
        def function(*inputs: Any) -> Any:
            def part(t: Any, vjp: Callable[..., Any], value_of: Callable[[], np.ndarray]) -> Any:
                return _Closure.apply(t, lambda: paddle.to_tensor(value_of(), dtype=out[1], place=t.place),
                                      lambda cotangent: vjp(cotangent, *inputs))

            y = part(inputs[0], vjps[0], lambda: value(*(a.detach().numpy() for a in inputs)))
            for t, vjp in zip(inputs[1:], vjps[1:]):
                if not t.stop_gradient:
                    y = y + part(t, vjp, lambda: np.zeros(*out))
            return y

        return function

    def custom_rule(self, rule: Any) -> Callable[..., tuple]:
        # One PyLayer of one tensor, the differentiated inputs packed (see _Rule).  Symbolic values
        # (a to_static trace) take paddle's static PyLayer, bound to a context as to_static binds
        # one, without rewriting _Rule's source.  ad.stop_gradient's rule is paddle's detach.
        if rule.stops_gradient:
            return lambda *inputs: tuple(a.detach() if isinstance(a, _ARRAYS) else a for a in inputs)

        rule.nested_derivatives = False  # paddle.grad in a PyLayer's backward crashes (see _grad)

        def h(*inputs: Any) -> tuple:
            traced = any(isinstance(t, paddle.pir.Value) for t in inputs)
            flags = [isinstance(t, _ARRAYS) and not t.stop_gradient for t in inputs]
            if not any(flags) or not (traced or paddle.is_grad_enabled()):  # nothing to differentiate
                return tuple(rule.value(*inputs))
            diff, consts = [t for t, d in zip(inputs, flags) if d], [t for t, d in zip(inputs, flags) if not d]
            layout = [([int(n) for n in t.shape], t.dtype) if d else None for t, d in zip(inputs, flags)]
            args = [_pack(diff, _widest(diff)), rule, layout, lambda: consts]  # consts: not PyLayer inputs
            ctx = paddle.jit.dy2static.py_layer.StaticPyLayerContext() if traced else None
            out = paddle.static.nn.static_pylayer(functools.partial(_Rule.forward, ctx), args, functools.partial(
                _Rule.backward, ctx)) if traced else _Rule.apply(*args)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)

        return h

    # ------------------------------------------------------------ reverse mode
    @_operator
    def value_and_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        rec = self._record(fn, xs, data, compiled=True)
        return (*rec.outputs(), rec.pullback)

    def direct_prepared(self, prepared: Any, xs: list, data: list) -> Callable[..., Any] | None:
        # A prepared gradient of f(x, *arrays) on plain tensors: the core's layering (the
        # check, the preparation, the flat run, _record) is about 10 of a 35 us call (tiny,
        # measured); this closure does the same steps when every input is a tensor of the
        # preparation's dtypes (and shapes) outside any outer derivative, in dynamic mode.
        # Anything else takes the core's route, which says what changed.  (A pytree x too
        # would cost this case 1 us of its 4: flattening, and filling unused leaves.)
        fn, signature, tensor = prepared.fn, prepared.signature, paddle.Tensor
        if (self.compile or not fn._array_args or prepared.has_aux or signature.static
                or prepared.operator not in ("value_and_gradient", "gradient")
                or not all(type(a) is tensor for a in (*xs, *data))):
            return None
        f_ref, check_and_run, with_value = fn._f, prepared.check_and_run, prepared.operator == "value_and_gradient"
        raw, grad_enabled = signature.x_raw + signature.data_raw, paddle.is_grad_enabled  # a shape None: any
        dynamic = paddle.in_dynamic_mode

        def direct(x: Any, *args: Any) -> Any:
            inputs, f = (x, *args), f_ref()
            if not (f is not None and len(inputs) == len(raw) and dynamic() and grad_enabled() and all(
                # paddle's dtypes are singletons; stop_gradient=False: nested in an outer derivative
                type(t) is tensor and t.stop_gradient and t.dtype is d and (s is None or t.shape == s)
                for t, (s, d) in zip(inputs, raw)
            )):
                return check_and_run(x, *args)
            leaf = _fresh(x)
            y, hidden = _frames.run(f, leaf, *args)
            if type(y) is not tensor or y.dtype is not leaf.dtype:
                y = self._tensor(check_output(y, [leaf]))
            check_scalar(y)
            if hidden or y.stop_gradient:
                (g,) = _grad([y], [leaf], hidden=hidden)
            else:  # the common case, without _grad's layers
                with _GRAD_LOCK:
                    (g,) = paddle.grad([y], [leaf], allow_unused=True)
            g = paddle.zeros_like(x) if g is None else g
            return (y.detach(), g) if with_value else g

        return _operator(direct, dynamic=False)

    # ------------------------------------------------------------ forward mode
    def _pushforward(self, rec: _Recorded, routes: Artefacts) -> Callable[[list], Any]:
        """``ts -> J ts`` at a recorded ``y``: the double-vjp trick.

        ``J^T u`` is built once, on the first call, with ``create_graph=True`` for a dummy
        cotangent ``u``; each call then pulls ``ts`` back through it.  paddle 3.3 fails on
        some of these second pullbacks (see :data:`_DOUBLE_VJP_ROUTES`): the routes are
        tried in order, and the one that works is remembered in ``routes`` (the flat
        function's artefacts).  The last route builds ``J`` itself, one pullback per output
        element, which needs first derivatives only.
        """
        y = rec.y

        built: dict[str, Any] = {}  # each built once, by the first tangent that needs it

        def transposed() -> tuple[Any, list]:
            if "transposed" not in built:
                u = _fresh(paddle.zeros_like(y))  # any value: J^T u is linear in u
                built["transposed"] = (u, rec.grad([y], rec.leaves, [u], create_graph=True))
            return built["transposed"]

        def jacobian() -> list:
            if "jacobian" not in built:
                rows = [self.backend.complete(r, rec.leaves) for r in rec.rows(y, rec.nested)]
                built["jacobian"] = [paddle.stack([r[k].reshape([-1]) for r in rows]) for k in range(len(rec.leaves))]
            return built["jacobian"]

        def apply(route: str, ts: list) -> Any:
            if route == "jacobian":
                products = [j @ t.reshape([-1]) for j, t in zip(jacobian(), ts)]
                return functools.reduce(lambda a, b: a + b, products).reshape(y.shape)
            u, vjps = transposed()
            pairs = [(g, t) for g, t in zip(vjps, ts) if g is not None and not g.stop_gradient]
            if not pairs:  # y does not depend on xs
                return paddle.zeros_like(y)
            inputs = [u, *rec.leaves, *rec.hidden] if route == "u and inputs" else [u]
            with _GRAD_LOCK:
                out = paddle.grad([g for g, _ in pairs], inputs, [t for _, t in pairs], retain_graph=True,
                                  create_graph=rec.nested, allow_unused=True)[0]
            return paddle.zeros_like(y) if out is None else out

        @_operator
        def jvp(ts: list) -> Any:
            with _recording():
                start = _DOUBLE_VJP_ROUTES.index(routes.peek("route") or _DOUBLE_VJP_ROUTES[0])
                for route in _DOUBLE_VJP_ROUTES[start:-1]:
                    try:
                        out = apply(route, ts)
                    except (RuntimeError, SystemError, ValueError):  # paddle's own failures (f does not run here)
                        continue
                    except OSError as err:  # a derivative differentiate_with's boundary does not carry (_refusal)
                        refused = _refusal(err)
                        if refused is None:
                            raise
                        # a route's refusal (another route may work), or the user's rule is wrong
                        if not (isinstance(refused, CompositionError) or getattr(refused, "mode", None)
                                or getattr(refused, "route", False)):
                            raise refused from err
                        break
                    routes.put("route", route)
                    return out
                routes.put("route", _DOUBLE_VJP_ROUTES[-1])  # the last route: its errors are raised
                return apply(_DOUBLE_VJP_ROUTES[-1], ts)

        return jvp

    @_operator
    def value_and_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        rec = self._record(fn, xs, data)  # eagerly: a to_static program has no second derivative
        return (*rec.outputs(), self._pushforward(rec, artefacts(fn, self.backend, "double-vjp route")))

    # ------------------------------------------------------------ composed
    # No Jacobian route: the core's (batched pullbacks, or pushforwards, the fewer) joins its
    # rows in scope() (dynamic mode) and each primitive call translates its own errors.
    @_operator
    def hessian(self, fn: FlatFn, xs: list, data: list) -> Any:
        # the Jacobian of the gradient, row by row: one double backward per element of x
        rec = self._record(fn, xs, data)
        x, shape = xs[0], [int(d) for d in xs[0].shape]
        check_scalar(rec.y, "hessian")
        with _recording():
            (g,) = rec.grad([rec.y], rec.leaves, create_graph=True)
            if g is None or g.stop_gradient:  # f is linear (or constant) in x
                return paddle.zeros(shape + shape, dtype=x.dtype)
            rows = [paddle.zeros_like(x) if r is None else r for (r,) in rec.rows(g, rec.nested)]
        return paddle.stack(rows).reshape(shape + shape) if rows else paddle.zeros(shape + shape, dtype=x.dtype)

    def second_derivative(self, fn: FlatFn, xs: list, data: list) -> Any:
        try:
            return self._second_derivative(fn, xs, data)
        except _errors.CustomRuleError as err:
            if err.mode != "reverse":
                raise
            # an ad.custom_jvp rule, which paddle cannot transpose: forward over forward (the
            # core's derivative of the derivative, the double-vjp trick twice) differentiates
            # the rule's jvp, as jax does
            return DerivedOperators.flat_second_derivative(self.backend, fn, xs, data)

    @_operator
    def _second_derivative(self, fn: FlatFn, xs: list, data: list) -> Any:
        # reverse over reverse, one double backward per element of y: forward over forward
        # would need third derivatives with the double-vjp trick (paddle has no SinTripleGradNode)
        rec = self._record(fn, xs, data)
        x, y = xs[0], rec.y
        y_shape = [int(d) for d in y.shape]
        with _recording():
            # d2 None where y is linear (or constant) in x: d None, or a constant
            out = [None if d is None else rec.grad([d], rec.leaves, retain_graph=True, create_graph=rec.nested)[0]
                   for (d,) in rec.rows(y, create_graph=True)]
        out = [paddle.zeros_like(x) if d2 is None else d2 for d2 in out]
        return paddle.stack(out).reshape(y_shape) if out else paddle.zeros(y_shape, dtype=y.dtype)

    @_operator
    def hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> list:
        # reverse over reverse, the gradient of <grad f, v>: forward over reverse would need
        # third derivatives with the double-vjp trick
        rec = self._record(fn, xs, data)
        check_scalar(rec.y, "hvp")
        with _recording():
            grads = rec.grad([rec.y], rec.leaves, create_graph=True)
            terms = [paddle.sum(g * t) for g, t in zip(grads, tangents) if g is not None and not g.stop_gradient]
            if not terms:
                return [paddle.zeros_like(x) for x in xs]
            hv = rec.grad([functools.reduce(lambda a, b: a + b, terms)], rec.leaves, create_graph=rec.nested)
        return self.backend.complete(hv, xs)


# ---------------------------------------------------------------------------------------
# custom_function (differentiate_with's boundary) as paddle PyLayers.  paddle reports an
# exception raised in a PyLayer's backward as an OSError ("(External) ... Error message in
# backward of GradNodePyLayer..."): a CompositionError a rule raises (a derivative the
# boundary does not carry) is kept here, per thread, for _operator to raise as itself.
_refused = threading.local()


def _refusal(err: BaseException) -> _errors.AbstractDiffError | None:
    """The error a custom function's or rule's backward raised, if paddle's ``err`` reports it."""
    refused = getattr(_refused, "error", None)
    if refused is None or str(refused).splitlines()[0] not in str(err):
        return None
    _refused.error = None
    return refused


def _keeping_errors(backward: Callable) -> staticmethod:
    """A PyLayer's backward whose AbstractDiffError reaches the operator as itself (see _refusal)."""

    @functools.wraps(backward)
    def keeping(ctx: Any, *args: Any) -> Any:
        _refused.depth = getattr(_refused, "depth", 0) + 1  # in a backward: see _grad
        try:
            return backward(ctx, *args)
        except _errors.AbstractDiffError as err:
            _refused.error = err
            raise
        finally:
            _refused.depth -= 1

    return staticmethod(keeping)


class _Closure(paddle.autograd.PyLayer):
    """``value()``, a tensor of the one input ``t``, whose backward is ``pullback(cotangent)``;
    whatever else the two need they reach through their closures, hidden from paddle.

    A PyLayer of several inputs would have to return ``None`` for one that paddle.grad prunes
    (one nobody asked for), which its backward cannot know; one input per PyLayer, with the
    others reached through a closure, lets paddle prune whole PyLayers instead, and skip their
    backwards.
    """

    @staticmethod
    def forward(ctx: Any, t: Any, value: Callable[[], Any], pullback: Callable[[Any], Any]) -> Any:
        ctx.pullback = pullback
        return value()

    @_keeping_errors
    def backward(ctx: Any, cotangent: Any) -> Any:
        return ctx.pullback(cotangent)


def _pack(ts: Sequence, dtype: Any) -> Any:
    """The tensors ``ts`` flattened, cast to ``dtype`` and joined: one tensor."""
    flat = [paddle.cast(t, dtype).reshape([-1]) for t in ts]
    return flat[0] if len(flat) == 1 else paddle.concat(flat)


def _unpack(packed: Any, consts: Sequence, layout: list) -> list:
    """The inputs: ``consts`` in turn where ``layout`` has None, else its ``(shape, dtype)`` from ``packed``."""
    out, consts, start = [], iter(consts), 0
    for at in layout:
        size = 0 if at is None else int(np.prod(at[0]))
        out.append(next(consts) if at is None else paddle.cast(packed[start:start + size].reshape(at[0]), at[1]))
        start += size
    return out


def _widest(tensors: Sequence) -> Any:
    return max((t.dtype for t in tensors), key=lambda d: paddle.finfo(d).bits)


class _Rule(paddle.autograd.PyLayer):
    """A custom rule (the custom_rule hook) of its differentiated inputs ``packed`` in one tensor
    and its constants ``consts_of()``, placed by ``layout`` (:func:`_unpack`).

    paddle wants None from a PyLayer's backward for each input that paddle.grad prunes, which
    the backward cannot know; with one input, a pruned PyLayer is not run at all (as
    :class:`_Closure`).  When a graph is being built (``create_graph=True``; a program's
    backward) the backward runs ``rule.forward`` again, recorded, for residuals connected to
    the inputs: the forward ran unrecorded, and a program's backward sees only the values saved
    for it.  A custom_jvp rule's backward of a zero cotangent (the double-vjp trick's) is zeros
    (``J^T 0``) whose own backward, ``t -> J t``, is the rule's jvp: so the double-vjp trick
    (forward mode) through the rule gives its jvp, and reverse over that differentiates the jvp.
    """

    @staticmethod
    def forward(ctx: Any, packed: Any, rule: Any, layout: list, consts_of: Callable[[], list]) -> tuple:
        ctx.rule, ctx.layout, consts = rule, layout, consts_of()
        ctx.save_for_backward(packed, *consts)
        inputs = _unpack(packed, consts, layout)
        vjp = rule.has_vjp and paddle.in_dynamic_mode()  # residuals of values: not in a program
        outputs, ctx.residuals = rule.forward(*inputs) if vjp else (rule.value(*inputs), None)
        ctx.outputs = [([int(d) for d in y.shape], y.dtype) for y in outputs]
        return tuple(outputs)

    @_keeping_errors
    def backward(ctx: Any, *cotangents: Any) -> Any:
        (packed, *consts), rule, layout = ctx.saved_tensor(), ctx.rule, ctx.layout
        # a program's backward gives None for an output nobody differentiated
        cts = tuple(paddle.zeros(s, d) if c is None else c for c, (s, d) in zip(cotangents, ctx.outputs))
        if rule.has_vjp:
            again = not paddle.in_dynamic_mode() or paddle.is_grad_enabled()
            grads = rule.backward(rule.forward(*_unpack(packed, consts, layout))[1] if again else ctx.residuals, cts)
            return _pack(_tensors(rule, [g for g, at in zip(grads, layout) if at is not None], "bwd's cotangent"),
                         packed.dtype)
        if not paddle.in_dynamic_mode() or any(bool(paddle.any(c != 0)) for c in cts):
            raise rule.no_vjp_error()
        ct = _pack(cts, _widest(cts))

        def jvp(packed_tangent: Any) -> Any:
            tangents = _unpack(packed_tangent, [paddle.zeros_like(t) for t in consts], layout)
            out = rule.jvp(tuple(_unpack(packed, consts, layout)), tuple(tangents))[1]
            return _pack(_tensors(rule, out, "the jvp rule's tangent_out"), ct.dtype)

        return _Closure.apply(ct, lambda: paddle.zeros_like(packed), jvp)


def _tensors(rule: Any, values: Sequence, what: str) -> list:
    """A rule's cotangents or tangents, refused where one is a numpy array: paddle's ops take
    tensors only, and converted, a numpy array would be a constant to paddle, whose
    ``.numpy()`` works on tensors it differentiates: a second derivative would silently lose
    whatever the rule computed it from."""
    if any(isinstance(v, (np.ndarray, np.generic)) for v in values):
        raise _errors.CustomRuleError(
            f"{rule.name}: {what} is a numpy array, but the function was called with paddle tensors: numpy "
            f"arrays carry no derivative, so a second derivative through the rule would silently lose whatever "
            f"{what} was computed from; compute it with paddle (autoray's numpy interface works on every "
            f"backend), or return None for zero"
        )
    return list(values)

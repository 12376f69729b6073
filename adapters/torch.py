"""PyTorch: reverse mode with ``torch.autograd.grad``, forward mode and second order with ``torch.func``.

First-order reverse mode (gradient, pullback) runs ``torch.autograd.grad`` on fresh leaves:
about 3x faster than ``torch.func.grad`` on small inputs, and it never calls ``.backward()``
nor touches any ``.grad``.  ``torch.func`` transforms cannot contain ``torch.autograd.grad``,
so everything composed (pushforward, jacobian, hessian, hvp) and every operator called
*inside* a ``torch.func`` transform takes the ``torch.func`` route instead.  Under
``torch.func`` the user's function must not call data-dependent ops such as ``.item()``,
``.tolist()`` or ``.numpy()`` on its inputs (torch raises its own error there).

Nested use: when an input already requires grad and grad mode is on, we are inside an
outer differentiation; inputs are then aliased rather than detached and the gradient is
built with ``create_graph=True`` so that the outer derivative flows through it.  As with
``torch.func.grad``, this also holds for a caller's own tensor that requires grad (an
``nn.Parameter`` passed explicitly): the gradient stays attached to the graph until it is
dropped.  Call under ``torch.no_grad()``, or pass ``.detach()``-ed tensors, to get plain
values; ``ad.Implicit("torch")`` is the route for modules.

Threads: reverse mode runs in parallel.  torch's forward mode is process-global (one dual
level), so every forward-mode section (pushforward, derivative, forward Jacobians, hvp,
second derivatives) holds one re-entrant lock: such calls from several threads are
serialised, and nested use on one thread goes on.

``compile=True`` wraps the user's function in ``torch.compile`` (``compile="aot_eager"``
or any other ``torch.compile`` backend name picks that backend).  Dynamo turns Python
control flow on tensors into graph breaks rather than errors, so there is no
``TracedControlFlowError`` to raise here: such functions run, partly eagerly.

An adapter of the protocol (:class:`abstractdiff.protocol.Adapter`): ``ad.backend("torch")``
is the core's backend holding a :class:`TorchAdapter`.  Fast routes: the gradient (written
once, in its prepared form), the Jacobian (jacrev or jacfwd, whichever is cheaper), the
Hessian-vector product and the second derivatives of ``torch.func``.  The Hessian is the
core's (the Jacobian of the gradient, reverse over reverse: 2-3x faster than
``torch.func.hessian``'s forward over reverse, measured).  Variables: leaf tensors,
``nn.Module`` parameters, and Keras 3 variables on the torch Keras backend (:class:`_Variables`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.func
import torch.utils._pytree

from abstractdiff import _pytree as pytree
from abstractdiff._arrays import bfloat16_numpy, check_scalar
from abstractdiff._errors import (
    ArgumentTypeError,
    CustomRuleError,
    InvalidArgumentError,
    ModeMismatchError,
    NonDifferentiableInputError,
)
from abstractdiff._tree import FlatFunction, artefacts, check_output, split_aux
from abstractdiff.protocol import Adapter

from . import _keras

FlatFn = Callable[[list, list], tuple]


def _alive(tensors: Sequence[Any]) -> list:
    """``tensors`` with the wrappers of ended torch.func levels taken off.

    A custom rule's backward runs after the torch.func.vjp that recorded it has returned (its
    pullback calls autograd.grad outside its level), so the rule's saved inputs are wrappers of
    a level that has ended.  torch's operators unwrap such a dead wrapper, but a torch.func.vjp
    or jvp called inside the rule (an ``ad.pullback`` in a bwd: custom_root's) wraps it in its
    own level instead, and its backward then meets a dead wrapper under a dead one, which
    torch's engine fails on (``level <= current_level INTERNAL ASSERT FAILED ... escaped?``)."""
    out = []
    for t in tensors:
        while isinstance(t, torch.Tensor) and torch._C._functorch.is_dead_tensor_wrapper(t):
            t = torch._C._functorch.unwrap_if_dead(t)
        out.append(t)
    return out


def _in_functorch() -> bool:
    # A torch.func transform (ours or the user's) is active: autograd.grad must not run here.
    # torch has no public query for this (torch 2.13); the private one is what torch.func uses.
    return torch._C._functorch.peek_interpreter_stack() is not None


# Tensors this adapter made from numpy arrays, sharing their memory (held weakly).
_SHARES_NUMPY: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

# numpy first, torch second: numpy cannot multiply a tensor, nor convert one that requires grad
_NUMPY_MIX = re.compile(r"'numpy\.ndarray' and 'Tensor'|Can't call numpy\(\) on Tensor that requires grad")
_NUMPY_HINT = (
    "torch backend: f combines a numpy array with the torch tensors being differentiated (numpy on the "
    "left, as in W * x with W a numpy array captured by f). Pass the array to f as an argument "
    "(ad.gradient(b, f, x, W): arguments become torch tensors), convert it once with b.asarray(W), "
    "or put the tensor first (x * W)."
)


def _explains_numpy_mix(method: Callable) -> Callable:
    """A flat operator that adds a hint to the user's own exception when it comes from a
    numpy/torch mix-up (the exception is raised again, type and message unchanged)."""

    @functools.wraps(method)
    def operator(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (TypeError, RuntimeError) as err:
            _add_numpy_hint(err)
            raise

    return operator


def _add_numpy_hint(err: BaseException) -> None:
    """Add the numpy/torch mix-up hint to ``err`` when that is what it is (once)."""
    if _NUMPY_MIX.search(str(err)) and _NUMPY_HINT not in getattr(err, "__notes__", ()):
        err.add_note(_NUMPY_HINT)


# torch's forward mode is process-global: torch.autograd.forward_ad keeps one dual level for
# the whole process and torch.func.jvp counts its nesting in a module global, so two threads
# in forward mode at once read each other's tangents (wrong numbers, or "no level exists").
# Every forward-mode section of this adapter (jvp, jacfwd, hvp) holds this lock.
# Re-entrant: an operator nested in a function being differentiated runs on the same thread
# and goes on.  Reverse mode (autograd.grad, torch.func.vjp/grad/jacrev) keeps per-thread
# state and runs in parallel.
_FORWARD_MODE = threading.RLock()


def _forward_mode(method: Callable) -> Callable:
    """``method`` with the forward-mode lock held (see ``_FORWARD_MODE``)."""

    @functools.wraps(method)
    def serialised(*args: Any, **kwargs: Any) -> Any:
        with _FORWARD_MODE:
            return method(*args, **kwargs)

    return serialised


def _dual_ready(xs: list) -> tuple:
    """``xs`` as torch.func.jvp's primals: ``make_dual`` refuses a tensor whose elements share
    memory (an expanded one, such as the cotangent of a sum, which a custom rule's backward
    hands on as an input: ad.custom_root's adjoint solve at third order), so such a tensor is
    made contiguous (a copy that stays in the caller's graph); others pass as they are."""
    return tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in xs)


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` in ``ref``'s float dtype.  torch 2.13's forward mode promotes a product with a
    Python float (``0.25 * s * s``) to float64 in float32 code (jvp, jacfwd, and the forward
    half of hvp), where every other route and library keeps float32."""
    if t.dtype != ref.dtype and t.is_floating_point() and ref.is_floating_point():
        return t.to(ref.dtype)
    return t


class _AuxCarrier:
    """``aux`` through ``torch.func``'s ``has_aux``, which carries tensors only: the rest waits here."""

    _TENSOR = object()

    def __init__(self) -> None:
        self.treedef: Any = None
        self.others: list[Any] = []

    def pack(self, aux: Any) -> list[torch.Tensor]:
        leaves, self.treedef = pytree.tree_flatten(aux)
        self.others = [self._TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
        return [v for v in leaves if isinstance(v, torch.Tensor)]

    def unpack(self, tensors: list[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if v is self._TENSOR else v for v in self.others]
        return pytree.tree_unflatten(self.treedef, leaves)


class _Variables:
    """The variable hooks (the adapter's ``variables``): a torch parameter is a leaf tensor
    that requires grad (an ``nn.Parameter`` or not); ``nn.Module`` gives its parameters and
    buffers.  Keras 3 variables and models on the torch Keras backend are added by
    :class:`_keras.WithKerasVariables` (through the parameter each one wraps)."""

    def __init__(self, adapter: TorchAdapter):
        self.adapter = adapter  # its ``backend`` (the holder), set after construction, for core services

    def is_variable(self, v: Any) -> bool:
        return isinstance(v, torch.Tensor)

    def check_variable(self, v: Any, where: str) -> None:
        # requires_grad first: an integer tensor cannot require grad, so it is data, not a variable
        if not v.requires_grad:
            raise ModeMismatchError(
                f"{where} is a torch tensor that does not require grad; call .requires_grad_() on it "
                f"(or create it with ad.variables(tree, 'torch'))"
            )
        if not v.is_leaf:
            raise ModeMismatchError(
                f"{where} is a torch tensor computed from other tensors (not a leaf); parameters must "
                f"be leaf tensors: use the tensors it was computed from, or .detach().requires_grad_()"
            )
        if not v.is_floating_point():
            raise NonDifferentiableInputError(
                f"{where} is a torch tensor of dtype {v.dtype}; only float tensors can be parameters"
            )

    def model_variables(self, obj: Any) -> tuple[list, int] | None:
        if not isinstance(obj, torch.nn.Module):
            return None
        params = list(obj.parameters())  # already de-duplicated (shared weights)
        trainable = [p for p in params if p.requires_grad]
        return trainable, len(params) - len(trainable)

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        # parameters (frozen ones too) and buffers (BatchNorm's running statistics), in
        # state_dict order and with its names
        return list(obj.state_dict(keep_vars=True).items()) if isinstance(obj, torch.nn.Module) else None

    def forward_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        # every buffer, the non-persistent ones (register_buffer(..., persistent=False)) too
        return list(obj.named_buffers()) if isinstance(obj, torch.nn.Module) else None

    def read(self, var: Any) -> torch.Tensor:
        return var.detach()

    def read_kept(self, var: Any) -> torch.Tensor:
        return var.detach().clone()  # detach() shares memory that copy_ writes

    def write(self, var: Any, value: Any) -> None:
        with torch.no_grad():
            var.copy_(value)

    def current_value(self, var: Any) -> torch.Tensor:
        return var

    def new_variable(self, value: Any) -> torch.Tensor:
        return value.detach().clone().requires_grad_(True)

    def implicit_value_and_gradient(self, f: Callable[..., Any], variables: list, args: tuple, has_aux: bool) -> tuple:
        args = _on_device_of(variables, args)
        with torch.enable_grad():
            y, aux = split_aux(f(*args), has_aux)
            y = self.adapter._tensor(check_output(y, variables))  # a Python number: a constant
            check_scalar(y)
        return y.detach(), _detached(aux), _variable_grads(y, variables)

    def implicit_value_and_pullback(self, f: Callable[..., Any], variables: list, args: tuple) -> tuple:
        args = _on_device_of(variables, args)
        with torch.enable_grad():
            y = self.adapter._tensor(check_output(f(*args), variables))

        def vjp(dy: Any) -> list:
            # on y's device and dtype: cotangent leaves a native tensor's dtype as it is
            dy = torch.as_tensor(self.adapter.backend.cotangent(dy, y), dtype=y.dtype, device=y.device)
            return _variable_grads(y, variables, grad_outputs=dy, retain_graph=True)

        return y.detach(), vjp


def _variable_grads(y: torch.Tensor, variables: list, **options: Any) -> list:
    """dy/dv for every variable (zeros where ``y`` does not depend on it)."""
    if not y.requires_grad:
        return [torch.zeros_like(p) for p in variables]
    with torch.enable_grad():
        # never .backward(): it would accumulate into every parameter's .grad
        return list(torch.autograd.grad(y, variables, allow_unused=True, materialize_grads=True, **options))


def _on_device_of(variables: list, args: tuple) -> tuple:
    # Data goes to the model's device (a model moved to a GPU) and float data to the
    # widest float dtype of the model's variables: a float64 batch for a float32 module
    # would otherwise fail in torch's matmul ("expected scalar type Float but found
    # Double"), and the first variable's dtype would narrow the data a wider (float64)
    # variable meets, losing its precision.
    device = variables[0].device
    floats = [v.dtype for v in variables if v.is_floating_point()]
    dtype = functools.reduce(torch.promote_types, floats) if floats else None

    def fit(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if dtype is not None and a.is_floating_point() and a.dtype != dtype:
            return a.to(device=device, dtype=dtype)
        return a.to(device) if a.device != device else a

    return pytree.tree_map(fit, args)


def _in_graph(xs: list, data: list) -> bool:
    # loops, not any() over a generator: a third of the cost, on every gradient
    if torch.is_grad_enabled():
        for t in xs:
            if t.requires_grad:
                return True
        for t in data:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def _detached(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, tree)


class TorchAdapter(Adapter):
    name = "torch"
    extra = "torch"
    modules = ("torch", "keras")
    # each fast route is the method of the operator's own name
    fast_routes = {
        "prepare_value_and_gradient": "prepare_value_and_gradient", "jacobian": "jacobian",
        "prepare_jacobian": "prepare_jacobian", "hvp": "hvp", "second_derivative": "second_derivative",
        "value_derivative_and_second_derivative": "value_derivative_and_second_derivative",
    }

    def __init__(self, *, device: str = "cpu", compile: bool | str = False):
        if not isinstance(compile, (bool, str)):
            raise ArgumentTypeError(f"compile must be a bool or a torch.compile backend name, got {compile!r}")
        if isinstance(compile, str) and compile not in torch.compiler.list_backends(exclude_tags=()):
            raise InvalidArgumentError(
                f"compile={compile!r} is not a torch.compile backend; pass True (inductor), False, or "
                f"one of {', '.join(sorted(torch.compiler.list_backends(exclude_tags=())))}"
            )
        super().__init__(device=device, compile=compile)
        self.compile = compile
        self.reuses_traces = bool(compile)  # a compiled trace freezes what f reads (see Adapter.reuses_traces)
        self.torch_device = torch.device(self.device)
        #: How many graphs torch.compile has compiled for this backend (a test hook: a repeated
        #: call with the same function, structure, shapes and dtypes must not add one).
        self.compilations = 0
        self.variables = _keras.WithKerasVariables(_Variables(self), "torch")

    # ---------------------------------------------------------------- devices
    def devices(self) -> list[str]:
        names = ["cpu"]
        if torch.cuda.is_available():
            names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        return names

    def pytree_node(self, obj: Any) -> tuple[Callable, Callable] | None:
        # registered with torch.utils._pytree (its flatten and unflatten, in optree's argument order)
        node = torch.utils._pytree.SUPPORTED_NODES.get(type(obj))
        if node is None:
            return None
        return node.flatten_fn, lambda context, children: node.unflatten_fn(list(children), context)

    # ---------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        return isinstance(a, torch.Tensor)

    def from_numpy(self, a: np.ndarray) -> torch.Tensor:
        # torch.as_tensor rejects negative strides and warns on read-only arrays.
        if not a.flags.writeable or any(s < 0 for s in a.strides):
            a = a.copy()
        t = torch.as_tensor(a, device=self.torch_device)
        if t.device.type == "cpu":  # it shares the numpy array's memory (see snapshot)
            _SHARES_NUMPY[id(t)] = t
        return t

    def from_dlpack(self, a: Any) -> torch.Tensor:
        # shares memory on the CPU, read-only numpy arrays (a jax caller's) included: torch has
        # no read-only tensors, so a kernel writing into its input in place would write into
        # the caller's memory, as with torch.from_dlpack itself.  bfloat16 numpy has no DLPack.
        try:
            t = torch.from_dlpack(a)
        except (BufferError, RuntimeError, TypeError):
            return super().from_dlpack(a)
        return t if t.device == self.torch_device else t.to(self.torch_device)

    def to_numpy(self, a: Any) -> np.ndarray:
        a = _keras.native_variable(a).detach().cpu()
        if a.dtype == torch.bfloat16:
            return bfloat16_numpy(a.float().numpy())
        return a.numpy()

    def cast(self, a: Any, dtype: str) -> torch.Tensor:
        return a.to(dtype=getattr(torch, dtype))

    def snapshot(self, a: Any) -> torch.Tensor:
        # Only a tensor sharing a numpy array's memory can change behind torch's back: a
        # write into a torch tensor bumps its version counter, and autograd then refuses
        # to use it.  clone() is differentiable: nested use keeps its graph.
        return a.clone() if _SHARES_NUMPY.get(id(a)) is a else a

    def asarray_like(self, a: np.ndarray, like: Any) -> torch.Tensor:
        # torch takes no ml_dtypes bfloat16: through float32, which holds every bfloat16 value
        t = torch.as_tensor(a.astype(np.float32)).to(like.device, torch.bfloat16) if str(a.dtype) == "bfloat16" \
            else torch.as_tensor(a, device=like.device)
        return t.requires_grad_() if like.requires_grad and t.is_floating_point() else t

    def _tensor(self, y: Any) -> torch.Tensor:
        # a Python number f returned, as the 0-d numpy array the core's check_output made of
        # it (the core refused numpy's own values: they cannot depend on x)
        return y if isinstance(y, torch.Tensor) else self.backend.asarray(np.asarray(y))

    # ------------------------------------------------------------- compilation
    def _forward(self, fn: FlatFn) -> FlatFn:
        """``fn``, or its ``torch.compile``d twin, cached in ``fn``'s artefacts."""
        if not self.compile or not isinstance(fn, FlatFunction):
            return fn
        store = fn.artefacts(self.backend, "torch.compile")
        forward = store.peek("forward")
        if forward is not None:
            return forward
        call = self._compiled_callable(fn.f)
        cacheable = call is not None
        if call is None:  # not a plain function or method: compile afresh, keep nothing
            call = torch.compile(fn.f, backend=self._compiler)
        # The twin flat function holds `call` weakly; the closure below keeps it alive.
        twin = FlatFunction(call, fn.x_treedef, fn.args_treedef, fn.template, fn.diff_index, fn.data_index,
                            fn.n_x_leaves, fn.has_aux)

        def forward(xs: list, data: list, _keep: Any = call) -> tuple[Any, Any]:
            try:
                return twin(xs, data)
            except Exception as err:
                # Dynamo fails to trace some valid Python (autoray's dispatch in torch 2.13):
                # run f eagerly; an error that is f's own raises again here, unchanged.
                out = fn(xs, data)
                warnings.warn(
                    f"torch.compile could not compile {fn!r} ({type(err).__name__}: {err}); running it "
                    f"eagerly from now on",
                    RuntimeWarning,
                    stacklevel=2,
                )
                store.put("forward", fn)
                return out

        if cacheable:
            store.put("forward", forward)
        return forward

    def _compiled_callable(self, f: Callable[..., Any]) -> Callable[..., Any] | None:
        # torch.compile(f) holds f strongly: kept in fn's artefacts it would keep f alive, and with
        # it the plan cache entry that is meant to die with f.  Dynamo caches compiled code
        # per code object, so a twin function sharing f's code, globals and closure compiles
        # to the same graphs without holding f (or, for a method, its owner).
        func, owner = (f.__func__, f.__self__) if isinstance(f, types.MethodType) else (f, None)
        if not isinstance(func, types.FunctionType):
            return None
        twin = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
        twin.__kwdefaults__ = func.__kwdefaults__
        compiled = torch.compile(twin, backend=self._compiler)
        if owner is None:
            return compiled
        owner_ref = weakref.ref(owner)
        return lambda *args: compiled(owner_ref(), *args)

    def _compiler(self, gm: Any, example_inputs: Any) -> Any:
        """The torch.compile backend: the chosen one, counting each graph it compiles."""
        self.compilations += 1
        name = "inductor" if self.compile is True else self.compile
        # No public lookup of a backend by name exists in torch 2.13 (torch.compile resolves
        # names internally through this same function).
        return torch._dynamo.lookup_backend(name)(gm, example_inputs)

    def _value_fn(self, fn: FlatFn, data: list, operator: str | None = None) -> Callable[..., torch.Tensor]:
        """``*xs -> y`` for ``torch.func``; checks that ``y`` is a scalar when ``operator`` is given."""
        forward = self._forward(fn)

        def value(*xs: torch.Tensor) -> torch.Tensor:
            y = self._tensor(forward(list(xs), data)[0])
            if operator is not None:
                check_scalar(y, operator)
            return y

        return value

    # ------------------------------------------------------------ reverse mode
    @staticmethod
    def _leaves(xs: list, data: list) -> tuple[list, bool]:
        """Fresh differentiable leaves for ``xs``, and whether we are nested in an outer derivative."""
        if _in_graph(xs, data):
            # view_as keeps the outer graph and gives each input its own node, so that the
            # same tensor passed twice gets two partial derivatives.
            # (a tensor of a torch.func level that has ended says requires_grad, but its view has no graph)
            views = [x.view_as(x) if x.requires_grad else x for x in xs]
            return [v if v.requires_grad else v.detach().requires_grad_() for v in views], True
        # detach() makes a new tensor object: the caller's tensor, its requires_grad and its
        # .grad are never touched.
        return [x.detach().requires_grad_() for x in xs], False

    @_explains_numpy_mix
    def value_and_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        # A compiled backward refuses retain_graph=True (AOTAutograd donates its buffers), and
        # a pullback may be called many times: compiled functions take the torch.func route.
        if self.compile or _in_functorch():
            y, aux, vjp_fn = self._func_vjp(fn, xs, data)
            return y, aux, lambda dy: list(vjp_fn(dy))

        with torch.enable_grad():  # the leaves too: a view made without grad mode (in a backward) has no graph
            leaves, nested = self._leaves(xs, data)
            y, aux = self._forward(fn)(leaves, data)
        y = self._tensor(y)

        def vjp(dy: torch.Tensor) -> list:
            if not y.requires_grad:
                return [None] * len(leaves)
            # retain_graph: the pullback may be called again (the core builds jacobians row by row).
            with torch.enable_grad():
                grads = torch.autograd.grad(y, leaves, dy, retain_graph=True, create_graph=nested, allow_unused=True)
            return list(grads)

        if nested:
            return y, aux, vjp
        return y.detach(), _detached(aux), vjp

    def _func_vjp(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """``(y, aux, vjp_fn)`` from ``torch.func.vjp``, which composes with ``torch.func.vmap``."""
        carrier = _AuxCarrier()
        forward = self._forward(fn)

        def with_aux(*a: torch.Tensor) -> tuple[torch.Tensor, list]:
            y, aux = forward(list(a), data)
            return self._tensor(y), carrier.pack(aux)

        y, vjp_fn, aux = torch.func.vjp(with_aux, *_alive(xs), has_aux=True)
        return y, carrier.unpack(aux), vjp_fn

    @_explains_numpy_mix
    def value_and_batched_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        # torch.func.vjp's pullback vmapped over the batch (autograd.grad cannot run under vmap)
        y, aux, vjp_fn = self._func_vjp(fn, xs, data)
        return y, aux, lambda dys: list(torch.func.vmap(vjp_fn)(dys))

    def prepare_value_and_gradient(self, fn: FlatFn, xs: list, data: list) -> Callable[[list, list], tuple]:
        # The hot path of training loops and small functions: outside torch.func, the call is
        # native's own few lines (autograd.grad on fresh leaves).  The per-call route is the
        # core's prepare-then-run, so preparing builds nothing but these closures.
        grad, grad_enabled, tensor = torch.autograd.grad, torch.is_grad_enabled, self._tensor
        compiled = self._forward if self.compile else None  # looked up per call: it may fall back to fn

        def gradient(leaves: list, data: list, nested: bool) -> tuple[Any, Any, list]:
            y, aux = (compiled(fn) if compiled else fn)(leaves, data)
            if not isinstance(y, torch.Tensor):
                y = tensor(y)
            check_scalar(y)  # before autograd.grad, whose own message is about grad_outputs
            grads = [None] * len(leaves) if not y.requires_grad else list(
                grad(y, leaves, create_graph=nested, allow_unused=True)
            )
            if nested:
                return y, aux, grads
            return y.detach(), (None if aux is None else _detached(aux)), grads

        def run(xs: list, data: list) -> tuple[Any, Any, list]:
            try:
                if _in_functorch():
                    y, aux, vjp_fn = self._func_vjp(fn, xs, data)
                    check_scalar(y)
                    return y, aux, list(vjp_fn(torch.ones_like(y)))
                leaves, nested = self._leaves(xs, data)
                if grad_enabled():  # enable_grad() costs 0.6 us of a 40 us call
                    return gradient(leaves, data, nested)
                with torch.enable_grad():
                    return gradient(leaves, data, nested)
            except (TypeError, RuntimeError) as err:
                _add_numpy_hint(err)
                raise

        return run

    # ------------------------------------------------------------- composition
    def custom_function(self, value: Callable[..., np.ndarray], vjps: Sequence[Callable[..., Any]],
                        jvps: Sequence[Callable[..., Any]], out: tuple[int, str]) -> Callable[..., torch.Tensor]:
        # one torch.autograd.Function in the setup_context style: reverse mode, forward mode
        # (jvp) and the torch.func transforms all see the rules.  ``out`` is not needed: the
        # numpy result carries its size and dtype.
        node = _Node(value, tuple(vjps), tuple(jvps))
        return lambda *inputs: _Custom.apply(node, *inputs)

    def custom_rule(self, rule: Any) -> Callable[..., tuple]:
        if rule.stops_gradient:
            return lambda *inputs: tuple(a.detach() for a in inputs)
        return lambda *inputs: (_Rule.apply if _in_functorch() else _apply_rule)(rule, *inputs)

    # ------------------------------------------------------------ forward mode
    @_explains_numpy_mix
    def value_and_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        return self._value_and_jvp(fn, xs, data, batched=False)

    @_explains_numpy_mix
    def value_and_batched_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        return self._value_and_jvp(fn, xs, data, batched=True)

    def _value_and_jvp(self, fn: FlatFn, xs: list, data: list, batched: bool) -> tuple[Any, Any, Callable]:
        """``(y, aux, jvp)``; with ``batched``, ``jvp`` takes stacked tangents (``torch.func.vmap``)."""
        y, aux = self._forward(fn)(xs, data)
        value = self._value_fn(fn, data)
        y = self._tensor(y)
        primals = _dual_ready(xs)

        def jvp(*ts: torch.Tensor) -> torch.Tensor:
            return torch.func.jvp(value, primals, ts)[1]

        @_forward_mode
        def jvps(ts: list) -> torch.Tensor:
            return _like(torch.func.vmap(jvp)(*ts) if batched else jvp(*ts), y)

        return y, aux, jvps

    # ------------------------------------------------------------ composed
    # with chunk_size set, the Jacobians are the core's chunks of vmapped vjps or jvps
    def jacobian(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, list]:
        # the prepared run, kept with fn: torch.func's transforms are built once per flat function
        run = artefacts(fn, self.backend, "jacobian").get(len(xs), lambda: self._jacobian_run(fn, len(xs), True))
        return run(xs, data)

    def prepare_jacobian(self, fn: FlatFn, xs: list, data: list) -> Callable[[list, list], list]:
        # without the value: carrying it as aux costs jacrev 2-5% on small inputs
        return self._jacobian_run(fn, len(xs), False)

    def _jacobian_run(self, fn: FlatFn, k: int, with_value: bool) -> Callable[[list, list], Any]:
        # torch.func's jacrev/jacfwd built once per mode, over (*xs, *data): the per-call work
        # is the transform's own (and fn's compiled twin, looked up per call: it may fall back to fn).
        forward_of, tensor = self._forward, self._tensor

        def value(*args: torch.Tensor) -> Any:
            y = tensor(forward_of(fn)(list(args[:k]), list(args[k:]))[0])
            return (y, y) if with_value else y

        # one input: argnums=0 (a tuple of argnums costs torch.func ~25 us more per call)
        argnums: int | tuple[int, ...] = 0 if k == 1 else tuple(range(k))
        reverse = torch.func.jacrev(value, argnums, has_aux=with_value)
        forward_mode = _forward_mode(torch.func.jacfwd(value, argnums, has_aux=with_value))
        modes: dict[tuple, tuple[Callable, Any]] = {}

        @_explains_numpy_mix
        def run(xs: list, data: list) -> Any:
            # Reverse mode costs one backward pass per output element, forward mode one pass
            # per input element: the smaller, from the output seen once per shapes and dtypes.
            key = tuple((x.shape, x.dtype) for x in (*xs, *data))
            mode = modes.get(key)
            if mode is None:
                with torch.no_grad():
                    y = tensor(forward_of(fn)(xs, data)[0])
                mode = (reverse if y.numel() <= sum(x.numel() for x in xs) else forward_mode, y.dtype)
                if len(modes) < 64:
                    modes[key] = mode
            transform, dtype = mode
            try:
                out = transform(*xs, *data)
            except CustomRuleError:  # an ad.custom_vjp (custom_jvp) has a rule in one mode: take that one
                out = (forward_mode if transform is reverse else reverse)(*xs, *data)
            jacs, y = out if with_value else (out, None)
            jacs = [j if j.dtype == dtype or not j.is_floating_point() else j.to(dtype) for j in (
                (jacs,) if k == 1 else jacs)]
            return (y, jacs) if with_value else jacs

        return run

    @_explains_numpy_mix
    @_forward_mode
    def hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> list:
        # Forward over reverse: one jvp of the gradient function, no Hessian built.
        grad = torch.func.grad(self._value_fn(fn, data, "hvp"), argnums=tuple(range(len(xs))))
        try:
            hv = torch.func.jvp(grad, _dual_ready(xs), tuple(tangents))[1]
        except (RuntimeError, CustomRuleError) as err:  # an ad.custom_vjp: it has no forward-mode rule
            # Reverse over reverse where torch 2.13's forward mode fails on the function: a jvp
            # through the backward of an index op (take, index_select) of a float32 array scaled
            # by a Python number makes a float64 tangent and raises a dtype error (torch.func.vjp
            # of the gradient does not); the Hessian is symmetric, so the vjp of the tangents is
            # the product.
            dtype_error = any(m in str(err) for m in ("same scalar type", "same dtype"))
            if not (dtype_error or isinstance(err, CustomRuleError)):
                raise
            _, vjp = torch.func.vjp(grad, *xs)
            hv = vjp(tuple(tangents))
        return [_like(h, x) for h, x in zip(hv, xs)]

    @_explains_numpy_mix
    @_forward_mode
    def value_derivative_and_second_derivative(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Any]:
        # forward over forward: the inner jvp's primal and tangent are y and dy/dx
        value = self._value_fn(fn, data)
        (x,) = _dual_ready(xs)
        one = torch.ones_like(x)

        def value_and_derivative(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.func.jvp(value, (x,), (one,))

        (y, d), (_, d2) = torch.func.jvp(value_and_derivative, (x,), (one,))
        return y, _like(d, y), _like(d2, y)

    def second_derivative(self, fn: FlatFn, xs: list, data: list) -> Any:
        return self.value_derivative_and_second_derivative(fn, xs, data)[2]


# ---------------------------------------------------------------------------------------
# Composition: a numpy function with custom derivatives as a torch operation (custom_function).  The
# portable translations of numpy/scipy calls are abstractdiff/portable/torch.py.
def _to_device_of(a: np.ndarray, like: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """A kernel's numpy result as a tensor on ``like``'s device, without a copy on the CPU
    (DLPack takes read-only memory too).  A result lying in the memory of one of ``inputs``
    (a kernel returning its input, or a slice of it) comes back as a view of that input:
    torch's version counter then sees a write through either, as it does for its own views,
    where a separate tensor would let it change the input silently."""
    if like.device.type == "cpu":
        for t in inputs:
            view = _view_into(t, a)
            if view is not None:
                return view
        try:
            return torch.from_dlpack(a)
        except (BufferError, RuntimeError, TypeError):  # bfloat16, which numpy has no DLPack for
            pass
    return torch.as_tensor(a if a.flags.writeable else a.copy(), device=like.device)


def _view_into(t: torch.Tensor, a: np.ndarray) -> torch.Tensor | None:
    """``a`` as a view of ``t`` when ``a`` is a contiguous run of ``t``'s elements, else ``None``
    (a copy when ``a`` overlaps ``t``'s memory some other way)."""
    if t.device.type != "cpu" or not t.is_contiguous() or not a.size:
        return None
    start, itemsize = t.data_ptr(), t.element_size()
    ptr = a.__array_interface__["data"][0]
    if ptr + a.nbytes <= start or ptr >= start + t.numel() * itemsize:
        return None
    offset, misaligned = divmod(ptr - start, itemsize)
    if (a.ndim == 1 and a.flags.c_contiguous and a.dtype.name == str(t.dtype).removeprefix("torch.")
            and offset >= 0 and not misaligned and offset + a.size <= t.numel()):
        return t.detach().reshape(-1)[offset : offset + a.size]
    return torch.as_tensor(a.copy())


class _Node:
    """What a :class:`_Custom` call computes: its value and derivative rules (a non-tensor
    argument of ``apply``, which torch passes through untouched; not a tuple, which
    torch.func would flatten)."""

    __slots__ = ("value", "vjps", "jvps")

    def __init__(self, value: Callable[..., np.ndarray], vjps: tuple, jvps: tuple):
        self.value, self.vjps, self.jvps = value, vjps, jvps


class _Custom(torch.autograd.Function):
    """A numpy function with custom derivatives as a torch operation of 1-D tensors
    (:meth:`TorchAdapter.custom_function`): the rules are torch code calling other custom
    functions, so torch differentiates them in turn (second derivatives, forward over reverse)."""

    @staticmethod
    def forward(node: _Node, *inputs: torch.Tensor) -> torch.Tensor:
        arrays = [t.detach().cpu().numpy() for t in inputs]  # no copy on CPU
        return _to_device_of(node.value(*arrays), inputs[0], *inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.node = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.save_for_forward(*inputs[1:])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        inputs = ctx.saved_tensors
        needed = ctx.needs_input_grad[1:]
        return None, *(rule(g, *inputs) if need else None for rule, need in zip(ctx.node.vjps, needed))

    @staticmethod
    def jvp(ctx: Any, _node_tangent: Any, *tangents: torch.Tensor | None) -> torch.Tensor:
        inputs = ctx.saved_tensors
        terms = [rule(t, *inputs) for rule, t in zip(ctx.node.jvps, tangents) if t is not None]
        return sum(terms[1:], terms[0])  # torch calls jvp only when some input has a tangent

    @classmethod
    def vmap(cls, info: Any, in_dims: tuple, node: _Node, *tensors: torch.Tensor) -> tuple:
        return _batched(info, in_dims[1:], lambda *t: cls.apply(node, *t), *tensors), 0


#: A context of :class:`_Rule` whose forward's residuals another context took (see its backward)
_NO_RESIDUALS = object()


class _Rule(torch.autograd.Function):
    """An ``ad.custom_vjp`` or ``ad.custom_jvp`` rule (:meth:`TorchAdapter.custom_rule`) as a
    torch operation: reverse mode is ``rule.backward``, forward mode ``rule.jvp``, and torch.func
    batches the rule's own torch code (``generate_vmap_rule``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(rule: Any, *inputs: torch.Tensor) -> tuple:
        # the rule is this call's own: setup_context takes its residuals
        outputs, rule.residuals = rule.forward(*inputs) if rule.has_vjp else (rule.value(*inputs), None)
        # an input returned as it is must be a view of it for torch (the identity of a clipped gradient)
        return tuple(o.view_as(o) if any(o is x for x in inputs) else o for o in outputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.rule = rule = inputs[0]
        # taken once: under nested torch.func levels only the innermost context gets them
        ctx.residuals = rule.__dict__.pop("residuals", _NO_RESIDUALS)
        ctx.save_for_backward(*inputs[1:])
        if rule.has_jvp or _in_functorch():
            # under torch.func.vmap the Function's batched jvp reads these even to refuse
            ctx.save_for_forward(*inputs[1:])

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple:
        rule, inputs = ctx.rule, ctx.saved_tensors
        if not rule.has_vjp:
            raise rule.no_vjp_error()
        # a graph of the backward being built (a second derivative): the residuals the forward
        # made without one are made again, now depending on the inputs.  Under nested torch.func
        # levels the forward ran once, at the innermost, whose context took its residuals: the
        # outer levels' contexts have none, and make them again too
        again = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
        fresh = again or ctx.residuals is _NO_RESIDUALS
        with _rule_running(rule, "bwd"):
            grads = rule.backward(rule.forward(*inputs)[1] if fresh else ctx.residuals, cotangents)
        return None, *_tensors(rule, grads, "bwd's cotangent")

    @staticmethod
    def jvp(ctx: Any, _rule_tangent: Any, *tangents: torch.Tensor | None) -> tuple:
        rule = ctx.rule
        if not rule.has_jvp:
            raise rule.no_jvp_error()
        inputs = ctx.saved_tensors
        full = tuple(torch.zeros_like(x) if t is None else t for x, t in zip(inputs, tangents))
        return _rule_tangents(rule, inputs, full)


def _rule_tangents(rule: Any, inputs: tuple, tangents: tuple) -> tuple:
    """``rule.jvp``'s output tangents, as :meth:`_Rule.jvp` returns them.

    torch.func runs an autograd.Function's jvp at its own level with forward-mode recording
    switched off, so a jvp rule is a constant to every torch.func.jvp outside the one that
    called it: forward over forward (second_derivative, a derivative of a derivative) would be
    silently zero.  Where that jvp is the innermost transform, the rule runs one level down
    instead, on the inputs and tangents unwrapped from that level, with recording on as it was
    outside it: the outer levels differentiate the rule's own torch code, as torch.func does
    with any operation.  Where a torch.func.vmap stands between the two (torch.func's batching
    of the Function, inside a forward-mode transform), that cannot be done: refused.
    """
    stack = torch._C._functorch.get_interpreter_stack() or []
    forward = [i for i in stack if i.key() == torch._C._functorch.TransformType.Jvp]
    if len(forward) < 2:  # no forward-mode level outside this one: torch's own call is right
        with _rule_running(rule, "the jvp rule"):
            return _tensors(rule, rule.jvp(inputs, tangents)[1], "the jvp rule's tangent_out")
    if stack[-1].key() != torch._C._functorch.TransformType.Jvp:
        raise CustomRuleError(
            f"{rule.name}: torch cannot differentiate this jvp rule in forward mode inside another forward-mode "
            f"derivative here (a torch.func.vmap, from a batched pushforward or a forward Jacobian, stands between "
            f"them, and torch.func runs the rule with the outer tangents switched off: the result would be "
            f"silently zero); take the outer derivative in reverse mode with a custom_vjp rule, or take it with "
            f"an operator that does not batch (ad.derivative, ad.second_derivative), or use the jax backend"
        )
    from torch._functorch.pyfunctorch import coerce_cinterpreter

    level = stack[-1].level()
    interpreter = coerce_cinterpreter(stack[-1])
    primals = tuple(torch._C._functorch._unwrap_for_grad(x, level) for x in inputs)
    inner = tuple(torch._C._functorch._unwrap_for_grad(t, level) for t in tangents)
    with interpreter.lower():
        recording = torch._C._is_fwd_grad_enabled()
        torch._C._set_fwd_grad_enabled(interpreter.prev_fwd_grad_mode())
        try:
            with _rule_running(rule, "the jvp rule"):
                out = _tensors(rule, rule.jvp(primals, inner)[1], "the jvp rule's tangent_out")
        finally:
            torch._C._set_fwd_grad_enabled(recording)
    return tuple(torch._C._functorch._wrap_for_grad(t, level) for t in out)


def _tensors(rule: Any, values: tuple, what: str) -> tuple:
    """A rule's cotangents or tangents, refused where one is a numpy array: torch's Function
    takes tensors only, and converted, a numpy array would be a constant to torch, so where
    torch differentiates the rule itself (a second derivative) whatever the rule computed it
    from (a ``.detach().numpy()`` of its inputs) would silently drop out."""
    if any(isinstance(v, (np.ndarray, np.generic)) for v in values):
        raise CustomRuleError(
            f"{rule.name}: {what} is a numpy array, but the function was called with torch tensors: numpy "
            f"arrays carry no derivative, so a second derivative through the rule would silently lose whatever "
            f"{what} was computed from; compute it with torch (autoray's numpy interface works on every "
            f"backend), or return None for zero"
        )
    return tuple(values)


@contextlib.contextmanager
def _rule_running(rule: Any, what: str) -> Iterator[None]:
    """torch's refusal to give a numpy value of a tensor it differentiates or batches, where the
    user's rule asked for one, as the rule's error."""
    try:
        yield
    except RuntimeError as err:
        if not _RULE_NUMPY.search(str(err)):
            raise
        raise CustomRuleError(
            f"{rule.name}: {what} converted a torch tensor to numpy (np.asarray, .numpy(), .item()), which torch "
            f"refuses where it differentiates the rule itself or batches it (a second derivative, a Jacobian, "
            f"torch.func): the derivative through that value would be lost; write {what} with torch operations "
            f"(autoray's numpy interface works on every backend) ({err})"
        ) from err


#: What torch says when a rule reads the value of a tensor it differentiates or batches
_RULE_NUMPY = re.compile(r"Can't call numpy\(\) on Tensor that requires grad|doesn't have storage|"
                         r"\.item\(\) on a Tensor|data-dependent")


#: _Rule.apply outside torch.func transforms without Function.apply's inspect.signature binding
#: of default arguments (20 us a call; forward has none): the C apply that Function.apply calls
_apply_rule = super(torch.autograd.Function, _Rule).apply


def _batched(info: Any, dims: tuple, call: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """A custom function's call under ``torch.func.vmap`` (jacobians, hessians): one call per
    batch element (its value is numpy, which cannot batch), stacked along dimension 0."""
    moved = [t if d is None else t.movedim(d, 0) for t, d in zip(tensors, dims)]
    return torch.stack([
        call(*[t if d is None else t[i] for t, d in zip(moved, dims)]) for i in range(info.batch_size)
    ])


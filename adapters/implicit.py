"""The implicit-params adapter: ``f()`` reads variables, ``ad.Params`` names them.

Three routes, chosen by the kind of variables in the ``Params``:

* torch leaf tensors: ``torch.autograd.grad`` over the parameters themselves
  (``.backward()`` would accumulate into ``.grad``; every ``.grad`` is left untouched);
* ``tf.Variable`` (and Keras variables): a ``tf.GradientTape`` watching exactly them;
* ``ad.Variable`` boxes, on any inner backend: ``f`` becomes an explicit function of the
  boxes' values, which swaps each box's value for the traced one, calls ``f`` and puts
  the values back (``finally``), and the inner backend differentiates it.

The explicit function is cached per (``f``, variables, other boxes), holding all of them
weakly, so that compiling inner backends (jax ``jit``, ``tf.function``) reuse their trace
on a repeated call.  Boxes ``f`` reads that are not in ``Params`` ("other boxes") are
passed as data, so a trace never freezes their values.  Which boxes those are is learned
whenever ``f`` runs: a call that reads a box outside the wrapper's set gives correct
values (the box is read as it is) and the next call uses a wrapper for the new set (a
new trace on compiled backends); a dead box simply drops out of the set.  A compiled
inner backend runs ``f`` only when it traces, so replacing a box ``f`` reads (rather
than assigning its ``.value``) while the old box is still alive goes unnoticed until
the next trace: assign ``box.value = new`` instead, which is always seen.

torch and tensorflow are imported only when their variables are seen.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import optree

from abstractdiff._backend import Backend, check_scalar
from abstractdiff._errors import ModeMismatchError, NonDifferentiableInputError
from abstractdiff._implicit import TENSORFLOW, TORCH, Grads, Params, Variable, _reads, _tf_variable
from abstractdiff._registry import _lookup
from abstractdiff._registry import backend as _backend
from abstractdiff._tree import _weak_callable, check_output, is_array, split_aux

_EXPLICIT_ONLY = ("value_and_pushforward", "pushforward", "derivative", "jacobian", "hessian", "hvp")


class _Seen(threading.local):
    """Per thread, the collectors of the other boxes ``f`` reads (a stack, for nesting)."""

    def __init__(self) -> None:
        self.stack: list[dict[int, Variable]] = []


_seen = _Seen()


class _Swapped:
    """``f`` as an explicit function of its boxes' values: ``(values, extra_values, *args) -> f(*args)``.

    ``extra`` are the boxes ``f`` read that are not parameters, fixed for the wrapper's
    life (a new set of them gets a new wrapper, and so a new trace).  Holds ``f`` and
    every box weakly: it is cached and must not keep them alive; whoever calls it holds
    them.
    """

    def __init__(self, f: Callable[..., Any], boxes: list[Variable], extra: list[Variable]):
        self._f = _weak_callable(f)
        self._boxes = [weakref.ref(b) for b in boxes]
        self._extra = [weakref.ref(b) for b in extra]
        self._known = {id(b) for b in boxes}

    def boxes(self) -> tuple[Callable[..., Any], list[Variable], list[Variable]]:
        f = self._f()
        boxes = [r() for r in self._boxes]
        if f is None or any(b is None for b in boxes):
            raise ReferenceError("the function or a variable being differentiated was garbage collected")
        # a dead other box cannot be read by f any more: it is left out, never an error
        return f, boxes, [b for b in (r() for r in self._extra) if b is not None]  # type: ignore[return-value]

    def __call__(self, values: list, extra_values: list, *args: Any) -> Any:
        f = self._f()
        if f is None:
            raise ReferenceError("the function being differentiated was garbage collected")
        reads: dict[int, Variable] = {}
        swapped: list[tuple[Variable, Any]] = []
        _reads.stack.append(reads)
        try:
            for ref, value in zip(self._boxes + self._extra, list(values) + list(extra_values)):
                box = ref()
                if box is not None:
                    swapped.append((box, box._swap(value)))
            return f(*args)
        finally:
            _reads.stack.pop()
            for box, old in reversed(swapped):
                box._swap(old)
            if _seen.stack:
                seen = _seen.stack[-1]
                seen[id(self)] = self  # f ran
                for key, box in reads.items():
                    if key not in self._known:
                        seen[key] = box


class _Family:
    """The wrappers of one (``f``, parameters): one per set of other boxes, the current set
    being the one ``f`` read when it last ran."""

    max_wrappers = 8  # sets of other boxes remembered (each may hold a compiled trace)

    def __init__(self, f: Callable[..., Any], boxes: list[Variable]):
        self._f = _weak_callable(f)
        self._boxes = [weakref.ref(b) for b in boxes]
        self.extra: list[weakref.ref] = []
        self.wrappers: OrderedDict[tuple[int, ...], _Swapped] = OrderedDict()

    def wrapper(self) -> _Swapped:
        extra = [b for b in (r() for r in self.extra) if b is not None]
        key = tuple(id(b) for b in extra)
        with _LOCK:
            w = self.wrappers.get(key)
            if w is not None:
                self.wrappers.move_to_end(key)
                return w
        f, boxes = self._f(), [r() for r in self._boxes]
        if f is None or any(b is None for b in boxes):
            raise ReferenceError("the function or a variable being differentiated was garbage collected")
        w = _Swapped(f, boxes, extra)  # type: ignore[arg-type]
        # a dead box's id may be reused by a new box: its wrapper (and trace) goes with it
        family = weakref.ref(self)  # not self: no cycle through the callbacks
        drop = lambda _r, key=key: family() is not None and family()._forget(key)  # noqa: E731
        w.refs = [weakref.ref(b, drop) for b in extra]  # type: ignore[attr-defined]
        with _LOCK:
            self.wrappers[key] = w
            while len(self.wrappers) > self.max_wrappers:
                self.wrappers.popitem(last=False)
        return w

    def _forget(self, key: tuple[int, ...]) -> None:
        # no lock: called from weakref callbacks, which may run while this thread holds it
        self.wrappers.pop(key, None)

    def observe(self, w: _Swapped, seen: dict[int, Any]) -> None:
        """After an operation: ``seen`` holds ``w`` if ``f`` ran, and the other boxes it read."""
        if id(w) not in seen:
            return  # a compiled trace was reused: f did not run, nothing new was learned
        read = [b for k, b in seen.items() if k != id(w)]
        if [id(b) for b in read] == [id(r()) for r in w._extra]:
            return
        self.extra = [weakref.ref(b) for b in read]
        if any(id(b) not in {id(r()) for r in w._extra} for b in read):
            # f read a box w does not pass as data: a compiled trace of w holds its value
            # as a constant, so w must never be used again
            for key, other in list(self.wrappers.items()):
                if other is w:
                    self._forget(key)


_LOCK = threading.RLock()


# Wrapper families per (f, parameters), shared by every Implicit instance: a wrapper does
# not depend on the inner backend (whose own plan cache keys on the wrapper), so a fresh
# ad.Implicit(b) per step still reuses jax's compiled trace.
_EXPLICIT: dict[tuple, _Family] = {}


class Implicit(Backend):
    """``Implicit(inner)``: differentiate ``f()`` with respect to ``ad.Params`` on ``inner``.

    ``inner`` is a backend name or instance; extra keyword options create the inner
    backend (``Implicit("jax", compile=False)``).  Operators: ``gradient``,
    ``value_and_gradient`` (``has_aux`` too), ``pullback`` and ``value_and_pullback``,
    returning :class:`abstractdiff.Grads`.  Extra positional ``args`` are passed to
    ``f(*args)`` undifferentiated (data, as in explicit mode: compiled backends reuse
    their trace for new data of the same shapes).  The same backend as
    ``ad.backend("implicit", inner=inner)``.

    ``ad.gradient(Implicit(inner), f, ad.Params(obj), *args) -> ad.Grads``;
    ``ad.value_and_gradient(...) -> (y, Grads)``; ``ad.value_and_pullback(...) -> (y,
    vjp)`` with ``vjp(dy) -> Grads``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> w = ad.Variable(np.array([1.0, -2.0]))
        >>> b = ad.Implicit("finite_differences")
        >>> y, gs = ad.value_and_gradient(b, lambda x: (w.value * x).sum(), ad.Params([w]), np.array([3.0, 4.0]))
        >>> float(y), np.round(gs[w], 6)
        (-5.0, array([3., 4.]))
    """

    name = "implicit"

    def __init__(self, inner: str | Backend, **inner_options: Any):
        if isinstance(inner, Implicit):
            raise TypeError("the inner backend of ad.Implicit must be an explicit backend, not another ad.Implicit")
        if isinstance(inner, Backend):
            if inner_options:
                raise TypeError("options cannot be given with a Backend instance as inner")
            self._inner: Backend | None = inner
            self.inner_name = inner.name
        elif isinstance(inner, str):
            _lookup(inner)  # an unknown name fails now, with the list of names
            if inner == "implicit":
                raise TypeError("the inner backend of ad.Implicit must be an explicit backend, such as 'jax'")
            self._inner, self.inner_name = None, inner
        else:
            raise TypeError(f"inner must be a backend name (such as 'jax') or a Backend, got {type(inner).__name__}")
        self._inner_options = inner_options
        self.options = {"inner": inner, **inner_options}
        self._plans = None

    @property
    def inner(self) -> Backend:
        """The explicit backend doing the work (created on first use)."""
        if self._inner is None:
            self._inner = _backend(self.inner_name, **self._inner_options)
        return self._inner

    @property
    def device(self) -> str:  # type: ignore[override]
        return self.inner.device

    def devices(self) -> list[str]:
        return self.inner.devices()

    def is_native(self, a: Any) -> bool:
        return self.inner.is_native(a)

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        return self.inner.asarray(a, dtype)

    def zeros_like(self, a: Any) -> Any:
        return self.inner.zeros_like(a)

    def ones_like(self, a: Any) -> Any:
        return self.inner.ones_like(a)

    # ------------------------------------------------------------- checks
    def _params(self, x: Any) -> Params:
        if not isinstance(x, Params):
            raise ModeMismatchError(
                f"the implicit backend ({self!r}) differentiates f() with respect to ad.Params, but got "
                f"a {type(x).__name__}; wrap the model or variables: ad.gradient(b, f, ad.Params(model)) "
                f"with f taking no arguments, or differentiate f(x) explicitly with "
                f"ad.backend({self.inner_name!r})"
            )
        if x.kind is None:
            raise NonDifferentiableInputError(
                f"{x!r} holds no trainable variable to differentiate; unfreeze some parameters "
                f"(requires_grad=True / trainable=True) or pass the variables themselves"
            )
        need = {TORCH: "torch", TENSORFLOW: "tensorflow"}.get(x.kind)
        if need is not None and need != self.inner_name:
            raise TypeError(
                f"Params holds {need} variables but the inner backend is {self.inner_name!r}; use "
                f"ad.Implicit({need!r}), or hold {self.inner_name} values in ad.Variable boxes "
                f"(ad.variables(tree, {self.inner_name!r}))"
            )
        return x

    def _native(self, args: tuple, params: Params) -> tuple:
        # array leaves of args become native arrays, as in explicit mode (the generic
        # route gets this from the inner backend); numpy data of a torch model goes to
        # the model's device, so Implicit("torch") works for a model moved to a GPU
        if not args:
            return args
        inner = self.inner
        device = params[0].device if params.kind == TORCH else None

        def native(a: Any) -> Any:
            if not is_array(a) or inner.is_native(a):
                return a
            a = inner.convert(a)
            return a.to(device) if device is not None and a.device != device else a

        return optree.tree_map(native, args)

    def _wrapper(self, f: Callable[..., Any], boxes: list[Variable]) -> tuple[_Family, _Swapped]:
        owner = getattr(f, "__self__", None)
        func = getattr(f, "__func__", f) if owner is not None else f
        key = (id(func), id(owner), *(id(b) for b in boxes))
        with _LOCK:
            family = _EXPLICIT.get(key)
        if family is None:
            family = _Family(f, boxes)
            try:
                # drop the family (and the inner backend's plans for its wrappers) when any of them dies
                drop = lambda _r, key=key: _EXPLICIT.pop(key, None)  # noqa: E731
                family.refs = [weakref.ref(o, drop) for o in (func, owner, *boxes) if o is not None]  # type: ignore[attr-defined]
            except TypeError:  # f cannot be weakly referenced: a wrapper for this call only
                w = _Swapped(f, boxes, [])
                w._f = lambda: f
                return family, w
            with _LOCK:
                family = _EXPLICIT.setdefault(key, family)
        return family, family.wrapper()

    def _run(self, op: Callable[..., Any], f: Callable[..., Any], ps: Params, *args: Any, **kw: Any) -> tuple:
        """``op(wrapper, values, extra values, *args)`` on the inner backend, noting what f read."""
        family, w = self._wrapper(f, list(ps))
        _, boxes, extra = w.boxes()
        seen: dict[int, Any] = {}
        _seen.stack.append(seen)
        try:
            out = op(w, [b._value for b in boxes], [b._value for b in extra], *args, **kw)
        finally:
            _seen.stack.pop()
        family.observe(w, seen)
        return w, out

    # ---------------------------------------------------- public operators
    def value_and_gradient(self, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False) -> tuple[Any, Grads]:
        """``(y, gs)`` or ``((y, aux), gs)``; see :func:`abstractdiff.value_and_gradient`."""
        ps = self._params(x)
        if not callable(f):
            raise TypeError(f"f must be callable, got {type(f).__name__}")
        if ps.kind == TORCH:
            y, aux, grads = _torch_value_and_gradient(self.inner, f, list(ps), self._native(args, ps), has_aux)
        elif ps.kind == TENSORFLOW:
            y, aux, grads = _tf_value_and_gradient(f, list(ps), self._native(args, ps), has_aux)
        else:
            _, (out, grads) = self._run(self.inner.value_and_gradient, f, ps, *args, has_aux=has_aux)
            y, aux = out if has_aux else (out, None)
        gs = Grads(ps, list(grads))
        return ((y, aux), gs) if has_aux else (y, gs)

    def value_and_pullback(self, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Callable[[Any], Grads]]:
        """``(y, vjp)`` with ``vjp(dy) -> Grads``; see :func:`abstractdiff.value_and_pullback`."""
        ps = self._params(x)
        if not callable(f):
            raise TypeError(f"f must be callable, got {type(f).__name__}")
        w = None
        if ps.kind == TORCH:
            y, vjp = _torch_value_and_pullback(self.inner, f, list(ps), self._native(args, ps))
        elif ps.kind == TENSORFLOW:
            y, vjp = _tf_value_and_pullback(self.inner, f, list(ps), self._native(args, ps))
        else:
            w, (y, vjp) = self._run(self.inner.value_and_pullback, f, ps, *args)

        def pullback(dy: Any) -> Grads:
            return Grads(ps, list(vjp(dy)))

        # the explicit wrapper holds f weakly, and its family may drop it: a pullback that
        # calls f again (finite differences) needs both
        pullback.f, pullback.wrapper = f, w  # type: ignore[attr-defined]
        return y, pullback


def _explicit_only(name: str) -> Callable[..., Any]:
    def refuse(self: Implicit, *_args: Any, **_kwargs: Any) -> Any:
        raise ModeMismatchError(
            f"{name} is not available in implicit mode (ad.Implicit offers gradient, value_and_gradient, "
            f"pullback and value_and_pullback); call ad.{name} on the explicit backend "
            f"ad.backend({self.inner_name!r}) with the variables' values as x "
            f"(abstractdiff._implicit.current_values reads them from a tree of variables)"
        )

    refuse.__name__ = name
    return refuse


for _name in _EXPLICIT_ONLY:
    setattr(Implicit, _name, _explicit_only(_name))


# --------------------------------------------------------------- torch route
def _torch_output(out: Any) -> Any:
    import torch

    y = check_output(out)
    return y if isinstance(y, torch.Tensor) else torch.as_tensor(np.asarray(y))


def _torch_value_and_gradient(inner: Backend, f: Callable[..., Any], params: list, args: tuple, has_aux: bool) -> tuple:
    import torch

    with torch.enable_grad():
        y, aux = split_aux(f(*args), has_aux)
        y = _torch_output(y)
        check_scalar(y)
        if y.requires_grad:
            # never .backward(): it would accumulate into every parameter's .grad
            grads = torch.autograd.grad(y, params, allow_unused=True, materialize_grads=True)
        else:
            grads = tuple(torch.zeros_like(p) for p in params)
    return y.detach(), inner._detached(aux), list(grads)  # type: ignore[attr-defined]  # TorchBackend


def _torch_value_and_pullback(inner: Backend, f: Callable[..., Any], params: list, args: tuple) -> tuple:
    import torch

    with torch.enable_grad():
        y = _torch_output(f(*args))

    def vjp(dy: Any) -> list:
        # on y's device and dtype: cotangent leaves a native tensor's dtype as it is
        dy = torch.as_tensor(inner.cotangent(dy, y), dtype=y.dtype, device=y.device)
        if not y.requires_grad:
            return [torch.zeros_like(p) for p in params]
        with torch.enable_grad():
            grads = torch.autograd.grad(
                y, params, grad_outputs=dy, retain_graph=True, allow_unused=True, materialize_grads=True
            )
        return list(grads)

    return y.detach(), vjp


# ---------------------------------------------------------- tensorflow route
def _tf_output(out: Any) -> Any:
    import tensorflow as tf

    y = check_output(out)
    return y if tf.is_tensor(y) else tf.constant(np.asarray(y))


def _dense(tf: Any, g: Any) -> Any:
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _tf_value_and_gradient(f: Callable[..., Any], params: list, args: tuple, has_aux: bool) -> tuple:
    import tensorflow as tf

    watched = [_tf_variable(v) for v in params]
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(watched)
        y, aux = split_aux(f(*args), has_aux)
        y = _tf_output(y)
    check_scalar(y)
    grads = tape.gradient(y, watched, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return y, aux, [_dense(tf, g) for g in grads]


def _tf_value_and_pullback(inner: Backend, f: Callable[..., Any], params: list, args: tuple) -> tuple:
    import tensorflow as tf

    watched = [_tf_variable(v) for v in params]
    # persistent: the pullback may be called more than once
    with tf.GradientTape(watch_accessed_variables=False, persistent=True) as tape:
        tape.watch(watched)
        y = _tf_output(f(*args))

    def vjp(dy: Any) -> list:
        dy = tf.cast(inner.cotangent(dy, y), y.dtype)
        grads = tape.gradient(y, watched, output_gradients=dy, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [_dense(tf, g) for g in grads]

    return y, vjp


__all__ = ["Implicit"]

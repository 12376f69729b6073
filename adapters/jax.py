"""JAX adapter: ``jax.vjp``/``jax.jvp`` as primitives, ``jit``-compiled and cached per flat function.

An adapter of the protocol (:class:`abstractdiff.protocol.Adapter`): ``ad.backend("jax")`` is
the core's backend holding a :class:`JaxAdapter`.  Its fast routes are jax's own transforms
(``value_and_grad``, ``jacrev``/``jacfwd``, forward-over-reverse Hessians and HVPs, forward-
over-forward second derivatives), each compiled once per flat function; its compile step
(:meth:`JaxAdapter.direct_prepared`) hands a whole prepared call to jit's dispatch.

Two jax habits shape this module:

* x64 is off by default and float64 silently becomes float32.  The global
  ``jax_enable_x64`` flag is never touched; every call (conversion, transforms and the
  closures handed back) runs under a scoped ``jax.enable_x64(True)`` when an input is
  float64, and the compiled variants are cached per x64 mode.
* ``jit`` retraces for a new function object.  Compiled transforms are therefore built
  once per cached :class:`~abstractdiff._tree.FlatFunction` and kept in its typed cache
  (``fn.artefacts(self.backend, operator)``, keyed on the backend holding the adapter, one
  variant per x64 mode); the differentiated leaves and the data are traced arguments, so
  new data values of the same shapes reuse the compiled code.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from abstractdiff._arrays import check_scalar, signature
from abstractdiff._captures import CaptureGuard, _function_key
from abstractdiff._compose import ForeignKernel, boundary_error
from abstractdiff._custom import mode_refusal
from abstractdiff._errors import ArgumentTypeError, CompositionError, LoopDerivativeError, TracedControlFlowError
from abstractdiff._pytree import Static, unbox
from abstractdiff._tree import AuxStatics, HasArtefacts, _static_key, artefacts
from abstractdiff.protocol import Adapter

from . import _keras

_WIDE = (np.dtype("float64"), np.dtype("complex128"))
_WIDE_SET = frozenset(_WIDE)
#: how long to_numpy polls an array still being computed before blocking on it
_POLL_S = 200e-6
#: the weight of the newest wait in their smoothed length
_WAIT_WEIGHT = 0.2
# jax raises these when Python needs a concrete value (bool(), int(), float()) of a tracer.
_CONCRETE_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError)


_ARRAY = type(jnp.zeros(0))  # jax's concrete array type (jaxlib's ArrayImpl)


class _Static:
    """A static argument of a jitted prepared call, equal to another by the core's exact
    key (its type, a float's bits): jit's own comparison would take -0.0 for 0.0."""

    __slots__ = ("value", "key")

    def __init__(self, value: Any, key: Any):
        self.value, self.key = value, key

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Static and self.key == other.key


class _Held:
    """A residual leaf that is not a JAX value (a string, an options object in ``custom_root``'s
    ``theta``), carried through ``jax.custom_vjp``'s residuals as static structure: jax
    accepts only arrays and numbers as residual leaves and raised its own ``TypeError``
    (``Argument 's' of type <class 'str'> is not a valid JAX type``), where the other
    libraries carry such leaves as they are.  Equal by identity: the residuals of one call."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


jax.tree_util.register_pytree_node(_Held, lambda h: ((), h), lambda h, _: h)


def _is_jax_value(leaf: Any) -> bool:
    """Whether jax takes ``leaf`` as a residual leaf: one of its arrays (a tracer too), or a
    numpy array or number of a numeric dtype."""
    if isinstance(leaf, (jax.Array, bool, int, float, complex)):
        return True
    return isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype.kind in "biufc"


def _hold_static_residuals(forward: Callable, backward: Callable) -> tuple[Callable, Callable]:
    """``(fwd, bwd)`` for ``jax.custom_vjp`` from a rule's: the residual leaves that are not
    JAX values travel as :class:`_Held` structure, and ``bwd`` gets them back unchanged."""

    def fwd(*inputs: Any) -> tuple:
        out, residuals = forward(*inputs)
        return out, jax.tree_util.tree_map(lambda a: a if _is_jax_value(a) else _Held(a), residuals)

    def bwd(residuals: Any, ct: Any) -> Any:
        given = jax.tree_util.tree_map(lambda a: a.value if type(a) is _Held else a, residuals,
                                       is_leaf=lambda a: type(a) is _Held)
        return backward(given, ct)

    return fwd, bwd


#: Prepared operators whose results are arrays only (no closures), which a jit can return.
_DIRECT_OPERATORS = frozenset({
    "gradient", "value_and_gradient", "jacobian", "value_and_jacobian", "hessian", "value_gradient_and_hessian",
    "hvp", "gradient_and_hvp", "derivative", "value_and_derivative", "second_derivative",
    "value_derivative_and_second_derivative",
})


def _wants_x64(*groups: list) -> bool:
    return any(getattr(a, "dtype", None) in _WIDE for group in groups for a in group)


def _fresh(a: Any) -> Any:
    """A numpy array as a new object over the same memory (no copy), for jax to convert.

    jax (0.10) keeps what it canonicalised a numpy array to per array object, not per x64
    mode, while a trace that captured the array lives: an int64 ``idx`` closed over by a
    function traced in the x64 scope then converts, outside it, to an int32 array over an
    int64 buffer (and a float64 array seen by a float32 trace, inside the scope, to a
    float64 array over a float32 buffer), which a compiled call refuses or misreads.  A
    view jax has never seen is canonicalised in the mode of this conversion."""
    return a.view() if isinstance(a, np.ndarray) else a


def _stale_captures(fn: Any) -> list[str]:
    """The numpy arrays ``fn``'s user function reads by closure or global (the walk that
    keys traces: :mod:`abstractdiff._captures`) that jax converts, in the present x64 mode,
    to another dtype than this mode's: each as ``name dtype[shape] -> dtype``.

    That is jax's own per-object memory seen directly: ``dtypes.canonicalize_value`` (C++
    in jaxlib 0.10) keeps the array it made of a numpy array per array object, weakly, while
    that result lives, whatever the x64 mode it was made in; a trace that captured the array
    holds the result (its jaxpr's constants, in jax's caches, until they evict it or the
    cyclic garbage collector frees it).  A float64 array first seen outside x64 mode is
    then float32 to a trace in the x64 scope (lax refuses ``float64 * float32``; or, through
    ``jnp.asarray``, a float64 result computed from float32-rounded values), and an int64
    array first seen in the scope stays int64 outside it.  Neither the memory nor its
    holders can be reached without changing jax or the user's closure, so the adapter says
    what happened (see :meth:`JaxAdapter._traced`).  Best effort: ``[]`` where the walk
    fails (the caller then re-raises jax's own error)."""
    from jax._src import dtypes as jax_dtypes  # the conversion the trace used; no public name

    try:
        f = fn.f  # the user's function (a core FlatFunction; raises where it has none)
        guard = CaptureGuard()
        _function_key(f, [], 0, set(), guard)
        arrays = [entry[1]() for entry in guard._rest if entry[0] == "array"]
        code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
        names = {}
        if code is not None:
            for name, cell in zip(code.co_freevars, cells):
                with contextlib.suppress(ValueError):
                    names.setdefault(id(cell.cell_contents), name)
            for name in code.co_names:
                names.setdefault(id(f.__globals__.get(name)), name)
        stale = []
        for a in arrays:
            if a is None:
                continue
            held = jax_dtypes.canonicalize_value(a).dtype
            if held != jax_dtypes.canonicalize_dtype(a.dtype):
                stale.append(f"{names.get(id(a), 'a numpy array')} {a.dtype}{list(a.shape)} -> {held}")
        return stale
    except Exception:  # noqa: BLE001 - a diagnosis only: jax's own error stands
        return []


def _platform_devices(platform: str) -> list[Any]:
    try:
        return list(jax.devices(platform))
    except RuntimeError:  # no backend for that platform here
        return []


def _padded(v: Any, size: int) -> Any:
    """``v`` padded with zeros to ``size`` (the square system of a custom_linear_solve)."""
    return v if v.shape[0] == size else jnp.pad(v, (0, size - v.shape[0]))


def _without_forward_rule(forward: Callable, otherwise: Callable) -> Callable:
    """``forward``, or ``otherwise(err, *args)`` where jax refuses forward mode through the
    function (``err``: an ``ad.custom_vjp`` in it has no forward-mode rule)."""

    def call(*args: Any) -> Any:
        try:
            return forward(*args)
        except (TypeError, NotImplementedError) as err:
            # jax's words: a TypeError naming custom_vjp, or (forward over forward through
            # one) a NotImplementedError for its linearised primitive, custom_lin
            if "custom_vjp" not in str(err) and "'custom_lin'" not in str(err):
                raise
            return otherwise(err, *args)

    return call


def _jacfwd(f: Callable, **options: Any) -> Callable:
    # a Jacobian or Hessian through a custom_vjp: the rule's, by reverse mode
    reverse = jax.jacrev(f, **options)
    return _without_forward_rule(jax.jacfwd(f, **options), lambda _, *args: reverse(*args))


def _refuse_forward_mode(err: TypeError, *_: Any) -> Any:
    raise mode_refusal("forward", (
        f"forward mode (a pushforward, derivative or forward-over-forward) through an ad.custom_vjp "
        f"function, which has no forward-mode rule (on jax, ad.custom_root and ad.custom_fixed_point are "
        f"custom_vjp functions too): give it one with ad.custom_jvp, or use reverse mode (jax: {err})"
    )) from None


def _forward_mode(run: Callable) -> Callable:
    """``run`` with jax's refusal of forward mode through a custom_vjp as the core's error."""
    return _without_forward_rule(run, _refuse_forward_mode)


def _hvp(grad: Callable, xs: list, data: list, ts: list, reverse_only: bool = False) -> tuple:
    """``(gradient, Hessian times ts)``: forward over reverse, or reverse over reverse (the
    Hessian is symmetric) through an ``ad.custom_vjp``."""
    forward = lambda: jax.jvp(lambda xs: grad(xs, data), (xs,), (ts,))  # noqa: E731

    def reverse() -> tuple:
        g, pullback = jax.vjp(lambda xs: grad(xs, data), xs)
        return g, pullback(ts)[0]

    return reverse() if reverse_only else _without_forward_rule(forward, lambda _: reverse())()


def _second_order_error(kernel: Any) -> CompositionError:
    """The refusal of a second derivative through a custom function: the core's wording where
    the value is a :class:`~abstractdiff._compose.ForeignKernel`'s bound method."""
    if isinstance(kernel, ForeignKernel):
        return boundary_error(kernel, "jax", 2)
    return CompositionError(
        "a second derivative through a custom function called from jax code is not supported: "
        "jax carries its first derivatives only"
    )


def _typed(values: list, like: list) -> list:
    # lax's loops need a step to return its carry's exact types, weak types included
    return [jax.lax.convert_element_type(v, jnp.result_type(c)) for v, c in zip(values, like)]


class _Loops:
    """ad.fori_loop, ad.scan and ad.while_loop on lax's loops (the adapter guide's "Loops")."""

    def fori_loop(self, lower: int, upper: int, body: Callable, init: list) -> list:
        init = _typed(init, init)  # static bounds: lax lowers it to a scan, which reverse mode takes
        return jax.lax.fori_loop(lower, upper, lambda i, c: _typed(body(i, list(c)), c), init)

    def scan(self, f: Callable, init: list, xs: list, length: int) -> tuple:
        def step(c: list, x: list) -> tuple:
            new, y = f(list(c), list(x))
            return _typed(new, c), y

        return jax.lax.scan(step, _typed(init, init), xs, length=length)

    def while_loop(self, cond: Callable, body: Callable, init: list) -> list:
        step = lambda c: _typed(body(list(c)), c)  # noqa: E731
        return jax.lax.while_loop(lambda c: cond(list(c)), step, _typed(init, init))


def _loop_errors(traced: Callable, fn: Any = None) -> Callable:
    """``traced`` with jax's refusal to reverse a while loop as the core's error, and jax's
    dtype errors from a stale captured array (:func:`_stale_captures` of ``fn``) as an
    :class:`ArgumentTypeError` (at trace time; jax raises the latter while it transforms
    the trace too, so this wraps the whole transform rather than the call of ``fn``)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return traced(*args, **kwargs)
        except ValueError as err:
            if "Reverse-mode differentiation does not work for lax.while_loop" not in str(err):
                raise
            raise LoopDerivativeError(
                "reverse mode (a gradient, pullback or Hessian) through ad.while_loop, which jax cannot reverse: "
                "use ad.fori_loop with a bound (or ad.scan), or forward mode (pushforward, jacfwd)"
            ) from err
        except (TypeError, jax.errors.JaxRuntimeError) as err:
            # jax's dtype error (or a compiled op refusing the buffer) names no cause: is it
            # a numpy array f captured, converted by jax in the other x64 mode?  (No retry
            # after a garbage collection: the failed trace itself holds the conversion.)
            stale = [] if isinstance(err, ArgumentTypeError) else _stale_captures(fn)
            if not stale:
                raise
            raise ArgumentTypeError(
                "jax converted numpy array(s) that f reads by closure or global to a dtype "
                f"other than this call's ({'; '.join(stale)}): jax remembers its conversion of a "
                "numpy array per array object, not per x64 mode, while a trace made in the other "
                "mode (float32 inputs outside x64, float64 inputs inside it) is alive.  Pass the "
                "array to f as an argument (arguments are converted per call), or convert it in "
                "f with the dtype you mean (jnp.asarray(w, dtype=x.dtype))"
            ) from err
    return call


class JaxAdapter(Adapter):
    name = "jax"
    extra = "jax"
    modules = ("jax", "jaxlib", "keras")
    fast_routes = {
        "prepare_value_and_gradient": "prepare_value_and_gradient",  # the per-call form too (PER_CALL_ROUTES)
        "prepare_jacobian": "prepare_jacobian",
        "prepare_hvp": "prepare_hvp",
        "jacobian": "jacobian",
        "hessian": "hessian",
        "hessian_blocks": "hessian_blocks",
        "hvp": "hvp",
        "value_gradient_and_hessian": "value_gradient_and_hessian",
        "gradient_and_hvp": "gradient_and_hvp",
        "value_derivative_and_second_derivative": "value_derivative_and_second_derivative",
        "second_derivative": "second_derivative",
    }

    def __init__(self, *, device: str = "cpu", compile: bool = True):
        if not isinstance(compile, bool):
            raise ArgumentTypeError(f"compile must be True or False, got {compile!r}")
        super().__init__(device=device, compile=compile)
        self.compile = compile
        self.reuses_traces = bool(compile)  # a compiled trace freezes what f reads (see AdapterHooks)
        self._device = self._device_object(self.device)
        self._scoped_device = self._device != jax.devices()[0]
        #: Python executions of user functions under this backend's transforms; a
        #: compiled call that reuses its trace leaves it unchanged (tests count retraces).
        self.trace_count = 0
        self.variables = _keras.StatelessVariables(self, "jax")  # Keras 3 variables: jax arrays are immutable
        self._wait = 0.0  # to_numpy's waits for a result being computed, smoothed
        self.loops = _Loops()  # the loop hooks (ad.scan...): lax's loops, traced once
        self.compiler = self._compiler if compile else None  # whole train_steps, sparse calls: one jit

    # ---------------------------------------------------------------- devices
    def devices(self) -> list[str]:
        names = ["cpu"]
        for platform, prefix in (("gpu", "cuda"), ("tpu", "tpu")):
            names += [f"{prefix}:{i}" for i in range(len(_platform_devices(platform)))]
        return names

    @staticmethod
    def _device_object(name: str) -> Any:
        if name == "cpu":
            return jax.devices("cpu")[0]
        prefix, _, index = name.partition(":")
        return _platform_devices("gpu" if prefix == "cuda" else prefix)[int(index)]

    @contextlib.contextmanager
    def _scope(self, x64: bool) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if x64:
                stack.enter_context(jax.enable_x64(True))
            if self._scoped_device:
                stack.enter_context(jax.default_device(self._device))
            try:
                yield
            except _CONCRETE_ERRORS as err:
                raise TracedControlFlowError(self._control_flow_message(err)) from err

    def _compiler(self, step: Callable, assigns_variables: bool = False) -> Callable | None:
        if assigns_variables:
            return None  # jax arrays are immutable: implicit mode's variables are assigned in Python
        jitted, leaves = jax.jit(step), jax.tree_util.tree_leaves
        plain, wide = self._direct(jitted, False), self._direct(jitted, True)
        # the x64 scope where an argument is wide; a caller that knows its arguments' dtypes
        # decides once (Python before the dispatch is what a small compiled step's time is)
        run = lambda *args: run.for_dtypes({getattr(a, "dtype", None) for a in leaves(args)})(*args)  # noqa: E731
        run.for_dtypes = lambda dtypes: plain if _WIDE_SET.isdisjoint(dtypes) else wide
        return run

    def _control_flow_message(self, err: Exception) -> str:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if self.compile:
            fix = (
                "pass compile=False (ad.backend('jax', compile=False)): un-jitted jax transforms "
                "allow comparisons such as `if x.sum() > 0`, though not float()/int() of a "
                "traced value; or replace the branch with jnp.where / jax.lax.cond"
            )
        else:
            fix = (
                "jax transforms allow comparisons such as `if x.sum() > 0` without jit, but not "
                "float()/int()/.item() of a traced value: keep the value as an array and use "
                "jnp.where / jax.lax.cond"
            )
        return f"f used a traced jax value where Python needs a concrete number ({type(err).__name__}: {first}); {fix}"

    # ---------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        return isinstance(a, (jax.Array, jax.core.Tracer))

    def from_numpy(self, a: np.ndarray) -> Any:
        with self._scope(a.dtype in _WIDE):
            return jax.device_put(_fresh(a), self._device)

    def to_numpy(self, a: Any) -> np.ndarray:
        if type(a) is not _ARRAY or a.is_ready():
            return np.asarray(a)
        # A result still being computed is polled for a while before numpy blocks on it,
        # where the waits have been short: a thread that blocks is woken tens of microseconds
        # after the result is ready (a compiled small-MLP step on a 2-core VM syncs in ~60 us
        # blocking, ~25 polling), while polling through a long computation takes a core
        # from it (a medium MLP's step is ~8% slower).  The waits are smoothed: one late
        # result (a busy machine) must not turn a loop of short steps to blocking, whose
        # late wake-ups would then keep the measured waits long.
        start = time.perf_counter()
        if self._wait < _POLL_S:
            deadline = start + _POLL_S
            while not a.is_ready() and time.perf_counter() < deadline:
                pass
        out = np.asarray(a)
        self._wait += _WAIT_WEIGHT * (time.perf_counter() - start - self._wait)
        return out

    def from_dlpack(self, a: Any) -> Any:
        # shares memory aligned to 64 bytes (torch's allocations; numpy's large ones are 16)
        # and copies the rest; float64 stays float64 in the x64 scope.  numpy will not export
        # read-only memory by the DLPack version jax asks for: that copies too.
        with self._scope(getattr(a, "dtype", None) in _WIDE):
            try:
                return jax.dlpack.from_dlpack(a, device=self._device)
            except (BufferError, TypeError, RuntimeError, ValueError):
                return super().from_dlpack(a)

    def cast(self, a: Any, dtype: str) -> Any:
        with self._scope(np.dtype(dtype) in _WIDE or _wants_x64([a])):
            return a.astype(dtype)

    def asarray_like(self, a: np.ndarray, like: Any) -> Any:
        device = next(iter(like.devices())) if hasattr(like, "devices") else self._device
        with self._scope(a.dtype in _WIDE):
            return jax.device_put(_fresh(a), device)

    def pytree_node(self, obj: Any) -> tuple[Callable, Callable] | None:
        # registered with jax.tree_util (Equinox modules, register_dataclass, Flax structs):
        # flattened one level as jax does; an Equinox module's Python floats stay static, as
        # eqx.filter_grad leaves them (an eqx.nn.Dropout's p is no parameter)
        if jax.tree_util.all_leaves([obj]):
            return None
        equinox = sys.modules.get("equinox")
        floats_static = equinox is not None and isinstance(obj, equinox.Module)

        def flatten(node: Any) -> tuple[list, Any]:
            children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda child: child is not node)
            return [Static(c) if floats_static and type(c) is float else c for c in children], treedef

        return flatten, lambda treedef, children: jax.tree_util.tree_unflatten(treedef, unbox(children))

    def scope(self, arrays: Any) -> Any:
        # arithmetic on float64 jax arrays outside the scope truncates to float32; the scope
        # is local, so the user's global jax configuration is never changed
        wide = any(isinstance(a, (jax.Array, jax.core.Tracer)) and a.dtype == np.float64 for a in arrays)
        return jax.enable_x64(True) if wide else contextlib.nullcontext()

    def zeros_like(self, a: Any) -> Any:
        with self._scope(_wants_x64([a])):
            return jnp.zeros_like(a)

    def ones_like(self, a: Any) -> Any:
        with self._scope(_wants_x64([a])):
            return jnp.ones_like(a)

    # ------------------------------------------------------------ compilation
    def _traced(self, fn: Any, operator: str | None = None) -> Callable:
        """``fn`` with the scalar check (at trace time, before jax's own) and a trace count.

        jit can only return arrays, so aux leaves that are not jax arrays (ints, strings,
        numpy constants) are kept here at trace time, per input signature, and put back by
        :meth:`_aux`: aux comes back unchanged.
        """
        statics = self._aux_statics(fn, operator)

        def call(xs: list, data: list) -> tuple[Any, Any]:
            self.trace_count += 1
            y, aux = fn(xs, data)
            if operator is not None:
                check_scalar(y, operator)
            if aux is not None and statics is not None:
                aux = statics.split(signature(xs, data), aux)
            return jnp.asarray(y), aux

        return call

    def _aux_statics(self, fn: Any, operator: str | None) -> AuxStatics | None:
        if not isinstance(fn, HasArtefacts):
            return None
        return fn.artefacts(self.backend, f"aux of {operator}").get("statics", lambda: AuxStatics(
            lambda v: isinstance(v, (jax.Array, jax.core.Tracer)), jax.tree_util.tree_flatten,
            jax.tree_util.tree_unflatten))

    def _aux(self, fn: Any, operator: str | None, xs: list, data: list, aux: Any) -> Any:
        if aux is None or not isinstance(fn, HasArtefacts):  # not split: see _compiled
            return aux
        return self._aux_statics(fn, operator).join(signature(xs, data), aux)  # type: ignore[union-attr]

    def _compiled(self, fn: Any, operator: str, x64: bool, build: Callable[[], Callable]) -> Callable:
        if not isinstance(fn, HasArtefacts):  # a plain callable (not from the core): a jit would retrace every call
            return build()
        # jit caches per input shapes and dtypes itself; the x64 mode changes what a trace
        # means (float64 inputs are float32 outside it), so it is part of the variant
        traced = lambda: _loop_errors(build(), fn)  # noqa: E731
        return fn.artefacts(self.backend, operator).get(x64, lambda: jax.jit(traced()) if self.compile else traced())

    # ------------------------------------------------------------- primitives
    # The forward pass (jax.vjp or jax.linearize) and the application of its closure are two
    # compiled functions per flat function, and the closure crosses between them as its
    # residual arrays only: its tree, which holds its jaxpr, is set aside at trace time (per
    # input signature, as the aux statics are) and closed over by the compiled application.
    # A closure returned from or passed into a jit would be part of the trees jax keys its
    # global caches on, so each new function's jaxpr would stay cached there (memory growth
    # when a pullback, a Batch or ad.Sparse is built for a new function per call).
    def _linearised(self, fn: Callable, transform: Callable, xs: list, data: list, x64: bool) -> tuple:
        """``(y, aux, residuals, treedef)`` of ``transform`` (``jax.vjp`` or ``jax.linearize``)."""
        name = transform.__name__
        trees = artefacts(fn, self.backend, f"closure trees of {name}").get("trees", dict)

        def build() -> Callable:
            traced = self._traced(fn)

            def forward(xs: list, data: list) -> tuple:
                y, closure, aux = transform(lambda xs: traced(xs, data), xs, has_aux=True)
                residuals, trees[signature(xs, data)] = jax.tree_util.tree_flatten(closure)
                return y, residuals, aux

            return forward

        compiled = self._compiled(fn, name, x64, build)
        with self._scope(x64):
            y, residuals, aux = (_forward_mode(compiled) if transform is jax.linearize else compiled)(xs, data)
        return y, self._aux(fn, None, xs, data, aux), residuals, trees[signature(xs, data)]

    def _applied(self, fn: Callable, name: str, x64: bool, residuals: list, treedef: Any, apply: Callable) -> Callable:
        """``arg -> apply(closure, arg)``, compiled per closure tree, the closure rebuilt inside."""

        def build() -> Callable:
            return lambda residuals, arg: apply(jax.tree_util.tree_unflatten(treedef, residuals), arg)

        # uncompiled, each call linearises afresh and its tree is new: nothing to keep for reuse
        compiled = self._compiled(fn, name, (x64, treedef), build) if self.compile else _loop_errors(build())

        def call(arg: Any) -> Any:
            with self._scope(x64):
                return compiled(residuals, arg)

        return call

    def value_and_pullback(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, Callable]:
        x64 = _wants_x64(xs, data)
        y, aux, residuals, treedef = self._linearised(fn, jax.vjp, xs, data, x64)
        backward = self._applied(fn, "pullback_apply", x64, residuals, treedef, lambda pb, dy: pb(dy)[0])
        return y, aux, lambda dy: list(backward(dy))

    def value_and_pushforward(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, Callable]:
        x64 = _wants_x64(xs, data)
        y, aux, residuals, treedef = self._linearised(fn, jax.linearize, xs, data, x64)
        apply = self._applied(fn, "pushforward_apply", x64, residuals, treedef, lambda lin, ts: lin(ts))
        return y, aux, _forward_mode(lambda ts: apply(list(ts)))

    # ------------------------------------------------------------- batched
    # The forward pass is the primitive's own; the batch is one jax.vmap of the linearisation
    # (or of the pullback), compiled once per batch shape.
    def value_and_batched_pushforward(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, Callable]:
        x64 = _wants_x64(xs, data)
        y, aux, residuals, treedef = self._linearised(fn, jax.linearize, xs, data, x64)
        apply = self._applied(
            fn, "batched_pushforward_apply", x64, residuals, treedef, lambda lin, ts: jax.vmap(lin)(ts)
        )
        return y, aux, _forward_mode(lambda ts: apply(list(ts)))

    def value_and_batched_pullback(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, Callable]:
        x64 = _wants_x64(xs, data)
        y, aux, residuals, treedef = self._linearised(fn, jax.vjp, xs, data, x64)
        backward = self._applied(
            fn, "batched_pullback_apply", x64, residuals, treedef, lambda pb, dys: jax.vmap(lambda dy: pb(dy)[0])(dys)
        )
        return y, aux, lambda dys: list(backward(dys))

    # ------------------------------------------------------------- composition
    def custom_function(self, value: Callable, vjps: Sequence[Callable], jvps: Sequence[Callable],
                        out: tuple[int, str]) -> Callable[..., Any]:
        # The value through jax.pure_callback (so it works under jit; vmap calls it once per
        # element) in a jax.custom_jvp.  The jvp rule's tangent must be a map jax can
        # transpose (reverse mode) and batch (jacrev, jacfwd, vmap of grad):
        # lax.custom_linear_solve with an identity matvec is exactly "a linear map with a
        # custom transpose" (linear_call has no batching rule), so its solve is the rule's
        # pushforward and its transpose_solve the rule's pullback.  A non-square Jacobian is
        # padded to a square one with zeros.  The rules see the inputs through
        # refuse_second_order: jax treats the solves' closed-over values as constants, so a
        # second derivative would otherwise be silently zero.
        size, dtype = out
        struct = jax.ShapeDtypeStruct((size,), dtype)
        kernel = getattr(value, "__self__", None)  # the ForeignKernel, for the refusal's wording

        @jax.custom_jvp
        def refuse_second_order(a: Any) -> Any:
            return a

        @refuse_second_order.defjvp
        def _(primals: tuple, tangents: tuple) -> Any:
            raise _second_order_error(kernel)

        @jax.custom_jvp
        def function(*inputs: Any) -> Any:
            return jax.pure_callback(value, struct, *inputs, vmap_method="sequential")

        @function.defjvp
        def _(primals: tuple, tangents: tuple) -> Any:
            held = [refuse_second_order(a) for a in primals]
            total = None
            for t, vjp, jvp in zip(tangents, vjps, jvps):
                n = t.shape[0]
                k = max(n, size)

                def pushforward(_: Any, v: Any, jvp: Callable = jvp, n: int = n, k: int = k) -> Any:
                    return _padded(jvp(v[:n], *held), k)

                def pullback(_: Any, ct: Any, vjp: Callable = vjp, k: int = k) -> Any:
                    return _padded(vjp(ct[:size], *held), k)

                dy = jax.lax.custom_linear_solve(lambda v: v, _padded(t, k), pushforward, pullback)[:size]
                total = dy if total is None else total + dy
            return function(*primals), total

        return function

    def custom_rule(self, rule: Any) -> Callable[..., tuple]:
        # jax's own mechanisms, which nest, batch and compile: custom_jvp where there is a jvp
        # rule (jax transposes it for reverse mode), else custom_vjp (reverse mode only; the
        # Jacobians and Hessians then take reverse mode: _or_reverse)
        if rule.stops_gradient:
            return lambda *inputs: tuple(map(jax.lax.stop_gradient, inputs))
        # A rule with both modes (ad.custom_root's) takes custom_vjp: jax transposes a jvp rule
        # only where its tangent is linear as jax traces it, which an iterative linear solve's
        # is not; its forward mode is then refused as for any custom_vjp (_or_reverse).
        rule.lazy_forward = True  # jax runs fwd only under differentiation, and differentiates it
        if rule.has_jvp and not rule.has_vjp:
            function = jax.custom_jvp(rule.value)
            function.defjvp(rule.jvp)
        else:
            function = jax.custom_vjp(rule.value)
            function.defvjp(*_hold_static_residuals(rule.forward, rule.backward))
        return function

    # ---------------------------------------------- fast derived operators
    def prepare_value_and_gradient(self, fn: Callable, xs: list, data: list) -> Callable:
        x64 = _wants_x64(xs, data)
        compiled = self._compiled(
            fn, "value_and_gradient", x64, lambda: jax.value_and_grad(self._traced(fn, "gradient"), has_aux=True)
        )
        # This is the hot path of training loops: when there is no x64 or device scope to
        # enter, call the compiled function directly (a context manager costs ~5 us).
        scoped = x64 or self._scoped_device

        def run(xs: list, data: list) -> tuple[Any, Any, list]:
            if scoped:
                with self._scope(x64):
                    (y, aux), grads = compiled(xs, data)
            else:
                try:
                    (y, aux), grads = compiled(xs, data)
                except _CONCRETE_ERRORS as err:
                    raise TracedControlFlowError(self._control_flow_message(err)) from err
            if aux is not None:
                aux = self._aux(fn, "gradient", xs, data, aux)
            return y, aux, grads

        return run

    def _direct(self, compiled: Callable, x64: bool) -> Callable:
        """``compiled`` called in the x64 or device scope only where there is one to enter
        (a context manager costs ~5 us on the hot path of prepared operators)."""
        if x64 or self._scoped_device:

            def scoped(*args: Any) -> Any:
                with self._scope(x64):
                    return compiled(*args)

            return scoped

        def direct(*args: Any) -> Any:
            try:
                return compiled(*args)
            except _CONCRETE_ERRORS as err:
                raise TracedControlFlowError(self._control_flow_message(err)) from err

        direct.tests_watch = True  # type: ignore[attr-defined]
        return direct

    def direct_prepared(self, prepared: Any, xs: list, data: list) -> Callable[..., Any] | None:
        # jit's C++ dispatch flattens the user's pytree, compares structure, shapes and
        # dtypes with its cache and runs the executable: no Python per call.  The body
        # (prepared.run_traced) runs only when jit traces, that is at the first call and at
        # any call whose structure, shapes or dtypes differ from those traced, where the
        # core's check raises ShapeMismatchError (an unprepared operator's prepared operator
        # plans the new inputs instead).  Static leaves are jit's static arguments, compared
        # here by the core's exact key (so -0.0 is not 0.0) before jit sees them, so that a
        # changed one never costs a trace; only as whole arguments (a static leaf inside x or
        # inside a container argument would be traced).  Not for results holding closures or
        # aux (which jit cannot return), or with a scope to enter (x64, a device).
        signature, fn = prepared.signature, prepared.fn
        offset = 1 if prepared.operator in ("hvp", "gradient_and_hvp") else 0  # arguments start after v
        n_args = fn.args_treedef.num_children
        # every argument is one leaf (not a container of one: {"w": w} has two nodes)
        whole_args = fn.args_treedef.num_leaves == n_args and fn.args_treedef.num_nodes == n_args + 1
        static_keys = sorted((i - fn.n_x_leaves + offset, key) for i, _, key in signature.static)
        static = [i for i, _ in static_keys]
        if (
            not self.compile
            or prepared.operator not in _DIRECT_OPERATORS
            or prepared.has_aux
            or (static and (not whole_args or static[0] < offset))
            or self._scoped_device
            or _wants_x64(xs, data)
        ):
            return None
        n_rest = offset + n_args
        dynamic = [i for i in range(n_rest) if i not in static]
        run_traced, checked = prepared.run_traced, prepared.check_and_run
        unchanged, refresh = prepared.unchanged, prepared.refresh

        def body(x: Any, *rest: Any) -> Any:
            return run_traced(x, *(a.value if type(a) is _Static else a for a in rest))

        jitted = jax.jit(body, static_argnums=tuple(1 + i for i in static))
        leaves = jax.tree_util.tree_leaves

        def direct(x: Any, *rest: Any) -> Any:
            # the capture watch's test first (a changed global or closure value: trace again),
            # here rather than in a wrapper of the core's, one Python frame fewer per call
            if unchanged is not None and not unchanged():
                return refresh(x, *rest)
            # jax arrays only, none float64: jit would silently cast other inputs (numpy
            # float64, or a float64 jax array, outside x64 mode becomes float32) where the
            # check must refuse them; a tracer (the prepared operator inside the user's own
            # jit) takes the checked route too, as does a changed static leaf
            if len(rest) != n_rest or not (
                (type(x) is _ARRAY and x.dtype not in _WIDE_SET and (not dynamic or all(
                    type(rest[i]) is _ARRAY and rest[i].dtype not in _WIDE_SET for i in dynamic)))
                or all(type(a) is _ARRAY and a.dtype not in _WIDE_SET for a in leaves((x, [rest[i] for i in dynamic])))
            ):
                return checked(x, *rest)
            if static:
                keys = [_static_key(rest[i]) for i in static]
                if any(key != expected for key, (_, expected) in zip(keys, static_keys)):
                    return checked(x, *rest)  # the core's check says which (or plans the new value)
                rest = list(rest)
                for i, key in zip(static, keys):
                    rest[i] = _Static(rest[i], key)
            try:
                return jitted(x, *rest)
            except _CONCRETE_ERRORS as err:
                raise TracedControlFlowError(self._control_flow_message(err)) from err

        direct.tests_watch = True  # type: ignore[attr-defined]
        return direct

    # The Jacobian-building routes (jacobian, prepare_jacobian, the Hessians) are taken only
    # without chunk_size: with it they are the core's chunks of batched (vmapped) calls.
    def prepare_jacobian(self, fn: Callable, xs: list, data: list) -> Callable[[list, list], list]:
        x64 = _wants_x64(xs, data)

        def build() -> Callable:
            traced = self._traced(fn)

            def jacobian(xs: list, data: list) -> list:
                def value(xs: list) -> Any:
                    return traced(xs, data)[0]

                # the cheaper mode, from the shapes at trace time (a new shape retraces)
                n_out = jax.eval_shape(value, xs).size
                transform = jax.jacrev if n_out <= sum(x.size for x in xs) else _jacfwd
                return transform(value)(xs)

            return jacobian

        return self._direct(self._compiled(fn, "jacobian only", x64, build), x64)

    def _reverse_where_refused(self, fn: Any, operator: str, x64: bool,
                               build: Callable[[bool], Callable]) -> Callable:
        """The compiled ``build(False)`` (forward over reverse), or where jax refuses forward mode
        through an ``ad.custom_vjp`` only once it lowers the traced call (a custom_vjp called in
        another one's fwd: ``ad.custom_root``'s), the compiled ``build(True)`` (reverse over reverse)."""
        forward = self._compiled(fn, operator, x64, lambda: build(False))

        def reverse(_: Exception, *args: Any) -> Any:
            return self._compiled(fn, f"{operator} (reverse over reverse)", x64, lambda: build(True))(*args)

        return _without_forward_rule(forward, reverse)

    def prepare_hvp(self, fn: Callable, xs: list, data: list) -> Callable[[list, list, list], list]:
        x64 = _wants_x64(xs, data)

        def build(reverse_only: bool) -> Callable:
            traced = self._traced(fn, "hvp")
            grad = jax.grad(lambda xs, data: traced(xs, data)[0])
            # forward over reverse, the tangent only: what jax's own hvp idiom computes
            return lambda xs, data, ts: _hvp(grad, xs, data, ts, reverse_only)[1]

        return self._direct(self._reverse_where_refused(fn, "hvp only", x64, build), x64)

    def jacobian(self, fn: Callable, xs: list, data: list) -> tuple[Any, list]:
        x64 = _wants_x64(xs, data)

        def build() -> Callable:
            traced = self._traced(fn)

            def jacobian(xs: list, data: list) -> tuple[Any, list]:
                def value(xs: list) -> tuple[Any, Any]:
                    y = traced(xs, data)[0]
                    return y, y

                n_out = jax.eval_shape(lambda xs: traced(xs, data)[0], xs).size
                n_in = sum(x.size for x in xs)
                transform = jax.jacrev if n_out <= n_in else _jacfwd
                jacs, y = transform(value, has_aux=True)(xs)
                return y, jacs

            return jacobian

        compiled = self._compiled(fn, "jacobian", x64, build)
        with self._scope(x64):
            y, jacs = compiled(xs, data)
        return y, list(jacs)

    # The second-order operators share two compiled functions per flat function: value,
    # gradient and Hessian blocks (hessian, its blocks, value_gradient_and_hessian) and
    # gradient and Hessian-vector product (hvp, gradient_and_hvp).  Each is one forward-
    # over-reverse pass whose primal outputs come free, so one trace serves all of them.
    def hessian(self, fn: Callable, xs: list, data: list) -> Any:
        return self.value_gradient_and_hessian(fn, xs, data)[2][0][0]

    def hessian_blocks(self, fn: Callable, xs: list, data: list) -> list[list[Any]]:
        return self.value_gradient_and_hessian(fn, xs, data)[2]

    def hvp(self, fn: Callable, xs: list, data: list, tangents: list) -> list:
        return self.gradient_and_hvp(fn, xs, data, tangents)[1]

    def value_gradient_and_hessian(self, fn: Callable, xs: list, data: list) -> tuple[Any, list, list]:
        # the value and gradient ride along as aux of jacfwd(value_and_grad): jax.hessian's route
        x64 = _wants_x64(xs, data)

        def build() -> Callable:
            traced = self._traced(fn, "hessian")

            def value_gradient_and_hessian(xs: list, data: list) -> tuple[Any, list, list]:
                def gradient(xs: list) -> tuple[list, tuple[Any, list]]:
                    y, g = jax.value_and_grad(lambda xs: traced(xs, data)[0])(xs)
                    return g, (y, g)

                h, (y, g) = _jacfwd(gradient, has_aux=True)(xs)
                return y, g, h

            return value_gradient_and_hessian

        compiled = self._compiled(fn, "hessian", x64, build)
        with self._scope(x64):
            y, g, h = compiled(list(xs), data)
        return y, list(g), [list(row) for row in h]

    def gradient_and_hvp(self, fn: Callable, xs: list, data: list, tangents: list) -> tuple[list, list]:
        # one jvp of the gradient: its primal output is the gradient
        x64 = _wants_x64(xs, data)

        def build(reverse_only: bool) -> Callable:
            traced = self._traced(fn, "hvp")
            grad = jax.grad(lambda xs, data: traced(xs, data)[0])
            return lambda xs, data, ts: _hvp(grad, xs, data, ts, reverse_only)

        compiled = self._reverse_where_refused(fn, "hvp", x64, build)
        with self._scope(x64):
            g, hv = compiled(list(xs), data, list(tangents))
        return list(g), list(hv)

    def value_derivative_and_second_derivative(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, Any]:
        # forward over forward in one compiled call: the inner jvp's primal and tangent are y and dy/dx
        x64 = _wants_x64(xs, data)

        def build() -> Callable:
            traced = self._traced(fn)

            def value_derivative_and_second(x: Any, data: list) -> tuple[Any, Any, Any]:
                one = jnp.ones_like(x)

                def value_and_derivative(x: Any) -> tuple[Any, Any]:
                    return jax.jvp(lambda x: traced([x], data)[0], (x,), (one,))

                def reverse(_: Exception) -> tuple[Any, Any, Any]:
                    # through an ad.custom_vjp (no forward rule): reverse over reverse, the rule's
                    f = lambda x: traced([x], data)[0]  # noqa: E731
                    return f(x), jax.jacrev(f)(x), jax.jacrev(jax.jacrev(f))(x)

                forward = lambda: jax.jvp(value_and_derivative, (x,), (one,))  # noqa: E731
                out = _without_forward_rule(forward, reverse)()
                if len(out) == 3:
                    return out
                (y, d), (_, d2) = out
                return y, d, d2

            return value_derivative_and_second

        compiled = self._compiled(fn, "value_derivative_and_second_derivative", x64, build)
        with self._scope(x64):
            return _forward_mode(compiled)(xs[0], data)

    def second_derivative(self, fn: Callable, xs: list, data: list) -> Any:
        return self.value_derivative_and_second_derivative(fn, xs, data)[2]

"""Custom derivatives written once for every backend: ``ad.custom_vjp``, ``ad.custom_jvp``
and ``ad.stop_gradient`` (jax's semantics), on the adapters' ``custom_rule`` hook.

A function made with :class:`custom_vjp` or :class:`custom_jvp` looks, when it is called,
at the float arrays among its arguments, finds their library through the registry
(:func:`abstractdiff._registry.backend_for`, as :func:`~abstractdiff.differentiate_with`
does) and hands that library one :class:`Rule`: the user's function and rules as functions
of the flat float leaves, with the pytrees rebuilt and every cotangent and tangent the user
returns checked here (count, structure, shape, dtype).  The adapter's
:meth:`~abstractdiff.protocol.Adapter.custom_rule` wires the rule into the library's own
mechanism (``jax.custom_vjp``, ``torch.autograd.Function``, ``tf.custom_gradient``...), so
the rule runs on the caller's arrays, on their device, under the library's ``jit``.

* Called on numpy arrays (no library claims them), the function is ``f`` itself: outside
  differentiation that is its value, and under ``finite_differences`` it is what an oracle
  must differentiate (rules are ignored there: the docs say so).
* ``stop_gradient`` under ``finite_differences`` cannot be honoured (the perturbed points
  flow through it), so it raises :class:`~abstractdiff.CustomRuleError` there; the finite
  differences adapter marks its evaluations with :func:`numerical_evaluation`.

Implicit differentiation (``custom_root``, ``custom_fixed_point``) is built on
:class:`custom_vjp` in :mod:`abstractdiff._implicit_diff`.
"""

from __future__ import annotations

import contextvars
import copy
import functools
from typing import Any, Callable, Sequence

import numpy as np

from . import _pytree as pytree
from ._arrays import dtype_name, shape_of
from ._errors import ArgumentTypeError, CustomRuleError
from ._registry import backend_for
from ._tree import _ARRAY_TYPES, BASIC_STATIC, foreign_container, is_array, is_float_dtype

__all__ = [
    "Rule", "current_backend", "current_rule", "custom_jvp", "custom_vjp", "mode_refusal", "numerical_evaluation",
    "stop_gradient",
]

#: The name of the numerical backend evaluating ``f`` now (finite differences), or None.
_NUMERICAL: contextvars.ContextVar[str | None] = contextvars.ContextVar("abstractdiff_numerical", default=None)
#: The rule whose ``fwd``, ``bwd`` or ``jvp`` runs now (for rules that call operators).
_RUNNING: contextvars.ContextVar[Any] = contextvars.ContextVar("abstractdiff_running_rule", default=None)
#: The structure of one leaf (an output that is one array), and of one positional argument that is.
_ONE_LEAF = pytree.tree_structure(0)
_ONE_ARGUMENT = pytree.tree_structure((0,))


class numerical_evaluation:
    """``with numerical_evaluation(name):`` marks what it runs as the evaluations of ``f`` by a
    numerical backend called ``name``: :func:`stop_gradient` refuses to run there."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        self.token = _NUMERICAL.set(self.name)

    def __exit__(self, *exc: Any) -> None:
        _NUMERICAL.reset(self.token)


def current_rule() -> Rule | None:
    """The :class:`Rule` whose ``fwd``/``bwd``/``jvp`` runs now (innermost), or None."""
    return _RUNNING.get()


def current_backend() -> Any:
    """The backend whose library runs a rule's ``fwd``/``bwd``/``jvp`` now, or None."""
    rule = _RUNNING.get()
    return None if rule is None else rule.backend


def _is_input(leaf: Any) -> bool:
    """A leaf the custom function differentiates: a float array (Python floats are constants)."""
    kind = type(leaf)
    if kind not in _ARRAY_TYPES:  # the array types met before, as the operators keep them
        if not is_array(leaf):
            return False
        _ARRAY_TYPES.add(kind)
    return is_float_dtype(leaf.dtype)


def _library_of(inputs: list) -> Any:
    """The backend of the library whose arrays ``inputs`` are (numpy's: None)."""
    found = None
    for a in inputs:
        if type(a) is np.ndarray or isinstance(a, np.generic):
            continue
        b = backend_for(a)
        if b is None or b is found:
            continue
        if found is not None:
            raise CustomRuleError(
                f"a custom function was called with arrays of two libraries ({found.name} and {b.name}); "
                f"convert them to one library first (ad.differentiate_with composes libraries)"
            )
        found = b
    return found


def mode_refusal(mode: str, message: str) -> CustomRuleError:
    """A rule's refusal of ``mode`` (``"reverse"``, ``"forward"``): a Jacobian takes the other
    (:attr:`~abstractdiff.CustomRuleError.mode`); adapters raise it where their library refuses."""
    err = CustomRuleError(message)
    err.mode = mode
    return err


def _refuse_unflattened(name: str, leaf: Any, k: int) -> None:
    """A container only another optree namespace knows: its arrays would be
    constants to the rule, silently, so it is refused (pass its arrays, or register it)."""
    registry = foreign_container(leaf)
    if registry is not None:
        raise CustomRuleError(
            f"{name}: argument leaf {k} is a {type(leaf).__name__} registered as a pytree node in {registry}, "
            f"which abstractdiff does not flatten, so its arrays would get no derivative through the rule; pass "
            f"its arrays as arguments, or register the class with ad.register_pytree_node"
        )


def _static_shape(a: Any) -> tuple | None:
    try:
        return shape_of(a)
    except (TypeError, ValueError):
        return None  # a symbolic shape not known statically (PyTensor): not checked


def _describe(a: Any) -> str:
    return f"{type(a).__name__} of shape {_static_shape(a)} and dtype {dtype_name(a)}" if is_array(a) else repr(a)


class Rule:
    """One call of a custom function, as an adapter's
    :meth:`~abstractdiff.protocol.Adapter.custom_rule` hook sees it (the hook's docstring is
    its contract): the function and its rules as functions of the call's float leaves, in
    order, returning tuples of the output's float leaves."""

    def __init__(self, spec: _CustomFunction, backend: Any, args: tuple, leaves: list, treedef: Any,
                 index: list[int]):
        self.spec = spec
        self.backend = backend
        self.name = spec.__name__
        self.has_vjp = spec._bwd is not None
        self.has_jvp = spec._jvp is not None
        self.stops_gradient = spec._kind == "stop_gradient"
        #: False where the adapter's library cannot take a derivative inside its backward
        #: (paddle): rules that call operators (custom_root) do that work in the forward
        self.nested_derivatives = True
        #: True where the library runs ``fwd`` only when it differentiates the function and
        #: differentiates ``fwd`` itself for a higher order (jax): there a custom function called
        #: inside its own ``fwd`` is the custom function again, one differentiation level out,
        #: as in jax; elsewhere it is ``f`` (the library would run this ``fwd`` again, forever)
        self.lazy_forward = False
        #: False where the library runs the jvp rule with its differentiation hidden (tensorflow:
        #: a tape or accumulator made inside sees nothing): rules that take derivatives in their
        #: jvp (custom_root's) refuse forward mode there
        self.derivatives_in_jvp = True
        #: True for a rule whose fwd, bwd or jvp calls the operators (ad.custom_root's): a
        #: library that cannot build that into a compiled loop's body runs the loop in Python
        self.takes_derivatives = getattr(spec, "takes_derivatives", False)
        self._args = args
        self._leaves = leaves
        self._treedef = treedef
        self._index = index
        self._flat = len(index) == len(args) and treedef.num_nodes == len(args) + 1  # a tuple of arrays
        self.forwarding = False  # while the user's fwd runs (see _CustomFunction.__call__)
        # the outputs' structure, known once the function has run (stop_gradient's: its inputs')
        self.out_treedef: Any = pytree.tree_structure((0,) * len(index)) if self.stops_gradient else None

    # ------------------------------------------------------------ the pytrees
    def _rebuild(self, values: tuple, constants: bool = True) -> tuple:
        """The positional arguments with ``values`` at the float leaves; the other leaves are
        the call's own (``constants``) or None (a tangent's: constants have none)."""
        if self._flat:  # every argument one float array: they are the values themselves
            return tuple(values)
        leaves = list(self._leaves) if constants else [None] * len(self._leaves)
        for i, a in zip(self._index, values):
            leaves[i] = a
        return pytree.tree_unflatten(self._treedef, leaves)

    def _outputs(self, out: Any, what: str) -> tuple:
        if (self.out_treedef is None or self.out_treedef is _ONE_LEAF) and _is_input(out):
            self.out_treedef = _ONE_LEAF  # the common case: one float array
            return (out,)
        leaves, treedef = pytree.tree_flatten(out)
        for leaf in leaves:
            if not _is_input(leaf):
                raise CustomRuleError(
                    f"{self.name}: {what} must return float arrays (a pytree of them), but one output leaf is "
                    f"{_describe(leaf)}; return integer or constant results from a separate function"
                )
        if not leaves:
            raise CustomRuleError(f"{self.name}: {what} returned no float array")
        if self.out_treedef is None:
            self.out_treedef = _ONE_LEAF if treedef == _ONE_LEAF else treedef
        elif treedef != self.out_treedef:
            raise CustomRuleError(
                f"{self.name}: {what} returned an output of structure {treedef}, but the function's output has "
                f"structure {self.out_treedef}: fwd's first result must be f's output"
            )
        return tuple(leaves)

    def _checked(self, given: Any, like: list, what: str, where: Callable[[int], str]) -> tuple:
        """``given`` (one value per leaf of ``like``'s pytree, None meaning zero) checked
        against ``like``, with zeros filled in; ``where(k)`` names leaf ``k`` for messages."""
        out = []
        for k, (g, a) in enumerate(zip(given, like)):
            if not _is_input(a):
                out.append(None)
                continue
            if g is None:
                out.append(self.backend.zeros_like(a))
                continue
            try:  # the common case, by the arrays' own attributes (a symbolic shape is not equal: below)
                if g.shape == a.shape and g.dtype == a.dtype:
                    out.append(g)
                    continue
            except Exception:  # noqa: S110 (an unusual array: the checks below say what is wrong)
                pass
            if not is_array(g):
                raise CustomRuleError(
                    f"{self.name}: {what} {where(k)} is {_describe(g)}, not an array; return an array shaped "
                    f"like that leaf ({_describe(a)}), or None for zero"
                )
            shape, want = _static_shape(g), _static_shape(a)
            if shape is not None and want is not None and shape != want:
                raise CustomRuleError(
                    f"{self.name}: {what} {where(k)} has shape {shape}, but that leaf has shape {want}; "
                    f"each cotangent or tangent is shaped like its primal (reduce a broadcast one with sum)"
                )
            if dtype_name(g) != dtype_name(a):
                raise CustomRuleError(
                    f"{self.name}: {what} {where(k)} has dtype {dtype_name(g)}, but that leaf has dtype "
                    f"{dtype_name(a)}; cast it (a float32 input takes a float32 cotangent)"
                )
            out.append(g)
        return tuple(out)

    # ------------------------------------------------- what the adapters call
    def value(self, *inputs: Any) -> tuple:
        """The outputs' float leaves at ``inputs``."""
        token = _RUNNING.set(self)
        try:
            return self._outputs(self.spec.fun(*self._rebuild(inputs)), "f")
        finally:
            _RUNNING.reset(token)

    def forward(self, *inputs: Any) -> tuple[tuple, Any]:
        """``(outputs, residuals)``: the user's ``fwd`` at ``inputs``."""
        token, self.forwarding = _RUNNING.set(self), True
        try:
            got = self.spec._fwd(*self._rebuild(inputs))
        finally:
            _RUNNING.reset(token)
            self.forwarding = False
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise CustomRuleError(
                f"{self.name}: fwd must return a pair (out, residuals), got {type(got).__name__}"
                + (f" of length {len(got)}" if isinstance(got, (tuple, list)) else "")
            )
        return self._outputs(got[0], "fwd"), got[1]

    def backward(self, residuals: Any, cotangents: tuple) -> tuple:
        """One cotangent per input (float leaf), from the user's ``bwd``, checked."""
        if not self.has_vjp:
            raise self.no_vjp_error()
        ct = cotangents[0] if self.out_treedef is _ONE_LEAF else pytree.tree_unflatten(self.out_treedef,
                                                                                        list(cotangents))
        token = _RUNNING.set(self)
        try:
            got = self.spec._bwd(residuals, ct)
        finally:
            _RUNNING.reset(token)
        n = len(self._args)
        if not isinstance(got, (tuple, list)):
            raise CustomRuleError(
                f"{self.name}: bwd must return a tuple with one cotangent per positional argument ({n}), got "
                f"{type(got).__name__}" + ("; write `return (ct_x,)` for one argument" if n == 1 else "")
            )
        if len(got) != n:
            raise CustomRuleError(
                f"{self.name}: bwd returned {len(got)} cotangents, but the function takes {n} positional "
                f"argument{'s' if n != 1 else ''}: return one per argument (None for an argument with none)"
            )
        flat: list = []
        for i, (g, spec) in enumerate(zip(got, self._treedef.children())):  # one spec per argument
            if spec.is_leaf():
                flat.append(g)
            elif g is None:
                flat.extend([None] * spec.num_leaves)
            else:
                try:
                    flat.extend(spec.flatten_up_to(g))
                except (ValueError, TypeError) as err:
                    raise CustomRuleError(
                        f"{self.name}: bwd's cotangent for argument {i} does not have that argument's structure "
                        f"{spec}: {err}"
                    ) from None

        def where(k: int) -> str:  # "for argument i (its leaf j)", for messages
            for i, spec in enumerate(self._treedef.children()):
                if k < spec.num_leaves:
                    return f"for argument {i}" + (f" (its leaf {k})" if spec.num_leaves > 1 else "")
                k -= spec.num_leaves
            return ""

        checked = self._checked(flat, self._leaves, "bwd's cotangent", where)
        return tuple(checked[i] for i in self._index)

    def jvp(self, primals: tuple, tangents: tuple) -> tuple[tuple, tuple]:
        """``(outputs, output tangents)`` from the user's jvp rule, checked."""
        if not self.has_jvp:
            raise self.no_jvp_error()
        token = _RUNNING.set(self)
        try:
            got = self.spec._jvp(self._rebuild(primals), self._rebuild(tangents, constants=False))
        finally:
            _RUNNING.reset(token)
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise CustomRuleError(
                f"{self.name}: the jvp rule must return a pair (out, tangent_out), got {type(got).__name__}"
            )
        out = self._outputs(got[0], "the jvp rule")
        try:
            given = self.out_treedef.flatten_up_to(got[1])
        except (ValueError, TypeError) as err:
            raise CustomRuleError(
                f"{self.name}: the jvp rule's tangent_out does not have the output's structure "
                f"{self.out_treedef}: {err}"
            ) from None
        return out, self._checked(given, list(out), "the jvp rule's tangent_out", lambda k: f"for output leaf {k}")

    # ------------------------------------------------------------ refusals
    def with_inputs(self, inputs: Sequence[Any]) -> Rule:
        """This rule for a call with ``inputs`` (one per float leaf) in place of the arguments
        it was made with: for an adapter whose library rebuilds a node on new inputs with the
        same rule (PyTensor's ``graph_replace`` of a nested operator's placeholders), so that
        what the rule makes from the call's arguments (zeros for a cotangent ``bwd`` leaves
        as None) comes from the node's inputs, not from values replaced out of the graph."""
        leaves = list(self._leaves)
        if all(leaves[i] is a for i, a in zip(self._index, inputs)):
            return self
        for i, a in zip(self._index, inputs):
            leaves[i] = a
        bound = copy.copy(self)
        bound._leaves = leaves
        return bound

    def no_vjp_error(self) -> CustomRuleError:
        return mode_refusal("reverse",
            f"{self.name} is an ad.custom_jvp function, and the {self.backend.name} backend cannot transpose a "
            f"jvp rule into reverse mode (jax alone can): give it a reverse rule with ad.custom_vjp, or use "
            f"forward mode (pushforward, jacobian of a tall function)"
        )

    def no_jvp_error(self) -> CustomRuleError:
        return mode_refusal("forward",
            f"{self.name} is an ad.custom_vjp function, which has no forward-mode rule, and the "
            f"{self.backend.name} backend was asked for forward mode through it: give it a jvp rule with "
            f"ad.custom_jvp, or use reverse mode (gradient, pullback)"
        )

    def second_order_error(self, library: str) -> CustomRuleError:
        return CustomRuleError(
            f"{self.name}: {library} cannot differentiate through a custom rule a second time (a hessian, hvp, "
            f"or SecondOrder over it); use a backend whose library nests rules (jax, torch), or give the "
            f"second derivative its own rule"
        )


class _CustomFunction:
    """What :class:`custom_vjp` and :class:`custom_jvp` share: the call, which hands the
    caller's library a :class:`Rule`."""

    _fwd: Callable[..., Any] | None = None
    _bwd: Callable[..., Any] | None = None
    _jvp: Callable[..., Any] | None = None
    _kind = ""

    def __init__(self, fun: Callable[..., Any]):
        if not callable(fun):
            raise ArgumentTypeError(f"{type(self).__name__} wraps a function, got {type(fun).__name__}")
        self.fun = fun
        functools.update_wrapper(self, fun)


    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise ArgumentTypeError(
                f"{self.__name__}: pass the arguments of an ad.{self._kind} function positionally (its rule has "
                f"one cotangent per positional argument); bind options with functools.partial first"
            )
        if self._bwd is None and self._jvp is None:
            raise CustomRuleError(
                f"{self.__name__} is an ad.{self._kind} function whose rule is not defined yet: call "
                f"{self.__name__}.{'defvjp(fwd, bwd)' if self._kind == 'custom_vjp' else 'defjvp(jvp)'} first"
            )
        if len(args) == 1 and type(args[0]) in _ARRAY_TYPES and is_float_dtype(args[0].dtype):
            # the common case, one float array: its structure is known without flattening
            leaves, treedef, index = list(args), _ONE_ARGUMENT, [0]
            inputs = leaves
            backend = None if type(args[0]) is np.ndarray else backend_for(args[0])
        else:
            leaves, treedef = pytree.tree_flatten(args)
            index = []
            for i, leaf in enumerate(leaves):
                if _is_input(leaf):
                    index.append(i)
                elif not isinstance(leaf, BASIC_STATIC):
                    _refuse_unflattened(self.__name__, leaf, i)
            inputs = [leaves[i] for i in index]
            backend = _library_of(inputs)
        if backend is None and inputs:
            from ._sparsity import Tracer, through_custom_function

            if any(isinstance(a, Tracer) for a in inputs):
                # sparsity detection (ad.Sparse) traces f: the pattern must be the rule's, which
                # may mix entries f keeps apart, so the custom function is a dense block there
                return through_custom_function(self.fun, leaves, treedef, self._kind == "stop_gradient")
        running = _RUNNING.get()
        if backend is None or (running is not None and running.forwarding and running.spec is self
                               and not running.lazy_forward):
            # numpy: f's value, and what finite differences differentiate; or called in its own fwd
            # (jax's idiom ``return f(x), residuals``), where its rule would run this fwd again
            return self.fun(*args)
        rule = Rule(self, backend, args, leaves, treedef, index)
        try:
            function = backend.custom_rule(rule)
        except (AttributeError, NotImplementedError):  # the protocol's default, or an older backend
            raise CustomRuleError(
                f"{self.__name__}: the {backend.name} backend's adapter has no custom_rule hook, so custom "
                f"derivatives cannot be used with its arrays (see the adapter guide)"
            ) from None
        outputs = function(*inputs)
        return pytree.tree_unflatten(rule.out_treedef, list(outputs))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)  # a method: self is an argument

    def __abstractdiff_captures__(self) -> tuple:
        """The user's functions this function calls (``fun`` and its rules): a backend that
        reuses traces keys its traces on what they read from globals and closures, as it keys
        ``f``'s (the protocol of :mod:`abstractdiff._captures`)."""
        return (self.fun, self._fwd, self._bwd, self._jvp)


class custom_vjp(_CustomFunction):
    """``g = ad.custom_vjp(f)``, then ``g.defvjp(fwd, bwd)``: ``f`` with a reverse-mode rule
    that every backend uses (jax's semantics).

    * ``fwd(*args) -> (out, residuals)``: ``out`` is ``f(*args)``; ``residuals`` any pytree.
    * ``bwd(residuals, ct) -> tuple``: one cotangent per positional argument of ``f``, each
      a pytree shaped like its argument (``None`` for zero), in the caller's array library.

    ``g(*args)`` can be called inside any function any backend differentiates, explicit
    or implicit, prepared or compiled: the gradient, pullback and reverse Jacobian are the
    rule's.  Forward mode has no rule (use :class:`custom_jvp`): it raises
    :class:`~abstractdiff.CustomRuleError`, except on a library whose forward mode is
    built from reverse mode (tensorflow, paddle, PyTensor), where it is the rule's too.
    Second derivatives differentiate ``bwd`` (write it in differentiable operations).
    Outside differentiation ``g(*args)`` is ``f(*args)``, and ``finite_differences``
    differentiates ``f`` itself: an oracle ignores rules.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> @ad.custom_vjp
        ... def clip_gradient(x):
        ...     return x
        >>> clip_gradient.defvjp(lambda x: (x, None), lambda _, ct: (ct.clip(-1, 1),))
        >>> clip_gradient(np.ones(2))
        array([1., 1.])
    """

    _kind = "custom_vjp"

    def defvjp(self, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
        """Give the rule: ``fwd(*args) -> (out, residuals)``, ``bwd(residuals, ct) -> tuple``."""
        for name, rule in (("fwd", fwd), ("bwd", bwd)):
            if not callable(rule):
                raise ArgumentTypeError(f"{self.__name__}.defvjp: {name} must be callable, got {type(rule).__name__}")
        self._fwd, self._bwd = fwd, bwd



class custom_jvp(_CustomFunction):
    """``g = ad.custom_jvp(f)``, then ``g.defjvp(jvp)``: ``f`` with a forward-mode rule
    (jax's semantics); ``defjvp`` works as a decorator.

    * ``jvp(primals, tangents) -> (out, tangent_out)``: ``primals`` and ``tangents`` are
      tuples like ``f``'s positional arguments; ``tangent_out`` is shaped like ``out``.

    Forward mode uses the rule on every backend with forward mode.  Reverse mode uses it
    on jax, which transposes the (linear) rule; elsewhere reverse mode raises
    :class:`~abstractdiff.CustomRuleError` saying to use :class:`custom_vjp`: never
    ``f``'s own derivative.  On numpy arrays ``g`` is ``f``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> @ad.custom_jvp
        ... def softplus(x):
        ...     return np.logaddexp(x, 0.0)
        >>> @softplus.defjvp
        ... def _(primals, tangents):
        ...     (x,), (t,) = primals, tangents
        ...     return softplus(x), t / (1 + np.exp(-x))
        >>> float(softplus(np.float64(0.0)))
        0.6931471805599453
    """

    _kind = "custom_jvp"

    def defjvp(self, jvp: Callable[..., Any]) -> Callable[..., Any]:
        """Give the rule ``jvp(primals, tangents) -> (out, tangent_out)``; returns ``jvp``."""
        if not callable(jvp):
            raise ArgumentTypeError(f"{self.__name__}.defjvp: jvp must be callable, got {type(jvp).__name__}")
        self._jvp = jvp
        return jvp



# ----------------------------------------------------------------- stop_gradient
class _Stopped(_CustomFunction):
    """``ad.stop_gradient``'s rule: the identity of its inputs, with zero cotangents and zero
    tangents (``Rule.stops_gradient``: an adapter may use the library's own operation)."""

    _kind = "stop_gradient"

    def __init__(self) -> None:
        super().__init__(lambda *inputs: inputs)
        self.__name__ = "stop_gradient"
        self._fwd = lambda *inputs: (inputs, None)
        self._bwd = lambda _, cts: (None,) * len(cts)
        self._jvp = lambda primals, tangents: (primals, (None,) * len(primals))



_STOPPED = _Stopped()


def stop_gradient(x: Any) -> Any:
    """``x``'s value with no derivative: ``ad.stop_gradient(x) -> x``, on a pytree.

    Inside any operator of any exact backend, first and second order, forward and
    reverse, the derivative through it is zero (the library's own ``stop_gradient``,
    ``detach``...).  Outside differentiation it returns ``x``.  Under
    ``finite_differences`` it raises :class:`~abstractdiff.CustomRuleError`: the
    perturbed points flow through it, so it cannot be honoured.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> ad.stop_gradient({"w": np.ones(2)})["w"]
        array([1., 1.])
    """
    leaves, treedef = pytree.tree_flatten(x)
    index = [i for i, a in enumerate(leaves) if _is_input(a) or isinstance(a, float)]
    numerical = _NUMERICAL.get()
    if numerical is not None and index:
        raise CustomRuleError(
            f"ad.stop_gradient cannot work under the {numerical} backend: it differentiates numerically, so the "
            f"perturbed points flow through stop_gradient and the derivative would silently count the stopped "
            f"path; use an exact AD backend, or compute the stopped value outside f and pass it in as an argument"
        )
    index = [i for i in index if not isinstance(leaves[i], float)]
    if not index or _library_of([leaves[i] for i in index]) is None:
        return x  # numpy, outside differentiation
    stopped = _STOPPED(*[leaves[i] for i in index])
    for i, a in zip(index, stopped):
        leaves[i] = a
    return pytree.tree_unflatten(treedef, leaves)

"""A whole training step as one compiled call of the library (``ad.train_step`` on jax,
tensorflow, and MLX with ``compile=True``).

The op-by-op step compiles only the gradient; the optimiser's update then runs in Python,
one library call per operation and leaf.  Here the backend's ``compiler`` hook (an
adapter's instance attribute: ``jax.jit``, ``tf.function``, ``mx.compile``) compiles the
whole step: the gradient, the rule (clipping, scheduled hyperparameters), the new
parameters and state, and the finite check's total.  The arithmetic is the rule's own
(:func:`abstractdiff.optim._state._apply`, traced), so the values are the op-by-op step's:
to 1e-12 in float64; in float32 the rule's scalar arithmetic (Adam's ``1 - b2**t``) is
traced in float32 where the op-by-op step uses Python floats.  Only one small array comes
back to Python per step: the finite total (the ``NonFiniteError`` check, made before
anything is returned or assigned) and the state's Python-int leaves (Adam's step count),
which stay Python ints in the returned ``OptState``.  That array, still on the device, is
the next step's input for those ints where the next state's ints are the ones it holds
(a state from elsewhere sends its own ints).

What the compiled step is keyed on (a step of another form traces again):

* the loss function by identity, and what it reads from globals and closures
  (:class:`abstractdiff._captures.CaptureWatch`, as every compiled trace);
* the structures of the model, the state and the batch, and their leaves that are not
  arrays, exactly (:func:`abstractdiff._cache.value_key`); the arrays' shapes and dtypes
  are the library's own cache key;
* the rule, field by field exactly, a schedule by its slot: its value at each step is
  computed in Python (and checked, as the op-by-op step checks it) and goes in as a
  traced input, so a schedule never costs a trace;
* the frozen paths; in implicit mode, the variables by identity.

Every step of a form is compiled, its first included: whether a step compiled must not
depend on what ran before it (a resumed run repeats an uninterrupted one bit for bit).

A step compiles only where its form allows it: array leaves of one float dtype (the
dtype the scheduled values and the state's step counts are traced in), no Python-float
parameters, Python-int state leaves exactly representable in that dtype; in implicit
mode, variables the library's compiled function can assign (``tf.Variable``, Keras 3
variables on tensorflow).  Any other form, and any form whose trace fails (a custom rule
that calls ``float()`` on an array), runs op by op, with the same values: the trace's
failure is remembered for that form, and the op-by-op step raises whatever error the
step itself has.
"""

from __future__ import annotations

import copy
import threading
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np
import optree

from . import optim
from ._atomic import HeldInterrupts, untrained_state
from .core import (
    LRU,
    CaptureWatch,
    InvalidArgumentError,
    WeakLRU,
    function_identity,
    is_array,
    model_variables,
    pytree,
    value_key,
    weak_callable,
)
from .optim._rules import Chain, Rule
from .optim._state import _check_set_up_for, _weak

__all__ = ["CompileFallbackWarning", "compiled_train_step"]


class CompileFallbackWarning(UserWarning):
    """A training step that could not be compiled as a whole runs op by op (same values, slower)."""


class NumpyRandomnessError(InvalidArgumentError):
    """The loss drew from numpy's global random state while the step was traced: raised to
    the user, never turned into the op-by-op fallback (which would hide why)."""


def _numpy_random_position() -> tuple:
    """Where numpy's global generator (``np.random.normal`` & co.) stands: it moves with
    every draw (the Mersenne Twister's position, key and cached Gaussian)."""
    state = np.random.get_state(legacy=False)
    inner = state["state"]
    return inner["pos"], inner["key"].tobytes(), state["has_gauss"], state["gauss"]


_RANDOM_MESSAGE = (
    "train_step: the loss drew from numpy's global random state (np.random.*) while the step was compiled, so "
    "every step would reuse the numbers drawn once at the trace; pass randomness in with the batch (draw it "
    "outside the loss, per step, from np.random.default_rng(seed)), or train with the backend's compile=False"
)


def _traced_value_and_gradient(b: Any, loss: Callable[..., Any], wrt: Any, batch: Any) -> Any:
    """``b.value_and_gradient`` while the step is traced, refusing a loss that draws from
    numpy's global random state: a compiled step runs the loss once, at the trace, so those
    numbers would be drawn once and reused by every later step (the op-by-op step draws anew)."""
    before = _numpy_random_position()
    out = b.value_and_gradient(loss, wrt, *batch)
    if _numpy_random_position() != before:
        raise NumpyRandomnessError(_RANDOM_MESSAGE)
    return out


#: compiled steps kept, least recently used out first (each holds a library executable)
CACHE_SIZE = 16

_DYNAMIC, _SCALAR, _STATIC = 0, 1, 2
_FAILED = object()  # a form whose trace failed: op by op from then on
_RANDOM = object()  # a form whose loss draws from numpy's global random state: refused from then on
#: the leaves that are not arrays a compiled step keys exactly (any other object: op by op)
_PLAIN = (type(None), bool, int, str, bytes)


# ----------------------------------------------------------------- the rule's form
def _scheduled_slots(rule: Rule, path: tuple = ()) -> list[tuple[tuple, str]]:
    """Where the rule tree has a schedule: ``(path of chain indices, field name)``."""
    if isinstance(rule, Chain):
        return [s for i, r in enumerate(rule.rules) for s in _scheduled_slots(r, (*path, i))]
    return [(path, n) for n in rule.schedulable if callable(getattr(rule, n, None))]


def _rule_key(rule: Rule, alive: list[Any]) -> Any:
    """The rule exactly, field by field, with each schedule as a slot (its values are inputs)."""
    if isinstance(rule, Chain):
        return (Chain, tuple(_rule_key(r, alive) for r in rule.rules))
    fields = dict(vars(rule)) if hasattr(rule, "__dict__") else {}
    scheduled = {n for n in rule.schedulable if callable(fields.get(n))}
    items = sorted(fields.items())
    return (type(rule), tuple((n, "scheduled" if n in scheduled else value_key(v, alive)) for n, v in items))


def _rule_at(rule: Rule, slots: list[tuple[tuple, str]], values: list[Any]) -> Rule:
    """``rule`` (already ``.at(step)``: schedules as numbers) with the scheduled fields set
    to ``values`` (traced).  The numbers were checked by ``.at``; a traced value cannot be
    checked again, so the fields are set as the constructor would have stored them."""
    if not slots:
        return rule

    def replaced(r: Rule, path: tuple) -> Rule:
        if isinstance(r, Chain):
            return Chain(tuple(replaced(sub, (*path, i)) for i, sub in enumerate(r.rules)))
        mine = [(n, v) for (p, n), v in zip(slots, values) if p == path]
        if not mine:
            return r
        new = copy.copy(r)
        for n, v in mine:
            object.__setattr__(new, n, v)
        return new

    return replaced(rule, ())


def _scheduled_values(rule_at: Rule, slots: list[tuple[tuple, str]]) -> list[float]:
    def find(r: Rule, path: tuple) -> Rule:
        for i in path:
            r = r.rules[i]  # type: ignore[attr-defined]
        return r

    return [getattr(find(rule_at, p), n) for p, n in slots]


# ----------------------------------------------------------------- leaves
def _classify(leaves: list[Any], native: Callable[[Any], bool], scalars: bool) -> list[int] | None:
    """Each leaf's kind: a native array (traced), a Python int (``scalars``: traced as a
    0-d array of the step's dtype), None, a bool, an int or a string (static, in the key).
    None where a leaf cannot go into a compiled step (a Python float parameter, a numpy or
    foreign array, a variable: the op-by-op step converts or refuses it)."""
    kinds = []
    for a in leaves:
        kind = type(a)
        if kind is int and scalars:
            kinds.append(_SCALAR)
        elif kind in _PLAIN:
            kinds.append(_STATIC)
        elif is_array(a) and native(a):
            kinds.append(_DYNAMIC)
        else:  # a Python float parameter, a foreign array, a variable, any other object
            return None
    return kinds


def _fill(leaves: list[Any], kinds: list[int], dynamic: list[Any], scalars: list[Any]) -> list[Any]:
    """The leaves with their traced values in place."""
    d, s = iter(dynamic), iter(scalars)
    return [next(d) if k == _DYNAMIC else next(s) if k == _SCALAR else a for a, k in zip(leaves, kinds)]


def _float_dtype(arrays: list[Any]) -> str | None:
    import autoray as ar

    names = {ar.get_dtype_name(a) for a in arrays}
    floats = {n for n in names if n.startswith(("float", "bfloat"))}
    return floats.pop() if len(floats) == 1 else None


#: the dtypes a step compiles in, with the integers each represents exactly
_EXACT_BELOW = {"float64": 2**53, "float32": 2**24}


class _Step(NamedTuple):
    run: Any  # the library's compiled step, or _FAILED, or _RANDOM
    watch: CaptureWatch
    alive: list  # the objects the key names by identity, held while the entry lives
    refs: list  # weak references to the loss and the variables, which the key names by id


#: the step of a form the library's compiler declined (implicit mode on jax): op by op, silently
_DECLINED = _Step(_FAILED, None, [], [])  # type: ignore[arg-type]


class _Plan:
    """One form of step, recognised on the next calls by a few identity and structure tests
    (the hot path): the rule, frozen paths and set-up variables by identity (all immutable,
    kept by every step's state; a state set up for other variables meets the plan-time
    check of :func:`_check_set_up_for`), the structure of ``(model, state, batch)``, each
    leaf's type, the static leaves' values and the arrays' dtypes.  A miss builds the plan
    again from the exact key (:func:`_plan`), which finds the compiled step of an equal form
    (a new but equal rule) in :data:`STEPS`.

    Leaf positions (``*_at``) index the leaves of the whole ``(model, state, batch)``."""

    __slots__ = ("rule", "frozen", "variables", "whole_def", "dicts", "types", "static_at", "static_values",
                 "dtype_at", "dtypes", "params", "m_def", "s_def", "m_kinds", "s_kinds", "n_m", "n_s", "m_at", "s_at",
                 "b_at", "scalar_at", "all_dynamic", "slots", "dtype", "key", "step", "call", "last", "others")

    def leaves_of(self, whole: tuple) -> list | None:
        """The leaves of ``whole`` where it has this plan's structure exactly, else None.  The
        structure's own flatten (up to its leaves: ~6x faster than a flatten, which looks up
        every leaf's type) checks each node's type, arity, keys and custom data, but takes an
        OrderedDict or a defaultdict for a dict (a plan whose dicts cannot be reached by
        path takes the full flatten, ``dicts`` None)."""
        if self.dicts is None:
            return None
        try:
            leaves = self.whole_def.flatten_up_to(whole)
        except Exception:  # noqa: BLE001 - another structure (a flatten that raises says so again in the full flatten)
            return None
        return leaves if self.dicts_match(whole) else None

    def dicts_match(self, whole: tuple) -> bool:
        """Whether the dicts of ``whole`` (of this plan's structure) are plain dicts with their
        keys in this plan's order: the structure's equality and flatten ignore the order, and
        the compiled step gives back its plan's (the op-by-op step gives back the caller's)."""
        for path, keys in self.dicts or ():
            node = whole
            for k in path:
                node = node[k]
            if type(node) is not dict or tuple(node) != keys:
                return False
        return True

    def matches(self, state: optim.OptState, leaves: list, params: list) -> bool:
        """Whether leaves of this plan's structure, and ``state``'s rule, are this plan's form."""
        return (
            state.rule is self.rule and state.frozen is self.frozen and state.variables is self.variables
            and tuple(map(type, leaves)) == self.types
            and [leaves[i] for i in self.static_at] == self.static_values
            and [leaves[i].dtype for i in self.dtype_at] == self.dtypes
            and len(params) == len(self.params) and all(p is q for p, q in zip(params, self.params))
        )


def _dict_paths(spec: Any) -> list[tuple[tuple, tuple]] | None:
    """The paths (keys and indices from the root) of the structure's dict nodes, each with the
    dict's keys in their order, or None where :meth:`_Plan.leaves_of` cannot tell its
    containers exactly: an OrderedDict, a defaultdict or a deque (whose flattens up to a
    structure take other kinds or lengths), or a dict inside a registered node (no path to it)."""
    kind = spec.kind
    if kind in _LOOSE_KINDS:
        return None
    paths: list[tuple[tuple, tuple]] = []
    if kind == optree.PyTreeKind.DICT:  # its keys in their order: the structure's unflatten keeps it
        paths.append(((), tuple(optree.tree_unflatten(spec, [None] * spec.num_leaves))))
    keys = spec.entries() if kind == optree.PyTreeKind.DICT else range(spec.num_children)
    for key, child in zip(keys, spec.children()):
        below = _dict_paths(child)
        if below is None or (below and kind == optree.PyTreeKind.CUSTOM):
            return None
        paths += [((key, *p), keys) for p, keys in below]
    return paths


_LOOSE_KINDS = frozenset(getattr(optree.PyTreeKind, n) for n in ("ORDEREDDICT", "DEFAULTDICT", "DEQUE", "FROZENDICT")
                         if hasattr(optree.PyTreeKind, n))


_PLANS_KEPT = 4  # forms per loss function and backend (a last, smaller batch is a second form)


class _Steps:
    """The compiled steps by their exact key (an LRU of :data:`CACHE_SIZE`), and the plans
    that reach them, per loss function (held weakly) and backend."""

    def __init__(self) -> None:
        self._entries: LRU[Any, _Step] = LRU(
            CACHE_SIZE, name="compiled training steps",
            keyed_on="backend, loss function, rule, model and batch structure, shapes and dtypes, captured values",
        )
        # the forms of steps seen per loss; ``_last`` is a look-ahead of it, checked by identity
        self._plans: WeakLRU[list] = WeakLRU(
            CACHE_SIZE, name="training step forms",
            keyed_on=f"loss function (and model, implicit mode), backend; {_PLANS_KEPT} forms each",
            hold_unreferenceable=True,
        )
        self._last: tuple = ((), None, None, None)  # the last plans looked up (a loop's step)
        self._held: Any = None  # the last step's inputs, let go at the next dispatch (hold)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._plans.clear()
        self._last = ((), None, None, None)
        self._held = None

    def hold(self, leaves: list, *others: Any) -> None:
        """Keeps a step's model and state leaves (and ``others``) until the next compiled step
        has dispatched, where they are small (under :data:`_HOLD_ELEMENTS` elements in all),
        and lets go of the last step's.  The caller drops a step's inputs when it rebinds its
        model and state to the step's results, that is in the Python between one step's
        result and the next dispatch, where each library array freed costs about a
        microsecond (jax) and a small step's time is that Python's.  Let go of here, while
        the library computes, they are freed where a native loop frees them (it rebinds right
        after its dispatch).  A large model is not held: a second copy of it would be."""
        total = 0
        for a in leaves:
            if type(a) in _PLAIN:
                continue
            size = getattr(a, "size", None)
            if type(size) is not int:  # a library's array without an element count: not held
                total = _HOLD_ELEMENTS
                break
            total += size
        self._held = (leaves, others) if total < _HOLD_ELEMENTS else None

    def get(self, key: Any, loss_fn: Callable[..., Any]) -> _Step | None:
        entry = self._entries.get(key)
        if entry is not None and entry.run is not _FAILED and not entry.watch.unchanged(loss_fn):
            return None  # a value the loss reads changed: trace again
        return entry

    def put(self, key: Any, entry: _Step) -> None:
        self._entries.put(key, entry)

    def weak(self, key: Any, objects: list) -> list:
        """Weak references to the objects ``key`` names by ``id``: the entry goes when one dies
        (its id may then be reused), and holding them would keep a model alive."""
        entries = self._entries
        drop = lambda _ref: entries.pop(key, None)  # noqa: E731
        refs = []
        for o in objects:
            try:
                refs.append(weakref.ref(o, drop))
            except TypeError:  # held strongly: its id cannot be reused while the entry holds it
                refs.append(o)
        return refs

    def plans(self, loss_fn: Callable[..., Any], model: Any, lib: Any, implicit: bool) -> list:
        """The plans of this loss (and model, in implicit mode) on this backend, most recent first."""
        objects = (*function_identity(loss_fn), *((model,) if implicit else ()))
        last_refs, last_lib, last_implicit, plans = self._last  # held weakly
        if (last_lib is lib and last_implicit is implicit and len(last_refs) == len(objects)
                and all(r() is o for r, o in zip(last_refs, objects))):
            return plans
        plans = self._plans.get_or_put(objects, list, (lib, implicit))
        try:
            self._last = ([weakref.ref(o) for o in objects], lib, implicit, plans)
        except TypeError:  # not weakly referenceable: looked up each time
            self._last = ((), None, None, None)
        return plans


#: the elements of a step's model and state held until the next dispatch at most (1 MiB in float64)
_HOLD_ELEMENTS = 1 << 17
STEPS = _Steps()
_flatten_known = optree.tree_flatten


def _variables(model: Any) -> list:
    """The variables an implicit step trains, for recognising its plan: a library's model's
    trainable variables as its library lists them (a plan made from them checked them as
    ``ad.Params`` does; any other list misses the plan, which then takes ``ad.Params``)."""
    found = None if optim._is_params(model) else model_variables(model)
    return list(found[0]) if found is not None else list(optim.params_of(model))


#: serialises the reordering of a loss's plans: threads training with one loss (two batch
#: shapes) would otherwise remove the same plan twice (ValueError: list.remove(x))
_PLANS_LOCK = threading.Lock()


def _to_front(plans: list, plan: _Plan, drop: bool = False) -> None:
    """``plan`` first in ``plans`` (or out of it, ``drop``), at most :data:`_PLANS_KEPT` kept."""
    with _PLANS_LOCK:
        if plan in plans:
            plans.remove(plan)
        if not drop:
            plans.insert(0, plan)
            del plans[_PLANS_KEPT:]


def _compiler(b: Any) -> Callable[..., Any] | None:
    return getattr(b, "compiler", None)


def compiled_train_step(
    b: Any, loss_fn: Callable[..., Any], model: Any, batch: tuple, state: optim.OptState,
    non_finite: Callable[[], Exception], bound: Callable[..., Any] | None = None,
    commit: Callable[[optim.OptState, Any], None] | None = None,
) -> Any:
    """The step ``ad.train_step`` takes, as one compiled call: ``(state, model, loss)``, or
    None where this backend or this step's form does not compile (the caller then takes
    the op-by-op step).  ``non_finite()`` is the
    error raised when the loss, a gradient or a new value is not finite (nothing is returned
    or assigned).  Implicit mode: ``b`` is the ``ad.Implicit`` backend, ``bound`` the loss
    bound to the model, ``commit(state, model)`` (optional) receives the new pair before
    an interrupt held during the step is delivered; a step that raises assigns nothing."""
    implicit = bound is not None
    lib = b.inner if implicit else b
    compiler = _compiler(lib)
    if compiler is None:
        return None
    # the hot path: everything the step reads, flattened once (a container type not yet
    # discovered misses the plan, whose flatten discovers it)
    if implicit:
        params, whole = _variables(model), (state.tree, batch)
    else:
        params, whole = [], (model, state.tree, batch)
    plans = STEPS.plans(loss_fn, model, lib, implicit)
    # a loop's step is the last plan's form: recognised by its structure's own flatten
    recent = plans[:1]  # (one operation: another thread may be reordering the list)
    plan = recent[0] if recent else None
    leaves = plan.leaves_of(whole) if plan is not None else None
    if leaves is None or not plan.matches(state, leaves, params):
        leaves, whole_def = _flatten_known(whole, none_is_leaf=True, namespace=pytree.NAMESPACE)
        plan = next((p for p in plans if p.whole_def == whole_def and p.dicts_match(whole)
                     and p.matches(state, leaves, params)), None)
    if plan is None or (plan.step.run is not _FAILED and not plan.step.watch.unchanged(loss_fn)):
        if plan is not None:  # a value the loss reads changed: plan (and trace) again
            _to_front(plans, plan, drop=True)
        params = list(optim.params_of(model)) if implicit else []  # checked, as op by op
        leaves, whole_def = pytree.tree_flatten(whole, none_is_leaf=True)  # discovers container types
        plan = _plan(b, lib, compiler, loss_fn, bound, model, params, state, batch, whole_def)
        if plan is None:
            return None
        _to_front(plans, plan)
    elif plans[0] is not plan:
        _to_front(plans, plan)
    if plan.step.run is _FAILED:
        return None
    if plan.step.run is _RANDOM:  # (the library may keep the loss's trace: it would not draw again)
        raise NumpyRandomnessError(_RANDOM_MESSAGE)
    ints = [leaves[i] for i in plan.scalar_at]
    if ints and max(map(abs, ints)) >= _EXACT_BELOW[plan.dtype]:
        return None
    # the numbers, each group in one array of the step's dtype: the state's Python ints,
    # after a slot for the finite total, and the scheduled values.  The ints are most often
    # those the last step of this plan reported, whose report is still on the device: it
    # goes in as it is (moving a numpy array to the device costs more than the step's
    # arithmetic on a small model)
    numbers = []
    if ints:
        last = plan.last
        numbers.append(last[1] if last is not None and last[0] == ints else np.asarray([0, *ints], dtype=plan.dtype))
    if plan.slots:
        hyper = _scheduled_values(state.rule.at(state.step), plan.slots)  # checked, as op by op
        numbers.append(np.asarray(hyper, dtype=plan.dtype))
    args = ([leaves[i] for i in plan.m_at], [leaves[i] for i in plan.s_at], [leaves[i] for i in plan.b_at], *numbers)
    if not implicit:  # nothing is assigned: an exception anywhere leaves the caller's pair as it was
        return _finish(plan, lib, state, model, leaves, ints, non_finite, args, None, None)
    # implicit mode: the call assigns the parameters and whatever the forward pass writes
    # (Keras's non-trainable variables).  SIGINT is held off from the call to the hand-over
    # (the library's call cannot be interrupted anyway: Python runs signal handlers between
    # its bytecodes); the call also returns every variable's value from before it, so a step
    # that fails after it (NonFiniteError: the buffers; an interrupt with nobody taking the
    # new state: everything) is undone without copying anything on the steps that succeed
    with HeldInterrupts() as held:
        done = _finish(plan, lib, state, model, leaves, ints, non_finite, args, held, commit)
    held.deliver()
    return done


def _finish(plan: _Plan, lib: Any, state: optim.OptState, model: Any, leaves: list, ints: list,
            non_finite: Callable[[], Exception], args: tuple, held: HeldInterrupts | None,
            commit: Callable[[optim.OptState, Any], None] | None) -> Any:
    """The compiled call and what follows it: ``(state, model, loss)``, or None where the
    form does not compile after all (op by op from now on).  ``held``: implicit mode, run
    with interrupts held off (see :func:`compiled_train_step`)."""
    implicit = held is not None
    try:
        loss, on_device, new_m, new_s, *olds = plan.call(*args)
    except NumpyRandomnessError:
        # the user's to fix (the op-by-op fallback would hide it), refused at every call of this form
        refused = plan.step._replace(run=_RANDOM)
        STEPS.put(plan.key, refused)
        plan.step = refused
        raise
    except Exception as err:  # noqa: BLE001 - a form the library cannot trace: op by op from now on
        failed = plan.step._replace(run=_FAILED)
        STEPS.put(plan.key, failed)
        plan.step = failed
        first = (str(err).strip().splitlines() or [""])[0][:200]
        warnings.warn(
            f"ad.train_step runs this step op by op on {lib!r}: compiling the whole step failed "
            f"({type(err).__name__}: {first}). The values are the same, the step is slower; a loss or "
            f"rule that needs a concrete number (float() or an `if` on an array) cannot be compiled",
            CompileFallbackWarning, stacklevel=4,
        )
        return None
    olds = olds[0] if olds else []
    # what needs no number from the device is done while the library computes (a thread
    # that waits from the moment it dispatched is woken later than one that was busy, and
    # the Python between this step's result and the next dispatch is what a small step costs):
    # the last step's inputs let go (see _Steps.hold), the new model
    n_m = plan.n_m
    STEPS.hold(leaves[:n_m + plan.n_s], loss, plan.last)
    if implicit:
        new_model = model
    else:
        new_leaves = new_m if plan.all_dynamic else _fill(leaves[:n_m], plan.m_kinds, new_m, [])
        new_model = pytree.tree_unflatten(plan.m_def, new_leaves)
    # and the new state with the counts the report most often holds (each one more than it
    # was: Adam's t), built again below where the report holds others
    s_leaves = leaves[n_m:n_m + plan.n_s]

    def new_tree(counts: list[int]) -> Any:
        return pytree.tree_unflatten(plan.s_def, _fill(s_leaves, plan.s_kinds, new_s, counts))

    counts = [i + 1 for i in ints]
    new_state = state._replace(step=state.step + 1, tree=new_tree(counts), implicit=implicit)
    report = lib.to_numpy(on_device).tolist()  # the one synchronisation
    if not report[0] == 0:
        if implicit:  # the parameters were not assigned (see _body), the other variables were
            _write_back(plan.others, olds[len(plan.params):])
        raise non_finite()
    if report[1:] != counts:  # exact: integers below _EXACT_BELOW
        counts = [int(c) for c in report[1:]]
        new_state = new_state._replace(tree=new_tree(counts))
    plan.last = (counts, on_device) if ints else None
    if implicit:
        try:
            if commit is not None:
                commit(new_state, model)
            elif held.pending:  # interrupted, and nobody holds the new state: nothing applied
                _write_back([*plan.params, *plan.others], olds)
        except BaseException:
            _write_back([*plan.params, *plan.others], olds)
            raise
    return new_state, new_model, loss


def _write_back(variables: list, values: list) -> None:
    for v, value in zip(variables, values):
        optim.write(v, value)


def _plan(b: Any, lib: Any, compiler: Callable, loss_fn: Callable[..., Any], bound: Any, model: Any,
          params: list, state: optim.OptState, batch: tuple, whole_def: Any) -> _Plan | None:
    """The plan of this form, or None where the form does not compile (see the module
    docstring), with its compiled step: that of an equal form compiled before, else a new
    one (traced at its first call).  ``whole_def``: the structure of the hot path's one
    flatten (container types discovered)."""
    implicit = bound is not None
    # each part flattened on its own: the body rebuilds each
    m_leaves, m_def = ([], None) if implicit else _flatten_known(model, none_is_leaf=True, namespace=pytree.NAMESPACE)
    s_leaves, s_def = _flatten_known(state.tree, none_is_leaf=True, namespace=pytree.NAMESPACE)
    b_leaves, b_def = _flatten_known(batch, none_is_leaf=True, namespace=pytree.NAMESPACE)
    leaves = [*m_leaves, *s_leaves, *b_leaves]
    if implicit:
        # only the library's own variables: the compiled step assigns them (an ad.Variable
        # box would be given a traced value)
        if not params or not all(lib.is_variable(v) for v in params) or len(params) != len(state.tree):
            return None  # (a wrong number of variables: the op-by-op step says what is wrong)
        _check_set_up_for(state, params)

        others = untrained_state(model, params)  # what the forward pass may write (kept to undo a failed step)
        m_kinds: list[int] | None = []
        floats = [optim.read(v) for v in params]
    else:
        s_out = _state_after(model, state.tree)
        if s_out != s_def:
            return None
        others = []
        m_kinds = _classify(m_leaves, lib.is_native, scalars=False)
        floats = [a for a, k in zip(m_leaves, m_kinds or ()) if k == _DYNAMIC]
    s_kinds = _classify(s_leaves, lib.is_native, scalars=True)
    b_kinds = _classify(b_leaves, lambda a: True, scalars=False)
    if m_kinds is None or s_kinds is None or b_kinds is None:
        return None
    dtype = _float_dtype(floats)
    if dtype not in _EXACT_BELOW:
        return None
    kinds = [*m_kinds, *s_kinds, *b_kinds]
    slots = _scheduled_slots(state.rule)
    alive: list[Any] = []
    identity = function_identity(loss_fn)  # a bound method: its function and object (new per access)
    key = (
        lib, tuple(map(id, identity)), implicit, dtype, whole_def, tuple(kinds),
        tuple(value_key(a, alive) for a, k in zip(leaves, kinds) if k == _STATIC),
        _rule_key(state.rule, alive), state.frozen.paths, tuple(map(id, params)),
    )
    step = STEPS.get(key, loss_fn)
    if step is not None and not all((r() if isinstance(r, weakref.ref) else r) is o
                                    for r, o in zip(step.refs, [*identity, *params])):
        step = None
    rule_at = state.rule.at(state.step)
    # what the trace needs of this call's leaves: the static ones (holding the arrays would
    # keep a copy of the model, its optimiser state and a batch alive with the plan)
    m_leaves, s_leaves, b_leaves = (
        [a if k == _STATIC else None for a, k in zip(part, kinds_of)]
        for part, kinds_of in ((m_leaves, m_kinds), (s_leaves, s_kinds), (b_leaves, b_kinds)))

    if step is None:
        shell = state._replace(tree=None, implicit=False)  # the rule, frozen paths and variables, not the arrays
        body = _body(b, loss_fn, bound, model if implicit else None, m_leaves, m_def, m_kinds, s_leaves, s_def,
                     s_kinds, b_leaves, b_def, b_kinds, shell, rule_at, slots, dtype, others)
        run = compiler(body, implicit)
        if run is None:
            step = _DECLINED
        else:
            step = _Step(run, CaptureWatch(loss_fn), [state.rule, *alive], STEPS.weak(key, [*identity, *params]))
            STEPS.put(key, step)
    n_m, n_s = len(m_leaves), len(s_leaves)
    plan = _Plan()
    plan.rule, plan.frozen, plan.variables, plan.whole_def, plan.key, plan.step = (
        state.rule, state.frozen, state.variables, whole_def, key, step)
    plan.types = tuple(map(type, leaves))
    plan.static_at = [i for i, k in enumerate(kinds) if k == _STATIC]
    plan.static_values = [leaves[i] for i in plan.static_at]
    # every array's dtype: the step's dtype comes from the model's, and the call may be the
    # compiler's for these dtypes (jax: inside its x64 scope or not, decided once)
    plan.dtype_at = [i for i, k in enumerate(kinds) if k == _DYNAMIC]
    plan.dtypes = [leaves[i].dtype for i in plan.dtype_at]
    plan.dicts = _dict_paths(whole_def)
    plan.call = step.run
    for_dtypes = getattr(step.run, "for_dtypes", None)
    if for_dtypes is not None:
        plan.call = for_dtypes(frozenset([*plan.dtypes, np.dtype(dtype)]))
    # the new state is built as optim.update builds it: with the model's dict key order (the
    # structures are equal, so the leaves' order is one)
    plan.s_def = s_def if implicit else s_out
    plan.params, plan.m_def, plan.m_kinds, plan.s_kinds = params, m_def, m_kinds, s_kinds
    plan.others = others
    plan.n_m, plan.n_s, plan.slots, plan.dtype = n_m, n_s, slots, dtype
    plan.m_at, plan.s_at, plan.b_at = (
        [start + i for i, k in enumerate(part) if k == _DYNAMIC]
        for start, part in ((0, m_kinds), (n_m, s_kinds), (n_m + n_s, b_kinds)))
    plan.scalar_at = [n_m + i for i, k in enumerate(s_kinds) if k == _SCALAR]
    plan.all_dynamic = all(k == _DYNAMIC for k in m_kinds)
    plan.last = None  # (the Python ints the last step reported, its report on the device)
    return plan


def _state_after(model: Any, tree: Any) -> Any:
    """The structure of the state tree an explicit step gives back: the model's containers down
    to its leaves, each leaf's state below (``optim.update`` rebuilds it so), or None where
    the state is not of this model (the op-by-op step says what is wrong).  A state of other
    containers (a dict state for an OrderedDict model, whose keys come in another order) takes
    one op-by-op step, whose state has the model's: the compiled step reads the state by the
    given state's structure.  (Structures equal but for their dicts' key order have one
    order of leaves.)"""
    treedef = pytree.tree_flatten_with_path(model)[2]  # the structure optim.update pairs the state by
    try:
        rebuilt = pytree.tree_unflatten(treedef, treedef.flatten_up_to(tree))
    except (ValueError, TypeError):
        return None
    return pytree.tree_structure(rebuilt, none_is_leaf=True)


def _body(b: Any, loss_fn: Callable[..., Any], bound: Any, model: Any, m_leaves: list, m_def: Any, m_kinds: list,
          s_leaves: list, s_def: Any, s_kinds: list, b_leaves: list, b_def: Any, b_kinds: list,
          shell: optim.OptState, rule_at: Rule, slots: list, dtype: str, others: list) -> Callable[..., tuple]:
    """The step as a function of its traced inputs: ``(model arrays, state arrays, batch
    arrays, *numbers) -> (loss, report, new model arrays, new state arrays)``; ``report`` is
    the finite total followed by the new Python-int state leaves, in one array of the
    step's dtype.  ``numbers``: where the state has Python-int leaves, an array laid out as
    ``report`` (its first element unread: the last step's report goes in as it is), then,
    where the rule is scheduled, the scheduled values.  Implicit mode appends a fifth output:
    the values of the parameters and of ``others`` (the variables the forward pass may
    write) from before the step, read before the forward pass, to undo a step that fails
    after the call (the library keeps a value read before an assignment as it was)."""
    import autoray as ar

    loss_ref = weak_callable(loss_fn)
    bound_ref = _weak(bound) if bound is not None else None
    model_ref = _weak(model) if model is not None else None
    n_hyper, n_ints = len(slots), s_kinds.count(_SCALAR)
    other_refs = [_weak(v) for v in others]

    def body(m_arrays: list, s_arrays: list, b_arrays: list, *numbers: Any) -> tuple:
        ints = [numbers[0][i + 1] for i in range(n_ints)]
        hyper = [numbers[-1][i] for i in range(n_hyper)]
        rule = _rule_at(rule_at, slots, hyper)
        tree = pytree.tree_unflatten(s_def, _fill(s_leaves, s_kinds, list(s_arrays), ints))
        batch = pytree.tree_unflatten(b_def, _fill(b_leaves, b_kinds, list(b_arrays), []))
        if bound_ref is not None:
            ps = optim.params_of(model_ref())
            params = list(ps)
            olds = [optim.read(v) for v in params]
            kept = [optim.read(v()) for v in other_refs]  # before the forward pass writes them
            loss, grads = _traced_value_and_gradient(b, bound_ref(), ps, batch)
            grad_leaves = [grads[p] for p in params]
            # the variables' values as an explicit list model: the same rule arithmetic, and
            # the same frozen paths ((i,) for the i-th variable)
            new_st, news = optim._apply(shell._replace(rule=rule, tree=tree), olds, grad_leaves)
        else:
            olds = _fill(m_leaves, m_kinds, list(m_arrays), [])
            model = pytree.tree_unflatten(m_def, olds)
            loss, grads = _traced_value_and_gradient(b, loss_ref(), model, batch)
            grad_leaves = m_def.flatten_up_to(grads)
            new_st, new_model = optim._apply(shell._replace(rule=rule, tree=tree), model, grads)
            news = pytree.tree_flatten(new_model, none_is_leaf=True)[0]
        total = _finite_total(loss, grad_leaves, olds, news, dtype)
        new_s = pytree.tree_flatten(new_st.tree, none_is_leaf=True)[0]
        report = [total, *(ar.astype(v, dtype) for v, k in zip(new_s, s_kinds) if k == _SCALAR)]
        new_s_arrays = [v for v, k in zip(new_s, s_kinds) if k == _DYNAMIC]
        if bound_ref is not None:
            finite = total == 0
            for v, new, was in zip(params, news, olds):
                if new is not was:
                    optim.write(v, ar.do("where", finite, new, was))  # nothing applied unless finite
            return loss, ar.do("stack", report), [], new_s_arrays, [*olds, *kept]
        return loss, ar.do("stack", report), [v for v, k in zip(news, m_kinds) if k == _DYNAMIC], new_s_arrays

    return body


def _finite_total(loss: Any, grads: list, olds: list, news: list, dtype: str) -> Any:
    """The check :func:`abstractdiff._train._all_finite` makes, as one traced number: 0 where
    the loss, every gradient and every new value is finite, NaN elsewhere.  A leaf's
    gradient and new value share one reduction (``sum(g*0 + x*0)``): small reductions are
    what a compiled step spends its time on, not arithmetic."""
    import autoray as ar

    parts = [loss * 0]
    for g, old, new in zip(grads, olds, news):
        changed = new is not old
        paired = g is not None and changed and ar.shape(g) == ar.shape(new)
        if paired and ar.get_dtype_name(g) == ar.get_dtype_name(new):
            parts.append(ar.do("sum", g * 0 + new * 0))
            continue
        parts += [ar.do("sum", a * 0) for a in ((g,) if g is not None else ()) + ((new,) if changed else ())]
    total = None
    for t in parts:
        t = ar.astype(t, dtype)
        total = t if total is None else total + t
    return total

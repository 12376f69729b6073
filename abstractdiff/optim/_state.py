"""The optimiser state: ``setup``, ``update``, and ``adjust``/``freeze``/``thaw`` on it."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np

from ..core import (
    ArgumentTypeError,
    InvalidArgumentError,
    ModeMismatchError,
    ShapeMismatchError,
    UnknownVariableError,
    is_array,
    is_float_leaf,
    pytree,
    register_pytree_node,
    shape_of,
)
from ._rules import Chain, Rule

#: A key path into the model tree: a tuple of dict keys, sequence indices and attribute
#: names as ``optree`` lists them (``("encoder", "w")``, ``("layers", 0)``); a single
#: key stands for a path of one.
KeyPath = tuple | str | int


class Frozen:
    """The key paths of the frozen subtrees of a state (see :func:`freeze`).

    A pytree node without children: checkpoints and ``ad.to_numpy`` carry it in the tree
    structure, not as a leaf, so the files' format is the same with or without it
    (frozen paths, like the rule, come from ``like`` when a checkpoint is loaded).
    """

    __slots__ = ("paths",)

    def __init__(self, paths: tuple[tuple, ...] = ()):
        self.paths = tuple(paths)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Frozen) and other.paths == self.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"Frozen({list(self.paths)!r})"

    def covers(self, path: tuple) -> bool:
        """Whether the leaf at ``path`` is inside a frozen subtree."""
        return any(path[: len(p)] == p for p in self.paths)


register_pytree_node(Frozen, lambda f: ((), f.paths), lambda paths, _: Frozen(paths))
NOTHING_FROZEN = Frozen()


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj`` where it allows one, else a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class SetUpFor:
    """The variables an implicit-mode state was set up for, in ``ad.Params`` order, held weakly.

    An optimiser's leaf states (Adam's moments) belong to the variables they were set up
    for (Optimisers.jl: the state tree mirrors its model): :func:`update` refuses variables
    that are not these very objects, even when they have the same shapes, rather than
    handing one layer's moments to another.  A pytree node without children (like
    :class:`Frozen`): checkpoints and ``ad.to_numpy`` keep it, and store nothing of it.
    """

    __slots__ = ("_refs",)

    def __init__(self, variables: Any = ()):
        self._refs = tuple(_weak(v) for v in variables)

    def __len__(self) -> int:
        return len(self._refs)

    def first_other(self, variables: list[Any]) -> int | None:
        """The index of the first of ``variables`` that is not the one the state was set up
        for (a collected one never matches), or ``None`` when all are."""
        return next((i for i, (r, v) in enumerate(zip(self._refs, variables)) if r() is not v), None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SetUpFor) and len(other) == len(self) and other.first_other(
            [r() for r in self._refs]) is None

    def __hash__(self) -> int:
        return len(self._refs)

    def __repr__(self) -> str:
        return f"SetUpFor({len(self._refs)} variables)"


# itself as the metadata: a tf.Variable (unhashable) inside a weakref would make the treedef unhashable
register_pytree_node(SetUpFor, lambda s: ((), s), lambda s, _: s)


NOT_SET_UP_FOR_VARIABLES = SetUpFor()


class OptState(NamedTuple):
    """What :func:`setup` returns and :func:`update` threads through training.

    ``rule``: the rule; ``step``: how many updates were applied; ``tree``: the leaf states,
    shaped like the model (explicit mode) or a list in ``ad.Params`` order (implicit mode);
    ``implicit``: which of the two; ``frozen``: the subtrees :func:`freeze` excluded from
    updates; ``variables``: in implicit mode, the variables the state belongs to (held
    weakly, see :class:`SetUpFor`).  ``step`` is also the count a scheduled
    hyperparameter sees (the first update is step 0).  It is a pytree (a namedtuple), so
    ``ad.to_numpy`` and checkpoints see its arrays and the step counter.
    """

    rule: Rule
    step: int
    tree: Any
    implicit: bool = False
    frozen: Frozen = NOTHING_FROZEN
    variables: SetUpFor = NOT_SET_UP_FOR_VARIABLES


# ------------------------------------------------------------------ variables
# What counts as a variable is ad.Params' notion (abstractdiff._implicit): each library's
# adapter recognises its own (is_variable, check_variable), found by the object's type.
def _is_params(obj: Any) -> bool:
    return bool(getattr(obj, "_abstractdiff_params", False))


def _is_variable(leaf: Any) -> bool:
    from ..core import is_library_variable

    return is_library_variable(leaf)


def holds_variables(model: Any) -> bool:
    """Whether ``model`` is trained in place (implicit mode) rather than returned anew:
    ``ad.Params``, a model of a library (``nn.Module``, Keras...), or a pytree with
    variables among its leaves."""
    from ..core import is_variable_or_model, model_variables

    if _is_params(model):
        return True
    leaves = pytree.tree_leaves(model, is_leaf=is_variable_or_model)
    return any(_is_variable(v) or model_variables(v) is not None for v in leaves)


def params_of(model: Any) -> Any:
    """``ad.Params(model)`` (the model itself if it already is one)."""
    from ..core import Params

    return model if _is_params(model) else Params(model)


def read(var: Any) -> Any:
    """The current value of a variable, as an array outside any autodiff graph."""
    from ..core import variable_owner

    return variable_owner(var).read(var)


def write(var: Any, value: Any) -> None:
    """Assign ``value`` to a variable in place (same shape and dtype)."""
    from ..core import variable_owner

    variable_owner(var).write(var, value)


# ------------------------------------------------------------------ arithmetic scope
def arithmetic_scope(leaves: Any) -> Any:
    """The scopes the arrays' libraries need for arithmetic outside the operators:
    :func:`abstractdiff.scope` over ``leaves`` (jax's x64 mode for float64 jax arrays, which
    would otherwise become float32); local, so no library's global configuration is ever
    changed.  A no-op for numpy."""
    from ..core import scope

    return scope(leaves)


x64_scope = arithmetic_scope  # its older name


def _is_float_leaf(a: Any) -> bool:
    """A float array or a Python float: a leaf the operators differentiate (the shared
    classification), and so a leaf the optimiser trains."""
    return is_float_leaf(a)


def _is_python_float(a: Any) -> bool:
    # np.float64 subclasses float but is an array (shape, dtype): it is trained as one
    return isinstance(a, float) and not is_array(a)


def _leaf_for_state(x: Any) -> Any:
    """What a rule's ``init`` sees: a Python float as a 0-d float64 array (its state is an
    array, which checkpoints store and ``train_step`` moves to the backend)."""
    return np.asarray(x, dtype=np.float64) if _is_python_float(x) else x


def _like_gradient(a: Any, g: Any) -> Any:
    """A Python float or numpy leaf state as an array of ``g``'s library and device, so the
    rule computes where the gradient lives (numpy values stay numpy for numpy gradients)."""
    from ..core import backend_for

    owner = backend_for(g)
    if owner is None or not (isinstance(a, np.ndarray) or _is_python_float(a)):
        return a
    return owner.asarray_like(np.asarray(a, dtype=np.float64 if _is_python_float(a) else None), g)


def _to_python_float(value: Any) -> float:
    from ..core import to_numpy

    return float(to_numpy(value))


# ------------------------------------------------------------------ setup / update
def setup(rule: Rule, model: Any) -> OptState:
    """The initial optimiser state for ``model``: ``setup(rule, model) -> OptState``.

    ``model`` is a pytree of arrays (explicit mode; float leaves, Python floats included,
    get a state, other leaves ``None``), or holds variables (implicit mode: an
    ``nn.Module``, a Keras model, ``ad.variables(...)`` or ``ad.Params``; the state then
    belongs to those very variables, see :class:`SetUpFor`).

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> state = optim.setup(optim.Momentum(lr=0.1), {"w": np.ones(2)})
        >>> state, model = optim.update(state, {"w": np.ones(2)}, {"w": np.ones(2)})
        >>> model["w"], state.step
        (array([0.9, 0.9]), 1)
    """
    if not isinstance(rule, Rule):
        raise ArgumentTypeError(
            f"setup(rule, model): rule must be an optim rule such as optim.Adam(), got {type(rule).__name__}"
        )
    rule.at(0)  # a schedule that does not return a number fails here rather than mid-training
    if holds_variables(model):
        params = list(params_of(model))
        values = [read(v) for v in params]
        with arithmetic_scope(values):
            return OptState(rule, 0, [rule.init(x) for x in values], True, variables=SetUpFor(params))
    leaves, treedef = pytree.tree_flatten(model)
    with arithmetic_scope(leaves):
        states = [rule.init(_leaf_for_state(x)) if _is_float_leaf(x) else None for x in leaves]
    return OptState(rule, 0, pytree.tree_unflatten(treedef, states), False)


def _is_grads(obj: Any) -> bool:
    from ..core import Grads

    return isinstance(obj, Grads)


def update(state: OptState, model: Any, grads: Any) -> tuple[OptState, Any]:
    """Apply one step: ``update(state, model, grads) -> (state, model)``.

    Explicit mode (``grads`` shaped like the model): pure, returns new arrays and leaves
    the inputs untouched; ``None`` gradients (non-float leaves) leave the leaf as it is.
    A Python float leaf is differentiated by the operators, so it is trained too, and
    stays a Python float (its state is a 0-d array).
    Implicit mode (``grads`` an ``ad.Grads``): computes every new value first, then
    assigns them to the variables in place, and returns ``model`` itself.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> from abstractdiff import optim
        >>> model = {"w": np.array([1.0, 2.0]), "n": 3}          # n: not a float leaf, left alone
        >>> state = optim.setup(optim.Descent(0.5), model)
        >>> state, new = optim.update(state, model, {"w": np.array([1.0, 1.0]), "n": None})
        >>> new, model["w"], state.step                            # pure: model is unchanged
        ({'w': array([0.5, 1.5]), 'n': 3}, array([1., 2.]), 1)
    """
    return _apply(state, model, grads)


def _apply(
    state: OptState, model: Any, grads: Any, check: Callable[[list[Any]], None] | None = None,
    commit: Callable[[OptState, Callable[[], None]], None] | None = None,
) -> tuple[OptState, Any]:
    """:func:`update`, with ``check(new_values)`` called on the new parameter values after they
    are computed and before anything is returned or assigned: it may raise, and then the
    model (variables included) and the state are left exactly as they were.

    Implicit mode: ``commit(new_state, undo)`` is called once the new values are assigned,
    in the same block without interrupts (see :func:`_assign`); ``undo()`` writes the old
    values back (for a caller that fails before it hands the new state on)."""
    if not isinstance(state, OptState):
        raise ArgumentTypeError(f"state must be the OptState from optim.setup(rule, model), got {type(state).__name__}")
    if _is_grads(grads) or state.implicit:
        if not (_is_grads(grads) and state.implicit):
            raise ModeMismatchError(
                "optim.update: the state was set up for "
                + ("variables (implicit mode)" if state.implicit else "a pytree of arrays (explicit mode)")
                + f" but got {'ad.Grads' if _is_grads(grads) else 'a pytree of gradients'}; set the state up "
                "with optim.setup(rule, model) on the same kind of model the gradients come from"
            )
        return _update_implicit(state, model, grads, check, commit)
    return _update_explicit(state, model, grads, check)


def _frozen_leaves(state: OptState, paths: list[tuple]) -> set[int]:
    """The indices of the leaves (at ``paths``) inside a frozen subtree; every frozen path
    must reach at least one leaf of the model."""
    if not state.frozen.paths:
        return set()
    for f in state.frozen.paths:
        if not any(p[: len(f)] == f for p in paths):
            raise InvalidArgumentError(
                f"optim.update: the frozen path {f!r} reaches no parameter of this model (a path into a rule's "
                f"own state, or a model of another structure); thaw it with optim.thaw(state, {f!r})"
            )
    return {i for i, p in enumerate(paths) if state.frozen.covers(p)}


def _leaf_state_mismatch(rule: Rule, st: Any, shape: tuple, dtype: str, counts: dict[int, tuple]) -> str | None:
    """What is wrong with ``st`` as ``rule``'s state for a parameter of ``shape`` and ``dtype``,
    or None.  The built-in rules keep arrays shaped and typed as their parameter
    (``zeros_like``) and Python numbers as counts (Adam's t); a rule of the user's own may
    keep anything, so it is not checked.  Metadata only (shapes, dtype names): no array is
    read.  ``counts`` memoises, per rule object, which of its state's leaves are counts and
    how many nodes its state has."""
    if isinstance(rule, Chain):
        if not isinstance(st, tuple) or len(st) != len(rule.rules):
            return f"a state of another rule (the chain {rule!r} keeps one state per rule)"
        return next((m for r, s in zip(rule.rules, st) if (m := _leaf_state_mismatch(r, s, shape, dtype, counts))),
                    None)
    if type(rule).__module__ != Rule.__module__:
        return None
    from ..core import dtype_name

    if id(rule) not in counts:  # the rule's own state for a probe parameter: arrays where it keeps arrays
        probe = rule.init(np.zeros(1))
        counts[id(rule)] = (tuple(not is_array(a) for a in pytree.tree_leaves(probe)),
                            pytree.tree_structure(probe).num_nodes)
    leaves, (kept, nodes) = pytree.tree_leaves(st), counts[id(rule)]
    # the nesting too (a chain's state of the same leaves is another rule's), not the
    # containers' types: a state rebuilt by a library may hold lists where init made tuples
    if len(leaves) != len(kept) or pytree.tree_structure(st).num_nodes != nodes:
        return f"a state of another rule ({len(leaves)} arrays or numbers, where {rule!r} keeps {len(kept)})"
    for a, is_count in zip(leaves, kept):
        # a count is a Python number, or a 0-d array of the step's dtype where a compiled step traced it
        if is_count:
            if is_array(a) and shape_of(a) != ():
                return f"an array of shape {shape_of(a)} where {rule!r} keeps a count"
        elif not is_array(a) or shape_of(a) != shape or dtype_name(a) != dtype:
            return (f"an array of shape {shape_of(a)} and dtype {dtype_name(a)}" if is_array(a)
                    else f"{type(a).__name__} {a!r} where {rule!r} keeps an array")
    return None


def _check_grad_shapes(xs: list[Any], gs: list[Any], live: list[int], where: Callable[[int], str]) -> None:
    """Refuse a gradient of another shape than its parameter: the update would broadcast it
    (a (2, 1) parameter with a (2, 2) gradient became (2, 2)), silently."""
    for i in live:
        x, g = xs[i], gs[i]
        if is_array(x) and is_array(g) and shape_of(g) != shape_of(x):
            raise ShapeMismatchError(
                f"optim.update: the gradient of {where(i)} has shape {shape_of(g)}, but the parameter has shape "
                f"{shape_of(x)}; pass grads computed for this model (ad.gradient of the loss at it)"
            )


def _check_leaf_states(rule: Rule, xs: list[Any], states: list[Any], live: list[int],
                       where: Callable[[int], str]) -> None:
    """Refuse a state whose arrays do not match the parameters they belong to: arithmetic
    would broadcast a state of another but compatible shape silently (or fail with a raw
    library error), training with another model's moments."""
    from ..core import dtype_name

    counts: dict[int, tuple] = {}
    for i in live:
        x = xs[i]
        if not is_array(x):  # a Python float kept as one (numpy gradients): its state is 0-d
            continue
        mismatch = _leaf_state_mismatch(rule, states[i], shape_of(x), dtype_name(x), counts)
        if mismatch is not None:
            raise ShapeMismatchError(
                f"optim.update: the optimiser state of {where(i)} holds {mismatch}, but the parameter has shape "
                f"{shape_of(x)} and dtype {dtype_name(x)}; the state belongs to another model (or was loaded for "
                f"one). Call optim.setup(rule, model) for this model, or load the state with this model as like"
            )


def _step(
    state: OptState, xs: list[Any], gs: list[Any], states: list[Any], live: list[int],
    where: Callable[[int], str] = lambda i: f"leaf {i}",
) -> tuple[list[Any], list[Any]]:
    """The new values and leaf states of the leaves ``live``; the others stay as they are
    (same objects).  A ``None`` delta leaves the value as it is."""
    rule = state.rule.at(state.step)  # scheduled hyperparameters as numbers (checked)
    _check_grad_shapes(xs, gs, live, where)
    _check_leaf_states(state.rule, xs, states, live, where)
    new_states, deltas = rule.apply_tree([states[i] for i in live], [xs[i] for i in live], [gs[i] for i in live])
    values, out_states = list(xs), list(states)
    for i, s, d in zip(live, new_states, deltas):
        out_states[i] = s
        if d is not None:
            values[i] = xs[i] - d
    return values, out_states


def _python_floats_as_arrays(
    leaves: list[Any], g_leaves: list[Any], s_leaves: list[Any], live: list[int]
) -> tuple[list[Any], list[Any]]:
    """The leaves and leaf states the rule computes with: each trained Python float, and its
    state, as 0-d arrays of its gradient's library (``ad.gradient`` differentiates Python
    floats, so they are trained like 0-d arrays and given back as Python floats)."""
    xs, states = list(leaves), list(s_leaves)
    for i in live:
        if _is_python_float(leaves[i]):
            g = g_leaves[i]
            xs[i] = _like_gradient(leaves[i], g)
            states[i] = pytree.tree_map(lambda a, g=g: _like_gradient(a, g), s_leaves[i])
    return xs, states


def _as_leaf_type(new: Any, computed_from: Any, old: Any) -> Any:
    """A Python float leaf stays a Python float (the rule computed it as a 0-d array); a
    leaf the step left alone is the user's own object."""
    if new is computed_from:
        return old
    return _to_python_float(new) if _is_python_float(old) else new


def _update_explicit(
    state: OptState, model: Any, grads: Any, check: Callable[[list[Any]], None] | None
) -> tuple[OptState, Any]:
    paths, leaves, treedef = pytree.tree_flatten_with_path(model)
    try:
        g_leaves = treedef.flatten_up_to(grads)
    except (ValueError, TypeError) as err:
        raise ShapeMismatchError(
            f"optim.update: grads must have the structure of the model, {treedef}, but have "
            f"{pytree.tree_structure(grads)}"
        ) from err
    try:
        s_leaves = treedef.flatten_up_to(state.tree)
    except (ValueError, TypeError) as err:
        raise ShapeMismatchError(
            f"optim.update: the state was set up for a model of structure {pytree.tree_structure(state.tree)}, "
            f"not {treedef}; call optim.setup(rule, model) for this model"
        ) from err
    frozen = _frozen_leaves(state, paths)
    live = [
        i for i, (x, g) in enumerate(zip(leaves, g_leaves)) if g is not None and _is_float_leaf(x) and i not in frozen
    ]
    # the gradients too: numpy float64 leaves with jax float64 gradients compute in jax
    with arithmetic_scope([*leaves, *g_leaves]):
        xs, s_leaves = _python_floats_as_arrays(leaves, g_leaves, s_leaves, live)
        new_leaves, new_states = _step(state, xs, g_leaves, s_leaves, live,
                                       lambda i: f"the parameter at path {paths[i]!r}")
        if check is not None:
            check([v for v, x in zip(new_leaves, xs) if v is not x])
    new_leaves = [_as_leaf_type(new, x, old) for new, x, old in zip(new_leaves, xs, leaves)]
    new_tree = pytree.tree_unflatten(treedef, new_states)
    return (
        state._replace(step=state.step + 1, tree=new_tree, implicit=False),
        pytree.tree_unflatten(treedef, new_leaves),
    )


def _check_set_up_for(state: OptState, params: list[Any]) -> None:
    """Refuse variables the state was not set up for: their optimiser state would be another
    variable's (a state without that record, built by hand, is not checked)."""
    if not len(state.variables):
        return
    i = state.variables.first_other(params)
    if i is not None:
        v = params[i]
        raise UnknownVariableError(
            f"optim.update: variable {i} of this model ({type(v).__name__} of shape {shape_of(v)}) is not the "
            f"variable the optimiser state was set up for; a state belongs to the variables given to "
            f"optim.setup (their moments and step counts), even when another model's have the same shapes. "
            f"Call optim.setup(rule, model) for this model and keep one state per model (after "
            f"ad.load_checkpoint, use the state and model it returns)"
        )


def _assign(changed: list[tuple[Any, Any]], new_state: OptState,
            commit: Callable[[OptState, Callable[[], None]], None] | None) -> None:
    """Assign the new values as one block: all of them or none.

    A ``KeyboardInterrupt`` landing between two assignments (or an assignment that raises)
    would leave some variables updated and the state not: resuming from the state the
    caller holds would then differ from an uninterrupted run.  So SIGINT is held off while
    assigning (:class:`~abstractdiff._atomic.HeldInterrupts`), and the old values are kept
    (copied only where the library assigns in place: torch, paddle) to undo the block if it
    fails, or if an interrupt arrived meanwhile and nobody took the new state (``commit``
    None: the interrupt then propagates from a step that applied nothing).  With
    ``commit``, the new state is handed over inside the block, so an interrupt held there
    is delivered after, with the caller holding the new, consistent pair."""
    from .._atomic import HeldInterrupts, snapshot

    variables = [v for v, _ in changed]
    olds = snapshot(variables)

    def undo() -> None:
        for v, old in zip(variables, olds):
            write(v, old)

    with HeldInterrupts() as held:
        try:
            for v, value in changed:
                write(v, value)
            if commit is not None:
                commit(new_state, undo)
            elif held.pending:  # nobody holds the new state yet: the step applies nothing
                undo()
        except BaseException:
            undo()
            raise
    held.deliver()


def _update_implicit(
    state: OptState, model: Any, grads: Any, check: Callable[[list[Any]], None] | None,
    commit: Callable[[OptState, Callable[[], None]], None] | None = None,
) -> tuple[OptState, Any]:
    params = list(params_of(model))
    if len(params) != len(state.tree):
        raise ShapeMismatchError(
            f"optim.update: the state holds {len(state.tree)} variables but the model has {len(params)}; "
            f"call optim.setup(rule, model) for this model"
        )
    _check_set_up_for(state, params)
    values = [read(v) for v in params]
    gs = [grads[v] for v in params]
    frozen = _frozen_leaves(state, [(i,) for i in range(len(params))])
    live = [i for i, g in enumerate(gs) if g is not None and i not in frozen]
    # Everything is computed before anything is assigned, so a failure leaves the
    # variables as they were.  The gradients count for the scope too: ad.Variable boxes
    # of numpy float64 with jax float64 gradients compute in jax.
    with arithmetic_scope([*values, *gs]):
        new_values, new_states = _step(state, values, gs, list(state.tree), live, lambda i: f"variable {i}")
        changed = [(v, new) for v, new, old in zip(params, new_values, values) if new is not old]
        if check is not None:
            check([new for _, new in changed])
        new_state = state._replace(step=state.step + 1, tree=new_states, implicit=True)
        _assign(changed, new_state, commit)
    return new_state, model


# ------------------------------------------------------------------ adjust / freeze / thaw
def _hyperparameters(rule: Rule) -> set[str]:
    if isinstance(rule, Chain):
        return set().union(*(_hyperparameters(r) for r in rule.rules)) if rule.rules else set()
    return {f.name for f in dataclasses.fields(rule)} if dataclasses.is_dataclass(rule) else set()


def _adjusted(rule: Rule, changes: dict[str, Any]) -> Rule:
    if isinstance(rule, Chain):
        return Chain(tuple(_adjusted(r, changes) for r in rule.rules))
    mine = {k: v for k, v in changes.items() if k in _hyperparameters(rule)}
    return dataclasses.replace(rule, **mine) if mine else rule  # type: ignore[type-var]


def adjust(state: OptState | Rule, **hyperparameters: Any) -> Any:
    """Change hyperparameters: ``adjust(state, lr=1e-4, ...) -> state`` (Optimisers.jl ``adjust!``).

    Returns a new state whose rule has the given values, in every rule of the tree that
    has that hyperparameter (each rule of a :func:`chain`); the leaf states, the step
    counter and the frozen paths are kept.  A value may be a schedule where the rule
    allows one (``lr``).  ``adjust(rule, ...)`` on a rule returns the adjusted rule.

    Raises:
        InvalidArgumentError: no rule in the tree has one of the names, or a value is
            out of its range (the rule's own check).

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> state = optim.setup(optim.chain(optim.ClipNorm(1.0), optim.Adam(1e-3)), np.zeros(2))
        >>> optim.adjust(state, lr=1e-4).rule
        Chain(rules=(ClipNorm(omega=1.0, p=2), Adam(lr=0.0001, betas=(0.9, 0.999), eps=1e-08)))
    """
    rule = state.rule if isinstance(state, OptState) else state
    if not isinstance(rule, Rule):
        raise ArgumentTypeError(
            f"optim.adjust: the first argument must be an OptState or a rule, got {type(state).__name__}"
        )
    if not hyperparameters:
        raise InvalidArgumentError("optim.adjust: name the hyperparameters to change, e.g. adjust(state, lr=1e-4)")
    known = _hyperparameters(rule)
    unknown = sorted(set(hyperparameters) - known)
    if unknown:
        raise InvalidArgumentError(
            f"optim.adjust: no rule of {rule!r} has a hyperparameter named {', '.join(map(repr, unknown))}; "
            f"its hyperparameters are {sorted(known)}"
        )
    new = _adjusted(rule, hyperparameters)
    return state._replace(rule=new) if isinstance(state, OptState) else new


def _key_path(fn: str, path: Any) -> tuple:
    if isinstance(path, list):
        path = tuple(path)
    if not isinstance(path, tuple):
        path = (path,)
    return path


def _leaf_paths(state: OptState) -> list[tuple]:
    return pytree.tree_flatten_with_path(state.tree, none_is_leaf=True)[0]


def _check_path(fn: str, state: OptState, path: tuple) -> list[tuple]:
    if not isinstance(state, OptState):
        raise ArgumentTypeError(f"optim.{fn}: state must be the OptState from optim.setup, got {type(state).__name__}")
    paths = _leaf_paths(state)
    if not any(p[: len(path)] == path for p in paths):
        tops = sorted({repr(p[0]) for p in paths if p})
        raise InvalidArgumentError(
            f"optim.{fn}: the model has no subtree at the path {path!r}; paths are tuples of dict keys and "
            f"indices (as pytree.tree_flatten_with_path lists them"
            + (", in ad.Params order for variables" if state.implicit else "")
            + f"), starting with one of {', '.join(tops) or 'nothing'}"
        )
    return paths


def freeze(state: OptState, path: KeyPath = ()) -> OptState:
    """Exclude a subtree from updates: ``freeze(state, path) -> state`` (Optimisers.jl ``freeze!``).

    ``path`` is a key path into the model: a tuple of dict keys and sequence indices, as
    ``pytree.tree_flatten_with_path`` lists them (``("encoder",)``, ``("layers", 0,
    "w")``); a single key means a path of one, ``()`` the whole model.  In implicit mode
    the model is the list of its variables in ``ad.Params`` order: ``(i,)`` is the
    i-th.  :func:`update` leaves every parameter under a frozen path exactly as it is
    (the same array) and keeps its optimiser state; the step counter still advances.

    Raises:
        InvalidArgumentError: no subtree of the model is at ``path``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> model = {"enc": np.ones(2), "dec": np.ones(2)}
        >>> state = optim.freeze(optim.setup(optim.Descent(0.5), model), "enc")
        >>> state, new = optim.update(state, model, {"enc": np.ones(2), "dec": np.ones(2)})
        >>> new
        {'enc': array([1., 1.]), 'dec': array([0.5, 0.5])}
    """
    path = _key_path("freeze", path)
    _check_path("freeze", state, path)
    if state.frozen.covers(path):
        return state
    kept = tuple(p for p in state.frozen.paths if p[: len(path)] != path)
    return state._replace(frozen=Frozen((*kept, path)))


def thaw(state: OptState, path: KeyPath = ()) -> OptState:
    """Undo :func:`freeze` for a subtree: ``thaw(state, path) -> state`` (Optimisers.jl ``thaw!``).

    ``path`` as for :func:`freeze`; thawing part of a frozen subtree leaves the rest of
    it frozen, and ``thaw(state)`` thaws everything.

    Raises:
        InvalidArgumentError: no subtree of the model is at ``path``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> model = {"a": [np.ones(1), np.ones(1)], "b": np.ones(1)}
        >>> state = optim.freeze(optim.setup(optim.Descent(0.5), model), ())
        >>> optim.thaw(state, ("a", 1)).frozen
        Frozen([('b',), ('a', 0)])
    """
    path = _key_path("thaw", path)
    leaf_paths = _check_path("thaw", state, path)
    kept: list[tuple] = []
    for f in state.frozen.paths:
        if f[: len(path)] == path:
            continue  # inside the thawed subtree
        if path[: len(f)] != f:
            kept.append(f)  # elsewhere
            continue
        # f contains path: keep f's other branches frozen, level by level down to path
        for k in range(len(f), len(path)):
            children = dict.fromkeys(p[k] for p in leaf_paths if len(p) > k and p[:k] == path[:k])
            kept += [(*path[:k], c) for c in children if c != path[k]]
    return state._replace(frozen=Frozen(tuple(kept)))

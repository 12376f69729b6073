"""Optimisation rules with explicit state: Optimisers.jl semantics in optax's shape.

A rule is an immutable set of hyperparameters.  Its state lives in a separate tree
built by :func:`setup`, mirroring the model, and :func:`update` returns the new state
and the new model::

    from abstractdiff import optim
    rule = optim.chain(optim.ClipNorm(1.0), optim.Adam(lr=1e-3))
    state = optim.setup(rule, model)
    state, model = optim.update(state, model, grads)

A rule defines two methods, ``init(x) -> leaf_state`` and ``apply(leaf_state, x, g) ->
(leaf_state, delta)``; the parameter becomes ``x - delta``.  The formulas use only
arithmetic operators (and ``autoray`` for ``sqrt``/``abs``/``sum``), so one definition
runs on numpy, torch, jax, tensorflow and autograd arrays and keeps their dtype.

The model is either a pytree of arrays (explicit mode: :func:`update` is pure and
returns new arrays) or holds variables (implicit mode: a ``torch.nn.Module``, a Keras
model, ``ad.variables(...)`` or ``ad.Params``; :func:`update` takes the ``ad.Grads``
from the implicit backend, assigns the new values in place and returns the model).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import optree

from ._errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    ModeMismatchError,
    NonDifferentiableInputError,
    ShapeMismatchError,
)
from ._tree import is_array, is_float_leaf

__all__ = [
    "Adam",
    "AdamW",
    "Chain",
    "ClipNorm",
    "Descent",
    "Momentum",
    "Nesterov",
    "OptState",
    "RMSProp",
    "Rule",
    "chain",
    "setup",
    "update",
]


def _ar() -> Any:
    import autoray

    return autoray


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgumentError(message)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_lr(rule: str, lr: Any) -> None:
    _check(_is_number(lr) and lr >= 0, f"{rule}: lr must be a finite number >= 0, got {lr!r}")


def _check_decay(rule: str, name: str, v: Any) -> None:
    _check(_is_number(v) and 0 <= v < 1, f"{rule}: {name} must be a number in [0, 1), got {v!r}")


def _check_eps(rule: str, eps: Any) -> None:
    _check(_is_number(eps) and eps > 0, f"{rule}: eps must be a finite number > 0, got {eps!r}")


class Rule:
    """Base class of the rules: immutable hyperparameters, two methods.

    ``init(x) -> leaf_state`` gives the state of one array; ``apply(leaf_state, x, g) ->
    (leaf_state, delta)`` the new state and the step, which :func:`update` subtracts
    (``x - delta``).  Neither may modify its arguments.

    Example:
        >>> import numpy as np
        >>> from dataclasses import dataclass
        >>> from abstractdiff import optim
        >>> @dataclass(frozen=True)
        ... class SignDescent(optim.Rule):
        ...     # x -= lr * sign(g); no state, so init keeps the default (None)
        ...     lr: float = 0.1
        ...     def apply(self, state, x, g):
        ...         return None, self.lr * ((g > 0) * 1.0 - (g < 0) * 1.0)
        >>> state = optim.setup(SignDescent(), np.array([1.0, 2.0]))
        >>> optim.update(state, np.array([1.0, 2.0]), np.array([3.0, -4.0]))[1]
        array([0.9, 2.1])
    """

    def init(self, x: Any) -> Any:
        return None

    def apply(self, state: Any, x: Any, g: Any) -> tuple[Any, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class Descent(Rule):
    """Gradient descent: ``x -= lr * g``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.Descent(lr=0.1), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.4, 2.8])
    """

    lr: float = 0.1

    def __post_init__(self) -> None:
        _check_lr("Descent", self.lr)

    def apply(self, state: None, x: Any, g: Any) -> tuple[None, Any]:
        return None, self.lr * g


@dataclass(frozen=True)
class Momentum(Rule):
    """Classical momentum: ``v = rho*v + lr*g; x -= v``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.Momentum(lr=0.1, rho=0.9), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.13, 3.16])
    """

    lr: float = 0.01
    rho: float = 0.9

    def __post_init__(self) -> None:
        _check_lr("Momentum", self.lr)
        _check_decay("Momentum", "rho", self.rho)

    def init(self, x: Any) -> Any:
        return _ar().do("zeros_like", x)

    def apply(self, v: Any, x: Any, g: Any) -> tuple[Any, Any]:
        v = self.rho * v + self.lr * g
        return v, v


@dataclass(frozen=True)
class Nesterov(Rule):
    """Nesterov momentum: ``d = -rho^2*v + (1+rho)*lr*g; v = rho*v - lr*g; x -= d``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.Nesterov(lr=0.1, rho=0.9), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([-0.383,  3.844])
    """

    lr: float = 0.001
    rho: float = 0.9

    def __post_init__(self) -> None:
        _check_lr("Nesterov", self.lr)
        _check_decay("Nesterov", "rho", self.rho)

    def init(self, x: Any) -> Any:
        return _ar().do("zeros_like", x)

    def apply(self, v: Any, x: Any, g: Any) -> tuple[Any, Any]:
        rho, lr = self.rho, self.lr
        delta = -(rho**2) * v + ((1 + rho) * lr) * g
        return rho * v - lr * g, delta


@dataclass(frozen=True)
class RMSProp(Rule):
    """RMSProp: ``s = rho*s + (1-rho)*g^2; x -= lr*g/(sqrt(s)+eps)``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.RMSProp(lr=0.1), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.454357, 2.545643])
    """

    lr: float = 0.001
    rho: float = 0.9
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_lr("RMSProp", self.lr)
        _check_decay("RMSProp", "rho", self.rho)
        _check_eps("RMSProp", self.eps)

    def init(self, x: Any) -> Any:
        return _ar().do("zeros_like", x)

    def apply(self, s: Any, x: Any, g: Any) -> tuple[Any, Any]:
        s = self.rho * s + (1 - self.rho) * (g * g)
        return s, self.lr * g / (_ar().do("sqrt", s) + self.eps)


def _betas(rule: str, betas: Any) -> None:
    _check(
        isinstance(betas, (tuple, list)) and len(betas) == 2,
        f"{rule}: betas must be a pair (beta1, beta2), got {betas!r}",
    )
    _check_decay(rule, "betas[0]", betas[0])
    _check_decay(rule, "betas[1]", betas[1])


def _adam_step(betas: tuple[float, float], eps: float, state: tuple, g: Any) -> tuple[tuple, Any]:
    """Adam with lr = 1: ``(m/(1-b1^t)) / (sqrt(s/(1-b2^t)) + eps)``; t counts from 1."""
    m, s, t = state
    b1, b2 = betas
    t = t + 1
    m = b1 * m + (1 - b1) * g
    s = b2 * s + (1 - b2) * (g * g)
    u = (m / (1 - b1**t)) / (_ar().do("sqrt", s / (1 - b2**t)) + eps)
    return (m, s, t), u


@dataclass(frozen=True)
class Adam(Rule):
    """Adam: ``m = b1*m + (1-b1)*g; s = b2*s + (1-b2)*g^2;
    x -= lr * (m/(1-b1^t)) / (sqrt(s/(1-b2^t)) + eps)``, t counting from 1.

    The leaf state is ``(m, s, t)``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.Adam(lr=0.1), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.8, 2.2])
    """

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_lr("Adam", self.lr)
        _betas("Adam", self.betas)
        object.__setattr__(self, "betas", tuple(self.betas))
        _check_eps("Adam", self.eps)

    def init(self, x: Any) -> Any:
        zeros = _ar().do("zeros_like", x)
        return (zeros, zeros, 0)

    def apply(self, state: tuple, x: Any, g: Any) -> tuple[tuple, Any]:
        state, u = _adam_step(self.betas, self.eps, state, g)
        return state, self.lr * u


@dataclass(frozen=True)
class AdamW(Rule):
    """AdamW with PyTorch's coupling: ``u`` = the Adam step with lr = 1, then
    ``x -= lr * (u + weight_decay * x)``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.AdamW(lr=0.1, weight_decay=0.5), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.7075, 2.    ])
    """

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_lr("AdamW", self.lr)
        _betas("AdamW", self.betas)
        object.__setattr__(self, "betas", tuple(self.betas))
        _check(
            _is_number(self.weight_decay) and self.weight_decay >= 0,
            f"AdamW: weight_decay must be a finite number >= 0, got {self.weight_decay!r}",
        )
        _check_eps("AdamW", self.eps)

    def init(self, x: Any) -> Any:
        zeros = _ar().do("zeros_like", x)
        return (zeros, zeros, 0)

    def apply(self, state: tuple, x: Any, g: Any) -> tuple[tuple, Any]:
        state, u = _adam_step(self.betas, self.eps, state, g)
        return state, self.lr * (u + self.weight_decay * x)


@dataclass(frozen=True)
class ClipNorm(Rule):
    """Rescale each gradient array to p-norm at most ``omega``: ``g *= min(omega/|g|_p, 1)``.

    Per array, as Optimisers.jl does (not over the whole model).  ``p`` may be ``inf``.
    Put it first in a :func:`chain`.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.ClipNorm(omega=1.0), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([-0.2,  3.6])
    """

    omega: float = 10.0
    p: float = 2

    def __post_init__(self) -> None:
        _check(_is_number(self.omega) and self.omega > 0, f"ClipNorm: omega must be a number > 0, got {self.omega!r}")
        _check(
            isinstance(self.p, (int, float)) and not isinstance(self.p, bool) and self.p > 0,
            f"ClipNorm: p must be a number > 0 (or math.inf), got {self.p!r}",
        )

    def apply(self, state: None, x: Any, g: Any) -> tuple[None, Any]:
        ar = _ar()
        a = ar.do("abs", g)
        if math.isinf(self.p):
            norm = float(ar.do("max", a))
        else:
            norm = float(ar.do("sum", a**self.p) ** (1.0 / self.p))
        # norm > omega also guards the division: a zero gradient is left as it is.
        return None, (g * (self.omega / norm) if norm > self.omega else g)


@dataclass(frozen=True)
class Chain(Rule):
    """Rules applied in order, each seeing the previous one's output; see :func:`chain`."""

    rules: tuple[Rule, ...] = ()

    def __post_init__(self) -> None:
        for r in self.rules:
            if not isinstance(r, Rule):
                raise ArgumentTypeError(f"chain: every element must be an optim rule, got {type(r).__name__}")

    def init(self, x: Any) -> tuple:
        return tuple(r.init(x) for r in self.rules)

    def apply(self, state: tuple, x: Any, g: Any) -> tuple[tuple, Any]:
        new = []
        for r, s in zip(self.rules, state):
            s, g = r.apply(s, x, g)
            new.append(s)
        return tuple(new), g


def chain(*rules: Rule) -> Chain:
    """Compose rules: ``chain(ClipNorm(1.0), Adam())`` clips, then feeds the result to Adam.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.chain(optim.ClipNorm(1.0), optim.Descent(0.1)), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.88, 2.16])
    """
    return Chain(tuple(rules))


class OptState(NamedTuple):
    """What :func:`setup` returns and :func:`update` threads through training.

    ``rule``: the rule; ``step``: how many updates were applied; ``tree``: the leaf states,
    shaped like the model (explicit mode) or a list in ``ad.Params`` order (implicit mode);
    ``implicit``: which of the two.  It is a pytree (a namedtuple), so ``ad.to_numpy``
    and checkpoints see its arrays.
    """

    rule: Rule
    step: int
    tree: Any
    implicit: bool = False


# ------------------------------------------------------------------ variables
# What counts as a variable is ad.Params' notion (abstractdiff._implicit): each library's
# adapter recognises its own (is_variable, check_variable), found by the object's type.
def _is_params(obj: Any) -> bool:
    return bool(getattr(obj, "_abstractdiff_params", False))


def _is_variable(leaf: Any) -> bool:
    """A variable its library would accept as a parameter, whatever its dtype (a torch
    tensor that does not require grad is an array, not a variable)."""
    from ._implicit import variable_owner

    owner = variable_owner(leaf)
    if owner is None:
        return False
    try:
        owner.check_variable(leaf, "leaf")
    except NonDifferentiableInputError:  # an integer variable: still a variable
        return True
    except (TypeError, ValueError):
        return False
    return True


def holds_variables(model: Any) -> bool:
    """Whether ``model`` is trained in place (implicit mode) rather than returned anew:
    ``ad.Params``, a model of a library (``nn.Module``, Keras...), or a pytree with
    variables among its leaves."""
    from ._implicit import is_variable_or_model, model_variables

    if _is_params(model):
        return True
    leaves = optree.tree_leaves(model, is_leaf=is_variable_or_model)
    return any(_is_variable(v) or model_variables(v) is not None for v in leaves)


def params_of(model: Any) -> Any:
    """``ad.Params(model)`` (the model itself if it already is one)."""
    from ._implicit import Params

    return model if _is_params(model) else Params(model)


def read(var: Any) -> Any:
    """The current value of a variable, as an array outside any autodiff graph."""
    from ._implicit import variable_owner

    return variable_owner(var).read(var)


def write(var: Any, value: Any) -> None:
    """Assign ``value`` to a variable in place (same shape and dtype)."""
    from ._implicit import variable_owner

    variable_owner(var).write(var, value)


# ------------------------------------------------------------------ arithmetic scope
@contextlib.contextmanager
def arithmetic_scope(leaves: Any) -> Iterator[None]:
    """The scopes the arrays' libraries need for arithmetic outside the operators.

    Each array's backend is found by its type and its ``scope`` hook entered (jax's x64
    mode for float64 jax arrays, which would otherwise become float32); local, so no
    library's global configuration is ever changed.  A no-op for numpy.
    """
    from ._registry import backend_for

    owners: dict[int, tuple[Any, list]] = {}
    for a in leaves:
        if a is None or type(a) is np.ndarray or isinstance(a, (int, float)):
            continue
        b = backend_for(a)
        if b is not None:
            owners.setdefault(id(b), (b, []))[1].append(a)
    with contextlib.ExitStack() as stack:
        for b, arrays in owners.values():
            stack.enter_context(b.scope(arrays))
        yield


x64_scope = arithmetic_scope  # its older name


def _is_float_leaf(a: Any) -> bool:
    # the shared classification, for arrays only: a Python float in a model tree is left
    # as it is (a float stays a float, rather than becoming a 0-d array)
    return is_array(a) and is_float_leaf(a)


# ------------------------------------------------------------------ setup / update
def setup(rule: Rule, model: Any) -> OptState:
    """The initial optimiser state for ``model``: ``setup(rule, model) -> OptState``.

    ``model`` is a pytree of arrays (explicit mode; float leaves get a state, other
    leaves ``None``), or holds variables (implicit mode: an ``nn.Module``, a Keras
    model, ``ad.variables(...)`` or ``ad.Params``).

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
    if holds_variables(model):
        values = [read(v) for v in params_of(model)]
        with arithmetic_scope(values):
            return OptState(rule, 0, [rule.init(x) for x in values], True)
    leaves, treedef = optree.tree_flatten(model)
    with arithmetic_scope(leaves):
        states = [rule.init(x) if _is_float_leaf(x) else None for x in leaves]
    return OptState(rule, 0, optree.tree_unflatten(treedef, states), False)


def _is_grads(obj: Any) -> bool:
    from ._implicit import Grads

    return isinstance(obj, Grads)


def update(state: OptState, model: Any, grads: Any) -> tuple[OptState, Any]:
    """Apply one step: ``update(state, model, grads) -> (state, model)``.

    Explicit mode (``grads`` shaped like the model): pure, returns new arrays and leaves
    the inputs untouched; ``None`` gradients (non-float leaves) leave the leaf as it is.
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
    state: OptState, model: Any, grads: Any, check: Callable[[list[Any]], None] | None = None
) -> tuple[OptState, Any]:
    """:func:`update`, with ``check(new_values)`` called on the new parameter values after they
    are computed and before anything is returned or assigned: it may raise, and then the
    model (variables included) and the state are left exactly as they were."""
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
        return _update_implicit(state, model, grads, check)
    return _update_explicit(state, model, grads, check)


def _update_explicit(
    state: OptState, model: Any, grads: Any, check: Callable[[list[Any]], None] | None
) -> tuple[OptState, Any]:
    leaves, treedef = optree.tree_flatten(model)
    try:
        g_leaves = treedef.flatten_up_to(grads)
    except (ValueError, TypeError) as err:
        raise ShapeMismatchError(
            f"optim.update: grads must have the structure of the model, {treedef}, but have "
            f"{optree.tree_structure(grads)}"
        ) from err
    try:
        s_leaves = treedef.flatten_up_to(state.tree)
    except (ValueError, TypeError) as err:
        raise ShapeMismatchError(
            f"optim.update: the state was set up for a model of structure {optree.tree_structure(state.tree)}, "
            f"not {treedef}; call optim.setup(rule, model) for this model"
        ) from err
    rule = state.rule
    new_leaves, new_states = [], []
    # the gradients too: numpy float64 leaves with jax float64 gradients compute in jax
    with arithmetic_scope([*leaves, *g_leaves]):
        for x, g, s in zip(leaves, g_leaves, s_leaves):
            if g is None or not _is_float_leaf(x):
                new_leaves.append(x)
                new_states.append(s)
                continue
            s, delta = rule.apply(s, x, g)
            new_leaves.append(x - delta)
            new_states.append(s)
        if check is not None:
            check([v for v, x in zip(new_leaves, leaves) if v is not x])
    return (
        OptState(rule, state.step + 1, optree.tree_unflatten(treedef, new_states), False),
        optree.tree_unflatten(treedef, new_leaves),
    )


def _update_implicit(
    state: OptState, model: Any, grads: Any, check: Callable[[list[Any]], None] | None
) -> tuple[OptState, Any]:
    params = list(params_of(model))
    if len(params) != len(state.tree):
        raise ShapeMismatchError(
            f"optim.update: the state holds {len(state.tree)} variables but the model has {len(params)}; "
            f"call optim.setup(rule, model) for this model"
        )
    rule = state.rule
    values = [read(v) for v in params]
    gs = [grads[v] for v in params]
    new_values, new_states = [], []
    # Everything is computed before anything is assigned, so a failure leaves the
    # variables as they were.  The gradients count for the scope too: ad.Variable boxes
    # of numpy float64 with jax float64 gradients compute in jax.
    with arithmetic_scope([*values, *gs]):
        for x, g, s in zip(values, gs, state.tree):
            if g is None:
                new_values.append(None)
                new_states.append(s)
                continue
            s, delta = rule.apply(s, x, g)
            new_values.append(x - delta)
            new_states.append(s)
        if check is not None:
            check([v for v in new_values if v is not None])
        for v, value in zip(params, new_values):
            if value is not None:
                write(v, value)
    return OptState(rule, state.step + 1, new_states, True), model

"""The rules: immutable hyperparameters, ``init`` and ``apply`` (Optimisers.jl's ``init``/``apply!``)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..core import ArgumentTypeError, InvalidArgumentError

#: A hyperparameter that may be a schedule: a number, or a function of the step count.
Hyper = float | Callable[[int], float]


def _ar() -> Any:
    import autoray

    return autoray


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidArgumentError(message)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_lr(rule: str, lr: Any) -> None:
    if callable(lr):  # a schedule: its values are checked at every step (Rule.at)
        return
    _check(_is_number(lr) and lr >= 0, f"{rule}: lr must be a finite number >= 0, got {lr!r}")


def _check_decay(rule: str, name: str, v: Any) -> None:
    _check(_is_number(v) and 0 <= v < 1, f"{rule}: {name} must be a number in [0, 1), got {v!r}")


def _check_eps(rule: str, eps: Any) -> None:
    _check(_is_number(eps) and eps > 0, f"{rule}: eps must be a finite number > 0, got {eps!r}")


def _check_nonnegative(rule: str, name: str, v: Any, schedulable: bool = True) -> None:
    if schedulable and callable(v):
        return
    _check(_is_number(v) and v >= 0, f"{rule}: {name} must be a finite number >= 0, got {v!r}")


def _evaluate(rule: str, name: str, schedule: Callable[[int], Any], step: int) -> float:
    value = schedule(step)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(
            f"{rule}: the schedule of {name} returned {value!r} ({type(value).__name__}) at step {step}; a "
            f"schedule must return a real number (see optim.schedules)"
        )
    return float(value)


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
        ...     lr: Hyper = 0.1
        ...     def apply(self, state, x, g):
        ...         return None, self.lr * ((g > 0) * 1.0 - (g < 0) * 1.0)
        >>> state = optim.setup(SignDescent(), np.array([1.0, 2.0]))
        >>> optim.update(state, np.array([1.0, 2.0]), np.array([3.0, -4.0]))[1]
        array([0.9, 2.1])
    """

    #: The hyperparameters that may be schedules (callables of the step count); ``lr``
    #: in every rule that has one.
    schedulable: ClassVar[tuple[str, ...]] = ("lr",)

    def init(self, x: Any) -> Any:
        return None

    def apply(self, state: Any, x: Any, g: Any) -> tuple[Any, Any]:
        """``(new_leaf_state, delta)``; a ``delta`` of ``None`` means "no update this step"
        (the parameter is left exactly as it is, and later rules of a chain are skipped)."""
        raise NotImplementedError

    def apply_tree(self, states: list[Any], xs: list[Any], gs: list[Any]) -> tuple[list[Any], list[Any]]:
        """All the leaves of one update at once: ``(new_states, deltas)``.

        The default applies :meth:`apply` leaf by leaf; a leaf whose ``g`` is ``None`` is
        skipped (its state kept, its delta ``None``).  Rules that need the whole tree
        (:class:`ClipGlobalNorm`) override this.
        """
        new_states, deltas = [], []
        for s, x, g in zip(states, xs, gs):
            if g is not None:
                s, g = self.apply(s, x, g)
            new_states.append(s)
            deltas.append(g)
        return new_states, deltas

    def at(self, step: int) -> Rule:
        """This rule with every scheduled hyperparameter evaluated at ``step`` (counting from 0).

        Values are checked as the constructor checks numbers; a schedule returning
        anything but a real number raises :class:`InvalidArgumentError`.
        """
        names = [n for n in self.schedulable if callable(getattr(self, n, None))]
        if not names:
            return self
        values = {n: _evaluate(type(self).__name__, n, getattr(self, n), step) for n in names}
        try:
            return dataclasses.replace(self, **values)  # type: ignore[type-var]
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"{err} (the value of its schedule at step {step})") from None


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

    lr: Hyper = 0.1

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

    lr: Hyper = 0.01
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

    lr: Hyper = 0.001
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

    lr: Hyper = 0.001
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

    lr: Hyper = 0.001
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

    lr: Hyper = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: Hyper = 0.0
    eps: float = 1e-8

    schedulable: ClassVar[tuple[str, ...]] = ("lr", "weight_decay")

    def __post_init__(self) -> None:
        _check_lr("AdamW", self.lr)
        _betas("AdamW", self.betas)
        object.__setattr__(self, "betas", tuple(self.betas))
        _check_nonnegative("AdamW", "weight_decay", self.weight_decay)
        _check_eps("AdamW", self.eps)

    def init(self, x: Any) -> Any:
        zeros = _ar().do("zeros_like", x)
        return (zeros, zeros, 0)

    def apply(self, state: tuple, x: Any, g: Any) -> tuple[tuple, Any]:
        state, u = _adam_step(self.betas, self.eps, state, g)
        return state, self.lr * (u + self.weight_decay * x)


def _at_most_one(norm: Any, limit: float) -> Any:
    """``limit / max(norm, limit)``, the clipping factor, with ``max(a, b) = (a + b + |a - b|) / 2``:
    arithmetic only, so it stays an array of the norm's library (no synchronisation, and a
    compiled step traces it); 1 where the norm is within the limit, a zero norm included."""
    return (2 * limit) / (norm + limit + _ar().do("abs", norm - limit))


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
        norm = ar.do("max", a) if math.isinf(self.p) else ar.do("sum", a**self.p) ** (1.0 / self.p)
        # an array of g's library (no transfer to the host, and traceable by a compiled step)
        return None, g * _at_most_one(norm, self.omega)


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
        new_states, deltas = self.apply_tree([state], [x], [g])
        return new_states[0], deltas[0]

    def apply_tree(self, states: list[Any], xs: list[Any], gs: list[Any]) -> tuple[list[Any], list[Any]]:
        # rule by rule over the whole tree, so that a whole-tree rule (ClipGlobalNorm) sees
        # every leaf's output of the rule before it; a None delta (AccumulateGradients
        # between its steps) skips the later rules for that leaf, as Optimisers.jl does
        columns = [list(col) for col in zip(*states)] if states else [[] for _ in self.rules]
        for k, r in enumerate(self.rules):
            columns[k], gs = r.apply_tree(columns[k], xs, gs)
        return [tuple(row) for row in zip(*columns)] if columns else [() for _ in states], gs

    def at(self, step: int) -> Chain:
        rules = tuple(r.at(step) for r in self.rules)
        return self if all(a is b for a, b in zip(rules, self.rules)) else Chain(rules)


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




# ------------------------------------------------------------------ more rules
@dataclass(frozen=True)
class ClipGrad(Rule):
    """Clip each gradient entry to ``[-delta, delta]``: ``g = clamp(g, -delta, delta)``.

    Optimisers.jl ``ClipGrad``, optax ``clip``.  Put it first in a :func:`chain`.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> rule = optim.chain(optim.ClipGrad(1.0), optim.Descent(0.1))
        >>> state = optim.setup(rule, np.array([1.0, 2.0]))
        >>> optim.update(state, np.array([1.0, 2.0]), np.array([3.0, -0.5]))[1]
        array([0.9 , 2.05])
    """

    delta: float = 10.0

    schedulable: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check(_is_number(self.delta) and self.delta > 0, f"ClipGrad: delta must be a number > 0, got {self.delta!r}")

    def apply(self, state: None, x: Any, g: Any) -> tuple[None, Any]:
        return None, _ar().do("clip", g, -self.delta, self.delta)


def _dtype_totals(arrays: list[Any]) -> dict[str, Any]:
    """``sum(a*a)`` over ``arrays``, one total per dtype (tensorflow does not add float32 to float64)."""
    ar = _ar()
    totals: dict[str, Any] = {}
    for a in arrays:
        name = ar.get_dtype_name(a)
        part = ar.do("sum", a * a)
        totals[name] = part if name not in totals else totals[name] + part
    return totals


@dataclass(frozen=True)
class ClipGlobalNorm(Rule):
    """Rescale the whole gradient tree to 2-norm at most ``max_norm``:
    ``g *= max_norm / max(norm, max_norm)`` with ``norm = sqrt(sum of g^2 over every leaf)``.

    optax ``clip_by_global_norm``, ``torch.nn.utils.clip_grad_norm_`` (which adds 1e-6
    to the norm).  The norm and the factor stay arrays of the gradients' library (no
    transfer to the host, no synchronisation); ``max`` is written arithmetically.
    Put it first in a :func:`chain`.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> model = {"a": np.zeros(1), "b": np.zeros(1)}
        >>> state = optim.setup(optim.chain(optim.ClipGlobalNorm(1.0), optim.Descent(1.0)), model)
        >>> state, model = optim.update(state, model, {"a": np.array([3.0]), "b": np.array([4.0])})
        >>> model
        {'a': array([-0.6]), 'b': array([-0.8])}
    """

    max_norm: float = 1.0

    schedulable: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check(
            _is_number(self.max_norm) and self.max_norm > 0,
            f"ClipGlobalNorm: max_norm must be a number > 0, got {self.max_norm!r}",
        )

    def apply(self, state: None, x: Any, g: Any) -> tuple[None, Any]:
        return None, self.apply_tree([state], [x], [g])[1][0]

    def apply_tree(self, states: list[Any], xs: list[Any], gs: list[Any]) -> tuple[list[Any], list[Any]]:
        ar = _ar()
        totals = _dtype_totals([g for g in gs if g is not None])
        if not totals:
            return states, gs
        factors = {}
        for name in totals:
            # the squared norm in this dtype: the other dtypes' totals cast to it
            sq = sum((t if other == name else ar.astype(t, name)) for other, t in totals.items())
            factors[name] = _at_most_one(ar.do("sqrt", sq), self.max_norm)
        return states, [None if g is None else g * factors[ar.get_dtype_name(g)] for g in gs]


@dataclass(frozen=True)
class WeightDecay(Rule):
    """Add ``weight_decay * x`` to the gradient (L2 regularisation): ``g = g + weight_decay * x``.

    Optimisers.jl ``WeightDecay``, optax ``add_decayed_weights``.  Before the
    optimiser in a :func:`chain` it is L2 regularisation (``chain(WeightDecay(wd),
    Momentum())`` is ``torch.optim.SGD(weight_decay=wd, momentum=...)``); after Adam it
    is decoupled decay (``chain(Adam(lr=1), WeightDecay(wd), Descent(lr))`` is AdamW).
    ``weight_decay`` may be a schedule.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> state = optim.setup(optim.chain(optim.WeightDecay(0.5), optim.Descent(0.1)), np.array([2.0]))
        >>> optim.update(state, np.array([2.0]), np.array([1.0]))[1]
        array([1.8])
    """

    weight_decay: Hyper = 5e-4

    schedulable: ClassVar[tuple[str, ...]] = ("weight_decay",)

    def __post_init__(self) -> None:
        _check_nonnegative("WeightDecay", "weight_decay", self.weight_decay)

    def apply(self, state: None, x: Any, g: Any) -> tuple[None, Any]:
        return None, g + self.weight_decay * x


@dataclass(frozen=True)
class SignDecay(Rule):
    """Add ``kappa * sign(x)`` to the gradient (L1 regularisation): ``g = g + kappa * sign(x)``.

    Optimisers.jl ``SignDecay``.  ``kappa`` may be a schedule.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> state = optim.setup(optim.chain(optim.SignDecay(0.5), optim.Descent(0.1)), np.array([2.0, -1.0]))
        >>> optim.update(state, np.array([2.0, -1.0]), np.array([1.0, 1.0]))[1]
        array([ 1.85, -1.05])
    """

    kappa: Hyper = 1e-3

    schedulable: ClassVar[tuple[str, ...]] = ("kappa",)

    def __post_init__(self) -> None:
        _check_nonnegative("SignDecay", "kappa", self.kappa)

    def apply(self, state: None, x: Any, g: Any) -> tuple[None, Any]:
        return None, g + self.kappa * _ar().do("sign", x)


@dataclass(frozen=True)
class AccumulateGradients(Rule):
    """Apply the mean of ``n`` gradients every ``n`` steps: gradient accumulation.

    The leaf state is ``(running_sum, count)``.  At steps ``n, 2n, ...`` (counting from 1)
    the delta is ``running_sum / n`` and the sum is reset; in between there is no update
    at all (the parameter is left exactly as it is and the rules after it in a
    :func:`chain` do not run, so ``chain(AccumulateGradients(4), Adam())`` advances Adam
    once per 4 steps, as Optimisers.jl's ``AccumGrad`` and optax's ``MultiSteps`` do).
    ``state.step`` still counts every call, and a schedule sees that count.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> state = optim.setup(optim.chain(optim.AccumulateGradients(2), optim.Descent(1.0)), np.zeros(1))
        >>> x = np.zeros(1)
        >>> for g in (1.0, 3.0, 5.0):
        ...     state, x = optim.update(state, x, np.array([g]))
        ...     print(x)
        [0.]
        [-2.]
        [-2.]
    """

    n: int = 1

    schedulable: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check(
            isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
            f"AccumulateGradients: n must be an int >= 1 (the number of gradients to average), got {self.n!r}",
        )

    def init(self, x: Any) -> Any:
        return (_ar().do("zeros_like", x), 0)

    def apply(self, state: tuple, x: Any, g: Any) -> tuple[tuple, Any]:
        total, count = state
        total, count = total + g, count + 1
        if count < self.n:
            return (total, count), None
        return (_ar().do("zeros_like", total), 0), total / self.n


@dataclass(frozen=True)
class Adagrad(Rule):
    """Adagrad: ``acc = acc + g^2; x -= lr * g / (sqrt(acc) + eps)``, ``acc`` starting at
    ``initial_accumulator_value``.

    ``torch.optim.Adagrad`` exactly (``lr_decay=0``).  Optimisers.jl's ``AdaGrad(lr, eps)``
    is ``Adagrad(lr, eps, initial_accumulator_value=eps)``; optax's ``adagrad(lr,
    initial_accumulator_value=a, eps=0)`` is ``Adagrad(lr, eps=0, initial_accumulator_value=a)``
    (optax puts its eps inside the square root).  ``eps`` may be 0 when
    ``initial_accumulator_value > 0``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.Adagrad(lr=0.1), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.829289, 2.170711])
    """

    lr: Hyper = 0.1
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check_lr("Adagrad", self.lr)
        _check_nonnegative("Adagrad", "eps", self.eps, schedulable=False)
        _check_nonnegative("Adagrad", "initial_accumulator_value", self.initial_accumulator_value, schedulable=False)
        _check(
            self.eps > 0 or self.initial_accumulator_value > 0,
            "Adagrad: eps and initial_accumulator_value cannot both be 0 (a zero gradient would divide 0 by 0)",
        )

    def init(self, x: Any) -> Any:
        return _ar().do("zeros_like", x) + self.initial_accumulator_value

    def apply(self, acc: Any, x: Any, g: Any) -> tuple[Any, Any]:
        acc = acc + g * g
        return acc, self.lr * g / (_ar().do("sqrt", acc) + self.eps)


@dataclass(frozen=True)
class AdaBelief(Rule):
    """AdaBelief: ``m = b1*m + (1-b1)*g; s = b2*s + (1-b2)*(g-m)^2 + eps;
    x -= lr * (m/(1-b1^t)) / (sqrt(s/(1-b2^t)) + eps)``, t counting from 1.

    Optimisers.jl ``AdaBelief`` and optax ``adabelief`` (with ``eps_root = eps``).
    The leaf state is ``(m, s, t)``.

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.AdaBelief(lr=0.1), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.772088, 2.227912])
    """

    lr: Hyper = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-16

    def __post_init__(self) -> None:
        _check_lr("AdaBelief", self.lr)
        _betas("AdaBelief", self.betas)
        object.__setattr__(self, "betas", tuple(self.betas))
        _check_eps("AdaBelief", self.eps)

    def init(self, x: Any) -> Any:
        zeros = _ar().do("zeros_like", x)
        return (zeros, zeros, 0)

    def apply(self, state: tuple, x: Any, g: Any) -> tuple[tuple, Any]:
        m, s, t = state
        (b1, b2), eps, t = self.betas, self.eps, t + 1
        m = b1 * m + (1 - b1) * g
        d = g - m
        s = b2 * s + (1 - b2) * (d * d) + eps
        u = (m / (1 - b1**t)) / (_ar().do("sqrt", s / (1 - b2**t)) + eps)
        return (m, s, t), self.lr * u


@dataclass(frozen=True)
class Lion(Rule):
    """Lion: ``x -= lr * sign(b1*m + (1-b1)*g); m = b2*m + (1-b2)*g``.

    Optimisers.jl ``Lion`` and optax ``lion`` (add decoupled decay with
    ``chain(Lion(lr=1), WeightDecay(wd), Descent(lr))``).

    Example:
        >>> import numpy as np
        >>> from abstractdiff import optim
        >>> x, g = np.array([1.0, 2.0]), np.array([3.0, -4.0])
        >>> state = optim.setup(optim.Lion(lr=0.1), x)
        >>> for _ in range(2):
        ...     state, x = optim.update(state, x, g)
        >>> np.round(x, 6)
        array([0.8, 2.2])
    """

    lr: Hyper = 0.001
    betas: tuple[float, float] = (0.9, 0.99)

    def __post_init__(self) -> None:
        _check_lr("Lion", self.lr)
        _betas("Lion", self.betas)
        object.__setattr__(self, "betas", tuple(self.betas))

    def init(self, x: Any) -> Any:
        return _ar().do("zeros_like", x)

    def apply(self, m: Any, x: Any, g: Any) -> tuple[Any, Any]:
        b1, b2 = self.betas
        delta = self.lr * _ar().do("sign", b1 * m + (1 - b1) * g)
        return b2 * m + (1 - b2) * g, delta

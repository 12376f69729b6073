"""Schedules: a hyperparameter as a function of the step count, with optax's semantics.

A schedule is a callable ``schedule(step) -> float``; ``step`` counts the updates
already applied (``state.step``), so the first update uses ``schedule(0)``, as optax's
``count`` does.  Any rule's ``lr`` (and its weight-decay coefficient) may be one::

    from abstractdiff import optim
    rule = optim.Adam(lr=optim.schedules.warmup_cosine(0.0, 1e-3, 100, 10_000))

The functions here return small immutable objects (with a readable ``repr``) that
compute in plain Python floats: evaluating one never touches an array or a device.
A user function of the step works as well, as long as it returns a Python number.

Each function names its optax counterpart; the formulas agree with optax to the last
bits (tested).  One deliberate difference: optax silently turns a non-positive
``transition_steps`` into a constant schedule, these raise ``InvalidArgumentError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..core import InvalidArgumentError

__all__ = ["Schedule", "constant", "cosine", "exponential", "linear", "piecewise", "warmup_cosine"]


def _number(fn: str, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidArgumentError(f"schedules.{fn}: {name} must be a finite number, got {v!r}")
    return float(v)


def _steps(fn: str, name: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InvalidArgumentError(f"schedules.{fn}: {name} must be an int >= {minimum}, got {v!r}")
    return v


class Schedule:
    """Base class of the schedules of this module: ``schedule(step) -> float``."""

    def __call__(self, step: int) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class _Constant(Schedule):
    value: float

    def __call__(self, step: int) -> float:
        return self.value


@dataclass(frozen=True)
class _Linear(Schedule):
    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int

    def __call__(self, step: int) -> float:
        count = min(max(step - self.transition_begin, 0), self.transition_steps)
        frac = 1 - count / self.transition_steps
        return (self.init_value - self.end_value) * frac + self.end_value


@dataclass(frozen=True)
class _Cosine(Schedule):
    init_value: float
    decay_steps: int
    alpha: float
    exponent: float

    def __call__(self, step: int) -> float:
        count = min(step, self.decay_steps)
        decay = 0.5 * (1 + math.cos(math.pi * count / self.decay_steps))
        return self.init_value * ((1 - self.alpha) * decay**self.exponent + self.alpha)


@dataclass(frozen=True)
class _Exponential(Schedule):
    init_value: float
    transition_steps: int
    decay_rate: float
    transition_begin: int
    staircase: bool
    end_value: float | None

    def __call__(self, step: int) -> float:
        count = step - self.transition_begin
        if count <= 0:
            value = self.init_value
        else:
            p = count / self.transition_steps
            value = self.init_value * self.decay_rate ** (math.floor(p) if self.staircase else p)
        if self.end_value is not None:
            value = max(value, self.end_value) if self.decay_rate < 1 else min(value, self.end_value)
        return value


@dataclass(frozen=True)
class _Joined(Schedule):
    """``first`` before ``boundary``, then ``then(step - boundary)`` (optax ``join_schedules``)."""

    first: Schedule
    then: Schedule
    boundary: int

    def __call__(self, step: int) -> float:
        return self.first(step) if step < self.boundary else self.then(step - self.boundary)


@dataclass(frozen=True)
class _Piecewise(Schedule):
    init_value: float
    boundaries_and_scales: tuple[tuple[int, float], ...]

    def __call__(self, step: int) -> float:
        value = self.init_value
        for boundary, scale in self.boundaries_and_scales:
            if step >= boundary:
                value *= scale
        return value


def constant(value: float) -> Schedule:
    """The same value at every step (optax ``constant_schedule``): ``constant(value)(t) = value``.

    Example:
        >>> from abstractdiff.optim import schedules
        >>> schedules.constant(0.1)(1000)
        0.1
    """
    return _Constant(_number("constant", "value", value))


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Linear interpolation (optax ``linear_schedule``): ``linear(init_value, end_value, transition_steps,
    transition_begin=0)``.

    With ``c = clip(t - transition_begin, 0, transition_steps)``:
    ``value(t) = (init_value - end_value) * (1 - c / transition_steps) + end_value``, so
    ``init_value`` up to ``transition_begin``, ``end_value`` from ``transition_begin +
    transition_steps`` on.

    Example:
        >>> from abstractdiff.optim import schedules
        >>> s = schedules.linear(1.0, 0.0, transition_steps=4)
        >>> [s(t) for t in range(6)]
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    return _Linear(
        _number("linear", "init_value", init_value),
        _number("linear", "end_value", end_value),
        _steps("linear", "transition_steps", transition_steps, 1),
        _steps("linear", "transition_begin", transition_begin, 0),
    )


def cosine(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
    """Cosine decay (optax ``cosine_decay_schedule``): ``cosine(init_value, decay_steps, alpha=0.0,
    exponent=1.0)``.

    With ``c = min(t, decay_steps)`` and ``d = 0.5 * (1 + cos(pi * c / decay_steps))``:
    ``value(t) = init_value * ((1 - alpha) * d**exponent + alpha)``; it ends at
    ``alpha * init_value`` and stays there.

    Example:
        >>> from abstractdiff.optim import schedules
        >>> s = schedules.cosine(1.0, decay_steps=4)
        >>> [round(s(t), 6) for t in range(6)]
        [1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0]
    """
    return _Cosine(
        _number("cosine", "init_value", init_value),
        _steps("cosine", "decay_steps", decay_steps, 1),
        _number("cosine", "alpha", alpha),
        _number("cosine", "exponent", exponent),
    )


def exponential(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """Exponential decay (optax ``exponential_decay``): ``exponential(init_value, transition_steps,
    decay_rate, transition_begin=0, staircase=False, end_value=None)``.

    With ``c = t - transition_begin`` and ``p = c / transition_steps`` (``floor(p)`` if
    ``staircase``): ``value(t) = init_value`` for ``c <= 0``, else ``init_value *
    decay_rate**p``; then bounded by ``end_value`` if given (from below when
    ``decay_rate < 1``, from above otherwise).

    Example:
        >>> from abstractdiff.optim import schedules
        >>> s = schedules.exponential(1.0, transition_steps=2, decay_rate=0.5)
        >>> [round(s(t), 6) for t in range(5)]
        [1.0, 0.707107, 0.5, 0.353553, 0.25]
    """
    if not isinstance(staircase, bool):
        raise InvalidArgumentError(f"schedules.exponential: staircase must be a bool, got {staircase!r}")
    rate = _number("exponential", "decay_rate", decay_rate)
    if rate <= 0:
        raise InvalidArgumentError(f"schedules.exponential: decay_rate must be > 0, got {decay_rate!r}")
    return _Exponential(
        _number("exponential", "init_value", init_value),
        _steps("exponential", "transition_steps", transition_steps, 1),
        rate,
        _steps("exponential", "transition_begin", transition_begin, 0),
        staircase,
        None if end_value is None else _number("exponential", "end_value", end_value),
    )


def warmup_cosine(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup, then cosine decay (optax ``warmup_cosine_decay_schedule``):
    ``warmup_cosine(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0, exponent=1.0)``.

    ``linear(init_value, peak_value, warmup_steps)`` for ``t < warmup_steps``, then
    ``cosine(peak_value, decay_steps - warmup_steps, alpha=end_value / peak_value,
    exponent)`` at ``t - warmup_steps``.  ``decay_steps`` counts the warmup too.

    Example:
        >>> from abstractdiff.optim import schedules
        >>> s = schedules.warmup_cosine(0.0, 1.0, warmup_steps=2, decay_steps=6, end_value=0.1)
        >>> [round(s(t), 6) for t in range(8)]
        [0.0, 0.5, 1.0, 0.868198, 0.55, 0.231802, 0.1, 0.1]
    """
    peak = _number("warmup_cosine", "peak_value", peak_value)
    warmup = _steps("warmup_cosine", "warmup_steps", warmup_steps, 0)
    if isinstance(decay_steps, bool) or not isinstance(decay_steps, int) or decay_steps <= warmup:
        raise InvalidArgumentError(
            f"schedules.warmup_cosine: decay_steps (the total length, warmup included) must be an int > "
            f"warmup_steps = {warmup}, got {decay_steps!r}"
        )
    end = _number("warmup_cosine", "end_value", end_value)
    decay = cosine(peak, decay_steps - warmup, alpha=0.0 if peak == 0 else end / peak, exponent=exponent)
    if warmup == 0:
        _number("warmup_cosine", "init_value", init_value)
        return decay
    return _Joined(linear(init_value, peak, warmup), decay, warmup)


def piecewise(init_value: float, boundaries_and_scales: Mapping[int, float] | None = None) -> Schedule:
    """Piecewise constant (optax ``piecewise_constant_schedule``): ``piecewise(init_value,
    boundaries_and_scales)``.

    ``value(t) = init_value * prod(scale for boundary, scale in boundaries_and_scales.items()
    if t >= boundary)``: at each boundary step the value is multiplied by its scale.

    Example:
        >>> from abstractdiff.optim import schedules
        >>> s = schedules.piecewise(1.0, {2: 0.5, 4: 0.1})
        >>> [round(s(t), 6) for t in range(6)]
        [1.0, 1.0, 0.5, 0.5, 0.05, 0.05]
    """
    init = _number("piecewise", "init_value", init_value)
    pairs = dict(boundaries_and_scales or {})
    checked = []
    for boundary, scale in sorted(pairs.items()):
        _steps("piecewise", "a boundary", boundary, 0)
        if _number("piecewise", f"the scale at step {boundary}", scale) < 0:
            raise InvalidArgumentError(f"schedules.piecewise: scales must be >= 0, got {scale!r} at step {boundary}")
        checked.append((boundary, float(scale)))
    return _Piecewise(init, tuple(checked))

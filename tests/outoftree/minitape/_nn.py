"""minitape's variables and models: ``Parameter`` (a mutable holder) and ``Module``."""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from ._core import Array, asarray, matmul, tanh

__all__ = ["Linear", "MLP", "Module", "Parameter"]


class Parameter:
    """A mutable holder of one float :class:`Array`: read and assign ``p.value``.

    ``Parameter(value, name=None, trainable=True)``.  Assignment keeps shape and dtype
    (a ``ValueError`` otherwise).  A frozen parameter (``trainable=False``) is listed
    by its module's ``parameters()`` but not trained.
    """

    def __init__(self, value: Any, name: str | None = None, trainable: bool = True):
        value = Array(value)  # a copy: a Parameter owns its value
        if not np.issubdtype(value.dtype, np.floating):
            raise TypeError(f"a Parameter holds a float array, not {value.dtype}")
        self._value = value
        self.name = name
        self.trainable = trainable

    @property
    def value(self) -> Array:
        return self._value

    @value.setter
    def value(self, new: Any) -> None:
        new = asarray(new)
        if new.shape != self._value.shape or new.dtype != self._value.dtype:
            raise ValueError(
                f"cannot assign a {new.dtype}{new.shape} array to parameter {self.name or ''} of "
                f"{self._value.dtype}{self._value.shape}"
            )
        self._value = new.detach()

    def swap(self, value: Array) -> Array:
        """Hold ``value`` as it is (a recorded array too: differentiation then sees every
        read of the parameter), without checks; return the previous value."""
        old, self._value = self._value, value
        return old

    @property
    def shape(self) -> tuple[int, ...]:
        return self._value.shape

    @property
    def dtype(self) -> np.dtype:
        return self._value.dtype

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return self._value.__array__(dtype, copy)

    def __repr__(self) -> str:
        name = f"{self.name!r}, " if self.name else ""
        frozen = "" if self.trainable else ", trainable=False"
        return f"minitape.Parameter({name}{self._value!r}{frozen})"


class Module:
    """A model: its attributes hold Parameters, Modules, and lists/dicts of them.

    ``parameters()`` lists every Parameter once (frozen ones too); ``named_parameters()``
    gives them dotted names.
    """

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        for name, p in _walk(self, prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def __call__(self, *args: Any) -> Any:
        return self.forward(*args)

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, Parameter]]:
    if isinstance(obj, Parameter):
        yield prefix, obj
    elif isinstance(obj, Module):
        for key, value in vars(obj).items():
            yield from _walk(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, f"{prefix}.{key}" if prefix else str(key))


class Linear(Module):
    """``x @ w + b`` with ``w`` of shape ``(n_in, n_out)``."""

    def __init__(self, n_in: int, n_out: int, *, dtype: str = "float64", seed: int = 0):
        rng = np.random.default_rng(seed)
        self.w = Parameter((rng.normal(size=(n_in, n_out)) / math.sqrt(n_in)).astype(dtype), "w")
        self.b = Parameter(np.zeros(n_out, dtype=dtype), "b")

    def forward(self, x: Any) -> Array:
        return matmul(x, self.w.value) + self.b.value


class MLP(Module):
    """Dense layers with tanh between them; ``frozen_scale`` is a frozen parameter."""

    def __init__(self, sizes: tuple[int, ...], *, dtype: str = "float64", seed: int = 0):
        self.layers = [Linear(a, b, dtype=dtype, seed=seed + i) for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]
        self.scale = Parameter(np.ones((), dtype=dtype), "scale", trainable=False)

    def forward(self, x: Any) -> Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = tanh(x)
        return x * self.scale.value

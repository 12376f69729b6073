"""What a function reads from globals and closures: the key that keeps traces fresh.

A compiling backend (jax ``jit``, ``tf.function``) traces ``f`` once and reuses the trace;
values ``f`` reads by closure or from a global are frozen into it as constants.  An
unprepared operator must not reuse a trace once such a value changed, so the plan cache
of a tracing backend keys each plan on :func:`captures` of ``f`` too: a changed value
gives a new plan, and so a new trace.

What is compared:

* Python numbers, strings, bytes, booleans and ``None`` by value (floats by their exact
  bits), tuples of them element by element;
* numpy arrays by content when small (up to :data:`CONTENT_LIMIT` elements), larger ones
  by identity;
* any other object (another library's array, a function, a model) by identity; such an
  object is also returned in ``alive``, held weakly by the plan, so that a new object
  that reuses a dead one's ``id`` cannot find its plan;
* functions of ``f``'s own module that ``f`` calls through a global or a closure are
  followed (to a small depth), so a helper reading a global is covered as well; a
  library's functions are compared by identity only.

Not seen: values reached through attributes (``self.scale``, ``config.lr``) or inside
mutable containers (a dict's entries), and large numpy arrays changed in place.  Pass
such values to ``f`` as arguments: arguments are traced inputs, never frozen.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import numpy as np

__all__ = ["CONTENT_LIMIT", "captures"]

#: numpy arrays up to this many elements are compared by content, larger ones by identity.
CONTENT_LIMIT = 4096
_MAX_DEPTH = 3
_SCALARS = (bool, int, str, bytes, complex, type(None))


def _value_key(value: Any, alive: list[Any], depth: int, seen: set[int], module: str | None = None) -> Any:
    kind = type(value)
    if kind is types.ModuleType:  # the commonest global (np, jnp, torch): one type test
        return None
    if kind is float:
        return (float, value.hex())
    if isinstance(value, float):
        return (float, value.hex())
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, np.generic):
        return (type(value), value.tobytes())
    if isinstance(value, tuple) and depth < _MAX_DEPTH:
        return (tuple, tuple(_value_key(v, alive, depth + 1, seen, module) for v in value))
    if isinstance(value, np.ndarray) and value.size <= CONTENT_LIMIT and value.dtype != object:
        return (np.ndarray, value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, types.ModuleType):
        return None  # module attributes are not followed (see the module docstring)
    if (
        isinstance(value, (types.FunctionType, functools.partial))
        and depth < _MAX_DEPTH
        and getattr(value, "__module__", None) == module  # the user's own helpers; not a library's internals
    ):
        return ("function", id(value), _function_key(value, alive, depth + 1, seen))
    alive.append(value)
    return ("id", id(value))


_NAMES: dict[types.CodeType, tuple[str, ...]] = {}


def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names a code object (and the lambdas and comprehensions inside it) may read,
    sorted; computed once per code object."""
    names = _NAMES.get(code)
    if names is None:
        found = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found |= set(_code_names(const))
        names = tuple(sorted(found))
        if len(_NAMES) > 4096:  # bounded: code objects of functions made at run time
            _NAMES.clear()
        _NAMES[code] = names
    return names


def _function_key(f: Any, alive: list[Any], depth: int, seen: set[int]) -> tuple:
    if id(f) in seen:
        return ()
    seen.add(id(f))
    if type(f) is types.FunctionType:  # the common case first: one type test
        pass
    elif isinstance(f, functools.partial):
        module = getattr(f.func, "__module__", None)
        parts = (
            tuple(_value_key(a, alive, depth, seen, module) for a in f.args),
            tuple((k, _value_key(v, alive, depth, seen, module)) for k, v in sorted(f.keywords.items())),
        )
        return (parts, _function_key(f.func, alive, depth, seen))
    else:
        if isinstance(f, types.MethodType):
            f = f.__func__
        if not isinstance(f, types.FunctionType):
            return ()
    globals_ = f.__globals__
    module = f.__module__
    out = [
        (name, _value_key(globals_[name], alive, depth, seen, module))
        for name in _code_names(f.__code__)
        if name in globals_
    ]
    for i, cell in enumerate(f.__closure__ or ()):
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
            continue
        out.append((i, _value_key(contents, alive, depth, seen, module)))
    return tuple(out)


def captures(f: Callable[..., Any]) -> tuple[tuple, list[Any]]:
    """``(key, alive)``: a hashable key of the values ``f`` reads from globals and closures,
    and the objects compared by identity (to be held weakly while the key is in use).

    A callable object that wraps a user function (the implicit adapter's wrapper, the
    training loop's bound loss) names it in ``__abstractdiff_wrapped__``.

    Example:
        >>> SCALE = 2.0
        >>> f = lambda x: SCALE * x
        >>> before, _ = captures(f)
        >>> SCALE = 5.0
        >>> captures(f)[0] == before
        False
    """
    alive: list[Any] = []
    # wrappers may wrap wrappers (the training loop's bound loss inside the implicit wrapper)
    for _ in range(8):
        wrapped = getattr(f, "__abstractdiff_wrapped__", None)
        if wrapped is None:
            break
        f = wrapped
    return _function_key(f, alive, 0, set()), alive

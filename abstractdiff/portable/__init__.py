"""Portable translations: numpy/scipy calls each library lacks or takes differently, as data.

A backend-neutral ``f`` calls numpy's names through autoray (``do("logsumexp", x)``,
``anp.linalg.solve``).  autoray finds most of them in the library of the array; where the
library lacks a name, takes other arguments, or has it without a derivative, the
translation here supplies one, built from the library's own differentiable operations.
``docs/guide/portable.md`` is the table of what works where (``abstractdiff.testing._portable``
checks every entry on every backend).

One module per library (``abstractdiff.portable.torch``...), named by autoray's name of the
library, holds everything abstractdiff knows of that library's numpy compatibility: its
``translations()`` returns a :class:`Table`.  Nothing is registered when a module is
imported.  :func:`apply` registers a table into autoray, once per process, and is what
creating a backend does (:class:`abstractdiff._hooks.AdapterHooks`: the numpy table, which
every backend's ``f`` meets in its data, and the table of the adapter's first module).  Only
names numpy users never reach are changed: a table registers functions for its own
library's arrays (and the numpy table two names numpy lacks), never numpy's own functions.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

__all__ = ["Table", "apply", "applied", "table"]


@dataclass(frozen=True)
class Table:
    """The translations of one library, as autoray registers them.

    ``functions`` maps an autoray name (numpy's, or ``"scipy.special.erf"``) to a function
    taking numpy's arguments; ``wrapped`` maps a name to a wrapper of autoray's own function
    of that name (``autoray.register_function(..., wrap=True)``); ``dtype_name`` replaces
    autoray's name of the library's dtypes; ``dispatch`` maps a name to the dispatcher that
    picks the argument whose library autoray calls.
    """

    library: str
    functions: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    wrapped: Mapping[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = field(default_factory=dict)
    dtype_name: Callable[[Any], str] | None = None
    dispatch: Mapping[str, Callable[..., Any]] = field(default_factory=dict)

    def names(self) -> set[str]:
        return set(self.functions) | set(self.wrapped)


_LOCK = threading.Lock()
_APPLIED: dict[str, Table] = {}


def _module_of(library: str) -> Any | None:
    try:
        return importlib.import_module(f"{__name__}.{library}")
    except ModuleNotFoundError as err:
        if err.name == f"{__name__}.{library}":
            return None  # no translations for this library (a third-party adapter's)
        raise


def table(library: str) -> Table | None:
    """The translations of ``library`` (autoray's name: ``"torch"``), or ``None`` where there are none.

    Builds the table, importing the library; registers nothing.
    """
    module = _module_of(library)
    return None if module is None else module.translations()


def apply(libraries: Iterable[str]) -> None:
    """Register the translations of each of ``libraries`` into autoray, once per process.

    Safe to call again and from several threads: a table is registered once.
    """
    for library in libraries:
        if library in _APPLIED:
            continue
        with _LOCK:
            if library in _APPLIED:
                continue
            found = table(library)
            if found is not None:
                _register(found)
                _APPLIED[library] = found


def applied() -> Mapping[str, Table]:
    """The tables registered in this process so far, by library."""
    return dict(_APPLIED)


def _register(t: Table) -> None:
    import autoray
    from autoray.autoray import register_dispatch

    for name, fn in t.functions.items():
        autoray.register_function(t.library, name, fn)
    for name, wrapper in t.wrapped.items():
        autoray.register_function(t.library, name, wrapper, wrap=True)
    if t.dtype_name is not None:
        autoray.get_dtype_name.register(t.library, t.dtype_name)
    for name, dispatcher in t.dispatch.items():
        register_dispatch(name, dispatcher)

"""``ad.scope``: the context arithmetic on backend arrays needs outside the operators."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from . import _pytree as pytree

__all__ = ["scope"]


@contextlib.contextmanager
def scope(*trees: Any) -> Iterator[None]:
    """Keep the precision (and placement) of arrays in arithmetic you write yourself.

    ``with ad.scope(*trees): ...`` enters, for every library whose arrays are leaves of
    ``trees``, the context its adapter's ``scope`` hook names.  The operators do this
    themselves; code that works on their results outside them needs it where a library's
    default would change the numbers.  jax is the case: with its x64 mode off (the
    default), ``p - lr * g`` on float64 jax arrays silently computes in float32, and
    ``ad.scope(p, g)`` keeps it in float64.  The scope is local, so no library's global
    configuration is changed; for numpy, torch and the others it does nothing.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> p = {"w": np.ones(2)}
        >>> g = ad.gradient("finite_differences", lambda p: (p["w"] ** 2).sum(), p)
        >>> with ad.scope(p, g):
        ...     p = {"w": p["w"] - 0.1 * g["w"]}
        >>> p["w"].dtype
        dtype('float64')
    """
    from ._registry import backend_for

    owners: dict[int, tuple[Any, list]] = {}
    for a in pytree.tree_leaves(trees, none_is_leaf=False):
        if type(a) is np.ndarray or isinstance(a, (bool, int, float, complex, str, np.generic)):
            continue
        b = backend_for(a)
        if b is not None:
            owners.setdefault(id(b), (b, []))[1].append(a)
    with contextlib.ExitStack() as stack:
        for b, arrays in owners.values():
            stack.enter_context(b.scope(arrays))
        yield

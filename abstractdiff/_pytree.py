"""abstractdiff's one pytree registry, used wherever the package flattens a tree.

optree's functions in the ``"abstractdiff"`` namespace: optree's own containers (dict,
list, tuple, namedtuple, None...) and every class of its global registry, plus the
containers of the AD libraries' own registries (a class registered with
``jax.tree_util``: Equinox modules, ``register_dataclass`` classes, Flax structs; one
registered with ``torch.utils._pytree``).  Those are found through the adapters' pytree
hook (:meth:`abstractdiff.protocol.Adapter.pytree_node`) the first time a flatten meets
one as a leaf, and registered here, in abstractdiff's namespace only: optree's global
registry, which other code reads, is never changed.  So ``x``, ``args``, aux, gradients,
optimiser state, checkpoints and ``ad.to_numpy`` all see such a class as its library does.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import optree

NAMESPACE = "abstractdiff"

PyTreeSpec = optree.PyTreeSpec

#: Leaf types known not to be another registry's container: arrays and Python scalars
#: met before, and classes the adapters' hooks said no to.  A flatten whose leaves are all
#: of these types costs one set difference more than optree's.
_KNOWN_LEAVES: set[type] = {bool, int, float, complex, str, bytes, type(None), np.ndarray}
_lock = threading.Lock()


class Static:
    """A leaf that stays static data however it looks: a Python float an Equinox module holds
    (``eqx.filter_grad`` differentiates arrays only).  An adapter's flatten returns its
    children boxed, its unflatten unboxes them (:func:`unbox`); equal by exact value, so that
    the plan cache keys on it."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def _key(self) -> Any:
        v = self.value
        return (type(v), float.hex(v)) if isinstance(v, float) else (type(v), v)

    def __eq__(self, other: object) -> bool:
        return type(other) is Static and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


def unbox(children: Any) -> list:
    """``children`` with each :class:`Static` box replaced by its value."""
    return [c.value if type(c) is Static else c for c in children]


def _no_foreign_nodes(obj: Any) -> None:
    return None


#: ``finder(obj) -> (registry, flatten, unflatten) | None``: the adapters' pytree hook, asked
#: through the registry (:func:`abstractdiff._registry.foreign_pytree_node`), which installs
#: itself here when imported (the registry depends on this module, not the other way round).
_node_finder: Callable[[Any], tuple | None] = _no_foreign_nodes


def set_node_finder(finder: Callable[[Any], tuple | None]) -> None:
    """Install the function that asks the adapters' pytree hook (the registry does, at import)."""
    global _node_finder
    _node_finder = finder


def _discover(leaves: list) -> bool:
    """Register the leaf classes that an imported library's registry knows as containers;
    whether any was (the tree must then be flattened again)."""
    new = set(map(type, leaves)) - _KNOWN_LEAVES
    if not new:
        return False
    found = False
    for cls in new:
        obj = next(leaf for leaf in leaves if type(leaf) is cls)
        # an array (of any library) is a leaf; only the hook knows the other classes
        node = None if hasattr(obj, "shape") and hasattr(obj, "dtype") else _node_finder(obj)
        with _lock:
            if node is None:
                _KNOWN_LEAVES.add(cls)
                continue
            flatten, unflatten = node[1], node[2]
            try:
                optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)
            except ValueError:  # registered meanwhile, by another thread
                pass
            found = True
    return found


def tree_flatten(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None, *, none_is_leaf: bool = False
) -> tuple[list, PyTreeSpec]:
    """``optree.tree_flatten`` in abstractdiff's registry."""
    while True:
        leaves, treedef = optree.tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)
        if not _discover(leaves):
            return leaves, treedef


def tree_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None, *, none_is_leaf: bool = False) -> list:
    """``optree.tree_leaves`` in abstractdiff's registry."""
    return tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf)[0]


def tree_structure(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None, *, none_is_leaf: bool = False
) -> PyTreeSpec:
    """``optree.tree_structure`` in abstractdiff's registry."""
    return tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf)[1]


def tree_unflatten(treedef: PyTreeSpec, leaves: Any) -> Any:
    """``optree.tree_unflatten`` (a treedef knows its namespace)."""
    return optree.tree_unflatten(treedef, leaves)


def tree_map(
    f: Callable[..., Any], tree: Any, *rests: Any, is_leaf: Callable[[Any], bool] | None = None,
    none_is_leaf: bool = False,
) -> Any:
    """``optree.tree_map`` in abstractdiff's registry."""
    leaves, treedef = tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf)  # registers foreign containers
    if not rests:
        return treedef.unflatten([f(leaf) for leaf in leaves])
    return treedef.unflatten(list(map(f, leaves, *(treedef.flatten_up_to(r) for r in rests))))


def tree_flatten_with_path(
    tree: Any, is_leaf: Callable[[Any], bool] | None = None, *, none_is_leaf: bool = False
) -> tuple[list, list, PyTreeSpec]:
    """``optree.tree_flatten_with_path`` in abstractdiff's registry."""
    tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf)
    return optree.tree_flatten_with_path(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)

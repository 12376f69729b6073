"""Batched tangents: ``ad.Batch(dx_1, ..., dx_k)`` pushed forward or pulled back in one call.

A pushforward (or pullback) closure given a :class:`Batch` returns a :class:`Batch` of the
results, computed by the backend's batched hooks
(:meth:`~abstractdiff._derived.DerivedOperators.flat_value_and_batched_pushforward` and
``..._pullback``): one vectorised call where the library has ``vmap`` (jax, torch,
TensorFlow), a loop over the members otherwise.  Internally a batch travels *stacked*:
one array per leaf with a leading batch axis of length ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Iterator, overload

from . import _pytree as pytree
from ._arrays import ar, dtype_name, shape_of
from ._errors import InvalidArgumentError, ShapeMismatchError
from ._tree import is_array

__all__ = ["Batch"]


def _batch_axis(leaf: Any) -> int | None:
    """The length of ``leaf``'s leading axis, ``None`` for a scalar or a non-array."""
    if not is_array(leaf):
        return None
    shape = shape_of(leaf)
    return shape[0] if shape else None


class Batch(Sequence):
    """``k`` tangents (or cotangents) at once: ``Batch(dx_1, ..., dx_k)``.

    Pass a batch to the closure a pushforward or pullback returns and get a batch of the
    results: ``ad.pushforward(b, f, x)(Batch(dx_1, ..., dx_k)) -> Batch(dy_1, ..., dy_k)``.
    Each member is a tangent of the usual form (a tree shaped like ``x``; for a pullback,
    an array shaped like ``y``).  A batch is a sequence (``len``, iteration, indexing) and
    a single leaf to pytree libraries, never a container of tangents.

    ``Batch.stacked(tree)`` builds one from a tree whose array leaves share a leading
    batch axis (what ``jax.vmap`` takes), and ``batch.stack()`` returns that stacked tree.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> jvp = ad.pushforward("finite_differences", lambda x: 3 * x, np.zeros(2))
        >>> dys = jvp(ad.Batch(np.array([1.0, 0.0]), np.array([0.0, 1.0])))
        >>> len(dys), np.round(dys.stack(), 6)
        (2, array([[3., 0.],
               [0., 3.]]))
    """

    __slots__ = ("_members", "_stacked", "_k")

    def __init__(self, *members: Any):
        if not members:
            raise InvalidArgumentError(
                "Batch() needs at least one member: Batch(dx_1, ..., dx_k), or Batch.stacked(tree) "
                "for a tree with a leading batch axis"
            )
        self._members: tuple[Any, ...] | None = members
        self._stacked: Any = None
        self._k = len(members)

    @classmethod
    def stacked(cls, tree: Any) -> Batch:
        """The batch whose members are ``tree``'s slices along the leading axis of every array leaf.

        Raises:
            ShapeMismatchError: the array leaves do not share a leading axis (or one is a scalar).
            InvalidArgumentError: the tree has no array leaf, or the batch axis has length 0.
        """
        leaves = pytree.tree_leaves(tree)
        arrays = [leaf for leaf in leaves if is_array(leaf)]
        if not arrays:
            raise InvalidArgumentError(
                f"Batch.stacked needs a tree of arrays with a leading batch axis, got {type(tree).__name__} "
                f"with no array leaf"
            )
        sizes = [_batch_axis(leaf) for leaf in arrays]
        if None in sizes or len(set(sizes)) != 1:
            shapes = [shape_of(leaf) for leaf in arrays]
            raise ShapeMismatchError(
                f"Batch.stacked needs every array leaf to have the same leading (batch) axis, got leaves "
                f"of shapes {shapes}"
            )
        if sizes[0] == 0:
            raise InvalidArgumentError("Batch.stacked got a batch axis of length 0; a Batch needs at least one member")
        batch = cls.__new__(cls)
        batch._members, batch._stacked, batch._k = None, tree, sizes[0]
        return batch

    @property
    def is_stacked(self) -> bool:
        """Whether the batch holds the stacked tree (built by :meth:`stacked`) rather than its members."""
        return self._stacked is not None

    def stack(self) -> Any:
        """The members stacked leaf by leaf along a new leading axis (one tree, ``k`` first).

        Raises:
            ShapeMismatchError: the members differ in structure or leaf shapes.
        """
        if self._stacked is None:
            members = self._members or ()
            leaves0, treedef = pytree.tree_flatten(members[0])
            columns: list[list[Any]] = [[leaf] for leaf in leaves0]
            for j, member in enumerate(members[1:], start=1):
                leaves, other = pytree.tree_flatten(member)
                if other != treedef:
                    raise ShapeMismatchError(f"Batch member {j} has structure {other}, member 0 has {treedef}")
                for i, leaf in enumerate(leaves):
                    if is_array(leaf) and shape_of(leaf) != shape_of(leaves0[i]):
                        raise ShapeMismatchError(
                            f"Batch member {j} leaf {i} has shape {shape_of(leaf)}, member 0's has "
                            f"{shape_of(leaves0[i])}"
                        )
                    columns[i].append(leaf)
            self._stacked = pytree.tree_unflatten(treedef, [_stack(column) for column in columns])
        return self._stacked

    def _member(self, i: int) -> Any:
        if self._members is not None:
            return self._members[i]
        return pytree.tree_map(lambda leaf: leaf[i] if _batch_axis(leaf) is not None else leaf, self._stacked)

    # ------------------------------------------------------------------ sequence
    def __len__(self) -> int:
        return self._k

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> Batch: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return Batch(*(self._member(i) for i in range(self._k)[index]))
        i = range(self._k)[index]  # IndexError, negative indices, like a tuple
        return self._member(i)

    def __iter__(self) -> Iterator[Any]:
        return (self._member(i) for i in range(self._k))

    def __repr__(self) -> str:
        if self._members is not None:
            return f"Batch({', '.join(repr(m) for m in self._members)})"
        return f"Batch.stacked({self._stacked!r})"


def _stack(column: list[Any]) -> Any:
    if not all(is_array(v) or isinstance(v, (int, float, complex)) for v in column):
        return column[0]  # a static leaf (a string, None...): kept as it is
    return ar().do("stack", column)


# --------------------------------------------------------------- checks and conversion
def _member_error(err: ShapeMismatchError, j: int) -> ShapeMismatchError:
    return ShapeMismatchError(f"Batch member {j}: {err}")


def stacked_tangents(b: Any, fn: Any, xs: list, batch: Batch) -> list:
    """The batch of tangents as native arrays, one per float leaf of ``x``, shaped ``(k,) + leaf``.

    Members are checked one by one (the error names the member and the leaf); a stacked
    batch is checked leaf by leaf without being split.
    """
    k = len(batch)
    if not batch.is_stacked:
        members = [b.tangents(fn, xs, m, f"Batch member {j}: tangent") for j, m in enumerate(batch)]
        with b.scope(members[0]):
            return [ar().do("stack", [m[i] for m in members]) for i in range(len(xs))]
    tree = batch.stack()
    try:
        leaves = fn.x_treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        raise ShapeMismatchError(
            f"a stacked Batch of tangents must have the structure of x, {fn.x_treedef}, but has "
            f"{pytree.tree_structure(tree)}"
        ) from err
    out = []
    for i, x in zip(fn.diff_index, xs):
        t = leaves[i]
        want = (k,) + shape_of(x)
        got = shape_of(t) if is_array(t) else type(t).__name__
        if got != want:
            raise ShapeMismatchError(
                f"stacked Batch tangent leaf at position {i} has shape {got}, expected {want} "
                f"(the batch axis of length {k}, then x's leaf shape)"
            )
        out.append(b.convert(t, dtype_name(x)))
    return out


def stacked_cotangents(b: Any, y: Any, batch: Batch) -> Any:
    """The batch of cotangents as one native array shaped ``(k,) + y.shape``, in ``y``'s dtype."""
    if not batch.is_stacked:
        members = []
        for j, dy in enumerate(batch):
            try:
                members.append(b.cotangent(dy, y))
            except ShapeMismatchError as err:
                raise _member_error(err, j) from None
        with b.scope(members):
            return ar().do("stack", members)
    dys = batch.stack()
    want = (len(batch),) + shape_of(y)
    got = shape_of(dys) if is_array(dys) else type(dys).__name__
    if got != want:
        raise ShapeMismatchError(
            f"a stacked Batch of cotangents must be one array of shape {want} (the batch axis, then "
            f"f's output shape), got {got}"
        )
    return b.convert(dys, dtype_name(y))


class BatchedPushforward:
    """The batched side of a pushforward closure: its hook is called on first use only."""

    __slots__ = ("b", "fn", "xs", "data", "_jvps")

    def __init__(self, b: Any, fn: Any, xs: list, data: list):
        self.b, self.fn, self.xs, self.data, self._jvps = b, fn, xs, data, None

    def __call__(self, batch: Batch) -> Batch:
        ts = stacked_tangents(self.b, self.fn, self.xs, batch)
        if self._jvps is None:
            self._jvps = self.b.flat_value_and_batched_pushforward(self.fn, self.xs, self.data)[2]
        return Batch.stacked(self._jvps(ts))


class BatchedPullback:
    """The batched side of a pullback closure: its hook is called on first use only."""

    __slots__ = ("b", "fn", "xs", "data", "y", "_vjps")

    def __init__(self, b: Any, fn: Any, xs: list, data: list, y: Any):
        self.b, self.fn, self.xs, self.data, self.y, self._vjps = b, fn, xs, data, y, None

    def __call__(self, batch: Batch) -> Batch:
        b = self.b
        dys = stacked_cotangents(b, self.y, batch)
        if self._vjps is None:
            self._vjps = b.flat_value_and_batched_pullback(self.fn, self.xs, self.data)[2]
        dxs = b.complete_batched(self._vjps(dys), self.xs, len(batch))
        return Batch.stacked(self.fn.unflatten_x(dxs))

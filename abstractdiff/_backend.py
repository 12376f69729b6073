"""The backend protocol: two primitives in, the whole operator family out.

An adapter subclasses :class:`Backend` and implements one or both primitives on *flat*
functions (see :mod:`abstractdiff._tree`):

* ``flat_value_and_pullback(fn, xs, data) -> (y, aux, vjp)`` with ``vjp(dy) -> [dx, ...]``
* ``flat_value_and_pushforward(fn, xs, data) -> (y, aux, jvp)`` with ``jvp([dx, ...]) -> dy``

plus ``asarray``/``is_native`` to move arrays in.  ``fn(xs, data)`` returns ``(y, aux)``
where ``y`` is one array.  ``vjp`` may return ``None`` for an unconnected leaf; the core
turns it into zeros.  Everything else (gradient, jacobian, hessian, hvp, derivative and
the pytree handling) is derived here; an adapter overrides a ``flat_*`` operator only
where its library has a faster native route.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import optree

from ._errors import (
    DeviceError,
    ModeMismatchError,
    NonDifferentiableInputError,
    NonScalarOutputError,
    ShapeMismatchError,
)
from ._tree import FlatFunction, PlanCache, PyTree, flatten_call, is_array

__all__ = ["Backend"]

FlatFn = Callable[[list, list], tuple]


def _ar() -> Any:
    # autoray costs ~90 ms to import: load it on first use, not with abstractdiff.
    import autoray

    return autoray


def shape_of(a: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def size_of(a: Any) -> int:
    return math.prod(shape_of(a))


def dtype_name(a: Any) -> str:
    return _ar().get_dtype_name(a)


def check_scalar(y: Any, operator: str = "gradient") -> None:
    if y.shape == ():  # the common case, cheaply (torch.Size and tf.TensorShape compare to ())
        return
    shape = shape_of(y)
    if shape != ():
        raise NonScalarOutputError(
            f"{operator} needs f to return a scalar (shape ()), but f returned an array of "
            f"shape {shape}; reduce it to a scalar (e.g. .sum()), or use jacobian, pullback "
            f"or pushforward for vector-valued functions"
        )


class GradientFunction:
    """``xs -> gradient of fn at xs`` as a flat function, for second-order operators."""

    def __init__(self, backend: Backend, fn: FlatFn):
        self.backend, self.fn, self.cache = backend, fn, {}

    def __call__(self, xs: list, data: list) -> tuple[Any, None]:
        _, _, grads = self.backend.flat_value_and_gradient(self.fn, xs, data)
        return self.backend.complete(grads, xs)[0], None


class GradientDotTangent:
    """``xs -> <gradient of fn at xs, tangents>``: its gradient is the Hessian-vector product."""

    def __init__(self, backend: Backend, fn: FlatFn, tangents: list):
        self.backend, self.fn, self.tangents, self.cache = backend, fn, tangents, {}

    def __call__(self, xs: list, data: list) -> tuple[Any, None]:
        ar = _ar()
        _, _, grads = self.backend.flat_value_and_gradient(self.fn, xs, data)
        grads = self.backend.complete(grads, xs)
        total = sum(ar.do("sum", g * t) for g, t in zip(grads, self.tangents))
        return total, None


class Backend:
    """Base class of every AD backend.

    Subclasses set :attr:`name`, implement at least one primitive
    (:meth:`flat_value_and_pullback` or :meth:`flat_value_and_pushforward`) and the
    array hooks (:meth:`asarray`, :meth:`is_native`).  Users call the pytree-level
    operators (:meth:`gradient`, :meth:`jacobian`, ...) or the module functions
    ``ad.gradient(backend, ...)``, which are the same thing.

    ``Backend(*, device=None, **options)``; ``b.options`` holds them, and two backends
    of the same class and options compare equal.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> class Doubling(ad.Backend):  # a toy reverse mode for f(x) = sum(x**2) only
        ...     name = "doubling"
        ...     def flat_value_and_pullback(self, fn, xs, data):
        ...         y, aux = fn(xs, data)
        ...         return y, aux, lambda dy: [2 * x * dy for x in xs]
        >>> b = Doubling()
        >>> b.gradient(lambda x: (x**2).sum(), np.array([1.0, 3.0]))   # derived by the core
        array([2., 6.])
    """

    #: Registry name of the backend ("torch", "jax", ...).
    name: ClassVar[str] = "backend"
    #: The pip extra that installs the backend's library, for error messages.
    extra: ClassVar[str | None] = None

    def __init__(self, *, device: str | None = None, **options: Any):
        self.device = self.normalise_device(device)
        self.options: dict[str, Any] = {"device": self.device, **options}
        self._plans = PlanCache()

    # ---------------------------------------------------------------- identity
    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options == self.options  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted((k, repr(v)) for k, v in self.options.items()))))

    # ---------------------------------------------------------------- devices
    def devices(self) -> list[str]:
        """Names of the devices this backend can run on here (``"cpu"`` first)."""
        return ["cpu"]

    def normalise_device(self, device: str | None) -> str:
        """Map a user spelling (``None``, ``"gpu"``, ``"cuda"``...) to a name from :meth:`devices`."""
        if device is None:
            return "cpu"
        name = str(device).lower()
        available = self.devices()
        if name in available:
            return name
        raise DeviceError(
            f"{self.name} backend: device {device!r} is not available here; available "
            f"devices: {', '.join(available)}"
        )

    # ---------------------------------------------------------------- arrays
    def is_native(self, a: Any) -> bool:
        """Whether ``a`` is already this backend's array type (traced values included)."""
        return isinstance(a, np.ndarray)

    def asarray(self, a: Any, dtype: str | None = None) -> Any:
        """Convert ``a`` (numpy or a Python number) to this backend's array on its device.

        The dtype is preserved unless ``dtype`` (a name such as ``"float32"``) is given.
        """
        return np.asarray(a, dtype=dtype)

    def convert(self, a: Any, dtype: str | None = None) -> Any:
        """``a`` as a native array: native arrays pass through, anything else is converted."""
        if self.is_native(a):
            return a
        if isinstance(a, float):
            a = np.asarray(a, dtype=np.float64)
        elif not isinstance(a, np.ndarray):
            from ._convert import to_numpy

            a = to_numpy(a)
        return self.asarray(a, dtype)

    def zeros_like(self, a: Any) -> Any:
        return _ar().do("zeros_like", a)

    def ones_like(self, a: Any) -> Any:
        return _ar().do("ones_like", a)

    def one_hot(self, like: Any, index: int) -> Any:
        """An array shaped and typed like ``like`` with a single one at flat ``index``."""
        e = np.zeros(size_of(like), dtype=dtype_name(like))
        e[index] = 1
        return self.asarray(e.reshape(shape_of(like)))

    def complete(self, grads: Sequence[Any], xs: Sequence[Any]) -> list[Any]:
        """Replace ``None`` (an unconnected leaf) by zeros shaped like the input."""
        return [self.zeros_like(x) if g is None else g for g, x in zip(grads, xs)]

    # ------------------------------------------------------------- primitives
    def flat_value_and_pullback(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """Reverse mode: ``(y, aux, vjp)`` with ``vjp(dy) -> list of dx (None = zeros)``."""
        raise NotImplementedError(f"{self.name} backend has no reverse mode")

    def flat_value_and_pushforward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        """Forward mode: ``(y, aux, jvp)`` with ``jvp(list of dx) -> dy``."""
        raise NotImplementedError(f"{self.name} backend has no forward mode")

    @property
    def has_reverse(self) -> bool:
        return type(self).flat_value_and_pullback is not Backend.flat_value_and_pullback

    @property
    def has_forward(self) -> bool:
        return type(self).flat_value_and_pushforward is not Backend.flat_value_and_pushforward

    # ---------------------------------------------- derived flat operators
    def flat_value_and_gradient(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, list]:
        """``(y, aux, grads)``: a pullback seeded with one, or pushforwards over a basis."""
        if self.has_reverse:
            y, aux, vjp = self.flat_value_and_pullback(fn, xs, data)
            check_scalar(y)
            return y, aux, vjp(self.ones_like(y))
        y, aux, jvp = self.flat_value_and_pushforward(fn, xs, data)
        check_scalar(y)
        return y, aux, [self._forward_columns(jvp, xs, k, y) for k in range(len(xs))]

    def flat_prepare_value_and_gradient(self, fn: FlatFn, xs: list, data: list) -> Callable[[list, list], tuple]:
        """``run(xs, data) -> (y, aux, grads)`` for repeated calls on inputs shaped like ``xs``/``data``.

        Used by ``ad.prepare_value_and_gradient``.  Adapters override it to hoist
        per-call work (cache lookups, dtype scopes, compilation) out of the loop.
        """
        return lambda xs, data: self.flat_value_and_gradient(fn, xs, data)

    def _forward_columns(self, jvp: Callable, xs: list, k: int, y: Any) -> Any:
        """``d y / d xs[k]`` by one pushforward per element of ``xs[k]``; shape ``y.shape + xs[k].shape``."""
        ar = _ar()
        zeros = [self.zeros_like(x) for x in xs]
        cols = []
        for j in range(size_of(xs[k])):
            tangents = list(zeros)
            tangents[k] = self.one_hot(xs[k], j)
            cols.append(jvp(tangents))
        stacked = ar.do("reshape", ar.do("stack", cols), (len(cols), size_of(y)))
        return ar.do("reshape", ar.do("transpose", stacked), shape_of(y) + shape_of(xs[k]))

    def flat_jacobian(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, list]:
        """``(y, [J_k])`` with ``J_k.shape == y.shape + xs[k].shape``."""
        ar = _ar()
        n_in = sum(size_of(x) for x in xs)
        if self.has_reverse:
            y, _, vjp = self.flat_value_and_pullback(fn, xs, data)
            if not (self.has_forward and size_of(y) > n_in):
                rows = [self.complete(vjp(self.one_hot(y, i)), xs) for i in range(size_of(y))]
                jacs = [
                    ar.do("reshape", ar.do("stack", [row[k] for row in rows]), shape_of(y) + shape_of(x))
                    if rows
                    else self.asarray(np.zeros(shape_of(y) + shape_of(x), dtype=dtype_name(x)))
                    for k, x in enumerate(xs)
                ]
                return y, jacs
        y, _, jvp = self.flat_value_and_pushforward(fn, xs, data)
        return y, [self._forward_columns(jvp, xs, k, y) for k in range(len(xs))]

    def flat_hessian(self, fn: FlatFn, xs: list, data: list) -> Any:
        """Hessian of scalar ``fn`` with respect to its single input, ``x.shape * 2``."""
        _, jacs = self.flat_jacobian(GradientFunction(self, fn), xs, data)
        return jacs[0]

    def flat_hvp(self, fn: FlatFn, xs: list, data: list, tangents: list) -> list:
        """Hessian-vector product: forward-over-reverse when possible, else reverse-over-reverse."""
        if self.has_forward and len(xs) == 1:
            _, _, jvp = self.flat_value_and_pushforward(GradientFunction(self, fn), xs, data)
            return [jvp(tangents)]
        _, _, hv = self.flat_value_and_gradient(GradientDotTangent(self, fn, tangents), xs, data)
        return self.complete(hv, xs)

    # --------------------------------------------------------------- plumbing
    def flatten(
        self, f: Callable[..., Any], x: PyTree, args: tuple, has_aux: bool = False
    ) -> tuple[FlatFunction, list, list]:
        """The cached flat function of ``f`` and the native leaves of ``x`` and ``args``."""
        if getattr(x, "_abstractdiff_params", False):
            raise ModeMismatchError(
                f"ad.Params reached the explicit {self.name!r} backend; implicit parameters "
                f"need the implicit adapter: use ad.Implicit({self.name!r}) (or "
                f"ad.backend('implicit', inner={self.name!r})), or pass the arrays "
                f"themselves as x to differentiate explicitly"
            )
        if not callable(f):
            raise TypeError(f"f must be callable, got {type(f).__name__}")
        fn, xs, data = flatten_call(self._plans, f, x, args, has_aux)
        if not xs:
            kinds = sorted({type(v).__name__ + (f"[{v.dtype}]" if is_array(v) else "") for v in optree.tree_leaves(x)})
            raise NonDifferentiableInputError(
                f"x has no floating-point leaf to differentiate (its leaves are: "
                f"{', '.join(kinds) or 'none'}); pass float arrays (e.g. "
                f"np.asarray(x, dtype=np.float64)), and pass non-differentiable data as "
                f"extra arguments after x"
            )
        return fn, [self.convert(v) for v in xs], [self.convert(v) for v in data]

    def cotangent(self, dy: Any, y: Any) -> Any:
        """``dy`` checked against ``y``'s shape and converted to a native array of its dtype."""
        if not (is_array(dy) or isinstance(dy, (int, float))):
            raise ShapeMismatchError(
                f"cotangent must be an array shaped like f's output {shape_of(y)}, got "
                f"{type(dy).__name__}"
            )
        got = shape_of(dy) if is_array(dy) else ()
        if got != shape_of(y):
            raise ShapeMismatchError(
                f"cotangent has shape {got} but f's output has shape {shape_of(y)}; "
                f"pass an array shaped like y"
            )
        if self.is_native(dy) and dtype_name(dy) == dtype_name(y):
            return dy
        return self.convert(np.asarray(dy) if not self.is_native(dy) else dy, dtype_name(y))

    def tangents(self, fn: FlatFunction, xs: list, dx: PyTree, what: str = "tangent") -> list:
        """The float leaves of ``dx``, a tree shaped like ``x``, checked and converted."""
        try:
            leaves = fn.x_treedef.flatten_up_to(dx)
        except (ValueError, TypeError) as err:
            got = optree.tree_structure(dx)
            raise ShapeMismatchError(
                f"{what} must have the structure of x, {fn.x_treedef}, but has {got}"
            ) from err
        out = []
        for i, x in zip(fn.diff_index, xs):
            t = leaves[i]
            if not (is_array(t) or isinstance(t, (int, float))):
                raise ShapeMismatchError(
                    f"{what} leaf at position {i} must be an array of shape {shape_of(x)}, "
                    f"got {type(t).__name__}"
                )
            got_shape = shape_of(t) if is_array(t) else ()
            if got_shape != shape_of(x):
                raise ShapeMismatchError(
                    f"{what} leaf at position {i} has shape {got_shape} but x's leaf has "
                    f"shape {shape_of(x)}"
                )
            if self.is_native(t) and dtype_name(t) == dtype_name(x):
                out.append(t)
            else:
                out.append(self.convert(np.asarray(t) if not self.is_native(t) else t, dtype_name(x)))
        return out

    # ------------------------------------------------------- public operators
    def value_and_gradient(
        self, f: Callable[..., Any], x: PyTree, *args: Any, has_aux: bool = False
    ) -> tuple[Any, PyTree]:
        """``(y, g)``, or ``((y, aux), g)`` with ``has_aux``; see :func:`abstractdiff.value_and_gradient`."""
        fn, xs, data = self.flatten(f, x, args, has_aux)
        y, aux, grads = self.flat_value_and_gradient(fn, xs, data)
        check_scalar(y)
        g = fn.unflatten_x(self.complete(grads, xs))
        return ((y, aux), g) if has_aux else (y, g)

    def gradient(self, f: Callable[..., Any], x: PyTree, *args: Any, has_aux: bool = False) -> Any:
        """``g``, or ``(g, aux)`` with ``has_aux``; see :func:`abstractdiff.gradient`."""
        value, g = self.value_and_gradient(f, x, *args, has_aux=has_aux)
        return (g, value[1]) if has_aux else g

    def value_and_pullback(self, f: Callable[..., Any], x: PyTree, *args: Any) -> tuple[Any, Callable]:
        """``(y, vjp)`` with ``vjp(dy) -> dx``; see :func:`abstractdiff.value_and_pullback`."""
        fn, xs, data = self.flatten(f, x, args)
        if self.has_reverse:
            y, _, vjp = self.flat_value_and_pullback(fn, xs, data)
        else:
            y, _, vjp = self._pullback_from_forward(fn, xs, data)

        def pullback(dy: Any) -> PyTree:
            return fn.unflatten_x(self.complete(vjp(self.cotangent(dy, y)), xs))

        pullback.f = f  # type: ignore[attr-defined]  # fn holds f weakly; a lazy vjp may still call it
        return y, pullback

    def _pullback_from_forward(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Any, Callable]:
        ar = _ar()
        y, jacs = self.flat_jacobian(fn, xs, data)
        ny = size_of(y)

        def vjp(dy: Any) -> list:
            flat_dy = ar.do("reshape", dy, (1, ny))
            return [
                ar.do("reshape", ar.do("matmul", flat_dy, ar.do("reshape", j, (ny, size_of(x)))), shape_of(x))
                for j, x in zip(jacs, xs)
            ]

        return y, None, vjp

    def pullback(self, f: Callable[..., Any], x: PyTree, *args: Any) -> Callable:
        """``vjp`` with ``vjp(dy) -> dx``; see :func:`abstractdiff.pullback`."""
        return self.value_and_pullback(f, x, *args)[1]

    def value_and_pushforward(self, f: Callable[..., Any], x: PyTree, *args: Any) -> tuple[Any, Callable]:
        """``(y, jvp)`` with ``jvp(dx) -> dy``; see :func:`abstractdiff.value_and_pushforward`."""
        fn, xs, data = self.flatten(f, x, args)
        if self.has_forward:
            y, _, jvp = self.flat_value_and_pushforward(fn, xs, data)
        else:
            y, jvp = self._pushforward_from_reverse(fn, xs, data)

        def pushforward(dx: PyTree) -> Any:
            return jvp(self.tangents(fn, xs, dx))

        pushforward.f = f  # type: ignore[attr-defined]  # fn holds f weakly; jvp calls it again
        return y, pushforward

    def _pushforward_from_reverse(self, fn: FlatFn, xs: list, data: list) -> tuple[Any, Callable]:
        ar = _ar()
        y, jacs = self.flat_jacobian(fn, xs, data)
        ny = size_of(y)

        def jvp(ts: list) -> Any:
            total = None
            for j, x, t in zip(jacs, xs, ts):
                part = ar.do("matmul", ar.do("reshape", j, (ny, size_of(x))), ar.do("reshape", t, (size_of(x), 1)))
                total = part if total is None else total + part
            return ar.do("reshape", total, shape_of(y))

        return y, jvp

    def pushforward(self, f: Callable[..., Any], x: PyTree, *args: Any) -> Callable:
        """``jvp`` with ``jvp(dx) -> dy``; see :func:`abstractdiff.pushforward`."""
        return self.value_and_pushforward(f, x, *args)[1]

    def derivative(self, f: Callable[..., Any], x: Any, *args: Any) -> Any:
        """``dy/dx`` for scalar ``x``, shaped like ``y``; see :func:`abstractdiff.derivative`."""
        fn, xs, data = self.flatten(f, x, args)
        if len(xs) != 1 or shape_of(xs[0]) != ():
            raise ShapeMismatchError(
                f"derivative needs a scalar x (one float of shape ()), got "
                f"{[shape_of(v) for v in xs]}; use jacobian for array inputs"
            )
        if self.has_forward:
            _, _, jvp = self.flat_value_and_pushforward(fn, xs, data)
            return jvp([self.ones_like(xs[0])])
        _, jacs = self.flat_jacobian(fn, xs, data)
        return jacs[0]

    def jacobian(self, f: Callable[..., Any], x: PyTree, *args: Any) -> PyTree:
        """Tree shaped like ``x`` of ``y.shape + leaf.shape`` arrays; see :func:`abstractdiff.jacobian`."""
        fn, xs, data = self.flatten(f, x, args)
        _, jacs = self.flat_jacobian(fn, xs, data)
        return fn.unflatten_x(jacs)

    def hessian(self, f: Callable[..., Any], x: PyTree, *args: Any) -> PyTree:
        """``x.shape + x.shape`` Hessian of scalar ``f``; see :func:`abstractdiff.hessian`."""
        fn, xs, data = self.flatten(f, x, args)
        if len(xs) != 1:
            raise ShapeMismatchError(
                f"hessian needs x with exactly one float array, got {len(xs)} float leaves; "
                f"concatenate them into one vector, or use hvp, which takes any pytree"
            )
        return fn.unflatten_x([self.flat_hessian(fn, xs, data)])

    def hvp(self, f: Callable[..., Any], x: PyTree, v: PyTree, *args: Any) -> PyTree:
        """Hessian-vector product shaped like ``x``; see :func:`abstractdiff.hvp`."""
        fn, xs, data = self.flatten(f, x, args)
        tangents = self.tangents(fn, xs, v, "v")
        return fn.unflatten_x(self.complete(self.flat_hvp(fn, xs, data, tangents), xs))


# See the note at the end of abstractdiff/_operators.py: autograph must call these as they are.
for _name in (
    "value_and_gradient", "gradient", "value_and_pullback", "pullback", "value_and_pushforward",
    "pushforward", "derivative", "jacobian", "hessian", "hvp",
):
    getattr(Backend, _name).autograph_info__ = frozenset()

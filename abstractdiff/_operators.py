"""The operator family as functions: ``ad.gradient(backend, f, x, *args)`` and friends.

Each takes the backend first (an instance, or a registered name), the function, the
point ``x`` (any pytree of float arrays: it is what gets differentiated) and extra
``args`` that pass through undifferentiated.  Pass data as ``args`` rather than through
closures: compiled backends cache per function object and retrace on a new closure.
"""

from __future__ import annotations

from typing import Any, Callable

from ._backend import Backend
from ._operator_table import OPERATORS
from ._registry import backend as _get_backend

__all__ = list(OPERATORS)


def _b(b: Backend | str) -> Backend:
    return b if isinstance(b, Backend) else _get_backend(b)


def gradient(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False) -> Any:
    """Gradient of scalar ``f`` with respect to ``x``.

    ``gradient(b, f, x, *args, has_aux=False) -> g`` with ``g`` shaped like ``x``:
    float leaves get their gradient (zeros if ``f`` does not depend on them), non-float
    leaves get ``None``.  With ``has_aux=True``, ``f`` returns ``(y, aux)`` and the
    result is ``(g, aux)``.

    Raises:
        NonScalarOutputError: ``f`` returned a non-scalar; use ``jacobian`` or ``pullback``.
        NonDifferentiableInputError: ``x`` has no float leaf.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> g = ad.gradient("finite_differences", lambda x: (x**2).sum(), np.array([1.0, 2.0]))
        >>> np.round(g, 6)
        array([2., 4.])
    """
    b = _b(b)
    # the hot path of training loops: no keyword argument to pass on when there is none (~0.2 us)
    return b.gradient(f, x, *args, has_aux=True) if has_aux else b.gradient(f, x, *args)


def value_and_gradient(
    b: Backend | str, f: Callable[..., Any], x: Any, *args: Any, has_aux: bool = False
) -> tuple[Any, Any]:
    """Value and gradient of scalar ``f`` in one pass.

    ``value_and_gradient(b, f, x, *args, has_aux=False) -> (y, g)``; with
    ``has_aux=True`` it returns ``((y, aux), g)``.  ``y`` is a scalar array of the
    backend, ``g`` is shaped like ``x`` (see :func:`gradient`).

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> y, g = ad.value_and_gradient("finite_differences", lambda x, a: a * (x**2).sum(), np.ones(2), 3.0)
        >>> float(y), np.round(g, 6)
        (6.0, array([6., 6.]))
    """
    b = _b(b)
    # the hot path of training loops: no keyword argument to pass on when there is none (~0.2 us)
    return b.value_and_gradient(f, x, *args, has_aux=True) if has_aux else b.value_and_gradient(f, x, *args)


def value_and_pullback(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Callable]:
    """Value and vector-Jacobian product function (reverse mode).

    ``value_and_pullback(b, f, x, *args) -> (y, vjp)`` with ``vjp(dy) -> dx``: ``dy``
    is shaped like ``y`` (numpy or native), ``dx`` like ``x``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> y, vjp = ad.value_and_pullback("finite_differences", lambda x: 2 * x, np.ones(2))
        >>> np.round(vjp(np.array([1.0, 3.0])), 6)
        array([2., 6.])
    """
    return _b(b).value_and_pullback(f, x, *args)


def pullback(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> Callable:
    """Vector-Jacobian product function: ``pullback(b, f, x, *args) -> vjp``, ``vjp(dy) -> dx``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> vjp = ad.pullback("finite_differences", lambda x: x * x, np.array([3.0]))
        >>> np.round(vjp(np.ones(1)), 6)
        array([6.])
    """
    return _b(b).pullback(f, x, *args)


def value_and_pushforward(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Callable]:
    """Value and Jacobian-vector product function (forward mode).

    ``value_and_pushforward(b, f, x, *args) -> (y, jvp)`` with ``jvp(dx) -> dy``: ``dx``
    is shaped like ``x``, ``dy`` like ``y``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> y, jvp = ad.value_and_pushforward("finite_differences", lambda x: x.sum() * x, np.ones(2))
        >>> np.round(jvp(np.array([1.0, 0.0])), 6)
        array([3., 1.])
    """
    return _b(b).value_and_pushforward(f, x, *args)


def pushforward(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> Callable:
    """Jacobian-vector product function: ``pushforward(b, f, x, *args) -> jvp``, ``jvp(dx) -> dy``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> jvp = ad.pushforward("finite_differences", lambda x: 3 * x, np.zeros(2))
        >>> np.round(jvp(np.ones(2)), 6)
        array([3., 3.])
    """
    return _b(b).pushforward(f, x, *args)


def derivative(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Derivative of ``f`` at a scalar ``x``: ``derivative(b, f, x, *args) -> dy/dx``, shaped like ``y``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> round(float(ad.derivative("finite_differences", np.sin, 0.0)), 8)
        1.0
    """
    return _b(b).derivative(f, x, *args)


def jacobian(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Jacobian of array-valued ``f``: ``jacobian(b, f, x, *args) -> J``.

    For an array ``x``, ``J.shape == y.shape + x.shape``; for a pytree ``x``, ``J`` is
    shaped like ``x`` with a ``y.shape + leaf.shape`` array at each float leaf.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> np.round(ad.jacobian("finite_differences", lambda x: x[::-1] * 2, np.ones(2)), 6)
        array([[0., 2.],
               [2., 0.]])
    """
    return _b(b).jacobian(f, x, *args)


def hessian(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Hessian of scalar ``f``: ``hessian(b, f, x, *args) -> H`` with ``H.shape == x.shape + x.shape``.

    For a pytree ``x``, ``H`` has the layout of ``jax.hessian``: a tree shaped like ``x``
    whose entry at float leaf ``i`` is a tree shaped like ``x`` whose entry at float leaf
    ``j`` is the block ``d2f / dx_i dx_j`` of shape ``leaf_i.shape + leaf_j.shape``;
    non-float leaves get ``None``, outside and inside (as in :func:`gradient`).  For large
    inputs prefer :func:`hvp`, which never builds the Hessian.

    Raises:
        NonScalarOutputError: ``f`` returned a non-scalar.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> np.round(ad.hessian("finite_differences", lambda x: x[0] ** 2 * x[1], np.array([1.0, 2.0])), 5) + 0.0
        array([[4., 2.],
               [2., 0.]])
        >>> H = ad.hessian("finite_differences", lambda t: (t["a"] ** 2).sum() * t["b"], {"a": np.ones(2), "b": 3.0})
        >>> H["a"]["b"].shape, round(float(H["b"]["b"]), 6), np.round(H["a"]["a"], 4) + 0.0
        ((2,), 0.0, array([[6., 0.],
               [0., 6.]]))
    """
    return _b(b).hessian(f, x, *args)


def hvp(b: Backend | str, f: Callable[..., Any], x: Any, v: Any, *args: Any) -> Any:
    """Hessian-vector product of scalar ``f``: ``hvp(b, f, x, v, *args) -> H @ v``, shaped like ``x``.

    ``v`` has the structure of ``x``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> np.round(ad.hvp("finite_differences", lambda x: (x**3).sum(), np.array([1.0, 2.0]), np.ones(2)), 5)
        array([ 6., 12.])
    """
    return _b(b).hvp(f, x, v, *args)


def value_and_derivative(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Any]:
    """Value and derivative at a scalar ``x``: ``value_and_derivative(b, f, x, *args) -> (y, dy/dx)``.

    ``dy/dx`` is shaped like ``y``.

    Raises:
        ShapeMismatchError: ``x`` is not one float of shape ``()`` (use :func:`value_and_jacobian`).

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> y, d = ad.value_and_derivative("finite_differences", np.sin, 0.0)
        >>> float(y), round(float(d), 8)
        (0.0, 1.0)
    """
    return _b(b).value_and_derivative(f, x, *args)


def second_derivative(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> Any:
    """Second derivative at a scalar ``x``: ``second_derivative(b, f, x, *args) -> d2y/dx2``, shaped like ``y``.

    The derivative of the derivative: forward over forward where the backend has a
    forward mode, else the Jacobian of the Jacobian.

    Raises:
        ShapeMismatchError: ``x`` is not one float of shape ``()``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> round(float(ad.second_derivative("finite_differences", lambda t: t**3, 2.0)), 4)
        12.0
    """
    return _b(b).second_derivative(f, x, *args)


def value_derivative_and_second_derivative(
    b: Backend | str, f: Callable[..., Any], x: Any, *args: Any
) -> tuple[Any, Any, Any]:
    """Value, derivative and second derivative at a scalar ``x``.

    ``value_derivative_and_second_derivative(b, f, x, *args) -> (y, dy/dx, d2y/dx2)``,
    the last two shaped like ``y``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> y, d, d2 = ad.value_derivative_and_second_derivative("finite_differences", lambda t: t**3, 2.0)
        >>> float(y), round(float(d), 6), round(float(d2), 4)
        (8.0, 12.0, 12.0)
    """
    return _b(b).value_derivative_and_second_derivative(f, x, *args)


def value_and_jacobian(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Any]:
    """Value and Jacobian: ``value_and_jacobian(b, f, x, *args) -> (y, J)``, ``J`` as :func:`jacobian` gives it.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> y, J = ad.value_and_jacobian("finite_differences", lambda x: x[::-1] * 2, np.array([1.0, 3.0]))
        >>> y, np.round(J, 6)
        (array([6., 2.]), array([[0., 2.],
               [2., 0.]]))
    """
    return _b(b).value_and_jacobian(f, x, *args)


def value_gradient_and_hessian(b: Backend | str, f: Callable[..., Any], x: Any, *args: Any) -> tuple[Any, Any, Any]:
    """Value, gradient and Hessian of scalar ``f``: ``value_gradient_and_hessian(b, f, x, *args) -> (y, g, H)``.

    ``g`` as :func:`gradient` gives it, ``H`` as :func:`hessian` does (nested blocks for a pytree ``x``).

    Raises:
        NonScalarOutputError: ``f`` returned a non-scalar.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> y, g, H = ad.value_gradient_and_hessian("finite_differences", lambda x: (x**3).sum(), np.array([1.0, 2.0]))
        >>> float(y), np.round(g, 6), np.round(H, 4) + 0.0
        (9.0, array([ 3., 12.]), array([[ 6.,  0.],
               [ 0., 12.]]))
    """
    return _b(b).value_gradient_and_hessian(f, x, *args)


def gradient_and_hvp(b: Backend | str, f: Callable[..., Any], x: Any, v: Any, *args: Any) -> tuple[Any, Any]:
    """Gradient and Hessian-vector product of scalar ``f``: ``gradient_and_hvp(b, f, x, v, *args) -> (g, H @ v)``.

    Both are shaped like ``x``; ``v`` has the structure of ``x`` (as in :func:`hvp`).

    Raises:
        ShapeMismatchError: ``v`` does not have the structure and shapes of ``x``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> g, hv = ad.gradient_and_hvp("finite_differences", lambda x: (x**3).sum(), np.array([1.0, 2.0]), np.ones(2))
        >>> np.round(g, 6), np.round(hv, 5)
        (array([ 3., 12.]), array([ 6., 12.]))
    """
    return _b(b).gradient_and_hvp(f, x, v, *args)

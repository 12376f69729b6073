"""The operator family as functions: ``ad.gradient(backend, f, x, *args)`` and friends.

Each takes the backend first (an instance, or a registered name), the function, the
point ``x`` (any pytree of float arrays: it is what gets differentiated) and extra
``args`` that pass through undifferentiated.  Pass data as ``args`` rather than through
closures: compiled backends cache per function object and retrace on a new closure.
"""

from __future__ import annotations

from typing import Any, Callable

from ._backend import Backend
from ._registry import backend as _get_backend

__all__ = [
    "derivative",
    "gradient",
    "hessian",
    "hvp",
    "jacobian",
    "pullback",
    "pushforward",
    "value_and_gradient",
    "value_and_pullback",
    "value_and_pushforward",
]


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
    return _b(b).gradient(f, x, *args, has_aux=has_aux)


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
    return _b(b).value_and_gradient(f, x, *args, has_aux=has_aux)


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

    ``x`` must hold exactly one float array (use :func:`hvp` for pytrees).

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> np.round(ad.hessian("finite_differences", lambda x: x[0] ** 2 * x[1], np.array([1.0, 2.0])), 5) + 0.0
        array([[4., 2.],
               [2., 0.]])
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

"""Implicit differentiation written once for every backend: ``ad.custom_root`` and
``ad.custom_fixed_point`` (jaxopt's semantics), on :class:`~abstractdiff.custom_vjp`.

A solver ``x* = solver(init, *theta)`` with ``F(x*, *theta) = 0`` is differentiated by the
implicit function theorem, never through its iterations: ``dx*/dtheta = -(dF/dx)^-1 dF/dtheta``,
so a cotangent ``ct`` of ``x*`` becomes ``-(dF/dtheta)^T u`` with ``(dF/dx)^T u = ct``.  Both
products are the backend's own pullback of ``F`` at ``(x*, theta)`` (the core's operator, on
the caller's arrays), and the linear system is solved matrix-free (:func:`bicgstab`, the
default) or densely (``solve="dense"``), in the caller's library, on its device.  The solver
may be a non-differentiable loop, a call into scipy, or stop its own gradient.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

from . import _pytree as pytree
from ._arrays import ar, shape_of
from ._custom import current_backend, current_rule, custom_vjp
from ._errors import AbstractDiffError, ArgumentTypeError, CustomRuleError, InvalidArgumentError

__all__ = ["bicgstab", "custom_fixed_point", "custom_root", "dense_solve"]

LinearSolve = Callable[[Callable[[Any], Any], Any], Any]
#: How the libraries' dense solves word a singular matrix (numpy's and torch's LinAlgError,
#: tensorflow's and paddle's "not invertible", MLX's "inversion failed").
_SINGULAR_WORDS = ("linalgerror", "singular", "invertible", "inversion failed")


# ------------------------------------------------------------------ the linear solvers
def _dot(a: Any, b: Any) -> Any:
    return ar().do("sum", a * b)


def _concrete(a: Any) -> float | None:
    """``a``'s value as a float, or None where it is traced (under jit, in a graph)."""
    backend = current_backend()
    try:
        return float(backend.to_numpy(a) if backend is not None else a)
    except Exception as err:  # each library's own error for a traced value
        if any(word in f"{type(err).__name__}: {err}".lower() for word in _SINGULAR_WORDS):
            raise  # not traced: a lazy library (MLX) evaluating a solve of a singular matrix
        return None


def _eps(a: Any) -> float:
    """The machine epsilon of ``a``'s float dtype (bfloat16: float32's, which numpy knows)."""
    name = ar().get_dtype_name(a)
    return float(np.finfo(np.dtype("float32" if name == "bfloat16" else name)).eps)


def _safe_div(a: Any, b: Any) -> Any:
    """``a / b``, and 0 where ``b`` is 0 (BiCGSTAB's scalars once it has converged, under a trace)."""
    # abs(b) > 0 rather than b == 0: PyTensor's == compares variables, not values
    return a / ar().do("where", ar().do("abs", b) > 0, b, b * 0 + 1)


def bicgstab(matvec: Callable[[Any], Any], b: Any, *, tol: float | None = None, maxiter: int | None = None) -> Any:
    """``x`` with ``matvec(x) = b`` (1-D arrays of any library): BiCGSTAB, matrix-free.

    The default linear solver of :func:`custom_root`: it needs only products with the
    matrix (there, the backend's pullback of the optimality function), no transpose.  On
    concrete arrays it stops once ``|matvec(x) - b| <= tol |b|``; under a trace (jit) it
    runs ``maxiter`` iterations (default: twice the size plus two, at most 200), its
    scalars guarded against the zeros of a converged iteration.
    """
    n = shape_of(b)[0]
    maxiter = maxiter if maxiter is not None else min(2 * n + 2, 200)
    tol = tol if tol is not None else max(_eps(b) * 100, 1e-14)
    bb = _dot(b, b)
    bnorm = _concrete(bb)
    if bnorm == 0.0:
        return b * 0
    done = (lambda a: _concrete(a) <= tol * tol * bnorm) if bnorm is not None else (lambda a: False)  # noqa: E731
    x, r, r0 = b * 0, b, b
    one = bb * 0 + 1
    rho = alpha = omega = one
    v = p = b * 0
    for _ in range(maxiter):
        rho_new = _dot(r0, r)
        p = r + _safe_div(rho_new, rho) * _safe_div(alpha, omega) * (p - omega * v)
        v = matvec(p)
        alpha = _safe_div(rho_new, _dot(r0, v))
        x = x + alpha * p
        s = r - alpha * v
        if done(_dot(s, s)):
            break
        t = matvec(s)
        omega = _safe_div(_dot(t, s), _dot(t, t))
        x = x + omega * s
        r = s - omega * t
        rho = rho_new
        if done(_dot(r, r)):
            break
    return x


def dense_solve(matvec: Callable[[Any], Any], b: Any) -> Any:
    """``x`` with ``matvec(x) = b``, by building the matrix (``n`` products) and one dense
    solve in ``b``'s library: the choice for small systems (``solve="dense"``)."""
    n = shape_of(b)[0]
    eye = ar().do("eye", n, dtype=ar().get_dtype_name(b), like=b)
    columns = [matvec(eye[i]) for i in range(n)]
    a = ar().do("stack", columns, axis=1)
    return ar().do("linalg.solve", a, ar().do("reshape", b, (n, 1)))[:, 0] if n else b


_SOLVERS: dict[str, LinearSolve] = {"bicgstab": bicgstab, "dense": dense_solve}


def _linear_solve(solve: str | LinearSolve | None) -> LinearSolve:
    if solve is None:
        return bicgstab
    if isinstance(solve, str):
        try:
            return _SOLVERS[solve]
        except KeyError:
            raise InvalidArgumentError(
                f"solve={solve!r} is not a linear solver abstractdiff knows; use one of "
                f"{', '.join(map(repr, _SOLVERS))}, or a function solve(matvec, b) -> x"
            ) from None
    if not callable(solve):
        raise ArgumentTypeError(f"solve must be a name ({', '.join(_SOLVERS)}) or a function solve(matvec, b) -> x, "
                                f"got {type(solve).__name__}")
    return solve


# ---------------------------------------------------------------- flat vectors
class _Flat:
    """A pytree of arrays as one 1-D vector of its library, and back."""

    def __init__(self, tree: Any):
        self.leaves, self.treedef = pytree.tree_flatten(tree)
        self.shapes = [shape_of(a) for a in self.leaves]
        self.sizes = [math.prod(s) for s in self.shapes]

    def ravel(self, tree: Any) -> Any:
        leaves = self.treedef.flatten_up_to(tree)
        parts = [ar().do("reshape", a if a is not None else ar().do("zeros_like", like), (size,))
                 for a, like, size in zip(leaves, self.leaves, self.sizes)]
        return parts[0] if len(parts) == 1 else ar().do("concatenate", parts)

    def unravel(self, flat: Any) -> Any:
        out, start = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            part = flat if len(self.sizes) == 1 else flat[start:start + size]
            out.append(ar().do("reshape", part, shape))
            start += size
        return pytree.tree_unflatten(self.treedef, out)


# ------------------------------------------------------------------ the decorators
class _ImplicitSolver:
    """``solver`` with derivatives from the implicit function theorem (see the module)."""

    def __init__(self, solver: Callable[..., Any], optimality_fn: Callable[..., Any], solve: LinearSolve,
                 what: str):
        if not callable(solver):
            raise ArgumentTypeError(f"{what} decorates a solver function, got {type(solver).__name__}")
        self.solver = solver
        self.optimality_fn = optimality_fn
        self.solve = solve
        self.what = what
        functools.update_wrapper(self, solver)
        # one function object for the pullbacks: the backend's plans are keyed on it
        self._residual = lambda z: optimality_fn(z[0], *z[1])
        solved = custom_vjp(self._solve_fixed)
        solved.__name__ = getattr(solver, "__name__", "solver")
        solved.defvjp(self._forward, self._backward)
        self._solved = solved

    def __call__(self, init: Any, *theta: Any) -> Any:
        return self._solved(init, *theta)

    def _solve_fixed(self, init: Any, *theta: Any) -> Any:
        return self.solver(init, *theta)

    def _forward(self, init: Any, *theta: Any) -> tuple[Any, Any]:
        x = self.solver(init, *theta)
        rule = current_rule()
        if rule is not None and not rule.nested_derivatives:
            return x, (x, theta, self._linearised(rule.backend, x, theta))
        return x, (x, theta, None)

    def _linearised(self, backend: Any, x: Any, theta: tuple) -> tuple[Any, list]:
        """``dF/dx`` as a dense matrix and the rows of ``dF/dtheta``, taken in the forward for a
        library that cannot take a derivative inside its backward (the backward then only
        solves): one pullback per element of ``x``."""
        from ._operators import pullback

        vjp = pullback(backend, self._residual, (x, theta))
        flat = _Flat(x)
        n = sum(flat.sizes)
        eye = ar().do("eye", n, dtype=ar().get_dtype_name(flat.leaves[0]), like=flat.leaves[0])
        rows = [vjp(flat.unravel(eye[i])) for i in range(n)]  # (dF_i/dx, dF_i/dtheta)
        jx = ar().do("stack", [flat.ravel(r[0]) for r in rows])
        return jx, [r[1] for r in rows]

    def _backward(self, residuals: Any, ct: Any) -> tuple:
        from ._operators import pullback

        x, theta, linearised = residuals
        flat = _Flat(x)
        b = flat.ravel(ct)
        if linearised is None:
            vjp = pullback(current_backend(), self._residual, (x, theta))

            def matvec(u: Any) -> Any:  # (dF/dx)^T u
                return flat.ravel(vjp(flat.unravel(u))[0])

            u, poison = self._linear_solution(matvec, b)
            theta_ct = vjp(flat.unravel(u))[1]
        else:
            jx, theta_rows = linearised
            jxt = ar().do("transpose", jx)

            def matvec(u: Any) -> Any:
                return ar().do("tensordot", jxt, u, axes=1)

            u, poison = self._linear_solution(matvec, b)
            theta_ct = pytree.tree_map(
                lambda *leaves: ar().do("tensordot", u, ar().do("stack", leaves), axes=1), *theta_rows)
        negated = pytree.tree_map(lambda a: -a if poison is None else poison - a, theta_ct)
        return (None, *negated)

    def _linear_solution(self, matvec: Callable[[Any], Any], b: Any) -> tuple[Any, Any]:
        """``u`` with ``matvec(u) = b``, by the chosen solver, checked (:meth:`_check_solution`)."""
        try:  # the check too: a lazy library (MLX) raises when the solution is first evaluated
            return self._check_solution(matvec, self.solve(matvec, b), b)
        except Exception as err:  # a dense solve of a singular matrix: each library's own error
            text = f"{type(err).__name__}: {err}"
            if isinstance(err, AbstractDiffError) or not any(w in text.lower() for w in _SINGULAR_WORDS):
                raise
            raise self._singular(f"the linear solve raised {text}") from err

    def _singular(self, detail: str) -> CustomRuleError:
        return CustomRuleError(
            f"{self.what}: the Jacobian of the optimality function with respect to x, dF/dx at the solution, "
            f"is singular or too badly conditioned for the implicit function theorem ({detail}): x* does not "
            f"depend smoothly on theta there. Check that optimality_fn(x*, *theta) == 0 determines x* uniquely "
            f"(a regularised objective), or pass solve='dense' or a solver of your own"
        )

    def _check_solution(self, matvec: Callable[[Any], Any], u: Any, b: Any) -> tuple[Any, Any]:
        """``(u, poison)``, checked: a singular (or badly conditioned) ``dF/dx`` at ``x*`` is a
        clear error on concrete arrays, never a silently wrong derivative.  Under a trace (jit,
        a graph) the values are not known here, so ``poison`` is a scalar that is ``nan`` where
        the solution does not solve the system (else 0), for the backward to add to its
        cotangents: the caller sees ``nan``.  On concrete arrays it is None."""
        name = ar().get_dtype_name(b)
        loose = max(_eps(b) ** 0.5, 1e-6)
        r = matvec(u) - b
        rr, bb = _dot(r, r), _dot(b, b)
        rnorm, bnorm = _concrete(rr), _concrete(bb)
        if rnorm is None or bnorm is None:
            # rr <= bound is false where rr is nan too; added, not multiplied: a graph library
            # may simplify 0 * nan to 0 (PyTensor does), which would hide it again
            nan = ar().do("astype", bb * np.nan, name)  # in b's dtype (PyTensor widens a Python float)
            return u, ar().do("where", rr <= loose * loose * bb, bb * 0, nan)
        relative = math.sqrt(rnorm) / max(math.sqrt(bnorm), 1e-300)
        if not math.isfinite(relative) or relative > loose:
            raise self._singular(f"the linear solve left a relative residual of {relative:.3g}")
        return u, None


def custom_root(optimality_fn: Callable[..., Any], solve: str | LinearSolve | None = None
                ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: ``solver(init, *theta) -> x_star`` with ``optimality_fn(x_star, *theta) == 0``,
    differentiated by the implicit function theorem on every exact backend (jaxopt's
    ``custom_root``): ``ad.custom_root(optimality_fn, solve=None)(solver)``.

    The derivatives of ``x_star`` with respect to ``theta`` come from a linear solve with the
    backend's own pullback of ``optimality_fn``, never from the solver's iterations: the
    solver may be a non-differentiable loop, call scipy, or stop its own gradient.  ``init``
    gets no derivative.  ``solve`` picks the linear solver: ``None`` or ``"bicgstab"``
    (matrix-free, the default), ``"dense"`` (the Jacobian built, one dense solve: small
    problems), or ``solve(matvec, b) -> x`` on 1-D arrays.  A singular ``d optimality_fn/dx``
    at ``x_star`` raises :class:`~abstractdiff.CustomRuleError` (on concrete arrays).
    ``finite_differences`` differentiates the solver itself.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> @ad.custom_root(lambda x, a: x**2 - a)
        ... def sqrt(init, a):
        ...     x = init
        ...     for _ in range(30):
        ...         x = 0.5 * (x + a / x)
        ...     return x
        >>> float(sqrt(np.float64(1.0), np.float64(4.0)))
        2.0
    """
    if not callable(optimality_fn):
        raise ArgumentTypeError(f"custom_root: optimality_fn must be callable, got {type(optimality_fn).__name__}")
    linear = _linear_solve(solve)
    return lambda solver: _ImplicitSolver(solver, optimality_fn, linear, "ad.custom_root")


def custom_fixed_point(fixed_point_fn: Callable[..., Any], solve: str | LinearSolve | None = None
                       ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: ``solver(init, *theta) -> x_star`` with ``x_star = fixed_point_fn(x_star, *theta)``,
    differentiated by the implicit function theorem (:func:`custom_root` of
    ``fixed_point_fn(x, *theta) - x``): ``ad.custom_fixed_point(T, solve=None)(solver)``.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> @ad.custom_fixed_point(lambda x, a: np.cos(a * x))
        ... def fixed(init, a):
        ...     x = init
        ...     for _ in range(200):
        ...         x = np.cos(a * x)
        ...     return x
        >>> round(float(fixed(np.float64(0.0), np.float64(1.0))), 6)
        0.739085
    """
    if not callable(fixed_point_fn):
        raise ArgumentTypeError(
            f"custom_fixed_point: fixed_point_fn must be callable, got {type(fixed_point_fn).__name__}")

    def optimality_fn(x: Any, *theta: Any) -> Any:
        return pytree.tree_map(lambda t, a: t - a, fixed_point_fn(x, *theta), x)

    linear = _linear_solve(solve)
    return lambda solver: _ImplicitSolver(solver, optimality_fn, linear, "ad.custom_fixed_point")

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
from ._custom import _CustomFunction, _is_input, current_backend, current_rule, mode_refusal, stop_gradient
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
    """``a / b``, and 0 where ``|b|`` is below the square root of the dtype's smallest normal
    number: BiCGSTAB's scalars once it has converged, under a trace, where it runs on and
    its residuals keep shrinking.  A derivative of ``a / b`` divides by ``b**2``, which
    underflows to 0 below that bound (inf, then nan, in every second derivative); exactly 0
    was not enough."""
    name = ar().get_dtype_name(b)
    small = float(np.finfo(np.dtype("float32" if name == "bfloat16" else name)).tiny) ** 0.5
    # abs(b) > small rather than a comparison of b: PyTensor's == compares variables, not values
    live = ar().do("abs", b) > small
    return ar().do("where", live, a, a * 0) / ar().do("where", live, b, b * 0 + 1)


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
        # the solution is zero, but a library that builds forward mode by transposing a reverse
        # rule (a double vjp: PyTensor, paddle) differentiates this solve in b at b = 0, where no
        # iterate depends on b: the dense solve is linear in b as computed, its derivative A^-1
        return dense_solve(matvec, b)

    def done(a: Any) -> bool:  # a residual traced while b is not (b a constant under jit): run on
        value = _concrete(a) if bnorm is not None else None
        return value is not None and value <= tol * tol * bnorm

    x, r = b * 0, b
    # restarted from the last iterate where it stops short on concrete arrays: BiCGSTAB breaks
    # down (its shadow residual orthogonal to the Krylov space) on some structured systems,
    # and a fresh shadow residual recovers it; under a trace, where the values are not known,
    # it always runs twice
    for attempt in range(4 if bnorm is not None else 2):
        if attempt:
            r = b - matvec(x)
        x, r = _bicgstab_run(matvec, x, r, bb, maxiter, done)
        if bnorm is not None and done(_dot(r, r)):
            break
    return x


def _bicgstab_run(matvec: Callable[[Any], Any], x: Any, r: Any, bb: Any, maxiter: int,
                  done: Callable[[Any], bool]) -> tuple[Any, Any]:
    """BiCGSTAB's iterations from ``x`` with residual ``r``: ``(x, residual)``."""
    r0 = r
    one = bb * 0 + 1
    rho = alpha = omega = one
    v = p = r * 0
    for _ in range(maxiter):
        rho_new = _dot(r0, r)
        p = r + _safe_div(rho_new, rho) * _safe_div(alpha, omega) * (p - omega * v)
        v = matvec(p)
        alpha = _safe_div(rho_new, _dot(r0, v))
        x = x + alpha * p
        s = r - alpha * v
        if done(_dot(s, s)):
            return x, s
        t = matvec(s)
        omega = _safe_div(_dot(t, s), _dot(t, t))
        x = x + omega * s
        r = s - omega * t
        rho = rho_new
        if done(_dot(r, r)):
            break
    return x, r


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
class _ImplicitRule(_CustomFunction):
    """One of the two custom functions of an :class:`_ImplicitSolver`, with a reverse rule
    (``fwd``/``bwd``) and a forward rule (``jvp``), both from the implicit function theorem.

    * ``solved(init, *theta) -> x*``: the solver, differentiated implicitly;
    * ``attached(x, *theta) -> x``: the identity in value, whose derivative in ``theta`` is
      ``dx*/dtheta`` (and none in ``x``).  The rules evaluate the optimality function at
      ``attached(x*, *theta)`` rather than at the solver's output, which is a constant to the
      library (the solver may stop its gradient, or never ran under the library's tape): a
      second derivative differentiates the rules themselves, and needs ``x*``'s dependence on
      ``theta`` inside them.  The rules of ``attached`` call ``attached`` again, so each order
      of differentiation finds the implicit derivative one level down (jax's ``custom_root``
      calls itself in its jvp rule for the same reason).  Each call is the identity unless a
      library differentiates it, so a first derivative costs one more no-op operation.
    """

    _kind = "custom_vjp"
    takes_derivatives = True  # its rules call the backend's operators (Rule.takes_derivatives)

    def __init__(self, owner: _ImplicitSolver, attached: bool):
        super().__init__(owner._attached_value if attached else owner._solve_fixed)
        self.owner = owner
        self.__name__ = getattr(owner.solver, "__name__", "solver") + ("_attached" if attached else "")
        self._fwd = owner._attached_forward if attached else owner._forward
        self._bwd = owner._backward
        self._jvp = owner._attached_jvp if attached else owner._jvp

    def __abstractdiff_captures__(self) -> tuple:
        """The user functions these rules call (for the keys of traces: see _captures)."""
        return self.owner.__abstractdiff_captures__()


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
        self._adjoint: _ImplicitSolver | None = None  # the adjoint solve (_adjoint_solve), made on first use
        # one function object for the pullbacks and pushforwards: the backend's plans are keyed on it
        # the operators differentiate functions of one array output: the residuals raveled
        # in x's pytree order (one equation per unknown), one function object each, for the
        # backend's plans are keyed on it
        self._residual = lambda z: _Flat(z[0]).ravel(self._checked_residual(z))
        self._residual_theta_first = lambda theta, x: _Flat(x).ravel(self._checked_residual((x, theta)))
        self._residual_x_first = lambda x, *theta: _Flat(x).ravel(self._checked_residual((x, theta)))
        self._solved = _ImplicitRule(self, attached=False)
        self._attached = _ImplicitRule(self, attached=True)

    def __call__(self, init: Any, *theta: Any) -> Any:
        return self._solved(init, *theta)

    def __abstractdiff_captures__(self) -> tuple:
        """The user functions this solver calls: a global they read is part of a trace's key."""
        return (self.solver, self.optimality_fn, self.solve)

    # ------------------------------------------------------------ the optimality function
    def _checked_residual(self, z: tuple) -> Any:
        """``optimality_fn(x, *theta)`` for ``z = (x, theta)``, checked to be shaped like ``x``:
        the implicit function theorem needs as many equations as unknowns."""
        x, theta = z
        out = self.optimality_fn(x, *theta)
        want, got = pytree.tree_structure(x), pytree.tree_structure(out)
        if got != want:
            raise CustomRuleError(
                f"{self.what}: optimality_fn(x, *theta) must return a pytree of the structure of x (one equation "
                f"per unknown), but x has structure {want} and it returned {got}; return the residuals in x's "
                f"structure (for example the objective's gradient with respect to x)"
            )
        for a, r in zip(pytree.tree_leaves(x), pytree.tree_leaves(out)):
            sa, sr = _static_shape(a), _static_shape(r)
            if sa is not None and sr is not None and sa != sr:
                raise CustomRuleError(
                    f"{self.what}: optimality_fn(x, *theta) returned a leaf of shape {sr} where x's leaf has shape "
                    f"{sa}; it must return one equation per unknown, shaped like x"
                )
        return out

    # ------------------------------------------------------------ the custom functions' parts
    def _solve_fixed(self, init: Any, *theta: Any) -> Any:
        return self.solver(init, *theta)

    @staticmethod
    def _attached_value(x: Any, *theta: Any) -> Any:
        return x

    def _forward(self, init: Any, *theta: Any) -> tuple[Any, Any]:
        x = self.solver(init, *theta)
        rule = current_rule()
        if rule is not None and not rule.nested_derivatives:
            return x, (x, theta, self._linearised(rule.backend, x, theta))
        # attached: a library that differentiates fwd itself for a higher order (jax) sees the
        # implicit derivative of the output too, not the solver's (zero where it stops it)
        x = self._attached(x, *theta)
        return x, (x, theta, None)

    def _attached_forward(self, x: Any, *theta: Any) -> tuple[Any, Any]:
        # itself again where the library differentiates fwd for a higher order (jax: see
        # Rule.lazy_forward), else x (the library then differentiates the rules instead)
        return self._attached(x, *theta), (x, theta, None)

    def _backward(self, residuals: Any, ct: Any) -> tuple:
        x, theta, linearised = residuals
        if linearised is None:
            theta_ct = self._theta_cotangent(self._attached(x, *theta), theta, ct)
        else:
            theta_ct = self._linearised_cotangent(linearised, x, ct)
        return (None, *theta_ct)

    def _refuse_forward_mode(self) -> None:
        rule = current_rule()
        if rule is not None and not rule.derivatives_in_jvp:
            raise mode_refusal("forward", (
                f"{self.what}: the {rule.backend.name} backend cannot take the derivatives that forward mode "
                f"through an implicit solver needs (its library hides differentiation inside a forward-mode "
                f"rule): use reverse mode (gradient, pullback, hessian, a reverse Jacobian), or another backend"
            ))

    def _jvp(self, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        self._refuse_forward_mode()
        init, *theta = primals
        x = self._attached(self.solver(init, *theta), *theta)
        return x, self._x_tangent(x, tuple(theta), tuple(tangents[1:]))

    def _attached_jvp(self, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        self._refuse_forward_mode()
        x, *theta = primals
        x = self._attached(x, *theta)
        return x, self._x_tangent(x, tuple(theta), tuple(tangents[1:]))

    # ------------------------------------------------------------ the implicit function theorem
    def _theta_cotangent(self, x: Any, theta: tuple, ct: Any) -> tuple:
        """``-(dF/dtheta)^T u`` with ``(dF/dx)^T u = ct``, at ``(x, theta)``, one per ``theta``."""
        matvec, vjp = self._transposed(x, theta)
        # u by the adjoint solve, a custom function itself (jax's custom_linear_solve): a second
        # derivative differentiates this rule, and through the linear solver's iterations that
        # is not the derivative of (dF/dx)^-T ct where the solver stops early on an exact
        # answer (BiCGSTAB solves a dF/dx with k distinct eigenvalues in k steps: derivatives
        # of 2e-3 off, where the iterate's derivative has not converged)
        adjoint = self._adjoint_solve()
        u, poison = self._linear_solution(matvec, _Flat(x).ravel(ct), lambda _, b: adjoint(b * 0, x, theta, b))
        return self._negated(vjp(u)[1], poison)

    def _transposed(self, x: Any, theta: tuple) -> tuple[Callable[[Any], Any], Any]:
        """``(matvec, vjp)`` at ``(x, theta)``: ``matvec(u) = (dF/dx)^T u`` on x's raveled
        vector, and the pullback of F it is read from (``vjp(u)[1]`` is ``(dF/dtheta)^T u``)."""
        from ._operators import pullback

        vjp = pullback(current_backend(), self._residual, (x, theta))
        flat = _Flat(x)
        return (lambda u: flat.ravel(vjp(u)[0])), vjp

    def _adjoint_solve(self) -> _ImplicitSolver:
        """``solve(init, x, theta, b) -> u`` with ``(dF/dx)^T u = b`` at ``(x, theta)``: the linear
        solve as an implicit solver of its own, of ``G(u, x, theta, b) = (dF/dx)^T u - b``, so its
        derivatives in ``x``, ``theta`` and ``b`` come from the implicit function theorem (one
        more linear solve each, with ``dG/du = (dF/dx)^T``), never from the solver's iterations.
        Made on first use: a third derivative makes the adjoint solve's own, and so on."""
        if self._adjoint is None:
            def residual(u: Any, x: Any, theta: tuple, b: Any) -> Any:  # G(u, x, theta, b)
                return self._transposed(x, theta)[0](u) - b

            def solve(init: Any, x: Any, theta: tuple, b: Any) -> Any:
                x, theta, b = stop_gradient((x, theta, b))  # differentiated implicitly, not here
                return self.solve(self._transposed(x, theta)[0], b)

            self._adjoint = _ImplicitSolver(solve, residual, self.solve, self.what)
        return self._adjoint

    def _x_tangent(self, x: Any, theta: tuple, theta_dot: tuple) -> Any:
        """``dx* = -(dF/dx)^-1 (dF/dtheta) dtheta`` at ``(x, theta)``: forward mode."""
        from ._operators import pushforward

        leaves, treedef = pytree.tree_flatten(theta)
        if not any(map(_is_input, leaves)):  # nothing in theta is differentiated: x* is a constant
            return pytree.tree_map(lambda a: a * 0, x)
        backend = current_backend()
        # a tangent for each float leaf (zeros where the caller's has none), None for the others
        tangent = pytree.tree_unflatten(treedef, [
            (t if t is not None else backend.zeros_like(a)) if _is_input(a) else None
            for a, t in zip(leaves, treedef.flatten_up_to(theta_dot))
        ])
        flat = _Flat(x)
        rhs = pushforward(backend, self._residual_theta_first, theta, x)(tangent)
        along_x = pushforward(backend, self._residual_x_first, x, *theta)

        def matvec(v: Any) -> Any:  # (dF/dx) v
            return along_x(flat.unravel(v))

        v, poison = self._linear_solution(matvec, rhs)
        return flat.unravel(-v if poison is None else poison - v)

    def _linearised(self, backend: Any, x: Any, theta: tuple) -> tuple[Any, list]:
        """``dF/dx`` as a dense matrix and the rows of ``dF/dtheta``, taken in the forward for a
        library that cannot take a derivative inside its backward (the backward then only
        solves): one pullback per element of ``x``."""
        from ._operators import pullback

        vjp = pullback(backend, self._residual, (x, theta))
        flat = _Flat(x)
        n = sum(flat.sizes)
        eye = ar().do("eye", n, dtype=ar().get_dtype_name(flat.leaves[0]), like=flat.leaves[0])
        rows = [vjp(eye[i]) for i in range(n)]  # (dF_i/dx, dF_i/dtheta)
        jx = ar().do("stack", [flat.ravel(r[0]) for r in rows])
        return jx, [r[1] for r in rows]

    def _linearised_cotangent(self, linearised: tuple, x: Any, ct: Any) -> tuple:
        """:meth:`_theta_cotangent` from the matrices :meth:`_linearised` took.  The matrix is
        there, so the default solve is the dense one: it is linear in ``ct`` as computed, which a
        library that builds forward mode by transposing this backward (a double vjp) relies on."""
        jx, theta_rows = linearised
        jxt = ar().do("transpose", jx)
        flat = _Flat(x)
        b = flat.ravel(ct)

        def matvec(u: Any) -> Any:
            return ar().do("tensordot", jxt, u, axes=1)

        if self.solve is bicgstab:
            u, poison = self._checked_dense(jxt, b, matvec)
        else:
            u, poison = self._linear_solution(matvec, b)
        theta_ct = pytree.tree_map(lambda *leaves: ar().do("tensordot", u, ar().do("stack", leaves), axes=1),
                                   *theta_rows)
        return self._negated(theta_ct, poison)

    @staticmethod
    def _negated(tree: Any, poison: Any) -> Any:
        return pytree.tree_map(lambda a: -a if poison is None else poison - a, tree)

    def _checked_dense(self, a: Any, b: Any, matvec: Callable[[Any], Any]) -> tuple[Any, Any]:
        def solve(_: Any, b: Any) -> Any:
            return ar().do("linalg.solve", a, ar().do("reshape", b, (shape_of(b)[0], 1)))[:, 0]

        return self._linear_solution(matvec, b, solve)

    def _linear_solution(self, matvec: Callable[[Any], Any], b: Any,
                         solve: LinearSolve | None = None) -> tuple[Any, Any]:
        """``u`` with ``matvec(u) = b``, by the chosen solver, checked (:meth:`_check_solution`)."""
        try:  # the check too: a lazy library (MLX) raises when the solution is first evaluated
            return self._check_solution(matvec, (solve or self.solve)(matvec, b), b)
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
        the solution does not solve the system (else 0), for the rules to add to their results:
        the caller sees ``nan``.  On concrete arrays it is None.  The poison's gradient is
        stopped: a ``where`` whose other branch is ``nan`` has a ``nan`` derivative, which would
        poison every second derivative, also where the solve succeeded."""
        name = ar().get_dtype_name(b)
        loose = max(_eps(b) ** 0.5, 1e-6)
        r = matvec(u) - b
        rr, bb = _dot(r, r), _dot(b, b)
        rnorm, bnorm = _concrete(rr), _concrete(bb)
        if rnorm is None or bnorm is None:
            # rr <= bound is false where rr is nan too; added, not multiplied: a graph library
            # may simplify 0 * nan to 0 (PyTensor does), which would hide it again
            nan = ar().do("astype", bb * np.nan, name)  # in b's dtype (PyTensor widens a Python float)
            return u, stop_gradient(ar().do("where", rr <= loose * loose * bb, bb * 0, nan))
        relative = math.sqrt(rnorm) / max(math.sqrt(bnorm), 1e-300)
        if not math.isfinite(relative) and self.solve not in _SOLVERS.values() and not math.isfinite(
                _concrete(_dot(u, u))):
            raise CustomRuleError(
                f"{self.what}: the linear solve returned a non-finite solution (nan or inf) for a finite "
                f"right-hand side: check the solve function passed as solve=, or use solve='dense' or the "
                f"default"
            )
        if not math.isfinite(relative) or relative > loose:
            raise self._singular(f"the linear solve left a relative residual of {relative:.3g}")
        return u, None


def _has_floats(tree: Any) -> bool:
    return any(_is_input(a) for a in pytree.tree_leaves(tree))


def _static_shape(a: Any) -> tuple | None:
    try:
        return tuple(shape_of(a))
    except Exception:  # a symbolic shape (PyTensor) or not an array: not checked here
        return None


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

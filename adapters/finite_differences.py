"""Finite differences in numpy: the backend-free reference adapter and test oracle.

Fourth-order central differences (a five-point stencil) with a step chosen per dtype,
``h = eps**(1/5) * max(1, |x|)``, which balances truncation error (h**4) against
rounding (eps/h): about 1e-12 relative error in float64, 1e-5 in float32.

``compute_dtype="float64"`` evaluates ``f`` with its differentiated inputs widened to
float64 and returns results in the inputs' own dtypes: float32 derivatives accurate to
float32 rounding, which makes the backend an oracle for float32 code too.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from abstractdiff._backend import Backend, GradientFunction, check_scalar
from abstractdiff._errors import InvalidArgumentError, NonFiniteInputError

# Five-point stencil: f'(x) ~ (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / (12 h).
# Differences are taken before weighting so that an input f does not depend on gives
# exactly zero, not rounding noise.
_OFFSETS = (-2.0, -1.0, 1.0, 2.0)


def _fresh_inputs(fn: Callable) -> Callable:
    """``fn`` called on copies: an ``f`` that writes into its inputs must neither change the
    caller's arrays nor move the point of the next evaluation."""

    def call(xs: list, data: list) -> tuple:
        copy = lambda a: a.copy() if isinstance(a, np.ndarray) else a  # noqa: E731
        return fn([copy(x) for x in xs], [copy(d) for d in data])

    return call


def _stencil(values: list) -> np.ndarray:
    f_m2, f_m1, f_p1, f_p2 = (np.asarray(v) for v in values)
    return (8.0 * (f_p1 - f_m1) - (f_p2 - f_m2)) / 12.0


class FiniteDifferencesBackend(Backend):
    name = "finite_differences"
    approximate = True

    def __init__(
        self, *, step: float | None = None, compute_dtype: str | None = None, device: str | None = None,
        chunk_size: int | None = None,
    ):
        if step is not None and not (isinstance(step, (int, float)) and 0 < step < 1):
            raise InvalidArgumentError(f"step must be a relative step in (0, 1), e.g. 1e-3, got {step!r}")
        if compute_dtype is not None:
            try:
                valid = np.dtype(compute_dtype).kind == "f"
            except TypeError:
                valid = False
            if not valid:
                raise InvalidArgumentError(
                    f"compute_dtype must be a float dtype such as 'float64', got {compute_dtype!r}"
                )
            compute_dtype = np.dtype(compute_dtype).name
        super().__init__(device=device, chunk_size=chunk_size, step=step, compute_dtype=compute_dtype)
        self.step = step
        self.compute_dtype = compute_dtype

    def _widen(self, xs: list) -> tuple[list, list]:
        """``xs`` in the compute dtype (when one is set), and the dtypes to return results in.

        Also refuses what differences cannot handle: a non-finite point (every difference
        through it is NaN), and a step below what the dtype can resolve.
        """
        dtypes = [x.dtype for x in xs]
        for i, x in enumerate(xs):
            if not np.all(np.isfinite(x)):
                raise NonFiniteInputError(
                    f"finite differences cannot differentiate at a point holding NaN or inf (x's float "
                    f"leaf {i}): every difference through it is NaN, so every derivative would be; exact "
                    f"AD backends give NaN only where the NaN propagates"
                )
        compute = self.compute_dtype
        if compute is None and not all(np.issubdtype(d, np.inexact) for d in dtypes):
            compute = "float32"  # bfloat16 (ml_dtypes): numpy has no finfo for it; difference in float32
        if compute is None:
            widened = xs
        else:
            widened = [x.astype(np.promote_types(x.dtype, compute) if np.issubdtype(x.dtype, np.inexact)
                                else compute) for x in xs]
        if self.step is not None:
            for d in {w.dtype for w in widened}:
                if self.step < 16 * float(np.finfo(d).eps):
                    raise InvalidArgumentError(
                        f"step={self.step!r} is below what {d} can resolve (16 * eps = "
                        f"{16 * float(np.finfo(d).eps):.1e}): x + h would round back to x and every "
                        f"derivative would be zero; use a larger step, or compute_dtype='float64'"
                    )
        return widened, dtypes

    @staticmethod
    def _value_dtype(y: np.ndarray, dtypes: list, data: list) -> np.dtype:
        # f's output in the dtype it would have had on the caller's inputs (float data included:
        # float32 x times float64 data is float64, as on every backend)
        floats = list(dtypes) + [d.dtype for d in data if isinstance(d, np.ndarray) and d.dtype.kind == "f"]
        return np.result_type(*floats) if y.dtype.kind == "f" and floats else y.dtype

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def is_native(self, a: Any) -> bool:
        return isinstance(a, np.ndarray)

    def _relative_step(self, dtype: np.dtype, order: int = 1) -> float:
        if self.step is not None:
            return float(self.step)
        eps = float(np.finfo(dtype).eps)
        # Nested differences (second order) see the inner rounding error amplified by
        # 1/h, so they take a larger step: eps**(1/7) instead of eps**(1/5).
        return eps ** (1.0 / 5.0) if order == 1 else eps ** (1.0 / 7.0)

    def _directional(self, fn: Callable, xs: list, data: list, ts: list, order: int = 1) -> np.ndarray:
        """``d/dh f(xs + h ts)`` at ``h = 0`` by the five-point stencil."""
        scale = max([1.0] + [float(np.max(np.abs(x), initial=0.0)) for x in xs])
        t_norm = max([float(np.max(np.abs(t), initial=0.0)) for t in ts] + [0.0])
        dtype = np.result_type(*xs)
        if t_norm == 0.0:
            y, _ = fn(xs, data)
            return np.zeros_like(np.asarray(y))
        h = self._relative_step(dtype, order) * scale / t_norm
        # np.asarray: on a 0-d array, x + h t is a numpy scalar, not an array.
        values = [fn([np.asarray(x + (k * h) * t, dtype=x.dtype) for x, t in zip(xs, ts)], data)[0] for k in _OFFSETS]
        return (_stencil(values) / h).astype(np.result_type(np.asarray(values[0]).dtype, dtype))

    def _jacobian_matrices(self, fn: Callable, xs: list, data: list, y: Any, order: int = 1) -> list:
        """``J_k`` of shape ``(y.size, xs[k].size)``, one stencil per input element."""
        ny = int(np.size(y))
        mats = []
        for k, x in enumerate(xs):
            cols = np.zeros((ny, x.size), dtype=np.result_type(np.asarray(y).dtype, x.dtype))
            for j in range(x.size):
                cols[:, j] = np.reshape(self._directional_elementwise(fn, xs, data, k, j, order), -1)
            mats.append(cols)
        return mats

    def _directional_elementwise(self, fn: Callable, xs: list, data: list, k: int, j: int, order: int) -> np.ndarray:
        # Step scaled by the element itself, |x_j|, rather than the whole input.
        x = xs[k]
        h = self._relative_step(x.dtype, order) * max(1.0, abs(float(x.reshape(-1)[j])))
        values = []
        for offset in _OFFSETS:
            moved = np.array(x, copy=True)  # an ndarray, so that reshape(-1) below is a view
            moved.reshape(-1)[j] += offset * h
            values.append(fn(xs[:k] + [moved] + xs[k + 1 :], data)[0])
        return _stencil(values) / h

    def flat_value_and_pullback(self, fn: Callable, xs: list, data: list):
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)
        y, aux = fn(xs, data)
        y = np.asarray(y)
        mats: list = []

        def vjp(dy: Any) -> list:
            if not mats:  # the Jacobian is built once, on the first pullback
                mats.extend(self._jacobian_matrices(fn, xs, data, y))
            flat_dy = np.reshape(dy, -1)
            return [(flat_dy @ m).reshape(x.shape).astype(d) for m, x, d in zip(mats, xs, dtypes)]

        return y.astype(self._value_dtype(y, dtypes, data)), aux, vjp

    def flat_value_and_pushforward(self, fn: Callable, xs: list, data: list):
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)
        y, aux = fn(xs, data)
        y = np.asarray(y)
        out = self._value_dtype(y, dtypes, data)

        def jvp(ts: list) -> np.ndarray:
            return np.asarray(self._directional(fn, xs, data, ts)).astype(out).reshape(y.shape)

        return y.astype(out), aux, jvp

    def flat_value_and_gradient(self, fn: Callable, xs: list, data: list):
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)
        y, aux = fn(xs, data)
        y = np.asarray(y)
        check_scalar(y)
        mats = self._jacobian_matrices(fn, xs, data, y)
        grads = [m.reshape(x.shape).astype(d) for m, x, d in zip(mats, xs, dtypes)]
        return y.astype(self._value_dtype(y, dtypes, data)), aux, grads

    def flat_hessian(self, fn: Callable, xs: list, data: list) -> np.ndarray:
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)
        grad = GradientFunction(self, fn)
        y, _ = grad(xs, data)
        (mat,) = self._jacobian_matrices(grad, xs, data, y, order=2)
        mat = 0.5 * (mat + mat.T)  # the exact Hessian is symmetric; averaging halves the error
        return mat.reshape(xs[0].shape + xs[0].shape).astype(dtypes[0])

    def flat_hvp(self, fn: Callable, xs: list, data: list, tangents: list) -> list:
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)

        def gradient_flat(points: list, data: list):
            _, _, grads = self.flat_value_and_gradient(fn, points, data)
            return np.concatenate([np.reshape(g, -1) for g in grads]), None

        hv = self._directional(gradient_flat, xs, data, tangents, order=2)
        out, start = [], 0
        for x, d in zip(xs, dtypes):
            out.append(hv[start : start + x.size].reshape(x.shape).astype(d))
            start += x.size
        return out

    def flat_second_derivative(self, fn: Callable, xs: list, data: list) -> np.ndarray:
        # as flat_hessian: the outer difference with the second-order step
        fn = _fresh_inputs(fn)
        _, d = self.flat_value_and_derivative(fn, xs, data)  # in the dtype the result takes
        wide, _ = self._widen(xs)

        def derivative(points: list, data: list) -> tuple[Any, None]:
            return self.flat_value_and_derivative(fn, points, data)[1], None

        (mat,) = self._jacobian_matrices(derivative, wide, data, d, order=2)
        return mat.reshape(np.shape(d)).astype(np.asarray(d).dtype)


# ---------------------------------------------------------------------------------------
# Portable functions: the two short names numpy lacks that the portable-functions table
# offers on every backend (docs/guide/portable.md), with scipy's semantics.  scipy is
# imported on first call only: this adapter needs numpy alone.  The autograd adapter
# registers these too (its functions see the numpy data arrays).
def _register_portable_functions() -> None:
    import autoray

    def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
        import scipy.special

        return scipy.special.logsumexp(a, axis=axis, b=b, keepdims=keepdims, return_sign=return_sign)

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        import scipy.linalg

        return scipy.linalg.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit_diagonal,
                                             overwrite_b=overwrite_b, check_finite=check_finite)

    autoray.register_function("numpy", "logsumexp", logsumexp)
    autoray.register_function("numpy", "linalg.solve_triangular", solve_triangular)


_register_portable_functions()

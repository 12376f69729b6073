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

# Five-point stencil: f'(x) ~ (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / (12 h).
# Differences are taken before weighting so that an input f does not depend on gives
# exactly zero, not rounding noise.
_OFFSETS = (-2.0, -1.0, 1.0, 2.0)


def _stencil(values: list) -> np.ndarray:
    f_m2, f_m1, f_p1, f_p2 = (np.asarray(v) for v in values)
    return (8.0 * (f_p1 - f_m1) - (f_p2 - f_m2)) / 12.0


class FiniteDifferencesBackend(Backend):
    name = "finite_differences"
    approximate = True

    def __init__(self, *, step: float | None = None, compute_dtype: str | None = None, device: str | None = None):
        if step is not None and not (isinstance(step, (int, float)) and 0 < step < 1):
            raise ValueError(f"step must be a relative step in (0, 1), e.g. 1e-3, got {step!r}")
        if compute_dtype is not None:
            try:
                valid = np.dtype(compute_dtype).kind == "f"
            except TypeError:
                valid = False
            if not valid:
                raise ValueError(f"compute_dtype must be a float dtype such as 'float64', got {compute_dtype!r}")
            compute_dtype = np.dtype(compute_dtype).name
        super().__init__(device=device, step=step, compute_dtype=compute_dtype)
        self.step = step
        self.compute_dtype = compute_dtype

    def _widen(self, xs: list) -> tuple[list, list]:
        """``xs`` in the compute dtype (when one is set), and the dtypes to return results in."""
        dtypes = [x.dtype for x in xs]
        if self.compute_dtype is None:
            return xs, dtypes
        return [x.astype(np.promote_types(x.dtype, self.compute_dtype)) for x in xs], dtypes

    @staticmethod
    def _value_dtype(y: np.ndarray, dtypes: list) -> np.dtype:
        # f's output in the dtype it would have had on the caller's inputs.
        return np.result_type(*dtypes) if y.dtype.kind == "f" and dtypes else y.dtype

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
        xs, dtypes = self._widen(xs)
        y, aux = fn(xs, data)
        y = np.asarray(y)
        mats: list = []

        def vjp(dy: Any) -> list:
            if not mats:  # the Jacobian is built once, on the first pullback
                mats.extend(self._jacobian_matrices(fn, xs, data, y))
            flat_dy = np.reshape(dy, -1)
            return [(flat_dy @ m).reshape(x.shape).astype(d) for m, x, d in zip(mats, xs, dtypes)]

        return y.astype(self._value_dtype(y, dtypes)), aux, vjp

    def flat_value_and_pushforward(self, fn: Callable, xs: list, data: list):
        xs, dtypes = self._widen(xs)
        y, aux = fn(xs, data)
        y = np.asarray(y)
        out = self._value_dtype(y, dtypes)

        def jvp(ts: list) -> np.ndarray:
            return np.asarray(self._directional(fn, xs, data, ts)).astype(out).reshape(y.shape)

        return y.astype(out), aux, jvp

    def flat_value_and_gradient(self, fn: Callable, xs: list, data: list):
        xs, dtypes = self._widen(xs)
        y, aux = fn(xs, data)
        y = np.asarray(y)
        check_scalar(y)
        mats = self._jacobian_matrices(fn, xs, data, y)
        grads = [m.reshape(x.shape).astype(d) for m, x, d in zip(mats, xs, dtypes)]
        return y.astype(self._value_dtype(y, dtypes)), aux, grads

    def flat_hessian(self, fn: Callable, xs: list, data: list) -> np.ndarray:
        xs, dtypes = self._widen(xs)
        grad = GradientFunction(self, fn)
        y, _ = grad(xs, data)
        (mat,) = self._jacobian_matrices(grad, xs, data, y, order=2)
        mat = 0.5 * (mat + mat.T)  # the exact Hessian is symmetric; averaging halves the error
        return mat.reshape(xs[0].shape + xs[0].shape).astype(dtypes[0])

    def flat_hvp(self, fn: Callable, xs: list, data: list, tangents: list) -> list:
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

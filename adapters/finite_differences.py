"""Finite differences in numpy: the backend-free reference adapter and test oracle.

Fourth-order central differences (a five-point stencil) with a step chosen per dtype,
``h = eps**(1/5) * max(1, |x|)``, which balances truncation error (h**4) against
rounding (eps/h): about 1e-12 relative error in float64, 1e-5 in float32.
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

    def __init__(self, *, step: float | None = None, device: str | None = None):
        if step is not None and not (isinstance(step, (int, float)) and 0 < step < 1):
            raise ValueError(f"step must be a relative step in (0, 1), e.g. 1e-3, got {step!r}")
        super().__init__(device=device, step=step)
        self.step = step

    def is_native(self, a: Any) -> bool:
        return isinstance(a, np.ndarray)

    def asarray(self, a: Any, dtype: str | None = None) -> np.ndarray:
        return np.asarray(a, dtype=dtype)

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
        y, aux = fn(xs, data)
        y = np.asarray(y)
        mats: list = []

        def vjp(dy: Any) -> list:
            if not mats:  # the Jacobian is built once, on the first pullback
                mats.extend(self._jacobian_matrices(fn, xs, data, y))
            flat_dy = np.reshape(dy, -1)
            return [(flat_dy @ m).reshape(x.shape).astype(x.dtype) for m, x in zip(mats, xs)]

        return y, aux, vjp

    def flat_value_and_pushforward(self, fn: Callable, xs: list, data: list):
        y, aux = fn(xs, data)
        y = np.asarray(y)

        def jvp(ts: list) -> np.ndarray:
            return np.asarray(self._directional(fn, xs, data, ts)).astype(y.dtype).reshape(y.shape)

        return y, aux, jvp

    def flat_value_and_gradient(self, fn: Callable, xs: list, data: list):
        y, aux = fn(xs, data)
        y = np.asarray(y)
        check_scalar(y)
        mats = self._jacobian_matrices(fn, xs, data, y)
        return y, aux, [m.reshape(x.shape).astype(x.dtype) for m, x in zip(mats, xs)]

    def flat_hessian(self, fn: Callable, xs: list, data: list) -> np.ndarray:
        grad = GradientFunction(self, fn)
        y, _ = grad(xs, data)
        (mat,) = self._jacobian_matrices(grad, xs, data, y, order=2)
        mat = 0.5 * (mat + mat.T)  # the exact Hessian is symmetric; averaging halves the error
        return mat.reshape(xs[0].shape + xs[0].shape).astype(xs[0].dtype)

    def flat_hvp(self, fn: Callable, xs: list, data: list, tangents: list) -> list:
        def gradient_flat(points: list, data: list):
            _, _, grads = self.flat_value_and_gradient(fn, points, data)
            return np.concatenate([np.reshape(g, -1) for g in grads]), None

        hv = self._directional(gradient_flat, xs, data, tangents, order=2)
        out, start = [], 0
        for x in xs:
            out.append(hv[start : start + x.size].reshape(x.shape).astype(x.dtype))
            start += x.size
        return out

"""Finite differences in numpy: the backend-free reference adapter and test oracle.

Central differences extrapolated to fourth order (Richardson; the first two levels are a
five-point stencil) with a step per element, ``h ~ eps**(1/5) * max(1, |x_i|)``, which
balances truncation (h**4) against rounding (eps/h): about 1e-12 relative error in float64,
1e-5 in float32.  How the differences move as the step shrinks estimates their error; where
it is too large (f varies on a scale below the step: sin at 1e8; or is not finite at x +- h:
log at 1e-300), smaller steps are tried, and where none gives an accurate derivative (a kink,
a jump, a domain edge, rounding noise) it raises an error naming the element, never a number.
Any layout of ``x`` works (transposed, reversed, broadcast); the caller's arrays are not written.

``compute_dtype="float64"`` evaluates ``f`` with its differentiated inputs widened to
float64 and returns results in the inputs' own dtypes: float32 derivatives accurate to
float32 rounding, which makes the backend an oracle for float32 code too.

An adapter of the protocol (:class:`abstractdiff.protocol.Adapter`):
``ad.backend("finite_differences")`` is a :class:`FiniteDifferencesBackend`, the core's backend
holding a :class:`FiniteDifferencesAdapter`, whose fast routes are the gradient (one difference
per element), the Hessian, the HVP and the second derivative (differences of those, with the
larger second-order step).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from abstractdiff._arrays import check_scalar
from abstractdiff._backend import AdapterBackend
from abstractdiff._cache import Memo
from abstractdiff._custom import numerical_evaluation
from abstractdiff._derived import GradientFunction
from abstractdiff._errors import FiniteDifferenceAccuracyError, InvalidArgumentError, NonFiniteInputError
from abstractdiff._hooks import AdapterHooks
from abstractdiff.protocol import Adapter

# Central differences D(h) = (f(x + h t) - f(x - h t)) / 2h at steps h, h/r, h/r**2, h/r**3,
# Richardson-extrapolated: D(h/r) + (D(h/r) - D(h)) / (r**2 - 1) cancels the h**2 error, as a
# five-point stencil does, and how the D's move as the step shrinks says whether it suits f
# here.  The first two levels usually decide (four evaluations per derivative, as a plain
# five-point stencil); the deeper ones, and smaller steps, are spent only where they do not.
# r is not an integer: with r = 2, a periodic f whose period divides h (sin at 1e8, h ~ 1e5)
# gives the same wrong D at h, h/2, h/4..., which would pass for convergence.
_RATIO = 5.0**0.5
_LEVELS = 4  # levels that decide; up to _CONFIRM more confirm an estimate accepted by the last ones
_CONFIRM = 3
_TRIALS = 8  # steps tried before refusing: h0, then smaller ones (_SHRINK or _SHRINK**2 times)
_SHRINK = 16.0
_NOISE_ULPS = 64.0  # the rounding error assumed in each value of f, in eps * |f|
# The smallest step, in units of x's spacing.  f seen only at a few spacings apart cannot
# show that it varies on a smaller scale: float32 sin at 9e9 (spacing 1024) sampled at 1, 2,
# 3 spacings is a smooth function of the step, with a wrong derivative.
_MIN_GRAINS = 8


_SEARCHES = threading.local()  # per thread: how many step searches began, to see nesting


def _searches() -> int:
    return getattr(_SEARCHES, "count", 0)


class _Level:
    """One central difference, taken over the steps actually reached (``x + h`` rounds)."""

    __slots__ = ("d", "half", "peak", "finite", "nested")

    def __init__(self, evaluate: Callable, h: float):
        before = _searches()
        (f_plus, h_plus), (f_minus, h_minus) = evaluate(h), evaluate(-h)
        # f itself took finite differences (a gradient inside f, Sparse's Hessian): its values
        # carry that difference's error, not just rounding
        self.nested = _searches() != before
        # x + h rounds to x: the step is below what x's dtype resolves
        self.half = (h_plus - h_minus) / 2.0 if h_plus and h_minus else 0.0
        if self.half == 0.0:
            return
        f_plus, f_minus = np.asarray(f_plus), np.asarray(f_minus)
        # the difference first, so that an output f does not depend on gets exactly zero
        self.d = np.asarray((f_plus - f_minus) / (2.0 * self.half))
        self.peak = np.maximum(np.abs(f_plus), np.abs(f_minus))
        self.finite = np.isfinite(f_plus) & np.isfinite(f_minus)


def _richardson(coarse: Any, fine: Any, power: int = 2) -> np.ndarray:
    """``fine`` with its ``h**power`` error, estimated from ``coarse``, taken off (``.d``: the
    estimates, ``.half``: their steps)."""
    ratio = (coarse.half / fine.half) ** power  # _RATIO**power, up to the rounding of the steps
    return fine.d + (fine.d - coarse.d) / (ratio - 1.0)


class _Extrapolated:
    __slots__ = ("d", "half")

    def __init__(self, d: np.ndarray, half: float):
        self.d, self.half = d, half


class _Tolerance(NamedTuple):
    """How well f's values are known and how well the differences must agree."""

    eps: float  # the relative error of a value of f, before _NOISE_ULPS
    tau: float  # the agreement the criteria ask for, relative to the size of the D's
    normwise: bool  # whether a value's error scales with the largest output (a nested difference's)


def _judge(levels: list, tol: _Tolerance) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(estimate, accepted, slack)`` per output element, from the deepest criterion ``levels`` allow
    (a Romberg table: each column takes off one more power of h):

    - two levels: D(h) and D(h/r) agree to ``tol.tau`` (relative to their size) or to rounding;
    - three: the two h**2-free estimates agree, and the D's converge (each change at most half
      the previous); this accepts a zero derivative approached as h**2 (x**3 at 0);
    - four: the two h**2- and h**4-free estimates agree, and the D's converge; this accepts a
      zero derivative approached as h**4 (x**5 at 0).

    ``slack``: the disagreement allowed, ``tau`` relative to the size of the D's, or rounding.
    """
    ds = [lv.d for lv in levels]
    size = functools.reduce(np.maximum, [np.abs(d) for d in ds])  # faster than np.max of a list
    peak = functools.reduce(np.maximum, [lv.peak for lv in levels])
    noise = _NOISE_ULPS * tol.eps * (np.max(peak) if tol.normwise else peak) / levels[-1].half
    slack = np.maximum(tol.tau * size, noise)
    changes = [np.abs(b - a) for a, b in zip(ds, ds[1:])]
    if len(levels) == 2:
        return _richardson(*levels), changes[0] <= slack, slack
    converging = changes[-1] <= 0.5 * changes[-2] + noise
    column = [_Extrapolated(_richardson(a, b), b.half) for a, b in zip(levels, levels[1:])]
    if len(levels) == 4:
        column = [_Extrapolated(_richardson(a, b, 4), b.half) for a, b in zip(column, column[1:])]
    return column[-1].d, converging & (np.abs(column[-1].d - column[-2].d) <= slack), slack


class _Search:
    """Per output element: the derivative found, whether it is still to find, and the estimate
    held for confirmation with the index of the level that ended the window accepting it."""

    def __init__(self, first: _Level, live: np.ndarray):
        self.result = np.array(first.d, copy=True)  # the outputs not finite at x keep this one
        self.todo = live.copy()
        self.held = np.zeros_like(self.todo)
        self.held_value = np.zeros_like(self.result)
        self.held_slack = np.zeros_like(self.result)
        self.held_at = np.full(self.todo.shape, -1)
        self.fallback, self.uncertainty = self.result, np.full(self.result.shape, np.inf)

    def consider(self, estimate: np.ndarray, accepted: np.ndarray, slack: np.ndarray, start: int, end: int,
                 final_at_once: bool) -> None:
        """Take the estimates of the window of levels ``start..end`` where ``accepted``: final
        where they confirm a held estimate from a disjoint window (or ``final_at_once``),
        held otherwise."""
        accepted = accepted & self.todo & ~(self.held & (start <= self.held_at))  # overlapping: no news
        agree = np.abs(estimate - self.held_value) <= slack + self.held_slack  # each within its own
        final = accepted & ((self.held & agree) | (~self.held & final_at_once))
        hold = accepted & ~final
        self.result = np.where(final, estimate, self.result)
        self.held_value = np.where(hold, estimate, self.held_value)
        self.held_slack = np.where(hold, slack, self.held_slack)
        self.held_at = np.where(hold, end, self.held_at)
        self.todo &= ~final
        self.held = (self.held | hold) & self.todo


def _extrapolate(evaluate: Callable, h: float, smaller: float, floor: float, live: np.ndarray,
                 tols: tuple[_Tolerance, ...], where: Callable[[], str], large: bool) -> np.ndarray:
    """The derivative ``d/dh f(x + h t)`` at 0, one per output element, accurate to about ``tau``
    of ``tols = (plain, nested)``, the second where f's values are themselves differences.

    Each trial is a sequence of levels, steps ``h / r**k``, judged by windows of 2 to 4 levels
    (:func:`_judge`).  A further trial takes a smaller ``h`` (``_SHRINK`` times, or its square
    where the differences were far apart), or at once ``smaller`` (relative to ``|x|`` itself,
    for a domain edge near a small ``x``), but with its levels above ``floor``, the smallest step
    x's dtype resolves.  ``live``: the outputs finite at ``x``, the only ones held to the
    criteria.  Raises :class:`_NoStep` rather than return an estimate no step made accurate.

    An estimate is final at once only in the common case: the first trial's first two levels,
    at a step not ``large`` in absolute terms.  Any other needs a disjoint window's estimate to
    agree: differences can look converged by chance at a step far larger than f's scale (sin
    at 1e8), at a rate of about ``tau`` per criterion, but hardly in two windows.
    """
    _SEARCHES.count = _searches() + 1
    search, first, shifted = None, h, False
    for trial in range(_TRIALS):
        levels: list = []
        clean_from = 0  # the first level after the last one where f was not finite (per output)
        for k in range(_LEVELS + _CONFIRM):
            level = _Level(evaluate, h / _RATIO**k)
            if level.half == 0.0 or (levels and level.half >= levels[-1].half):
                break  # x's dtype resolves no smaller step (or rounds it to the last one)
            levels.append(level)
            if search is None:  # trial 0
                if k == 0:
                    continue
                if not large:  # the common case, decided by the first two levels: no bookkeeping
                    estimate, accepted, _ = _judge(levels, tols[levels[0].nested or level.nested])
                    if np.all(accepted | ~live):
                        return np.where(live, estimate, levels[0].d)
                search = _Search(levels[0], live)
                clean_from = np.where(~levels[0].finite & live, 1, 0)
            clean_from = np.where(~level.finite & search.todo, k + 1, clean_from)
            for start in range(k - 1, max(k - _LEVELS, -1), -1):
                window = levels[start:]
                estimate, accepted, slack = _judge(window, tols[any(lv.nested for lv in window)])
                if trial:  # a smaller step than the natural one: no change in f is f not resolving it
                    accepted &= np.logical_or.reduce([lv.d != 0 for lv in window])
                common = trial == 0 and k == 1 and not large
                search.consider(estimate, accepted & (clean_from <= start), slack, start, k, common)
            if not search.todo.any():
                return search.result
            if trial == 0 and k == _LEVELS - 1:
                search.fallback, search.uncertainty = _noise_limited(levels, tols[any(lv.nested for lv in levels)])
            if k >= _LEVELS - 1 and not search.held.any():  # else go on: a disjoint window may confirm
                break
        if search is None:
            raise _NoStep(_refusal(where(), f"x's dtype resolves no step below {first:.1e}", None), None, 0.0)
        last = h / _RATIO ** max(len(levels) - 1, 0)
        search.held_at[...] = -1  # the next sequence is disjoint from this one
        shrunk = min(h / (_SHRINK**2 if _far_apart(levels, search.todo & ~search.held) else _SHRINK), smaller)
        if shrunk < floor * _RATIO ** (_LEVELS - 1) <= h:  # keep a whole trial above the floor
            shrunk = floor * _RATIO ** (_LEVELS - 1)
        if shrunk >= h or len(levels) < _LEVELS:  # at the floor: one more trial, between these steps
            if shifted:
                break
            shifted, shrunk = True, h / _RATIO**0.5
        h = shrunk
    tried = f"steps from {first:.1e} to {last:.1e}"
    if np.any((clean_from > 0) & search.todo):  # in the last trial
        raise _NoStep(NonFiniteInputError(
            f"finite differences cannot differentiate {where()}{_outputs(search.todo)}: f is finite there but not "
            f"at x +- h for every step h tried ({tried}), so x is on the edge of f's domain or f overflows next "
            f"to it; move x inside the domain, or use an exact AD backend"
        ), None, tols[0].tau)
    raise _NoStep(_refusal(where(), tried, search), search, tols[0].tau)


def _noise_limited(levels: list, tol: _Tolerance) -> tuple[np.ndarray, np.ndarray]:
    """``(estimate, uncertainty)`` per output from the natural step's levels, for :func:`_settle`.

    Where f's own rounding swamps the differences at every level (a cancellation inside f:
    log(1 + x**2) at x = 1e-9), the D's scatter without trend, and more as the step shrinks
    (truncation error would shrink r**4 = 25 times over four levels).  Their coarsest estimate
    is then known to about that scatter, if the noise it implies in f's values is small
    (sqrt(eps)) against f's values, unlike a step far too large, which scatters as much as f.
    Elsewhere the uncertainty is inf.
    """
    ds = [lv.d for lv in levels]
    changes = [np.abs(b - a) for a, b in zip(ds, ds[1:])]
    peak = np.max([lv.peak for lv in levels], axis=0)
    implied = np.max([c * lv.half for c, lv in zip(changes, levels[1:])], axis=0)
    eligible = (changes[-1] >= changes[0]) & (implied <= np.sqrt(tol.eps) * (np.max(peak) if tol.normwise else peak))
    return _richardson(levels[0], levels[1]), np.where(eligible, np.max(changes, axis=0), np.inf)


class _NoStep(Exception):
    """No step made some outputs accurate.  ``error``: the public error to raise, unless
    :func:`_settle` finds the noise-limited ``estimate`` accurate against the whole derivative."""

    def __init__(self, error: Exception, search: _Search | None, tau: float):
        super().__init__(str(error))
        self.error, self.tau, self.estimate, self.uncertainty = error, tau, None, None
        if search is not None:
            self.estimate = np.where(search.todo, search.fallback, search.result)
            self.uncertainty = np.where(search.todo, search.uncertainty, 0.0)


def _settle(failure: _NoStep, scale: Any) -> np.ndarray:
    """``failure.estimate`` where its uncertainty is within ``tau / 4`` of ``scale``, the size of
    the whole derivative (per output; a gradient element at f's rounding noise among larger
    ones), else raise the error.  The uncertainty is the estimate's likely error, not a bound
    far above it as the criteria's are: hence the margin."""
    if failure.estimate is None or not np.all(failure.uncertainty <= 0.25 * failure.tau * scale):
        raise failure.error
    return failure.estimate


def _size(a: np.ndarray, axis: Any = None) -> Any:
    return np.max(np.abs(np.where(np.isfinite(a), a, 0.0)), axis=axis, initial=0.0)


def _far_apart(levels: list, todo: np.ndarray) -> bool:
    """Whether the first two differences disagree by half their size: the step is far too large."""
    if len(levels) < 2:
        return False
    d0, d1 = levels[0].d, levels[1].d
    return bool(np.any((np.abs(d1 - d0) > 0.5 * np.maximum(np.abs(d0), np.abs(d1))) & todo))


def _in_grains(step: Any, grain: Any) -> Any:
    """``step`` rounded to a whole number of ``grain`` (x's spacing) where that is not negligible:
    ``x + step`` and ``x - step`` are then exact, and the steps either side equal."""
    if isinstance(step, float):  # the common case, one element: Python floats are faster
        grain = float(grain)
        return step if abs(step) >= grain * 2.0**40 else round(step / grain) * grain
    rounded = np.round(np.asarray(step, dtype=np.float64) / grain) * grain
    return np.where(np.abs(step) >= grain * 2.0**40, step, rounded)


def _tangent_probe(fn: Callable, xs: list, data: list, ts: list, y: Any, tau: float) -> Callable:
    """``evaluate(h) -> (f(xs + h ts), the step reached along ts)`` for :func:`_extrapolate`.

    Steps are whole units of each ``x_i``'s spacing (as in ``_elementwise``), ``h`` itself one
    of the largest spacing: spacings are powers of two, so a tangent of ones or powers of two
    moves exactly along itself.  Any other bends off it by rounding; a step too small to keep
    that bend within ``tau``, or below ``_MIN_GRAINS`` spacings, reports no step (0.0), which
    ends the search.
    """
    tt = sum(float(np.vdot(t, t)) for t in ts)
    t_norm = max(float(np.max(np.abs(t), initial=0.0)) for t in ts)
    grains = [np.spacing(np.abs(x)) for x in xs]
    unit = max(float(np.max(g[t != 0], initial=0.0)) for g, t in zip(grains, ts))

    def evaluate(h: float) -> tuple[Any, float]:
        h = _in_grains(h, unit)
        if abs(h) < _MIN_GRAINS * unit:
            return y, 0.0
        points = [np.asarray(x + _in_grains(h * t, g), dtype=x.dtype) for x, t, g in zip(xs, ts, grains)]
        moves = [p.astype(np.float64) - x for p, x in zip(points, xs)]
        reached = sum(float(np.vdot(m, t)) for m, t in zip(moves, ts)) / tt
        off = max(float(np.max(np.abs(m - reached * t), initial=0.0)) for m, t in zip(moves, ts))
        if reached == 0.0 or off > tau * abs(reached) * t_norm:
            return y, 0.0
        return fn(points, data)[0], reached

    return evaluate


def _eps(dtype: np.dtype) -> float:
    return float(np.finfo(dtype).eps)


_TOLERANCES: Memo = Memo(name="finite-difference tolerances", keyed_on="input dtypes, f's dtype, order")


def _tolerance(dtypes: tuple, value_dtype: np.dtype, order: int) -> _Tolerance:
    key = (dtypes, value_dtype, order)
    found = _TOLERANCES.get(key)
    if found is None:
        found = _TOLERANCES[key] = _computed_tolerance(dtypes, value_dtype, order)
    return found


def _computed_tolerance(dtypes: tuple, value_dtype: np.dtype, order: int) -> _Tolerance:
    """From the coarser of the inputs' and f's precision ``eps``.  Second order differences a
    first-order difference, whose values are known to its own accuracy, about eps**(4/5) of the
    largest (inner rounding and truncation); it is judged looser, as it is checked."""
    eps = max(_eps(d) for d in (*dtypes, value_dtype) if np.issubdtype(d, np.floating))
    if order == 1:
        return _Tolerance(eps, eps ** (1.0 / 3.0), normwise=False)
    return _Tolerance(eps**0.8, eps ** (1.0 / 6.0), normwise=True)


def _outputs(todo: np.ndarray) -> str:
    if todo.ndim == 0:
        return ""
    some = [tuple(int(i) for i in index) for index in np.argwhere(todo)[:3]]
    return f" (output elements {', '.join(map(str, some))}{', ...' if todo.sum() > 3 else ''})"


def _refusal(where: str, tried: str, search: _Search | None) -> FiniteDifferenceAccuracyError:
    todo = search.todo if search is not None else np.zeros(())
    return FiniteDifferenceAccuracyError(
        f"finite differences found no step giving an accurate derivative {where}{_outputs(todo)} ({tried}): "
        f"the differences do not settle as the step shrinks, so f has a kink or jump there, or its values are "
        f"too noisy (rounding) for any step; use an exact AD backend there, or compute_dtype='float64' for "
        f"float32 code"
    )


def _fresh_inputs(fn: Callable) -> Callable:
    """``fn`` called on copies: an ``f`` that writes into its inputs must neither change the
    caller's arrays nor move the point of the next evaluation."""

    def call(xs: list, data: list) -> tuple:
        copy = lambda a: a.copy() if isinstance(a, np.ndarray) else a  # noqa: E731
        with numerical_evaluation("finite_differences"):  # where ad.stop_gradient cannot be honoured
            return fn([copy(x) for x in xs], [copy(d) for d in data])

    return call


class FiniteDifferencesAdapter(Adapter):
    name = "finite_differences"
    approximate = True
    fast_routes = {"value_and_gradient": "value_and_gradient", "hessian": "hessian", "hvp": "hvp",
                   "second_derivative": "second_derivative"}

    def __init__(self, *, device: str = "cpu", step: float | None = None, compute_dtype: str | None = None):
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
        super().__init__(device=device, step=step, compute_dtype=compute_dtype)
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

    def _relative_step(self, dtype: np.dtype, order: int = 1) -> float:
        if self.step is not None:
            return float(self.step)
        # Nested differences (second order) see the inner rounding error amplified by
        # 1/h, so they take a larger step: eps**(1/7) instead of eps**(1/5).
        return _eps(dtype) ** (1.0 / 5.0 if order == 1 else 1.0 / 7.0)

    @staticmethod
    def _tolerance(dtypes: list, values: Any, order: int) -> _Tolerance:
        return _tolerance(tuple(dtypes), np.asarray(values).dtype, order)

    def _extrapolated(self, evaluate: Callable, y: Any, dtypes: list, scale: float, distance: float, floor: float,
                      order: int, where: Callable[[], str], large: bool) -> np.ndarray:
        """``d/dh f(x + h t)`` at 0 with ``evaluate(h) -> (f(x + h t), h actually reached)``:
        the first step is relative to ``scale = max(|x|, 1)`` along ``t``; a smaller one,
        relative to the ``distance`` to the nearest zero of ``x``, is tried where it fails.
        ``floor``: the smallest step x's dtype resolves.  ``large``: ``|x|`` is so large (over 32)
        that f may vary on a scale far below the step (sin at 1e8), so every estimate is
        confirmed by a second one."""
        y = np.asarray(y)
        tols = (self._tolerance(dtypes, y, order), self._tolerance(dtypes, y, 2))
        rel = self._relative_step(dtypes[0], order)
        smaller = 2.0 * rel * distance if distance > 0 else np.inf
        # f away from the caller's point: a NaN there means "smaller step", not a warning
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return _extrapolate(evaluate, 2.0 * rel * scale, smaller, floor, np.isfinite(y), tols, where, large)

    def _directional(self, fn: Callable, xs: list, data: list, ts: list, order: int = 1,
                     y: Any = None) -> np.ndarray:
        """``d/dh f(xs + h ts)`` at ``h = 0``; ``y``: f at ``xs`` when the caller has it."""
        wide = [np.asarray(t, dtype=np.float64) for t in ts]
        t_norm = max([float(np.max(np.abs(t), initial=0.0)) for t in wide] + [0.0])
        if y is None:
            y, _ = fn(xs, data)
        if t_norm == 0.0:
            return np.zeros_like(np.asarray(y))
        # along t / max|t| (a tiny t's squared norm underflows), scaled back at the end
        wide = [t / t_norm for t in wide]
        moved = [np.abs(x[t != 0]) for x, t in zip(xs, wide)]
        along = [np.abs(t[t != 0]) for t in wide]
        # one step for every element t moves: the one that suits the smallest, relative to its
        # own max(|x_i|, 1) (a step relative to the largest |x_i| is far too large for the others)
        scale = min(float(np.min(np.maximum(m, 1.0) / a)) for m, a in zip(moved, along) if m.size)
        ratios = [m / a for m, a in zip(moved, along)]
        distance = min([float(np.min(r[r > 0])) for r in ratios if np.any(r > 0)], default=0.0)
        large = max(float(np.max(m, initial=0.0)) for m in moved) > 32.0
        dtypes = [x.dtype for x in xs]
        evaluate = _tangent_probe(fn, xs, data, wide, y, self._tolerance(dtypes, y, order).tau)
        try:
            floor = _MIN_GRAINS * max(float(np.max(np.spacing(m), initial=0.0)) for m in moved)
            d = self._extrapolated(evaluate, y, dtypes, scale, distance, floor, order, lambda: "along the tangent",
                                   large)
        except _NoStep as failure:
            d = _settle(failure, _size(failure.estimate) if failure.estimate is not None else 0.0)
        return (d * t_norm).astype(np.result_type(np.asarray(y).dtype, *dtypes))

    def _jacobian_matrices(self, fn: Callable, xs: list, data: list, y: Any, order: int = 1) -> list:
        """``J_k`` of shape ``(y.size, xs[k].size)``, one extrapolated difference per input element."""
        ny = int(np.size(y))
        mats, failures = [], []
        for k, x in enumerate(xs):
            cols = np.zeros((ny, x.size), dtype=np.result_type(np.asarray(y).dtype, x.dtype))
            for j in range(x.size):
                try:
                    cols[:, j] = np.reshape(self._elementwise(fn, xs, data, y, k, j, order), -1)
                except _NoStep as failure:
                    failures.append((k, j, failure))
                    cols[:, j] = np.reshape(failure.estimate, -1) if failure.estimate is not None else np.nan
            mats.append(cols)
        if failures:  # judged against each output's largest derivative, once all are known
            rows = np.max([_size(m, axis=1) for m in mats], axis=0)
            for k, j, failure in failures:
                mats[k][:, j] = np.reshape(_settle(failure, rows.reshape(np.shape(failure.uncertainty))), -1)
        return mats

    def _elementwise(self, fn: Callable, xs: list, data: list, y: Any, k: int, j: int, order: int) -> np.ndarray:
        """``df/dx_j`` for element ``j`` (C order) of ``xs[k]``, with a step scaled by ``|x_j|``."""
        x = xs[k]
        x_j = x.reshape(-1)[j]  # a copy when x is not C-contiguous: read only
        # Steps in whole units of x_j's spacing: x_j + h and x_j - h are then exact, so the two
        # steps are equal and a large |x_j| (sin at 1e8) adds no asymmetry error.
        grain = np.spacing(np.abs(x_j))

        def evaluate(h: float) -> tuple[Any, float]:
            if abs(h) < _MIN_GRAINS * grain:
                return y, 0.0
            # A fresh C-ordered copy, so that reshape(-1) is a view of it: x may be transposed,
            # reversed or broadcast (zero strides), and it is the caller's array.
            moved = np.array(x, order="C", copy=True)
            moved.reshape(-1)[j] = target = x.dtype.type(float(x_j) + _in_grains(h, grain))
            return fn(xs[:k] + [moved] + xs[k + 1 :], data)[0], float(target) - float(x_j)

        def where() -> str:
            index = tuple(int(i) for i in np.unravel_index(j, x.shape)) if x.shape else ()
            return f"with respect to x's float leaf {k}, element {index} (value {float(x_j):.17g})"

        magnitude = abs(float(x_j))
        return self._extrapolated(evaluate, y, [x.dtype], max(magnitude, 1.0), magnitude, _MIN_GRAINS * float(grain),
                                  order, where, magnitude > 32.0)

    def value_and_pullback(self, fn: Callable, xs: list, data: list):
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

    def value_and_pushforward(self, fn: Callable, xs: list, data: list):
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)
        y, aux = fn(xs, data)
        y = np.asarray(y)
        out = self._value_dtype(y, dtypes, data)

        def jvp(ts: list) -> np.ndarray:
            return np.asarray(self._directional(fn, xs, data, ts, y=y)).astype(out).reshape(y.shape)

        return y.astype(out), aux, jvp

    def value_and_gradient(self, fn: Callable, xs: list, data: list):
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)
        y, aux = fn(xs, data)
        y = np.asarray(y)
        check_scalar(y)
        mats = self._jacobian_matrices(fn, xs, data, y)
        grads = [m.reshape(x.shape).astype(d) for m, x, d in zip(mats, xs, dtypes)]
        return y.astype(self._value_dtype(y, dtypes, data)), aux, grads

    def hessian(self, fn: Callable, xs: list, data: list) -> np.ndarray:
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)
        grad = GradientFunction(self.backend, fn)  # the holder's gradient: a subclass's, where it has one
        y, _ = grad(xs, data)
        (mat,) = self._jacobian_matrices(grad, xs, data, y, order=2)
        mat = 0.5 * (mat + mat.T)  # the exact Hessian is symmetric; averaging halves the error
        return mat.reshape(xs[0].shape + xs[0].shape).astype(dtypes[0])

    def hvp(self, fn: Callable, xs: list, data: list, tangents: list) -> list:
        fn = _fresh_inputs(fn)
        xs, dtypes = self._widen(xs)

        def gradient_flat(points: list, data: list):
            _, _, grads = self.backend.flat_value_and_gradient(fn, points, data)
            return np.concatenate([np.reshape(g, -1) for g in grads]), None

        hv = self._directional(gradient_flat, xs, data, tangents, order=2)
        out, start = [], 0
        for x, d in zip(xs, dtypes):
            out.append(hv[start : start + x.size].reshape(x.shape).astype(d))
            start += x.size
        return out

    def second_derivative(self, fn: Callable, xs: list, data: list) -> np.ndarray:
        # as hessian: the outer difference with the second-order step
        fn = _fresh_inputs(fn)
        backend = self.backend
        _, d = backend.flat_value_and_derivative(fn, xs, data)  # in the dtype the result takes
        wide, _ = self._widen(xs)

        def derivative(points: list, data: list) -> tuple[Any, None]:
            return backend.flat_value_and_derivative(fn, points, data)[1], None

        (mat,) = self._jacobian_matrices(derivative, wide, data, d, order=2)
        return mat.reshape(np.shape(d)).astype(np.asarray(d).dtype)


class FiniteDifferencesBackend(AdapterBackend):
    """``ad.backend("finite_differences")``: the core's backend holding a :class:`FiniteDifferencesAdapter`.

    ``FiniteDifferencesBackend(*, device=None, chunk_size=None, step=None, compute_dtype=None)``.
    A class of its own, not the bare holder, because code written for the older design
    subclasses the reference backend to change one operator (deliberately wrong backends that
    test the checkers, the testing guide's stand-in adapter): a subclass's own methods and
    traits (``name = "myad"``) win over the adapter's that the holder binds, its ``super()``
    calls reach the adapter's, and a subclass is a backend of its own, with caches of its own.
    """

    def __init__(self, *, device: str | None = None, chunk_size: int | None = None, step: float | None = None,
                 compute_dtype: str | None = None):
        super().__init__(FiniteDifferencesAdapter, device=device, chunk_size=chunk_size, step=step,
                         compute_dtype=compute_dtype)
        own = type(self).__mro__[: type(self).__mro__.index(FiniteDifferencesBackend)]
        for attr in [a for a in vars(self) if any(a in vars(cls) for cls in own)]:
            del self.__dict__[attr]  # bound by the holder over a subclass's own definition

    # what a subclass's super().flat_X(...) reaches: the adapter's own operators
    def flat_value_and_pullback(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, Callable]:
        return self.adapter.value_and_pullback(fn, xs, data)

    def flat_value_and_pushforward(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, Callable]:
        return self.adapter.value_and_pushforward(fn, xs, data)

    def flat_value_and_gradient(self, fn: Callable, xs: list, data: list) -> tuple[Any, Any, list]:
        return self.adapter.value_and_gradient(fn, xs, data)

    # identity by class, as for any backend class: a subclass's artefacts are not the reference's
    __repr__ = AdapterHooks.__repr__
    __eq__ = AdapterHooks.__eq__
    __hash__ = AdapterBackend.__hash__
    _cache_class = AdapterHooks._cache_class

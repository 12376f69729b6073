"""The composition check: one library's code calling another library's kernel
(:func:`abstractdiff.differentiate_with`), against the same function in one library.

``check_pair(outer, inner, dtype) -> PairResult`` differentiates ``outer_code(g)`` with
``outer`` (``g`` is :func:`kernel` wrapped for ``inner``) and compares the value, the
gradient, the pullback, the pushforward and the Hessian with those of :func:`reference`
(the same function, all in ``outer``); forward mode and the Hessian may be refused (a
:class:`~abstractdiff.CompositionError`) where the outer library's mechanism stops.  The
functions are written once with autoray, so they run on every backend.  Used by
``abstractdiff check`` and by ``tests/test_compose.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from autoray import numpy as anp

from ..core import approximates

__all__ = ["MODES", "TOLERANCES", "PairResult", "check_pair", "kernel", "outer_code", "reference"]

#: What is compared, in this order.
MODES = ("value", "gradient", "pullback", "pushforward", "hessian")
#: The modes an adapter may refuse through the boundary (with a CompositionError).
REFUSABLE = ("pushforward", "hessian")
#: Absolute and relative tolerance per dtype.
TOLERANCES = {"float64": 1e-12, "float32": 1e-5}
#: The point, the output cotangent and the input tangent.
X = np.array([0.1, 0.2, 0.3, 1.5, 2.0])
DY = np.array([1.0, -2.0, 0.5, 3.0])
DX = np.linspace(-1.0, 1.0, 5)


def kernel(x: Any) -> Any:
    """The inner library's function: a pytree in (``{"u": (3,), "v": (2,)}``), a pytree out."""
    return {"a": anp.sin(x["u"]) * x["v"][0], "b": anp.sum(x["u"] ** 3)}


def outer_code(g: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The outer library's function of a vector ``t`` (5,), calling ``g`` (the kernel) inside."""

    def outer(t: Any) -> Any:
        out = g({"u": t[:3] * 2.0, "v": t[3:]})
        return anp.concatenate([out["a"] ** 2, anp.reshape(out["b"], (1,))])

    return outer


def reference(t: Any) -> Any:
    """``outer_code(kernel)`` written in one library."""
    u, v = t[:3] * 2.0, t[3:]
    return anp.concatenate([(anp.sin(u) * v[0]) ** 2, anp.reshape(anp.sum(u**3), (1,))])


@dataclass
class PairResult:
    """One (outer, inner) pair: the modes that agree, the one refused, the worst difference."""

    outer: str
    inner: str
    dtype: str
    passed: list[str] = field(default_factory=list)  # modes that agree with the reference
    refused: dict[str, str] = field(default_factory=dict)  # refused modes: the error's type
    failure: str | None = None  # the first disagreement or error
    max_abs_diff: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None

    def line(self) -> str:
        """``torch over jax: ok (gradient, pullback, pushforward, hessian)``, or ``...: FAIL ...``."""
        head = f"{self.outer} over {self.inner}"
        if not self.ok:
            return f"{head}: FAIL {self.failure}"
        modes = ", ".join(m for m in self.passed if m != "value")
        refused = "".join(f"; {mode} refused ({why})" for mode, why in self.refused.items())
        return f"{head}: ok ({modes}){refused}"

    def to_dict(self) -> dict[str, Any]:
        return {"outer": self.outer, "inner": self.inner, "dtype": self.dtype, "ok": self.ok,
                "passed": list(self.passed), "refused": dict(self.refused), "failure": self.failure,
                "max_abs_diff": self.max_abs_diff}


def _difference(got: Any, want: Any, dtype: str, tol: float) -> tuple[float, str | None]:
    """(max abs difference, why it fails or None)."""
    import abstractdiff as ad

    got, want = np.asarray(ad.to_numpy(got)), np.asarray(ad.to_numpy(want))
    if got.dtype != np.dtype(dtype) or got.shape != want.shape:
        return float("inf"), f"{got.dtype}{list(got.shape)} where {want.dtype}{list(want.shape)} was expected"
    diff = float(np.max(np.abs(got - want), initial=0.0))
    bad = not np.allclose(got, want, rtol=tol, atol=tol)
    return diff, (f"max abs diff {diff:.0e}" if bad else None)


def _is_refusal(err: Exception) -> bool:
    """A refusal through the boundary (an adapter's CompositionError)."""
    from abstractdiff import CompositionError

    return isinstance(err, CompositionError)


def check_pair(outer: Any, inner: Any, dtype: str = "float64") -> PairResult:
    """``outer``'s derivatives of :func:`outer_code` calling :func:`kernel` through
    ``differentiate_with(kernel, inner)``, against :func:`reference`: ``PairResult``.

    Example:
        >>> from abstractdiff.testing._composition import check_pair
        >>> check_pair("autograd", "finite_differences", "float32").line()
        'autograd over finite_differences: ok (gradient, pullback, pushforward, hessian)'
    """
    import abstractdiff as ad

    b, kb = ad.backend(outer), ad.backend(inner)
    out = PairResult(b.name, kb.name, dtype)
    f = outer_code(ad.differentiate_with(kernel, kb))
    x, dy, dx = (b.asarray(a.astype(dtype)) for a in (X, DY, DX))

    def value() -> tuple[Any, Any]:
        with b.scope([x]):  # jax computes in float64 only in its x64 scope
            return f(x), reference(x)

    checks: dict[str, Callable[[], tuple[Any, Any]]] = {
        "value": value,
        "gradient": lambda: (ad.gradient(b, lambda t: anp.sum(f(t) * dy), x),
                             ad.gradient(b, lambda t: anp.sum(reference(t) * dy), x)),
        "pullback": lambda: (ad.pullback(b, f, x)(dy), ad.pullback(b, reference, x)(dy)),
        "pushforward": lambda: (ad.pushforward(b, f, x)(dx), ad.pushforward(b, reference, x)(dx)),
        "hessian": lambda: (ad.hessian(b, lambda t: anp.sum(f(t) * dy), x),
                            ad.hessian(b, lambda t: anp.sum(reference(t) * dy), x)),
    }
    for mode in MODES:
        try:
            got, want = checks[mode]()
        except Exception as err:
            if mode in REFUSABLE and _is_refusal(err):
                out.refused[mode] = type(err).__name__
                continue
            out.failure = f"{mode}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            return out
        # differences of differences (an approximate kernel's Hessian) lose half the digits
        tol = TOLERANCES[dtype] ** (0.5 if mode == "hessian" and approximates(kb, 2) else 1.0)
        diff, why = _difference(got, want, dtype, tol)
        out.max_abs_diff = max(out.max_abs_diff, diff)
        if why is not None:
            out.failure = f"{why} ({mode})"
            return out
        out.passed.append(mode)
    return out

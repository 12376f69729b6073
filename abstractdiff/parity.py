"""Training parity: the same model, data and rule give the same parameters everywhere.

One backend-neutral MLP (written with ``autoray``, so it runs on every library's arrays
and on variables), fixed data and one optimiser rule are trained for many steps with
:func:`abstractdiff.train` on every available backend, in explicit mode and in
implicit mode (``ad.Implicit(b)`` with ``ad.variables``), in float64 and float32, on
every device the backend reports.  The reference is the same training in numpy with a
hand-written gradient (backpropagation written out), so it depends on no AD library.

    >>> from abstractdiff.parity import training_parity
    >>> summary = training_parity(["autograd"], steps=5)    # doctest: +SKIP
    >>> print(summary.format())                             # doctest: +SKIP

Dense layers are written as a broadcast product and a sum rather than a matmul, so that
GPU float32 results are not computed in TF32 (the default of jax and TensorFlow on
recent NVIDIA GPUs), which would differ from the CPU far beyond float32 rounding.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import optim
from .core import approximates, backend, installed_backends, to_numpy

__all__ = ["ParityResult", "ParitySummary", "RTOL", "mlp_init", "mlp_loss", "training_parity"]

#: Relative tolerance of the final parameters, per dtype (atol = rtol * max|reference|).
RTOL = {"float64": 1e-10, "float32": 1e-4}
SIZES = (5, 8, 3)
#: Why a kind of backend is left out of the comparison, shown in the summary.
SKIP_APPROXIMATE = (
    "approximates gradients (about 1e-10 relative in float64), so it cannot match exact AD to rtol 1e-10 "
    "after many steps; it is the gradient oracle of the conformance suite instead"
)
SKIP_IMPLICIT = "runs as the implicit mode of every other backend"


def skip_reason(name: str) -> str | None:
    """Why backend ``name`` is left out of the parity runs (its traits say), or ``None``."""
    if name == "implicit":
        return SKIP_IMPLICIT
    b = backend(name)
    if b.implicit:
        return SKIP_IMPLICIT
    return SKIP_APPROXIMATE if approximates(b) else None


def default_rule() -> optim.Rule:
    """The rule of the parity run: clipping then Adam, which exercise every kind of state."""
    return optim.chain(optim.ClipNorm(1.0), optim.Adam(lr=0.01))


def mlp_init(dtype: str = "float64", sizes: tuple[int, ...] = SIZES, seed: int = 0) -> dict[str, np.ndarray]:
    """Parameters of a tanh MLP as numpy arrays: ``{"w0", "b0", "w1", "b1", ...}``."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = (rng.normal(size=(n_in, n_out)) / math.sqrt(n_in)).astype(dtype)
        params[f"b{i}"] = (0.1 * rng.normal(size=n_out)).astype(dtype)
    return params


def mlp_data(dtype: str = "float64", n: int = 40, batch: int = 8, seed: int = 1) -> list[tuple[np.ndarray, ...]]:
    """A fixed regression problem split into batches ``(x, y)``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, SIZES[0]))
    y = np.stack([np.sin(x[:, 0] + x[:, 1]), x[:, 2] * x[:, 3], np.cos(x[:, 4])], axis=1)
    x, y = x.astype(dtype), y.astype(dtype)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def _dense(ar: Any, x: Any, w: Any, b: Any) -> Any:
    return ar.do("sum", x[:, :, None] * w[None, :, :], axis=1) + b


def mlp_loss(model: Any, x: Any, y: Any) -> Any:
    """Mean squared error of the MLP; ``model`` holds arrays or variables (any backend)."""
    import autoray as ar

    from .core import current_values

    p = current_values(model)
    n = len([k for k in p if k.startswith("w")])
    h = x
    for i in range(n):
        h = _dense(ar, h, p[f"w{i}"], p[f"b{i}"])
        if i < n - 1:
            h = ar.do("tanh", h)
    r = h - y
    return ar.do("mean", r * r)


def _numpy_gradient(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Backpropagation of :func:`mlp_loss` written out in numpy: the reference gradient."""
    n = len([k for k in p if k.startswith("w")])
    hs = [x]
    for i in range(n):
        z = np.sum(hs[-1][:, :, None] * p[f"w{i}"][None], axis=1) + p[f"b{i}"]
        hs.append(np.tanh(z) if i < n - 1 else z)
    d = 2 * (hs[-1] - y) / y.size
    g = {}
    for i in reversed(range(n)):
        g[f"w{i}"] = np.sum(hs[i][:, :, None] * d[:, None, :], axis=0)
        g[f"b{i}"] = np.sum(d, axis=0)
        if i > 0:
            d = np.sum(d[:, None, :] * p[f"w{i}"][None], axis=2) * (1 - hs[i] ** 2)
    return g


def reference(rule: optim.Rule, dtype: str, epochs: int) -> dict[str, np.ndarray]:
    """The parameters after ``epochs`` passes of numpy training with the reference gradient."""
    model = mlp_init(dtype)
    state = optim.setup(rule, model)
    for _ in range(epochs):
        for x, y in mlp_data(dtype):
            state, model = optim.update(state, model, _numpy_gradient(model, x, y))
    return model


@dataclass
class ParityResult:
    """One run: backend, mode ("explicit"/"implicit"), device, dtype and the outcome."""

    backend: str
    mode: str
    device: str
    dtype: str
    status: str  # "pass", "fail", "skip" or "error"
    max_rel_diff: float | None = None
    rtol: float | None = None
    reason: str = ""
    seconds: float = 0.0


@dataclass
class ParitySummary:
    """Every :class:`ParityResult` of one :func:`training_parity` call."""

    results: list[ParityResult] = field(default_factory=list)
    steps: int = 0
    rule: str = ""

    @property
    def ok(self) -> bool:
        """No run failed or raised (skips are fine)."""
        return all(r.status in ("pass", "skip") for r in self.results)

    def format(self) -> str:
        """A printable table, one line per run."""
        lines = [f"training parity: {self.steps} steps of {self.rule} on a tanh MLP {SIZES}, vs a numpy reference"]
        for r in self.results:
            where = f"{r.backend:<18} {r.mode:<9} {r.device:<7} {r.dtype:<8}"
            if r.status == "skip":
                lines.append(f"  {where} skip   {r.reason}")
            elif r.status == "error":
                lines.append(f"  {where} ERROR  {r.reason}")
            else:
                verdict = "ok  " if r.status == "pass" else "FAIL"
                lines.append(f"  {where} {verdict}   max rel diff {r.max_rel_diff:.1e} (rtol {r.rtol:.0e})")
        lines.append("  all runs agree" if self.ok else "  SOME RUNS DISAGREE")
        return "\n".join(lines)

    __str__ = format


def max_relative_difference(got: dict[str, Any], want: dict[str, np.ndarray]) -> float:
    """Max over leaves of ``max|got - want| / max|want|`` (an atol scaled to each leaf)."""
    worst = 0.0
    for k, w in want.items():
        g = np.asarray(to_numpy(got[k]), dtype=np.float64)
        w = np.asarray(w, dtype=np.float64)
        worst = max(worst, float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-300))
    return worst


def run_one(name: str, mode: str, device: str, dtype: str, rule: optim.Rule, epochs: int) -> dict[str, Any]:
    """Train the MLP on one backend/mode/device/dtype; the final parameters as numpy arrays."""
    from ._train import train

    model: Any = mlp_init(dtype)
    if mode == "implicit":
        from .core import Implicit, variables

        b: Any = Implicit(name, device=device) if device != "cpu" else Implicit(name)
        model = variables(model, b)
    else:
        b = backend(name, device=device) if device != "cpu" else backend(name)
    state = optim.setup(rule, model)
    state, model = train(mlp_loss, model, mlp_data(dtype), state, backend=b, epochs=epochs, progress=False)
    return to_numpy(model)


def training_parity(
    backends: list[str] | None = None,
    *,
    steps: int = 50,
    dtypes: tuple[str, ...] = ("float64", "float32"),
    modes: tuple[str, ...] = ("explicit", "implicit"),
    devices: bool = True,
    rule: optim.Rule | None = None,
) -> ParitySummary:
    """Run the parity check and return its :class:`ParitySummary` (``print(summary)`` shows it).

    ``backends`` defaults to every available one; ``steps`` is rounded up to whole
    epochs of the 5-batch data set; ``devices=True`` adds a run on every non-CPU
    device a backend reports (GPU versus CPU), and one "skip" line saying so where there
    is none.  Errors are caught and reported per run, never raised.
    """
    rule = rule or default_rule()
    n_batches = len(mlp_data())
    epochs = max(1, math.ceil(steps / n_batches))
    summary = ParitySummary(steps=epochs * n_batches, rule=repr(rule))
    refs = {dtype: reference(rule, dtype, epochs) for dtype in dtypes}
    names = installed_backends() if backends is None else list(backends)
    any_accelerator = False
    for name in names:
        try:
            why = skip_reason(name)
            if why is not None:
                summary.results.append(ParityResult(name, "-", "-", "-", "skip", reason=why))
                continue
            device_names = backend(name).devices()
        except Exception as err:  # unavailable library, broken install: report, do not raise
            summary.results.append(ParityResult(name, "-", "-", "-", "skip", reason=f"{type(err).__name__}: {err}"))
            continue
        if not devices:
            device_names = ["cpu"]
        any_accelerator |= len(device_names) > 1
        for device in device_names:
            for mode in modes:
                for dtype in dtypes:
                    start = time.perf_counter()
                    try:
                        got = run_one(name, mode, device, dtype, rule, epochs)
                    except Exception as err:
                        summary.results.append(
                            ParityResult(name, mode, device, dtype, "error", reason=f"{type(err).__name__}: {err}",
                                         seconds=time.perf_counter() - start)
                        )
                        continue
                    diff = max_relative_difference(got, refs[dtype])
                    rtol = RTOL[dtype]
                    summary.results.append(
                        ParityResult(name, mode, device, dtype, "pass" if diff <= rtol else "fail", diff, rtol,
                                     seconds=time.perf_counter() - start)
                    )
    if devices and not any_accelerator:
        summary.results.append(
            ParityResult(
                "(all)", "-", "gpu", "-", "skip", reason="no GPU visible to any backend: GPU versus CPU not run"
            )
        )
    return summary


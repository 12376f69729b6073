"""Run scenarios on backends and report: ``check_backend``, ``compare_backends``.

Each (scenario, operator) is called with the backend's native arrays (what users pass),
and once more with numpy inputs; every result is checked for its values (against the
analytic reference), dtype, array type, ``None`` exactly at non-float leaves and zeros
at unconnected ones, and the inputs (and tangents) are compared with a copy taken
before the call.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..core import Backend, InvalidArgumentError, approximates, is_array, is_float_dtype, pytree, to_numpy
from ._scenarios import COMBINED, OPERATORS, SECOND_ORDER, Scenario, default_scenarios, switching_scenarios

__all__ = [
    "Failure",
    "Report",
    "Result",
    "assert_backend",
    "backend_label",
    "check_backend",
    "compare_backends",
    "compare_reports",
    "default_rtol",
]

#: A pseudo-operator: the first first-order operator called again with numpy inputs.
NUMPY_INPUTS = "numpy_inputs"
#: A pseudo-operator: every operator of a scenario through its ``prepare_*`` twin, checked
#: against the references and against the unprepared operator's results.
PREPARED = "prepared"
COLUMNS: tuple[str, ...] = (*OPERATORS, NUMPY_INPUTS, PREPARED)


def operator_rows(results: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """``{operator: {"ok", "max_error", "seconds", "count", "failed"}}`` over ``results``, in :data:`COLUMNS` order."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        row = out.setdefault(r.operator, {"ok": True, "max_error": None, "seconds": 0.0, "count": 0, "failed": 0})
        row["ok"] = row["ok"] and r.ok
        row["failed"] += not r.ok
        row["count"] += 1
        row["seconds"] += r.seconds
        if r.max_error is not None:
            row["max_error"] = r.max_error if row["max_error"] is None else max(row["max_error"], r.max_error)
    return {op: out[op] for op in COLUMNS if op in out} | {op: v for op, v in out.items() if op not in COLUMNS}
#: How close a prepared result must be to the unprepared one (relative to max|reference|):
#: they share one code path, so they differ at most by rounding of a recompiled function.
PREPARED_RTOL = {"float64": 1e-12, "float32": 1e-6}

# (first order, second order) rtol per dtype.  Exact AD only loses rounding; the
# finite-differences oracle carries truncation and cancellation error on top (~1e-10
# relative in float64, ~1e-5 in float32, worse for nested second-order differences).
_EXACT_RTOL = {"float64": (1e-9, 1e-8), "float32": (1e-4, 2e-4)}
_APPROX_RTOL = {"float64": (1e-8, 1e-5), "float32": (2e-3, 1e-1)}
# Two backends' results are compared with the sum of their tolerances.


def is_approximate(b: Backend) -> bool:
    """Whether ``b`` approximates derivatives (finite differences) rather than computing them.

    ``is_approximate(b) -> bool``, at any derivative order; an implicit backend answers for its
    inner one, and a third-party backend sets the class attribute ``approximate = True`` (or one
    bool per order, ``(False, True)``: exact first derivatives, approximate second ones).

    Example:
        >>> import abstractdiff as ad
        >>> from abstractdiff import testing
        >>> fd = ad.backend("finite_differences")
        >>> testing.is_approximate(fd), testing.is_approximate(ad.Implicit(fd))
        (True, True)
    """
    return approximates(b)


def default_rtol(b: Backend, dtype: str, operator: str) -> float:
    """The tolerance ``check_backend`` uses for ``operator`` on ``b`` in ``dtype``.

    ``default_rtol(b, dtype, operator) -> float``: exact AD gets 1e-9 (float64) and 1e-4
    (float32) for first order; approximate backends and second order are looser.

    Example:
        >>> import abstractdiff as ad
        >>> from abstractdiff import testing
        >>> fd = ad.backend("finite_differences")
        >>> testing.default_rtol(fd, "float64", "gradient"), testing.default_rtol(fd, "float64", "hessian")
        (1e-08, 1e-05)
    """
    order = 2 if operator in SECOND_ORDER else 1
    table = _APPROX_RTOL if approximates(b, order) else _EXACT_RTOL  # approximate may differ per order
    first, second = table.get(dtype, table["float32"])
    return second if order == 2 else first


def is_implicit(b: Backend) -> bool:
    return bool(b.implicit)


def backend_label(b: Backend) -> str:
    """The name reports use: ``backend_label(b) -> str``, ``"torch"``, or ``"implicit(torch)"``.

    Example:
        >>> import abstractdiff as ad
        >>> from abstractdiff import testing
        >>> testing.backend_label(ad.Implicit("finite_differences"))
        'implicit(finite_differences)'
    """
    if is_implicit(b):
        return f"implicit({getattr(b, 'inner_name', None) or b.inner.name})"
    return b.name


# ------------------------------------------------------------------ records
@dataclass
class Failure:
    """One thing that went wrong: where (backend, device, scenario, operator, dtype) and what."""

    backend: str
    device: str
    scenario: str
    operator: str
    dtype: str
    message: str

    def __str__(self) -> str:
        return f"{self.backend} [{self.device}] {self.scenario} {self.operator} ({self.dtype}): {self.message}"


@dataclass
class Result:
    """The outcome of one (scenario, operator) on one backend."""

    backend: str
    device: str
    scenario: str  # the scenario id, name[dtype]
    name: str  # the scenario's base name
    dtype: str
    operator: str
    ok: bool
    max_error: float | None  # max relative error over the checked outputs (None: nothing compared)
    rtol: float
    seconds: float
    problems: list[str] = field(default_factory=list)

    def failures(self) -> list[Failure]:
        return [Failure(self.backend, self.device, self.scenario, self.operator, self.dtype, p) for p in self.problems]

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "device": self.device, "scenario": self.scenario, "name": self.name,
            "dtype": self.dtype, "operator": self.operator, "ok": self.ok, "max_error": self.max_error,
            "rtol": self.rtol, "seconds": self.seconds, "problems": list(self.problems),
        }


def verdict(ok: bool, max_error: float | None) -> str:
    """A table cell: ``ok 1.2e-16`` or ``FAIL 3.0e-01`` (``-`` for no error measured)."""
    return f"{'ok' if ok else 'FAIL'} {'-' if max_error is None else f'{max_error:.1e}'}"


def text_table(corner: str, columns: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]],
               min_width: int = 12) -> str:
    """The one plain-text table of the conformance reports and the CLI: a header of
    ``columns`` after ``corner``, a rule, then one line per ``(label, cells)``."""
    width = max([len(corner)] + [len(label) for label, _ in rows])
    widths = [max(min_width, len(c)) for c in columns]
    head = corner.ljust(width) + "  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    lines = [head.rstrip(), "-" * len(head.rstrip())]
    for label, cells in rows:
        lines.append((label.ljust(width) + "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths))).rstrip())
    return "\n".join(lines)


class Report:
    """Results of :func:`check_backend` or :func:`compare_backends`.

    ``report.ok`` is true when every result passed; ``report.failures`` lists
    :class:`Failure` records; ``print(report)`` shows a scenario x operator table.
    """

    def __init__(self, backend: str, device: str, results: Sequence[Result] | None = None, title: str | None = None):
        self.backend = backend
        self.device = device
        self.title = title or f"abstractdiff conformance: {backend} on {device}"
        self.results: list[Result] = list(results or [])
        # (scenario id, operator, part) -> numpy result, for cross-backend comparisons
        self.outputs: dict[tuple[str, str, str], Any] = {}
        self.errors: dict[tuple[str, str], str] = {}
        #: (scenario id, reason) of scenarios not run: the library lacks a function they need
        self.not_run: list[tuple[str, str]] = []

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[Failure]:
        return [f for r in self.results if not r.ok for f in r.failures()]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.results)

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.results)

    def by_operator(self) -> dict[str, dict[str, Any]]:
        """``{operator: {"ok", "max_error", "seconds", "count", "failed"}}`` over all scenarios."""
        return operator_rows(self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "device": self.device, "ok": self.ok, "seconds": self.seconds,
            "results": [r.to_dict() for r in self.results], "failures": [str(f) for f in self.failures],
            "not_run": [list(entry) for entry in self.not_run],
        }

    def table(self) -> str:
        """Scenario x operator: ``ok``/``FAIL`` and the max relative error per cell."""
        ops = [op for op in COLUMNS if any(r.operator == op for r in self.results)]
        ops += sorted({r.operator for r in self.results} - set(ops))
        rows: dict[str, dict[str, Result]] = {}
        for r in self.results:
            rows.setdefault(r.scenario, {})[r.operator] = r
        cell = lambda r: "" if r is None else verdict(r.ok, r.max_error)  # noqa: E731
        return text_table("scenario", ops, [(scen, [cell(got.get(op)) for op in ops]) for scen, got in rows.items()])

    def __str__(self) -> str:
        n_fail = sum(not r.ok for r in self.results)
        status = "all passed" if n_fail == 0 else f"{n_fail} of {len(self.results)} failed"
        out = [f"{self.title}: {status} ({self.seconds:.2f} s)", self.table()]
        if self.not_run:
            out.append("not run:")
            out.extend(f"  {scenario}: {reason}" for scenario, reason in self.not_run)
        failures = self.failures
        if failures:
            out.append("failures:")
            out.extend(f"  {f}" for f in failures)
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"<Report {self.backend} on {self.device}: {len(self.results)} results, ok={self.ok}>"


# ----------------------------------------------------------------- comparing
def _path_str(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path) or "result"


def _dtype_name(a: Any) -> str:
    import autoray

    return autoray.get_dtype_name(a)


def _compare(
    out: Any, ref: Any, *, rtol: float, atol: float | None, dtype: str | None, b: Backend | None, what: str
) -> tuple[float | None, list[str]]:
    """Max relative error of ``out`` against ``ref`` (numpy, None at non-float leaves) and problems found."""
    problems: list[str] = []
    paths, ref_leaves, treedef = pytree.tree_flatten_with_path(ref, none_is_leaf=True)
    try:
        out_leaves = treedef.flatten_up_to(out)
    except (ValueError, TypeError):
        got = pytree.tree_structure(out, none_is_leaf=True)
        return None, [f"{what} has structure {got}, expected {treedef}"]
    arrays = [np.asarray(r, np.float64) for r in ref_leaves if r is not None]
    scale = max((float(np.max(np.abs(r), initial=0.0)) for r in arrays), default=0.0)
    tol_abs = atol if atol is not None else rtol * scale
    worst: float | None = None
    for path, o, r in zip(paths, out_leaves, ref_leaves):
        where = what if not path else f"{what}{_path_str(path)}"
        if r is None:
            if o is not None:
                problems.append(f"{where}: expected None (x's leaf there is not a float array), got {type(o).__name__}")
            continue
        if o is None:
            problems.append(f"{where}: got None for a float leaf; a float leaf f does not use must get zeros")
            continue
        if not is_array(o):
            problems.append(f"{where}: expected an array, got {type(o).__name__}")
            continue
        if b is not None and not b.is_native(o):
            problems.append(f"{where}: got a {type(o).__module__}.{type(o).__name__}, not a native {b.name} array")
        if dtype is not None and _dtype_name(o) != dtype:
            problems.append(f"{where}: dtype {_dtype_name(o)}, expected {dtype} (the input's dtype)")
        o_np = np.asarray(to_numpy(o), dtype=np.float64)
        r_np = np.asarray(r, dtype=np.float64)
        if o_np.shape != r_np.shape:
            problems.append(f"{where}: shape {o_np.shape}, expected {r_np.shape}")
            continue
        diff = np.abs(o_np - r_np)
        err = float(np.max(diff, initial=0.0)) / scale if scale > 0 else float(np.max(diff, initial=0.0))
        if not np.all(np.isfinite(o_np)):
            err = float("inf")
        worst = err if worst is None else max(worst, err)
        bad = ~(diff <= tol_abs + rtol * np.abs(r_np))  # NaN counts as bad
        if np.any(bad):
            i = np.unravel_index(int(np.argmax(np.where(bad, diff, -1.0))), diff.shape) if diff.ndim else ()
            at = f" at {tuple(int(k) for k in i)}" if i else ""
            problems.append(
                f"{where}: max relative error {err:.2e} exceeds rtol {rtol:.0e}; worst element{at}: "
                f"got {o_np[i].item()!r}, expected {r_np[i].item()!r}"
            )
    return worst, problems


# ------------------------------------------------------------------- running
def _native(b: Backend, tree: Any) -> Any:
    return pytree.tree_map(lambda a: b.convert(a) if is_array(a) else a, tree, none_is_leaf=True)


def _snapshot(tree: Any) -> Any:
    return copy.deepcopy(to_numpy(tree))


def _unchanged(before: Any, after_tree: Any) -> list[str]:
    after = to_numpy(after_tree)
    try:
        paths, old, treedef = pytree.tree_flatten_with_path(before, none_is_leaf=True)
        new = treedef.flatten_up_to(after)
    except (ValueError, TypeError):
        return ["the input tree's structure was changed in place"]
    problems = []
    for path, a, c in zip(paths, old, new):
        if isinstance(a, np.ndarray):
            c = np.asarray(c)
            if a.dtype != c.dtype or a.shape != c.shape or not np.array_equal(a, c, equal_nan=True):
                problems.append(f"input {_path_str(path)} was modified in place (inputs must be left unchanged)")
        elif a is not c and a != c:
            problems.append(f"input {_path_str(path)} was replaced in place")
    return problems


def _call(b: Backend, s: Scenario, op: str, x: Any, args: tuple, tangent: Any, cotangent: Any) -> dict[str, Any]:
    import abstractdiff as ops

    f = s.f
    if op == "gradient":
        return {"gradient": ops.gradient(b, f, x, *args)}
    if op == "value_and_gradient":
        y, g = ops.value_and_gradient(b, f, x, *args)
        return {"value": y, "gradient": g}
    if op == "pullback":
        y, vjp = ops.value_and_pullback(b, f, x, *args)
        return {"value": y, "pullback": vjp(cotangent)}
    if op == "pushforward":
        y, jvp = ops.value_and_pushforward(b, f, x, *args)
        return {"value": y, "pushforward": jvp(tangent)}
    if op == "derivative":
        return {"derivative": ops.derivative(b, f, x, *args)}
    if op == "jacobian":
        return {"jacobian": ops.jacobian(b, f, x, *args)}
    if op == "hessian":
        return {"hessian": ops.hessian(b, f, x, *args)}
    if op == "hvp":
        return {"hvp": ops.hvp(b, f, x, tangent, *args)}
    if op == "gradient_and_hvp":
        return _parts(op, ops.gradient_and_hvp(b, f, x, tangent, *args))
    if op in COMBINED or op == "second_derivative":
        return _parts(op, getattr(ops, op)(b, f, x, *args))
    raise InvalidArgumentError(f"unknown operator {op!r}; known: {OPERATORS}")


def _parts(op: str, out: Any) -> dict[str, Any]:
    """A combined operator's result by part, ``{"value": y, "gradient": g, ...}``."""
    if op not in COMBINED:
        return {op: out}
    names = COMBINED[op]
    if not (isinstance(out, tuple) and len(out) == len(names)):
        raise InvalidArgumentError(f"{op} returned {type(out).__name__}, not a tuple ({', '.join(names)})")
    return dict(zip(names, out))


def _call_prepared(
    b: Backend, s: Scenario, op: str, x: Any, args: tuple, tangent: Any, cotangent: Any
) -> dict[str, Any]:
    """``op`` through its ``prepare_*`` twin(s), prepared on ``(x, args)`` and called on them."""
    import abstractdiff as prep

    f = s.f
    if op == "gradient":
        return {"gradient": prep.prepare_gradient(b, f, x, *args)(x, *args)}
    if op == "value_and_gradient":
        y, g = prep.prepare_value_and_gradient(b, f, x, *args)(x, *args)
        return {"value": y, "gradient": g}
    if op == "pullback":
        y, vjp = prep.prepare_value_and_pullback(b, f, x, *args)(x, *args)
        vjp_only = b.prepare("pullback", f, x, args)(x, *args)
        return {"value": y, "pullback": vjp(cotangent), "pullback (vjp only)": vjp_only(cotangent)}
    if op == "pushforward":
        y, jvp = prep.prepare_value_and_pushforward(b, f, x, *args)(x, *args)
        jvp_only = prep.prepare_pushforward(b, f, x, *args)(x, *args)
        return {"value": y, "pushforward": jvp(tangent), "pushforward (jvp only)": jvp_only(tangent)}
    if op == "derivative":
        return {"derivative": prep.prepare_derivative(b, f, x, *args)(x, *args)}
    if op == "jacobian":
        return {"jacobian": prep.prepare_jacobian(b, f, x, *args)(x, *args)}
    if op == "hessian":
        return {"hessian": prep.prepare_hessian(b, f, x, *args)(x, *args)}
    if op == "hvp":
        return {"hvp": prep.prepare_hvp(b, f, x, tangent, *args)(x, tangent, *args)}
    if op == "gradient_and_hvp":
        return _parts(op, prep.prepare_gradient_and_hvp(b, f, x, tangent, *args)(x, tangent, *args))
    if op in COMBINED or op == "second_derivative":
        return _parts(op, getattr(prep, f"prepare_{op}")(b, f, x, *args)(x, *args))
    raise InvalidArgumentError(f"unknown operator {op!r}; known: {OPERATORS}")


def _error_text(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    return f"raised {type(err).__name__}: {first[:300]}"


def _run_one(
    b: Backend, s: Scenario, op: str, *, numpy_inputs: bool, rtol: float | None, atol: float | None,
    label: str, report: Report, record_as: str | None = None, prepared: bool = False,
) -> Result:
    tol = rtol if rtol is not None else default_rtol(b, s.dtype, op)
    name = record_as or op
    problems: list[str] = []
    worst: float | None = None
    # A copy, so that a backend that mutates its inputs cannot corrupt the (shared) scenario.
    inputs = copy.deepcopy((s.x, s.args, s.tangent, s.cotangent))
    if not numpy_inputs:
        inputs = tuple(_native(b, part) for part in inputs)
    before = _snapshot(inputs)
    start = time.perf_counter()
    try:
        parts = (_call_prepared if prepared else _call)(b, s, op, *inputs)
    except Exception as err:  # a conformance harness reports, it does not stop
        seconds = time.perf_counter() - start
        report.errors[(s.id, name)] = _error_text(err)
        problems.append(_error_text(err))
        parts = {}
    else:
        seconds = time.perf_counter() - start
    for part, out in parts.items():
        base = part.split(" (")[0]  # "pullback (vjp only)" is checked against pullback's reference
        ref = s.reference(base)
        if base in ("gradient", "pullback", "jacobian", "hvp"):
            ref = s._map_floats(lambda r: r, ref)  # None exactly at the non-float leaves of x
        what = f"{op}: {part}" if prepared else part
        err, found = _compare(out, ref, rtol=tol, atol=atol, dtype=s.dtype, b=b, what=what)
        problems.extend(found)
        if err is not None:
            worst = err if worst is None else max(worst, err)
        if prepared:
            problems.extend(_same_as_unprepared(report, s, op, base, out, ref, what))
        elif not numpy_inputs:
            try:
                report.outputs[(s.id, op, part)] = to_numpy(out)
            except Exception:  # noqa: BLE001 - an unconvertible result is already a failure above
                pass
    problems.extend(_unchanged(before, inputs))
    return Result(label, b.device, s.id, s.name, s.dtype, name, not problems, worst, tol, seconds, problems)


def _same_as_unprepared(report: Report, s: Scenario, op: str, part: str, out: Any, ref: Any, what: str) -> list[str]:
    """A prepared result must equal the unprepared one (one code path) up to rounding."""
    unprepared = report.outputs.get((s.id, op, part))
    if unprepared is None:
        return []  # the unprepared operator failed: reported there
    scale = max((float(np.max(np.abs(np.asarray(r, np.float64)), initial=0.0))
                 for r in pytree.tree_leaves(ref) if r is not None), default=0.0)
    tol = PREPARED_RTOL.get(s.dtype, 1e-6) * max(scale, 1.0)
    _, found = _compare(out, unprepared, rtol=0.0, atol=tol, dtype=None, b=None, what=what)
    return [f"{p.replace('expected', 'unprepared gave')} (prepared and unprepared must agree)" for p in found]


def _run_prepared(b: Backend, s: Scenario, ops: Sequence[str], *, rtol: float | None, atol: float | None,
                  label: str, report: Report) -> Result:
    """Every operator of ``s`` through its prepared twin: one result in the ``prepared`` column."""
    problems: list[str] = []
    worst: float | None = None
    seconds = 0.0
    tol = 0.0
    for op in ops:
        r = _run_one(b, s, op, numpy_inputs=False, rtol=rtol, atol=atol, label=label, report=report,
                     record_as=PREPARED, prepared=True)
        problems.extend(r.problems if all(p.startswith(op) for p in r.problems) else
                        [p if p.startswith(op) else f"{op}: {p}" for p in r.problems])
        seconds += r.seconds
        tol = max(tol, r.rtol)
        if r.max_error is not None:
            worst = r.max_error if worst is None else max(worst, r.max_error)
    return Result(label, b.device, s.id, s.name, s.dtype, PREPARED, not problems, worst, tol, seconds, problems)


def _implicit_run(
    b: Backend, s: Scenario, op: str, *, rtol: float | None, atol: float | None, label: str, report: Report,
    state: dict,
) -> Result:
    """``op`` through the implicit adapter: x becomes variables, f reads them."""
    import abstractdiff as ops
    import abstractdiff as prep

    from ..core import Params, current_values, variables

    tol = rtol if rtol is not None else default_rtol(b, s.dtype, op)
    problems: list[str] = []
    worst: float | None = None
    start = time.perf_counter()
    parts: dict[str, Any] = {}
    try:
        if "vs" not in state:  # one set of variables and one f per scenario, so compiled traces are reused
            vs = variables(s.x, b)
            float_vars = [v for v, a in zip(pytree.tree_leaves(vs, none_is_leaf=True),
                                            pytree.tree_leaves(s.x, none_is_leaf=True))
                          if is_array(a) and is_float_dtype(a.dtype)]
            state.update(vs=vs, float_vars=float_vars, params=Params(float_vars),
                         f=lambda *args: s.f(current_values(vs), *args))
        vs, params, f = state["vs"], state["params"], state["f"]
        before = _snapshot(vs)
        args = _native(b, s.args)
        if op == "gradient":
            parts["gradient"] = ops.gradient(b, f, params, *args)
            parts["prepared gradient"] = prep.prepare_gradient(b, f, params, *args)(params, *args)
        elif op == "value_and_gradient":
            parts["value"], parts["gradient"] = ops.value_and_gradient(b, f, params, *args)
            prepared = prep.prepare_value_and_gradient(b, f, params, *args)
            parts["prepared value"], parts["prepared gradient"] = prepared(params, *args)
        elif op == "pullback":
            parts["value"], vjp = ops.value_and_pullback(b, f, params, *args)
            parts["pullback"] = vjp(_native(b, s.cotangent))
            parts["prepared value"], vjp = prep.prepare_value_and_pullback(b, f, params, *args)(params, *args)
            parts["prepared pullback"] = vjp(_native(b, s.cotangent))
        else:
            raise InvalidArgumentError(f"operator {op!r} has no implicit form")
        problems.extend(p.replace("input", "variable") for p in _unchanged(before, vs))
    except Exception as err:  # reported, not raised
        report.errors[(s.id, op)] = _error_text(err)
        problems.append(_error_text(err))
    seconds = time.perf_counter() - start
    for part, out in parts.items():
        base = part.removeprefix("prepared ")  # a prepared twin is checked against the same reference
        ref = s.reference(base)
        if base in ("gradient", "pullback"):
            try:
                out = _grads_as_tree(s, state["vs"], state["float_vars"], out)
            except Exception as err:  # noqa: BLE001
                problems.append(f"{part}: cannot read the Grads back by variable ({_error_text(err)})")
                continue
            ref = s._map_floats(lambda r: r, ref)
        err, found = _compare(out, ref, rtol=tol, atol=atol, dtype=s.dtype, b=b, what=part)
        problems.extend(found)
        if err is not None:
            worst = err if worst is None else max(worst, err)
        try:
            report.outputs[(s.id, op, part)] = to_numpy(out)
        except Exception:  # noqa: BLE001
            pass
    return Result(label, b.device, s.id, s.name, s.dtype, op, not problems, worst, tol, seconds, problems)


def _grads_as_tree(s: Scenario, vs: Any, float_vars: list, grads: Any) -> Any:
    if len(grads) != len(float_vars):
        raise InvalidArgumentError(f"Grads has {len(grads)} entries for {len(float_vars)} parameters")
    lookup = {id(v): grads[v] for v in float_vars}
    leaves, treedef = pytree.tree_flatten(vs, none_is_leaf=True)
    xs = pytree.tree_leaves(s.x, none_is_leaf=True)
    return pytree.tree_unflatten(
        treedef, [lookup[id(v)] if is_array(a) and is_float_dtype(a.dtype) else None for v, a in zip(leaves, xs)]
    )


IMPLICIT_OPERATORS = ("gradient", "value_and_gradient", "pullback")


def missing_functions(b: Backend, names: Sequence[str]) -> list[str]:
    """Which of the portable functions ``names`` autoray finds no implementation of for
    ``b``'s arrays (a third-party adapter's library without linear algebra)."""
    if not names:
        return []
    import autoray

    inner = getattr(b, "inner", b)  # ad.Implicit: the arrays are its inner backend's
    try:
        library = autoray.infer_backend(inner.asarray(np.zeros(2)))
    except Exception:  # noqa: BLE001  no array to ask about: run, and let the scenario say what fails
        return []
    out = []
    for name in names:
        try:
            autoray.get_lib_fn(library, name)
        except (ImportError, AttributeError):
            out.append(name)
    return out


def check_backend(
    b: Backend | str,
    scenarios: Iterable[Scenario] | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    operators: Sequence[str] | None = None,
    progress: Callable[[Scenario], None] | None = None,
    switching: bool | None = None,
) -> Report:
    """Run every applicable operator of every scenario on ``b`` and check the results.

    ``check_backend(b, scenarios=None, *, rtol=None, atol=None) -> Report``.  Scenarios
    default to :func:`default_scenarios` (float64 and float32).  ``rtol`` defaults per
    dtype and operator order (:func:`default_rtol`), ``atol`` to ``rtol * max|reference|``.
    Checked: values, dtype preserved, native array type, ``None`` exactly at non-float
    leaves and zeros at unconnected float leaves, inputs left unchanged; each result
    records the max relative error and the time taken.  An implicit backend
    (``ad.Implicit(b)``) runs the scenarios with ``x`` turned into variables and
    checks gradient, value_and_gradient and pullback.  Exceptions are recorded as
    failures, never raised.  ``operators`` restricts the operators run; ``progress``
    is called after each scenario.  ``switching`` adds the switching family
    (:func:`switching_scenarios`: one function object called at float64, float32,
    float64 and a new shape in turn, every operator and prepared operator at each step,
    which catches caches keyed on the function alone); by default it runs when
    ``scenarios`` is not given, on explicit backends.

    Example:
        >>> from abstractdiff import testing
        >>> report = testing.check_backend("finite_differences", testing.default_scenarios("float64", ["sum_squares"]))
        >>> report.ok, report.failures
        (True, [])
    """
    from ..core import backend as get_backend

    b = get_backend(b)
    scenarios_given = scenarios is not None
    scenarios = default_scenarios() if scenarios is None else list(scenarios)
    label = backend_label(b)
    report = Report(label, b.device)
    implicit = is_implicit(b)
    for s in scenarios:
        missing = missing_functions(b, s.requires)
        if missing:
            report.not_run.append((s.id, f"{label}'s library has no {', '.join(missing)} (autoray finds none)"))
            continue
        ops = [op for op in s.operators if operators is None or op in operators]
        if implicit:
            state: dict = {}
            scalar = s.is_scalar_output
            for op in ops:
                if op in IMPLICIT_OPERATORS and (scalar or op == "pullback"):
                    report.results.append(_implicit_run(b, s, op, rtol=rtol, atol=atol, label=label, report=report,
                                                        state=state))
        else:
            for op in ops:
                report.results.append(
                    _run_one(b, s, op, numpy_inputs=False, rtol=rtol, atol=atol, label=label, report=report)
                )
            if ops:
                report.results.append(_run_prepared(b, s, ops, rtol=rtol, atol=atol, label=label, report=report))
            first = next((op for op in ("gradient", "jacobian", "derivative") if op in ops), None)
            if first is not None:
                report.results.append(_run_one(b, s, first, numpy_inputs=True, rtol=rtol, atol=atol, label=label,
                                               report=report, record_as=NUMPY_INPUTS))
        if progress is not None:
            progress(s)
    if (scenarios_given is False if switching is None else switching) and not implicit:
        for family in switching_scenarios():
            for step in family.steps:  # in order: the point is what one step leaves to the next
                ops = [op for op in step.operators if operators is None or op in operators]
                for op in ops:
                    report.results.append(
                        _run_one(b, step, op, numpy_inputs=False, rtol=rtol, atol=atol, label=label, report=report)
                    )
                if ops:
                    report.results.append(_run_prepared(b, step, ops, rtol=rtol, atol=atol, label=label, report=report))
    return report


def assert_backend(b: Backend | str, scenarios: Iterable[Scenario] | None = None, **options: Any) -> Report:
    """:func:`check_backend`, raising ``AssertionError`` with the report when anything failed.

    ``assert_backend(b, scenarios=None, **options) -> Report`` (the passing report).
    For an adapter's own test file::

        def test_conformance():
            testing.assert_backend(MyBackend())

    Example:
        >>> from abstractdiff import testing
        >>> scen = testing.default_scenarios("float64", ["matmul_least_squares"])
        >>> testing.assert_backend("finite_differences", scen).ok
        True
    """
    report = check_backend(b, scenarios, **options)
    if not report.ok:
        raise AssertionError(f"{len(report.failures)} conformance failure(s)\n{report}")
    return report


# ---------------------------------------------------------------- comparisons
def compare_reports(
    reports: Sequence[Report],
    *,
    rtol: float | dict[str, float] | None = None,
    title: str | None = None,
) -> Report:
    """Pairwise agreement of the outputs stored in ``reports`` (from :func:`check_backend`).

    ``compare_reports(reports, *, rtol=None, title=None) -> Report``.  ``rtol`` is one
    tolerance or one per dtype; by default each pair uses the sum of the tolerances its
    two backends were checked with.  Nothing is run again: use it to compare reports
    computed earlier (the same backend on two devices, say).

    Example:
        >>> from abstractdiff import testing
        >>> from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend
        >>> scen = testing.default_scenarios("float64", ["sum_squares"])
        >>> backends = [FiniteDifferencesBackend(), FiniteDifferencesBackend(step=1e-4)]
        >>> testing.compare_reports([testing.check_backend(b, scen) for b in backends]).ok
        True
    """
    own = [{(r.scenario, r.operator): r.rtol for r in rep.results} for rep in reports]
    labels = [f"{r.backend}@{r.device}" if len({x.device for x in reports}) > 1 else r.backend for r in reports]
    device = ",".join(sorted({r.device for r in reports}))
    out = Report(" vs ".join(labels), device, title=title or f"abstractdiff agreement: {', '.join(labels)}")
    for i in range(len(reports)):
        for j in range(i + 1, len(reports)):
            a, c = reports[i], reports[j]
            pair = f"{labels[i]} vs {labels[j]}"
            # what both sides ran (a scenario only one of them ran is not a disagreement)
            ran_a = {(k[0], k[1]) for k in a.outputs} | set(a.errors)
            ran_c = {(k[0], k[1]) for k in c.outputs} | set(c.errors)
            keys = sorted(ran_a & ran_c)
            for scen, op in keys:
                if op == NUMPY_INPUTS:
                    continue
                dtype = scen.rsplit("[", 1)[-1].rstrip("]") if "[" in scen else "float64"
                if isinstance(rtol, dict):
                    tol = rtol.get(dtype, max(rtol.values()))
                elif rtol is not None:
                    tol = float(rtol)
                else:
                    tol = own[i].get((scen, op), 1e-9) + own[j].get((scen, op), 1e-9)
                problems: list[str] = []
                worst: float | None = None
                for side, rep in ((labels[i], a), (labels[j], c)):
                    if (scen, op) in rep.errors:
                        problems.append(f"no result from {side}: {rep.errors[(scen, op)]}")
                if not problems:
                    parts = sorted({k[2] for k in a.outputs if k[:2] == (scen, op)}
                                   & {k[2] for k in c.outputs if k[:2] == (scen, op)})
                    for part in parts:
                        ref = a.outputs[(scen, op, part)]
                        err, found = _compare(c.outputs[(scen, op, part)], ref, rtol=tol, atol=None, dtype=None,
                                              b=None, what=part)
                        problems.extend(f.replace("expected", labels[i] + " has") for f in found)
                        if err is not None:
                            worst = err if worst is None else max(worst, err)
                name = scen.rsplit("[", 1)[0]
                out.results.append(Result(pair, device, scen, name, dtype, op, not problems, worst, tol, 0.0, problems))
    return out


def compare_backends(
    backends: Sequence[Backend | str],
    scenarios: Iterable[Scenario] | None = None,
    *,
    rtol: float | dict[str, float] | None = None,
    reports: Sequence[Report] | None = None,
) -> Report:
    """Pairwise agreement of every backend with every other on the same scenarios.

    ``compare_backends([b1, b2, ...], scenarios=None, *, rtol=None) -> Report`` whose
    results are named ``"b1 vs b2"``.  Results are compared with ``ad.to_numpy``;
    the default tolerance of a pair is the sum of the two backends' own tolerances
    (so two exact backends agree to ~1e-9 in float64, and finite differences is
    allowed its truncation error).  Pass ``reports`` (from :func:`check_backend`, in
    the same order) to compare results already computed.

    Example:
        >>> from abstractdiff import testing
        >>> from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend
        >>> scen = testing.default_scenarios("float64", ["rosenbrock"])
        >>> testing.compare_backends(["finite_differences", FiniteDifferencesBackend(step=1e-4)], scen).ok
        True
    """
    from ..core import backend as get_backend

    bs = [get_backend(b) for b in backends]
    if len(bs) < 2:
        raise InvalidArgumentError(f"compare_backends needs at least two backends, got {len(bs)}")
    if reports is None:
        scenarios = default_scenarios() if scenarios is None else list(scenarios)
        reports = [check_backend(b, scenarios) for b in bs]
    elif len(reports) != len(bs):
        raise InvalidArgumentError(
            f"got {len(reports)} reports for {len(bs)} backends; pass one report per backend, in order"
        )
    return compare_reports(reports, rtol=rtol)

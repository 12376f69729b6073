"""The ``abstractdiff`` command line: ``abstractdiff check``.

``abstractdiff check`` runs the conformance suite (:mod:`abstractdiff.testing`) on every
available backend, explicit and through ``ad.Implicit``, on every device and in float64
and float32; prints a backend x operator table (pass/fail, max relative error against
the analytic results, time), the cross-backend agreement, one line per GPU-versus-CPU
comparison (or why it was skipped), and the training-parity summary
(:func:`abstractdiff.parity.training_parity`, when that module is installed), and the
composition matrix (one line per pair of exact backends: the outer's code calling the inner's
kernel through :func:`abstractdiff.differentiate_with`, run in the outer's job).  Exit
status 1 when anything fails.  Backends run in parallel worker processes (``--jobs``);
``--import MODULE`` loads a module that registers more backends (``ad.register_backend``).

The command is three steps, each testable alone: :func:`plan` decides what runs (no AD
library is imported), :func:`run` runs it and :func:`report` turns the outcome into the
text, the JSON document and the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from .core import OPERATORS, available_backends, unavailable_reason

DTYPES = ("float64", "float32")
DEVICES = {"all": ("cpu", "gpu"), "cpu": ("cpu",), "gpu": ("gpu",)}
# Short column names keep the table within ~120 characters (the operator table's).
COLUMN_NAMES = {
    **{name: op.column for name, op in OPERATORS.items() if op.graded},
    "numpy_inputs": "numpy_in",
    "prepared": "prepared",
}
PARITY_MODULE = "abstractdiff.parity"
# The stock last line of ParitySummary.format(): replaced by a line that speaks for parity only.
_PARITY_VERDICTS = ("all runs agree", "SOME RUNS DISAGREE")
# Worker processes share the machine's cores: one thread each for the numerical libraries.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


# ------------------------------------------------------------------- records
@dataclass
class Job:
    backend: str
    device: str  # "cpu" or "gpu" (the backend's first accelerator, found in the worker)
    dtype: str
    implicit: bool
    scenarios: tuple[str, ...] | None
    # the switching family (one function at several dtypes and shapes) crosses dtypes: it
    # runs once per backend and device, in the job of the first dtype, unless scenarios are chosen
    switching: bool = False
    # the inner backends of the composition matrix this job checks with its backend as the
    # outer (the first CPU job of each backend; float64 where the plan has it)
    composition: tuple[str, ...] = ()


@dataclass
class JobResult:
    job: Job
    reports: list = field(default_factory=list)  # testing.Report
    error: str | None = None  # the backend could not be created
    skipped: str | None = None  # why a GPU job did not run (no GPU)
    device: str = "cpu"  # the device it ran on
    # Labels of the reports made by approximating backends (testing.is_approximate), decided
    # where the backend exists: reports only carry labels, and "exact" must not be guessed by name.
    approximate: list[str] = field(default_factory=list)
    composition: list = field(default_factory=list)  # testing._composition.PairResult


@dataclass
class Plan:
    """What ``abstractdiff check`` will run, decided from the options alone (no AD library loaded)."""

    backends: list[str]  # named in the header: requested, or every available one
    requested: list[str]  # named with --backend: failing to load them is a failure, not a note
    dtypes: tuple[str, ...]
    device: str  # "all", "cpu" or "gpu"
    implicit: bool
    jobs: list[Job]  # in the order they start
    notes: list[str] = field(default_factory=list)  # backends left out, not failures
    problems: list[str] = field(default_factory=list)  # failures found before running anything
    parity: bool = False  # whether training parity runs
    parity_backends: list[str] = field(default_factory=list)
    parity_skip: str = ""  # the parity line when it does not run
    workers: int = 1
    ticks: int = 0  # progress units: one per scenario per target, one for parity
    imports: tuple[str, ...] = ()  # --import modules, imported again in every worker
    max_failures: int = 30
    composition: bool = True  # whether the composition matrix runs (--no-composition)


@dataclass
class Outcome:
    """What :func:`run` produced: one :class:`JobResult` per job and the training-parity result."""

    results: list[JobResult] = field(default_factory=list)
    parity: Any = None  # abstractdiff.parity.ParitySummary
    parity_error: str | None = None  # training parity raised (or its worker died)
    seconds: float = 0.0

    @property
    def approximate(self) -> set[str]:
        return {label for r in self.results for label in r.approximate}


# ------------------------------------------------------------------- worker side
_progress_queue: Any = None
_in_worker = False


def _quiet_logging() -> None:
    """Silence library warnings below ERROR in a worker process of ours.

    Libraries warn about retracing (each scenario is a new function, traced by design)
    and the like; in the user's own process (``--jobs 1``) nothing is changed.  Called
    at start-up and again once a backend exists, for loggers its library set a level on.
    """
    logging.getLogger().setLevel(logging.ERROR)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and logging.NOTSET < logger.level < logging.ERROR:
            logger.setLevel(logging.ERROR)


def _import_modules(modules: Sequence[str]) -> None:
    """Import the ``--import`` modules (their ``ad.register_backend`` calls take effect)."""
    for module in modules:
        importlib.import_module(module)


def _init_worker(queue: Any, modules: Sequence[str] = ()) -> None:
    """Pool initializer: progress queue, quiet logging, and the ``--import`` modules."""
    global _progress_queue, _in_worker
    _progress_queue, _in_worker = queue, True
    _quiet_logging()
    _import_modules(modules)


def run_job(job: Job, tick: Callable[[str], None] | None = None) -> JobResult:
    """Run the scenarios of ``job``; ``tick(label)`` after each scenario (progress)."""
    import abstractdiff as ad
    from abstractdiff import testing

    if tick is None and _progress_queue is not None:
        def tick(label: str) -> None:
            _progress_queue.put(label)

    out = JobResult(job)
    scenarios = testing.default_scenarios(job.dtype, job.scenarios)
    try:
        b = ad.backend(job.backend)
        if job.device != "cpu":
            accelerators = [d for d in b.devices() if d != "cpu"]
            if not accelerators:
                out.skipped = f"no GPU here (its devices: {', '.join(b.devices())})"
                if tick is not None:
                    for _ in range(len(scenarios) * (2 if job.implicit else 1)):
                        tick(f"{job.backend} gpu: skipped")
                return out
            b = ad.backend(job.backend, device=accelerators[0])
    except Exception as err:  # reported as a failure of this backend, not raised
        out.error = f"{type(err).__name__}: {err}"
        return out
    if _in_worker:
        _quiet_logging()  # the backend's library is loaded now, with its loggers
    out.device = b.device
    targets = [b, ad.Implicit(b)] if job.implicit else [b]
    for target in targets:
        name = testing.backend_label(target)
        if testing.is_approximate(target):
            out.approximate.append(name)
        label = f"{name} {job.device} {job.dtype}"
        out.reports.append(testing.check_backend(
            target, scenarios, progress=(lambda s, label=label: tick(label)) if tick else None,
            switching=job.switching))
    if job.composition:
        out.composition = _run_composition(b, job)
        if tick is not None:
            tick(f"{job.backend} composition")
    return out


def _run_composition(b: Any, job: Job) -> list:
    """The composition pairs with ``b`` as the outer backend (exact backends only)."""
    from abstractdiff import testing
    from abstractdiff.testing._composition import PairResult, check_pair

    if testing.is_approximate(b):
        return []
    results = []
    for inner in job.composition:
        try:
            results.append(check_pair(b, inner, job.dtype))
        except Exception as err:  # the inner backend could not load: a failed pair
            results.append(PairResult(b.name, inner, job.dtype, failure=_error_text(err)))
    return results


def _run_parity(backends: list[str], dtypes: tuple[str, ...], devices: bool) -> Any:
    from abstractdiff.parity import training_parity

    return training_parity(backends, dtypes=dtypes, devices=devices)


# ------------------------------------------------------------------- progress
class _Progress:
    """tqdm on stderr when importable, else a plain text line; silent when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total, self.done = enabled, total, 0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, unit="scenario", dynamic_ncols=True, leave=False)
            except ImportError:
                pass

    def update(self, label: str, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(label, refresh=False)
            self.bar.update(n)
        else:
            sys.stderr.write(f"\r[{self.done}/{self.total}] {label:<50}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


# ------------------------------------------------------------------- planning
def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _backend_names(requested: list[str]) -> list[str]:
    """The backends to check: those named, else every available one, less the implicit wrapper
    (it runs as every backend's implicit mode, ``--no-implicit`` to skip)."""
    import abstractdiff as ad

    wrapper = ad.Implicit.name
    return [n for n in (requested or available_backends()) if n != wrapper]


def _load_problem(name: str) -> str | None:
    """Why ``name`` cannot be created here, decided without importing its library."""
    try:
        reason = unavailable_reason(name)
    except Exception as err:  # an unknown name
        reason = f"{type(err).__name__}: {err}"
    return None if reason is None else f"{name}: cannot load: {reason}"


def _start_order(jobs: list[Job]) -> list[Job]:
    """GPU jobs first, otherwise the plan's order (stable).

    The point is to start long jobs first, but which backends are slow (compiling ones)
    is only known once their library is loaded, which planning must not do.  A GPU job
    either finishes at once (no GPU: skipped) or pays for setting up the device, so it
    goes first; the rest keep the backends' order, so that runs are reproducible.
    """
    return sorted(jobs, key=lambda j: j.device == "cpu")


def plan(args: argparse.Namespace) -> Plan:
    """Decide the backends, jobs, notes, problems and whether parity runs; imports no AD library."""
    from abstractdiff import testing

    requested = list(dict.fromkeys(args.backend or []))
    dtypes = tuple(dict.fromkeys(args.dtype or DTYPES))
    names = _backend_names(requested)
    implicit = not args.no_implicit
    scenarios = tuple(args.scenario) if args.scenario else None
    notes: list[str] = []
    problems: list[str] = []  # failures outside the reports (a requested backend missing...)
    runnable: list[str] = []
    for name in names:
        problem = _load_problem(name)
        if problem is not None:
            (problems if name in requested else notes).append(problem)
        else:
            runnable.append(name)
    jobs = [Job(name, kind, dtype, implicit, scenarios, switching=scenarios is None and dtype == dtypes[0])
            for name in runnable for kind in DEVICES[args.device] for dtype in dtypes]
    composition = not args.no_composition
    if composition:
        _plan_composition(jobs, runnable, dtypes)
    if args.no_training:
        parity_skip = "training parity: skipped (--no-training)"
    elif importlib.util.find_spec(PARITY_MODULE) is None:
        parity_skip = f"training parity: not available ({PARITY_MODULE} is not installed)"
    elif not runnable:
        parity_skip = "training parity: skipped (no backend to train)"
    else:
        parity_skip = ""
    parity = not parity_skip
    per_job = len(testing.default_scenarios(dtypes[0], scenarios)) * (2 if implicit else 1)
    return Plan(
        backends=names, requested=requested, dtypes=dtypes, device=args.device, implicit=implicit,
        jobs=_start_order(jobs), notes=notes, problems=problems, parity=parity,
        parity_backends=runnable if parity else [], parity_skip=parity_skip,
        workers=max(1, min(args.jobs or _usable_cpus(), len(jobs) + parity)),
        ticks=per_job * len(jobs) + parity + sum(bool(j.composition) for j in jobs),
        imports=tuple(args.imports or ()), max_failures=args.max_failures, composition=composition,
    )


def _plan_composition(jobs: list[Job], runnable: list[str], dtypes: tuple[str, ...]) -> None:
    """Give each backend's first CPU job (float64 where it runs) the inner backends of its pairs."""
    names = [n for n in runnable if n != "implicit"]  # ad.Implicit wraps a backend: no pairs of its own
    dtype = "float64" if "float64" in dtypes else dtypes[0]
    for name in names:
        job = next((j for j in jobs if j.backend == name and j.device == "cpu" and j.dtype == dtype), None)
        if job is not None and len(names) > 1:
            job.composition = tuple(n for n in names if n != name)


# ------------------------------------------------------------------- running
def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def run(plan: Plan, progress: Callable[[str], None]) -> Outcome:
    """Run the plan's jobs and training parity, in this process or in worker processes."""
    started = time.perf_counter()
    runner = _run_serial if plan.workers == 1 else _run_pool
    outcome = runner(plan, progress)
    outcome.seconds = time.perf_counter() - started
    return outcome


def _run_serial(plan: Plan, progress: Callable[[str], None]) -> Outcome:
    """``--jobs 1``: everything in this process (the backends registered here are seen)."""
    outcome = Outcome([run_job(job, tick=progress) for job in plan.jobs])
    if plan.parity:
        try:
            outcome.parity = _run_parity(plan.parity_backends, plan.dtypes, plan.device != "cpu")
        except Exception as err:
            outcome.parity_error = _error_text(err)
        progress("training parity")
    return outcome


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """One thread per worker for the numerical libraries, set before they load in the child
    (a spawned worker inherits this process's environment); restored afterwards."""
    saved = {var: os.environ.get(var) for var in _THREAD_VARS}
    for var in _THREAD_VARS:
        os.environ.setdefault(var, "1")
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _run_pool(plan: Plan, progress: Callable[[str], None]) -> Outcome:
    """Worker processes (spawned: some AD libraries do not survive fork); each imports the
    ``--import`` modules first, so that backends registered there exist in it too."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    outcome = Outcome()

    def drain() -> None:
        while not queue.empty():
            progress(queue.get())

    with ProcessPoolExecutor(plan.workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(queue, plan.imports)) as pool:
        pending: dict[Future, Any] = {}
        with _worker_environment():  # workers are spawned as jobs are submitted
            if plan.parity:  # the longest single job: start it first
                pending[pool.submit(_run_parity, plan.parity_backends, plan.dtypes, plan.device != "cpu")] = "parity"
            for job in plan.jobs:
                pending[pool.submit(run_job, job)] = job
        while pending:
            done, _ = wait(list(pending), timeout=0.2, return_when=FIRST_COMPLETED)
            drain()
            for fut in done:
                _collect(outcome, pending.pop(fut), fut, progress)
        drain()
    return outcome


def _collect(outcome: Outcome, what: Any, fut: Future, progress: Callable[[str], None]) -> None:
    """File one finished future under ``outcome``; a crashed worker is reported, not raised."""
    try:
        value = fut.result()
    except Exception as err:
        if what == "parity":
            outcome.parity_error = _error_text(err)
        else:
            outcome.results.append(JobResult(what, error=f"worker failed: {_error_text(err)}"))
        return
    if what == "parity":
        outcome.parity = value
        progress("training parity")
    else:
        outcome.results.append(value)


# ------------------------------------------------------------------- reporting
def _table(reports: list[Any]) -> str:
    from abstractdiff.testing._check import COLUMNS, operator_rows, text_table, verdict

    # One row per (backend, device, dtype) of the *results*: the switching family, run in the
    # first dtype's job, adds steps of the other dtype, which belong to that dtype's row.
    grouped: dict[tuple[str, str, str], list[Any]] = {}
    seconds: dict[tuple[str, str, str], float] = {}
    for rep in reports:
        own = (rep.backend, rep.device, rep.results[0].dtype if rep.results else "-")
        grouped.setdefault(own, [])
        seconds[own] = seconds.get(own, 0.0) + rep.seconds
        for r in rep.results:
            key = (rep.backend, rep.device, r.dtype)
            grouped.setdefault(key, []).append(r)
            if key != own:  # the job's time, split by where its results belong
                seconds[key] = seconds.get(key, 0.0) + r.seconds
                seconds[own] -= r.seconds
    merged = {key: operator_rows(results) for key, results in grouped.items()}
    ops = [op for op in COLUMNS if any(op in rows for rows in merged.values())]
    names = [f"{b} {t}" + ("" if d == "cpu" else f" [{d}]") for b, d, t in merged]
    rows = [
        (name, [("-" if rows.get(op) is None else verdict(rows[op]["ok"], rows[op]["max_error"])) for op in ops]
         + [f"{seconds[key]:5.1f}s"])
        for name, (key, rows) in zip(names, merged.items())
    ]
    return text_table("backend", [*(COLUMN_NAMES.get(op, op) for op in ops), "time"], rows)


def _agreement_lines(dtype: str, agreement: Any, approximate: Collection[str] = ()) -> list[str]:
    """One line per dtype, plus one per pair that disagrees.

    ``approximate`` holds the labels of approximating backends: pairs without one of them
    give the "between exact backends" figure (results are named ``"a vs b"``).
    """
    pairs: dict[str, dict[str, Any]] = {}
    for r in agreement.results:
        if r.dtype != dtype:  # a switching step of the other dtype: that dtype's figure, not this line's
            continue
        p = pairs.setdefault(r.backend, {"ok": True, "max": None, "n": 0, "failed": 0})
        p["ok"] = p["ok"] and r.ok
        p["n"] += 1
        p["failed"] += not r.ok
        if r.max_error is not None:
            p["max"] = r.max_error if p["max"] is None else max(p["max"], r.max_error)
    exact = {k: v for k, v in pairs.items() if not set(k.split(" vs ")) & set(approximate)}
    bad = [k for k, v in pairs.items() if not v["ok"]]

    def worst(group: dict[str, dict[str, Any]]) -> str:
        found = [(v["max"], k) for k, v in group.items() if v["max"] is not None]
        return f"{max(found)[0]:.1e} ({max(found)[1]})" if found else "-"

    line = f"  {dtype}: {len(pairs) - len(bad)} of {len(pairs)} pairs agree; largest difference {worst(pairs)}"
    if exact and len(exact) < len(pairs):
        line += f"; between exact backends {worst(exact)}"
    out = [line]
    for k in bad:
        p = pairs[k]
        out.append(f"    {k}: DISAGREE on {p['failed']} of {p['n']} results (max relative difference "
                   f"{p['max']:.1e})" if p["max"] is not None else f"    {k}: DISAGREE on {p['failed']} results")
    return out


@dataclass
class _Section:
    """Part of the report: its text lines, its JSON entries and the failures it found."""

    lines: list[str] = field(default_factory=list)
    json: list[Any] = field(default_factory=list)
    failures: list[Any] = field(default_factory=list)  # testing.Failure, or text


def _sorted_results(plan: Plan, results: list[JobResult]) -> list[JobResult]:
    """The plan's backend order, CPU before GPU, float64 before float32 (workers finish in any order)."""
    order = {n: i for i, n in enumerate(plan.backends)}
    return sorted(results, key=lambda r: (order.get(r.job.backend, len(order)), r.job.device != "cpu",
                                          DTYPES.index(r.job.dtype) if r.job.dtype in DTYPES else len(DTYPES)))


def _load_failures(plan: Plan, results: list[JobResult]) -> tuple[list[str], list[str]]:
    """(notes, problems): a backend that failed to load is a problem if it was requested or
    broke in an unexpected way, else a note (its library is simply missing)."""
    notes, problems = list(plan.notes), list(plan.problems)
    for r in results:
        if r.error is None:
            continue
        text = f"{r.job.backend}: cannot load: {r.error}"
        if r.job.backend in plan.requested or not r.error.startswith(("BackendUnavailableError", "ImportError")):
            problems.append(text)
        elif text not in notes:
            notes.append(text)
    return notes, problems


def _conformance_section(reports: list[Any], notes: list[str]) -> _Section:
    out = _Section()
    if reports:
        out.lines.append("conformance: ok/FAIL and the max relative error against the analytic results, per operator")
        out.lines.extend(_table(reports).splitlines())
    else:
        out.lines.append("conformance: nothing ran")
    out.lines.extend(f"  {note}" for note in notes)
    out.failures = [f for rep in reports for f in rep.failures]
    return out


def _agreement_section(plan: Plan, reports: list[Any], approximate: Collection[str]) -> _Section:
    """Cross-backend agreement on the CPU, per dtype."""
    from abstractdiff import testing

    out = _Section(["cross-backend agreement (cpu; pairwise, tolerance the sum of both backends' own):"])
    for dtype in plan.dtypes:
        # a report's dtype is its job's (its first result's): the switching family, in the
        # first dtype's reports, adds steps of the other dtype, compared there too
        same = [rep for rep in reports if rep.device == "cpu" and rep.results and rep.results[0].dtype == dtype]
        if len(same) < 2:
            continue
        agreement = testing.compare_reports(same)
        out.json.append({"dtype": dtype, **agreement.to_dict()})
        out.lines.extend(_agreement_lines(dtype, agreement, approximate))
        out.failures += agreement.failures
    if not out.json:
        out.lines.append("  skipped: fewer than two backends ran")
    return out


def _device_section(plan: Plan, results: list[JobResult]) -> _Section:
    """GPU results against the CPU results of the same backend and dtype."""
    from abstractdiff.testing._grid import device_comparison

    out = _Section(["devices (GPU results against CPU results: float32 rtol 1e-5, float64 rtol 1e-10):"])
    skips = {r.job.backend: r.skipped for r in results if r.skipped is not None}
    for name in plan.backends:
        if name in skips and plan.device != "cpu":
            out.lines.append(f"  {name:<20} gpu vs cpu: skipped: {skips[name]}")
            out.json.append({"backend": name, "skipped": skips[name]})
            continue
        gpu_reps = [rep for r in results if r.job.backend == name and r.device != "cpu" for rep in r.reports]
        for g in gpu_reps:
            cpu = next((c for r in results if r.job.backend == name and r.device == "cpu"
                        and r.job.dtype == g.results[0].dtype for c in r.reports if c.backend == g.backend), None)
            if cpu is None:
                out.lines.append(f"  {g.backend:<20} {g.device} vs cpu: skipped: no CPU run to compare with "
                                 "(--device gpu)")
                continue
            comp = device_comparison(cpu, g)
            out.failures += comp.failures
            out.json.append({"backend": g.backend, "device": g.device, **comp.to_dict()})
            worst = max((r.max_error for r in comp.results if r.max_error is not None), default=None)
            err = "-" if worst is None else f"{worst:.1e}"
            verdict = "ok" if comp.ok else f"FAIL ({len(comp.failures)} differences)"
            out.lines.append(f"  {g.backend:<20} {g.device} vs cpu {g.results[0].dtype}: {verdict}, max relative "
                             f"difference {err}")
    if plan.device == "cpu":
        out.lines.append("  skipped: --device cpu")
    return out


def _composition_section(plan: Plan, results: list[JobResult]) -> _Section:
    """The composition matrix: one line per (outer, inner) pair, checked in the outer's job."""
    from abstractdiff.testing._composition import TOLERANCES

    pairs = [p for r in results for p in r.composition]
    dtype = pairs[0].dtype if pairs else "float64"
    out = _Section([f"composition (outer code calling an inner kernel through differentiate_with, against the "
                    f"same function in one library; {dtype}, tolerance {TOLERANCES[dtype]:.0e}):"])
    if not plan.composition:
        out.lines.append("  skipped: --no-composition")
    elif not pairs:
        out.lines.append("  skipped: " + ("--device gpu" if plan.device == "gpu" else "fewer than two exact backends"))
    for pair in pairs:
        out.lines.append(f"  composition: {pair.line()}")
        out.json.append(pair.to_dict())
        if not pair.ok:
            out.failures.append(f"composition: {pair.line()}")
    return out


def _parity_section(plan: Plan, outcome: Outcome) -> _Section:
    """The parity table with a last line that speaks for parity alone.

    ``ParitySummary.format()`` ends with "all runs agree" whenever no parity run failed,
    even when every run was skipped; printed as is, it stood next to the overall FAIL
    of a check whose conformance runs failed.  Its failed runs are counted as failures.
    """
    out = _Section()
    parity = outcome.parity
    if parity is None:
        if outcome.parity_error is not None:
            out.lines.append(f"training parity: ERROR {outcome.parity_error}")
            out.failures.append(f"training parity: ERROR {outcome.parity_error}")
        else:
            out.lines.append(plan.parity_skip or "training parity: did not run")
        return out
    lines = (parity.format() if hasattr(parity, "format") else str(parity)).splitlines()
    if lines and lines[-1].strip() in _PARITY_VERDICTS:
        lines.pop()
    out.lines.extend(lines)
    runs = list(getattr(parity, "results", []))
    status = Counter(getattr(r, "status", "") for r in runs)
    for r in runs:
        if getattr(r, "status", "") in ("fail", "error"):
            detail = r.reason if r.status == "error" else f"max rel diff {r.max_rel_diff:.1e} > rtol {r.rtol:.0e}"
            out.failures.append(f"training parity: {r.backend} {r.mode} {r.device} {r.dtype}: "
                                f"{r.status.upper()} {detail}")
    if not bool(getattr(parity, "ok", True)) and not out.failures:
        out.failures.append("training parity: not ok")
    skipped = f", {status['skip']} skipped" if status["skip"] else ""
    if out.failures:
        ran = status["pass"] + status["fail"] + status["error"]
        out.lines.append(f"  training parity: FAIL ({len(out.failures)} of {ran} runs disagree or raised{skipped})")
    elif status["pass"]:
        out.lines.append(f"  training parity: ok (all {status['pass']} runs agree with the numpy reference{skipped})")
    else:
        out.lines.append(f"  training parity: nothing compared ({status['skip']} skipped)")
    return out


def _parity_json(parity: Any, error: str | None) -> Any:
    if parity is None:
        return None if error is None else {"ok": False, "error": error}
    from dataclasses import asdict, is_dataclass

    results = [asdict(r) if is_dataclass(r) else str(r) for r in getattr(parity, "results", [])]
    return {"ok": bool(getattr(parity, "ok", True)), "results": results, "text": str(parity)}


def _header(plan: Plan) -> str:
    return (f"abstractdiff check: {len(plan.backends)} backend(s) ({', '.join(plan.backends) or 'none'}), "
            f"{'explicit and implicit' if plan.implicit else 'explicit'}; dtypes {', '.join(plan.dtypes)}; "
            f"device {plan.device}")


def report(plan: Plan, outcome: Outcome) -> tuple[list[str], dict[str, Any], int]:
    """The text lines, the JSON document and the exit status (0 pass, 1 fail) of a run.

    Every failure (conformance, agreement, devices, composition, training parity, backends that
    could not load) is listed and counted in the final PASS/FAIL line.
    """
    results = _sorted_results(plan, outcome.results)
    reports = [rep for r in results for rep in r.reports]
    notes, problems = _load_failures(plan, results)
    conformance = _conformance_section(reports, notes)
    agreement = _agreement_section(plan, reports, outcome.approximate)
    devices = _device_section(plan, results)
    composition = _composition_section(plan, results)
    parity = _parity_section(plan, outcome)
    if not reports and not problems:
        problems.append("nothing ran: no backend was available" + (" with a GPU" if plan.device == "gpu" else ""))
    failures = conformance.failures + agreement.failures + devices.failures + composition.failures
    count = len(problems) + len(failures) + len(parity.failures)
    lines = [_header(plan)]
    for section in (conformance, agreement, devices, composition, parity):
        lines += ["", *section.lines]
    if count:
        shown = failures[: plan.max_failures]
        lines += ["", "failures:", *(f"  {p}" for p in problems), *(f"  {f}" for f in shown)]
        if len(failures) > len(shown):
            lines.append(f"  ... and {len(failures) - len(shown)} more (--max-failures, or --json for all)")
        lines += [f"  {p}" for p in parity.failures]
    ok = count == 0
    lines += ["", f"{'PASS' if ok else 'FAIL'}: {len(reports)} backend x device x dtype runs, "
              f"{sum(len(r.results) for r in reports)} checks, {count} failure(s), {outcome.seconds:.1f} s"]
    data = {
        "ok": ok,
        "seconds": outcome.seconds,
        "backends": plan.backends,
        "dtypes": list(plan.dtypes),
        "device": plan.device,
        "implicit": plan.implicit,
        "problems": problems,
        "reports": [rep.to_dict() for rep in reports],
        "agreement": agreement.json,
        "devices": devices.json,
        "composition": composition.json,
        "training_parity": _parity_json(outcome.parity, outcome.parity_error),
        "failures": [str(f) for f in failures],
    }
    return lines, data, 0 if ok else 1


# ------------------------------------------------------------------- command
def _check(args: argparse.Namespace) -> int:
    """``abstractdiff check``: plan, run, report."""
    the_plan = plan(args)
    progress = _Progress(the_plan.ticks, enabled=not args.no_progress)
    try:
        outcome = run(the_plan, progress.update)
    finally:
        progress.close()
    lines, data, status = report(the_plan, outcome)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, default=str)
    return status


def build_parser() -> argparse.ArgumentParser:
    """The ``abstractdiff`` argument parser (its own function so tests can build a plan from argv)."""
    parser = argparse.ArgumentParser(prog="abstractdiff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check", help="run the conformance suite on every backend and device",
        description="Run the conformance suite on every available backend (explicit and implicit), device and "
        "dtype; print the backend x operator table, cross-backend and GPU-vs-CPU agreement and the training-parity "
        "summary. Exit status 1 when anything fails.",
    )
    check.add_argument("--backend", action="append", metavar="NAME",
                       help="backend to check (repeatable; default: every available one). A named backend that "
                       "cannot load is a failure.")
    check.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                       help="import MODULE first, here and in every worker process (repeatable): a module that "
                       "registers backends with ad.register_backend")
    check.add_argument("--device", choices=("all", "cpu", "gpu"), default="all",
                       help="cpu, gpu (the first accelerator of each backend), or all (default)")
    check.add_argument("--dtype", action="append", choices=DTYPES, help="dtype to check (repeatable; default both)")
    check.add_argument("--scenario", action="append", metavar="NAME",
                       help="only this scenario (repeatable; default: all of testing.default_scenarios())")
    check.add_argument("--json", metavar="FILE", help="also write the full results as JSON to FILE")
    check.add_argument("--jobs", type=int, default=None,
                       help="worker processes (default: the number of usable CPUs); 1 runs in this process")
    check.add_argument("--no-implicit", action="store_true", help="skip the ad.Implicit runs")
    check.add_argument("--no-training", action="store_true", help="skip the training-parity summary")
    check.add_argument("--no-composition", action="store_true",
                       help="skip the composition matrix (each backend's code calling every other's kernel)")
    check.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    check.add_argument("--max-failures", type=int, default=30, help="failures listed in the text output (default 30)")
    check.set_defaults(run=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check":
        for module in args.imports or ():
            try:
                _import_modules([module])
            except Exception as err:  # a broken or missing module: a usage error naming it
                parser.error(f"--import {module}: {_error_text(err)}")
        if args.scenario:
            from abstractdiff import testing

            unknown = sorted(set(args.scenario) - set(testing.scenario_names()))
            if unknown:
                parser.error(f"unknown scenario(s) {', '.join(unknown)}; "
                             f"choose from {', '.join(testing.scenario_names())}")
        if args.jobs is not None and args.jobs < 1:
            parser.error("--jobs must be at least 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``abstractdiff`` command line: ``abstractdiff check``.

``abstractdiff check`` runs the conformance suite (:mod:`abstractdiff.testing`) on every
available backend, explicit and through ``ad.Implicit``, on every device and in float64
and float32; prints a backend x operator table (pass/fail, max relative error against
the analytic results, time), the cross-backend agreement, one line per GPU-versus-CPU
comparison (or why it was skipped), and the training-parity summary
(:func:`abstractdiff.parity.training_parity`, when that module is installed).  Exit
status 1 when anything fails.  Backends run in parallel worker processes (``--jobs``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from ._registry import available_backends, unavailable_reason

DTYPES = ("float64", "float32")
# Short column names keep the table within ~120 characters.
COLUMN_NAMES = {
    "gradient": "gradient",
    "value_and_gradient": "value_grad",
    "pullback": "pullback",
    "pushforward": "pushforward",
    "derivative": "derivative",
    "jacobian": "jacobian",
    "hessian": "hessian",
    "hvp": "hvp",
    "numpy_inputs": "numpy_in",
}
# Rough cost of each backend's share (compilation dominates), to start the long jobs first.
_COST = {"jax": 10, "tensorflow": 8, "torch": 3, "autograd": 1, "finite_differences": 1}
PARITY_MODULE = "abstractdiff.parity"


# ------------------------------------------------------------------- worker side
@dataclass
class Job:
    backend: str
    device: str  # "cpu" or "gpu" (the backend's first accelerator, found in the worker)
    dtype: str
    implicit: bool
    scenarios: tuple[str, ...] | None


@dataclass
class JobResult:
    job: Job
    reports: list = field(default_factory=list)  # testing.Report
    error: str | None = None  # the backend could not be created
    skipped: str | None = None  # why a GPU job did not run (no GPU)
    device: str = "cpu"  # the device it ran on


_progress_queue: Any = None


def _init_worker(queue: Any) -> None:
    global _progress_queue
    _progress_queue = queue
    # Worker processes share the machine's cores: one thread each for the libraries.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # This worker process is ours: TensorFlow's retracing warnings (each scenario is a
    # new function, retraced by design) would only clutter the report.
    import logging

    logging.getLogger("tensorflow").setLevel(logging.ERROR)


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
    out.device = b.device
    scenarios = testing.default_scenarios(job.dtype, job.scenarios)
    targets = [b]
    if job.implicit:
        from .adapters.implicit import Implicit

        targets.append(Implicit(b))
    for target in targets:
        label = f"{testing.backend_label(target)} {job.device} {job.dtype}"
        out.reports.append(testing.check_backend(
            target, scenarios, progress=(lambda s, label=label: tick(label)) if tick else None))
    return out


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


def _implicit_available() -> bool:
    try:
        return importlib.util.find_spec("abstractdiff.adapters.implicit") is not None
    except (ImportError, ValueError):
        return False


# ------------------------------------------------------------------- reporting
def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    err = "-" if row["max_error"] is None else f"{row['max_error']:.1e}"
    return f"{'ok' if row['ok'] else 'FAIL'} {err}"


def _table(reports: list[Any]) -> str:
    from abstractdiff.testing._check import COLUMNS

    merged: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    seconds: dict[tuple[str, str, str], float] = {}
    for rep in reports:  # one row per (backend, device, dtype)
        dtype = rep.results[0].dtype if rep.results else "-"
        key = (rep.backend, rep.device, dtype)
        merged[key] = rep.by_operator()
        seconds[key] = rep.seconds
    ops = [op for op in COLUMNS if any(op in rows for rows in merged.values())]
    names = [f"{b} {t}" + ("" if d == "cpu" else f" [{d}]") for b, d, t in merged]
    width = max([len("backend")] + [len(n) for n in names])
    widths = [max(12, len(COLUMN_NAMES.get(op, op))) for op in ops]
    head = "backend".ljust(width) + "  " + "  ".join(COLUMN_NAMES.get(op, op).ljust(w) for op, w in zip(ops, widths))
    head += "  time"
    lines = [head, "-" * len(head)]
    for name, (key, rows) in zip(names, merged.items()):
        cells = "  ".join(_cell(rows.get(op)).ljust(w) for op, w in zip(ops, widths))
        lines.append(f"{name.ljust(width)}  {cells}  {seconds[key]:5.1f}s")
    return "\n".join(lines)


def _agreement_lines(dtype: str, agreement: Any) -> list[str]:
    """One line per dtype, plus one per pair that disagrees."""
    pairs: dict[str, dict[str, Any]] = {}
    for r in agreement.results:
        p = pairs.setdefault(r.backend, {"ok": True, "max": None, "n": 0, "failed": 0})
        p["ok"] = p["ok"] and r.ok
        p["n"] += 1
        p["failed"] += not r.ok
        if r.max_error is not None:
            p["max"] = r.max_error if p["max"] is None else max(p["max"], r.max_error)
    exact = {k: v for k, v in pairs.items() if "finite_differences" not in k}
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


def _check(args: argparse.Namespace) -> int:
    from abstractdiff import testing

    started = time.perf_counter()
    requested = list(dict.fromkeys(args.backend or []))
    dtypes = tuple(dict.fromkeys(args.dtype or DTYPES))
    names = requested or [n for n in available_backends() if n != "implicit"]
    names = [n for n in names if n != "implicit"]
    implicit = not args.no_implicit and _implicit_available()
    problems: list[str] = []  # failures outside the reports (a requested backend missing...)
    notes: list[str] = []
    jobs: list[Job] = []
    kinds = {"all": ("cpu", "gpu"), "cpu": ("cpu",), "gpu": ("gpu",)}[args.device]
    for name in names:
        try:
            reason = unavailable_reason(name)  # decided without importing the library
        except Exception as err:  # an unknown name
            reason = f"{type(err).__name__}: {err}"
        if reason is not None:
            (problems if name in requested else notes).append(f"{name}: cannot load: {reason}")
            continue
        for kind in kinds:
            for dtype in dtypes:
                jobs.append(Job(name, kind, dtype, implicit, tuple(args.scenario) if args.scenario else None))
    scenario_count = len(testing.default_scenarios(dtypes[0], args.scenario or None))
    total = sum(scenario_count * (2 if j.implicit else 1) for j in jobs)
    parity_wanted = not args.no_training and importlib.util.find_spec(PARITY_MODULE) is not None
    progress = _Progress(total + (1 if parity_wanted else 0), enabled=not args.no_progress)

    results: list[JobResult] = []
    parity: Any = None
    parity_error: str | None = None
    workers = max(1, min(args.jobs or _usable_cpus(), len(jobs) + parity_wanted))
    try:
        if workers == 1:
            for job in sorted(jobs, key=lambda j: -_COST.get(j.backend, 2)):
                results.append(run_job(job, tick=progress.update))
            if parity_wanted:
                try:
                    parity = _run_parity(names, dtypes, args.device != "cpu")
                except Exception as err:
                    parity_error = f"{type(err).__name__}: {err}"
                progress.update("training parity")
        else:
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")  # jax and tensorflow do not survive fork
            queue = ctx.Queue()
            with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
                pending: dict[Future, Any] = {}
                if parity_wanted:  # the longest single job: start it first
                    pending[pool.submit(_run_parity, names, dtypes, args.device != "cpu")] = "parity"
                for job in sorted(jobs, key=lambda j: -_COST.get(j.backend, 2)):
                    pending[pool.submit(run_job, job)] = job
                while pending:
                    done, _ = wait(list(pending), timeout=0.2, return_when=FIRST_COMPLETED)
                    while not queue.empty():
                        progress.update(queue.get())
                    for fut in done:
                        what = pending.pop(fut)
                        try:
                            value = fut.result()
                        except Exception as err:  # a crashed worker: report it
                            if what == "parity":
                                parity_error = f"{type(err).__name__}: {err}"
                            else:
                                results.append(JobResult(what, error=f"worker failed: {type(err).__name__}: {err}"))
                            continue
                        if what == "parity":
                            parity = value
                            progress.update("training parity")
                        else:
                            results.append(value)
                while not queue.empty():
                    progress.update(queue.get())
    finally:
        progress.close()

    # ----------------------------------------------------------------- output
    order = {n: i for i, n in enumerate(names)}
    results.sort(key=lambda r: (order.get(r.job.backend, 99), r.job.device != "cpu", DTYPES.index(r.job.dtype)))
    reports = [rep for r in results for rep in r.reports]
    device_skips: dict[str, str] = {}
    for r in results:
        if r.error is not None:
            text = f"{r.job.backend}: cannot load: {r.error}"
            if r.job.backend in requested or not r.error.startswith(("BackendUnavailableError", "ImportError")):
                problems.append(text)
            elif text not in notes:
                notes.append(text)
        if r.skipped is not None:
            device_skips[r.job.backend] = r.skipped
    failures = [f for rep in reports for f in rep.failures]
    out: list[str] = []
    out.append(f"abstractdiff check: {len(names)} backend(s) ({', '.join(names) or 'none'}), "
               f"{'explicit and implicit' if implicit else 'explicit'}; dtypes {', '.join(dtypes)}; "
               f"device {args.device}")
    out.append("")
    if reports:
        out.append("conformance: ok/FAIL and the max relative error against the analytic results, per operator")
        out.append(_table(reports))
    else:
        out.append("conformance: nothing ran")
    for note in notes:
        out.append(f"  {note}")

    # cross-backend agreement, on the CPU, per dtype
    agreement_json = []
    out.append("")
    out.append("cross-backend agreement (cpu; pairwise, tolerance the sum of both backends' own):")
    any_pair = False
    for dtype in dtypes:
        same = [rep for rep in reports if rep.device == "cpu" and any(r.dtype == dtype for r in rep.results)]
        if len(same) < 2:
            continue
        any_pair = True
        agreement = testing.compare_reports(same)
        agreement_json.append({"dtype": dtype, **agreement.to_dict()})
        out.extend(_agreement_lines(dtype, agreement))
        failures += agreement.failures
    if not any_pair:
        out.append("  skipped: fewer than two backends ran")

    # GPU versus CPU
    devices_json = []
    out.append("")
    out.append("devices (GPU results against CPU results: float32 rtol 1e-5, float64 rtol 1e-10):")
    from abstractdiff.testing._grid import device_comparison

    for name in names:
        if name in device_skips and args.device != "cpu":
            out.append(f"  {name:<20} gpu vs cpu: skipped: {device_skips[name]}")
            devices_json.append({"backend": name, "skipped": device_skips[name]})
            continue
        gpu_reps = [rep for r in results if r.job.backend == name and r.device != "cpu" for rep in r.reports]
        for g in gpu_reps:
            cpu = next((c for r in results if r.job.backend == name and r.device == "cpu"
                        and r.job.dtype == g.results[0].dtype for c in r.reports if c.backend == g.backend), None)
            if cpu is None:
                out.append(f"  {g.backend:<20} {g.device} vs cpu: skipped: no CPU run to compare with (--device gpu)")
                continue
            comp = device_comparison(cpu, g)
            failures += comp.failures
            devices_json.append({"backend": g.backend, "device": g.device, **comp.to_dict()})
            worst = max((r.max_error for r in comp.results if r.max_error is not None), default=None)
            err = "-" if worst is None else f"{worst:.1e}"
            verdict = "ok" if comp.ok else f"FAIL ({len(comp.failures)} differences)"
            out.append(f"  {g.backend:<20} {g.device} vs cpu {g.results[0].dtype}: {verdict}, max relative "
                       f"difference {err}")
    if args.device == "cpu":
        out.append("  skipped: --device cpu")

    # training parity (abstractdiff.parity, from the training layer)
    out.append("")
    parity_ok = True
    if parity is not None:
        out.append(parity.format() if hasattr(parity, "format") else str(parity))
        parity_ok = bool(getattr(parity, "ok", True))
    elif parity_error is not None:
        out.append(f"training parity: ERROR {parity_error}")
        parity_ok = False
    elif args.no_training:
        out.append("training parity: skipped (--no-training)")
    else:
        out.append(f"training parity: not available ({PARITY_MODULE} is not installed)")

    if not reports and not problems:
        problems.append("nothing ran: no backend was available" + (" with a GPU" if args.device == "gpu" else ""))
    ok = not failures and not problems and parity_ok
    if failures or problems:
        out.append("")
        out.append("failures:")
        out.extend(f"  {p}" for p in problems)
        shown = failures[: args.max_failures]
        out.extend(f"  {f}" for f in shown)
        if len(failures) > len(shown):
            out.append(f"  ... and {len(failures) - len(shown)} more (--max-failures, or --json for all)")
    elapsed = time.perf_counter() - started
    out.append("")
    out.append(f"{'PASS' if ok else 'FAIL'}: {len(reports)} backend x device x dtype runs, "
               f"{sum(len(r.results) for r in reports)} checks, {len(failures) + len(problems)} failure(s), "
               f"{elapsed:.1f} s")
    print("\n".join(out))

    if args.json:
        data = {
            "ok": ok,
            "seconds": elapsed,
            "backends": names,
            "dtypes": list(dtypes),
            "device": args.device,
            "implicit": implicit,
            "problems": problems,
            "reports": [rep.to_dict() for rep in reports],
            "agreement": agreement_json,
            "devices": devices_json,
            "training_parity": _parity_json(parity, parity_error),
            "failures": [str(f) for f in failures],
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, default=str)
    return 0 if ok else 1


def _parity_json(parity: Any, error: str | None) -> Any:
    if parity is None:
        return None if error is None else {"ok": False, "error": error}
    from dataclasses import asdict, is_dataclass

    results = [asdict(r) if is_dataclass(r) else str(r) for r in getattr(parity, "results", [])]
    return {"ok": bool(getattr(parity, "ok", True)), "results": results, "text": str(parity)}


def main(argv: list[str] | None = None) -> int:
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
    check.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    check.add_argument("--max-failures", type=int, default=30, help="failures listed in the text output (default 30)")
    check.set_defaults(run=_check)
    args = parser.parse_args(argv)
    if args.command == "check" and args.scenario:
        from abstractdiff import testing

        unknown = sorted(set(args.scenario) - set(testing.scenario_names()))
        if unknown:
            parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(testing.scenario_names())}")
    if args.command == "check" and args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be at least 1")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m benchmarks``: time native, abstractdiff and EagerPy side by side.

Prints a table of median per-call times and ratios to native, and writes it to
``docs/benchmarks.md`` (``--output``; ``--no-write`` to only print).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

import abstractdiff as ad

from . import compose, custom, import_time, memory, operators, sparse
from .harness import Result, run_backend
from .workloads import WORKLOADS

BACKENDS = ("jax", "torch", "tensorflow", "autograd", "mlx", "paddle", "pytensor")
TARGETS = {"tiny": (1.10, 1.30), "gmm": (1.05, 1.10), "mlp": (1.05, 1.10)}  # (prepared, unprepared)


def _versions() -> str:
    parts = []
    for dist in ("numpy", "torch", "jax", "tensorflow-cpu", "autograd", "eagerpy"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            pass
    return ", ".join(parts)


def _fmt(us: float | None) -> str:
    if us is None:
        return "n/a"
    return f"{us:,.1f}" if us < 1000 else f"{us:,.0f}"


def table(results: list[Result]) -> list[str]:
    lines = [
        "| workload | backend | native (us) | spread | abstractdiff (us) | ratio | prepared (us) | ratio "
        "| EagerPy (us) | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r.workload, r.backend) for r in results}, key=lambda k: (list(WORKLOADS).index(k[0]), k[1]))
    for wl, be in keys:
        by = {r.variant: r for r in results if r.workload == wl and r.backend == be}
        native = by.get("native")
        base = native.median_us if native else None

        def cell(variant: str, by: dict = by, base: float | None = base) -> tuple[str, str]:
            r = by.get(variant)
            if r is None or r.median_us is None:
                return ("n/a" + (f" ({r.note})" if r and r.note else ""), "")
            ratio = f"{r.median_us / base:.2f}" if base else ""
            return (_fmt(r.median_us), ratio)

        spread = f"±{50 * native.spread:.0f}%" if native and native.spread is not None else ""
        row = [wl, be, _fmt(base), spread, *cell("abstractdiff"), *cell("abstractdiff prepared"), *cell("eagerpy")]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--backend", action="append", choices=BACKENDS, help="repeatable; default: all available")
    parser.add_argument("--workload", action="append", choices=list(WORKLOADS), help="repeatable; default: all")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per variant (median taken)")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per variant per round")
    parser.add_argument("--output", default=os.path.join("docs", "benchmarks.md"))
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory comparison")
    parser.add_argument("--no-import", action="store_true", help="skip the import-time comparison")
    parser.add_argument("--no-operators", action="store_true", help="skip the jacobian and hvp comparison")
    parser.add_argument("--no-sparse", action="store_true", help="skip the sparse against dense Jacobian comparison")
    parser.add_argument("--no-compose", action="store_true", help="skip the crossing-libraries comparison")
    parser.add_argument("--no-custom", action="store_true", help="skip the ad.custom_vjp comparison")
    opts = parser.parse_args(argv)

    available = set(ad.available_backends())
    backends = [b for b in (opts.backend or BACKENDS) if b in available]
    workloads = opts.workload or list(WORKLOADS)
    results: list[Result] = []
    for wl_name in workloads:
        wl = WORKLOADS[wl_name]()
        for be in backends:
            print(f"  {wl_name} / {be} ...", file=sys.stderr, flush=True)
            results.extend(run_backend(be, wl, opts.dtype, opts.rounds, opts.min_time))
    lines = table(results)
    print("\n".join(lines))
    overhead_lines = overhead_table(results)
    print("\n".join(overhead_lines))
    lines = [*lines, "", "abstractdiff's own cost per call (its time minus native's, median of rounds):", "",
             *overhead_lines]
    capture_lines = captures_table(workloads)
    print("\n".join(capture_lines))
    operator_lines: list[str] = []
    if not opts.no_operators:
        names = [b for b in backends if b in operators.BACKENDS]
        print(f"  jacobian and hvp / {', '.join(names)} ...", file=sys.stderr, flush=True)
        operator_lines = operators.table(operators.run(names, opts.dtype, opts.rounds, opts.min_time))
        print("\n".join(operator_lines))
    if not opts.no_sparse:
        names = [b for b in backends if b in sparse.BACKENDS]
        print(f"  sparse jacobians and hessians / {', '.join(names)} ...", file=sys.stderr, flush=True)
        sparse_lines = sparse.table(sparse.run(names))
        print("\n".join(sparse_lines))
        operator_lines = [*operator_lines, "", "Sparse Jacobians and Hessians against dense and against asdex and "
                          "sparsejac (2-D Laplacian residual, banded and arrowhead Hessians; 10^4 and 10^5 unknowns), "
                          "float64 (`python -m benchmarks.sparse`):", "", *sparse_lines]
    compose_lines: list[str] = []
    if not opts.no_compose:
        names = [b for b in backends if b in compose.LIBRARIES]
        print(f"  crossing libraries / {', '.join(names)} ...", file=sys.stderr, flush=True)
        compose_lines = compose.table(compose.run(names, opts.rounds, opts.min_time))
        print("\n".join(compose_lines))
    custom_lines: list[str] = []
    if not opts.no_custom:
        names = [b for b in backends if b in custom.LIBRARIES]
        print(f"  ad.custom_vjp / {', '.join(names)} ...", file=sys.stderr, flush=True)
        custom_lines = custom.table(custom.run(names, opts.rounds, opts.min_time))
        print("\n".join(custom_lines))
    memory_lines: list[str] = []
    if not opts.no_memory:
        print("  peak memory (fresh processes) ...", file=sys.stderr, flush=True)
        memory_lines = memory.table(memory.run_all(backends, opts.dtype))
        print("\n".join(memory_lines))
    import_lines: list[str] = []
    if not opts.no_import:
        print("  import time (fresh interpreters) ...", file=sys.stderr, flush=True)
        import_lines = import_table()
        print("\n".join(import_lines))
    if not opts.no_write:
        write_markdown(opts, workloads, lines, memory_lines, import_lines, capture_lines, operator_lines,
                       compose_lines, custom_lines)
    return 0


def overhead_table(results: list[Result]) -> list[str]:
    """Per backend and workload, abstractdiff's own microseconds per call (total minus native):
    a regression of the interface shows here at a glance, whatever the workload's size."""
    lines = ["| workload | backend | unprepared overhead (us) | prepared overhead (us) |", "|---|---|---:|---:|"]
    keys = sorted({(r.workload, r.backend) for r in results}, key=lambda k: (list(WORKLOADS).index(k[0]), k[1]))
    for wl, be in keys:
        by = {r.variant: r.median_us for r in results if r.workload == wl and r.backend == be}
        base = by.get("native")
        if base is None:
            continue
        variants = ("abstractdiff", "abstractdiff prepared")
        cells = [f"{by[v] - base:+,.1f}" if by.get(v) is not None else "n/a" for v in variants]
        lines.append(f"| {wl} | {be} | {cells[0]} | {cells[1]} |")
    return lines


def captures_table(workloads: list[str], calls: int = 20000) -> list[str]:
    """What the stale-trace check costs per unprepared call: the guard's test that each
    workload's function still reads the same objects from its globals and closures (what a
    hot call pays, abstractdiff._captures.CaptureGuard.unchanged), and the full fingerprint
    taken when it does not (abstractdiff._captures.captures)."""
    from abstractdiff._captures import capture_guard, captures

    def best_us(call: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        return best

    lines = ["| workload | function | guard per call (us) | full fingerprint, on a miss (us) |", "|---|---|---:|---:|"]
    for name in workloads:
        f = WORKLOADS[name]().f
        guard = capture_guard(f)
        guarded = "n/a" if guard is None else f"{best_us(lambda g=guard, f=f: g.unchanged(f)):.2f}"
        lines.append(f"| {name} | `{f.__name__}` | {guarded} | {best_us(lambda f=f: captures(f)):.2f} |")
    return lines


def import_table(repeat: int = 15) -> list[str]:
    """Median wall and CPU time of ``import numpy`` and ``import abstractdiff``, interleaved."""
    import_time.time_import("numpy", 1)  # warm caches and .pyc files first
    import_time.time_import("abstractdiff", 1)
    numpy_ms, ad_ms = [], []
    for _ in range(repeat):
        numpy_ms += import_time.time_import("numpy", 1)
        ad_ms += import_time.time_import("abstractdiff", 1)
    lines = ["| clock | import numpy (ms) | import abstractdiff (ms) | difference (ms) |", "|---|---:|---:|---:|"]
    for k, clock in enumerate(("wall", "CPU")):
        a = statistics.median(t[k] for t in numpy_ms)
        b = statistics.median(t[k] for t in ad_ms)
        lines.append(f"| {clock} | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    return lines


def write_markdown(
    opts: argparse.Namespace,
    workloads: list[str],
    lines: list[str],
    memory_lines: list[str],
    import_lines: list[str],
    capture_lines: list[str],
    operator_lines: list[str],
    compose_lines: list[str],
    custom_lines: list[str] = (),  # type: ignore[assignment]
) -> None:
    descriptions = [f"- `{name}`: {WORKLOADS[name]().description}" for name in workloads]
    targets = [
        f"- `{name}`: prepared <= {p}" + (f", unprepared <= {u}" if u else "") for name, (p, u) in TARGETS.items()
    ]
    text = "\n".join(
        [
            "# Benchmarks",
            "",
            "Generated by `python -m benchmarks` (`make bench`); do not edit by hand.",
            "",
            f"Run on {datetime.date.today().isoformat()}, {platform.machine()} with {os.cpu_count()} cores, "
            f"Python {platform.python_version()}; {_versions()}. dtype {opts.dtype}; median of {opts.rounds} "
            "interleaved rounds; `value_and_gradient` on inputs already converted to the backend's arrays.",
            "",
            "Variants: *native* is the fastest idiomatic call of each library (jax `jit(value_and_grad)`, "
            "torch `autograd.grad` on fresh leaves, tensorflow `tf.function` around a `GradientTape`, autograd "
            "`value_and_grad`, MLX `mx.compile(mx.value_and_grad)`, paddle `paddle.grad` on fresh leaves, "
            "PyTensor a compiled `pytensor.function` of the value and `pytensor.grad`); *abstractdiff* is "
            "`ad.value_and_gradient(b, f, x, *args)` (the MLX backend with `compile=True`, its native "
            "counterpart; every other backend with its defaults); *prepared* is "
            "`ad.prepare_value_and_gradient(...)` called repeatedly; *EagerPy* is `eagerpy.value_and_grad` "
            "(one tensor: pytrees are raveled). *spread* is half the interquartile range of native's per-round "
            "times relative to its median: ratios closer to 1 than that are within this machine's noise (a ratio "
            "below 1 means nothing more).",
            "",
            "Workloads:",
            "",
            *descriptions,
            "",
            *lines,
            "",
            "Targets (ratio to native):",
            "",
            *targets,
            "",
            "## The stale-trace check",
            "",
            "On backends that trace `f` once and reuse the trace (jax and tensorflow with `compile=True`, the "
            "default; torch with `compile=`), an unprepared operator keys its plan on the values `f` reads from "
            "globals and closures, so that a changed value is traced again instead of silently reusing the old "
            "one. A call whose function still reads the same objects (by identity, held weakly) pays the guard's "
            "test only; a call after a change, or the first one, takes the full fingerprint. The *abstractdiff* "
            "column above includes this check; its cost alone, per call (best of 5 runs of 20,000 calls):",
            "",
            *capture_lines,
            "",
            *(
                [
                    "## Jacobians and Hessian-vector products",
                    "",
                    *operators.DESCRIPTION,
                    "",
                    f"Target: prepared <= {operators.TARGET} x native.",
                    "",
                    *operator_lines,
                    "",
                ]
                if operator_lines
                else []
            ),
            *(
                [
                    "## Crossing libraries",
                    "",
                    *compose.DESCRIPTION,
                    "",
                    *compose_lines,
                    "",
                ]
                if compose_lines
                else []
            ),
            *(["## Custom derivatives", "", *custom.DESCRIPTION, "", *custom_lines, ""] if custom_lines else []),
            "## Peak memory of a gradient",
            "",
            "Growth of the process's peak resident set over its size just before, for three "
            "`value_and_gradient` calls of the GMM objective with n=10000 after one warm-up call (which "
            "compiles); median of 3 fresh processes per cell (`python -m benchmarks.memory`), "
            "with a fixed malloc mmap threshold and one TensorFlow inter-op thread so that the figure repeats. "
            "Target: no more than 10% above native.",
            "",
            *(memory_lines or ["(not measured in this run: --no-memory)"]),
            "",
            "## Import time",
            "",
            "`import abstractdiff` against `import numpy`, each in 15 fresh interpreters, interleaved, median "
            "(`python -m benchmarks.import_time` also attributes the difference to packages). Target: at most "
            "50 ms more than `import numpy`. Importing abstractdiff imports no AD library.",
            "",
            *(import_lines or ["(not measured in this run: --no-import)"]),
            "",
        ]
    )
    with open(opts.output, "w") as fh:
        fh.write(text)
    print(f"wrote {opts.output}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

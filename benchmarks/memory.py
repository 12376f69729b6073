"""Peak memory of one gradient: native vs abstractdiff, each in a fresh process.

The libraries allocate outside Python's allocator (torch, XLA, TensorFlow), so the
figure is the growth of the process's peak resident set size (``VmHWM``, reset after one
warm-up call, which compiles) over its size at that moment: the graph or tape, the
intermediates and the gradients of a steady-state call.  The workload is the GMM
objective with n=10000 points so that the intermediates (about 10 MB each) dominate
allocator noise.

``python -m benchmarks.memory`` prints the table; ``python -m benchmarks`` includes it.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
from typing import Any

VARIANTS = ("native", "abstractdiff", "abstractdiff prepared")
# A fixed mmap threshold: glibc otherwise raises it as blocks are freed, keeps large
# arrays on its heap and the resident size stops following live memory.  With it, every
# large array is its own mapping, returned to the system when freed.
# TensorFlow runs independent ops concurrently, so its peak varied between processes by
# 15% (native and ours alike); one inter-op thread makes it the same every time.
_MALLOC_ENV = {
    **os.environ,
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "0",
    "TF_NUM_INTEROP_THREADS": "1",
}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current
    # size (Linux >= 4.0): the imports and setup before the call must not count.
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def measure(backend: str, variant: str, dtype: str = "float32", calls: int = 3) -> dict[str, Any]:
    """Run in the current (fresh) process: peak RSS growth of ``calls`` gradients, in MiB."""
    import abstractdiff as ad

    from .harness import NATIVE, _synchronizer, _to, bench_backend
    from .workloads import gmm

    wl = gmm(n=10000)
    b = bench_backend(backend)
    sync = _synchronizer(backend)
    x, args = _to(b, wl.x, dtype), _to(b, wl.args, dtype)
    if variant == "native":
        call = NATIVE[backend](wl, x, args)
    elif variant == "abstractdiff":

        def call() -> Any:
            return sync(ad.value_and_gradient(b, wl.f, x, *args))

    else:
        prepared = ad.prepare_value_and_gradient(b, wl.f, x, *args)

        def call() -> Any:
            return sync(prepared(x, *args))

    call()  # warm-up: tracing and compilation are not the gradient's memory
    gc.collect()
    _reset_peak()
    before = _status_kib("VmRSS")
    for _ in range(calls):
        out = call()
        del out
    peak = _status_kib("VmHWM")
    return {"backend": backend, "variant": variant, "peak_growth_mib": max(peak - before, 0) / 1024}


def run_all(backends: list[str], dtype: str = "float32", repeats: int = 3) -> list[dict[str, Any]]:
    """Median over ``repeats`` fresh processes per (backend, variant), interleaved."""
    samples: dict[tuple[str, str], list[float]] = {}
    errors: dict[tuple[str, str], str] = {}
    for _ in range(repeats):
        for backend in backends:
            for variant in VARIANTS:
                code = (
                    "import json, sys; from benchmarks.memory import measure; "
                    f"print('RESULT', json.dumps(measure({backend!r}, {variant!r}, {dtype!r})))"
                )
                proc = subprocess.run(
                    [sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd(), env=_MALLOC_ENV
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    errors[(backend, variant)] = (proc.stderr.strip().splitlines() or ["failed"])[-1]
                    continue
                value = json.loads(lines[-1][len("RESULT ") :])["peak_growth_mib"]
                samples.setdefault((backend, variant), []).append(value)
    rows = []
    for backend in backends:
        for variant in VARIANTS:
            values = samples.get((backend, variant))
            row: dict[str, Any] = {"backend": backend, "variant": variant}
            if values:
                row["peak_growth_mib"] = statistics.median(values)
            else:
                row["error"] = errors.get((backend, variant), "no result")
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| backend | native (MiB) | abstractdiff (MiB) | ratio | prepared (MiB) | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for backend in dict.fromkeys(r["backend"] for r in rows):
        by = {r["variant"]: r.get("peak_growth_mib") for r in rows if r["backend"] == backend}
        native = by.get("native")
        cells = [backend, f"{native:.1f}" if native is not None else "error"]
        for variant in VARIANTS[1:]:
            value = by.get(variant)
            if value is None:
                cells += ["error", ""]
            else:
                cells += [f"{value:.1f}", f"{value / native:.2f}" if native else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    import abstractdiff as ad

    from .__main__ import BACKENDS

    backends = [b for b in BACKENDS if b in ad.available_backends()]
    print("\n".join(table(run_all(backends))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

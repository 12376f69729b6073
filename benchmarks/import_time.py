"""Import time of abstractdiff against numpy, in fresh interpreters.

    python -m benchmarks.import_time [--repeat N]

Goal: ``import abstractdiff`` costs at most 50 ms more than ``import numpy``.  Each
import is timed inside its own fresh interpreter (interpreter start-up excluded);
the median of the repetitions is reported.  A ``-X importtime`` run then attributes
the extra time to the modules abstractdiff imports beyond numpy.

Not a timed test: timings depend on the machine and its load, so this reports, and
exits 0 whatever it finds (``--check`` makes a missed goal exit 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

GOAL_MS = 50.0

_TIMED = (
    "import time; t, c = time.perf_counter(), time.process_time(); import {module}; "
    "print(time.perf_counter() - t, time.process_time() - c)"
)

# Bytecode as a user has it: an installed package has .pyc files, but with
# PYTHONDONTWRITEBYTECODE set (as in some CI and sandbox shells) an editable install
# recompiles abstractdiff from source on every import, which costs ~40 ms that no user
# pays.  The .pyc files go to a private prefix, never into the working tree.
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
_ENV["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="abstractdiff-import-time-")


def time_import(module: str, repeat: int) -> list[tuple[float, float]]:
    """``(wall ms, CPU ms)`` to import ``module``, in each of ``repeat`` fresh interpreters.

    CPU time (``time.process_time``) leaves out time spent waiting for a core, so it
    is the steadier figure on a shared machine.
    """
    times = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-c", _TIMED.format(module=module)], capture_output=True, text=True, check=True, env=_ENV
        )
        wall, cpu = out.stdout.split()
        times.append((1000.0 * float(wall), 1000.0 * float(cpu)))
    return times


def import_profile(module: str, runs: int = 5) -> dict[str, float]:
    """``{module name: self ms}`` from ``python -X importtime``, the minimum over ``runs``.

    The minimum, because on a loaded machine noise only ever adds time.
    """
    profile: dict[str, float] = {}
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", f"import {module}"],
            capture_output=True,
            text=True,
            check=True,
            env=_ENV,
        )
        for line in out.stderr.splitlines():
            if not line.startswith("import time:") or "[us]" in line:
                continue
            self_us, _, name = line[len("import time:") :].split("|", 2)
            name, ms = name.strip(), int(self_us) / 1000.0
            profile[name] = min(ms, profile.get(name, ms))
    return profile


def attribute(extra_of: str, baseline: str, top: int = 15) -> list[tuple[str, float, float]]:
    """Top-level packages imported by ``extra_of`` but not by ``baseline``, costliest first.

    Self times are summed per top-level package (``optree._C`` counts as ``optree``), so
    the figures add up to the extra time without double counting nested imports.
    """
    base = set(import_profile(baseline))
    per_package: dict[str, list[float]] = {}
    for name, self_ms in import_profile(extra_of).items():
        if name in base:
            continue
        package = name.partition(".")[0]
        entry = per_package.setdefault(package, [0.0, 0])
        entry[0] += self_ms
        entry[1] += 1
    ranked = sorted(per_package.items(), key=lambda kv: -kv[1][0])
    return [(pkg, ms, int(n)) for pkg, (ms, n) in ranked[:top]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="fresh interpreters per module (default 15)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the goal is missed")
    opts = parser.parse_args(argv)

    # Warm the file-system cache and write the .pyc files (see _ENV) before timing.
    time_import("numpy", 1)
    time_import("abstractdiff", 1)
    # Interleaved, so that a change in machine load hits both series alike.
    numpy_ms, ad_ms = [], []
    for _ in range(opts.repeat):
        numpy_ms += time_import("numpy", 1)
        ad_ms += time_import("abstractdiff", 1)
    print(
        f"python {sys.version.split()[0]} on {sys.platform}, {os.cpu_count()} CPUs; "
        f"{opts.repeat} fresh interpreters each (interleaved), median (min-max)"
    )
    extras = {}
    for k, clock in enumerate(("wall", "CPU")):
        np_t = [t[k] for t in numpy_ms]
        ad_t = [t[k] for t in ad_ms]
        extras[clock] = statistics.median(ad_t) - statistics.median(np_t)
        print(f"  {clock:4s}  import numpy        {statistics.median(np_t):7.1f} ms  ({min(np_t):.1f}-{max(np_t):.1f})")
        print(f"  {clock:4s}  import abstractdiff {statistics.median(ad_t):7.1f} ms  ({min(ad_t):.1f}-{max(ad_t):.1f})")
        print(f"  {clock:4s}  difference          {extras[clock]:7.1f} ms")
    for clock, extra in extras.items():
        verdict = "met" if extra <= GOAL_MS else "MISSED"
        print(f"goal: import abstractdiff <= import numpy + {GOAL_MS:.0f} ms ({clock}): {verdict} ({extra:+.1f} ms)")
    load = statistics.median(t[0] for t in numpy_ms) / statistics.median(t[1] for t in numpy_ms)
    if load > 1.5:
        print(f"note: wall time is {load:.1f}x CPU time for import numpy: the machine is busy, trust the CPU figures")
    print("\nwhere the extra time goes (-X importtime, self time per package not imported by numpy,")
    print("minimum of 5 runs per module):")
    ranked = attribute("abstractdiff", "numpy")
    for package, ms, n in ranked:
        print(f"  {package:28s} {ms:7.1f} ms  ({n} modules)")
    print(f"  {'total':28s} {sum(ms for _, ms, _ in ranked):7.1f} ms")
    return 1 if (opts.check and min(extras.values()) > GOAL_MS) else 0


if __name__ == "__main__":
    sys.exit(main())

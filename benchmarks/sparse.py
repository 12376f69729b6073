"""Sparse against dense Jacobians: the 2-D Laplacian residual with 10^4 unknowns (100 x 100).

``python -m benchmarks.sparse`` prints the table; ``python -m benchmarks`` adds it to
docs/benchmarks.md (``--no-sparse`` skips it).  *dense* is ``ad.prepare_jacobian(b, f, x)``,
*sparse* ``ad.prepare_jacobian(ad.Sparse(b), f, x)`` (detection and coloring at
preparation, not timed; timed separately); derivative calls count the seed vectors pushed
forward (one per column for dense, one per color for sparse).  Dense is timed over few
rounds: one call builds a 10^4 x 10^4 float64 matrix (800 MB).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

import abstractdiff as ad
from abstractdiff.testing._sparse_problems import laplacian_residual

BACKENDS = ("jax", "torch")
GRID = 100


def _median_s(call: Callable[[], Any], rounds: int) -> float:
    call()  # warm up (compilation, caches)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(names: list[str], rounds: int = 5, grid: int = GRID) -> list[dict]:
    n = grid * grid
    x0 = np.random.default_rng(0).normal(size=n)
    rows = []
    for name in names:
        b = ad.backend(name)
        x = b.asarray(x0)
        start = time.perf_counter()
        sparse = ad.prepare_jacobian(ad.Sparse(b), laplacian_residual, x)
        prepare_s = time.perf_counter() - start
        colors = sparse.preparation.plan([x], []).count
        sparse_s = _median_s(lambda: sparse(x), rounds)  # noqa: B023
        dense = ad.prepare_jacobian(b, laplacian_residual, x)
        dense_s = _median_s(lambda: ad.to_numpy(dense(x)), 1)  # noqa: B023  (to numpy: jax returns before it is done)
        J = sparse(x)
        err = float(np.max(np.abs(J.toarray() - np.asarray(ad.to_numpy(dense(x))))))
        rows.append({"backend": name, "n": n, "nnz": J.nnz, "colors": colors, "prepare_s": prepare_s,
                     "sparse_s": sparse_s, "dense_s": dense_s, "max_abs_diff": err})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| backend | n | nnz | derivative calls sparse / dense | sparse (ms) | dense (ms) | time ratio | "
        "sparse preparation (s) | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['n']} | {r['nnz']} | {r['colors']} / {r['n']} "
            f"({r['n'] / r['colors']:.0f}x fewer) | {1e3 * r['sparse_s']:.1f} | {1e3 * r['dense_s']:.0f} | "
            f"{r['dense_s'] / r['sparse_s']:.0f}x | {r['prepare_s']:.2f} | {r['max_abs_diff']:.1e} |"
        )
    return lines


if __name__ == "__main__":
    names = [n for n in (sys.argv[1:] or BACKENDS) if n in ad.available_backends()]
    print("\n".join(table(run(names))))

"""Sparse Jacobians and Hessians: ``ad.Sparse`` against dense, and against asdex and sparsejac on jax.

``python -m benchmarks.sparse`` prints the table (``--quick``: the 10^4 cases only);
``python -m benchmarks`` adds it to docs/benchmarks.md (``--no-sparse`` skips it).  Problems
(float64, :mod:`abstractdiff.testing._sparse_problems`): the 2-D Laplacian residual's
Jacobian (5-point stencil plus ``u**3``), a pentadiagonal Hessian (``banded_hessian``) at
10^4 and 10^5 unknowns, and a 2,000-unknown arrowhead Hessian.

* *abstractdiff sparse*: ``ad.prepare_jacobian(ad.Sparse(b), f, x)`` /
  ``ad.prepare_hessian``: detection (tracer arrays), coloring and planning at preparation.
* *dense*: ``ad.prepare_jacobian(b, f, x)`` / ``ad.prepare_hessian(b, f, x)`` (only where the
  dense matrix fits: 10^4 x 10^4 float64 is 800 MB).
* *asdex*: ``asdex.jacobian_coloring(f, x)`` / ``asdex.hessian_coloring(f, x)`` (its own
  jaxpr-based detection and coloring), then ``jax.jit(asdex.jacobian_from_coloring(f, c))``
  returning a BCOO matrix: the compressed products and the decompression in one compiled call.
* *sparsejac*: ``jax.jit(sparsejac.jacfwd(f, sparsity))``, given our detected pattern as a
  BCOO (sparsejac does no detection); Jacobians only.

*preparation* is the time to the first result (detection, coloring, compilation and the first
call); *call* the median of later calls to a finished result (a scipy CSR matrix for
abstractdiff, a BCOO matrix for asdex and sparsejac, ready: ``block_until_ready``).
*products* is the number of Jacobian- or Hessian-vector products per call (colors).
*max abs diff* is against abstractdiff's sparse result.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

import numpy as np

import abstractdiff as ad
from abstractdiff.testing._sparse_problems import arrowhead, banded_hessian, laplacian_residual

BACKENDS = ("torch", "jax")
#: the peers, run on jax only
PEERS = ("asdex", "sparsejac")


class Case(NamedTuple):
    problem: str
    f: Callable[..., Any]
    n: int
    kind: str  # "jacobian" or "hessian"
    dense: bool  # whether the dense matrix is computed too


CASES = (
    Case("laplacian", laplacian_residual, 100 * 100, "jacobian", True),
    Case("laplacian", laplacian_residual, 316 * 316, "jacobian", False),
    Case("banded hessian", banded_hessian, 10**4, "hessian", False),
    Case("banded hessian", banded_hessian, 10**5, "hessian", False),
    Case("arrowhead hessian", arrowhead, 2000, "hessian", True),
)


def _median_s(call: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timed(prepare: Callable[[], Callable[[], Any]], rounds: int) -> tuple[float, float, Any]:
    """``(preparation and first call s, median call s, result)``."""
    start = time.perf_counter()
    call = prepare()
    result = call()
    prepare_s = time.perf_counter() - start
    return prepare_s, _median_s(call, rounds), result


def _scipy(result: Any, shape: tuple) -> Any:
    """A scipy matrix of a scipy or BCOO result (BCOO's own todense is float32 outside x64 mode)."""
    import scipy.sparse as sp

    if sp.issparse(result):
        return result
    indices = np.asarray(result.indices)
    return sp.csr_matrix((np.asarray(result.data), (indices[:, 0], indices[:, 1])), shape=shape)


def _as_dense(result: Any, shape: tuple) -> np.ndarray:
    if isinstance(result, np.ndarray):
        return result.reshape(shape)
    return _scipy(result, shape).toarray()


def _abstractdiff(b: Any, case: Case, x: Any, rounds: int, sparse: bool) -> dict:
    prepare = getattr(ad, f"prepare_{case.kind}")
    box: dict = {}

    def build() -> Callable[[], Any]:
        op = prepare(ad.Sparse(b) if sparse else b, case.f, x)
        box["op"] = op
        return (lambda: op(x)) if sparse else (lambda: np.asarray(ad.to_numpy(op(x))))

    prepare_s, call_s, result = _timed(build, rounds if sparse else 1)
    op = box["op"]
    products = op.ncolors if sparse else case.n
    detail = f"{op.coloring}, {op.mode}" if sparse else "dense"
    return {"prepare_s": prepare_s, "call_s": call_s, "products": products, "detail": detail, "result": result}


def _asdex(case: Case, x: Any, rounds: int) -> dict:
    import asdex
    import jax

    box: dict = {}

    def build() -> Callable[[], Any]:
        if case.kind == "jacobian":
            coloring = asdex.jacobian_coloring(case.f, x)
            fn = jax.jit(asdex.jacobian_from_coloring(case.f, coloring, "bcoo"))
        else:
            coloring = asdex.hessian_coloring(case.f, x)
            fn = jax.jit(asdex.hessian_from_coloring(case.f, coloring, "bcoo"))
        box["colors"] = int(coloring.num_colors)
        box["mode"] = str(coloring.mode)
        return lambda: jax.block_until_ready(fn(x))

    with jax.enable_x64(True):  # float64, as abstractdiff's jax backend runs it (in its own scope)
        prepare_s, call_s, result = _timed(build, rounds)
    return {"prepare_s": prepare_s, "call_s": call_s, "products": box["colors"], "detail": box["mode"],
            "result": result}


def _sparsejac(case: Case, x: Any, rounds: int, pattern: Any) -> dict:
    import jax
    import jax.experimental.sparse as jsparse
    import sparsejac

    def build() -> Callable[[], Any]:
        sparsity = jsparse.BCOO.from_scipy_sparse(pattern.astype(np.float64))
        fn = jax.jit(sparsejac.jacfwd(case.f, sparsity=sparsity))
        return lambda: jax.block_until_ready(fn(x))

    with jax.enable_x64(True):
        prepare_s, call_s, result = _timed(build, rounds)
    products = int(ad.prepare_jacobian(ad.Sparse("jax", sparsity=pattern, mode="forward"), case.f, x).ncolors)
    return {"prepare_s": prepare_s, "call_s": call_s, "products": products, "detail": "forward (given pattern)",
            "result": result}


def _available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def run(names: list[str], rounds: int = 5, cases: tuple[Case, ...] = CASES) -> list[dict]:
    rows = []
    # Backends outer, and each backend's dense matrices last: one library's thread pools, and
    # the aftermath of a dense 10^4 x 10^4 build, do not slow the sparse timings (torch's sparse
    # calls measured 5-20x slower after either, on 2 cores).  The table regroups rows by case.
    for name in names:
        b = ad.backend(name)
        dense_cases = []
        for case in cases:
            x = b.asarray(np.random.default_rng(0).normal(size=case.n))
            mine = _abstractdiff(b, case, x, rounds, sparse=True)
            reference = mine["result"].toarray() if case.n <= 20000 else mine["result"]
            measured = [("abstractdiff sparse", mine)]
            if name == "jax":
                if _available("asdex"):
                    measured.append(("asdex", _asdex(case, x, rounds)))
                if _available("sparsejac") and case.kind == "jacobian":
                    pattern = ad.prepare_jacobian(ad.Sparse(b), case.f, x).sparsity
                    measured.append(("sparsejac", _sparsejac(case, x, rounds, pattern)))
            rows += [_row(case, name, method, r, reference) for method, r in measured]
            if case.dense:
                dense_cases.append((case, x, reference))
        for case, x, reference in dense_cases:
            rows.append(_row(case, name, "dense", _abstractdiff(b, case, x, rounds, sparse=False), reference))
    return rows


def _row(case: Case, backend: str, method: str, r: dict, reference: Any) -> dict:
    return {"problem": case.problem, "kind": case.kind, "n": case.n, "backend": backend, "method": method,
            "products": r["products"], "detail": r["detail"], "prepare_s": r["prepare_s"], "call_s": r["call_s"],
            "max_abs_diff": _difference(reference, r["result"])}


def _difference(reference: Any, result: Any) -> float:
    if isinstance(reference, np.ndarray):
        return float(np.max(np.abs(_as_dense(result, reference.shape) - reference)))
    diff = (reference - _scipy(result, reference.shape)).tocsr()  # too large for dense: as sparse matrices
    return float(np.max(np.abs(diff.data))) if diff.nnz else 0.0


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| problem | n | backend | method | products | coloring, mode | call (ms) | time / abstractdiff's | "
        "preparation (s) | max abs diff |",
        "|---|---:|---|---|---:|---|---:|---:|---:|---:|",
    ]
    mine = {(r["problem"], r["n"], r["backend"]): r["call_s"] for r in rows if r["method"] == "abstractdiff sparse"}
    cases = list(dict.fromkeys((r["problem"], r["n"]) for r in rows))
    for r in sorted(rows, key=lambda r: cases.index((r["problem"], r["n"]))):  # stable: backends in run order
        ratio = r["call_s"] / mine[(r["problem"], r["n"], r["backend"])]
        lines.append(
            f"| {r['problem']} {r['kind']} | {r['n']} | {r['backend']} | {r['method']} | {r['products']} | "
            f"{r['detail']} | {1e3 * r['call_s']:.2f} | {ratio:.2f}x | {r['prepare_s']:.2f} | "
            f"{r['max_abs_diff']:.1e} |"
        )
    return lines


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    names = [n for n in (a for a in sys.argv[1:] if not a.startswith("--")) if n in ad.available_backends()] \
        or [n for n in BACKENDS if n in ad.available_backends()]
    print("\n".join(table(run(names, cases=tuple(c for c in CASES if not quick or c.n <= 10**4)))))

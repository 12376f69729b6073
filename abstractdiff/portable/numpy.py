"""numpy's translations (docs/guide/portable.md): the two short names numpy lacks that the
portable-functions table offers on every backend, ``logsumexp`` and ``linalg.solve_triangular``,
with scipy's semantics.  Every backend meets numpy arrays in ``f``'s data (the
finite-differences backend's and autograd's unboxed ones), so creating any backend applies
this table.  Only names numpy lacks: numpy's own functions are never replaced.  scipy is
imported on first call only: the finite-differences backend needs numpy alone.
"""

from __future__ import annotations

from typing import Any

from . import Table


def logsumexp(a: Any, axis: Any = None, b: Any = None, keepdims: bool = False, return_sign: bool = False) -> Any:
    import scipy.special

    return scipy.special.logsumexp(a, axis=axis, b=b, keepdims=keepdims, return_sign=return_sign)


def solve_triangular(a: Any, b: Any, trans: Any = 0, lower: bool = False, unit_diagonal: bool = False,
                     overwrite_b: bool = False, check_finite: bool = True) -> Any:
    import scipy.linalg

    return scipy.linalg.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit_diagonal,
                                         overwrite_b=overwrite_b, check_finite=check_finite)


def translations() -> Table:
    return Table("numpy", functions={"logsumexp": logsumexp, "linalg.solve_triangular": solve_triangular})

"""jax's translations of numpy/scipy calls (docs/guide/portable.md): the names ``jax.numpy``
lacks, taken from ``jax.scipy`` with numpy's/scipy's arguments (scipy's ``overwrite_b`` and
``check_finite`` mean nothing to immutable, traced arrays and are dropped).
"""

from __future__ import annotations

from . import Table


def translations() -> Table:
    import jax.scipy.linalg  # imported here: importing this module imports nothing heavy
    import jax.scipy.special

    def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
        return jax.scipy.special.logsumexp(a, axis=axis, b=b, keepdims=keepdims, return_sign=return_sign)

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        return jax.scipy.linalg.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit_diagonal)

    return Table("jax", functions={"logsumexp": logsumexp, "linalg.solve_triangular": solve_triangular})

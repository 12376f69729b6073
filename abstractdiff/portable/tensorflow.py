"""TensorFlow's translations of numpy/scipy calls (docs/guide/portable.md): the names
``tf.experimental.numpy`` lacks or takes differently.

Each takes numpy's/scipy's arguments and is built from differentiable TensorFlow ops that
keep the dtype; none needs autograph, so each is marked to be called as it is inside a
``tf.function`` (autograph would otherwise rewrite its source).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import Table


def translations() -> Table:
    import tensorflow as tf  # imported here: importing this module imports nothing heavy

    def like(value: Any, ref: Any) -> Any:
        return value if isinstance(value, tf.Tensor | tf.Variable) else tf.convert_to_tensor(value, dtype=ref.dtype)

    def logsumexp(a, axis=None, keepdims=False):
        return tf.math.reduce_logsumexp(a, axis=axis, keepdims=keepdims)

    def log_softmax(x, axis=None):
        return x - logsumexp(x, axis=axis, keepdims=True)

    def softmax(x, axis=None):
        return tf.exp(log_softmax(x, axis=axis))

    def moment(sqrt: bool) -> Callable:
        # tf.experimental.numpy's var/std fail on ddof=
        def numpy_like(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
            if dtype is not None or out is not None:
                raise NotImplementedError("dtype= and out= are not supported on TensorFlow tensors")
            mean = tf.reduce_mean(a, axis=axis, keepdims=True)
            n = tf.cast(tf.size(a) // tf.size(mean), a.dtype)
            var = tf.reduce_sum(tf.square(a - mean), axis=axis, keepdims=keepdims) / (n - ddof)
            return tf.sqrt(var) if sqrt else var

        return numpy_like

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        if unit_diagonal:
            a = tf.linalg.set_diag(a, tf.ones_like(tf.linalg.diag_part(a)))
        vector = b.shape.rank == 1  # scipy takes a vector right-hand side, TensorFlow a matrix
        x = tf.linalg.triangular_solve(a, b[..., None] if vector else b, lower=lower,
                                       adjoint=trans in (1, 2, "T", "C"))
        return x[..., 0] if vector else x

    def unary(op: Callable) -> Callable:
        def numpy_like(x):
            return op(x)

        return numpy_like

    def logit(x):
        return tf.math.log(x) - tf.math.log1p(-x)

    def pad(array, pad_width, mode="constant", constant_values=0):
        # numpy's width forms (an int, one pair for every axis, a pair per axis); tf.pad takes the last
        widths = np.broadcast_to(np.asarray(pad_width, dtype=np.int64).reshape(-1, 2)
                                 if np.ndim(pad_width) else np.asarray(pad_width), (len(array.shape), 2))
        return tf.pad(array, widths, mode=mode.upper(), constant_values=constant_values)

    def xlogy(x, y):
        return tf.math.xlogy(x, like(y, x))

    functions = {
        "logsumexp": logsumexp,
        "scipy.special.logsumexp": logsumexp,
        "std": moment(True),
        "var": moment(False),
        "linalg.solve_triangular": solve_triangular,
        "scipy.linalg.solve_triangular": solve_triangular,
        "scipy.special.erf": unary(tf.math.erf),
        "scipy.special.erfc": unary(tf.math.erfc),
        "scipy.special.expit": unary(tf.math.sigmoid),
        "scipy.special.logit": logit,
        "scipy.special.gammaln": unary(tf.math.lgamma),
        "scipy.special.digamma": unary(tf.math.digamma),
        "scipy.special.xlogy": xlogy,
        "scipy.special.softmax": softmax,
        "scipy.special.log_softmax": log_softmax,
        "pad": pad,
    }
    for fn in functions.values():
        # what tf.autograph.experimental.do_not_convert sets: autograph calls them as they are
        fn.autograph_info__ = frozenset()
    return Table("tensorflow", functions=functions)

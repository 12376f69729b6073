"""autograd's translations of numpy/scipy calls (docs/guide/portable.md): the calls autograd
lacks, or has without a derivative, each taking numpy's/scipy's arguments and built from
``autograd.numpy``/``autograd.scipy`` ops (or an autograd primitive with its VJP), so
autograd differentiates it.

f also sees plain numpy arrays (its data, which autograd does not box): numpy's short names
(``logsumexp``, ``linalg.solve_triangular``) come from the numpy table, applied for every
backend.  ``where`` is the one call whose library autoray picks wrongly (see
:func:`translations`): the table routes it with a dispatcher, and numpy's own ``where``
stays numpy's.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import Table


def translations() -> Table:
    import autograd.extend  # imported here: importing this module imports nothing heavy
    import autograd.numpy as anp
    import autograd.scipy.linalg
    import autograd.scipy.special
    from autograd.extend import defvjp, primitive
    from autograd.tracer import Box, getval
    from autoray.autoray import default_dispatcher

    special = autograd.scipy.special

    def logsumexp(a, axis=None, b=None, keepdims=False, return_sign=False):
        if return_sign:
            raise NotImplementedError("logsumexp(return_sign=True) is not differentiable by autograd")
        if b is None:
            return special.logsumexp(a, axis=axis, keepdims=keepdims)
        return special.logsumexp(a, axis=axis, b=b, keepdims=keepdims)

    def log_softmax(x, axis=None):
        return x - logsumexp(x, axis=axis, keepdims=True)

    def softmax(x, axis=None):
        return anp.exp(log_softmax(x, axis=axis))

    def xlogy(x, y):
        zero = x == 0
        return anp.where(zero, 0.0, x * anp.log(anp.where(zero, 1.0, y)))

    def unary(op: Callable) -> Callable:
        def numpy_like(x):
            return op(x)

        return numpy_like

    def solve_triangular(a, b, trans=0, lower=False, unit_diagonal=False, overwrite_b=False, check_finite=True):
        return autograd.scipy.linalg.solve_triangular(a, b, trans=trans, lower=lower, unit_diagonal=unit_diagonal)

    def take_along_axis(arr, indices, axis):
        # fancy indexing (differentiable), as numpy builds it: arange over arr's other axes
        if axis is None:
            arr, axis = anp.ravel(arr), 0
        indices = getval(indices)
        ndim = anp.ndim(arr)
        axis = axis % ndim
        index = []
        for d, n in enumerate(anp.shape(arr)):
            if d == axis:
                index.append(indices)
            else:
                index.append(np.arange(n).reshape([n if k == d else 1 for k in range(ndim)]))
        return arr[tuple(index)]

    def sort(a, axis=-1, kind=None, order=None):
        # autograd's sort has a gradient for vectors only
        if axis is None:
            a, axis = anp.ravel(a), 0
        return take_along_axis(a, np.argsort(getval(a), axis=axis, kind=kind), axis)

    def cumprod(a, axis=None, dtype=None, out=None):
        # no VJP for cumprod in autograd: running products, which it differentiates
        if dtype is not None or out is not None:
            raise NotImplementedError("dtype= and out= are not supported by autograd")
        if axis is None:
            a, axis = anp.ravel(a), 0
        moved = anp.moveaxis(a, axis, 0)
        if anp.shape(moved)[0] == 0:
            return a
        rows = [moved[0]]
        for k in range(1, anp.shape(moved)[0]):
            rows.append(rows[-1] * moved[k])
        return anp.moveaxis(anp.stack(rows), 0, axis)

    def flip(m, axis=None):
        # no VJP for flip in autograd: reversed slices
        ndim = anp.ndim(m)
        axes = range(ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
        index = [slice(None)] * ndim
        for ax in axes:
            index[ax % ndim] = slice(None, None, -1)
        return m[tuple(index)]

    def diagonal(a, offset=0, axis1=0, axis2=1):
        # autograd's VJP of diagonal takes offset=0 on the last two axes only
        moved = anp.moveaxis(a, (axis1, axis2), (-2, -1))
        n, m = anp.shape(moved)[-2:]
        rows = np.arange(max(0, -offset), max(0, min(n, m - offset)))
        return moved[..., rows, rows + offset]

    def pad(array, pad_width, mode="constant", **kwargs):
        # autograd's VJP of pad needs mode passed explicitly (it has no default there)
        return anp.pad(array, pad_width, mode, **kwargs)

    # numpy.copy has no derivative in autograd: a primitive with the identity's, to every order
    copied = autograd.extend.primitive(lambda a: np.array(a, copy=True))
    autograd.extend.defvjp(copied, lambda ans, a: lambda g: g)
    autograd.extend.defjvp(copied, lambda g, ans, a: g)

    def copy(a):
        return copied(a)

    def broadcast_to(array, shape):
        # autograd's VJP of broadcast_to cannot add leading axes: add them first
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        lead = len(shape) - anp.ndim(array)
        return anp.broadcast_to(anp.reshape(array, (1,) * lead + anp.shape(array)), shape)

    def eigvalsh(a, UPLO="L"):
        return anp.linalg.eigh(a, UPLO)[0]

    @primitive
    def qr_primitive(a, mode):
        q, r = np.linalg.qr(a, mode)
        return q, r

    def qr_vjp(ans, a, mode):
        q, r = ans
        m, n = anp.shape(a)[-2:]

        def transpose(x):
            return anp.swapaxes(x, -1, -2)

        def times_inverse_rt(x):  # x @ inv(r).T
            return transpose(anp.linalg.solve(r, transpose(x)))

        def vjp(g):
            # TensorFlow's QrGrad (m >= n, reduced R): Liao et al., arXiv:1903.09650, eq. (5)
            if m < n or (mode == "complete" and m != n):
                raise NotImplementedError("the derivative of qr needs rows >= columns and mode='reduced'")
            dq, dr = g
            qdq = transpose(q) @ dq
            rdr = r @ transpose(dr)
            lower = anp.tril(qdq - transpose(qdq) + rdr - transpose(rdr))
            return q @ (dr + times_inverse_rt(lower)) + times_inverse_rt(dq - q @ qdq)

        return vjp

    defvjp(qr_primitive, qr_vjp)

    def qr(a, mode="reduced"):
        # autograd has no derivative for qr: a primitive with one, for the (Q, R) modes
        if mode in ("reduced", "complete"):
            return qr_primitive(a, mode)
        return anp.linalg.qr(a, mode)

    # Comparisons of autograd's boxes give plain numpy arrays, so autoray, which picks the
    # library of the first argument, sends where(x > 0, x, y) to numpy's where: that makes
    # an object array of boxes (no float dtype; exp() of it fails).  The dispatcher sends a
    # call with a traced value among its arguments to autograd instead; every other call
    # goes where autoray's default sends it, so numpy's where (and every other library's)
    # is untouched.
    def where_dispatcher(*args: Any, **kwargs: Any) -> str:
        if any(isinstance(a, Box) for a in args):
            return "autograd"
        return default_dispatcher(args, kwargs)

    def where(condition, *args, **kwargs):
        # autograd.numpy.where differentiates with respect to the values, given any mask
        return anp.where(condition, *args, **kwargs)

    functions = {
        "logsumexp": logsumexp,
        "scipy.special.logsumexp": logsumexp,
        "scipy.special.erf": unary(special.erf),
        "scipy.special.erfc": unary(special.erfc),
        "scipy.special.expit": unary(special.expit),
        "scipy.special.logit": unary(special.logit),
        "scipy.special.gammaln": unary(special.gammaln),
        "scipy.special.digamma": unary(special.digamma),
        "scipy.special.xlogy": xlogy,
        "scipy.special.softmax": softmax,
        "scipy.special.log_softmax": log_softmax,
        "linalg.solve_triangular": solve_triangular,
        "scipy.linalg.solve_triangular": solve_triangular,
        "linalg.eigvalsh": eigvalsh,
        "linalg.qr": qr,
        "take_along_axis": take_along_axis,
        "sort": sort,
        "cumprod": cumprod,
        "flip": flip,
        "diagonal": diagonal,
        "pad": pad,
        "copy": copy,
        "broadcast_to": broadcast_to,
        "where": where,
    }
    return Table("autograd", functions=functions, dispatch={"where": where_dispatcher})

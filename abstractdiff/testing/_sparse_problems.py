"""Sparse problems for ``ad.Sparse``: written once with ``autoray.numpy``, so every backend
runs the same code and the sparsity detector traces its numpy version.

Each problem is ``(f, x, kind)``: ``kind`` is ``"jacobian"`` or ``"hessian"``; ``x`` is a
float64 numpy vector (convert it with the backend).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from ..core import shape_of


class SparseProblem(NamedTuple):
    name: str
    f: Callable[..., Any]
    x: np.ndarray
    kind: str  # "jacobian" or "hessian"


def _anp() -> Any:
    from autoray import numpy as anp

    return anp


def tridiagonal(x: Any) -> Any:
    """``f(x)_i = x_{i-1} - 2 x_i + x_{i+1} + sin(x_i)`` (zero outside)."""
    anp = _anp()
    zero = anp.zeros_like(x[:1])  # like=x below: autograd's zeros_like is a plain numpy array
    return anp.concatenate([zero, x[:-1]], like=x) - 2 * x + anp.concatenate([x[1:], zero], like=x) + anp.sin(x)


def laplacian_residual(u: Any) -> Any:
    """The 5-point Laplacian of ``u`` on a ``k x k`` grid (zero boundary) plus ``u**3``, raveled."""
    anp = _anp()
    k = int(round(shape_of(u)[0] ** 0.5))  # the static shape (PyTensor's u.shape is symbolic)
    g = anp.reshape(u, (k, k))
    row, col = anp.zeros_like(g[:1]), anp.zeros_like(g[:, :1])
    up = anp.concatenate([row, g[:-1]], axis=0, like=g)
    down = anp.concatenate([g[1:], row], axis=0, like=g)
    left = anp.concatenate([col, g[:, :-1]], axis=1, like=g)
    right = anp.concatenate([g[:, 1:], col], axis=1, like=g)
    return anp.reshape(4 * g - up - down - left - right + g**3, (k * k,))


def arrowhead(x: Any) -> Any:
    """``sum_i (x_0 x_i)^2 + sum_i sin(x_i)``: an arrowhead Hessian."""
    anp = _anp()
    return anp.sum((x[0] * x[1:]) ** 2) + anp.sum(anp.sin(x))


def banded_hessian(x: Any) -> Any:
    """``sum_i (x_{i+1} - x_i^2)^2 + (x_{i+2} x_i)^2 / 4``: a pentadiagonal Hessian (band 2)."""
    anp = _anp()
    return anp.sum((x[1:] - x[:-1] ** 2) ** 2) + anp.sum((x[2:] * x[:-2]) ** 2) / 4


def tridiagonal_hessian(x: Any) -> Any:
    """``sum_i (x_{i+1} - x_i^2)^2 + cos(x_i)``: a tridiagonal Hessian (Rosenbrock-like)."""
    anp = _anp()
    return anp.sum((x[1:] - x[:-1] ** 2) ** 2) + anp.sum(anp.cos(x))


def block_diagonal_hessian(x: Any, block: int = 5) -> Any:
    """``sum_b (sum of block b)^2 sin(first of block b)``: dense ``block x block`` diagonal
    blocks (``x.size`` a multiple of ``block``)."""
    anp = _anp()
    g = anp.reshape(x, (shape_of(x)[0] // block, block))
    return anp.sum(anp.sum(g, axis=1) ** 2 * anp.sin(g[:, 0]))


def arrowhead_jacobian(x: Any) -> Any:
    """``f_0 = sum x^2``, ``f_i = x_0 x_i + sin(x_i)``: a dense first row and a dense first
    column (``n`` colors for columns or rows alone, a few bidirectionally)."""
    anp = _anp()
    head = anp.reshape(anp.sum(x * x), (1,))
    return anp.concatenate([head, x[0] * x[1:] + anp.sin(x[1:])], like=x)


def bordered_banded_jacobian(x: Any) -> Any:
    """A tridiagonal residual with a dense last row and a dense last column (a bordered
    band: a coupling constraint and a shared parameter)."""
    anp = _anp()
    core = tridiagonal(x[:-1]) * x[-1]
    border = anp.reshape(anp.sum(anp.sin(x)), (1,))
    return anp.concatenate([core, border], like=x)


# ---------------------------------------------------------------- bundle adjustment
#: A small instance: 3 cameras (11 parameters each), 10 points (3 each), 20 observations.
BA_CAMERAS, BA_POINTS, BA_OBSERVATIONS = 3, 10, 20
_RNG = np.random.default_rng(0)
BA_CAMERA_OF = np.arange(BA_OBSERVATIONS) % BA_CAMERAS
BA_POINT_OF = np.arange(BA_OBSERVATIONS) % BA_POINTS
BA_FEATURES = _RNG.normal(size=(BA_OBSERVATIONS, 2))


def _cross(a: Any, b: Any) -> Any:
    anp = _anp()
    return anp.stack([
        a[:, 1] * b[:, 2] - a[:, 2] * b[:, 1],
        a[:, 2] * b[:, 0] - a[:, 0] * b[:, 2],
        a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0],
    ], axis=1)


def bundle_adjustment(x: Any) -> Any:
    """ADBench's BA reprojection residual (Rodrigues rotation, camera centre, focal length,
    principal point, two radial distortion terms), ``2 * observations`` values: each depends
    on one camera's 11 parameters and one point's 3."""
    anp = _anp()
    cams = anp.reshape(x[: BA_CAMERAS * 11], (BA_CAMERAS, 11))
    pts = anp.reshape(x[BA_CAMERAS * 11 :], (BA_POINTS, 3))
    cam = anp.take(cams, anp.asarray(BA_CAMERA_OF, like=x), axis=0)
    p = anp.take(pts, anp.asarray(BA_POINT_OF, like=x), axis=0) - cam[:, 3:6]
    w = cam[:, 0:3]
    theta = anp.sqrt(anp.sum(w * w, axis=1, keepdims=True))
    axis = w / theta
    cos, sin = anp.cos(theta), anp.sin(theta)
    dot = anp.sum(axis * p, axis=1, keepdims=True)
    rotated = p * cos + _cross(axis, p) * sin + axis * dot * (1 - cos)
    proj = rotated[:, 0:2] / rotated[:, 2:3]
    rsq = anp.sum(proj * proj, axis=1, keepdims=True)
    distortion = 1 + cam[:, 9:10] * rsq + cam[:, 10:11] * rsq * rsq
    features = anp.asarray(BA_FEATURES, like=x)  # a numpy constant, in x's library
    out = proj * distortion * cam[:, 6:7] + cam[:, 7:9] - features
    return anp.reshape(out, (2 * BA_OBSERVATIONS,))


def _ba_point() -> np.ndarray:
    rng = np.random.default_rng(1)
    cams = np.zeros((BA_CAMERAS, 11))
    cams[:, 0:3] = rng.normal(scale=0.3, size=(BA_CAMERAS, 3))
    cams[:, 3:6] = rng.normal(scale=0.1, size=(BA_CAMERAS, 3)) + np.array([0.0, 0.0, -5.0])
    cams[:, 6] = 1.0 + rng.uniform(size=BA_CAMERAS)
    cams[:, 7:9] = rng.normal(scale=0.1, size=(BA_CAMERAS, 2))
    cams[:, 9:11] = rng.normal(scale=0.01, size=(BA_CAMERAS, 2))
    pts = rng.normal(size=(BA_POINTS, 3))
    return np.concatenate([cams.ravel(), pts.ravel()])


def coloring_problems(n: int = 40) -> list[SparseProblem]:
    """The problems of the symmetric and bidirectional colorings: arrowhead, tridiagonal,
    banded and block-diagonal Hessians; arrowhead, bordered-banded and bundle-adjustment
    Jacobians (``n`` unknowns where the size is free; ``n`` a multiple of 5)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=n)
    return [
        SparseProblem("arrowhead_hessian", arrowhead, x, "hessian"),
        SparseProblem("tridiagonal_hessian", tridiagonal_hessian, x, "hessian"),
        SparseProblem("banded_hessian", banded_hessian, x, "hessian"),
        SparseProblem("block_diagonal_hessian", block_diagonal_hessian, x, "hessian"),
        SparseProblem("arrowhead_jacobian", arrowhead_jacobian, x, "jacobian"),
        SparseProblem("bordered_banded_jacobian", bordered_banded_jacobian, x, "jacobian"),
        SparseProblem("bundle_adjustment", bundle_adjustment, _ba_point(), "jacobian"),
    ]


def sparse_problems(grid: int = 6) -> list[SparseProblem]:
    """The four problems: tridiagonal (n=50), 2-D Laplacian residual (``grid x grid``),
    bundle adjustment (3 cameras, 10 points, 20 observations), arrowhead Hessian (n=50)."""
    rng = np.random.default_rng(2)
    return [
        SparseProblem("tridiagonal", tridiagonal, rng.normal(size=50), "jacobian"),
        SparseProblem("laplacian", laplacian_residual, rng.normal(size=grid * grid), "jacobian"),
        SparseProblem("bundle_adjustment", bundle_adjustment, _ba_point(), "jacobian"),
        SparseProblem("arrowhead", arrowhead, rng.normal(size=50), "hessian"),
    ]

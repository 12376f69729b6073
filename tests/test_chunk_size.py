"""``chunk_size`` is honoured by every backend: a 100-row Jacobian costs ``ceil(100 / chunk_size)``
batched primitive calls.

A batched primitive call is one call of the closure returned by the backend's
``flat_value_and_batched_pullback`` (or ``..._pushforward``): the core's derived Jacobian
(``DerivedOperators.flat_jacobian``) makes one per chunk of basis vectors.  The hooks are
wrapped on the backend instance only.  ``f(x) = tanh(W x)`` maps R^100 to R^100, so every
backend picks reverse mode (one batched pullback per chunk of output rows); its Jacobian is
checked against the analytic ``diag(1 - tanh(W x)^2) W`` for every chunk size.

With ``chunk_size=None`` a backend makes its own choice: the core's default chunks
(``DEFAULT_CHUNK_SIZE``: 100 rows are 2 chunks of 50), or, where the library builds the whole
Jacobian in one vectorised call of its own (``jax.jacrev``, ``tf``'s ``jacobian``,
``torch.func.jacrev``, ``mx.vmap``, PyTensor's graph), no call of the core's hook at all.
"""

from __future__ import annotations

import math
from pathlib import Path

import autoray
import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._hooks import DEFAULT_CHUNK_SIZE

from .test_batch import CallCounter  # counts calls of the closures the batched hooks return

N = 100
BUILT_IN = ("finite_differences", "autograd", "jax", "tensorflow", "torch", "mlx", "paddle", "pytensor")
#: backends that, with chunk_size=None, build the whole Jacobian with one call of the library's own
NATIVE_WHEN_NONE = ("jax", "tensorflow", "torch", "mlx", "pytensor")
OUTOFTREE = Path(__file__).parent / "outoftree"

RNG = np.random.default_rng(25)
W = RNG.normal(size=(N, N)) / math.sqrt(N)
X = RNG.normal(size=N)


def f(x, w):
    return autoray.do("tanh", autoray.do("matmul", w, x))


def analytic_jacobian() -> np.ndarray:
    return (1 - np.tanh(W @ X) ** 2)[:, None] * W


def make_backend(name: str, chunk_size: int | None, monkeypatch, request) -> ad.Backend:
    if name == "minitape":
        pytest.importorskip("optree")
        monkeypatch.syspath_prepend(str(OUTOFTREE))
        from abstractdiff_minitape import MinitapeBackend

        # its constructor takes no chunk_size: ad.backend sets the core's option itself
        request.getfixturevalue("clean_registry")
        ad.register_backend("minitape", MinitapeBackend, replace=True)
        return ad.backend("minitape", chunk_size=chunk_size)
    if name not in ad.available_backends():
        pytest.skip(f"{name} is not installed")
    return ad.backend(name, chunk_size=chunk_size)


def as_numpy(a) -> np.ndarray:
    return np.asarray(a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) else a)


def tolerance(name: str, j: np.ndarray) -> float:
    if name == "finite_differences":
        return 1e-6
    return 1e-5 if j.dtype == np.float32 else 1e-10


def expected_calls(name: str, chunk_size: int | None) -> int:
    if chunk_size is None:
        return 0 if name in NATIVE_WHEN_NONE else math.ceil(N / DEFAULT_CHUNK_SIZE)
    return math.ceil(N / chunk_size)


@pytest.mark.parametrize("chunk_size", [1, 7, None], ids=["chunk1", "chunk7", "none"])
@pytest.mark.parametrize("name", (*BUILT_IN, "minitape"))
def test_a_jacobian_costs_one_batched_call_per_chunk(request, monkeypatch, name, chunk_size):
    b = make_backend(name, chunk_size, monkeypatch, request)
    counter = CallCounter(monkeypatch, b)
    j = as_numpy(ad.jacobian(b, f, X, W))
    assert j.shape == (N, N)
    tol = tolerance(name, j)
    np.testing.assert_allclose(j, analytic_jacobian(), rtol=tol, atol=tol)
    assert counter.calls == expected_calls(name, chunk_size)


@pytest.mark.parametrize("name", ("autograd", "mlx", "paddle"))
def test_a_chunked_hessian_costs_one_batched_call_per_chunk(monkeypatch, name):
    """The Hessian, the Jacobian of the gradient, follows chunk_size too: the core's chunks
    when it is given, the library's own rows (no call of the core's hook) when it is None."""
    if name not in ad.available_backends():
        pytest.skip(f"{name} is not installed")
    x = RNG.normal(size=5)

    def g(x):
        return autoray.do("sum", autoray.do("sin", x)) * autoray.do("sum", x**2)

    s, q = np.sum(np.sin(x)), np.sum(x**2)
    want = -np.diag(np.sin(x)) * q + 2 * (np.outer(np.cos(x), x) + np.outer(x, np.cos(x))) + 2 * s * np.eye(5)
    for chunk_size, calls in ((2, 3), (None, 0)):
        b = ad.backend(name, chunk_size=chunk_size)
        counter = CallCounter(monkeypatch, b)
        h = as_numpy(ad.hessian(b, g, x))
        tol = tolerance(name, h)
        np.testing.assert_allclose(h, want, rtol=tol, atol=tol)
        assert counter.calls == calls



def test_the_core_owns_chunk_size_for_an_adapter_that_does_not_take_it(clean_registry, monkeypatch):
    """A third-party constructor without the option still gets it, checked by the core, and two
    chunk sizes are two backends (their compiled artefacts differ)."""
    monkeypatch.syspath_prepend(str(OUTOFTREE))
    pytest.importorskip("optree")
    from abstractdiff_minitape import MinitapeBackend

    ad.register_backend("minitape", MinitapeBackend, replace=True)
    seven = ad.backend("minitape", chunk_size=7)
    assert seven.chunk_size == 7 and seven.options["chunk_size"] == 7
    assert ad.backend("minitape").chunk_size is None
    assert seven != ad.backend("minitape") and seven.cache_key != ad.backend("minitape").cache_key
    for bad in (0, -1, 2.5, True, "7"):
        with pytest.raises(ad.InvalidArgumentError, match="chunk_size must be a positive int"):
            ad.backend("minitape", chunk_size=bad)

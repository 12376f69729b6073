"""ad.Batch: batched pushforwards and pullbacks, and the chunked Jacobian built on them.

Each batched result must equal the loop of single calls (float64: to 1e-12 for exact
backends); the counting tests check that a derived Jacobian costs one batched call per
chunk of basis vectors, ``ceil(n / chunk_size)``, on the vectorising adapters.
"""

from __future__ import annotations

import math

import autoray
import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff._derived import DerivedOperators

EXACT = ("torch", "jax", "tensorflow", "autograd")
LOOPED = ("mlx", "paddle", "pytensor")  # the core's default loop over the batch
VECTORISED = ("jax", "torch", "tensorflow")


def backend_or_skip(name: str, **options) -> ad.Backend:
    if name not in ad.available_backends():
        pytest.skip(f"{name} is not installed")
    return ad.backend(name, **options)


def tol(b: ad.Backend) -> float:
    return 1e-6 if b.approximate else 1e-12


def np_(a) -> np.ndarray:
    return np.asarray(ad.to_numpy(a))


def f_array(x):
    return autoray.do("sin", x) * autoray.do("sum", x**2) + x**3


def f_tree(t):
    return t["a"] * autoray.do("sum", t["b"]) + autoray.do("sum", t["a"] ** 2)


RNG = np.random.default_rng(0)
X = RNG.normal(size=4)
TREE = {"a": RNG.normal(size=3), "b": RNG.normal(size=(2, 2))}
TANGENTS = [RNG.normal(size=4) for _ in range(3)]
TREE_TANGENTS = [{"a": RNG.normal(size=3), "b": RNG.normal(size=(2, 2))} for _ in range(3)]
COTANGENTS = [RNG.normal(size=4) for _ in range(3)]
TREE_COTANGENTS = [RNG.normal(size=3) for _ in range(3)]

CASES = {"array": (f_array, X, TANGENTS, COTANGENTS), "tree": (f_tree, TREE, TREE_TANGENTS, TREE_COTANGENTS)}


def assert_same(batch, singles, atol: float) -> None:
    assert isinstance(batch, ad.Batch) and len(batch) == len(singles)
    for member, single in zip(batch, singles):
        got, want = (dict(member), dict(single)) if isinstance(single, dict) else ({0: member}, {0: single})
        for key in want:
            np.testing.assert_allclose(np_(got[key]), np_(want[key]), rtol=atol, atol=atol)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("name", ("finite_differences", *EXACT, *LOOPED))
def test_batched_pushforward_equals_the_loop(name, prepared, case):
    b = backend_or_skip(name)
    f, x, tangents, _ = CASES[case]
    jvp = ad.prepare_pushforward(b, f, x)(x) if prepared else ad.pushforward(b, f, x)
    assert_same(jvp(ad.Batch(*tangents)), [jvp(t) for t in tangents], tol(b))
    _, jvp2 = ad.value_and_pushforward(b, f, x)
    stacked = {k: np.stack([t[k] for t in tangents]) for k in tangents[0]} if case == "tree" else np.stack(tangents)
    assert_same(jvp2(ad.Batch.stacked(stacked)), [jvp(t) for t in tangents], tol(b))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
@pytest.mark.parametrize("name", ("finite_differences", *EXACT, *LOOPED))
def test_batched_pullback_equals_the_loop(name, prepared, case):
    b = backend_or_skip(name)
    f, x, _, cotangents = CASES[case]
    vjp = ad.prepare_value_and_pullback(b, f, x)(x)[1] if prepared else ad.pullback(b, f, x)
    assert_same(vjp(ad.Batch(*cotangents)), [vjp(dy) for dy in cotangents], tol(b))
    _, vjp2 = ad.value_and_pullback(b, f, x)
    assert_same(vjp2(ad.Batch.stacked(np.stack(cotangents))), [vjp(dy) for dy in cotangents], tol(b))


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 100])
@pytest.mark.parametrize("name", ("finite_differences", *EXACT, *LOOPED))
def test_chunked_jacobian_matches(name, chunk_size):
    b = backend_or_skip(name, chunk_size=chunk_size)
    x = RNG.normal(size=7)
    want = np_(ad.jacobian(backend_or_skip(name), f_array, x))
    np.testing.assert_allclose(np_(ad.jacobian(b, f_array, x)), want, rtol=tol(b), atol=tol(b))
    # the core's derivation itself, reverse (square J) and forward (tall J) alike
    fn, xs, data = b.flatten(f_array, x, ())
    _, (j,) = DerivedOperators.flat_jacobian(b, fn, xs, data)
    np.testing.assert_allclose(np_(j), want, rtol=tol(b), atol=tol(b))


def test_chunked_jacobian_of_a_tree_and_a_tall_output(fd):
    b = ad.backend("finite_differences", chunk_size=2)
    tree = {"a": np.array([1.0, 2.0]), "b": np.array([[0.5]])}

    def tall(t):
        return autoray.do("concatenate", [t["a"] * t["b"][0, 0], t["a"] ** 2, t["b"][0]])

    j, ref = ad.jacobian(b, tall, tree), ad.jacobian(fd, tall, tree)
    for k in ref:
        np.testing.assert_allclose(j[k], ref[k], atol=1e-8)
    assert j["b"].shape == (5, 1, 1)


# ------------------------------------------------------------------ counting
class CallCounter:
    """Wraps a backend's batched hooks and counts calls of the closures they return."""

    def __init__(self, monkeypatch, b: ad.Backend):
        self.calls = 0
        for hook in ("flat_value_and_batched_pushforward", "flat_value_and_batched_pullback"):
            original = getattr(b, hook)
            monkeypatch.setattr(b, hook, self.wrap(original))

    def wrap(self, hook):
        def counted_hook(fn, xs, data):
            y, aux, batched = hook(fn, xs, data)

            def counted(*args):
                self.calls += 1
                return batched(*args)

            return y, aux, counted

        return counted_hook


@pytest.mark.parametrize("n_in, n_out", [(10, 3), (3, 10)], ids=["reverse", "forward"])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 64])
@pytest.mark.parametrize("name", VECTORISED)
def test_a_derived_jacobian_is_one_batched_call_per_chunk(monkeypatch, name, chunk_size, n_in, n_out):
    b = backend_or_skip(name, chunk_size=chunk_size)
    w = RNG.normal(size=(n_out, n_in))

    def f(x, w):
        return autoray.do("tanh", autoray.do("matmul", w, x))

    counter = CallCounter(monkeypatch, b)
    fn, xs, data = b.flatten(f, RNG.normal(size=n_in), (w,))
    _, (j,) = DerivedOperators.flat_jacobian(b, fn, xs, data)  # the core's route, whatever the adapter's
    assert np_(j).shape == (n_out, n_in)
    assert counter.calls == math.ceil(min(n_in, n_out) / chunk_size)
    if name != "torch":  # torch's own jacrev takes chunk_size itself (below); jax and TensorFlow derive
        counter.calls = 0
        np.testing.assert_allclose(np_(ad.jacobian(b, f, RNG.normal(size=n_in), w)).shape, (n_out, n_in))
        assert counter.calls == math.ceil(min(n_in, n_out) / chunk_size)


def test_torch_chunks_are_the_cores(monkeypatch):
    # with chunk_size, torch's Jacobian is the core's chunks (counted in tests/test_chunk_size.py),
    # not torch.func.jacrev's own chunking
    torch = pytest.importorskip("torch")
    b = backend_or_skip("torch", chunk_size=3)
    seen = []
    jacrev = torch.func.jacrev
    monkeypatch.setattr(torch.func, "jacrev", lambda *a, **k: seen.append(k.get("chunk_size")) or jacrev(*a, **k))
    j = ad.jacobian(b, lambda x: x[:2] * autoray.do("sum", x), np.ones(5))
    assert all(c is None for c in seen) and np_(j).shape == (2, 5)  # built at preparation, not used
    want = np.array([[6, 1, 1, 1, 1], [1, 6, 1, 1, 1]], dtype=float)  # sum(x) + x_i on the diagonal
    np.testing.assert_allclose(np_(j), want)


def test_torch_vmaps_once_per_chunk(monkeypatch):
    torch = pytest.importorskip("torch")
    b = backend_or_skip("torch", chunk_size=4)
    calls = []
    vmap = torch.func.vmap
    monkeypatch.setattr(torch.func, "vmap", lambda *a, **k: calls.append(1) or vmap(*a, **k))
    def f(x):
        return x * autoray.do("sum", x)

    fn, xs, data = b.flatten(f, np.ones(10), ())
    DerivedOperators.flat_jacobian(b, fn, xs, data)
    assert len(calls) == 3


def test_uncompiled_jax_vmaps_once_per_chunk(monkeypatch):
    jax = pytest.importorskip("jax")
    b = backend_or_skip("jax", chunk_size=4, compile=False)
    calls = []
    vmap = jax.vmap
    monkeypatch.setattr(jax, "vmap", lambda *a, **k: calls.append(1) or vmap(*a, **k))
    j = ad.jacobian(b, lambda x: x * autoray.do("sum", x), np.ones(10))
    assert len(calls) == 3 and np_(j).shape == (10, 10)


def test_basis_chunks_are_balanced(fd):
    b = ad.backend("finite_differences", chunk_size=64)
    assert b.basis_chunks(100) == [(0, 50), (50, 100)]
    assert b.basis_chunks(0) == []
    assert ad.backend("finite_differences", chunk_size=3).basis_chunks(10) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert fd.chunk_size is None and fd.basis_chunks(64) == [(0, 64)]


# ------------------------------------------------------------------ options
@pytest.mark.parametrize("name", ("finite_differences", *EXACT, *LOOPED))
def test_every_backend_takes_chunk_size(name):
    b = backend_or_skip(name, chunk_size=8)
    assert b.chunk_size == 8 and b.options["chunk_size"] == 8
    assert b != backend_or_skip(name)
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ad.InvalidArgumentError, match="chunk_size"):
            ad.backend(name, chunk_size=bad)


def test_implicit_passes_chunk_size_to_its_inner_backend():
    b = ad.Implicit("finite_differences", chunk_size=5)
    assert b.inner.chunk_size == 5


# ------------------------------------------------------------------ the Batch class
def test_batch_is_a_sequence_and_a_single_leaf():
    import optree

    members = [np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([5.0, 6.0])]
    b = ad.Batch(*members)
    assert len(b) == 3 and b[-1] is members[-1] and list(b) == members
    assert isinstance(b[1:], ad.Batch) and len(b[1:]) == 2
    assert optree.tree_leaves(b) == [b]  # never flattened as a container
    np.testing.assert_array_equal(b.stack(), np.stack(members))
    s = ad.Batch.stacked(np.stack(members))
    assert s.is_stacked and len(s) == 3
    np.testing.assert_array_equal(s[1], members[1])
    assert repr(b).startswith("Batch(array(") and repr(s).startswith("Batch.stacked(array(")


def test_batch_of_trees_stacks_leaf_by_leaf():
    b = ad.Batch({"a": np.ones(2), "b": 1.0}, {"a": np.zeros(2), "b": 2.0})
    stacked = b.stack()
    assert stacked["a"].shape == (2, 2) and stacked["b"].tolist() == [1.0, 2.0]
    assert ad.Batch.stacked(stacked)[1]["b"] == 2.0


def test_empty_batch_is_refused():
    with pytest.raises(ad.InvalidArgumentError, match="at least one member"):
        ad.Batch()
    with pytest.raises(ad.InvalidArgumentError, match="length 0"):
        ad.Batch.stacked(np.zeros((0, 3)))
    with pytest.raises(ad.InvalidArgumentError, match="no array leaf"):
        ad.Batch.stacked({"a": None})


def test_stacked_leaves_must_share_the_batch_axis():
    with pytest.raises(ad.ShapeMismatchError, match="same leading"):
        ad.Batch.stacked({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))})
    with pytest.raises(ad.ShapeMismatchError, match="same leading"):
        ad.Batch.stacked(np.float64(1.0))
    with pytest.raises(ad.ShapeMismatchError, match="member 1"):
        ad.Batch(np.ones(2), np.ones(3)).stack()


def test_wrong_members_name_the_member_and_the_leaf(fd):
    jvp = ad.pushforward(fd, f_tree, TREE)
    bad = {"a": np.ones(3), "b": np.ones(3)}
    with pytest.raises(ad.ShapeMismatchError, match=r"Batch member 1: tangent leaf at position 1 has shape \(3,\)"):
        jvp(ad.Batch(TREE_TANGENTS[0], bad))
    with pytest.raises(ad.ShapeMismatchError, match="Batch member 0: tangent must have the structure of x"):
        jvp(ad.Batch(np.ones(3)))
    with pytest.raises(ad.ShapeMismatchError, match=r"stacked Batch tangent leaf at position 1 has shape \(2, 3\)"):
        jvp(ad.Batch.stacked({"a": np.ones((2, 3)), "b": np.ones((2, 3))}))
    vjp = ad.pullback(fd, f_tree, TREE)
    with pytest.raises(ad.ShapeMismatchError, match=r"Batch member 2: cotangent has shape \(4,\)"):
        vjp(ad.Batch(np.ones(3), np.ones(3), np.ones(4)))
    with pytest.raises(ad.ShapeMismatchError, match=r"shape \(2, 3\).*got \(2, 4\)"):
        vjp(ad.Batch.stacked(np.ones((2, 4))))


def test_a_batch_where_one_tangent_is_expected_is_refused(fd):
    with pytest.raises(ad.ShapeMismatchError, match="got an ad.Batch of 2"):
        ad.hvp(fd, lambda x: (x**3).sum(), np.ones(2), ad.Batch(np.ones(2), np.ones(2)))


def test_unbatched_calls_are_unchanged(fd):
    jvp = ad.pushforward(fd, f_array, X)
    out = jvp(TANGENTS[0])
    assert isinstance(out, np.ndarray) and out.shape == (4,)
    vjp = ad.pullback(fd, f_array, X)
    assert isinstance(vjp(COTANGENTS[0]), np.ndarray)

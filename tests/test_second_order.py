"""``ad.SecondOrder(outer, inner)``: second order by ``outer`` over ``inner``'s first order.

Every same-library pair of the installed exact backends, and finite differences over each
of them (and over itself), against analytic Hessians in float64; first-order operators
are ``inner``'s; ``outer`` is really the one differentiating; refused pairs and arguments.
The pairs of an AD library are skipped (with the reason) where it is not installed.
"""

from __future__ import annotations

import numpy as np
import optree
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff._second_order import SecondOrder

EXACT = ("torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor")
FD = "finite_differences"
PAIRS = [(n, n) for n in EXACT] + [(FD, n) for n in EXACT] + [(FD, FD)]
EXACT_RTOL, FD_RTOL = 1e-10, 1e-5


def backend_or_skip(name: str) -> ad.Backend:
    # availability through the registry, not an import: importing paddle after tensorflow
    # crashes, and the paddle adapter knows how to import it safely
    if name not in ad.available_backends():
        pytest.skip(f"{name} is not installed here")
    return ad.backend(name)


@pytest.fixture(params=PAIRS, ids=lambda p: f"{p[0]}-over-{p[1]}")
def so(request: pytest.FixtureRequest) -> SecondOrder:
    outer, inner = request.param
    return ad.SecondOrder(backend_or_skip(outer), backend_or_skip(inner))


def rtol_of(b: ad.Backend) -> float:
    return FD_RTOL if b.approximate else EXACT_RTOL


def assert_close(actual, expected, rtol: float) -> None:
    actual = np.asarray(ad.to_numpy(actual), dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * max(1.0, float(np.max(np.abs(expected)))))


# ----------------------------------------------------- functions and references
def sin_x2(x):
    return anp.sum(anp.sin(x) * x**2)


def sin_x2_hessian(x):
    return np.diag(2 * np.sin(x) + 4 * x * np.cos(x) - x**2 * np.sin(x))


def rosenbrock(x):
    return anp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def rosenbrock_hessian(x):
    n = x.size
    h = np.zeros((n, n))
    for i in range(n - 1):
        h[i, i] += 1200 * x[i] ** 2 - 400 * x[i + 1] + 2
        h[i + 1, i + 1] += 200
        h[i, i + 1] = h[i + 1, i] = -400 * x[i]
    return h


FUNCTIONS = {"sin_x2": (sin_x2, sin_x2_hessian), "rosenbrock": (rosenbrock, rosenbrock_hessian)}
X = np.array([0.3, -1.2, 2.0])
V = np.array([1.0, 0.5, -2.0])


def tree_f(p):
    return anp.sum(p["a"] ** 2 * p["b"][0]) + anp.sum(anp.sin(p["b"]))


TREE_X = {"a": np.array([1.0, 2.0]), "b": np.array([0.5, -1.0, 0.3])}
TREE_V = {"a": np.array([1.0, -1.0]), "b": np.array([0.2, 0.1, -0.4])}


def tree_hessian() -> np.ndarray:
    """The Hessian of ``tree_f`` over the concatenation (a, b)."""
    a, b = TREE_X["a"], TREE_X["b"]
    h = np.zeros((5, 5))
    h[0, 0] = h[1, 1] = 2 * b[0]
    h[0, 2] = h[2, 0] = 2 * a[0]
    h[1, 2] = h[2, 1] = 2 * a[1]
    h[2:, 2:] -= np.diag(np.sin(b))
    return h


def flat(tree) -> np.ndarray:
    return np.concatenate([np.reshape(ad.to_numpy(v), -1) for v in (tree["a"], tree["b"])])


def scalar_f(t):
    return anp.sin(t) * t**2


T = 0.7
SCALAR_D2 = 2 * np.sin(T) + 4 * T * np.cos(T) - T**2 * np.sin(T)


def native(b: ad.Backend, tree):
    return optree.tree_map(b.asarray, tree)


# ------------------------------------------------------------- second order
@pytest.mark.parametrize("name", FUNCTIONS)
def test_hessian_and_hvp_match_the_analytic_ones(so: SecondOrder, name: str) -> None:
    f, hessian = FUNCTIONS[name]
    x = so.asarray(X)
    h = ad.hessian(so, f, x)
    assert so.inner.is_native(h)
    assert_close(h, hessian(X), rtol_of(so))
    hv = ad.hvp(so, f, x, so.asarray(V))
    assert so.inner.is_native(hv)
    assert_close(hv, hessian(X) @ V, rtol_of(so))


def test_pytree_hvp_and_prepared_forms(so: SecondOrder) -> None:
    h = tree_hessian()
    hv = ad.hvp(so, tree_f, native(so, TREE_X), native(so, TREE_V))
    assert_close(flat(hv), h @ flat(TREE_V), rtol_of(so))
    prepared = ad.prepare_hvp(so, tree_f, TREE_X, TREE_V)
    for v in (TREE_V, {"a": np.array([0.0, 3.0]), "b": np.array([1.0, 0.0, 2.0])}):
        assert_close(flat(prepared(TREE_X, v)), h @ flat(v), rtol_of(so))
    prepared_h = ad.prepare_hessian(so, sin_x2, X)
    assert_close(prepared_h(X), sin_x2_hessian(X), rtol_of(so))


SECOND_DERIVATIVE_XFAILS: dict[tuple[str, str], str] = {}  # known gaps, applied strictly: (outer, inner) -> reason
needs_family = pytest.mark.skipif(
    not hasattr(ad, "second_derivative"), reason="the second-order operator family is not there yet"
)


@needs_family
def test_second_derivative(so: SecondOrder, request: pytest.FixtureRequest) -> None:
    reason = SECOND_DERIVATIVE_XFAILS.get((so.outer.name, so.inner.name))
    if reason is not None:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
    rtol = rtol_of(so)
    assert_close(ad.second_derivative(so, scalar_f, np.float64(T)), SCALAR_D2, rtol)
    y, d, d2 = ad.value_derivative_and_second_derivative(so, scalar_f, np.float64(T))
    assert_close(d2, SCALAR_D2, rtol)
    assert_close(d, np.sin(T) * 2 * T + T**2 * np.cos(T), rtol)
    prepared = ad.prepare_second_derivative(so, scalar_f, np.float64(T))
    assert_close(prepared(np.float64(-T)), -SCALAR_D2, rtol)  # f is odd, so is f''


@needs_family
def test_hessian_blocks_and_gradient_with_hvp(so: SecondOrder) -> None:
    rtol = rtol_of(so)
    y, g, blocks = ad.value_gradient_and_hessian(so, tree_f, native(so, TREE_X))
    full = np.block([
        [np.reshape(ad.to_numpy(blocks[i][j]), (TREE_X[i].size, TREE_X[j].size)) for j in ("a", "b")]
        for i in ("a", "b")
    ])
    assert_close(full, tree_hessian(), rtol)
    g, hv = ad.gradient_and_hvp(so, sin_x2, X, V)
    assert_close(hv, sin_x2_hessian(X) @ V, rtol)
    assert_close(g, ad.gradient(so.inner, sin_x2, X), EXACT_RTOL)


# ----------------------------------------------------------- the two backends
def test_first_order_operators_are_inner_s(so: SecondOrder) -> None:
    inner = so.inner
    x = so.asarray(X)

    def vector_f(x):
        return anp.sin(x) * x[0]

    def same(a, b) -> None:
        np.testing.assert_array_equal(ad.to_numpy(a), ad.to_numpy(b))

    same(ad.gradient(so, rosenbrock, x), ad.gradient(inner, rosenbrock, x))
    y, g = ad.value_and_gradient(so, rosenbrock, x)
    same(y, ad.value_and_gradient(inner, rosenbrock, x)[0])
    same(ad.jacobian(so, vector_f, x), ad.jacobian(inner, vector_f, x))
    same(ad.pushforward(so, vector_f, x)(so.asarray(V)), ad.pushforward(inner, vector_f, x)(inner.asarray(V)))
    same(ad.pullback(so, vector_f, x)(so.asarray(V)), ad.pullback(inner, vector_f, x)(inner.asarray(V)))
    same(ad.derivative(so, scalar_f, np.float64(T)), ad.derivative(inner, scalar_f, np.float64(T)))
    assert type(ad.gradient(so, rosenbrock, x)) is type(ad.gradient(inner, rosenbrock, x))
    assert (so.has_forward, so.has_reverse, so.device) == (inner.has_forward, inner.has_reverse, inner.device)


class _Spy:
    """Counts the calls of one method of one backend instance."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, b: ad.Backend, name: str):
        self.calls = 0
        method = getattr(b, name)

        def spy(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        monkeypatch.setattr(b, name, spy)


def test_outer_differentiates_inner_s_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend

    outer, inner = FiniteDifferencesBackend(), FiniteDifferencesBackend(step=1e-3)
    so = ad.SecondOrder(outer, inner)
    pushforward = _Spy(monkeypatch, outer, "flat_value_and_pushforward")
    gradient = _Spy(monkeypatch, inner, "flat_value_and_gradient")
    own = [_Spy(monkeypatch, b, m) for b in (outer, inner) for m in ("flat_hvp", "flat_hessian")]
    ad.hvp(so, sin_x2, X, V)
    # inner's gradient at x and at the four points of one five-point stencil
    assert pushforward.calls == 1 and gradient.calls == 5
    assert all(s.calls == 0 for s in own)  # neither backend's own second order
    pullback = _Spy(monkeypatch, outer, "flat_value_and_pullback")
    ad.hessian(so, sin_x2, X)
    assert pullback.calls == 1 and gradient.calls > 5


def _fresh(name: str) -> ad.Backend:
    """A new backend of ``name``, not the instance ``ad.backend`` shares."""
    from abstractdiff._backend import AdapterBackend

    shared = ad.backend(name)
    return AdapterBackend(type(shared.adapter)) if isinstance(shared, AdapterBackend) else type(shared)()


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_a_library_over_itself_nests_with_outer_s_forward_mode(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    backend_or_skip(name)
    outer, inner = _fresh(name), _fresh(name)  # fresh instances to spy on
    so = ad.SecondOrder(outer, inner)
    pushforward = _Spy(monkeypatch, outer, "flat_value_and_pushforward")
    gradient = _Spy(monkeypatch, inner, "flat_value_and_gradient")
    own = [_Spy(monkeypatch, b, "flat_hvp") for b in (outer, inner)]
    assert_close(ad.hvp(so, sin_x2, X, V), sin_x2_hessian(X) @ V, EXACT_RTOL)
    assert pushforward.calls == 1 and gradient.calls >= 1 and all(s.calls == 0 for s in own)


def test_jax_with_other_options_is_the_same_library() -> None:
    backend_or_skip("jax")
    compiled, eager = ad.backend("jax"), ad.backend("jax", compile=False)
    for so in (ad.SecondOrder(compiled, eager), ad.SecondOrder(eager, compiled)):
        assert_close(ad.hessian(so, rosenbrock, X), rosenbrock_hessian(X), EXACT_RTOL)
        assert_close(flat(ad.hvp(so, tree_f, TREE_X, TREE_V)), tree_hessian() @ flat(TREE_V), EXACT_RTOL)


def test_compiled_jax_over_jax_traces_once() -> None:
    backend_or_skip("jax")
    so = ad.SecondOrder("jax", "jax")
    ad.hvp(so, tree_f, TREE_X, TREE_V)
    ad.hessian(so, sin_x2, X)
    before = so.outer.trace_count
    for k in range(3):
        ad.hvp(so, tree_f, TREE_X, optree.tree_map(lambda v, k=k: v + k, TREE_V))
        ad.hessian(so, sin_x2, X + k)
    assert so.outer.trace_count == before


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_finite_differences_over_float32_keeps_the_dtype(name: str) -> None:
    inner = backend_or_skip(name)
    x = X.astype(np.float32)
    plain = ad.SecondOrder(FD, inner)
    wide = ad.SecondOrder(ad.backend(FD, compute_dtype="float64"), inner)
    for so, rtol in ((plain, 2e-2), (wide, 1e-5)):
        h = ad.hessian(so, sin_x2, x)
        assert ad.to_numpy(h).dtype == np.float32 and inner.is_native(h)
        assert_close(h, sin_x2_hessian(x.astype(np.float64)), rtol)
        hv = ad.hvp(so, sin_x2, x, V.astype(np.float32))
        assert ad.to_numpy(hv).dtype == np.float32
        assert_close(hv, sin_x2_hessian(x.astype(np.float64)) @ V, rtol)


# ------------------------------------------------------------------- identity
def test_identity_name_and_traits() -> None:
    fd = ad.backend(FD)
    a, b = ad.SecondOrder(FD, FD), ad.SecondOrder(fd, ad.backend(FD))
    assert a == b and hash(a) == hash(b) and a.cache_key == b.cache_key
    c = ad.SecondOrder(ad.backend(FD, step=1e-3), FD)
    assert a != c and a.cache_key != c.cache_key
    assert a.name == "second_order(finite_differences, finite_differences)"
    assert repr(a) == f"SecondOrder(outer={fd!r}, inner={fd!r})"
    assert a.approximate and a.outer is fd and a.inner is fd
    assert isinstance(a, ad.Backend)


def test_approximate_when_either_is() -> None:
    backend_or_skip("jax")
    assert not ad.SecondOrder("jax", "jax").approximate
    assert ad.SecondOrder(FD, "jax").approximate


# --------------------------------------------------------------------- errors
class _ToyExact(ad.Backend):
    """An exact reverse mode for f(x) = sum(x**2) only (the pairing rules need no library)."""

    name = "toy_exact"

    def flat_value_and_pullback(self, fn, xs, data):
        y, aux = fn(xs, data)
        return y, aux, lambda dy: [2 * x * dy for x in xs]


class _OtherToyExact(_ToyExact):
    name = "other_toy_exact"


def test_exact_libraries_that_differ_are_refused_with_the_pairs_that_work() -> None:
    with pytest.raises(ad.InvalidArgumentError) as err:
        ad.SecondOrder(_ToyExact(), _OtherToyExact())
    message = str(err.value)
    assert "'toy_exact'" in message and "'other_toy_exact'" in message
    assert "the same library twice" in message and "finite differences over any backend" in message
    assert ad.SecondOrder(_ToyExact(), _ToyExact()).name == "second_order(toy_exact, toy_exact)"
    assert ad.SecondOrder(FD, _ToyExact()).name == "second_order(finite_differences, toy_exact)"


def test_an_exact_outer_over_finite_differences_is_refused() -> None:
    with pytest.raises(ad.InvalidArgumentError, match="numpy arithmetic .* does not trace; pairs that work"):
        ad.SecondOrder(_ToyExact(), FD)


def test_jax_over_torch_is_refused() -> None:
    backend_or_skip("jax")
    backend_or_skip("torch")
    with pytest.raises(ad.InvalidArgumentError, match=r"SecondOrder\('jax', 'torch'\).*pairs that work"):
        ad.SecondOrder("jax", "torch")


@pytest.mark.parametrize("bad", [None, 3, np.ones(2), ad.backend])
def test_arguments_that_are_not_backends(bad) -> None:
    with pytest.raises(ad.ArgumentTypeError, match="outer must be a backend name"):
        ad.SecondOrder(bad, FD)
    with pytest.raises(ad.ArgumentTypeError, match="inner must be a backend name"):
        ad.SecondOrder(FD, bad)


def test_unknown_names_implicit_and_nested_second_order_are_refused() -> None:
    with pytest.raises(ad.UnknownBackendError):
        ad.SecondOrder("no_such_backend", FD)
    with pytest.raises(ad.ArgumentTypeError, match="must be an explicit backend"):
        ad.SecondOrder(ad.Implicit(FD), FD)
    with pytest.raises(ad.ArgumentTypeError, match="cannot be another ad.SecondOrder"):
        ad.SecondOrder(FD, ad.SecondOrder(FD, FD))

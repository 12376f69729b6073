"""Never silently wrong, round 3 (issue 24): caches keyed on everything that changes the result.

Each test fails on the version before the fix:

* item 0, a prepared operator whose adapter compiles at its first call, under the plan
  key of the globals at preparation, poisoned the unprepared operator (jax, tensorflow,
  PyTensor, and every backend's ``compile=True``); and prepared operators froze ``f``'s
  globals on compiling backends but not on eager ones, so a changed global gave
  different numbers on different backends;
* the capture key compared numpy arrays over 4,096 elements by identity, so an in-place
  change to a large captured array kept a stale trace;
* item 4, a bool output gave a zero Jacobian on autograd, tensorflow, MLX and PyTensor
  and a library's own error elsewhere;
* item 8, float64 results narrowed to float32 by arithmetic outside the operators (jax,
  x64 off) had no documented fix, and the prepared operator's error said "prepare again";
* item 9, a class registered with ``jax.tree_util`` got a ``None`` gradient on the other
  backends.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff._cache import array_fingerprint, value_key

EXPLICIT = ["finite_differences", "autograd", "jax", "tensorflow", "torch", "mlx", "paddle", "pytensor"]
#: every backend, and each one's compiled variant where it has one
VARIANTS = [(name, {}) for name in EXPLICIT] + [
    (name, {"compile": True}) for name in ("jax", "tensorflow", "torch", "mlx", "paddle")
]


def _backend(name: str, options: dict) -> ad.Backend:
    if name not in ad.available_backends():
        pytest.skip(f"{name} is not installed here")
    return ad.backend(name, **options)


@pytest.fixture(params=VARIANTS, ids=[f"{n}{'-compiled' if o else ''}" for n, o in VARIANTS])
def b(request):
    return _backend(*request.param)


@pytest.fixture(params=EXPLICIT)
def eager(request):
    return _backend(request.param, {})


def numbers(tree):
    return np.asarray(ad.to_numpy(tree), dtype=np.float64)


# ------------------------------------------------ item 0: one rule for what a prepared operator freezes
K = 2.0


def scaled_by_k(w):
    return anp.sum(w**2) * K


def test_a_prepared_operator_does_not_poison_the_unprepared_one(b):
    global K
    x = np.ones(2)
    try:
        K = 2.0
        g = ad.prepare_gradient(b, scaled_by_k, x)
        K = 5.0  # changed before the first call, where compiling adapters trace
        np.testing.assert_allclose(numbers(g(x)), 10 * x, rtol=1e-6)
        K = 2.0
        np.testing.assert_allclose(numbers(ad.gradient(b, scaled_by_k, x)), 4 * x, rtol=1e-6)
        np.testing.assert_allclose(numbers(g(x)), 4 * x, rtol=1e-6)
    finally:
        K = 2.0


def test_prepared_operators_see_the_current_globals_on_every_backend(b):
    # The documented rule: a prepared operator freezes the form of its inputs, nothing of f.
    global K
    x = np.array([1.0, 3.0])
    try:
        K = 2.0
        ops = {
            "gradient": (ad.prepare_gradient(b, scaled_by_k, x), lambda p: p(x), lambda k: 2 * k * x),
            "hvp": (ad.prepare_hvp(b, scaled_by_k, x, x), lambda p: p(x, x), lambda k: 2 * k * x),
            "hessian": (ad.prepare_hessian(b, scaled_by_k, x), lambda p: p(x), lambda k: 2 * k * np.eye(2)),
        }
        for k in (2.0, 7.0, 2.0):
            K = k
            for name, (prepared, call, want) in ops.items():
                np.testing.assert_allclose(numbers(call(prepared)), want(k), rtol=1e-5, atol=1e-6, err_msg=name)
    finally:
        K = 2.0


def test_a_prepared_operator_still_refuses_another_form_after_a_global_changed(b):
    global K
    try:
        g = ad.prepare_gradient(b, scaled_by_k, np.ones(2))
        g(np.ones(2))
        K = 3.0
        with pytest.raises(ad.ShapeMismatchError):
            g(np.ones(3))
    finally:
        K = 2.0


LARGE = np.ones(10_000)


def reads_a_large_array(w):
    return anp.sum(w * anp.sum(LARGE))


def test_an_in_place_change_to_a_large_captured_array_is_seen(b):
    x = np.ones(2)
    try:
        np.testing.assert_allclose(numbers(ad.gradient(b, reads_a_large_array, x)), [1e4, 1e4], rtol=1e-5)
        g = ad.prepare_gradient(b, reads_a_large_array, x)
        g(x)
        LARGE[:] = 2.0  # in place: the same object, other values
        np.testing.assert_allclose(numbers(ad.gradient(b, reads_a_large_array, x)), [2e4, 2e4], rtol=1e-5)
        np.testing.assert_allclose(numbers(g(x)), [2e4, 2e4], rtol=1e-5)
    finally:
        LARGE[:] = 1.0


# ---------------------------------------------------------------- the keying policy itself
def test_value_key_compares_values_exactly_and_arrays_by_content():
    assert value_key(1.0) != value_key(1) != value_key(True)
    assert value_key(0.0) != value_key(-0.0)
    assert value_key(float("nan")) == value_key(float("nan"))
    a = np.arange(2000.0)
    b = a.copy()
    b[1000] += 1e-9  # below repr's precision, and inside repr's "..." summary
    assert repr(a) == repr(b) and value_key(a) != value_key(b)
    assert value_key(a) == value_key(a.copy())
    assert value_key(np.arange(4).reshape(2, 2).T) == value_key(np.array([[0, 2], [1, 3]]))
    assert value_key(np.zeros(2, np.float32)) != value_key(np.zeros(2, np.float64))
    assert value_key(np.zeros((2, 1))) != value_key(np.zeros((1, 2)))
    assert value_key({"b": 1, "a": (2.0, [3])}) == value_key({"a": (2.0, [3]), "b": 1})
    assert array_fingerprint(np.ones(3))[:3] == (np.ndarray, "<f8", (3,))


def test_value_key_keys_other_objects_by_identity_never_repr():
    class Config:
        def __init__(self, lr):
            self.lr = lr

        def __repr__(self):
            return "Config()"  # hides the field that changes the result

    alive: list = []
    one, two = Config(1.0), Config(2.0)
    assert value_key(one, alive) != value_key(two, alive)
    assert alive == [one, two]  # for the caller to hold weakly


def test_value_key_keys_native_arrays_by_content():
    from abstractdiff._convert import content_of

    torch = pytest.importorskip("torch")
    t = torch.ones(3)
    before = value_key(t, native=content_of)
    t[0] = 2.0  # in place
    assert value_key(t, native=content_of) != before
    assert value_key(torch.ones(3), native=content_of) == value_key(torch.ones(3), native=content_of)


# ---------------------------------------------------------------- item 4: discrete outputs
@pytest.mark.parametrize("output", ["bool array", "bool scalar", "int array"])
def test_a_discrete_output_is_an_error_on_every_backend(eager, output):
    f = {
        "bool array": lambda x: x > 0.5,
        "bool scalar": lambda x: anp.sum(x) > 0.5,
        "int array": lambda x: anp.astype(x > 0.5, "int32") if hasattr(anp, "astype") else (x > 0.5) * 1,
    }[output]
    x = np.ones(3)
    with pytest.raises(ad.InvalidOutputError, match="no derivative"):
        ad.jacobian(eager, f, x)
    if output == "bool scalar":
        with pytest.raises(ad.InvalidOutputError, match="no derivative"):
            ad.gradient(eager, f, x)


def test_a_python_bool_output_is_the_same_error():
    with pytest.raises(ad.InvalidOutputError, match="bool"):
        ad.gradient("finite_differences", lambda x: bool(x.sum() > 0), np.ones(2))


# ----------------------------------------------- item 8: float64 outside the operators (ad.scope)
def test_scope_keeps_float64_in_the_users_own_arithmetic_on_jax():
    if "jax" not in ad.available_backends():
        pytest.skip("jax is not installed here")
    p = {"w": np.ones(3)}
    loss = lambda p: anp.sum(p["w"] ** 3)  # noqa: E731
    step = ad.prepare_value_and_gradient("jax", loss, p)
    for _ in range(3):
        _, g = step(p)
        with ad.scope(p, g):
            p = {"w": p["w"] - 0.1 * g["w"]}
        assert p["w"].dtype == np.float64
    want = np.ones(3)
    for _ in range(3):
        want = want - 0.1 * 3 * want**2
    np.testing.assert_allclose(numbers(p["w"]), want, rtol=1e-14)


def test_a_narrowed_float64_input_names_the_fix():
    if "jax" not in ad.available_backends():
        pytest.skip("jax is not installed here")
    import jax.numpy as jnp

    step = ad.prepare_gradient("jax", lambda w: anp.sum(w**2), np.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        narrowed = jnp.asarray(np.ones(2))  # x64 off: float32
    with pytest.raises(ad.ShapeMismatchError, match=r"ad\.scope"):
        step(narrowed)


def test_scope_does_nothing_where_nothing_is_needed(eager):
    x = eager.asarray(np.ones(2))
    with ad.scope({"x": x}, [1, "static", None]):
        y = x * 2.0
    np.testing.assert_allclose(numbers(y), [2.0, 2.0])


# ---------------------------------------------- item 9: another library's pytree registry
class JaxRegistered:
    def __init__(self, w):
        self.w = w


def test_a_class_registered_only_with_jax_is_flattened_on_every_backend(eager):
    jax = pytest.importorskip("jax")
    if not hasattr(JaxRegistered, "_registered"):
        jax.tree_util.register_pytree_node(
            JaxRegistered, lambda p: ((p.w,), None), lambda _, children: JaxRegistered(*children)
        )
        JaxRegistered._registered = True
    g = ad.gradient(eager, lambda p: anp.sum(p.w**2), JaxRegistered(np.array([1.0, -2.0])))
    assert type(g) is JaxRegistered  # flattened as jax flattens it, never a None gradient
    np.testing.assert_allclose(ad.to_numpy(g.w), [2.0, -4.0], rtol=1e-6)


# ------------------------------------------- scenarios a third-party library cannot run
def test_every_builtin_backend_runs_every_default_scenario(eager):
    from abstractdiff import testing
    from abstractdiff.testing._check import missing_functions

    needed = sorted({name for s in testing.default_scenarios() for name in s.requires})
    assert {"linalg.cholesky", "linalg.slogdet", "linalg.solve_triangular"} <= set(needed)
    assert missing_functions(eager, needed) == []


def test_a_scenario_the_library_cannot_run_is_reported_not_run():
    from abstractdiff import testing

    s = testing.Scenario("needs_a_missing_function", lambda x: anp.sum(x**2), np.ones(2),
                         value=2.0, gradient=np.full(2, 2.0), requires=("no_such_function_anywhere",))
    report = testing.check_backend("finite_differences", [s])
    assert report.ok and report.results == []
    assert report.not_run == [("needs_a_missing_function[float64]", "finite_differences's library has no "
                               "no_such_function_anywhere (autoray finds none)")]
    assert "not run:" in str(report)


# ------------------------------------------- what the property-based net found on its first runs
def test_sparse_finite_difference_hessian_in_float32_is_not_a_false_pattern_error():
    sb = ad.Sparse(ad.backend("finite_differences"))
    f = lambda x, w, t: anp.sum(x[:2] * w) * (1 + anp.sum(anp.sin(x[2:]) * t))  # noqa: E731
    x = np.array([0, -1.1323481, 0, 0], np.float32)
    w, t = np.array([0, -1.3540763], np.float32), np.zeros(2, np.float32)
    np.testing.assert_array_equal(ad.hessian(sb, f, x, w, t).toarray(), np.zeros((4, 4)))


def test_numpy_data_reaches_a_torch_kernel_as_tensors():
    for name in ("autograd", "torch"):
        if name not in ad.available_backends():
            pytest.skip(f"{name} is not installed here")
    g = ad.differentiate_with(lambda x, w: anp.sum(x * w), "torch")
    np.testing.assert_allclose(numbers(ad.gradient("autograd", g, np.ones(2), np.array([2.0, 3.0]))), [2.0, 3.0])


def test_tensorflow_lets_a_composition_error_through_unwrapped():
    for name in ("tensorflow", "torch"):
        if name not in ad.available_backends():
            pytest.skip(f"{name} is not installed here")
    g = ad.differentiate_with(lambda x, w: anp.sum(x * w), "torch")
    with pytest.raises(ad.CompositionError, match="traced"):
        ad.gradient("tensorflow", g, np.ones(2), np.array([2.0, 3.0]))


def test_mlx_takes_a_one_element_negative_stride_array():
    if "mlx" not in ad.available_backends():
        pytest.skip("mlx is not installed here")
    x = np.array([2.0], np.float32)[::-1].copy()[::-1]
    assert x.strides[0] < 0
    np.testing.assert_allclose(numbers(ad.gradient("mlx", lambda v: anp.sum(v**2), x)), [4.0])

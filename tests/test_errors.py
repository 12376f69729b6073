"""Bad input: each raises our class *and* the matching builtin, with a message naming the fix.

Also: an exception raised by ``f`` reaches the caller unchanged, and no operator
changes its inputs.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import optree
import pytest

import abstractdiff as ad
from abstractdiff._registry import _Entry

X = np.array([0.7, -1.3, 0.4])


def f_scalar(x):
    return np.sum(x**2)


def f_vector(x):
    return np.stack([x[0] * x[1], x[2], x[0], x[1] ** 2])


def raises(cls, builtin, *, match=()):
    """pytest.raises for ``cls`` that also checks the builtin base and message fragments."""
    assert issubclass(cls, ad.AbstractDiffError) and issubclass(cls, builtin)

    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(cls)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self._ctx.__exit__(*exc)
            err = self.info.value
            assert isinstance(err, builtin) and isinstance(err, ad.AbstractDiffError)
            for fragment in match:
                assert fragment in str(err), f"{fragment!r} not in message: {err}"
            return handled

    return _Check()


# ------------------------------------------------------------------------- backends


def test_unknown_backend_lists_registered_names(fd):
    with raises(ad.UnknownBackendError, ValueError, match=ad.registered_backends()) as info:
        ad.backend("pytorch")
    assert "'pytorch'" in str(info.value) and "register_backend" in str(info.value)
    # The operators accept a name and fail the same way.
    with raises(ad.UnknownBackendError, ValueError, match=["finite_differences"]):
        ad.gradient("no_such_backend", f_scalar, X)


def test_backend_name_must_be_a_string_and_instances_take_no_options(fd):
    with pytest.raises(TypeError, match="string"):
        ad.backend(3)
    assert ad.backend(fd) is fd
    with pytest.raises(TypeError, match="options"):
        ad.backend(fd, step=1e-3)


def test_missing_library_names_the_extra(clean_registry):
    clean_registry._registry["fakelib"] = _Entry(
        "abstractdiff.adapters.fakelib:FakeBackend", ("no_such_fakelib_module",), "fakelib"
    )
    assert "fakelib" in ad.registered_backends()
    assert "fakelib" not in ad.available_backends()
    with raises(ad.BackendUnavailableError, ImportError, match=["no_such_fakelib_module", "abstractdiff[fakelib]"]):
        ad.backend("fakelib")
    assert "pip install 'abstractdiff[fakelib]'" in clean_registry.unavailable_reason("fakelib")
    with raises(ad.BackendUnavailableError, ImportError):
        ad.gradient("fakelib", f_scalar, X)


def test_missing_requirement_of_a_registered_factory(clean_registry):
    from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend

    ad.register_backend("needs_lib", FiniteDifferencesBackend, requires=("no_such_required_module",))
    assert "needs_lib" not in ad.available_backends()
    with raises(ad.BackendUnavailableError, ImportError, match=["no_such_required_module", "pip install"]):
        ad.backend("needs_lib")


def test_registered_module_that_does_not_import(clean_registry):
    ad.register_backend("broken", "no_such_adapter_module_xyz:Backend")
    with raises(ad.BackendUnavailableError, ImportError, match=["no_such_adapter_module_xyz"]) as info:
        ad.backend("broken")
    assert info.value.name == "no_such_adapter_module_xyz"


@pytest.mark.parametrize("device", ["cuda", "gpu", "tpu:0", "cuda:1"])
def test_device_that_does_not_exist(device):
    with raises(ad.DeviceError, ValueError, match=[repr(device), "cpu"]):
        ad.backend("finite_differences", device=device)


def test_device_cpu_is_accepted_in_any_case():
    assert ad.backend("finite_differences", device="CPU").device == "cpu"
    assert ad.backend("finite_differences").devices() == ["cpu"]


@pytest.mark.parametrize("step", [0, 0.0, -1e-3, 1.0, 2, float("nan"), "1e-3", True])
def test_bad_finite_difference_step(step):
    with pytest.raises(ValueError, match=re.escape("(0, 1)")):
        ad.backend("finite_differences", step=step)


# ------------------------------------------------------------------------ operators


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda b: ad.gradient(b, f_vector, X), id="gradient"),
        pytest.param(lambda b: ad.value_and_gradient(b, f_vector, X), id="value_and_gradient"),
        pytest.param(lambda b: b.gradient(f_vector, X), id="method"),
        pytest.param(lambda b: ad.hessian(b, f_vector, X), id="hessian"),
        pytest.param(lambda b: ad.hvp(b, f_vector, X, np.ones(3)), id="hvp"),
    ],
)
def test_non_scalar_output(fd, call):
    with raises(ad.NonScalarOutputError, ValueError, match=["(4,)", "jacobian", "pullback"]):
        call(fd)


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(np.array([1, 2, 3]), id="int_array"),
        pytest.param(3, id="int"),
        pytest.param({"n": 1, "idx": np.arange(2)}, id="dict_of_ints"),
        pytest.param(None, id="None"),
        pytest.param([], id="empty_list"),
        pytest.param("text", id="string"),
        pytest.param(np.array([True, False]), id="bool_array"),
    ],
)
def test_x_without_float_leaf(fd, x):
    with raises(ad.NonDifferentiableInputError, TypeError, match=["float", "extra arguments"]):
        ad.gradient(fd, lambda x: np.asarray(1.0), x)


@pytest.mark.parametrize("op", ["pullback", "jacobian", "pushforward", "hessian", "derivative"])
def test_x_without_float_leaf_every_operator(fd, op):
    with raises(ad.NonDifferentiableInputError, TypeError):
        getattr(ad, op)(fd, lambda x: np.asarray(1.0), np.arange(3))


def test_cotangent_of_wrong_shape(fd):
    vjp = ad.pullback(fd, f_vector, X)
    with raises(ad.ShapeMismatchError, ValueError, match=["(3,)", "(4,)"]):
        vjp(np.ones(3))
    with raises(ad.ShapeMismatchError, ValueError, match=["()", "(4,)"]):
        vjp(1.0)
    with raises(ad.ShapeMismatchError, ValueError, match=["(4,)", "str"]):
        vjp("ones")
    _, vjp = ad.value_and_pullback(fd, f_scalar, X)
    with raises(ad.ShapeMismatchError, ValueError, match=["(1,)", "()"]):
        vjp(np.ones(1))
    np.testing.assert_allclose(vjp(1.0), 2 * X, rtol=1e-9)  # a Python number fits a scalar output


def test_tangent_of_wrong_structure_or_shape(fd):
    x = {"a": X.copy(), "b": np.asarray(1.0)}
    jvp = ad.pushforward(fd, lambda t: t["a"] * t["b"], x)
    with raises(ad.ShapeMismatchError, ValueError, match=["structure", "'a'", "'b'"]) as info:
        jvp({"a": np.ones(3)})
    assert "PyTreeSpec({'a': *})" in str(info.value)  # received
    with raises(ad.ShapeMismatchError, ValueError, match=["structure"]):
        jvp([np.ones(3), np.asarray(1.0)])
    with raises(ad.ShapeMismatchError, ValueError, match=["(2,)", "(3,)"]):
        jvp({"a": np.ones(2), "b": np.asarray(1.0)})
    with raises(ad.ShapeMismatchError, ValueError, match=["()", "str"]):
        jvp({"a": np.ones(3), "b": "one"})
    _, jvp = ad.value_and_pushforward(fd, f_vector, X)
    with raises(ad.ShapeMismatchError, ValueError, match=["(4,)", "(3,)"]):
        jvp(np.ones(4))


def test_hvp_vector_mismatched(fd):
    with raises(ad.ShapeMismatchError, ValueError, match=["v ", "(2,)", "(3,)"]):
        ad.hvp(fd, f_scalar, X, np.ones(2))
    with raises(ad.ShapeMismatchError, ValueError, match=["v must have the structure of x"]):
        ad.hvp(fd, lambda t: np.sum(t["a"] ** 2), {"a": X.copy()}, [np.ones(3)])


def test_derivative_needs_scalar_x(fd):
    with raises(ad.ShapeMismatchError, ValueError, match=["scalar x", "(3,)", "jacobian"]):
        ad.derivative(fd, f_vector, X)
    with raises(ad.ShapeMismatchError, ValueError, match=["scalar x"]):
        ad.derivative(fd, lambda t: t[0] * t[1], [1.0, 2.0])


def test_hessian_with_several_leaves_gives_blocks(fd):
    # once an error (one float array only); now jax.hessian's nested layout of blocks
    h = ad.hessian(fd, lambda t: np.sum(t["a"] ** 2) * t["b"], {"a": X.copy(), "b": 2.0})
    np.testing.assert_allclose(h["a"]["a"], 4.0 * np.eye(X.size), atol=1e-5)
    np.testing.assert_allclose(h["a"]["b"], 2 * X, rtol=1e-5)
    assert np.shape(h["b"]["a"]) == X.shape and abs(float(h["b"]["b"])) < 1e-5


@pytest.mark.parametrize(
    "out",
    [
        pytest.param([1.0, 2.0], id="list"),
        pytest.param("loss", id="string"),
        pytest.param(None, id="None"),
        pytest.param({"loss": 1.0}, id="dict"),
        pytest.param(True, id="bool"),
    ],
)
@pytest.mark.parametrize("op", ["gradient", "value_and_gradient", "jacobian", "pullback", "pushforward"])
def test_non_array_output(fd, op, out):
    with raises(ad.InvalidOutputError, TypeError, match=["must return an array", type(out).__name__]):
        getattr(ad, op)(fd, lambda x: out, X)


@pytest.mark.parametrize(
    "out",
    [
        pytest.param(lambda x: np.sum(x), id="array"),
        pytest.param(lambda x: (np.sum(x), 1, 2), id="triple"),
        pytest.param(lambda x: [np.sum(x), 1], id="list"),
    ],
)
@pytest.mark.parametrize("op", ["gradient", "value_and_gradient"])
def test_has_aux_needs_a_pair(fd, op, out):
    with raises(ad.InvalidOutputError, TypeError, match=["has_aux=True", "pair (y, aux)"]):
        getattr(ad, op)(fd, out, X, has_aux=True)


def test_f_must_be_callable(fd):
    with pytest.raises(TypeError, match="callable"):
        ad.gradient(fd, "not a function", X)


class ParamsLike:
    """What ad.Params looks like to the core: the marker attribute."""

    _abstractdiff_params = True


OPERATORS = {
    "gradient": lambda b, f, x: ad.gradient(b, f, x),
    "value_and_gradient": lambda b, f, x: ad.value_and_gradient(b, f, x),
    "pullback": lambda b, f, x: ad.pullback(b, f, x),
    "value_and_pullback": lambda b, f, x: ad.value_and_pullback(b, f, x),
    "pushforward": lambda b, f, x: ad.pushforward(b, f, x),
    "value_and_pushforward": lambda b, f, x: ad.value_and_pushforward(b, f, x),
    "derivative": lambda b, f, x: ad.derivative(b, f, x),
    "jacobian": lambda b, f, x: ad.jacobian(b, f, x),
    "hessian": lambda b, f, x: ad.hessian(b, f, x),
    "hvp": lambda b, f, x: ad.hvp(b, f, x, x),
}


@pytest.mark.parametrize("op", list(OPERATORS))
def test_params_to_an_explicit_backend(fd, op):
    with raises(ad.ModeMismatchError, TypeError, match=["Params", "ad.Implicit('finite_differences')"]):
        OPERATORS[op](fd, lambda: np.asarray(1.0), ParamsLike())


# ------------------------------------------------------------- errors raised by f


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("op", list(OPERATORS))
def test_exception_in_f_propagates_unchanged(fd, op):
    err = Boom("from inside f")

    def f(x):
        raise err

    x = np.asarray(0.5)
    with pytest.raises(Boom) as info:
        out = OPERATORS[op](fd, f, x)
        if callable(out):  # pullback/pushforward only call f when used
            out(np.asarray(1.0))
    assert info.value is err


@pytest.mark.parametrize("op", ["pullback", "value_and_pullback", "pushforward", "value_and_pushforward"])
def test_exception_in_f_during_a_later_pullback_or_pushforward(fd, op):
    # f succeeds at x itself and fails at the perturbed points the vjp/jvp evaluates.
    err = Boom("perturbed")
    x0 = np.array([0.5, 1.0])

    def f(x):
        if not np.array_equal(x, x0):
            raise err
        return 2 * x

    out = OPERATORS[op](fd, f, x0.copy())
    closure = out[1] if isinstance(out, tuple) else out
    with pytest.raises(Boom) as info:
        closure(np.ones(2))
    assert info.value is err


# ------------------------------------------------------------- inputs untouched


def assert_unchanged(tree, snapshot):
    assert optree.tree_structure(tree) == optree.tree_structure(snapshot)
    for a, s in zip(optree.tree_leaves(tree), optree.tree_leaves(snapshot)):
        if isinstance(s, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == s.dtype and a.shape == s.shape
            assert np.array_equal(a, s)
        else:
            assert type(a) is type(s) and a == s


def tree_f(t, w, k):
    return k * np.sum(t["a"] ** 2 * w) + np.sum(t["b"].astype(np.float64) ** 3) + t["c"] * t["idx"][0]


def tree_vec(t, w, k):
    return np.concatenate([t["a"] * w * k, t["b"].astype(np.float64).reshape(-1) * t["c"]])


@pytest.mark.parametrize(
    "op",
    [
        "gradient",
        "value_and_gradient",
        "pullback",
        "value_and_pullback",
        "pushforward",
        "value_and_pushforward",
        "jacobian",
        "hvp",
        "hessian",
        "derivative",
    ],
)
def test_inputs_are_left_unchanged(fd, op):
    x = {"a": np.array([0.5, -1.0, 2.0]), "b": np.ones((2, 2), dtype=np.float32), "c": 1.5, "idx": np.array([2, 0])}
    w = np.array([1.0, 2.0, 3.0])
    args = (w, 3)
    dy = np.linspace(1.0, 2.0, 7)
    v = {"a": np.ones(3), "b": np.full((2, 2), 0.5, dtype=np.float32), "c": 1.0, "idx": None}
    inputs = (x, args, dy, v)
    snapshot = copy.deepcopy(inputs)
    if op in ("gradient", "value_and_gradient", "jacobian"):
        getattr(ad, op)(fd, tree_f if op != "jacobian" else tree_vec, x, *args)
    elif op in ("pullback", "value_and_pullback"):
        out = getattr(ad, op)(fd, tree_vec, x, *args)
        (out[1] if isinstance(out, tuple) else out)(dy)
    elif op in ("pushforward", "value_and_pushforward"):
        out = getattr(ad, op)(fd, tree_vec, x, *args)
        (out[1] if isinstance(out, tuple) else out)(v)
    elif op == "hvp":
        ad.hvp(fd, tree_f, x, v, *args)
    elif op == "hessian":
        ad.hessian(fd, lambda a, w, k: k * np.sum(a**2 * w), x["a"], *args)
    else:
        ad.derivative(fd, lambda t, w: t * w, x["c"], w)
    for now, before in zip(inputs, snapshot):
        assert_unchanged(now, before)


def test_gradient_does_not_alias_x(fd):
    # A caller who updates x in place (x -= lr * g) must not corrupt g.
    x = np.array([0.5, -1.0])
    for g in (ad.gradient(fd, lambda t: np.sum(t), x), ad.pullback(fd, lambda t: t, x)(np.ones(2))):
        assert not np.shares_memory(g, x)


# ------------------------------------------------------------- every error is ours
def test_every_raise_in_the_package_is_an_abstractdiff_error():
    """No bare builtin exception escapes to users: each raise names an ad.AbstractDiffError
    subclass (which is also the builtin a caller would catch)."""
    import ast
    import builtins
    from pathlib import Path

    exceptions = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    allowed = {"NotImplementedError", "AttributeError", "AssertionError"}  # abstract hooks, module __getattr__
    root = Path(ad.__file__).resolve().parent.parent
    problems = []
    for path in sorted((root / "abstractdiff").rglob("*.py")) + sorted((root / "adapters").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                name = node.exc.func.id
                if name in exceptions and name not in allowed:
                    problems.append(f"{path.relative_to(root)}:{node.lineno}: raise {name}(...)")
    assert not problems, "builtin exceptions raised directly:\n" + "\n".join(problems)


def test_params_of_a_numpy_array_is_an_abstractdiff_error():
    with raises(ad.ModeMismatchError, TypeError, match=["not a variable", "ad.Variable"]):
        ad.Params([np.ones(2)])

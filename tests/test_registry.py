"""The registry: names, shared instances, third-party backends, and the plan cache."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

import numpy as np
import optree
import pytest
from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend

import abstractdiff as ad

BUILTIN = ["autograd", "finite_differences", "implicit", "jax", "tensorflow", "torch"]

# A third-party adapter as its author would write it: one primitive (reverse mode, by
# plain central differences here), everything else derived by the core.
TOY_SOURCE = textwrap.dedent(
    """
    import numpy as np

    import abstractdiff as ad


    class ToyBackend(ad.Backend):
        name = "toy"

        def __init__(self, *, h=1e-6, device=None):
            super().__init__(device=device, h=h)
            self.h = h

        def flat_value_and_pullback(self, fn, xs, data):
            y, aux = fn(xs, data)

            def vjp(dy):
                out = []
                for k, x in enumerate(xs):
                    g = np.zeros_like(x)
                    for j in range(x.size):
                        step = self.h * max(1.0, abs(float(x.flat[j])))
                        e = np.zeros_like(x)
                        e.flat[j] = step
                        up = fn(xs[:k] + [x + e] + xs[k + 1 :], data)[0]
                        down = fn(xs[:k] + [x - e] + xs[k + 1 :], data)[0]
                        g.flat[j] = np.sum(dy * (up - down)) / (2 * step)
                    out.append(g)
                return out

            return y, aux, vjp
    """
)

X = np.array([0.7, -1.3, 0.4])


def f(x, w):
    return np.sum(w * np.sin(x))


def grad_f(x, w):
    return w * np.cos(x)


@pytest.fixture
def toy_module(tmp_path, monkeypatch):
    """The toy adapter as an importable module, ``abstractdiff_toy_backend``."""
    (tmp_path / "abstractdiff_toy_backend.py").write_text(TOY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import abstractdiff_toy_backend

    yield abstractdiff_toy_backend
    sys.modules.pop("abstractdiff_toy_backend", None)


# ---------------------------------------------------------------------------- names


def test_registered_backends_sorted_with_the_builtins():
    names = ad.registered_backends()
    assert names == sorted(names)
    assert set(BUILTIN) <= set(names)


def test_available_backends_is_a_sorted_subset():
    available = ad.available_backends()
    assert available == sorted(available)
    assert set(available) <= set(ad.registered_backends())
    assert {"finite_differences", "implicit"} <= set(available)  # they need no AD library


def test_available_backends_can_be_created():
    # Only the dependency-free one here: the others import their library (conformance tests do that).
    assert isinstance(ad.backend("finite_differences"), FiniteDifferencesBackend)


# ------------------------------------------------------------------ shared instances


def test_one_instance_per_name_and_options():
    b = ad.backend("finite_differences")
    assert ad.backend("finite_differences") is b
    coarse = ad.backend("finite_differences", step=1e-3)
    assert coarse is not b and coarse.step == 1e-3
    assert ad.backend("finite_differences", step=1e-3) is coarse
    # Option order does not matter.
    both = ad.backend("finite_differences", step=1e-3, device="cpu")
    assert ad.backend("finite_differences", device="cpu", step=1e-3) is both
    assert both == coarse  # same options once normalised (device defaults to "cpu")


def test_backend_equality_and_repr():
    assert FiniteDifferencesBackend() == FiniteDifferencesBackend()
    assert hash(FiniteDifferencesBackend()) == hash(FiniteDifferencesBackend())
    assert FiniteDifferencesBackend(step=1e-3) != FiniteDifferencesBackend()
    expected = "FiniteDifferencesBackend(device='cpu', step=0.001, compute_dtype=None)"
    assert repr(FiniteDifferencesBackend(step=1e-3)) == expected


# ------------------------------------------------------------------------ third party


def test_register_backend_with_a_factory(clean_registry, toy_module):
    ad.register_backend("toy", toy_module.ToyBackend)
    assert "toy" in ad.registered_backends() and "toy" in ad.available_backends()
    b = ad.backend("toy")
    assert isinstance(b, toy_module.ToyBackend) and ad.backend("toy") is b
    w = np.array([1.0, 2.0, -1.0])
    np.testing.assert_allclose(ad.gradient("toy", f, X, w), grad_f(X, w), rtol=1e-6)
    np.testing.assert_allclose(b.gradient(f, X, w), grad_f(X, w), rtol=1e-6)
    # The core derives the rest from the one primitive.
    np.testing.assert_allclose(ad.jacobian(b, np.sin, X), np.diag(np.cos(X)), rtol=1e-6, atol=1e-9)
    # Options reach the factory.
    assert ad.backend("toy", h=1e-5).h == 1e-5


def test_register_backend_with_a_module_string(clean_registry, toy_module):
    ad.register_backend("toy_by_path", "abstractdiff_toy_backend:ToyBackend")
    b = ad.backend("toy_by_path")
    assert type(b).__name__ == "ToyBackend"
    np.testing.assert_allclose(ad.gradient(b, f, X, np.ones(3)), np.cos(X), rtol=1e-6)


def test_duplicate_registration(clean_registry, toy_module):
    ad.register_backend("toy", toy_module.ToyBackend)
    first = ad.backend("toy")
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        ad.register_backend("toy", toy_module.ToyBackend)
    with pytest.raises(ValueError, match="already registered"):
        ad.register_backend("finite_differences", toy_module.ToyBackend)
    assert isinstance(ad.backend("finite_differences"), FiniteDifferencesBackend)
    ad.register_backend("toy", lambda **o: FiniteDifferencesBackend(**o), replace=True)
    replaced = ad.backend("toy")
    assert isinstance(replaced, FiniteDifferencesBackend) and replaced is not first  # the old instance is dropped


def test_factory_returning_a_non_backend(clean_registry):
    ad.register_backend("not_a_backend", lambda **o: object())
    with pytest.raises(TypeError, match="not an abstractdiff.Backend"):
        ad.backend("not_a_backend")


@pytest.mark.parametrize(
    "name, factory",
    [("", FiniteDifferencesBackend), (3, FiniteDifferencesBackend), ("x", 42), ("x", "no_colon_here")],
)
def test_register_backend_rejects_bad_arguments(clean_registry, name, factory):
    with pytest.raises(TypeError):
        ad.register_backend(name, factory)


ENTRY_POINT_SCRIPT = """
import json, sys
sys.path.insert(0, {tmp!r})
import abstractdiff as ad
import numpy as np
names = ad.registered_backends()
b = ad.backend("mybackend")
g = ad.gradient("mybackend", lambda x: np.sum(x ** 3), np.array([1.0, -2.0]))
print(json.dumps({{
    "registered": names,
    "available": ad.available_backends(),
    "type": type(b).__module__ + "." + type(b).__name__,
    "same": ad.backend("mybackend") is b,
    "gradient": g.tolist(),
}}))
"""


def test_entry_point_backend(tmp_path):
    (tmp_path / "mymodule.py").write_text(TOY_SOURCE.replace("class ToyBackend", "class MyBackend"))
    dist = tmp_path / "thirdparty_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[abstractdiff.backends]\nmybackend = mymodule:MyBackend\n")
    proc = subprocess.run(
        [sys.executable, "-c", ENTRY_POINT_SCRIPT.format(tmp=str(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "mybackend" in out["registered"] and out["registered"] == sorted(out["registered"])
    assert "mybackend" in out["available"]
    assert out["type"] == "mymodule.MyBackend"
    assert out["same"]
    np.testing.assert_allclose(out["gradient"], [3.0, 12.0], rtol=1e-6)


# ------------------------------------------------------------------------ plan cache


def test_plan_cache_reuses_the_flat_function():
    b = FiniteDifferencesBackend()

    def loss(x, w):
        return sum(np.sum(w * leaf**2) for leaf in optree.tree_leaves(x))

    w = np.ones(3)
    fn1, _, _ = b.flatten(loss, X, (w,))
    for _ in range(3):
        b.gradient(loss, X, w)
        b.value_and_gradient(loss, X * 2, w)  # new values, same structure: same plan
    fn2, _, _ = b.flatten(loss, X, (w,))
    assert fn2 is fn1
    assert len(b._plans) == 1
    b.gradient(loss, {"a": X}, w)  # a new structure is a new plan (f itself unchanged)
    b.gradient(loss, X, w)  # back to the first structure: its plan is still there
    assert len(b._plans) == 2
    assert b.flatten(loss, X, (w,))[0] is fn1


def test_plan_cache_keys_static_leaves():
    b = FiniteDifferencesBackend()

    def loss(x, k):
        return k * np.sum(x**2)

    b.gradient(loss, X, 2)
    b.gradient(loss, X, 2)
    assert len(b._plans) == 1
    np.testing.assert_allclose(b.gradient(loss, X, 3), 6 * X, rtol=1e-9)  # not the plan for k=2
    assert len(b._plans) == 2


def test_plan_cache_drops_collected_functions():
    b = FiniteDifferencesBackend()

    def make():
        return lambda x: np.sum(x**2)

    losses = [make() for _ in range(3)]
    for loss in losses:
        b.gradient(loss, X)
    assert len(b._plans) == 3
    del loss, losses
    gc.collect()
    assert len(b._plans) == 0


def test_plan_cache_drops_bound_methods_with_their_object():
    b = FiniteDifferencesBackend()

    class Model:
        def loss(self, x):
            return np.sum(x**2)

    model = Model()
    b.gradient(model.loss, X)
    b.gradient(model.loss, X)  # a new bound-method object each time, the same plan
    assert len(b._plans) == 1
    other = Model()
    b.gradient(other.loss, X)
    assert len(b._plans) == 2
    del model, other
    gc.collect()
    assert len(b._plans) == 0


def test_pullback_keeps_its_function_alive():
    # The cache holds f weakly; a returned pullback must still work after the caller drops f.
    b = FiniteDifferencesBackend()
    vjp = b.pullback(lambda x: 3 * x, X)
    jvp = b.pushforward(lambda x: 2 * x, X)
    gc.collect()
    np.testing.assert_allclose(vjp(np.ones(3)), np.full(3, 3.0), rtol=1e-9)
    np.testing.assert_allclose(jvp(np.ones(3)), np.full(3, 2.0), rtol=1e-9)
    del vjp, jvp
    gc.collect()
    assert len(b._plans) == 0


def test_unweakrefable_callables_are_not_cached():
    b = FiniteDifferencesBackend()
    np.testing.assert_allclose(b.gradient(np.sin, 0.3), np.cos(0.3), rtol=1e-9)  # a ufunc
    assert len(b._plans) == 0


def test_option_types_are_part_of_the_shared_instance_key(clean_registry):
    calls = []

    def factory(**options):
        calls.append(options)
        return ad.backend("finite_differences")

    ad.register_backend("typed_options", factory)
    ad.backend("typed_options", flag=True)
    ad.backend("typed_options", flag=1)  # 1 == True, but a different option
    assert [type(c["flag"]) for c in calls] == [bool, int]


def test_registration_naming_a_missing_attribute_is_a_clear_error(clean_registry):
    ad.register_backend("misspelt", "abstractdiff.adapters.finite_differences:FiniteDifferencesBacknd")
    with pytest.raises(ad.BackendUnavailableError, match="has no attribute 'FiniteDifferencesBacknd'") as err:
        ad.backend("misspelt")
    assert isinstance(err.value, ImportError)
    assert "misspelt" in str(err.value)


def test_backends_registered_at_run_time_are_not_installed_ones(clean_registry):
    from abstractdiff._registry import installed_backends

    ad.register_backend("run_time_fd", lambda **o: ad.backend("finite_differences"))
    assert "run_time_fd" in ad.available_backends()
    # the conformance suite's default backends: a test's registration must not join them
    assert "run_time_fd" not in installed_backends()
    assert "finite_differences" in installed_backends()


def test_keras_on_another_keras_backend_does_not_import_tensorflow(tmp_path):
    """Objects of a module a backend claims (keras) only reach that backend when its own library
    (tensorflow) is already imported."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("keras") is None or importlib.util.find_spec("jax") is None:
        pytest.skip("needs keras and jax")
    code = (
        "import sys, numpy as np, keras, abstractdiff as ad\n"
        "v = keras.Variable(np.ones(2))\n"
        "ad.to_numpy(v)\n"
        "print('tensorflow' in sys.modules)\n"
    )
    env = dict(__import__("os").environ, KERAS_BACKEND="jax")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"

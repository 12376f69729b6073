"""Globals read by the user's helpers in other modules and deep call chains (issue 45: a
helper more than three calls down, or in a sibling module, was not walked, and jax and
TensorFlow reused a trace with the old value: a stale, plausible gradient)."""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff._captures import _is_user_module

HELPERS = """
SCALE = 2.0


def h3(x):
    return x * SCALE


def h2(x):
    return h3(x) + 0


def h1(x):
    return h2(x) * 1
"""


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    name = f"ad_user_helpers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(HELPERS))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)


def _compiled(name: str) -> ad.Backend:
    pytest.importorskip(name)
    return ad.backend(name)


@pytest.mark.parametrize("name", ["jax", "tensorflow"])
@pytest.mark.parametrize("form", ["imported function", "module attribute"])
def test_a_global_changed_deep_in_another_user_module_is_seen(name, form, helpers):
    b = _compiled(name)
    h1 = helpers.h1

    def d3(x):  # three calls of this module above the helper module's three
        return h1(x) if form == "imported function" else helpers.h1(x)

    def d2(x):
        return d3(x)

    def f(x):
        return anp.sum(d2(x) ** 2)

    x = np.array([1.0, 2.0])
    for scale in (2.0, 3.0, 2.0):
        helpers.SCALE = scale
        got = ad.to_numpy(ad.gradient(b, f, x))
        np.testing.assert_allclose(got, 2 * scale**2 * x)  # d/dx sum((s x)^2) = 2 s^2 x


def test_user_and_library_modules_are_told_apart(helpers):
    assert _is_user_module(helpers.__name__)
    assert _is_user_module("__main__")
    assert not _is_user_module("numpy")  # site-packages: compared by identity, not walked
    assert not _is_user_module("json")  # the standard library
    assert not _is_user_module("abstractdiff._captures")  # ours: transparent wrappers only


# ---------------------------------------------- the user's classes: methods are helpers too
# A global read inside a method of one of the user's classes (a callable object, a static
# method, a bound method kept in a global) was not followed: the object or class was keyed by
# identity only, and jax, TensorFlow and MLX (compile=True) reused a trace with the old value.
FACTOR = 2.0


class Scaled:
    def __call__(self, x):
        return x * FACTOR

    @staticmethod
    def static(x):
        return x * FACTOR

    def method(self, x):
        return x * FACTOR


scaled = Scaled()
bound = scaled.method

sin_rule = ad.custom_vjp(lambda v: anp.sin(v))
sin_rule.defvjp(lambda v: (anp.sin(v), v), lambda v, ct: (scaled(ct * anp.cos(v)) / 2.0,))

FORMS = {
    "callable object": lambda x: anp.sum(scaled(x) ** 2),
    "static method": lambda x: anp.sum(Scaled.static(x) ** 2),
    "bound method": lambda x: anp.sum(bound(x) ** 2),
}
COMPILING = [("jax", {}), ("tensorflow", {}), ("mlx", {"compile": True})]


def _backend_of(name: str, options: dict) -> ad.Backend:
    pytest.importorskip(name)
    return ad.backend(name, **options)


@pytest.fixture
def factor():
    global FACTOR
    before = FACTOR
    yield
    FACTOR = before


@pytest.mark.parametrize("name,options", COMPILING, ids=[n for n, _ in COMPILING])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_global_read_by_a_method_of_a_users_class_is_seen(name, options, form, factor):
    global FACTOR
    b, f = _backend_of(name, options), FORMS[form]
    x = np.array([1.0, 2.0], dtype=np.float32)
    for FACTOR in (2.0, 3.0, 2.0):
        got = ad.to_numpy(ad.gradient(b, f, b.convert(x)))
        np.testing.assert_allclose(got, 2 * FACTOR**2 * x, rtol=1e-5)  # d/dx sum((k x)^2)


@pytest.mark.parametrize("name,options", COMPILING, ids=[n for n, _ in COMPILING])
def test_a_rule_calling_a_users_callable_object_sees_its_global_at_second_order(name, options, factor):
    # the oracle's mlx-hvp-global_sin shape: a Hessian-vector product through a rule whose bwd
    # reads a global, here through a callable object; bwd = (FACTOR / 2) ct cos(v)
    global FACTOR
    b = _backend_of(name, options)
    x, v = np.array([0.3, -1.0], dtype=np.float32), np.array([1.0, 0.5], dtype=np.float32)
    for FACTOR in (2.0, 4.0):
        got = ad.to_numpy(ad.hvp(b, lambda z: anp.sum(sin_rule(z)), b.convert(x), b.convert(v)))
        np.testing.assert_allclose(got, -(FACTOR / 2) * np.sin(x) * v, rtol=1e-5)


def test_a_method_replaced_on_the_class_changes_the_key_and_fails_the_guard(monkeypatch):
    from abstractdiff._captures import capture_guard, captures

    def f(x):
        return scaled(x)

    key, guard = captures(f)[0], capture_guard(f)
    assert guard is not None and guard.unchanged(f)
    monkeypatch.setattr(Scaled, "__call__", lambda self, x: x * 5.0)
    assert not guard.unchanged(f)
    assert captures(f)[0] != key


def test_a_library_class_and_its_objects_are_not_walked():
    from abstractdiff._captures import captures

    rng = np.random.default_rng(0)  # numpy's own class: its object keyed by identity alone
    key, alive = captures(lambda x: x * rng.random())
    assert [part for _, part in key] == [("id", id(rng))] and rng in alive

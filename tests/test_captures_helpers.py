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

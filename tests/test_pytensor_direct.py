"""PyTensor's compile step (``PyTensorAdapter.direct_prepared``): a prepared gradient's call is
the compiled function behind a test of each input; anything else takes the core's checked
call, so a changed form still gives the core's error (prepared) or the right answer
(unprepared), and a changed global is still seen."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("pytensor", reason="PyTensor is not installed (pip install 'abstractdiff[pytensor]')")

from abstractdiff.adapters.pytensor import PyTensorAdapter  # noqa: E402
from autoray import numpy as anp  # noqa: E402

import abstractdiff as ad  # noqa: E402
from abstractdiff._backend import AdapterBackend  # noqa: E402

SCALE = 2.0


def tiny(x):
    return anp.sum(anp.sin(x) * x + x**2)


def weighted(x, w):
    return anp.sum(w * x**2)


def scaled(x):
    return SCALE * anp.sum(x**2)


def tiny_grad(x):
    return np.cos(x) * x + np.sin(x) + 2 * x


@pytest.fixture
def b() -> ad.Backend:
    return AdapterBackend(PyTensorAdapter, mode="FAST_COMPILE")  # its own counters


def test_prepared_call_is_the_compiled_function(b):
    x = np.linspace(-1.0, 1.0, 10, dtype="float32")
    vg = ad.prepare_value_and_gradient(b, tiny, x)
    assert vg.call is not vg.check_and_run
    for _ in range(3):
        y, g = vg(x)
        np.testing.assert_allclose(g, tiny_grad(x), rtol=1e-5)
        assert g.dtype == np.float32 and y.dtype == np.float32
    assert b.compilations == 1
    vg.signature.check = lambda *a: pytest.fail("checked in Python")  # inputs of the compiled form are not
    np.testing.assert_allclose(vg(x + 1)[1], tiny_grad(x + 1), rtol=1e-5)


def test_prepared_refuses_another_form(b):
    x = np.linspace(-1.0, 1.0, 10, dtype="float32")
    vg = ad.prepare_value_and_gradient(b, tiny, x)
    vg(x)
    for bad in (np.ones(5, "float32"), x.astype("float64"), [x], x.reshape(2, 5)):
        with pytest.raises(ad.ShapeMismatchError):
            vg(bad)
    with pytest.raises(ad.ShapeMismatchError):
        vg(x, x)  # an extra argument: another structure
    swapped = x.astype(">f4")  # another byte order, the same values: converted by the checked call
    np.testing.assert_allclose(vg(swapped)[1], tiny_grad(x), rtol=1e-5)


def test_prepared_gradient_with_data_arguments(b):
    x, w = np.arange(3.0), np.array([1.0, 2.0, 3.0])
    grad = ad.prepare_gradient(b, weighted, x, w)
    for scale in (1.0, 2.0):
        np.testing.assert_allclose(grad(x, scale * w), 2 * scale * w * x)
    for bad_w in (np.ones(4), w.astype("float32"), 3.0):
        with pytest.raises(ad.ShapeMismatchError):
            grad(x, bad_w)
    with pytest.raises(ad.ShapeMismatchError):
        grad(x)


def test_unprepared_other_shapes_and_back(b):
    for n in (10, 5, 10, 7, 5):
        x = np.linspace(-1.0, 1.0, n)
        y, g = ad.value_and_gradient(b, tiny, x)
        np.testing.assert_allclose(g, tiny_grad(x), rtol=1e-9)
        np.testing.assert_allclose(y, np.sum(np.sin(x) * x + x**2), rtol=1e-9)
    assert b.compilations == 3  # one graph per shape, each compiled once


def test_a_changed_global_is_seen(b):
    x = np.arange(3.0)
    vg = ad.prepare_value_and_gradient(b, scaled, x)
    np.testing.assert_allclose(vg(x)[1], 4 * x)
    np.testing.assert_allclose(ad.value_and_gradient(b, scaled, x)[1], 4 * x)
    global SCALE
    old, SCALE = SCALE, 3.0
    try:
        np.testing.assert_allclose(vg(x)[1], 6 * x)
        np.testing.assert_allclose(ad.value_and_gradient(b, scaled, x)[1], 6 * x)
    finally:
        SCALE = old
    np.testing.assert_allclose(vg(x)[1], 4 * x)


def test_threads_calling_one_prepared_gradient(b):
    xs = [np.linspace(-1.0, 1.0, 10) * (i + 1) for i in range(8)]
    vg = ad.prepare_value_and_gradient(b, tiny, xs[0])
    vg(xs[0])
    errors = []

    def work(x):
        for _ in range(200):
            if not np.allclose(vg(x)[1], tiny_grad(x)):
                errors.append(x)

    threads = [threading.Thread(target=work, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

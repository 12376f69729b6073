"""A numpy array captured by f, seen by a float32 jax trace, then by a float64 one.

jax (jaxlib 0.10) keeps its conversion of a numpy array per array object, not per x64 mode,
while a trace that captured the array is alive; the adapter's float64 calls run in a scoped
x64 mode, so the second trace got the float32 conversion and jax raised a bare
``TypeError: lax.mul requires arguments to have the same dtypes``.  The adapter cannot reach
that memory without changing jax or the user's closure: it now raises an
``ad.ArgumentTypeError`` naming the array and the fix.

Each case runs in a fresh subprocess: whether the stale conversion is still alive depends on
when the cyclic garbage collector last ran, which the tests before it decide.
"""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

_SETUP = """
import gc
import numpy as np
import abstractdiff as ad
from autoray import numpy as anp
rng = np.random.default_rng(1)
w = rng.normal(size=30)
x32 = rng.normal(size=30).astype(np.float32)
f32 = lambda x: anp.sum(x * w)  # kept alive: its float32 trace holds jax's conversion of w
np.testing.assert_allclose(ad.gradient("jax", f32, x32), w.astype(np.float32), rtol=1e-6)
"""


def _run(body: str) -> str:
    code = _SETUP + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_float64_trace_of_an_array_a_float32_trace_captured_raises_a_named_error():
    out = _run("""
        try:
            ad.jacobian("jax", lambda x: x * w, w)
        except ad.ArgumentTypeError as err:
            print("REFUSED", err)
        else:
            raise AssertionError("no error: jax's float32 conversion of w is gone?")
        # the conversion jax holds is float32, as the message says (jax's own memory)
        from jax._src import dtypes
        import jax
        with jax.enable_x64(True):
            assert dtypes.canonicalize_value(w).dtype == np.float32
    """)
    assert "REFUSED" in out
    assert "w float64[30] -> float32" in out
    assert "as an argument" in out


def test_the_fixes_the_error_names_give_the_float64_derivative():
    _run("""
        # w as an argument: converted per call
        jac = ad.jacobian("jax", lambda x, w: x * w, w, w)
        assert jac.dtype == np.float64
        np.testing.assert_allclose(jac, np.diag(w), rtol=1e-15)
        # converted in f with the dtype meant
        import jax.numpy as jnp
        jac = ad.jacobian("jax", lambda x: x * jnp.asarray(w, dtype=x.dtype), w)
        assert jac.dtype == np.float64
        np.testing.assert_allclose(jac, np.diag(w), rtol=1e-15)
        # and once the float32 trace is gone, the capture works as before
        del f32
        gc.collect()
        jac = ad.jacobian("jax", lambda x: x * w, w)
        np.testing.assert_allclose(jac, np.diag(w), rtol=1e-15)
    """)


def test_an_unrelated_dtype_error_is_jax_own():
    # a TypeError that no stale capture explains stays jax's (no false diagnosis)
    out = _run("""
        import jax
        try:
            ad.gradient("jax", lambda x: anp.sum(jax.lax.mul(x, np.ones(30, np.int32))), x32)
        except ad.ArgumentTypeError as err:
            raise AssertionError(f"misdiagnosed: {err}")
        except TypeError as err:
            print("JAX", err)
    """)
    assert "JAX" in out and "same dtypes" in out

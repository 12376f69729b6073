"""Importing abstractdiff (and using the finite-differences backend) loads no AD library.

Each check runs in a fresh interpreter: this test process has already imported
abstractdiff through the pytest plugin, and other tests may have imported torch or jax.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

AD_LIBRARIES = ("torch", "jax", "jaxlib", "tensorflow", "keras", "autograd")


def run_fresh(code: str) -> dict:
    script = textwrap.dedent(
        f"""
        import json, sys
        AD = {AD_LIBRARIES!r}
        def loaded():
            return sorted({{m.partition(".")[0] for m in sys.modules}} & set(AD))
        {textwrap.indent(textwrap.dedent(code), " " * 8).strip()}
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_loads_no_ad_library():
    out = run_fresh(
        """
        assert not loaded(), loaded()  # nothing preloaded by the interpreter itself
        import abstractdiff
        print(json.dumps({"loaded": loaded(), "autoray": "autoray" in sys.modules}))
        """
    )
    assert out["loaded"] == []
    # autoray costs ~90 ms to import; the core loads it on first use (import-time goal).
    assert out["autoray"] is False


def test_registry_and_finite_differences_load_no_ad_library():
    out = run_fresh(
        """
        import numpy as np
        import abstractdiff as ad
        registered = ad.registered_backends()
        available = ad.available_backends()
        b = ad.backend("finite_differences")
        x = np.array([0.5, -1.0])
        g = ad.gradient(b, lambda x: np.sum(x ** 2), x)
        b.value_and_gradient(lambda x: np.sum(x ** 3), x)
        ad.jacobian(b, lambda x: x * 2, x)
        ad.hessian(b, lambda x: np.sum(x ** 3), x)
        ad.hvp(b, lambda x: np.sum(x ** 3), x, x)
        ad.pullback(b, lambda x: x * 2, x)(x)
        ad.pushforward(b, lambda x: x * 2, x)(x)
        ad.derivative(b, np.sin, 0.5)
        ad.to_numpy({"g": g})
        print(json.dumps({"loaded": loaded(), "registered": registered, "available": available,
                          "g": g.tolist()}))
        """
    )
    assert out["loaded"] == [], f"AD libraries imported: {out['loaded']}"
    assert {"torch", "jax", "tensorflow", "autograd"} <= set(out["registered"])
    assert "finite_differences" in out["available"]
    assert abs(out["g"][0] - 1.0) < 1e-9 and abs(out["g"][1] + 2.0) < 1e-9


def test_importing_an_adapter_registers_no_translation():
    """The portable tables are applied when a backend is created, never on an adapter's import,
    and never over numpy's own functions (abstractdiff.portable)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("autograd") is None:
        pytest.skip("autograd is not installed")
    out = run_fresh(
        """
        import autoray, numpy as np
        def module_of(lib, name):
            try:
                return getattr(autoray.get_lib_fn(lib, name), "__module__", None)
            except (AttributeError, ImportError):
                return None
        import abstractdiff.adapters.autograd  # the adapter module alone
        from abstractdiff import portable
        imported = {"applied": sorted(portable.applied()), "logsumexp": module_of("autograd", "logsumexp")}
        import abstractdiff as ad
        ad.backend("autograd")
        created = {"applied": sorted(portable.applied()), "logsumexp": module_of("autograd", "logsumexp"),
                   "numpy_where_is_numpys": autoray.get_lib_fn("numpy", "where") is np.where}
        print(json.dumps({"imported": imported, "created": created}))
        """
    )
    assert out["imported"]["applied"] == [] and out["imported"]["logsumexp"] != "abstractdiff.portable.autograd"
    assert out["created"]["applied"] == ["autograd", "numpy"]
    assert out["created"]["logsumexp"] == "abstractdiff.portable.autograd"
    assert out["created"]["numpy_where_is_numpys"]

"""ad.to_numpy on every backend's arrays."""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad


def test_numpy_and_static_leaves_pass_through():
    tree = {"a": np.ones(2), "n": 3, "s": "x", "z": None}
    out = ad.to_numpy(tree)
    assert out["a"] is tree["a"] and out["n"] == 3 and out["s"] == "x" and out["z"] is None


def test_torch_tensors_requiring_grad_and_bfloat16():
    torch = pytest.importorskip("torch")
    t = torch.ones(2, requires_grad=True)
    np.testing.assert_array_equal(ad.to_numpy(t), [1.0, 1.0])
    assert t.requires_grad and t.grad is None
    half = ad.to_numpy(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert half.dtype.name == "bfloat16"  # ml_dtypes keeps the dtype numpy lacks
    np.testing.assert_array_equal(half.astype(np.float32), [1.5, -2.0])


def test_jax_tensorflow_autograd_values():
    for name in ("jax", "tensorflow"):
        if name in ad.available_backends():
            b = ad.backend(name)
            out = ad.to_numpy(b.asarray(np.arange(3.0)))
            assert isinstance(out, np.ndarray) and out.dtype == np.float64
    if "tensorflow" in ad.available_backends():
        import tensorflow as tf

        np.testing.assert_array_equal(ad.to_numpy(tf.Variable([1.0, 2.0])), [1.0, 2.0])

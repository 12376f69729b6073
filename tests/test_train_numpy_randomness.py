"""A loss that draws from numpy's global random state under a compiled training step (issue
46, item 11): the trace ran the loss once, so every step reused the numbers drawn then and
compiled and op-by-op runs differed silently.  Refused now, with the portable way."""

from __future__ import annotations

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff import optim


def _noisy_loss(w, x):
    noise = np.random.normal(size=x.shape)  # numpy's global generator, inside the loss
    return anp.sum((w * (x + anp.asarray(noise, like=w))) ** 2)


def _step(b: ad.Backend, loss, *extra):
    w = b.asarray(np.array([1.0, 2.0]))
    state = optim.setup(optim.Descent(0.1), w)
    batch = (b.asarray(np.ones(2)), *extra)
    return ad.train_step(loss, w, batch, state, backend=b), w, state


@pytest.mark.parametrize("name", ["jax", "tensorflow"])
def test_numpy_randomness_in_a_compiled_step_is_refused(name):
    pytest.importorskip(name)
    b = ad.backend(name)
    np.random.seed(0)
    with pytest.raises(ad.InvalidArgumentError, match="numpy's global random state.*pass randomness in"):
        _step(b, _noisy_loss)
    with pytest.raises(ad.InvalidArgumentError, match="numpy's global random state"):  # again, not a fallback
        _step(b, _noisy_loss)


@pytest.mark.parametrize("name", ["jax", "tensorflow"])
def test_randomness_passed_in_the_batch_compiles_and_matches_op_by_op(name):
    pytest.importorskip(name)

    def loss(w, x, noise):
        return anp.sum((w * (x + noise)) ** 2)

    noise = np.random.default_rng(1).normal(size=2)
    got = _step(ad.backend(name), loss, ad.backend(name).asarray(noise))[0]
    want = _step(ad.backend(name, compile=False), loss, ad.backend(name, compile=False).asarray(noise))[0]
    np.testing.assert_allclose(ad.to_numpy(got[1]), ad.to_numpy(want[1]), rtol=1e-12)


def test_an_op_by_op_step_draws_anew():
    pytest.importorskip("jax")
    b = ad.backend("jax", compile=False)
    np.random.seed(0)
    (state, w, _), _, _ = _step(b, _noisy_loss)
    assert np.all(np.isfinite(ad.to_numpy(w)))

"""A compiled TensorFlow step cycling through more batch shapes than its cache holds (issue
46, item 10): each evicted XLA function was compiled again, and XLA keeps every executable
it compiles, so the process grew about 1.2 MB a step.  Past the bound, new signatures are
plain graphs, which are freed with their functions.  Each keeps its exact shapes: a graph
of unknown sizes would be shared, but a loss that reads a size in Python would silently
compute something else in it (found by an attack)."""

from __future__ import annotations

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim


def test_signatures_past_the_bound_are_plain_graphs():
    tf = pytest.importorskip("tensorflow")
    from abstractdiff.adapters.tensorflow import _CONCRETE_PER_STEP

    adapter = ad.backend("tensorflow").adapter
    original, built = adapter._concrete, []

    def recording(step, sizes, flat, xla):
        built.append(xla)
        return original(step, sizes, flat, xla)

    adapter._concrete = recording  # this adapter only, undone below
    try:
        run = adapter._compiler(lambda xs: [tf.reduce_sum(x * x) for x in xs])
        for n in range(1, _CONCRETE_PER_STEP + 5):
            (total,) = run([tf.ones(n, tf.float64)])
            assert float(total) == n
    finally:
        del adapter._concrete
    assert built == [True] * _CONCRETE_PER_STEP + [False] * 4


def test_a_loss_that_reads_a_batch_size_is_right_past_the_bound():
    tf = pytest.importorskip("tensorflow")
    from abstractdiff.adapters.tensorflow import _CONCRETE_PER_STEP

    def loss(m, x, y):
        e = (tf.matmul(x, m["w"]) - y) ** 2
        return tf.reduce_sum(e) if x.shape[0] == 5 else tf.reduce_mean(e)  # a size read in Python

    rng = np.random.default_rng(0)
    sizes = range(_CONCRETE_PER_STEP + 9, 2, -1)  # past the bound before the batch of 5 comes
    batches = [(tf.constant(rng.normal(size=(n, 3))), tf.constant(rng.normal(size=(n, 1)))) for n in sizes]
    losses = {}
    for compiled in (False, True):
        model = {"w": tf.zeros((3, 1), tf.float64)}
        state = optim.setup(optim.Momentum(0.05), model)
        b = ad.backend("tensorflow", compile=compiled)
        out = []
        for batch in batches:
            state, model, loss_value = ad.train_step(loss, model, batch, state, backend=b)
            out.append(float(loss_value))
        losses[compiled] = out
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-12)

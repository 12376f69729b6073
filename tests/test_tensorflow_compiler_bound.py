"""A compiled TensorFlow step cycling through more batch shapes than its cache holds (issue
46, item 10): each evicted XLA function was compiled again, and XLA keeps every executable
it compiles, so the process grew about 1.2 MB a step (0.16 MB a step with plain graphs
traced per shape).  Past the bound, the dimensions that have varied are traced as unknown,
once, so the cycling shapes share one plain graph."""

from __future__ import annotations

import pytest

import abstractdiff as ad


def _recording(adapter, built):
    original = adapter._concrete

    def recording(step, sizes, flat, xla, shapes=None):
        built.append((xla, shapes))
        return original(step, sizes, flat, xla, shapes)

    adapter._concrete = recording  # this adapter only, undone by the caller


def test_signatures_past_the_bound_share_one_graph_with_the_varied_sizes_unknown():
    tf = pytest.importorskip("tensorflow")
    from abstractdiff.adapters.tensorflow import _CONCRETE_PER_STEP

    adapter = ad.backend("tensorflow").adapter
    built: list = []
    _recording(adapter, built)
    try:
        run = adapter._compiler(lambda w, xs: [tf.reduce_sum(w * x) for x in xs])
        w = tf.constant([[2.0], [3.0]], tf.float64)
        for _cycle in range(3):
            for n in range(1, _CONCRETE_PER_STEP + 5):
                (total,) = run(w, [tf.ones((2, n), tf.float64)])
                assert float(total) == 5 * n
    finally:
        del adapter._concrete
    # one XLA graph per shape up to the bound, then one plain graph whose batch size is unknown
    # (w's shape, the same throughout, stays known)
    assert built == [(True, None)] * _CONCRETE_PER_STEP + [(False, ((2, 1), (2, None)))]


def test_a_step_that_needs_static_sizes_is_traced_per_shape_past_the_bound():
    tf = pytest.importorskip("tensorflow")
    from abstractdiff.adapters.tensorflow import _CONCRETE_PER_STEP

    adapter = ad.backend("tensorflow").adapter
    built: list = []
    _recording(adapter, built)
    try:
        # a Python int of the shape: None in a graph of unknown size, so that trace fails
        run = adapter._compiler(lambda xs: [tf.reduce_sum(xs[0]) / int(xs[0].shape[0])])
        for n in range(1, _CONCRETE_PER_STEP + 4):
            (mean,) = run([tf.fill((n,), tf.constant(3.0, tf.float64))])
            assert float(mean) == 3.0
    finally:
        del adapter._concrete
    assert [xla for xla, _ in built[_CONCRETE_PER_STEP:]] == [False] * 4  # relaxed once (fails), then exact

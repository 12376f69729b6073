"""A compiled TensorFlow step cycling through more batch shapes than its cache holds (issue
46, item 10): each evicted XLA function was compiled again, and XLA keeps every executable
it compiles, so the process grew about 1.2 MB a step.  Past the bound, new signatures are
plain graphs, which are freed with their functions (measured: 1.44 to 0.16 MB a step over
20 cycling shapes; a bounded cache of 10 shapes stays flat)."""

from __future__ import annotations

import pytest

import abstractdiff as ad


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

"""A training step is all or nothing (issue 46): a step that raises leaves the model, its
buffers and the optimiser state as they were, and ``ad.train`` hands back the last
consistent ``(state, model)`` with whatever it propagates.

The interrupt test delivers SIGINT at seeded random points of the step machinery (the
N-th Python call inside the step, counted by a profile hook: mid-forward, between two
assignments, inside the undo...), from inside the loss and from callbacks, and raises
from callbacks; each time it resumes from what the caller holds.  The reference is the
same run never interrupted, compared bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import zlib

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim

STEPS = 10
INTERRUPTS = 20


class Boom(Exception):
    """A callback's own exception."""


def _data(rng: np.random.Generator) -> list:
    return [(rng.normal(size=(4, 2)), rng.normal(size=(4, 1))) for _ in range(STEPS)]


# ------------------------------------------------------------------ the models, per backend and mode
def _torch_case(implicit: bool):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    data = [(torch.tensor(x), torch.tensor(y)) for x, y in _data(np.random.default_rng(1))]
    if implicit:
        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 1)).double()

        def loss(m, x, y):
            return ((m(x) - y) ** 2).mean()

        def values(m):
            return [t.detach().clone().numpy() for t in m.state_dict().values()]

        return make, loss, data, ad.Implicit("torch"), values

    def make():
        rng = np.random.default_rng(0)
        return {"w": torch.tensor(rng.normal(size=(2, 1))), "b": torch.zeros(1, dtype=torch.float64)}

    def loss(m, x, y):
        return ((x @ m["w"] + m["b"] - y) ** 2).mean()

    return make, loss, data, "torch", lambda m: [ad.to_numpy(m["w"]), ad.to_numpy(m["b"])]


def _jax_case(implicit: bool):
    pytest.importorskip("jax")
    data = _data(np.random.default_rng(1))

    def init():
        rng = np.random.default_rng(0)
        return {"w": rng.normal(size=(2, 1)), "b": np.zeros(1)}

    if implicit:
        def make():
            return ad.variables(init(), "jax")

        def loss(m, x, y):
            from abstractdiff._implicit import current_values

            v = current_values(m)
            return ((x @ v["w"] + v["b"] - y) ** 2).mean()

        return make, loss, data, ad.Implicit("jax"), lambda m: [np.asarray(ad.to_numpy(m[k].value)) for k in "wb"]

    def loss(m, x, y):
        return ((x @ m["w"] + m["b"] - y) ** 2).mean()

    return init, loss, data, "jax", lambda m: [np.asarray(ad.to_numpy(m[k])) for k in "wb"]


def _tf_case(implicit: bool):
    tf = pytest.importorskip("tensorflow")
    data = [(tf.constant(x), tf.constant(y)) for x, y in _data(np.random.default_rng(1))]

    def init():
        rng = np.random.default_rng(0)
        return {"w": tf.constant(rng.normal(size=(2, 1))), "b": tf.zeros(1, tf.float64)}

    if implicit:
        def make():
            m = {k: tf.Variable(v) for k, v in init().items()}
            m["mean"] = tf.Variable(tf.zeros(2, tf.float64), trainable=False)  # a buffer the forward pass writes
            return m

        def loss(m, x, y):
            m["mean"].assign(0.9 * m["mean"] + 0.1 * tf.reduce_mean(x, 0))
            centred = x - m["mean"]
            return tf.reduce_mean((centred @ m["w"] + m["b"] - y) ** 2)

        return make, loss, data, ad.Implicit("tensorflow"), lambda m: [v.numpy() for v in m.values()]

    def loss(m, x, y):
        return tf.reduce_mean((x @ m["w"] + m["b"] - y) ** 2)

    return init, loss, data, "tensorflow", lambda m: [m[k].numpy() for k in "wb"]


CASES = {"torch": _torch_case, "jax": _jax_case, "tensorflow": _tf_case}


# ------------------------------------------------------------------ the interrupts
class Interrupter:
    """SIGINT at the ``at``-th Python call inside ``inside`` (a code object), counted by a
    profile hook: a seeded random point of the step machinery.  The call and return of
    ``inside`` itself are left out: a signal there is raised in the caller's frame, before
    or after the call (Python cannot hand a result over and raise in one go).  ``at`` None:
    counts only."""

    def __init__(self, inside, at: int | None):
        self.inside, self.at, self.count, self.depth, self.fired = inside, at, 0, 0, False

    def __call__(self, frame, event, arg):
        if frame.f_code is self.inside and event in ("call", "return"):
            self.depth += 1 if event == "call" else -1
            return
        # Python calls only: an exception from a profile hook at a "c_call" event cancels the C
        # call, which a real signal never does, and the normal exit of `with lock:` is such a
        # call (lock.__exit__), outside the block's handler: it leaked a lock of jax's
        # (functools.cached_property's, shared by every instance), and later jax calls from
        # other threads of this worker waited for it forever.  A real SIGINT is raised at
        # checkpoints such as a Python function's entry, which "call" events model; not at the
        # entry of an __exit__ (a context manager's, contextlib's), which would leak the same way.
        if self.depth and not self.fired and event == "call" and frame.f_code.co_name != "__exit__":
            self.count += 1
            if self.at is not None and self.count >= self.at:
                self.fired = True
                signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def _profiled(hook):
    """``hook`` as the profile function, with the cyclic garbage collector paused: it runs
    finalizers (``__del__``, weakref callbacks) at points that depend on what earlier tests
    allocated, and a SIGINT raised in a finalizer is ignored (printed as unraisable), so the
    calls counted and the interrupts that land would change from run to run."""
    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()


def _reference(case: str, implicit: bool):
    """The run never interrupted, and how many Python calls each of its steps made."""
    make, loss, data, backend, values = CASES[case](implicit)
    model = make()
    state = optim.setup(optim.Adam(0.05), model)
    counter, marks = Interrupter(ad.train.__code__, None), []
    with _profiled(counter):
        state, model = ad.train(loss, model, data, state, backend=backend, progress=False,
                                callbacks=[lambda info: marks.append(counter.count)])
    # a step's calls once compiled (the first step's trace is cached: resumed runs do not repeat it)
    per_step = int(np.median(np.diff([0, *marks])))
    return values(model), state, per_step


def _run_interrupted(case: str, implicit: bool, via_train: bool, seed: int, per_step):
    """The run interrupted INTERRUPTS times, twice in each step, each time at another point,
    each time resumed from what the caller holds; then finished.  Returns the final values,
    the state and how the interrupts landed."""
    make, loss, data, backend, values = CASES[case](implicit)
    rng = np.random.default_rng(seed)
    model = make()
    state = optim.setup(optim.Adam(0.05), model)
    fired: list[str] = []
    planned: list[str] = []
    calls = {"loss": 0}
    plan: dict = {"kind": "none", "at": None}

    def counted_loss(m, x, y):
        calls["loss"] += 1
        if plan["kind"] == "loss" and calls["loss"] == plan["at"]:
            signal.raise_signal(signal.SIGINT)
        return loss(m, x, y)

    def callback(info):
        if plan["kind"] in ("callback", "callback_sigint") and info.step == plan["at"]:
            if plan["kind"] == "callback":
                raise Boom(f"callback at step {info.step}")
            signal.raise_signal(signal.SIGINT)

    def run(upto: int, hook) -> None:
        nonlocal state, model
        held_state, held_model = state, model
        try:
            with _profiled(hook):
                if via_train:
                    state, model = ad.train(counted_loss, model, data[state.step:upto], state, backend=backend,
                                            callbacks=[callback], progress=False)
                else:
                    for batch in data[state.step:upto]:
                        state, model, _ = ad.train_step(counted_loss, model, batch, state, backend=backend)
        except (KeyboardInterrupt, Boom) as err:
            fired.append(f"{plan['kind']}@{held_state.step}:{type(err).__name__}")
            if via_train:  # what ad.train hands back (no attributes: it raised before it began)
                if plan["kind"].startswith("callback"):  # after a completed step: that step is kept
                    assert err.state.step == plan["at"], (plan, err)
                state, model = getattr(err, "state", held_state), getattr(err, "model", held_model)

    target = ad.train if via_train else ad.train_step
    for step in range(STEPS):
        for _ in range(INTERRUPTS // STEPS):
            plan = {"kind": "none", "at": None}
            run(step, None)  # catch up, uninterrupted, where the last interrupt came after this step
            kind = rng.choice(["profile"] * 6 + ["loss"] + ["callback", "callback_sigint"] * via_train)
            planned.append(str(kind))
            plan = {"kind": kind, "at": None}
            if kind == "profile":
                plan["at"] = int(rng.integers(1, max(2, per_step)))
            elif kind == "loss":
                plan["at"] = calls["loss"] + 1  # the next loss call (a compiled step calls it when it traces)
            else:
                plan["at"] = state.step + 1
            run(STEPS, Interrupter(target.__code__, plan["at"]) if kind == "profile" else None)
    plan = {"kind": "none", "at": None}
    run(STEPS, None)
    assert state.step == STEPS
    return values(model), state, fired, planned


RUNS = [("torch", False, True), ("torch", True, True), ("torch", True, False),
        ("jax", False, True), ("jax", True, True),
        ("tensorflow", False, True), ("tensorflow", True, True)]


@pytest.mark.parametrize(("case", "implicit", "via_train"), RUNS,
                         ids=[f"{c}-{'implicit' if i else 'explicit'}-{'train' if t else 'train_step'}"
                              for c, i, t in RUNS])
def test_interrupted_training_resumes_bit_for_bit(case, implicit, via_train):
    expected, ref_state, per_step = _reference(case, implicit)
    seed = zlib.crc32(f"{case}{implicit}{via_train}".encode())
    got, state, fired, planned = _run_interrupted(case, implicit, via_train, seed, per_step)
    # at least half the planned interrupts landed (a point past the run's end may not); not
    # counting those planned in the loss, which a compiled step calls only when it traces
    # (whether it traces again depends on what earlier tests left in the compiled-step cache).
    # Run alone, all land; in the full suite, on compiled TensorFlow, 11 of 17 did: its steps
    # there make fewer Python calls than the reference counted (not understood yet)
    landed = [f for f in fired if not f.startswith("loss@")]
    assert len(landed) >= sum(k != "loss" for k in planned) // 2, (planned, fired)
    assert state.step == ref_state.step == STEPS
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(ad.to_numpy(optim._state.pytree.tree_leaves(state.tree)),
                    ad.to_numpy(optim._state.pytree.tree_leaves(ref_state.tree))):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ item 1: buffers after a failed step
def test_torch_batchnorm_statistics_survive_a_non_finite_step():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    bad = x.clone()
    bad[0, 0] = float("nan")
    state = optim.setup(optim.Adam(1e-2), m)

    def loss(m, x, y):
        return ((m(x) - y) ** 2).mean()

    state, m, _ = ad.train_step(loss, m, (x, y), state, backend=ad.Implicit("torch"))
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    with pytest.raises(ad.NonFiniteError):
        ad.train_step(loss, m, (bad, y), state, backend=ad.Implicit("torch"))
    for k, v in m.state_dict().items():  # running statistics and the batch count too
        assert torch.equal(v, before[k]), k


def test_keras_batchnormalization_survives_a_non_finite_compiled_step():
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                          keras.layers.Dense(1)])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 2)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
    bad = x.copy()
    bad[0, 0] = np.nan

    def loss(m, x, y):
        return keras.ops.mean((m(x, training=True) - y) ** 2)

    b = ad.Implicit("tensorflow")  # compiled: the whole step is one tf.function
    state = optim.setup(optim.Adam(1e-2), m)
    state, m, _ = ad.train_step(loss, m, (x, y), state, backend=b)
    before = [v.numpy().copy() for v in m.variables]
    with pytest.raises(ad.NonFiniteError):
        ad.train_step(loss, m, (bad, y), state, backend=b)
    for v, was in zip(m.variables, before):
        np.testing.assert_array_equal(v.numpy(), was, err_msg=v.path)


def test_an_exception_in_the_loss_leaves_buffers_as_they_were():
    torch = pytest.importorskip("torch")
    m = torch.nn.BatchNorm1d(2)
    state = optim.setup(optim.Descent(0.1), m)
    before = {k: v.clone() for k, v in m.state_dict().items()}

    def loss(m, x):
        m(x)  # writes the running statistics
        raise Boom("after the forward pass")

    with pytest.raises(Boom):
        ad.train_step(loss, m, (torch.randn(4, 2),), state, backend=ad.Implicit("torch"))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


# ------------------------------------------------------------------ item 7: the state's shapes
def test_a_state_for_other_shapes_is_refused():
    state = optim.setup(optim.Adam(0.1), {"w": np.zeros(1)})  # broadcastable against (3,)
    with pytest.raises(ad.ShapeMismatchError, match=r"path \('w',\).*shape \(1,\).*shape \(3,\).*optim.setup"):
        optim.update(state, {"w": np.zeros(3)}, {"w": np.ones(3)})
    scalar = optim.setup(optim.Adam(0.1), {"w": np.zeros(())})  # 0-d moments broadcast against (3,) too
    with pytest.raises(ad.ShapeMismatchError, match=r"shape \(\) and dtype float64.*shape \(3,\)"):
        optim.update(scalar, {"w": np.zeros(3)}, {"w": np.ones(3)})
    other_rule = optim.setup(optim.Momentum(0.1), {"w": np.zeros(3)})._replace(rule=optim.Adam(0.1))
    with pytest.raises(ad.ShapeMismatchError, match="a state of another rule"):
        optim.update(other_rule, {"w": np.zeros(3)}, {"w": np.ones(3)})
    chained = optim.setup(optim.chain(optim.ClipNorm(1.0), optim.Adam(0.1)), {"w": np.zeros(3)})
    with pytest.raises(ad.ShapeMismatchError, match="a state of another rule"):  # Adam's 3 leaves, nested deeper
        optim.update(chained._replace(rule=optim.Adam(0.1)), {"w": np.zeros(3)}, {"w": np.ones(3)})
    counted = optim.setup(optim.Adam(0.1), {"w": np.zeros(3)})
    new, _ = optim.update(counted, {"w": np.zeros(3)}, {"w": np.ones(3)})  # the count leaf (a number) is accepted
    assert new.tree["w"][2] == 1
    torch = pytest.importorskip("torch")
    m = torch.nn.Linear(2, 2)
    state = optim.setup(optim.Momentum(0.1), m)
    state = state._replace(tree=[torch.zeros(2, 1), state.tree[1]])  # a state of another model's shapes
    with pytest.raises(ad.ShapeMismatchError, match="variable 0"):
        ad.train_step(lambda m, x: m(x).sum(), m, (torch.ones(1, 2),), state, backend=ad.Implicit("torch"))


# ------------------------------------------------------------------ item 9: data and validation alike
def test_train_data_takes_the_forms_validation_takes():
    x, y = np.ones((4, 2)), np.zeros((4, 1))

    def loss(m, x, y):
        return (((x @ m["w"]) - y) ** 2).sum()

    model = {"w": np.ones((2, 1))}
    state = optim.setup(optim.Descent(0.01), model)
    run = ad.train(loss, model, (x, y), state, backend="finite_differences", validation=(x, y), progress=False)
    assert run.state.step == 1 and len(run.history.losses) == 1  # one batch, as validation=(x, y)
    with pytest.raises(ad.ArgumentTypeError, match="data must be batches"):
        ad.train(loss, model, None, state, backend="finite_differences", progress=False)


# ------------------------------------------------------------------ item 6: the compiled step's caches
def test_compiled_step_cache_is_bounded_and_thread_safe():
    jax = pytest.importorskip("jax")
    import threading

    def steps():
        import abstractdiff._compiled_step  # noqa: F401 (registers the compiled steps' cache)

        return next(c for c in ad.cache_info() if c.name == "compiled training steps")

    assert steps().bound >= 1

    def loss(m, x):
        return ((x @ m["w"]) ** 2).sum()

    errors = []
    # jax's first device_put computes a functools.cached_property, whose lock in Python 3.11
    # can deadlock threads that reach it together (CPython gh-87634, fixed in 3.12): once here
    jax.device_put(np.ones((2, 1)))

    def worker(rows: int) -> None:
        try:
            model = {"w": np.ones((2, 1))}
            state = optim.setup(optim.Descent(0.01), model)
            for _ in range(30):
                state, model, _ = ad.train_step(loss, model, (np.ones((rows, 2)),), state, backend="jax")
        except Exception as err:  # noqa: BLE001 - collected for the assertion
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 2, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert steps().size <= steps().bound


# ---------------------------------------------------------------- found by the attack
def test_a_gradient_of_another_shape_is_refused():
    model = {"w": np.ones((2, 1))}
    for rule, grad in [(optim.Descent(0.1), np.ones((2, 2))), (optim.Adam(0.1), np.ones((1, 1)))]:
        with pytest.raises(ad.ShapeMismatchError, match="gradient of .* has shape"):
            optim.update(optim.setup(rule, model), model, {"w": grad})
    assert model["w"].shape == (2, 1) and np.all(model["w"] == 1.0)


def test_a_list_of_arrays_as_data_is_refused_with_the_forms():
    b = ad.backend("finite_differences")
    w = np.ones(2)
    x, y = np.ones((4, 2)), np.ones(4)
    state = optim.setup(optim.Descent(0.1), w)
    for data, validation in [([x, y], None), ([(x, y)], [x, y])]:
        with pytest.raises(ad.ArgumentTypeError, match="list of 2 arrays.*tuple"):
            ad.train(lambda w, x, y: np.sum((x @ w - y) ** 2), w, data, state, backend=b, validation=validation)


def test_a_non_persistent_buffer_is_restored_after_a_failed_step():
    torch = pytest.importorskip("torch")

    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1).double()
            # not in state_dict (checkpoints leave it out), but the forward pass writes it
            self.register_buffer("seen", torch.zeros(2, dtype=torch.float64), persistent=False)

        def forward(self, x):
            self.seen += x.mean(0)
            return self.lin(x)

    def failing(m, x, y):
        m(x)
        raise RuntimeError("after the forward pass")

    x, y = torch.ones(3, 2, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64)
    for compile_ in (True, False):
        m = Counting()
        state = optim.setup(optim.Adam(0.1), m)
        with pytest.raises(RuntimeError, match="after the forward pass"):
            ad.train_step(failing, m, (x, y), state, backend=ad.Implicit(ad.backend("torch", compile=compile_)))
        assert torch.equal(m.seen, torch.zeros(2, dtype=torch.float64))

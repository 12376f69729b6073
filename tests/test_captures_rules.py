"""Issue 45, items 3 and 8: what a trace depends on besides ``f``'s own globals.

* Item 3: the globals read by the functions a custom rule or an implicit solver calls
  (``bwd``, ``jvp``, the optimality function): every call sees their current values, as it
  sees ``f``'s, prepared and unprepared, and in a compiled ``ad.train_step``.
* Item 8: an options object passed as an argument and changed in place between calls, and a
  global MLX array written in place: a backend that reuses traces traces again (unprepared)
  or refuses (prepared), never the old trace.

The oracles are closed forms (the derivative the rule states, which a stale trace would
give for the old value).
"""

from __future__ import annotations

import dataclasses
import functools
import types

import autoray
import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
import abstractdiff._cache as cache
from abstractdiff._captures import CaptureWatch, capture_guard, captures

#: every exact backend, and MLX's compiled mode; the tests of traces skip those that do not
#: reuse traces (they run f on each call), the tests of options objects check them too
EXACT = [n for n in ad.available_backends() if n not in ("finite_differences", "implicit")]
CONFIGS = [(n, {}) for n in EXACT] + ([("mlx", {"compile": True})] if "mlx" in EXACT else [])
IDS = [n + ("-compile" if o else "") for n, o in CONFIGS]


def backend(name: str, options: dict) -> ad.Backend:
    try:
        return ad.backend(name, **options)
    except ad.BackendUnavailableError as err:
        pytest.skip(str(err))


def tracing(name: str, options: dict) -> ad.Backend:
    b = backend(name, options)
    if not b.reuses_traces:
        pytest.skip(f"{b!r} runs f on each call: nothing is frozen")
    return b


def native(b: ad.Backend, a: np.ndarray):
    return b.convert(np.asarray(a, dtype=np.float32 if b.name == "mlx" else np.float64))


def value(a) -> np.ndarray:
    return np.asarray(ad.to_numpy(a), dtype=np.float64)


# ===================================================================== item 3
SCALE = 2.0


@ad.custom_vjp
def scaled_identity(x):
    return x


scaled_identity.defvjp(lambda x: (x, None), lambda _, ct: (SCALE * ct,))


def vjp_loss(x):
    return anp.sum(scaled_identity(x))


def both(b, f, x, *args):
    """The gradient unprepared and by a prepared operator made before the change (``both(...)``
    returns a function that computes the pair now)."""
    prepared = ad.prepare_gradient(b, f, x, *args)
    return lambda: (value(ad.gradient(b, f, x, *args)), value(prepared(x, *args)))


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_a_global_read_by_a_custom_vjp_bwd_is_seen(name, options):
    global SCALE
    b = tracing(name, options)
    x = native(b, np.ones(3))
    SCALE = 2.0
    grads = both(b, vjp_loss, x)
    try:
        for scale in (2.0, 3.0, 3.0):
            SCALE = scale
            for got in grads():
                np.testing.assert_allclose(got, np.full(3, scale), rtol=1e-6)
    finally:
        SCALE = 2.0


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_a_rule_given_again_is_seen(name, options):
    # defvjp on the same custom function: the object is the same, its bwd is another
    b = tracing(name, options)
    clip = ad.custom_vjp(lambda x: x)
    clip.defvjp(lambda x: (x, None), lambda _, ct: (2.0 * ct,))

    def f(x):
        return anp.sum(clip(x))

    x = native(b, np.ones(2))
    grads = both(b, f, x)
    for got in grads():
        np.testing.assert_allclose(got, [2.0, 2.0])
    clip.defvjp(lambda x: (x, None), lambda _, ct: (5.0 * ct,))
    for got in grads():
        np.testing.assert_allclose(got, [5.0, 5.0])


JVP_SCALE = 2.0


@ad.custom_jvp
def jvp_scaled(x):
    return x


@jvp_scaled.defjvp
def _jvp_scaled(primals, tangents):
    return primals[0], JVP_SCALE * tangents[0]


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_a_global_read_by_a_custom_jvp_rule_is_seen_in_forward_mode(name, options):
    global JVP_SCALE
    b = tracing(name, options)
    x, v = native(b, np.ones(2)), native(b, np.array([1.0, -1.0]))
    prepared = ad.prepare_pushforward(b, jvp_scaled, x)
    try:
        for scale in (2.0, 3.0):
            JVP_SCALE = scale
            for got in (ad.pushforward(b, jvp_scaled, x)(v), prepared(x)(v)):
                np.testing.assert_allclose(value(got), [scale, -scale], rtol=1e-6)
    finally:
        JVP_SCALE = 2.0


TARGET = 1.0


@ad.custom_root(lambda x, a: x - TARGET * a)
def tracked(init, a):
    return ad.stop_gradient(TARGET * a)


def root_loss(a):
    return anp.sum(tracked(a * 0.0, a))


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_a_global_read_by_a_custom_root_optimality_function_is_seen(name, options):
    # x*(a) = TARGET * a, so dx*/da = TARGET: by the implicit function theorem with the
    # optimality function's current TARGET, never the one of an earlier trace
    global TARGET
    b = tracing(name, options)
    a = native(b, np.array([1.5]))
    TARGET = 1.0
    grads = both(b, root_loss, a)
    try:
        for target in (1.0, 2.0):
            TARGET = target
            for got in grads():
                np.testing.assert_allclose(got, [target], rtol=1e-5)
            # a loss made after the change (a new plan for the loss, the solver's own
            # pullback of its optimality function planned before)
            fresh = lambda a: anp.sum(tracked(a * 0.0, a)) * 1.0  # noqa: E731
            np.testing.assert_allclose(value(ad.gradient(b, fresh, a)), [target], rtol=1e-5)
    finally:
        TARGET = 1.0


RATE = 0.5


@ad.custom_fixed_point(lambda x, a: RATE * x + a)
def contraction(init, a):
    # x* = a / (1 - RATE) directly; the derivative is the implicit function theorem's, from
    # the fixed-point function alone
    return ad.stop_gradient(a / (1.0 - RATE) + 0.0 * init)


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_a_global_read_by_a_fixed_point_function_is_seen(name, options):
    # x* = a / (1 - RATE): dx*/da = 1 / (1 - RATE)
    global RATE
    b = tracing(name, options)
    a = native(b, np.array([1.0, 2.0]))

    def f(a):
        return anp.sum(contraction(a * 0.0, a))

    grads = both(b, f, a)
    try:
        for rate in (0.5, 0.75):
            RATE = rate
            for got in grads():
                np.testing.assert_allclose(got, np.full(2, 1.0 / (1.0 - rate)), rtol=1e-4)
    finally:
        RATE = 0.5


#: the backends whose train_step compiles as a whole
COMPILING = [("jax", {}), ("tensorflow", {}), ("mlx", {"compile": True})]


@pytest.mark.parametrize("name,options", COMPILING, ids=[n for n, _ in COMPILING])
def test_a_compiled_train_step_sees_a_global_its_rule_reads(name, options):
    import abstractdiff._compiled_step as cs
    from abstractdiff import optim

    global SCALE
    b = backend(name, options)
    dtype = np.float32 if name == "mlx" else np.float64
    x = b.convert(np.array([1.0, -2.0, 0.5], dtype=dtype))
    w0 = np.array([0.3, 0.1, -0.2], dtype=dtype)

    def loss(m, x):
        return anp.sum(scaled_identity(m["w"]) * x)  # gradient: SCALE * x

    def steps(compiled: bool):
        global SCALE
        saved = cs._compiler
        if not compiled:
            cs._compiler = lambda b: None  # the op-by-op step
        try:
            model = {"w": b.convert(w0.copy())}
            state = optim.setup(optim.Descent(0.1), model)
            out = []
            for scale in (2.0, 2.0, 3.0, -1.0):
                SCALE = scale
                state, model, _ = ad.train_step(loss, model, (x,), state, backend=b)
                out.append(value(model["w"]))
            return out
        finally:
            cs._compiler = saved
            SCALE = 2.0

    cs.STEPS.clear()
    compiled = steps(True)
    assert [e for e in cs.STEPS._entries._entries.values() if e.run is not cs._FAILED], "the step did not compile"
    op_by_op = steps(False)
    w, want = w0.astype(np.float64), []
    for scale in (2.0, 2.0, 3.0, -1.0):
        w = w - 0.1 * scale * value(x)
        want.append(w)
    for got, ref, closed in zip(compiled, op_by_op, want):
        np.testing.assert_allclose(got, closed, rtol=1e-5)
        np.testing.assert_allclose(ref, closed, rtol=1e-5)


# ----------------------------------------- the capture walk and its guard (no library)
class FakeRule:
    """An object of the protocol: it calls ``self.fn`` for the user."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)

    def __abstractdiff_captures__(self):
        return (self.fn, None)


def test_the_walk_follows_the_functions_a_rule_object_names():
    global SCALE
    rule = FakeRule(lambda x: SCALE * x)
    f = lambda x: rule(x) + 1.0  # noqa: E731
    before = captures(f)[0]
    guard, watch = capture_guard(f), CaptureWatch(f)
    direct = CaptureWatch(rule)  # the rule object itself as f
    assert guard is not None and guard.unchanged(f) and watch.unchanged(f) and direct.unchanged(rule)
    SCALE = 3.0
    try:
        assert captures(f)[0] != before
        assert not guard.unchanged(f) and not watch.unchanged(f) and not direct.unchanged(rule)
    finally:
        SCALE = 2.0
    assert captures(f)[0] == before and guard.unchanged(f)
    rule.fn = lambda x: 2.0 * x  # the same object names another function
    assert captures(f)[0] != before and not guard.unchanged(f)


def test_a_helper_of_a_rule_in_another_module_is_followed():
    # a rule's functions are the user's whatever their module: the walk follows them, and
    # their own module's helpers from there
    namespace = {"OFFSET": 1.0}
    exec("def helper(x):\n    return x + OFFSET\ndef bwd(x):\n    return helper(x)\n", namespace)
    namespace["helper"].__module__ = namespace["bwd"].__module__ = "someones_library"
    rule = FakeRule(namespace["bwd"])
    f = lambda x: rule(x)  # noqa: E731
    before, guard = captures(f)[0], capture_guard(f)
    namespace["OFFSET"] = 2.0
    assert captures(f)[0] != before and not guard.unchanged(f)


def test_an_internal_wrapper_is_transparent_and_a_library_function_is_not():
    global SCALE
    import abstractdiff._implicit_diff as internal

    user = lambda x: SCALE * x  # noqa: E731
    wrapper = (lambda user: lambda z: user(z))(user)  # a closure, as abstractdiff's own wrappers are
    wrapper.__module__ = internal.__name__
    library = lambda x: SCALE * x  # noqa: E731
    library.__module__ = "json"  # a function of an installed module (the standard library's)
    theirs = (lambda library: lambda z: library(z))(library)
    keys = {id(w): captures(w)[0] for w in (wrapper, theirs)}
    SCALE = 3.0
    try:
        assert captures(wrapper)[0] != keys[id(wrapper)]  # ours: the user function is followed
        assert captures(theirs)[0] == keys[id(theirs)]  # a library's function: by identity
    finally:
        SCALE = 2.0


# ===================================================================== item 8
class Opts:
    def __init__(self, scale):
        self.scale = scale


@dataclasses.dataclass
class MutableOpts:  # eq=True makes it unhashable: keyed by identity before
    scale: float


class Nested:
    def __init__(self, scale):
        self.inner = Opts(scale)
        self.table = {"weights": np.array([1.0, 1.0])}


def read_scale(opts, like):
    if isinstance(opts, dict):
        return opts["scale"]
    if isinstance(opts, Nested):  # the numpy weights as a constant of x's library
        weights = autoray.do("asarray", opts.table["weights"], like=like)
        return opts.inner.scale * autoray.do("astype", weights, autoray.get_dtype_name(like))
    return opts.scale


def opts_loss(x, opts):
    return anp.sum(read_scale(opts, x) * x**2)


def set_scale(opts, scale):
    if isinstance(opts, dict):
        opts["scale"] = scale
    elif isinstance(opts, Nested):
        opts.inner.scale = scale
    else:
        opts.scale = scale


OPTIONS = {
    "object": lambda: Opts(2.0),
    "dataclass": lambda: MutableOpts(2.0),
    "namespace": lambda: types.SimpleNamespace(scale=2.0),
    "nested": lambda: Nested(2.0),
}


#: every kind of object on jax (the keys are the core's, whatever the library); a plain one elsewhere
OPTION_CASES = [(n, o, kind) for n, o in CONFIGS for kind in (sorted(OPTIONS) if n == "jax" else ["object"])]


@pytest.mark.parametrize("name,options,kind", OPTION_CASES, ids=[f"{i}-{c[2]}" for i, c in
                                                                  zip([n + ("-compile" if o else "") for n, o, _ in
                                                                       OPTION_CASES], OPTION_CASES)])
def test_an_options_object_changed_in_place_is_never_a_stale_trace(name, options, kind):
    b = backend(name, options)
    x = native(b, np.array([1.0, 2.0]))
    opts = OPTIONS[kind]()
    prepared = ad.prepare_gradient(b, opts_loss, x, opts)
    for scale in (2.0, 3.0, 3.0, 0.5):
        set_scale(opts, scale)
        np.testing.assert_allclose(value(ad.gradient(b, opts_loss, x, opts)), 2 * scale * np.array([1.0, 2.0]),
                                   rtol=1e-6)
        if scale == 2.0 or not b.reuses_traces:  # f runs on each call there: it reads the object then
            np.testing.assert_allclose(value(prepared(x, opts)), 2 * scale * np.array([1.0, 2.0]), rtol=1e-6)
        else:  # the prepared trace holds the old value: refused, as a new static value is
            with pytest.raises(ad.ShapeMismatchError, match="attribute values"):
                prepared(x, opts)


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_an_array_inside_an_options_object_is_keyed_by_content(name, options):
    b = tracing(name, options)
    x = native(b, np.array([1.0, 2.0]))
    opts = Nested(1.0)
    np.testing.assert_allclose(value(ad.gradient(b, opts_loss, x, opts)), 2 * value(x))
    opts.table["weights"][1] = 4.0  # in place, inside a dict inside the object
    np.testing.assert_allclose(value(ad.gradient(b, opts_loss, x, opts)), 2 * np.array([1.0, 4.0]) * value(x))


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_an_unchanged_options_object_reuses_its_trace_and_a_dict_stays_right(name, options):
    b = tracing(name, options)
    x = native(b, np.array([1.0, 2.0]))
    opts, calls = Opts(2.0), []

    def counted(x, opts):
        calls.append(1)  # runs when the library traces (or plans) f
        return opts_loss(x, opts)

    for _ in range(3):
        ad.gradient(b, counted, x, opts)
    traced = len(calls)
    for _ in range(3):
        np.testing.assert_allclose(value(ad.gradient(b, counted, x, opts)), [4.0, 8.0])
    assert len(calls) == traced  # the object's state is the same: the same trace
    d = {"scale": 2.0}
    ad.gradient(b, opts_loss, x, d)
    d["scale"] = 5.0
    np.testing.assert_allclose(value(ad.gradient(b, opts_loss, x, d)), [10.0, 20.0])


class Big:
    def __init__(self):
        self.scale = 2.0
        self.items = {f"k{i}": float(i) for i in range(cache.STATE_BUDGET + 1)}


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_an_object_too_large_to_key_is_traced_each_call_and_refused_prepared(name, options):
    b = tracing(name, options)
    x = native(b, np.array([1.0, 2.0]))
    big = Big()
    with pytest.raises(ad.ArgumentTypeError, match="too large"):
        ad.prepare_gradient(b, opts_loss, x, big)
    np.testing.assert_allclose(value(ad.gradient(b, opts_loss, x, big)), [4.0, 8.0])
    big.scale = 3.0
    np.testing.assert_allclose(value(ad.gradient(b, opts_loss, x, big)), [6.0, 12.0])


def test_static_keys():
    static_key = cache.static_key
    class Opts:
        def __init__(self):
            self.scale, self.name, self.w = 2.0, "a", np.ones(3)

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        scale: float

    opts = Opts()
    before = static_key(opts)
    assert static_key(opts) == before
    opts.w[0] = 5.0  # an array attribute, in place
    assert static_key(opts) != before
    opts.w[0], opts.scale = 1.0, -0.0
    assert static_key(opts) != before  # -0.0 is not 2.0, nor 0.0
    assert static_key(Opts()) != static_key(Opts())  # two objects: by identity too
    assert static_key(Frozen(1.0)) == static_key(Frozen(1.0))  # its own equality
    assert static_key(opts, deep=False) == static_key(opts, deep=False)
    fn = functools.partial(print, 1)
    assert static_key(fn) == static_key(fn) and static_key(len) == static_key(len)
    cyclic = Opts()
    cyclic.me = cyclic  # a cycle ends the walk
    assert static_key(cyclic) == static_key(cyclic)


# ------------------------------------------------------ a global MLX array written in place
def test_a_global_mlx_array_written_in_place_is_seen_with_compile():
    mx = pytest.importorskip("mlx.core")
    b = backend("mlx", {"compile": True})
    global WEIGHTS
    WEIGHTS = mx.array([2.0, 2.0])

    def f(x):
        return anp.sum(WEIGHTS * x)

    x = mx.array([1.0, 1.0])
    grads = both(b, f, x)
    for got in grads():
        np.testing.assert_allclose(got, [2.0, 2.0])
    WEIGHTS[...] = 3.0  # in place: the same Python object
    for got in grads():
        np.testing.assert_allclose(got, [3.0, 3.0])
    WEIGHTS[0] = -1.0
    for got in grads():
        np.testing.assert_allclose(got, [-1.0, 3.0])


def test_immutable_and_variable_arrays_keep_identity_keys():
    # a jax array cannot change in place, and a tf.Variable is read when the trace runs:
    # identity keeps a global dataset of them free of per-call hashing
    native_array_key = cache.native_array_key
    jnp = pytest.importorskip("jax.numpy")
    assert native_array_key(jnp.ones(3)) is None
    mx = pytest.importorskip("mlx.core")
    a = mx.array([1.0, 2.0])
    before = native_array_key(a)
    assert before is not None and native_array_key(a) == before
    a[1] = 5.0
    assert native_array_key(a) != before

"""ad.differentiate_with: a kernel of one library inside code another library differentiates."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff.testing._composition import MODES, X, check_pair, kernel, outer_code, reference

# available_backends, not importing: paddle imported after tensorflow crashes (its adapter
# imports it safely)
OUTERS = [name for name in ("torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor")
          if name in ad.available_backends()]
INNERS = OUTERS
#: outer libraries whose forward mode reaches the kernel's pushforward
FORWARD = {"torch", "jax", "tensorflow", "autograd", "mlx", "paddle", "pytensor"}
#: outer libraries whose second derivatives reach the kernel's (the others raise)
SECOND_ORDER = {"torch", "autograd", "mlx", "paddle", "pytensor"}


def scalar(f):
    """A scalar function of ``f``'s vector output (weights that depend on ``t`` too)."""
    return lambda t: anp.sum(f(t) * anp.cos(t[:4]))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("outer", OUTERS)
def test_matrix(outer, inner, dtype):
    """The value outside any derivative, the gradient, the pullback and (where the outer
    library has forward mode through the boundary) the pushforward, against the same
    function in one library: float64 to 1e-12, float32 to 1e-5 (the check ``abstractdiff
    check`` runs, :func:`abstractdiff.testing._composition.check_pair`)."""
    result = check_pair(outer, inner, dtype)
    assert result.ok, result.line()
    want = ["value", "gradient", "pullback"] + (["pushforward"] if outer in FORWARD or outer == inner else [])
    want += ["hessian"] if outer in SECOND_ORDER or outer == inner else []
    assert result.passed == want, result.line()
    assert set(result.refused) == set(MODES[1:]) - set(want), result.line()


@pytest.mark.skipif("jax" not in OUTERS or "torch" not in INNERS, reason="needs jax and torch")
def test_jax_forward_mode_under_jit_and_vmap():
    """jax's forward mode reaches the kernel's pushforward (custom_jvp with a transposable
    custom_linear_solve): jacfwd and jacrev, under jit, and per-sample gradients by vmap."""
    import jax
    import jax.numpy as jnp

    f = outer_code(ad.differentiate_with(kernel, "torch"))
    with jax.enable_x64(True):
        xs = jnp.stack([jnp.asarray(X), jnp.asarray(2 * X)])
        want = jax.jacfwd(reference)(xs[0])
        for op in (jax.jacfwd, jax.jacrev):
            np.testing.assert_allclose(jax.jit(op(f))(xs[0]), want, rtol=1e-12, atol=1e-14)
        tangent = jnp.asarray(np.linspace(-1, 1, X.size))
        got = jax.jit(lambda x: jax.jvp(f, (x,), (tangent,))[1])(xs[0])
        np.testing.assert_allclose(got, jax.jvp(reference, (xs[0],), (tangent,))[1], rtol=1e-12)
        loss = scalar(f)
        np.testing.assert_allclose(jax.vmap(jax.grad(loss))(xs), jax.vmap(jax.grad(scalar(reference)))(xs),
                                   rtol=1e-12)


@pytest.mark.skipif("tensorflow" not in OUTERS or "jax" not in INNERS, reason="needs tensorflow and jax")
@pytest.mark.parametrize("compile", [True, False])
def test_tensorflow_forward_mode_prepared_and_unprepared(compile):
    """tensorflow's ForwardAccumulator reaches the kernel's pushforward eagerly; the
    compiled backend reruns such a function eagerly (TensorFlow's forward mode does not
    reach a numpy_function's gradient in a graph)."""
    import jax.numpy as jnp
    import tensorflow as tf

    b = ad.backend("tensorflow", compile=compile)
    f = outer_code(ad.differentiate_with(kernel, "jax"))
    x, dx = tf.constant(X), tf.constant(np.linspace(-1, 1, X.size))
    want = ad.pushforward(b, reference, x)(dx)
    np.testing.assert_allclose(ad.pushforward(b, f, x)(dx), want, rtol=1e-12)
    prepared = ad.prepare_pushforward(b, f, x)
    for _ in range(2):
        np.testing.assert_allclose(prepared(x)(dx), want, rtol=1e-12)
    np.testing.assert_allclose(ad.jacobian(b, f, x), ad.jacobian(b, reference, x), rtol=1e-12)
    # derivative: forward mode on a scalar, through the prepared tf.function route too
    g = ad.differentiate_with(lambda t: jnp.sin(t) * 2.0, "jax")
    t = tf.constant(0.3, tf.float64)
    prepared = ad.prepare_derivative(b, g, t)
    for got in (ad.derivative(b, g, t), prepared(t), prepared(t)):
        np.testing.assert_allclose(got, 2 * np.cos(0.3), rtol=1e-12)
    with pytest.raises(ad.CompositionError, match="second derivatives"):
        ad.second_derivative(b, g, t)


@pytest.mark.skipif("tensorflow" not in OUTERS or "jax" not in INNERS, reason="needs tensorflow and jax")
def test_tensorflow_forward_mode_inside_a_users_tf_function_refuses():
    """In a graph TensorFlow's forward mode would find zeros through the boundary: it raises,
    and says that eagerly it works."""
    import tensorflow as tf

    g = ad.differentiate_with(kernel, "jax")

    @tf.function
    def jvp(x, t):
        with tf.autodiff.ForwardAccumulator(x, t) as acc:
            y = outer_code(g)(x)
        return acc.jvp(y)

    with pytest.raises(Exception, match="forward mode inside tf.function") as info:
        jvp(tf.constant(X), tf.ones(X.size, tf.float64))
    assert isinstance(info.value, (ad.CompositionError, tf.errors.OpError)) or "CompositionError" in repr(info.value)


@pytest.mark.parametrize("inner", INNERS + ["finite_differences"])
@pytest.mark.parametrize("outer", sorted(SECOND_ORDER & set(OUTERS)))
def test_second_derivatives_through_the_boundary(outer, inner):
    """The Hessian and an HVP of outer code calling the kernel, against the same function
    in one library: the caller's second derivatives reach the kernel's (its Hessian of
    <dy, f> times v, and f''(x)[v, w]); a third derivative raises."""
    if inner == outer:
        pytest.skip("the same library nests natively (test_same_library_is_native_and_nests)")
    b = ad.backend(outer)
    f = scalar(outer_code(ad.differentiate_with(kernel, inner)))
    want_f = scalar(reference)
    x, v = b.asarray(X), b.asarray(np.linspace(-1.0, 1.0, X.size))
    rtol = 1e-5 if inner == "finite_differences" else 1e-10
    with b.scope([x]):
        np.testing.assert_allclose(ad.to_numpy(ad.hessian(b, f, x)), ad.to_numpy(ad.hessian(b, want_f, x)),
                                   rtol=rtol, atol=rtol)
        np.testing.assert_allclose(ad.to_numpy(ad.hvp(b, f, x, v)), ad.to_numpy(ad.hvp(b, want_f, x, v)),
                                   rtol=rtol, atol=rtol)


@pytest.mark.parametrize("outer", sorted(SECOND_ORDER & set(OUTERS)))
def test_every_mixed_second_derivative_through_the_boundary(outer):
    """Forward over reverse, reverse over forward and forward over forward: each needs the
    second derivatives' own derivatives in their linear operands (PyTensor's and paddle's
    forward mode are two pullbacks), which are second derivatives, not third ones."""
    inner = "jax" if outer != "jax" else "torch"
    if inner not in INNERS:
        pytest.skip(f"{inner} is not installed")
    b = ad.backend(outer)
    g = ad.differentiate_with(kernel, inner)

    def outer(t, g=g):  # outer_code with products for powers (paddle 3.3's nested pow kernels fail)
        out = g({"u": t[:3] * 2.0, "v": t[3:]})
        return anp.concatenate([out["a"] * out["a"], anp.reshape(out["b"], (1,))])

    def want(t):
        u, v = t[:3] * 2.0, t[3:]
        a = anp.sin(u) * v[0]
        return anp.concatenate([a * a, anp.reshape(anp.sum(u * u * u), (1,))])

    f = lambda t: anp.sum(outer(t) * anp.cos(t[:4]))  # noqa: E731
    want_f = lambda t: anp.sum(want(t) * anp.cos(t[:4]))  # noqa: E731
    x, v = b.asarray(X), b.asarray(np.linspace(-1.0, 1.0, X.size))
    with b.scope([x]):
        pairs = [
            (ad.pushforward(b, lambda t: ad.gradient(b, f, t), x)(v),
             ad.pushforward(b, lambda t: ad.gradient(b, want_f, t), x)(v)),
            (ad.jacobian(b, lambda t: ad.pushforward(b, outer, t)(v), x),
             ad.jacobian(b, lambda t: ad.pushforward(b, want, t)(v), x)),
        ]
        line = ad.differentiate_with(lambda t: anp.sin(t) * 2.0, inner)
        pairs.append((ad.second_derivative(b, line, b.asarray(np.array(0.3))), -2.0 * np.sin(0.3)))
        for got, want in pairs:
            np.testing.assert_allclose(ad.to_numpy(got), ad.to_numpy(want), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("outer", sorted(SECOND_ORDER & set(OUTERS)))
def test_third_derivative_through_the_boundary_raises(outer):
    inner = "jax" if outer != "jax" else "torch"
    b = ad.backend(outer)
    f = scalar(outer_code(ad.differentiate_with(kernel, inner)))
    with pytest.raises(ad.CompositionError, match="third derivative") as info:
        ad.jacobian(b, lambda t: ad.hessian(b, f, t), b.asarray(X))
    assert inner in str(info.value) and outer in str(info.value)


@pytest.mark.parametrize("outer", sorted(set(OUTERS) - SECOND_ORDER))
def test_second_derivative_through_the_boundary_raises(outer):
    inner = "jax" if outer != "jax" else "torch"
    b = ad.backend(outer)
    f = outer_code(ad.differentiate_with(kernel, inner))
    with pytest.raises(ad.CompositionError) as info:
        ad.hessian(b, lambda t: anp.sum(f(t)), b.asarray(X))
    assert inner in str(info.value) and outer in str(info.value)


@pytest.mark.parametrize("lib", OUTERS)
def test_same_library_is_native_and_nests(lib):
    b = ad.backend(lib)
    g = ad.differentiate_with(kernel, lib)
    f = outer_code(g)
    x = b.asarray(X)
    h = ad.hessian(b, lambda t: anp.sum(f(t)), x)
    np.testing.assert_allclose(ad.to_numpy(h), ad.to_numpy(ad.hessian(b, lambda t: anp.sum(reference(t)), x)),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.skipif("jax" not in OUTERS or "torch" not in INNERS, reason="needs jax and torch")
def test_under_jax_jit_and_vmap():
    import jax
    import jax.numpy as jnp

    g = ad.differentiate_with(kernel, "torch")
    loss = scalar(outer_code(g))
    want = scalar(reference)
    with jax.enable_x64(True):
        xs = jnp.stack([jnp.asarray(X), jnp.asarray(2 * X)])
        np.testing.assert_allclose(jax.jit(jax.grad(loss))(xs[0]), jax.grad(want)(xs[0]), rtol=1e-12)
        np.testing.assert_allclose(jax.vmap(jax.grad(loss))(xs), jax.vmap(jax.grad(want))(xs), rtol=1e-12)


@pytest.mark.skipif("tensorflow" not in OUTERS or "jax" not in INNERS, reason="needs tensorflow and jax")
def test_under_tf_function():
    import tensorflow as tf

    g = ad.differentiate_with(kernel, "jax")
    loss = scalar(outer_code(g))
    want = scalar(reference)

    @tf.function
    def grad(x, f):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
        return tape.gradient(y, x)

    x = tf.constant(X)
    np.testing.assert_allclose(grad(x, loss).numpy(), grad(x, want).numpy(), rtol=1e-12)


@pytest.mark.skipif("torch" not in OUTERS or "jax" not in INNERS, reason="needs torch and jax")
def test_implicit_mode_torch_parameters():
    import torch

    w = torch.nn.Parameter(torch.tensor(X))
    g = ad.differentiate_with(kernel, "jax")

    grads = ad.gradient(ad.Implicit("torch"), lambda: scalar(outer_code(g))(w), ad.Params([w]))
    want = ad.gradient(ad.Implicit("torch"), lambda: scalar(reference)(w), ad.Params([w]))
    np.testing.assert_allclose(ad.to_numpy(grads[w]), ad.to_numpy(want[w]), rtol=1e-12)
    assert w.grad is None  # nothing accumulated


@pytest.mark.skipif("jax" not in OUTERS or "autograd" not in INNERS, reason="needs jax and autograd")
def test_implicit_mode_jax_variables():
    v = ad.Variable(np.asarray(X))
    g = ad.differentiate_with(kernel, "autograd")
    grads = ad.gradient(ad.Implicit("jax"), lambda: scalar(outer_code(g))(v.value), ad.Params([v]))
    want = ad.gradient(ad.Implicit("jax"), lambda: scalar(reference)(v.value), ad.Params([v]))
    np.testing.assert_allclose(ad.to_numpy(grads[v]), ad.to_numpy(want[v]), rtol=1e-12)


def test_outside_differentiation_numpy_in_numpy_out():
    g = ad.differentiate_with(kernel, "finite_differences")
    out = g({"u": X[:3], "v": X[3:]})
    assert isinstance(out["a"], np.ndarray) and out["a"].dtype == np.float64
    np.testing.assert_allclose(out["a"], np.sin(X[:3]) * X[3])


@pytest.mark.skipif("torch" not in OUTERS or "jax" not in INNERS, reason="needs torch and jax")
def test_outside_differentiation_caller_arrays_come_back():
    import torch

    g = ad.differentiate_with(kernel, "jax")
    out = g({"u": torch.tensor(X[:3], dtype=torch.float32), "v": torch.tensor(X[3:], dtype=torch.float32)})
    assert isinstance(out["a"], torch.Tensor) and out["a"].dtype == torch.float32
    assert isinstance(out["b"], torch.Tensor) and out["b"].shape == ()


@pytest.mark.skipif("torch" not in OUTERS or "jax" not in INNERS, reason="needs torch and jax")
def test_errors_inside_the_kernel_propagate():
    def failing(x):
        raise ValueError("kernel says no")

    g = ad.differentiate_with(failing, "jax")
    import torch

    with pytest.raises(ValueError, match="kernel says no") as info:
        ad.gradient("torch", lambda t: g(t).sum(), torch.ones(3, dtype=torch.float64))
    assert any(entry.name == "failing" for entry in info.traceback)


def test_bad_arguments():
    with pytest.raises(ad.ArgumentTypeError, match="callable"):
        ad.differentiate_with(3, "finite_differences")
    with pytest.raises(ad.UnknownBackendError):
        ad.differentiate_with(kernel, "no-such-backend")
    g = ad.differentiate_with(kernel, "finite_differences")
    with pytest.raises(ad.NonDifferentiableInputError):
        g({"u": np.arange(3), "v": np.arange(2)})
    with pytest.raises(ad.InvalidArgumentError, match="dtypes"):
        g({"u": X[:3].astype(np.float32), "v": X[3:]})


def test_a_backend_without_the_hook_says_so():
    class Bare(ad.Backend):
        name = "bare"

    with pytest.raises(ad.CompositionError, match="foreign_function"):
        Bare().foreign_function(None)


@pytest.mark.skipif("mlx" not in OUTERS or "autograd" not in INNERS, reason="needs mlx and autograd")
def test_mlx_jacobian_and_hessian_over_a_kernel():
    # the mlx backend's Jacobians and Hessians batch tangents with mx.vmap: the kernel's
    # rules are linear in them, and run once per tangent with concrete values of x
    b = ad.backend("mlx")
    f = outer_code(ad.differentiate_with(kernel, "autograd"))
    x = b.asarray(X)
    np.testing.assert_allclose(np.array(ad.jacobian(b, f, x)), np.array(ad.jacobian(b, reference, x)), rtol=1e-12)
    np.testing.assert_allclose(np.array(ad.hessian(b, lambda t: anp.sum(f(t)), x)),
                               np.array(ad.hessian(b, lambda t: anp.sum(reference(t)), x)), rtol=1e-12)


@pytest.mark.parametrize("outer", OUTERS)
def test_implicit_mode_every_caller(outer):
    """ad.Implicit(outer): f reads the caller library's own variables and calls a kernel of
    another library; the gradient per variable equals the single-library reference."""
    from abstractdiff._implicit import current_values

    inner = "jax" if outer != "jax" else "torch"
    g = ad.differentiate_with(kernel, inner)
    b = ad.backend(outer)
    weights = b.asarray(np.array([1.0, -2.0, 0.5, 3.0]))

    def scalar(f):
        return lambda: anp.sum(f(current_values(vs)["t"]) * weights)

    vs = ad.variables({"t": X}, b)
    grads = ad.gradient(ad.Implicit(outer), scalar(outer_code(g)), ad.Params(vs))
    want = ad.gradient(ad.Implicit(outer), scalar(reference), ad.Params(vs))
    np.testing.assert_allclose(ad.to_numpy(grads[vs["t"]]), ad.to_numpy(want[vs["t"]]), rtol=1e-12, atol=1e-12)


# ----------------------------------------------- crossing without a copy (issue 15)
#: Who calls ``g`` in a value call: ``numpy`` is plain numpy arrays (autograd's, outside its
#: derivatives, and PyTensor's at run time); the others pass their own arrays.
CALLERS = ["numpy", *(name for name in ("torch", "jax", "tensorflow", "mlx", "paddle") if name in OUTERS)]
KERNELS = [*INNERS, "finite_differences"]
#: Why a value call of an identity kernel copies, per caller or kernel; every other pair
#: shares the caller's memory end to end (strict: a pair that starts sharing fails until
#: it is taken out of here).
COPIES_FOR_CALLER = {
    "jax": "jax.pure_callback copies the callback's result into a buffer of jax's",
    "tensorflow": "eager tf.numpy_function copies its tensors to numpy and its result back",
    "mlx": "the mlx adapter builds its result with mx.array, a copy",
    "paddle": "the paddle adapter builds its result with paddle.to_tensor, a copy",
}
COPIES_FOR_KERNEL = {"mlx": "MLX imports no CPU memory without a copy (mx.from_dlpack copies)"}


def aligned(values: np.ndarray) -> np.ndarray:
    """``values`` copied into memory aligned to 64 bytes, as torch, jax and TensorFlow allocate
    (numpy aligns its large arrays to 16 bytes only, which jax imports by copying)."""
    raw = np.empty(values.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start : start + values.nbytes].view(values.dtype)
    out[...] = values
    return out


def caller_array(caller: str, values: np.ndarray):
    return aligned(values) if caller == "numpy" else ad.backend(caller).asarray(aligned(values))


def numpy_of(caller: str, a) -> np.ndarray:
    """The caller's array as numpy, its own memory where the library allows."""
    return a if caller == "numpy" else ad.backend(caller).numpy_view(a)


def identity_call(caller: str, kernel_lib: str, dtype: str):
    """``(x, g(x))`` for the identity kernel of ``kernel_lib`` called with ``caller``'s arrays."""
    x = caller_array(caller, np.linspace(-1.0, 1.0, 1000).astype(dtype))
    g = ad.differentiate_with(lambda t: t, kernel_lib)
    with contextlib.ExitStack() as scope:
        if caller != "numpy":
            scope.enter_context(ad.backend(caller).scope([x]))  # jax's float64
        return x, g(x)


def crossing_pairs(strict_copies: bool):
    for caller in CALLERS:
        for kernel_lib in KERNELS:
            if caller == kernel_lib:
                continue  # g is the kernel itself
            why = COPIES_FOR_CALLER.get(caller) or COPIES_FOR_KERNEL.get(kernel_lib)
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why and strict_copies else []
            yield pytest.param(caller, kernel_lib, marks=marks, id=f"{caller}-{kernel_lib}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("caller", "kernel_lib"), list(crossing_pairs(strict_copies=False)))
def test_crossing_keeps_values_type_and_dtype(caller, kernel_lib, dtype):
    """Every pair, sharing memory or copying: the caller's array type back, its dtype (float64
    too, in jax's x64 scope), the same numbers."""
    x, y = identity_call(caller, kernel_lib, dtype)
    assert type(y) is type(x)
    assert numpy_of(caller, y).dtype == np.dtype(dtype)
    np.testing.assert_array_equal(numpy_of(caller, y), numpy_of(caller, x))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("caller", "kernel_lib"), list(crossing_pairs(strict_copies=True)))
def test_crossing_shares_memory(caller, kernel_lib, dtype):
    """A value call of an identity kernel hands the caller back its own memory: DLPack into
    the kernel's library, a numpy view out of it, no copy on either side."""
    x, y = identity_call(caller, kernel_lib, dtype)
    assert np.shares_memory(numpy_of(caller, y), numpy_of(caller, x))


@pytest.mark.parametrize("kernel_lib", [name for name in ("jax", "tensorflow", "torch", "paddle") if name in INNERS])
def test_misaligned_memory_is_copied_not_misread(kernel_lib):
    """numpy's own allocations, and slices, are not aligned to 64 bytes: jax copies them, and
    TensorFlow (whose kernels abort the process on such memory) gets a copy too."""
    g = ad.differentiate_with(lambda t: {"a": anp.sin(t["u"][1:3]), "b": t["u"] * 2.0}, kernel_lib)
    base = np.linspace(0.0, 1.0, 101, dtype=np.float32)
    u = base[1:]  # 4 bytes past an allocation: misaligned for every library
    out = g({"u": u})
    np.testing.assert_allclose(out["a"], np.sin(u[1:3]), rtol=1e-6)
    np.testing.assert_allclose(out["b"], u * 2.0, rtol=1e-6)


@pytest.mark.parametrize("kernel_lib", [name for name in ("jax", "tensorflow", "autograd") if name in INNERS])
@pytest.mark.skipif("torch" not in OUTERS, reason="needs torch")
def test_torch_sees_writes_through_a_shared_result(kernel_lib):
    """A kernel's result lying in the caller's memory is a view of the caller's tensor: torch's
    version counter sees a write through it (loudly, when the input is saved for backward),
    never a silent change of the input."""
    import torch

    g = ad.differentiate_with(lambda t: t, kernel_lib)
    x = torch.linspace(0.0, 1.0, 8, requires_grad=True)
    y = g(x)
    with pytest.raises(RuntimeError, match="inplace|in-place"):
        y.mul_(2.0)
    plain = torch.linspace(0.0, 1.0, 8)
    version = plain._version
    g(plain).mul_(2.0)
    assert plain._version > version


@pytest.mark.parametrize("outer", OUTERS)
def test_a_kernel_returning_its_input_leaves_the_input_alone(outer):
    """The identity crosses without a copy, so the caller's library receives its own memory:
    its derivatives stay right and the input unchanged (PyTensor, which writes into an Op's
    output in place, gets a copy)."""
    inner = "autograd" if outer != "autograd" else "torch"
    b = ad.backend(outer)
    g = ad.differentiate_with(lambda t: t, inner)
    x = b.asarray(X)
    grad = ad.gradient(b, lambda t: anp.sum(anp.sin(g(t)) * g(t) * 3.0), x)
    np.testing.assert_allclose(ad.to_numpy(grad), 3.0 * (np.cos(X) * X + np.sin(X)), rtol=1e-12)
    np.testing.assert_array_equal(ad.to_numpy(x), X)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lib", KERNELS)
def test_dlpack_hooks_keep_dtype_and_values(lib, dtype):
    """``from_dlpack`` keeps the dtype (float64 in jax too: its x64 scope) and the numbers;
    ``numpy_view`` gives them back; both share memory except where a copy is documented."""
    b = ad.backend(lib)
    a = aligned(np.linspace(-1.0, 1.0, 64).astype(dtype))
    native = b.from_dlpack(a)
    back = b.numpy_view(native)
    assert back.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(back, a)
    assert np.shares_memory(back, a) == (lib not in COPIES_FOR_KERNEL)


def test_a_zero_operand_of_a_second_derivative_costs_no_kernel_call(monkeypatch):
    """second_vjp and second_jvp are bilinear in their last two operands: a caller's dummy zero
    (paddle's double-vjp forward mode passes one) returns zeros without a Hessian-vector product."""
    import abstractdiff._operators as operators

    g = ad.differentiate_with(kernel, "finite_differences")
    k = g.kernel({"u": X[:3], "v": X[3:]}, (), "float64")
    calls = []
    def counted(name):
        real = getattr(operators, name)
        return lambda *a, **kw: calls.append(name) or real(*a, **kw)

    for name in ("hvp", "second_derivative"):
        monkeypatch.setattr(operators, name, counted(name))
    x, zero_in, zero_out = X, np.zeros(k.in_size), np.zeros(k.out_size)
    v = np.linspace(-1.0, 1.0, k.in_size)
    assert not k.second_vjp(x, zero_out, v).any() and not k.second_vjp(x, np.ones(k.out_size), zero_in).any()
    assert not k.second_jvp(x, zero_in, v).any() and not k.second_jvp(x, v, zero_in).any()
    assert k.second_vjp(x, zero_out, v).shape == (k.in_size,) and k.second_jvp(x, v, zero_in).shape == (k.out_size,)
    assert calls == []
    assert k.second_vjp(x, np.ones(k.out_size), v).any() and calls == ["hvp"]

"""ad.custom_vjp, ad.custom_jvp, ad.stop_gradient, ad.custom_root and ad.custom_fixed_point
as users call them: on every exact backend, unprepared, prepared and compiled; the oracle
ignoring rules; and every error path (each an ad.CustomRuleError, or the argument errors).

The scenario family of rules (abstractdiff.testing._rules) is graded in every mode by
conformance_tests/test_rules.py; the adapters' hooks are tested against a stand-in rule in
tests/test_custom_rule_<library>.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from autoray import numpy as anp

import abstractdiff as ad
from abstractdiff._registry import unavailable_reason

EXACT = ("autograd", "jax", "mlx", "paddle", "pytensor", "tensorflow", "torch")
#: The option that compiles each backend's prepared and unprepared calls (PyTensor always
#: compiles; autograd has nothing to compile).
COMPILED = {"jax": {"compile": True}, "tensorflow": {"compile": True}, "torch": {"compile": True},
            "mlx": {"compile": True}, "paddle": {"compile": True}, "pytensor": {}}


def backend_available(name: str) -> bool:
    return unavailable_reason(name) is None


def _exact(name: str, **options: object) -> ad.Backend:
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    return ad.backend(name, **options)


def _sum(a):
    """A sum every library's compiler traces (torch.compile cannot trace autoray's dispatch)."""
    return anp.sum(a) if type(a).__module__.startswith("tensorflow") else a.sum()


def _three_x():
    """g = sum(x**2), whose bwd says 3 ct x (the true derivative is 2x)."""

    @ad.custom_vjp
    def g(x):
        return _sum(x * x)

    g.defvjp(lambda x: (g(x), x), lambda x, ct: (3 * ct * x,))
    return g


X = np.array([0.5, -1.0, 2.0])


@pytest.mark.parametrize("mode", ["unprepared", "prepared", "compiled"])
@pytest.mark.parametrize("name", EXACT)
def test_the_gradient_is_the_rules_on_every_exact_backend(name: str, mode: str) -> None:
    if mode == "compiled" and name not in COMPILED:
        pytest.skip(f"{name} has no compiled mode")
    b = _exact(name, **(COMPILED[name] if mode == "compiled" else {}))
    g = _three_x()
    x = b.from_numpy(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compiled backend falling back to eager warns
        if mode == "prepared":
            prepared = ad.prepare_gradient(b, g, x)
            got = [prepared(x), prepared(b.from_numpy(2 * X))]
        else:
            got = [ad.gradient(b, g, x), ad.gradient(b, g, b.from_numpy(2 * X))]
    np.testing.assert_allclose(ad.to_numpy(got[0]), 3 * X, rtol=1e-12)
    np.testing.assert_allclose(ad.to_numpy(got[1]), 6 * X, rtol=1e-12)


@pytest.mark.parametrize("name", EXACT)
def test_outside_differentiation_g_is_f(name: str) -> None:
    b = _exact(name)
    g = _three_x()
    assert float(ad.to_numpy(g(b.from_numpy(X)))) == pytest.approx(float(X @ X))
    assert g(X) == pytest.approx(float(X @ X))  # numpy: f itself


def test_finite_differences_differentiates_f_itself() -> None:
    np.testing.assert_allclose(ad.gradient("finite_differences", _three_x(), X), 2 * X, rtol=1e-7)


def test_a_users_own_jit_and_tf_function_use_the_rule() -> None:
    g = _three_x()
    if backend_available("jax"):
        import jax

        np.testing.assert_allclose(jax.jit(jax.grad(g))(jax.numpy.asarray(X)), 3 * X, rtol=1e-6)
    if backend_available("tensorflow"):
        import tensorflow as tf

        @tf.function
        def grad(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = g(x)
            return tape.gradient(y, x)

        np.testing.assert_allclose(grad(tf.constant(X)).numpy(), 3 * X, rtol=1e-12)


@pytest.mark.parametrize("name", EXACT)
def test_second_order_differentiates_the_rule(name: str) -> None:
    b = _exact(name)
    g = _three_x()
    np.testing.assert_allclose(ad.to_numpy(ad.hessian(b, g, b.from_numpy(X))), 3 * np.eye(3), rtol=1e-12)


def test_pytree_arguments_and_outputs() -> None:
    b = _exact("jax")

    @ad.custom_vjp
    def scale(p, y):
        return {"out": p["w"] * y, "twice": 2 * y}

    def bwd(res, ct):
        w, y = res
        return {"w": ct["out"] * y * 10}, ct["out"] * w + 2 * ct["twice"]

    scale.defvjp(lambda p, y: (scale(p, y), (p["w"], y)), bwd)
    x = {"p": {"w": np.array([1.0, 2.0])}, "y": np.array([3.0, 4.0])}
    grad = ad.gradient(b, lambda x: anp.sum(scale(x["p"], x["y"])["out"]) + anp.sum(scale(x["p"], x["y"])["twice"]), x)
    np.testing.assert_allclose(ad.to_numpy(grad["p"]["w"]), 10 * x["y"])
    np.testing.assert_allclose(ad.to_numpy(grad["y"]), x["p"]["w"] + 2)


def test_custom_jvp_forward_mode_everywhere_and_reverse_on_jax() -> None:
    @ad.custom_jvp
    def sine(x):
        return anp.sin(x)

    @sine.defjvp
    def _(primals, tangents):
        return anp.sin(primals[0]), 2 * anp.cos(primals[0]) * tangents[0]

    t = np.array([1.0, 0.0, 0.0])
    for name in EXACT:
        if not backend_available(name):
            continue
        b = ad.backend(name)
        jvp = ad.pushforward(b, sine, b.from_numpy(X))(b.from_numpy(t))
        np.testing.assert_allclose(ad.to_numpy(jvp), 2 * np.cos(X) * t, rtol=1e-12, err_msg=name)
    if backend_available("jax"):
        g = ad.gradient("jax", lambda x: anp.sum(sine(x)), X)  # jax transposes the linear rule
        np.testing.assert_allclose(ad.to_numpy(g), 2 * np.cos(X), rtol=1e-12)


def test_a_method_can_be_a_custom_function() -> None:
    class Layer:
        factor = 3.0

        @ad.custom_vjp
        def __call__(self, x):
            return x * self.factor

    Layer.__call__.defvjp(lambda self, x: (x * self.factor, None), lambda _, ct: (None, ct * 100))
    g = ad.gradient(_exact("torch"), lambda x: Layer()(x).sum(), _exact("torch").from_numpy(X))
    np.testing.assert_allclose(ad.to_numpy(g), 100 * np.ones(3))


# -------------------------------------------------------------------- implicit mode
def test_a_torch_module_whose_forward_calls_the_rule() -> None:
    b = _exact("torch")
    import torch

    g = _three_x()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))

        def forward(self) -> torch.Tensor:
            return g(self.w)

    model = Model()
    grads = ad.gradient(ad.Implicit(b), lambda: model(), ad.Params(model))
    np.testing.assert_allclose(ad.to_numpy(grads[model.w]), [3.0, 6.0])
    assert model.w.grad is None  # nothing accumulated into .grad


def test_a_keras_model_whose_call_uses_the_rule() -> None:
    b = _exact("tensorflow")
    import keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip("keras runs on another backend here")
    g = _three_x()
    layer = keras.layers.Dense(1, use_bias=False, dtype="float64")
    layer.build((None, 2))
    x = np.array([[1.0, 2.0]])
    grads = ad.gradient(ad.Implicit(b), lambda: g(layer(x)), ad.Params(layer.trainable_variables))
    # d/dW of 3/2 (xW)^2's rule: 3 (xW) x^T
    y = (x @ ad.to_numpy(layer.kernel)).item()
    np.testing.assert_allclose(ad.to_numpy(grads[layer.kernel]), 3 * y * x.T, rtol=1e-12)


# ------------------------------------------------------------------ stop_gradient
@pytest.mark.parametrize("name", EXACT)
def test_stop_gradient_first_and_second_order_and_forward(name: str) -> None:
    b = _exact(name)

    def f(x):
        return anp.sum(ad.stop_gradient(x) * x * x)

    x = b.from_numpy(X)
    np.testing.assert_allclose(ad.to_numpy(ad.gradient(b, f, x)), 2 * X**2, rtol=1e-12)
    np.testing.assert_allclose(ad.to_numpy(ad.hessian(b, f, x)), np.diag(2 * X), rtol=1e-12)
    t = b.from_numpy(np.array([1.0, 1.0, 1.0]))
    np.testing.assert_allclose(ad.to_numpy(ad.pushforward(b, f, x)(t)), np.sum(2 * X**2), rtol=1e-12)


def test_stop_gradient_on_a_pytree_and_outside_differentiation() -> None:
    tree = {"a": np.ones(2), "n": 3, "s": "text"}
    assert ad.stop_gradient(tree) == tree or ad.stop_gradient(tree)["a"] is tree["a"]
    b = _exact("jax")
    g = ad.gradient(b, lambda p: anp.sum(ad.stop_gradient(p)["w"] * p["w"] + p["v"]),
                    {"w": np.array([2.0]), "v": np.array([1.0])})
    np.testing.assert_allclose(ad.to_numpy(g["w"]), [2.0])
    np.testing.assert_allclose(ad.to_numpy(g["v"]), [1.0])


def test_stop_gradient_refuses_under_finite_differences() -> None:
    with pytest.raises(ad.CustomRuleError, match="finite_differences.*perturbed points"):
        ad.gradient("finite_differences", lambda x: anp.sum(ad.stop_gradient(x) * x), X)


# -------------------------------------------------------------------- custom_root
def _ridge(b: ad.Backend, solve: object = None):
    rng = np.random.default_rng(3)
    a, y = rng.normal(size=(10, 4)), rng.normal(size=10)
    ata, aty, eye = b.from_numpy(a.T @ a), b.from_numpy((a.T @ y).reshape(4, 1)), b.from_numpy(np.eye(4))

    @ad.custom_root(lambda w, lam: anp.tensordot(ata, w, axes=1) - aty[:, 0] + lam * w, solve=solve)
    def ridge(init, lam):
        # a solver that stops its own gradient: only the implicit function theorem differentiates it
        lam = ad.stop_gradient(lam)
        return ad.stop_gradient(anp.linalg.solve(ata + lam * eye, aty)[:, 0] + 0 * init)

    lam = 0.3
    m = a.T @ a + lam * np.eye(4)
    w = np.linalg.solve(m, a.T @ y)
    closed = -np.ones(4) @ np.linalg.solve(m, w)  # d sum(w*) / d lam
    return ridge, lam, closed


@pytest.mark.parametrize("solve", [None, "dense"])
@pytest.mark.parametrize("name", EXACT)
def test_custom_root_ridge_matches_the_closed_form(name: str, solve: object) -> None:
    b = _exact(name)
    ridge, lam, closed = _ridge(b, solve)
    init = b.from_numpy(np.zeros(4))
    g = ad.gradient(b, lambda lam: anp.sum(ridge(init, lam)), b.from_numpy(np.array(lam)))
    assert float(ad.to_numpy(g)) == pytest.approx(closed, abs=1e-6)


def test_custom_fixed_point_of_a_contraction() -> None:
    b = _exact("torch")

    @ad.custom_fixed_point(lambda x, a: anp.cos(a * x))
    def fixed(init, a):
        x = init
        for _ in range(200):
            x = anp.cos(a * x)
        return ad.stop_gradient(x)

    a = b.from_numpy(np.array([0.7, 1.0]))
    x = ad.to_numpy(fixed(b.from_numpy(np.zeros(2)), a))
    g = ad.gradient(b, lambda a: fixed(b.from_numpy(np.zeros(2)), a).sum(), a)
    av = np.array([0.7, 1.0])
    # x = cos(a x): dx/da = -sin(a x) x / (1 + a sin(a x))
    np.testing.assert_allclose(ad.to_numpy(g), -np.sin(av * x) * x / (1 + av * np.sin(av * x)), rtol=1e-8)


def test_custom_root_with_a_solver_of_ones_own() -> None:
    b = _exact("jax")
    calls = []

    def my_solve(matvec, rhs):
        calls.append(1)
        from abstractdiff._implicit_diff import dense_solve

        return dense_solve(matvec, rhs)

    ridge, lam, closed = _ridge(b, my_solve)
    g = ad.gradient(b, lambda lam: anp.sum(ridge(np.zeros(4), lam)), np.array(lam))
    assert float(ad.to_numpy(g)) == pytest.approx(closed, abs=1e-6) and calls


def _double_root(solve: object):
    # (x - a)^2 = 0 has its root at x = a, where d/dx (x - a)^2 = 0: singular
    @ad.custom_root(lambda x, a: (x - a) ** 2, solve=solve)
    def double_root(init, a):
        return ad.stop_gradient(a)

    return lambda a: anp.sum(double_root(a * 0, a))


@pytest.mark.parametrize("solve", [None, "dense"])
@pytest.mark.parametrize("name", ["autograd", "jax", "mlx", "paddle", "tensorflow", "torch"])
def test_custom_root_with_a_singular_jacobian_is_a_clear_error(name: str, solve: object) -> None:
    # on concrete arrays: jax and tensorflow without their compilers
    b = _exact(name, **({"compile": False} if name in ("jax", "tensorflow") else {}))
    with pytest.raises(ad.CustomRuleError, match="singular"):
        ad.gradient(b, _double_root(solve), b.from_numpy(np.array([1.0, 2.0])))


@pytest.mark.parametrize("name", ["jax", "tensorflow", "pytensor"])
def test_custom_root_with_a_singular_jacobian_under_a_trace_is_nan(name: str) -> None:
    # compiled, the values are not known where the system is solved: nan, not a wrong number
    b = _exact(name)
    g = ad.gradient(b, _double_root(None), b.from_numpy(np.array([1.0, 2.0])))
    assert np.isnan(ad.to_numpy(g)).all()


def test_custom_root_second_order_on_paddle_is_refused_not_a_crash() -> None:
    b = _exact("paddle")
    ridge, lam, _ = _ridge(b)
    init = b.from_numpy(np.zeros(4))
    with pytest.raises(ad.CustomRuleError, match="paddle"):
        ad.hessian(b, lambda lam: anp.sum(ridge(init, lam)), b.from_numpy(np.array([lam])))


# -------------------------------------------------------------------- error paths
def _jax() -> ad.Backend:
    return _exact("jax")


def test_bwd_returning_the_wrong_number_of_cotangents() -> None:
    g = ad.custom_vjp(lambda x: anp.sum(x))
    g.defvjp(lambda x: (anp.sum(x), None), lambda _, ct: (ct, ct))
    with pytest.raises(ad.CustomRuleError, match="bwd returned 2 cotangents.*1 positional argument"):
        ad.gradient(_jax(), g, X)


def test_bwd_returning_a_bare_array_rather_than_a_tuple() -> None:
    g = ad.custom_vjp(lambda x: anp.sum(x))
    g.defvjp(lambda x: (anp.sum(x), x), lambda x, ct: ct * x)
    with pytest.raises(ad.CustomRuleError, match=r"return \(ct_x,\)"):
        ad.gradient(_exact("torch"), g, _exact("torch").from_numpy(X))


@pytest.mark.parametrize("name", ["jax", "torch", "tensorflow"])
def test_a_cotangent_of_the_wrong_shape_or_dtype(name: str) -> None:
    b = _exact(name)
    wrong_shape = ad.custom_vjp(lambda x: anp.sum(x))
    wrong_shape.defvjp(lambda x: (anp.sum(x), x), lambda x, ct: (anp.sum(x) * ct,))
    with pytest.raises(ad.CustomRuleError, match=r"argument 0 has shape \(\), but that leaf has shape \(3,\)"):
        ad.gradient(b, wrong_shape, b.from_numpy(X))
    wrong_dtype = ad.custom_vjp(lambda x: anp.sum(x))
    wrong_dtype.defvjp(lambda x: (anp.sum(x), x), lambda x, ct: (anp.astype(x * ct, "float32"),))
    with pytest.raises(ad.CustomRuleError, match="dtype float32.*dtype float64"):
        ad.gradient(b, wrong_dtype, b.from_numpy(X))


def test_a_cotangent_of_the_wrong_structure() -> None:
    g = ad.custom_vjp(lambda p: anp.sum(p["w"]))
    g.defvjp(lambda p: (anp.sum(p["w"]), p), lambda p, ct: ({"v": p["w"]},))
    with pytest.raises(ad.CustomRuleError, match="structure"):
        ad.gradient(_jax(), g, {"w": X})


def test_fwd_not_returning_a_pair() -> None:
    g = ad.custom_vjp(lambda x: anp.sum(x))
    g.defvjp(lambda x: anp.sum(x), lambda _, ct: (ct,))
    with pytest.raises(ad.CustomRuleError, match=r"fwd must return a pair"):
        ad.gradient(_exact("torch"), g, _exact("torch").from_numpy(X))


@pytest.mark.parametrize("name", ["torch", "tensorflow", "autograd", "mlx", "paddle"])
def test_custom_jvp_reverse_mode_where_the_library_cannot_transpose(name: str) -> None:
    b = _exact(name)

    @ad.custom_jvp
    def sine(x):
        return anp.sin(x)

    sine.defjvp(lambda p, t: (anp.sin(p[0]), anp.cos(p[0]) * t[0]))
    with pytest.raises(ad.CustomRuleError, match="custom_jvp.*cannot transpose.*custom_vjp"):
        ad.gradient(b, lambda x: anp.sum(sine(x)), b.from_numpy(X))


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_custom_vjp_forward_mode_where_the_rule_has_none(name: str) -> None:
    b = _exact(name)
    with pytest.raises(ad.CustomRuleError, match="custom_vjp.*forward"):
        ad.pushforward(b, _three_x(), b.from_numpy(X))(b.from_numpy(np.ones(3)))


def test_a_rule_that_is_not_defined_yet_and_bad_arguments() -> None:
    g = ad.custom_vjp(lambda x: x)
    with pytest.raises(ad.CustomRuleError, match=r"defvjp\(fwd, bwd\) first"):
        g(X)
    with pytest.raises(ad.CustomRuleError, match=r"defjvp\(jvp\) first"):
        ad.custom_jvp(lambda x: x)(X)
    with pytest.raises(ad.ArgumentTypeError, match="positionally"):
        g.defvjp(lambda x: (x, None), lambda _, ct: (ct,)) or g(x=X)
    with pytest.raises(ad.ArgumentTypeError, match="wraps a function"):
        ad.custom_vjp(3)
    with pytest.raises(ad.ArgumentTypeError, match="bwd must be callable"):
        g.defvjp(lambda x: (x, None), None)
    with pytest.raises(ad.InvalidArgumentError, match="solve='cholesky'.*bicgstab"):
        ad.custom_root(lambda x: x, solve="cholesky")
    with pytest.raises(ad.ArgumentTypeError, match="optimality_fn must be callable"):
        ad.custom_root(None)


def test_an_integer_output_and_arrays_of_two_libraries() -> None:
    torch_b, jax_b = _exact("torch"), _jax()
    g = ad.custom_vjp(lambda x: anp.argmax(x))
    g.defvjp(lambda x: (anp.argmax(x), None), lambda _, ct: (None,))
    with pytest.raises(ad.CustomRuleError, match="float arrays"):
        ad.gradient(torch_b, lambda x: g(x) * 1.0, torch_b.from_numpy(X))
    h = ad.custom_vjp(lambda x, y: x)
    h.defvjp(lambda x, y: (x, None), lambda _, ct: (ct, None))
    with pytest.raises(ad.CustomRuleError, match="two libraries"):
        h(torch_b.from_numpy(X), jax_b.from_numpy(X))


def test_an_error_in_the_rule_reaches_the_user_as_itself() -> None:
    class Mine(Exception):
        pass

    def bwd(_, ct):
        raise Mine("from the rule")

    g = ad.custom_vjp(lambda x: anp.sum(x))
    g.defvjp(lambda x: (anp.sum(x), None), bwd)
    for name in ("jax", "torch"):
        b = _exact(name)
        with pytest.raises(Mine, match="from the rule"):
            ad.gradient(b, g, b.from_numpy(X))


def test_inputs_are_not_changed() -> None:
    b = _exact("torch")
    x = b.from_numpy(X.copy())
    before = ad.to_numpy(x).copy()
    ad.gradient(b, _three_x(), x)
    np.testing.assert_array_equal(ad.to_numpy(x), before)
    assert x.grad is None and not x.requires_grad


@pytest.mark.parametrize("name", EXACT)
def test_a_jacobian_takes_the_mode_the_rule_has(name: str) -> None:
    b = _exact(name)

    @ad.custom_jvp
    def sine(x):
        return anp.sin(x)

    sine.defjvp(lambda p, t: (anp.sin(p[0]), 2 * anp.cos(p[0]) * t[0]))
    x = b.from_numpy(X)
    np.testing.assert_allclose(ad.to_numpy(ad.jacobian(b, sine, x)), np.diag(2 * np.cos(X)), rtol=1e-12)
    g = _three_x()

    def tall(x):  # more outputs than inputs: forward mode would be the cheaper one
        return anp.stack([g(x), g(2 * x), g(x) + 1, g(x) * 2])

    want = np.stack([3 * X, 12 * X, 3 * X, 6 * X])
    np.testing.assert_allclose(ad.to_numpy(ad.jacobian(b, tall, x)), want, rtol=1e-12)
    y, jac = ad.value_and_jacobian(b, sine, x)
    np.testing.assert_allclose(ad.to_numpy(jac), np.diag(2 * np.cos(X)), rtol=1e-12)


def test_a_jax_tree_util_class_argument_is_flattened_not_made_a_constant() -> None:
    jax = pytest.importorskip("jax")
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Pair:
        w: object
        b: object

    g = ad.custom_vjp(lambda p: p.w * p.b)
    g.defvjp(lambda p: (p.w * p.b, p), lambda p, ct: (Pair(ct * p.b, ct * p.w),))
    got = ad.gradient("jax", lambda x: anp.sum(g(Pair(x, 3 * x))), X)
    # d/dx (x * 3x) through the rule: both of the container's arrays get their part
    np.testing.assert_allclose(ad.to_numpy(got), 6 * X, rtol=1e-6)


def test_a_container_of_another_optree_namespace_is_refused_not_made_a_constant() -> None:
    import optree

    class Pair:
        def __init__(self, w, b):
            self.w, self.b = w, b

    optree.register_pytree_node(Pair, lambda p: ((p.w, p.b), None), lambda _, c: Pair(*c), namespace="elsewhere")
    g = ad.custom_vjp(lambda p: p.w * 2)
    g.defvjp(lambda p: (p.w * 2, None), lambda _, ct: (None,))
    with pytest.raises(ad.CustomRuleError, match="Pair registered as a pytree node.*elsewhere"):
        ad.gradient("jax", lambda x: anp.sum(g(Pair(x, x))), X)

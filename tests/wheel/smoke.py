"""Smoke checks of an *installed* abstractdiff (a wheel in a fresh virtualenv), run as a script.

``make wheel-test`` builds the wheel, installs it into a new virtualenv that borrows the
backends from the project's .venv, and runs this file from outside the source tree, so
that ``import abstractdiff`` can only find the installed package: a subpackage missing
from the wheel fails here (an editable install hides it).  Prints pytest's closing line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback

import numpy as np

CHECKS = []


def check(f):
    CHECKS.append(f)
    return f


@check
def imported_from_the_wheel():
    import abstractdiff

    here = os.path.dirname(abstractdiff.__file__)
    assert "site-packages" in here, f"abstractdiff imported from {here}, not an installed package"
    for sub in ("adapters", "optim", "testing"):
        __import__(f"abstractdiff.{sub}")


@check
def operators_on_every_backend():
    from autoray import numpy as anp

    import abstractdiff as ad

    names = [n for n in ad.available_backends() if n != "implicit"]
    assert len(names) == 8, names
    x = np.array([1.0, 2.0, 3.0])
    for name in names:
        g = ad.to_numpy(ad.gradient(name, lambda w: anp.sum(w**2), x))
        np.testing.assert_allclose(g, 2 * x, rtol=1e-6, err_msg=name)
        h = ad.to_numpy(ad.hessian(name, lambda w: anp.sum(w**3), x))
        np.testing.assert_allclose(h, np.diag(6 * x), rtol=1e-5, atol=1e-6, err_msg=name)


@check
def train_and_checkpoints():
    import abstractdiff as ad
    from abstractdiff import optim

    def loss(model, xb, yb):
        return (((xb @ model["w"]) - yb) ** 2).mean()

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(32, 3))
    ys = xs @ np.array([[1.0], [-2.0], [0.5]])
    model = {"w": np.zeros((3, 1))}
    state = optim.setup(optim.Adam(0.1), model)
    state, model = ad.train(loss, model, [(xs, ys)] * 50, state, backend="torch")
    assert float(loss(ad.to_numpy(model), xs, ys)) < 0.1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        ad.save_checkpoint(path, state, model)
        state2, model2 = ad.load_checkpoint(path, like=(state, model))
    np.testing.assert_array_equal(ad.to_numpy(model2)["w"], ad.to_numpy(model)["w"])


@check
def testing_check_backend():
    from abstractdiff import testing

    report = testing.check_backend("autograd")
    assert report.ok, report.table()


@check
def cli_check_autograd():
    exe = os.path.join(os.path.dirname(sys.executable), "abstractdiff")
    out = subprocess.run([exe, "check", "--backend", "autograd", "--no-training"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


@check
def custom_derivatives_on_every_exact_backend():
    from autoray import numpy as anp

    import abstractdiff as ad
    from abstractdiff import testing
    from abstractdiff.testing._rules import rule_scenarios

    def total(a):  # a sum torch.compile traces (autoray's dispatch it cannot)
        return anp.sum(a) if type(a).__module__.startswith("tensorflow") else a.sum()

    g = ad.custom_vjp(lambda x: total(x * x))
    g.defvjp(lambda x: (total(x * x), x), lambda x, ct: (3 * ct * x,))
    x = np.array([0.5, -1.0, 2.0])
    compiled = {"jax": {"compile": True}, "tensorflow": {"compile": True}, "torch": {"compile": True},
                "mlx": {"compile": True}, "paddle": {"compile": True}, "pytensor": {}}
    for name in ("autograd", "jax", "mlx", "paddle", "pytensor", "tensorflow", "torch"):
        for options in ({}, compiled.get(name)):
            if options is None:
                continue
            b = ad.backend(name, **options)
            xb = b.from_numpy(x)
            for got in (ad.gradient(b, g, xb), ad.prepare_gradient(b, g, xb)(xb)):
                np.testing.assert_allclose(ad.to_numpy(got), 3 * x, rtol=1e-12, err_msg=f"{name} {options}")
        report = testing.check_backend(ad.backend(name), rule_scenarios("float64"))
        assert report.ok, report


@check
def loops_on_every_backend():
    """testing.loop_scenarios (ad.fori_loop and ad.scan, to second order) on every backend: the
    library's loop primitive on jax, tensorflow and PyTensor, Python loops on the others."""
    import abstractdiff as ad
    from abstractdiff import testing

    for name in ("autograd", "finite_differences", "jax", "mlx", "paddle", "pytensor", "tensorflow", "torch"):
        report = testing.check_backend(ad.backend(name), testing.loop_scenarios("float64"))
        assert report.ok, report


@check
def library_pytrees_on_every_backend():
    """A jax.tree_util dataclass and an Equinox module are flattened as jax flattens them."""
    import dataclasses

    import equinox as eqx
    import jax
    from autoray import numpy as anp

    import abstractdiff as ad

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Pair:
        w: object
        b: object

    for name in ("autograd", "finite_differences", "jax", "tensorflow", "torch"):
        g = ad.gradient(name, lambda p: anp.sum(p.w**2) + anp.sum(p.w * p.b), Pair(np.array([1.0, 2.0]), np.zeros(2)))
        assert type(g) is Pair, name
        np.testing.assert_allclose(ad.to_numpy(g.w), [2.0, 4.0], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(ad.to_numpy(g.b), [1.0, 2.0], rtol=1e-5, err_msg=name)
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.PRNGKey(0))
    x = jax.numpy.ones((3, 2))

    def loss(m, x):
        return jax.numpy.sum(jax.vmap(m)(x) ** 2)

    got, want = ad.gradient("jax", loss, model, x), eqx.filter_grad(loss)(model, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


_KERAS_STEP = """
import numpy as np, keras, abstractdiff as ad
from abstractdiff import optim
keras.utils.set_random_seed(0)
a = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
b = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
b.set_weights(a.get_weights())
x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
y = np.sin(x.sum(axis=1, keepdims=True)).astype("float32")
loss = lambda m, x, y: keras.ops.mean((m(x) - y) ** 2)
backend = ad.Implicit(keras.config.backend())
ad.train_step(loss, a, (x, y), optim.setup(optim.Descent(0.1), a), backend=backend)
b.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
b.train_on_batch(x, y)
for u, v in zip(a.get_weights(), b.get_weights()):
    np.testing.assert_allclose(u, v, atol=1e-5)
print("keras", keras.config.backend(), "ok")
"""


@check
def keras_on_every_keras_backend():
    """One implicit train_step equals Keras's SGD step, KERAS_BACKEND by KERAS_BACKEND."""
    import os
    import subprocess

    for name in ("tensorflow", "torch", "jax"):
        env = {**os.environ, "KERAS_BACKEND": name}
        proc = subprocess.run([sys.executable, "-c", _KERAS_STEP], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0 and f"keras {name} ok" in proc.stdout, proc.stderr[-3000:]


@check
def compiled_train_steps_and_sparse_calls():
    """A whole train_step as one jax.jit / tf.function call, equal to the op-by-op step, and a
    prepared sparse Hessian as one compiled call, equal to the dense one (jax, tensorflow)."""
    import warnings

    from autoray import numpy as anp

    import abstractdiff as ad
    import abstractdiff._compiled_step as cs
    from abstractdiff import optim
    from abstractdiff.testing._sparse_problems import arrowhead

    def loss(m, x, y):
        return anp.mean((anp.tanh(x @ m["w"]) @ m["v"] - y) ** 2)

    rng = np.random.default_rng(0)
    start = {"w": rng.standard_normal((3, 4)), "v": rng.standard_normal((4, 1))}
    x, y = rng.standard_normal((8, 3)), rng.standard_normal((8, 1))
    for name in ("jax", "tensorflow"):
        b = ad.backend(name)
        results = []
        for compiled in (True, False):
            saved = cs._compiler
            if not compiled:
                cs._compiler = lambda b: None
            try:
                model = {k: b.convert(v) for k, v in start.items()}
                state = optim.setup(optim.chain(optim.ClipNorm(1.0), optim.Adam(1e-2)), model)
                with warnings.catch_warnings():
                    warnings.simplefilter("error", ad.CompileFallbackWarning)
                    for _ in range(4):
                        state, model, _ = ad.train_step(loss, model, (b.convert(x), b.convert(y)), state, backend=b)
            finally:
                cs._compiler = saved
            results.append({k: ad.to_numpy(v) for k, v in model.items()})
        for k in start:
            np.testing.assert_allclose(results[0][k], results[1][k], rtol=1e-12, atol=1e-12, err_msg=name)
        point = b.convert(rng.uniform(0.5, 1.5, 30))
        prepared = ad.prepare_hessian(ad.Sparse(b), arrowhead, point)
        got = prepared(point)
        assert prepared.ncolors <= 3, (name, prepared.ncolors)
        native = prepared.preparation.plan([point], []).native
        assert any(isinstance(k, tuple) and k[:1] == ("compiled",) for k in native), name
        np.testing.assert_allclose(got.toarray(), ad.to_numpy(ad.hessian(b, arrowhead, point)), rtol=1e-12,
                                   atol=1e-12, err_msg=name)


def main() -> int:
    failed = 0
    for f in CHECKS:
        try:
            f()
            print(f"PASSED {f.__name__}")
        except Exception:  # noqa: BLE001  every check runs and reports
            failed += 1
            print(f"FAILED {f.__name__}\n{traceback.format_exc()}")
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

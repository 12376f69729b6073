"""Feature checks of the out-of-tree minitape backend, run in a process of their own.

``python outoftree_checks.py RESULTS.json [SECTION ...]`` with ``tests/outoftree`` and a
directory holding the ``abstractdiff_minitape-*.dist-info`` (what ``pip install`` writes)
on ``PYTHONPATH``.  Each section runs, in the order below, and its outcome is written to
``RESULTS.json`` as ``{section: "ok" or the traceback}``; tests/test_out_of_tree.py turns
each into a test.  Nothing here registers anything: ``ad.backend("minitape")`` must
come from the ``abstractdiff.backends`` entry point.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from typing import Any, Callable

import minitape as mt
import numpy as np

import abstractdiff as ad
from abstractdiff import optim, testing

DTYPES = ("float64", "float32")
RTOL = {"float64": 1e-12, "float32": 2e-5}
SECTIONS: dict[str, Callable[[], None]] = {}


def section(fn: Callable[[], None]) -> Callable[[], None]:
    SECTIONS[fn.__name__] = fn
    return fn


def close(got: Any, want: Any, dtype: str, what: str) -> None:
    """``got`` is a minitape array of ``dtype`` equal to ``want`` (numpy, float64)."""
    assert isinstance(got, mt.Array), f"{what}: got a {type(got).__module__}.{type(got).__name__}, not a minitape.Array"
    assert str(got.dtype) == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    assert not got.requires_grad, f"{what}: the result is still attached to a graph"
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_allclose(got.data, want, rtol=RTOL[dtype], atol=RTOL[dtype] * np.abs(want).max(), err_msg=what)


# ------------------------------------------------------------------ discovery
@section
def before_backend_created() -> None:
    """The core finds minitape's objects before anything created the backend.

    Runs first: in a fresh process the registry only knows the entry point, not yet
    which modules the adapter handles.
    """
    p = mt.Parameter(np.ones(2))
    problems = []
    try:
        ad.Params([p])
    except Exception as err:  # noqa: BLE001
        problems.append(f"ad.Params([minitape.Parameter]) raised {type(err).__name__}")
    if not optim.holds_variables(mt.Linear(2, 1)):
        problems.append("optim.holds_variables(minitape.Linear) is False: optim.setup treats the model as an array")
    with tempfile.TemporaryDirectory() as tmp:
        model = {"w": mt.ones(2)}
        path = os.path.join(tmp, "ckpt.npz")
        ad.save_checkpoint(path, optim.setup(optim.Descent(), model), model)
        _, loaded = ad.load_checkpoint(path, like=(optim.setup(optim.Descent(), model), model))
        if not isinstance(loaded["w"], mt.Array):
            problems.append(f"ad.load_checkpoint restored a {type(loaded['w']).__name__}, not a minitape.Array")
    assert not problems, "; ".join(problems)


@section
def library() -> None:
    """minitape on its own: autoray dispatches to it, dtypes hold, reverse mode nests."""
    import autoray

    x = mt.Array(np.array([0.5, -1.0, 2.0], np.float32), requires_grad=True)
    assert autoray.infer_backend(x) == "minitape" and autoray.get_dtype_name(x) == "float32"
    y = autoray.do("sum", autoray.do("exp", x) * autoray.do("sin", x), axis=0)
    assert isinstance(y, mt.Array) and y.dtype == np.float32 and y.requires_grad
    assert autoray.do("astype", x, "float64").dtype == np.float64
    assert isinstance(autoray.do("stack", [x, x]), mt.Array) and autoray.do("zeros_like", x).dtype == np.float32
    (g,) = mt.grad(mt.sum(x**3), [x], create_graph=True)
    (h,) = mt.grad(mt.sum(g), [x])
    assert g.dtype == h.dtype == np.float32
    np.testing.assert_allclose(h.data, 6 * x.data, rtol=1e-6)
    assert (np.ones(3) * x).__class__ is mt.Array  # numpy defers to minitape's operators


@section
def entry_point() -> None:
    assert "minitape" in ad.registered_backends() and "minitape" in ad.available_backends()
    b = ad.backend("minitape")
    assert type(b).__module__ == "abstractdiff_minitape" and type(b).__name__ == "MinitapeBackend", repr(b)
    assert ad.backend("minitape") is b and b.name == "minitape" and b.devices() == ["cpu"]
    assert not b.approximate and not b.implicit and b.has_reverse


# ------------------------------------------------------------------ operators
@section
def conformance() -> None:
    """Every default scenario and operator (prepared ones too), explicit and implicit."""
    explicit = set(testing.OPERATORS)
    for target, operators in (("minitape", explicit), (ad.Implicit("minitape"), {"gradient", "pullback"})):
        report = testing.check_backend(target)
        assert report.ok, str(report)
        ran = {r.operator for r in report.results}
        assert operators <= ran, f"{testing.backend_label(ad.backend(target))} ran only {sorted(ran)}"
        assert {r.dtype for r in report.results} == set(DTYPES)


def _sin_sq(x: Any) -> Any:
    return mt.sum(mt.sin(x) * x**2)


def _sin_sq_grad(u: np.ndarray) -> np.ndarray:
    return np.cos(u) * u**2 + 2 * u * np.sin(u)


def _sin_sq_hess(u: np.ndarray) -> np.ndarray:
    return np.diag((2 - u**2) * np.sin(u) + 4 * u * np.cos(u))


def _sin_x(x: Any) -> Any:
    return mt.sin(x) * x


@section
def operators() -> None:
    """Every operator and every prepared operator against analytic results."""
    b = ad.backend("minitape")
    for dt in DTYPES:
        x0 = np.array([0.3, -1.2, 2.0], dtype=dt)
        x1 = np.array([1.1, 0.4, -0.7], dtype=dt)  # a prepared operator is called at another point
        t, dy = np.array([0.5, -1.0, 2.0], dtype=dt), np.array(1.5, dtype=dt)
        u0, u1, tu = (a.astype(np.float64) for a in (x0, x1, t))
        x = mt.asarray(x0)
        s = mt.asarray(np.array(0.8, dtype=dt))
        us = float(s.data)
        ds = np.cos(us) * us + np.sin(us)

        close(ad.gradient(b, _sin_sq, x), _sin_sq_grad(u0), dt, "gradient")
        y, g = ad.value_and_gradient(b, _sin_sq, x)
        close(y, np.sum(np.sin(u0) * u0**2), dt, "value")
        close(g, _sin_sq_grad(u0), dt, "value_and_gradient")
        close(ad.pullback(b, _sin_sq, x)(mt.asarray(dy)), 1.5 * _sin_sq_grad(u0), dt, "pullback")
        y, vjp = ad.value_and_pullback(b, _sin_x, x)
        close(vjp(mt.asarray(t)), t * (np.cos(u0) * u0 + np.sin(u0)), dt, "value_and_pullback")
        close(ad.pushforward(b, _sin_sq, x)(mt.asarray(t)), _sin_sq_grad(u0) @ tu, dt, "pushforward")
        y, jvp = ad.value_and_pushforward(b, _sin_x, x)
        close(jvp(mt.asarray(t)), (np.cos(u0) * u0 + np.sin(u0)) * tu, dt, "value_and_pushforward")
        close(ad.derivative(b, _sin_x, s), ds, dt, "derivative")
        close(ad.jacobian(b, _sin_x, x), np.diag(np.cos(u0) * u0 + np.sin(u0)), dt, "jacobian")
        close(ad.hessian(b, _sin_sq, x), _sin_sq_hess(u0), dt, "hessian")
        close(ad.hvp(b, _sin_sq, x, mt.asarray(t)), _sin_sq_hess(u0) @ tu, dt, "hvp")
        # numpy inputs come back as minitape arrays too
        close(ad.gradient(b, _sin_sq, x0), _sin_sq_grad(u0), dt, "gradient of numpy input")

        x1m = mt.asarray(x1)
        close(ad.prepare_gradient(b, _sin_sq, x)(x1m), _sin_sq_grad(u1), dt, "prepare_gradient")
        y, g = ad.prepare_value_and_gradient(b, _sin_sq, x)(x1m)
        close(y, np.sum(np.sin(u1) * u1**2), dt, "prepare_value_and_gradient value")
        close(g, _sin_sq_grad(u1), dt, "prepare_value_and_gradient")
        for name in ("prepare_pullback", "prepare_value_and_pullback"):  # both return (y, vjp)
            y, vjp = getattr(ad, name)(b, _sin_x, x)(x1m)
            close(y, np.sin(u1) * u1, dt, f"{name} value")
            close(vjp(mt.asarray(t)), t * (np.cos(u1) * u1 + np.sin(u1)), dt, name)
        jvp = ad.prepare_pushforward(b, _sin_x, x)(x1m)
        close(jvp(mt.asarray(t)), (np.cos(u1) * u1 + np.sin(u1)) * tu, dt, "prepare_pushforward")
        y, jvp = ad.prepare_value_and_pushforward(b, _sin_x, x)(x1m)
        close(y, np.sin(u1) * u1, dt, "prepare_value_and_pushforward value")
        close(jvp(mt.asarray(t)), (np.cos(u1) * u1 + np.sin(u1)) * tu, dt, "prepare_value_and_pushforward")
        close(ad.prepare_derivative(b, _sin_x, mt.asarray(np.array(0.1, dt)))(s), ds, dt, "prepare_derivative")
        close(ad.prepare_jacobian(b, _sin_x, x)(x1m), np.diag(np.cos(u1) * u1 + np.sin(u1)), dt, "prepare_jacobian")
        close(ad.prepare_hessian(b, _sin_sq, x)(x1m), _sin_sq_hess(u1), dt, "prepare_hessian")
        close(ad.prepare_hvp(b, _sin_sq, x, mt.asarray(t))(x1m, mt.asarray(t)), _sin_sq_hess(u1) @ tu, dt,
              "prepare_hvp")

        # a pytree x with an integer leaf (data: None in the gradient), and data in args
        tree = {"w": mt.asarray(np.array([[1.0, -2.0], [0.5, 3.0]], dt)), "i": mt.asarray(np.array([1, 1, 0]))}
        a = mt.asarray(np.array([2.0, -1.0], dt))

        def loss(p: Any, a: Any) -> Any:
            return mt.sum(mt.take(p["w"] @ a, p["i"], axis=0) ** 2)

        gt = ad.gradient(b, loss, tree, a)
        z = tree["w"].data.astype(np.float64) @ a.data.astype(np.float64)
        counts = np.bincount([1, 1, 0], minlength=2)
        close(gt["w"], np.outer(2 * counts * z, a.data.astype(np.float64)), dt, "pytree gradient")
        assert gt["i"] is None, gt["i"]

    # an operator inside a function another one differentiates: d/dx sum(grad f(x)^2)
    u = np.array([0.3, -1.2, 2.0])
    gg = ad.gradient(b, lambda x: mt.sum(ad.gradient(b, _sin_sq, x) ** 2), mt.asarray(u))
    close(gg, 2 * _sin_sq_hess(u) @ _sin_sq_grad(u), "float64", "gradient of a gradient")
    (g, aux) = ad.gradient(b, lambda x: (_sin_sq(x), {"twice": 2 * x}), mt.asarray(u), has_aux=True)
    close(aux["twice"], 2 * u, "float64", "aux")


@section
def to_numpy() -> None:
    b = ad.backend("minitape")
    x = mt.asarray(np.array([1.0, 2.0], np.float32))
    p = mt.Parameter(np.array([[3.0]]))
    g = ad.gradient(ad.Implicit("minitape"), lambda: mt.sum(p.value ** 2), ad.Params([p]))
    traced = []
    ad.gradient(b, lambda v: traced.append(ad.to_numpy(v)) or mt.sum(v), x)  # a value on the tape
    out = ad.to_numpy({"x": x, "p": p, "n": 3, "none": None, "nested": [x, (p,)], "grads": g})
    for a, want in ((out["x"], x.data), (out["p"], p.value.data), (out["nested"][0], x.data),
                    (out["nested"][1][0], p.value.data), (out["grads"][p], 2 * p.value.data), (traced[0], x.data)):
        assert type(a) is np.ndarray and a.dtype == want.dtype, (type(a), a.dtype)
        np.testing.assert_array_equal(a, want)
    assert out["n"] == 3 and out["none"] is None
    assert type(ad.to_numpy(x)) is np.ndarray and type(ad.to_numpy(p)) is np.ndarray


# ------------------------------------------------------------------ implicit mode
def _mlp_apply(values: list, scale: Any, x: Any) -> Any:
    """minitape.MLP's forward pass as an explicit function of its trainable values."""
    h = x
    for i in range(0, len(values), 2):
        h = h @ values[i] + values[i + 1]
        if i + 2 < len(values):
            h = mt.tanh(h)
    return h * scale


@section
def implicit() -> None:
    for dt in DTYPES:
        _implicit(dt)


def _implicit(dt: str) -> None:
    b, imp = ad.backend("minitape"), ad.Implicit("minitape")
    rng = np.random.default_rng(0)
    model = mt.MLP((3, 4, 2), dtype=dt)
    x = mt.asarray(rng.normal(size=(6, 3)).astype(dt))
    y = mt.asarray(rng.normal(size=(6, 2)).astype(dt))
    ps = ad.Params(model)
    assert len(ps) == 4 and ps.frozen == 1 and ps.kind == "minitape", repr(ps)
    before = [p.value for p in model.parameters()]

    def loss(x: Any, y: Any) -> Any:
        return mt.mean((model(x) - y) ** 2)

    value, gs = ad.value_and_gradient(imp, loss, ps, x, y)
    assert all(p.value is v for p, v in zip(model.parameters(), before)), "the parameters were changed"
    vals = [p.value for p in ps]
    ge = ad.gradient(b, lambda v, x, y: mt.mean((_mlp_apply(v, model.scale.value, x) - y) ** 2), vals, x, y)
    for p, g in zip(ps, ge):
        close(gs[p], ad.to_numpy(g), dt, "implicit gradient vs explicit")
    close(value, ad.to_numpy(loss(x, y)), dt, "implicit value")
    assert model.scale not in gs  # frozen: not differentiated

    # pullback of a vector output, and the prepared twins
    y_out, vjp = ad.value_and_pullback(imp, lambda x: model(x), ps, x)
    cot = mt.asarray(rng.normal(size=(6, 2)).astype(dt))
    gp = vjp(cot)
    ge = ad.pullback(b, lambda v, x: _mlp_apply(v, model.scale.value, x), vals, x)(cot)
    for p, g in zip(ps, ge):
        close(gp[p], ad.to_numpy(g), dt, "implicit pullback vs explicit")
    prepared = ad.prepare_gradient(imp, loss, ps, x, y)
    for p, g in zip(ps, ad.gradient(b, lambda v, x, y: mt.mean((_mlp_apply(v, model.scale.value, x) - y) ** 2),
                                    vals, x, y)):
        close(prepared(ps, x, y)[p], ad.to_numpy(g), dt, "prepared implicit gradient")

    # Parameters in a tree, made by ad.variables (the new_variable hook)
    vs = ad.variables({"w": np.array([1.0, -2.0], dt), "c": np.array(3.0, dt), "n": 4, "i": np.arange(2)},
                      "minitape")
    assert isinstance(vs["w"], mt.Parameter) and isinstance(vs["c"], mt.Parameter), vs
    assert vs["n"] == 4 and isinstance(vs["i"], mt.Array) and vs["i"].dtype == np.int64
    gs = ad.gradient(imp, lambda: vs["c"].value * mt.sum(vs["w"].value ** 2), ad.Params(vs))
    close(gs[vs["w"]], 2 * 3.0 * np.array([1.0, -2.0]), dt, "ad.variables gradient w")
    close(gs[vs["c"]], 5.0, dt, "ad.variables gradient c")


# ------------------------------------------------------------------ optimisers
RULES = {
    "Adam": lambda: optim.Adam(lr=0.1),
    "Momentum": lambda: optim.Momentum(lr=0.1, rho=0.9),
    "ClipNorm+Adam": lambda: optim.chain(optim.ClipNorm(0.5), optim.Adam(lr=0.1)),
}


@section
def optimisers() -> None:
    """Rules update a pytree of minitape arrays (explicit) and a Module (implicit) exactly
    as they update numpy arrays, in the arrays' dtype."""
    rng = np.random.default_rng(1)
    for dt in DTYPES:
        x = rng.normal(size=(8, 3)).astype(dt)
        y = rng.normal(size=(8, 2)).astype(dt)
        for name, make in RULES.items():
            _optimise(dt, name, make, x, y, rng)


def _optimise(dt: str, name: str, make: Callable[[], optim.Rule], x: np.ndarray, y: np.ndarray,
              rng: np.random.Generator) -> None:
    b, imp = ad.backend("minitape"), ad.Implicit("minitape")
    # explicit: three steps on {"w", "b", "n"} against the same steps on numpy arrays
    ref: Any = {"w": rng.normal(size=(3, 2)).astype(dt), "b": np.zeros(2, dt), "n": 7}
    model = {"w": mt.asarray(ref["w"]), "b": mt.asarray(ref["b"]), "n": 7}
    state, ref_state = optim.setup(make(), model), optim.setup(make(), ref)

    def loss(p: Any, x: Any, y: Any) -> Any:
        return mt.mean((x @ p["w"] + p["b"] - y) ** 2)

    for _ in range(3):
        g = ad.gradient(b, loss, model, x, y)
        state, model = optim.update(state, model, g)
        ref_state, ref = optim.update(ref_state, ref, ad.to_numpy(g))
    for k in ("w", "b"):
        close(model[k], ref[k], dt, f"{name} explicit {k}")
        m_state = state.tree[k]
        assert all(isinstance(leaf, mt.Array) for leaf in _arrays(m_state)), (name, m_state)
    assert model["n"] == 7 and state.step == 3

    # implicit: the Module's parameters are assigned in place
    net = mt.MLP((3, 2), dtype=dt)
    state = optim.setup(make(), net)
    assert state.implicit
    ref_values = [p.value.numpy() for p in ad.Params(net)]
    ref_state = optim.setup(make(), ref_values)
    scale = net.scale.value
    for _ in range(3):
        gs = ad.gradient(imp, lambda x, y: mt.mean((net(x) - y) ** 2), ad.Params(net), x, y)
        ref_grads = [ad.to_numpy(gs[p]) for p in ad.Params(net)]
        state, same = optim.update(state, net, gs)
        assert same is net
        ref_state, ref_values = optim.update(ref_state, ref_values, ref_grads)
    for p, want in zip(ad.Params(net), ref_values):
        close(p.value, want, dt, f"{name} implicit")
    assert net.scale.value is scale, "a frozen parameter was updated"


def _arrays(tree: Any) -> list:
    import optree

    return [leaf for leaf in optree.tree_leaves(tree) if not isinstance(leaf, int)]


# ------------------------------------------------------------------ training
def _regression(dt: str) -> tuple[list, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    w, c = rng.normal(size=(3, 2)), rng.normal(size=2)
    x = rng.normal(size=(64, 3))
    y = x @ w + c
    batches = [(x[i:i + 16].astype(dt), y[i:i + 16].astype(dt)) for i in range(0, 64, 16)]
    return batches, w, c


def _mse(p: Any, x: Any, y: Any) -> Any:
    return mt.mean((x @ p["w"] + p["b"] - y) ** 2)


def _module_mse(net: Any, x: Any, y: Any) -> Any:
    return mt.mean((net(x) - y) ** 2)


@section
def training() -> None:
    for dt in DTYPES:
        _train(dt)


def _train(dt: str) -> None:
    b, imp = ad.backend("minitape"), ad.Implicit("minitape")
    data, w, c = _regression(dt)
    model = {"w": np.zeros((3, 2), dt), "b": np.zeros(2, dt)}  # numpy leaves: converted by train
    losses: list[float] = []
    state = optim.setup(optim.Adam(lr=0.1), model)
    state, model = ad.train(_mse, model, data, state, backend=b, epochs=60, progress=False,
                            callbacks=[lambda info: losses.append(info.loss)])
    assert state.step == 240 and isinstance(model["w"], mt.Array) and str(model["w"].dtype) == dt
    assert losses[-1] < 1e-3 * losses[0], (losses[0], losses[-1])
    np.testing.assert_allclose(model["w"].data, w, atol=1e-2)

    net = mt.Linear(3, 2, dtype=dt)
    losses = []
    state = optim.setup(optim.Adam(lr=0.1), net)
    state, same = ad.train(_module_mse, net, data, state, backend=imp, epochs=60, progress=False,
                           callbacks=[lambda info: losses.append(info.loss)])
    assert same is net and state.implicit and state.step == 240
    assert losses[-1] < 1e-3 * losses[0], (losses[0], losses[-1])
    assert str(net.w.value.dtype) == dt
    np.testing.assert_allclose(net.w.value.data, w, atol=1e-2)
    np.testing.assert_allclose(net.b.value.data, c, atol=1e-2)


# ------------------------------------------------------------------ checkpoints
@section
def checkpoints() -> None:
    b, imp = ad.backend("minitape"), ad.Implicit("minitape")
    rule = optim.chain(optim.ClipNorm(1.0), optim.Adam(lr=0.05))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.npz")
        for dt in DTYPES:
            data, _, _ = _regression(dt)
            # explicit: a pytree of minitape arrays and its optimiser state
            model = {"w": mt.zeros((3, 2), dt), "b": mt.zeros(2, dt)}
            state, model = ad.train(_mse, model, data, optim.setup(rule, model), backend=b, progress=False)
            ad.save_checkpoint(path, state, model)
            blank = {"w": mt.ones((3, 2), dt), "b": mt.ones(2, dt)}
            state2, model2 = ad.load_checkpoint(path, like=(optim.setup(rule, blank), blank))
            assert state2.step == state.step == 4
            for k in model:
                close(model2[k], model[k].data, dt, f"restored {k}")
            for got, want in zip(_arrays(state2.tree), _arrays(state.tree)):
                close(got, want.data, dt, "restored optimiser state")
            # training on from the checkpoint is training on from where it was saved
            _, after = ad.train(_mse, model, data, state, backend=b, progress=False)
            _, after2 = ad.train(_mse, model2, data, state2, backend=b, progress=False)
            for k in model:
                close(after2[k], after[k].data, dt, f"trained on from the checkpoint: {k}")

            # implicit: a Module, restored in place (its frozen parameter too)
            net = mt.MLP((3, 4, 2), dtype=dt)
            net.scale.value = mt.asarray(np.array(0.5, dt))
            state = optim.setup(rule, net)
            state, net = ad.train(_module_mse, net, data, state, backend=imp, progress=False)
            ad.save_checkpoint(path, state, net)
            other = mt.MLP((3, 4, 2), dtype=dt, seed=7)
            state2, restored = ad.load_checkpoint(path, like=(optim.setup(rule, other), other))
            assert restored is other and state2.step == 4 and state2.implicit
            for (name, p), (name2, q) in zip(net.named_parameters(), other.named_parameters()):
                assert name == name2 and isinstance(q, mt.Parameter) and isinstance(q.value, mt.Array)
                close(q.value, p.value.data, dt, f"restored parameter {name}")
            for got, want in zip(_arrays(state2.tree), _arrays(state.tree)):
                close(got, want.data, dt, "restored implicit optimiser state")


def main(argv: list[str]) -> int:
    out, wanted = argv[0], argv[1:] or list(SECTIONS)
    results: dict[str, str] = {}
    for name in wanted:
        try:
            SECTIONS[name]()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - each section reports, the next one runs
            results[name] = traceback.format_exc()
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    for name, outcome in results.items():
        print(f"{name}: {'ok' if outcome == 'ok' else 'FAILED'}")
    return 0 if all(v == "ok" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The training layer is never silently wrong (issue 24, item 5).

- a Python-float model leaf, which ``ad.gradient`` differentiates, is trained by
  ``train_step`` and stays a Python float;
- ``ad.DataParallel`` ends every step with identical buffers (BatchNorm's running
  statistics) on every process: rank 0's, broadcast as torch's DDP does;
- an implicit-mode optimiser state belongs to the variables it was set up for: another
  model's variables of the same shapes are refused, not handed its Adam moments;
- each parameter keeps its own dtype and precision: float64 data and a float64
  parameter are not narrowed to the dtype of a float32 (or float16) first parameter.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import autoray
import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim

ROOT = Path(__file__).resolve().parent.parent


def need(name: str) -> ad.Backend:
    try:
        return ad.backend(name)
    except ad.BackendUnavailableError as err:
        pytest.skip(str(err))


def need_torch():
    return pytest.importorskip("torch")


# ------------------------------------------------------------------ 1. Python-float leaves
def scaled_distance(m, x):
    return autoray.do("sum", (m["w"] * m["b"] - x) ** 2)


# The gradient in "b" at w = (1, 1), b = 3, x = 0 is sum(2 * (w*b - x) * w) = 12.
BACKENDS = ["finite_differences", "torch", "jax", "autograd", "tensorflow"]
RTOL = {"finite_differences": 1e-7}


@pytest.mark.parametrize("name", BACKENDS)
def test_a_python_float_leaf_is_trained_and_stays_a_python_float(name):
    need(name)
    x = np.zeros(2)
    model = {"w": np.ones(2), "b": 3.0}
    g = ad.gradient(name, scaled_distance, model, x)
    np.testing.assert_allclose(float(ad.to_numpy(g["b"])), 12.0, rtol=RTOL.get(name, 1e-12))
    state = optim.setup(optim.Descent(0.1), model)
    state, new, _ = ad.train_step(scaled_distance, model, (x,), state, backend=name)
    assert type(new["b"]) is float
    np.testing.assert_allclose(new["b"], 3.0 - 0.1 * 12.0, rtol=RTOL.get(name, 1e-12))
    assert model["b"] == 3.0  # explicit mode is pure


@pytest.mark.parametrize("name", BACKENDS)
def test_a_python_float_leaf_trains_exactly_as_a_0d_float64_array(name):
    need(name)
    x = np.array([0.5, -1.0])
    as_float = {"w": np.ones(2), "b": 3.0}
    as_array = {"w": np.ones(2), "b": np.array(3.0)}
    rule = optim.chain(optim.ClipNorm(5.0), optim.Adam(0.1))
    s_float, s_array = optim.setup(rule, as_float), optim.setup(rule, as_array)
    for _ in range(3):
        s_float, as_float, _ = ad.train_step(scaled_distance, as_float, (x,), s_float, backend=name)
        s_array, as_array, _ = ad.train_step(scaled_distance, as_array, (x,), s_array, backend=name)
    assert type(as_float["b"]) is float and s_float.step == 3
    if ad.backend(name).compiler is None:
        assert as_float["b"] == float(ad.to_numpy(as_array["b"]))  # the same arithmetic, bit for bit
        np.testing.assert_array_equal(ad.to_numpy(as_float["w"]), ad.to_numpy(as_array["w"]))
    else:  # the arrays' steps ran compiled (a Python-float leaf does not): the same arithmetic, to 1e-12
        np.testing.assert_allclose(as_float["b"], float(ad.to_numpy(as_array["b"])), rtol=1e-12)
        np.testing.assert_allclose(ad.to_numpy(as_float["w"]), ad.to_numpy(as_array["w"]), rtol=1e-12)


def test_optim_update_trains_a_python_float_with_numpy_gradients():
    state = optim.setup(optim.Momentum(lr=0.5, rho=0.5), {"b": 2.0, "n": 3})
    state, new = optim.update(state, {"b": 2.0, "n": 3}, {"b": np.array(1.0), "n": None})
    state, new = optim.update(state, new, {"b": np.array(1.0), "n": None})
    assert type(new["b"]) is float and new["n"] == 3
    assert new["b"] == 2.0 - 0.5 - (0.5 * 0.5 + 0.5)  # v1 = 0.5, v2 = 0.75


def test_a_frozen_python_float_is_the_same_object(fd):
    model = {"w": np.ones(2), "b": 3.0}
    state = optim.freeze(optim.setup(optim.Descent(0.1), model), "b")
    _, new, _ = ad.train_step(scaled_distance, model, (np.zeros(2),), state, backend=fd)
    assert new["b"] is model["b"]


def test_a_python_float_leaf_and_its_state_round_trip_through_a_checkpoint(tmp_path, fd):
    model = {"w": np.ones(2), "b": 3.0}
    state = optim.setup(optim.Adam(0.1), model)
    state, model, _ = ad.train_step(scaled_distance, model, (np.zeros(2),), state, backend=fd)
    ad.save_checkpoint(tmp_path / "c.npz", state, model)
    like = ({"w": np.zeros(2), "b": 0.0})
    loaded_state, loaded = ad.load_checkpoint(tmp_path / "c.npz", like=(optim.setup(optim.Adam(0.1), like), like))
    assert loaded["b"] == model["b"] and type(loaded["b"]) is float
    m, s, _ = loaded_state.tree["b"]
    np.testing.assert_array_equal(m, state.tree["b"][0])
    np.testing.assert_array_equal(s, state.tree["b"][1])


# ------------------------------------------------------------------ 2. DataParallel buffers
def _gloo_reason() -> str | None:
    try:
        import torch.distributed as dist
    except ImportError as err:
        return f"torch is not installed ({err})"
    if not (dist.is_available() and dist.is_gloo_available()):
        return "this torch has no torch.distributed with gloo"
    return None


WORKER = textwrap.dedent('''
    import sys
    import numpy as np
    import torch
    import abstractdiff as ad
    from abstractdiff import optim

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)).double()
    dp = ad.DataParallel("gloo", timeout=60)
    if dp.rank == 1:  # rank 0's buffers must win from the start, too
        net[1].running_var.add_(1.0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 1))
    x[4:] += 3.0  # the two processes' rows have different means
    state = optim.setup(optim.Descent(0.1), net)
    for _ in range(2):
        state, net, _ = ad.train_step(lambda m, x, y: ((m(x) - y) ** 2).mean(), net, (x, y), state,
                                      backend=ad.Implicit("torch"), distributed=dp)
    np.savez(f"{sys.argv[1]}/rank{dp.rank}.npz", **{k: v.detach().numpy() for k, v in net.state_dict().items()})
    dp.close()
''')


@pytest.mark.skipif(_gloo_reason() is not None, reason=str(_gloo_reason()))
def test_data_parallel_ends_every_step_with_rank_0s_buffers_on_every_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=dict(env, RANK=str(r),
                              LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errs)
    with np.load(tmp_path / "rank0.npz") as f0, np.load(tmp_path / "rank1.npz") as f1:
        rank0, rank1 = dict(f0), dict(f1)
    assert set(rank0) == set(rank1) and "1.running_mean" in rank0
    for k in rank0:
        np.testing.assert_array_equal(rank0[k], rank1[k], err_msg=k)
    assert int(rank0["1.num_batches_tracked"]) == 2
    assert np.all(rank0["1.running_mean"] != 0.0)  # the statistics did move: the check is not vacuous


# ------------------------------------------------------------------ 3. state belongs to its variables
def _implicit_loss(m, x):
    return (m(x) ** 2).sum()


def test_a_state_set_up_for_one_layer_refuses_another_of_the_same_shapes():
    torch = need_torch()
    b = ad.Implicit(need("torch"))
    torch.manual_seed(0)
    a_layer, b_layer = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    x = np.random.default_rng(0).normal(size=(4, 3))
    state = optim.setup(optim.Adam(0.1), a_layer)
    for _ in range(2):
        state, a_layer, _ = ad.train_step(_implicit_loss, a_layer, (x,), state, backend=b)
    before = [p.detach().clone() for p in b_layer.parameters()]
    with pytest.raises(ad.UnknownVariableError, match="variable 0 of this model .* not the variable the optimiser"):
        ad.train_step(_implicit_loss, b_layer, (x,), state, backend=b)
    for p, old in zip(b_layer.parameters(), before):  # nothing was applied
        assert torch.equal(p.detach(), old)
    # a state set up for b_layer trains it from fresh moments, as Adam's first step does
    fresh = optim.setup(optim.Adam(0.1), b_layer)
    _, b_layer, _ = ad.train_step(_implicit_loss, b_layer, (x,), fresh, backend=b)
    for p, old in zip(b_layer.parameters(), before):  # Adam's first step is lr * sign(g)
        np.testing.assert_allclose(np.abs(p.detach().numpy() - old.numpy()), 0.1, rtol=1e-6)


def test_the_state_of_ad_variables_is_tied_to_them_too(fd):
    ib = ad.Implicit(fd)
    first, second = ad.variables({"w": np.ones(2)}, ib), ad.variables({"w": np.ones(2)}, ib)
    state = optim.setup(optim.Momentum(0.1), first)
    grads = ad.gradient(ib, lambda: (second["w"].value ** 2).sum(), ad.Params(second))
    with pytest.raises(ad.UnknownVariableError, match="not the variable the optimiser state was set up for"):
        optim.update(state, second, grads)
    np.testing.assert_array_equal(second["w"].value, np.ones(2))


def test_the_state_holds_its_variables_weakly():
    torch = need_torch()
    layer = torch.nn.Linear(2, 2)
    state = optim.setup(optim.Adam(), layer)
    alive = weakref.ref(layer.weight)
    del layer
    gc.collect()
    assert alive() is None
    assert len(state.variables) == 2


def test_a_state_loaded_into_a_fresh_model_belongs_to_that_model(tmp_path):
    torch = need_torch()
    b = ad.Implicit(need("torch"))
    x = np.random.default_rng(1).normal(size=(4, 3))
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2).double()
    state = optim.setup(optim.Adam(0.1), net)
    state, net, _ = ad.train_step(_implicit_loss, net, (x,), state, backend=b)
    ad.save_checkpoint(tmp_path / "c.npz", state, net)
    fresh = torch.nn.Linear(3, 2).double()
    loaded, fresh = ad.load_checkpoint(tmp_path / "c.npz", like=(state, fresh))  # like's state: net's
    loaded, fresh, _ = ad.train_step(_implicit_loss, fresh, (x,), loaded, backend=b)
    state, net, _ = ad.train_step(_implicit_loss, net, (x,), state, backend=b)
    for p, q in zip(fresh.parameters(), net.parameters()):
        assert torch.equal(p.detach(), q.detach())


# ------------------------------------------------------------------ 4. each parameter keeps its precision
X64 = np.linspace(0.1, 1.0, 5) + 1e-9  # float64 data that float32 cannot hold
B64 = np.array([1.0 + 1e-9])


def _mixed_loss(m, x):
    # "a" (the narrow one) comes first in Params order; "b" meets only float64 values
    return autoray.do("sum", m["a"] ** 2) + autoray.do("sum", (m["b"] * x - x**2) ** 2)


def _float64_reference(lr: float) -> np.ndarray:
    g = np.sum(2.0 * (B64 * X64 - X64**2) * X64)
    return B64 - lr * g


def _check_the_float64_parameter(model, narrow: str) -> None:
    b = ad.to_numpy(model["b"])
    assert b.dtype == np.float64 and ad.to_numpy(model["a"]).dtype == np.dtype(narrow)
    np.testing.assert_allclose(b, _float64_reference(0.01), rtol=0, atol=1e-12)


@pytest.mark.parametrize("narrow", ["float16", "float32"])
def test_torch_implicit_keeps_a_float64_parameter_in_float64_next_to_a_narrow_first_one(narrow):
    torch = need_torch()
    ib = ad.Implicit(need("torch"))
    model = {"a": torch.tensor([0.5], dtype=getattr(torch, narrow), requires_grad=True),
             "b": torch.tensor(B64, requires_grad=True)}
    state = optim.setup(optim.Descent(0.01), model)
    state, model, loss = ad.train_step(_mixed_loss, model, (X64,), state, backend=ib)
    _check_the_float64_parameter(model, narrow)


def test_paddle_implicit_keeps_a_float64_parameter_in_float64_next_to_a_float32_first_one():
    ib = ad.Implicit(need("paddle"))
    model = ad.variables({"a": np.array([0.5], dtype=np.float32), "b": B64}, ib)
    state = optim.setup(optim.Descent(0.01), model)
    state, model, _ = ad.train_step(_mixed_loss, model, (X64,), state, backend=ib)
    _check_the_float64_parameter(model, "float32")


# (tensorflow refuses float32 + float64 in the loss itself)
@pytest.mark.parametrize("name", ["torch", "paddle", "jax", "autograd"])
def test_explicit_mode_keeps_a_float64_parameter_in_float64_next_to_a_float32_first_one(name):
    need(name)
    model = {"a": np.array([0.5], dtype=np.float32), "b": B64.copy()}
    state = optim.setup(optim.Descent(0.01), model)
    state, model, _ = ad.train_step(_mixed_loss, model, (X64,), state, backend=name)
    _check_the_float64_parameter(model, "float32")

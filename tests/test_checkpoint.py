"""Checkpoints: round trips on every backend and mode, atomic writes, and refusal of bad files."""

from __future__ import annotations

import json
import os
import pickle

import autoray
import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim
from abstractdiff._implicit import current_values

TARGET = np.array([1.0, -2.0, 3.0])


def quadratic(model, c):
    return autoray.do("sum", (current_values(model)["w"] - c) ** 2)


def need(name: str):
    try:
        return ad.backend(name)
    except ad.BackendUnavailableError as err:
        pytest.skip(str(err))


def trained(backend="finite_differences", steps=3, model=None):
    model = {"w": np.zeros(3), "b": np.ones((2, 2), dtype=np.float32), "n": 5} if model is None else model
    state = optim.setup(optim.chain(optim.ClipNorm(10.0), optim.Adam(0.1)), model)
    return ad.train(quadratic, model, [(TARGET,)] * steps, state, backend=backend, progress=False)


def assert_trees_equal(a, b):
    la, lb = ad.to_numpy(a), ad.to_numpy(b)
    import optree

    xa, ta = optree.tree_flatten(la)
    xb, tb = optree.tree_flatten(lb)
    assert ta == tb
    for u, v in zip(xa, xb):
        if isinstance(u, np.ndarray):
            assert u.dtype == v.dtype
            np.testing.assert_array_equal(u, v)
        else:
            assert u == v


# ------------------------------------------------------------------ round trips
def test_round_trip_restores_everything_and_training_continues_identically(tmp_path):
    state, model = trained()
    path = tmp_path / "ckpt.npz"
    ad.save_checkpoint(path, state, model)
    fresh_model = {"w": np.zeros(3), "b": np.ones((2, 2), dtype=np.float32), "n": 5}
    like = (optim.setup(state.rule, fresh_model), fresh_model)
    s2, m2 = ad.load_checkpoint(path, like=like)
    assert s2.step == 3 and s2.tree["w"][1][2] == 3  # the step counter and Adam's t
    assert_trees_equal((s2, m2), (state, model))
    a = ad.train(quadratic, model, [(TARGET,)] * 2, state, backend="finite_differences", progress=False)
    b = ad.train(quadratic, m2, [(TARGET,)] * 2, s2, backend="finite_differences", progress=False)
    assert_trees_equal(a, b)


@pytest.mark.parametrize("name", ["torch", "jax", "tensorflow", "autograd"])
def test_round_trip_gives_the_like_leaves_library_and_dtype(tmp_path, name):
    b = need(name)
    state, model = trained(b)
    ad.save_checkpoint(tmp_path / "c.npz", state, model)
    like_model = {"w": b.convert(np.zeros(3)), "b": b.convert(np.ones((2, 2), dtype=np.float32)), "n": 5}
    s2, m2 = ad.load_checkpoint(tmp_path / "c.npz", like=(optim.setup(state.rule, like_model), like_model))
    assert b.is_native(m2["w"]) and b.is_native(s2.tree["w"][1][0])
    assert ad.to_numpy(m2["w"]).dtype == np.float64 and ad.to_numpy(m2["b"]).dtype == np.float32
    assert_trees_equal((s2, m2), (state, model))


@pytest.mark.parametrize("name", ["finite_differences", "jax", "torch", "tensorflow"])
def test_implicit_variables_are_assigned_in_place(tmp_path, name):
    if name != "finite_differences":
        need(name)
    b = ad.Implicit(name)
    vs = ad.variables({"w": np.zeros(3)}, b)
    state, vs = trained(b, model=vs)
    ad.save_checkpoint(tmp_path / "c.npz", state, vs)
    other = ad.variables({"w": np.full(3, 9.0)}, b)
    box = other["w"]
    s2, m2 = ad.load_checkpoint(tmp_path / "c.npz", like=(optim.setup(state.rule, other), other))
    assert m2 is other and other["w"] is box
    np.testing.assert_array_equal(ad.to_numpy(other)["w"], ad.to_numpy(vs)["w"])
    assert s2.implicit and s2.step == state.step


def test_torch_module_round_trip(tmp_path):
    need("torch")
    import torch

    net = torch.nn.Linear(3, 2).double()
    state = optim.setup(optim.Momentum(0.1), net)
    ad.save_checkpoint(tmp_path / "net.npz", state, net)
    other = torch.nn.Linear(3, 2).double()
    weight = other.weight
    ad.load_checkpoint(tmp_path / "net.npz", like=(optim.setup(optim.Momentum(0.1), other), other))
    assert other.weight is weight and other.weight.requires_grad
    torch.testing.assert_close(other.weight, net.weight, rtol=0, atol=0)
    torch.testing.assert_close(other.bias, net.bias, rtol=0, atol=0)


def _frozen_bn_net():
    import torch

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)).double()
    net[0].weight.requires_grad_(False)  # frozen (fine-tuning)
    return net


def test_torch_module_keeps_frozen_parameters_and_buffers(tmp_path):
    need("torch")
    import torch

    torch.manual_seed(0)
    net = _frozen_bn_net()
    net(torch.randn(8, 3, dtype=torch.float64))  # training mode: updates BatchNorm's running statistics
    loss = lambda m, x: (m(x) ** 2).mean()  # noqa: E731
    state = optim.setup(optim.Adam(0.1), net)
    data = [(np.random.default_rng(0).normal(size=(8, 3)),)] * 2
    state, net = ad.train(loss, net, data, state, backend=ad.Implicit("torch"), progress=False)
    ad.save_checkpoint(tmp_path / "net.npz", state, net)
    other = _frozen_bn_net()
    frozen = other[0].weight
    s2, m2 = ad.load_checkpoint(tmp_path / "net.npz", like=(optim.setup(optim.Adam(0.1), other), other))
    assert m2 is other and other[0].weight is frozen and not frozen.requires_grad
    for name, t in net.state_dict().items():  # frozen weight, running mean/var and num_batches_tracked too
        torch.testing.assert_close(other.state_dict()[name], t, rtol=0, atol=0, msg=name)
    assert int(other[1].num_batches_tracked) == 3
    # the optimiser state is still one entry per trainable parameter, in Params order
    assert len(s2.tree) == len(ad.Params(other)) == 5
    for a, b in zip(s2.tree, state.tree):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    a = ad.train(loss, net, data, state, backend=ad.Implicit("torch"), progress=False)
    b = ad.train(loss, other, data, s2, backend=ad.Implicit("torch"), progress=False)
    for u, v in zip(a[1].state_dict().values(), b[1].state_dict().values()):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def test_torch_mismatch_names_the_buffer_and_assigns_nothing(tmp_path):
    need("torch")
    import torch

    net = _frozen_bn_net()
    ad.save_checkpoint(tmp_path / "net.npz", optim.setup(optim.Descent(), net), net)
    other = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))  # float32
    other[0].weight.requires_grad_(False)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ad.CheckpointError, match=r"model/variable0 \(0.weight\) is float64\(3, 3\) in the file"):
        ad.load_checkpoint(tmp_path / "net.npz", like=(optim.setup(optim.Descent(), other), other))
    for k, v in other.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_keras_model_keeps_non_trainable_variables(tmp_path):
    need("tensorflow")
    import keras

    if keras.backend.backend() != "tensorflow":
        pytest.skip("Keras runs on the tensorflow backend only here")

    def make():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.BatchNormalization()])

    model = make()
    x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
    model(x, training=True)  # updates the moving mean and variance (non-trainable)
    assert len(model.non_trainable_variables) == 2
    state = optim.setup(optim.Descent(0.1), model)
    ad.save_checkpoint(tmp_path / "k.npz", state, model)
    other = make()
    s2, m2 = ad.load_checkpoint(tmp_path / "k.npz", like=(optim.setup(optim.Descent(0.1), other), other))
    assert m2 is other and len(s2.tree) == len(model.trainable_variables)
    for u, v in zip(model.variables, other.variables):
        np.testing.assert_array_equal(np.asarray(v), np.asarray(u))
    assert np.any(np.asarray(other.layers[1].moving_mean) != 0)


def test_zero_dimensional_arrays_round_trip(tmp_path):
    b = ad.Implicit("finite_differences")
    vs = ad.variables({"w": np.zeros(3), "s": np.array(2.5)}, b)
    state = optim.setup(optim.Momentum(0.1), vs)
    ad.save_checkpoint(tmp_path / "c.npz", state, vs)
    other = ad.variables({"w": np.ones(3), "s": np.array(0.0)}, b)
    ad.load_checkpoint(tmp_path / "c.npz", like=(optim.setup(optim.Momentum(0.1), other), other))
    assert other["s"].value.shape == () and float(other["s"].value) == 2.5


# ------------------------------------------------------------------ atomic writes
def _writer(suffix):
    """The module and function that write a checkpoint of ``suffix``: what a failed save patches."""
    if suffix == ".safetensors":
        return pytest.importorskip("safetensors.numpy"), "save"
    return np, "savez"


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path, monkeypatch, suffix):
    module, writer = _writer(suffix)
    state, model = trained()
    path = tmp_path / f"ckpt{suffix}"
    ad.save_checkpoint(path, state, model)
    before = path.read_bytes()
    state2, model2 = trained(steps=5)
    ad.save_checkpoint(path, state2, model2)  # overwriting works
    assert os.listdir(tmp_path) == [path.name]
    after = path.read_bytes()
    assert after != before

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(module, writer, fail)
    with pytest.raises(OSError, match="disk full"):
        ad.save_checkpoint(path, state, model)
    assert path.read_bytes() == after, "a failed save must not touch the existing checkpoint"
    assert os.listdir(tmp_path) == [path.name]


# ------------------------------------------------------------------ refusing bad files
def like_of(model=None):
    model = {"w": np.zeros(3), "b": np.ones((2, 2), dtype=np.float32), "n": 5} if model is None else model
    return optim.setup(optim.chain(optim.ClipNorm(10.0), optim.Adam(0.1)), model), model


def test_truncated_file_is_refused(tmp_path):
    state, model = trained()
    path = tmp_path / "ckpt.npz"
    ad.save_checkpoint(path, state, model)
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 30):
        path.write_bytes(data[:cut])
        with pytest.raises(ad.CheckpointError, match="truncated"):
            ad.load_checkpoint(path, like=like_of())


@pytest.mark.parametrize("suffix, cut", [(".npz", 40), (".safetensors", 10)])
def test_truncated_file_does_not_touch_variables(tmp_path, suffix, cut):
    _writer(suffix)  # skips where the format's package is missing
    b = ad.Implicit("finite_differences")
    vs = ad.variables({"w": np.zeros(3)}, b)
    state, vs = trained(b, model=vs)
    path = tmp_path / f"c{suffix}"
    ad.save_checkpoint(path, state, vs)
    path.write_bytes(path.read_bytes()[:-cut])
    other = ad.variables({"w": np.full(3, 9.0)}, b)
    with pytest.raises(ad.CheckpointError):
        ad.load_checkpoint(path, like=(optim.setup(state.rule, other), other))
    np.testing.assert_array_equal(other["w"].value, np.full(3, 9.0))


@pytest.mark.parametrize(
    "model,match",
    [
        (
            {"w": np.zeros(4), "b": np.ones((2, 2), dtype=np.float32), "n": 5},
            r"float64\(3,\) in the file but float64\(4,\)",
        ),
        ({"w": np.zeros(3), "b": np.ones((2, 2), dtype=np.float64), "n": 5}, "float32.* in the file but float64"),
        ({"w": np.zeros(3), "c": np.ones((2, 2), dtype=np.float32), "n": 5}, "where like has"),
        ({"w": np.zeros(3), "b": np.ones((2, 2), dtype=np.float32)}, "leaves, like has"),
        ({"w": np.zeros(3), "b": np.ones((2, 2), dtype=np.float32), "n": "five"}, "is a int in the file but a str"),
    ],
    ids=["shape", "dtype", "key", "missing-leaf", "static-type"],
)
def test_mismatched_like_is_refused(tmp_path, model, match):
    state, saved = trained()
    ad.save_checkpoint(tmp_path / "c.npz", state, saved)
    with pytest.raises(ad.CheckpointError, match=match):
        ad.load_checkpoint(tmp_path / "c.npz", like=like_of(model))


def test_a_different_rule_is_refused(tmp_path):
    state, model = trained()
    ad.save_checkpoint(tmp_path / "c.npz", state, model)
    like_model = {"w": np.zeros(3), "b": np.ones((2, 2), dtype=np.float32), "n": 5}
    with pytest.raises(ad.CheckpointError, match="does not match like"):
        ad.load_checkpoint(tmp_path / "c.npz", like=(optim.setup(optim.Momentum(), like_model), like_model))


def test_mismatch_assigns_no_variable(tmp_path):
    b = ad.Implicit("finite_differences")
    saved = ad.variables({"w": np.zeros(3), "v": np.zeros(2)}, b)
    state = optim.setup(optim.Descent(), saved)
    ad.save_checkpoint(tmp_path / "c.npz", state, saved)
    # Params order is v, w: v matches, the later w does not
    other = ad.variables({"w": np.full(4, 9.0), "v": np.full(2, 9.0)}, b)
    with pytest.raises(ad.CheckpointError, match=r"model/variable1 is float64\(3,\) in the file but float64\(4,\)"):
        ad.load_checkpoint(tmp_path / "c.npz", like=(optim.setup(optim.Descent(), other), other))
    np.testing.assert_array_equal(other["v"].value, np.full(2, 9.0))  # v matched but was not assigned


class RunsCode:
    """Unpickling this creates a file: a stand-in for arbitrary code execution."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_file_that_would_run_code_when_unpickled_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    state, model = trained()
    good = tmp_path / "good.npz"
    ad.save_checkpoint(good, state, model)
    with np.load(good, allow_pickle=False) as f:
        entries = {k: f[k] for k in f.files}
    entries["leaf3"] = np.array([RunsCode(str(marker))], dtype=object)  # replace an array by a pickle
    evil = tmp_path / "evil.npz"
    with open(evil, "wb") as fh:
        np.savez(fh, allow_pickle=True, **entries)
    with pytest.raises(ad.CheckpointError, match="pickled"):
        ad.load_checkpoint(evil, like=like_of())
    assert not marker.exists(), "loading must not run code"
    # the file really is dangerous: numpy with allow_pickle=True would have run it
    with np.load(evil, allow_pickle=True) as f:
        f["leaf3"]
    assert marker.exists()


def test_plain_pickle_and_npy_files_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    p = tmp_path / "ckpt.pkl"
    p.write_bytes(pickle.dumps(RunsCode(str(marker))))
    with pytest.raises(ad.CheckpointError, match="pickled files are refused"):
        ad.load_checkpoint(p, like=like_of())
    assert not marker.exists()
    npy = tmp_path / "a.npy"
    np.save(npy, np.zeros(3))
    with pytest.raises(ad.CheckpointError, match="single .npy array"):
        ad.load_checkpoint(npy, like=like_of())


def test_other_npz_files_and_corrupt_metadata_are_refused(tmp_path):
    plain = tmp_path / "plain.npz"
    np.savez(plain, w=np.zeros(3))
    with pytest.raises(ad.CheckpointError, match="no abstractdiff metadata"):
        ad.load_checkpoint(plain, like=like_of())
    bad = tmp_path / "bad.npz"
    np.savez(bad, __abstractdiff__=np.frombuffer(b"{not json", dtype=np.uint8))
    with pytest.raises(ad.CheckpointError, match="metadata is corrupt"):
        ad.load_checkpoint(bad, like=like_of())
    future = tmp_path / "future.npz"
    meta = json.dumps({"format": "abstractdiff-checkpoint", "version": 99, "leaves": []}).encode()
    np.savez(future, __abstractdiff__=np.frombuffer(meta, dtype=np.uint8))
    with pytest.raises(ad.CheckpointError, match="version 99"):
        ad.load_checkpoint(future, like=like_of())


def test_argument_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        ad.load_checkpoint(tmp_path / "missing.npz", like=like_of())
    with pytest.raises(TypeError, match="like must be the pair"):
        ad.load_checkpoint(tmp_path / "missing.npz", like={"w": np.zeros(3)})
    with pytest.raises(TypeError, match="OptState"):
        ad.save_checkpoint(tmp_path / "x.npz", {"w": np.zeros(3)}, {"w": np.zeros(3)})


# ------------------------------------------------------------------ corrupt files, one kind at a time
def _saved(tmp_path):
    state, model = trained()
    path = tmp_path / "ckpt.npz"
    ad.save_checkpoint(path, state, model)
    return path


def _rewrite_metadata(path, change):
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["__abstractdiff__"].tobytes())
    change(meta)
    arrays["__abstractdiff__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def test_a_bad_compression_field_is_a_checkpoint_error(tmp_path):
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    # the compression method of the first local file header (offset 8) and of every
    # central-directory entry (offset 10 after each signature): 99 is no method zipfile knows
    data[8:10] = (99).to_bytes(2, "little")
    start = data.find(b"PK\x01\x02")
    while start != -1:
        data[start + 10 : start + 12] = (99).to_bytes(2, "little")
        start = data.find(b"PK\x01\x02", start + 4)
    path.write_bytes(bytes(data))
    with pytest.raises(ad.CheckpointError, match="ckpt.npz"):
        ad.load_checkpoint(path, like=like_of())


def test_a_member_that_is_not_an_array_is_a_checkpoint_error(tmp_path):
    import zipfile

    path = _saved(tmp_path)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("notes.txt", "not an array")
    with pytest.raises(ad.CheckpointError, match="ckpt.npz"):
        ad.load_checkpoint(path, like=like_of())


def test_a_text_file_is_not_called_pickled(tmp_path):
    path = tmp_path / "ckpt.npz"
    path.write_text("hello, I am a text file\n")
    with pytest.raises(ad.CheckpointError, match=r"not a \.npz \(zip\) archive") as err:
        ad.load_checkpoint(path, like=like_of())
    assert "pickle" not in str(err.value)
    path.write_bytes(b"")
    with pytest.raises(ad.CheckpointError, match="empty"):
        ad.load_checkpoint(path, like=like_of())


@pytest.mark.parametrize("value", ["three", 3.5, True, None])
def test_metadata_values_are_type_checked(tmp_path, value):
    path = _saved(tmp_path)

    def corrupt(meta):
        entry = next(e for e in meta["leaves"] if e["path"] == "state/1")  # the step counter
        entry["value"] = value

    _rewrite_metadata(path, corrupt)
    with pytest.raises(ad.CheckpointError, match="metadata is corrupt"):
        ad.load_checkpoint(path, like=like_of())


def test_temporaries_of_killed_saves_are_cleaned_up(tmp_path):
    state, model = trained()
    path = tmp_path / "ckpt.npz"
    dead = tmp_path / ".ckpt.npz.999999999.abcdef.tmp"  # no such process: a killed save's leftover
    dead.write_bytes(b"x" * 100)
    mine = tmp_path / f".ckpt.npz.{os.getpid()}.abcdef.tmp"  # a save of a running process: left alone
    mine.write_bytes(b"y")
    old = tmp_path / ".ckpt.npz.a1b2c3.tmp"  # the older name without a process id, an hour old
    old.write_bytes(b"z")
    os.utime(old, (0, 0))
    other = tmp_path / ".other.npz.999999999.abcdef.tmp"  # another checkpoint's: not ours to remove
    other.write_bytes(b"w")
    ad.save_checkpoint(path, state, model)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.npz", mine.name, other.name])


def test_on_windows_no_process_is_signalled_and_age_decides(tmp_path, monkeypatch):
    from abstractdiff import _checkpoint

    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append(pid))
    monkeypatch.setattr(os, "name", "nt")
    fresh = tmp_path / f".ckpt.npz.{os.getpid() + 1}.abcdef.tmp"  # maybe another save in progress
    fresh.write_bytes(b"x")
    old = tmp_path / ".ckpt.npz.12345.abcdef.tmp"
    old.write_bytes(b"y")
    os.utime(old, (0, 0))
    _checkpoint._remove_stale_temporaries(str(tmp_path), "ckpt.npz")
    assert kills == [] and fresh.exists() and not old.exists()

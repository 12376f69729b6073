"""Checkpoints in the .safetensors format: round trips (bfloat16 and float16 exactly), files
other tools read, atomic writes, and every damaged file a CheckpointError."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim

from .test_checkpoint import TARGET, assert_trees_equal, like_of, need, quadratic, trained

safetensors_numpy = pytest.importorskip("safetensors.numpy")
from safetensors import safe_open  # noqa: E402


def _fresh():
    return {"w": np.zeros(3), "b": np.ones((2, 2), dtype=np.float32), "n": 5}


def _saved(tmp_path, name="ckpt.safetensors"):
    state, model = trained()
    path = tmp_path / name
    ad.save_checkpoint(path, state, model)
    return path, state, model


# ------------------------------------------------------------------ round trips
def test_round_trip_restores_everything_and_training_continues_identically(tmp_path):
    path, state, model = _saved(tmp_path)
    s2, m2 = ad.load_checkpoint(path, like=like_of(_fresh()))
    assert s2.step == 3 and s2.tree["w"][1][2] == 3
    assert_trees_equal((s2, m2), (state, model))
    a = ad.train(quadratic, model, [(TARGET,)] * 2, state, backend="finite_differences", progress=False)
    b = ad.train(quadratic, m2, [(TARGET,)] * 2, s2, backend="finite_differences", progress=False)
    assert_trees_equal(a, b)


def test_the_file_is_plain_safetensors_with_the_tree_in_its_metadata(tmp_path):
    path, state, model = _saved(tmp_path)
    tensors = safetensors_numpy.load_file(path)
    with safe_open(path, framework="np") as f:
        meta = json.loads(f.metadata()["__abstractdiff__"])
    keys = {e["path"]: e.get("key") for e in meta["leaves"]}
    np.testing.assert_array_equal(tensors[keys["model/b"]], model["b"])
    np.testing.assert_array_equal(tensors[keys["model/w"]], model["w"])
    assert meta["format"] == "abstractdiff-checkpoint" and meta["version"] == 1
    assert {e["path"] for e in meta["leaves"]} >= {"model/w", "model/b", "model/n", "state/1"}
    assert next(e for e in meta["leaves"] if e["path"] == "model/n")["value"] == 5


def test_other_extensions_still_write_npz(tmp_path):
    state, model = trained()
    for name in ("ckpt.npz", "ckpt.ckpt", "ckpt"):
        ad.save_checkpoint(tmp_path / name, state, model)
        assert (tmp_path / name).read_bytes()[:4] == b"PK\x03\x04"
        assert_trees_equal(ad.load_checkpoint(tmp_path / name, like=like_of(_fresh())), (state, model))
    ad.save_checkpoint(tmp_path / "UPPER.SAFETENSORS", state, model)  # the extension in any case
    assert safetensors_numpy.load_file(tmp_path / "UPPER.SAFETENSORS")


def test_float16_and_bfloat16_numpy_leaves_round_trip_exactly(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    model = {"h": rng.normal(size=(4, 3)).astype(np.float16),
             "bf": rng.normal(size=5).astype(ml_dtypes.bfloat16), "s": np.array(1.5, dtype=np.float16)}
    state = optim.setup(optim.Momentum(0.1), model)
    ad.save_checkpoint(tmp_path / "c.safetensors", state, model)
    like = {k: np.zeros_like(v) for k, v in model.items()}
    s2, m2 = ad.load_checkpoint(tmp_path / "c.safetensors", like=(optim.setup(optim.Momentum(0.1), like), like))
    for k, v in model.items():
        assert m2[k].dtype == v.dtype and m2[k].shape == v.shape
        np.testing.assert_array_equal(m2[k].view(np.uint16), v.view(np.uint16))  # bit for bit
    stored = safetensors_numpy.load_file(tmp_path / "c.safetensors")
    assert {a.dtype.name for a in stored.values()} == {"bfloat16", "float16"}


def test_bfloat16_torch_module_round_trips_exactly(tmp_path):
    need("torch")
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    loss = lambda m, x: m(x).float().pow(2).mean()  # noqa: E731
    data = [(torch.randn(8, 3, dtype=torch.bfloat16),)] * 2
    state = optim.setup(optim.Adam(0.01), net)
    state, net = ad.train(loss, net, data, state, backend=ad.Implicit("torch"), progress=False)
    path = tmp_path / "net.safetensors"
    ad.save_checkpoint(path, state, net)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    weight = other[0].weight
    s2, m2 = ad.load_checkpoint(path, like=(optim.setup(optim.Adam(0.01), other), other))
    assert m2 is other and other[0].weight is weight and weight.requires_grad
    for name, t in net.state_dict().items():
        got = other.state_dict()[name]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), t.view(torch.int16)), name  # bit for bit
    for a, b in zip(s2.tree, state.tree):
        assert a[0].dtype == b[0].dtype and torch.equal(a[0], b[0])
    with safe_open(path, framework="pt") as f:  # other tools read it as bfloat16 too
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    a = ad.train(loss, net, data, state, backend=ad.Implicit("torch"), progress=False)
    b = ad.train(loss, other, data, s2, backend=ad.Implicit("torch"), progress=False)
    for u, v in zip(a[1].state_dict().values(), b[1].state_dict().values()):
        assert torch.equal(u, v)


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_explicit_half_precision_models_round_trip_on_the_like_library(tmp_path, name):
    b = need(name)
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    bf = rng.normal(size=(2, 3)).astype(np.float32)
    model = {"bf": b.cast(b.convert(bf), "bfloat16"), "h": b.convert(rng.normal(size=4).astype(np.float16))}
    state = optim.setup(optim.Adam(0.1), model)
    ad.save_checkpoint(tmp_path / "c.safetensors", state, model)
    like = {"bf": b.cast(b.convert(np.zeros((2, 3), np.float32)), "bfloat16"),
            "h": b.convert(np.zeros(4, np.float16))}
    s2, m2 = ad.load_checkpoint(tmp_path / "c.safetensors", like=(optim.setup(optim.Adam(0.1), like), like))
    assert b.is_native(m2["bf"]) and b.is_native(s2.tree["bf"][1][0])
    assert ad.to_numpy(m2["bf"]).dtype.name == "bfloat16" and ad.to_numpy(m2["h"]).dtype == np.float16
    assert_trees_equal((s2, m2), (state, model))


# ------------------------------------------------------------------ atomic writes
# (a failed save leaving the old file: tests/test_checkpoint.py, for both formats)
def test_temporaries_of_killed_saves_are_cleaned_up(tmp_path):
    dead = tmp_path / ".ckpt.safetensors.999999999.abcdef.tmp"  # no such process: a killed save's leftover
    dead.write_bytes(b"x" * 100)
    mine = tmp_path / f".ckpt.safetensors.{os.getpid()}.abcdef.tmp"  # a running process's save
    mine.write_bytes(b"y")
    _saved(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.safetensors", mine.name])


# ------------------------------------------------------------------ refusing bad files
def _header_length(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


def test_truncated_file_is_refused(tmp_path):
    path, _, _ = _saved(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 10, _header_length(data) + 4, 30, 5, 0):
        path.write_bytes(data[:cut])
        with pytest.raises(ad.CheckpointError, match="truncated"):
            ad.load_checkpoint(path, like=like_of())


@pytest.mark.parametrize("byte", range(8))
def test_a_flipped_byte_in_the_header_length_is_a_checkpoint_error(tmp_path, byte):
    path, _, _ = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[byte] ^= 0xFF if byte else 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ad.CheckpointError, match="ckpt.safetensors"):
        ad.load_checkpoint(path, like=like_of())


def test_a_garbage_header_is_a_checkpoint_error(tmp_path):
    path, _, _ = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    n = _header_length(data)
    for garbage in (b"\xff" * n, b"{" + b" " * (n - 1), b"[]".ljust(n), json.dumps({"a": 1}).encode().ljust(n)):
        path.write_bytes(bytes(data[:8]) + garbage + bytes(data[8 + n:]))
        with pytest.raises(ad.CheckpointError, match="ckpt.safetensors"):
            ad.load_checkpoint(path, like=like_of())
    path.write_bytes(b"hello, I am a text file\n")
    with pytest.raises(ad.CheckpointError, match="not a readable safetensors checkpoint"):
        ad.load_checkpoint(path, like=like_of())


def test_a_flipped_byte_anywhere_is_a_checkpoint_error_or_a_clean_load(tmp_path):
    path, _, _ = _saved(tmp_path)
    data = path.read_bytes()
    for i in range(0, len(data), 7):
        damaged = bytearray(data)
        damaged[i] ^= 0x55
        path.write_bytes(bytes(damaged))
        try:
            ad.load_checkpoint(path, like=like_of())
        except ad.CheckpointError:
            pass  # anything else fails the test


def _key_of(path, leaf_path):
    with safe_open(path, framework="np") as f:
        meta = json.loads(f.metadata()["__abstractdiff__"])
    return next(e["key"] for e in meta["leaves"] if e["path"] == leaf_path)


def _rewrite(path, change_meta=None, change_tensors=None):
    tensors = safetensors_numpy.load_file(path)
    with safe_open(path, framework="np") as f:
        metadata = dict(f.metadata())
    meta = json.loads(metadata["__abstractdiff__"])
    if change_meta:
        change_meta(meta)
    if change_tensors:
        change_tensors(tensors)
    metadata["__abstractdiff__"] = json.dumps(meta)
    safetensors_numpy.save_file(tensors, path, metadata=metadata)


def test_wrong_structure_is_refused(tmp_path):
    path, _, _ = _saved(tmp_path)
    with pytest.raises(ad.CheckpointError, match=r"float64\(3,\) in the file but float64\(4,\)"):
        ad.load_checkpoint(path, like=like_of({"w": np.zeros(4), "b": np.ones((2, 2), np.float32), "n": 5}))
    with pytest.raises(ad.CheckpointError, match="leaves, like has"):
        ad.load_checkpoint(path, like=like_of({"w": np.zeros(3), "b": np.ones((2, 2), np.float32)}))
    key = _key_of(path, "model/w")
    _rewrite(path, change_tensors=lambda t: t.pop(key))
    with pytest.raises(ad.CheckpointError, match="is missing"):
        ad.load_checkpoint(path, like=like_of())
    path, _, _ = _saved(tmp_path, "b.safetensors")
    key = _key_of(path, "model/w")
    _rewrite(path, change_tensors=lambda t: t.update({key: t[key].astype(np.float32)}))
    with pytest.raises(ad.CheckpointError, match="does not match its metadata"):
        ad.load_checkpoint(path, like=like_of())


def test_other_safetensors_files_and_corrupt_metadata_are_refused(tmp_path):
    plain = tmp_path / "plain.safetensors"
    safetensors_numpy.save_file({"w": np.zeros(3)}, plain)
    with pytest.raises(ad.CheckpointError, match="no abstractdiff metadata"):
        ad.load_checkpoint(plain, like=like_of())
    safetensors_numpy.save_file({"w": np.zeros(3)}, plain, metadata={"__abstractdiff__": "{not json"})
    with pytest.raises(ad.CheckpointError, match="metadata is corrupt"):
        ad.load_checkpoint(plain, like=like_of())
    future = json.dumps({"format": "abstractdiff-checkpoint", "version": 99, "leaves": []})
    safetensors_numpy.save_file({"w": np.zeros(3)}, plain, metadata={"__abstractdiff__": future})
    with pytest.raises(ad.CheckpointError, match="version 99"):
        ad.load_checkpoint(plain, like=like_of())
    path, _, _ = _saved(tmp_path)
    _rewrite(path, change_meta=lambda m: next(e for e in m["leaves"] if e["path"] == "state/1").update(value="x"))
    with pytest.raises(ad.CheckpointError, match="metadata is corrupt"):
        ad.load_checkpoint(path, like=like_of())


def test_an_npz_under_a_safetensors_name_is_refused(tmp_path):
    state, model = trained()
    ad.save_checkpoint(tmp_path / "c.npz", state, model)
    os.replace(tmp_path / "c.npz", tmp_path / "c.safetensors")
    with pytest.raises(ad.CheckpointError, match="not a readable safetensors checkpoint"):
        ad.load_checkpoint(tmp_path / "c.safetensors", like=like_of())


def test_missing_file_and_bfloat16_in_npz(tmp_path):
    with pytest.raises(FileNotFoundError):
        ad.load_checkpoint(tmp_path / "missing.safetensors", like=like_of())
    ml_dtypes = pytest.importorskip("ml_dtypes")
    model = {"w": np.ones(2, dtype=ml_dtypes.bfloat16)}
    with pytest.raises(ad.CheckpointError, match=r"bfloat16 cannot be stored in a \.npz checkpoint"):
        ad.save_checkpoint(tmp_path / "c.npz", optim.setup(optim.Descent(), model), model)
    assert os.listdir(tmp_path) == []

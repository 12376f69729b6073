"""Checkpoint integrity (issue 46): every damaged byte detected in both formats, sizes
bounded before anything is read (decompression bombs), special files refused without
hanging, and crafted or foreign files refused with a CheckpointError naming the path."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import tracemalloc
import zipfile

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim

FORMAT = "abstractdiff-checkpoint"


def _model():
    return {"w": np.array([0.5, -1.25, 3.0]), "b": np.array([2.0, -0.0], dtype=np.float32), "n": 4}


def _like():
    model = {"w": np.zeros(3), "b": np.zeros(2, dtype=np.float32), "n": 0}
    return optim.setup(optim.Momentum(0.1), model), model


def _saved(tmp_path, suffix=".npz"):
    model = _model()
    state = optim.setup(optim.Momentum(0.1), model)
    state = state._replace(step=7)
    path = tmp_path / f"ckpt{suffix}"
    ad.save_checkpoint(path, state, model)
    return path


def _fingerprint(loaded):
    """Every leaf's exact bytes, dtype and shape (so -0.0 and NaN payloads count)."""
    state, model = loaded
    out = [("step", state.step)]
    for name, leaf in sorted(model.items()):
        out.append((name, leaf.dtype.str, leaf.shape, leaf.tobytes()) if isinstance(leaf, np.ndarray) else (name, leaf))
    for leaf in ad.to_numpy(state.tree) if isinstance(state.tree, list) else [ad.to_numpy(state.tree)]:
        out.append(repr(leaf))
    return out


def _sweep(path):
    """Flip every byte of ``path``, one at a time: one bit, whose position turns with the
    byte's (a one-bit flip is the subtle case: a digit becomes another digit, a space a
    ``!``), so that every bit position is tried all over the file."""
    data = path.read_bytes()
    reference = _fingerprint(ad.load_checkpoint(path, like=_like()))
    counts = {"tried": 0, "refused": 0, "identical": 0, "different": 0}
    different = []
    for i in range(len(data)):
        for mask in (1 << (i % 8),):
            damaged = bytearray(data)
            damaged[i] ^= mask
            path.write_bytes(bytes(damaged))
            counts["tried"] += 1
            try:
                loaded = ad.load_checkpoint(path, like=_like())
            except ad.CheckpointError as err:
                assert str(path) in str(err)
                counts["refused"] += 1
                continue
            if _fingerprint(loaded) == reference:
                counts["identical"] += 1
            else:
                counts["different"] += 1
                different.append((i, mask))
    return counts, different


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_no_flipped_byte_loads_a_different_model(tmp_path, suffix):
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    path = _saved(tmp_path, suffix)
    size = path.stat().st_size
    counts, different = _sweep(path)
    print(f"{suffix}: {counts}")
    assert counts["tried"] == size > 1000
    assert different == [], f"{len(different)} flips load a different model: {different[:10]}"


# ------------------------------------------------------------------ sizes bounded: decompression bombs
BOMB = 64 << 20  # 64 MiB of zeros: a few tens of KiB deflated


def _add_bomb(path, name="bomb.npy", size=BOMB):
    header = {"descr": "|u1", "fortran_order": False, "shape": (size,)}
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "a") as z:
        with z.open(info, "w", force_zip64=True) as m:
            np.lib.format.write_array_header_1_0(m, header)
            chunk = bytes(1 << 20)
            for _ in range(size >> 20):
                m.write(chunk)


def _peak_while(fn):
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_a_decompression_bomb_is_refused_before_it_allocates(tmp_path):
    path = _saved(tmp_path)
    _add_bomb(path)
    assert path.stat().st_size < BOMB // 100

    def load():
        with pytest.raises(ad.CheckpointError, match=r"ckpt\.npz: .*max_bytes") as err:
            ad.load_checkpoint(path, like=_like())
        assert "decompression bomb" in str(err.value)

    assert _peak_while(load) < BOMB // 16
    # raising the limit does not help a member the description does not list: still read nothing
    with pytest.raises(ad.CheckpointError, match="not a checkpoint of this model|does not list"):
        ad.load_checkpoint(path, like=_like(), max_bytes=1 << 40)


def test_a_bomb_in_place_of_a_tensor_is_refused_whatever_the_limit(tmp_path):
    good = _saved(tmp_path)
    with zipfile.ZipFile(good) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    meta = json.loads(np.load(good, allow_pickle=False)["__abstractdiff__"].tobytes())
    key = next(e["key"] for e in meta["leaves"] if e["path"] == "model/w") + ".npy"
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            if name != key:
                z.writestr(name, data)
    _add_bomb(path, key)
    assert path.stat().st_size < BOMB // 100

    def load():
        with pytest.raises(ad.CheckpointError, match=r"bomb\.npz: the array of .* does not match its metadata"):
            ad.load_checkpoint(path, like=_like(), max_bytes=1 << 40)

    assert _peak_while(load) < BOMB // 16


def test_max_bytes_bounds_a_trusted_compressed_file(tmp_path):
    good = _saved(tmp_path)
    with np.load(good, allow_pickle=False) as z:
        members = {k: z[k] for k in z.files}
    packed = tmp_path / "packed.npz"
    np.savez_compressed(packed, **{k: np.tile(v, 1) for k, v in members.items()})
    reference = _fingerprint(ad.load_checkpoint(good, like=_like()))
    size = good.stat().st_size
    with pytest.raises(ad.CheckpointError, match="max_bytes=10"):
        ad.load_checkpoint(good, like=_like(), max_bytes=10)
    assert _fingerprint(ad.load_checkpoint(packed, like=_like(), max_bytes=size)) == reference
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(TypeError, match="max_bytes"):
            ad.load_checkpoint(good, like=_like(), max_bytes=bad)


# ------------------------------------------------------------------ files without checksums
def test_a_checkpoint_without_checksums_is_refused_with_how_to_resave(tmp_path):
    path = _saved(tmp_path)
    with np.load(path, allow_pickle=False) as z:
        members = {k: z[k] for k in z.files if k != "__abstractdiff_sha256__"}
    meta = json.loads(members["__abstractdiff__"].tobytes())
    for e in meta["leaves"]:
        e.pop("sha256", None)
    members["__abstractdiff__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    np.savez(path, **members)  # what the previous version wrote
    with pytest.raises(ad.CheckpointError, match="ckpt.npz: this checkpoint has no checksums.*save it again"):
        ad.load_checkpoint(path, like=_like())


# ------------------------------------------------------------------ crafted descriptions (item 8)
def _write_crafted(tmp_path, suffix, description: bytes, tensors=None):
    """A file whose description is ``description`` with a *correct* checksum: only the
    checks of its content can refuse it."""
    digest = hashlib.sha256(description).hexdigest()
    tensors = {"leaf0": np.zeros(3)} if tensors is None else tensors
    path = tmp_path / f"crafted{suffix}"
    if suffix == ".npz":
        np.savez(path, __abstractdiff__=np.frombuffer(description, np.uint8),
                 __abstractdiff_sha256__=np.frombuffer(digest.encode(), np.uint8), **tensors)
    else:
        st = pytest.importorskip("safetensors.numpy")
        st.save_file(tensors, path, metadata={"__abstractdiff__": description.decode(),
                                              "__abstractdiff_sha256__": digest})
    return path


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_deeply_nested_metadata_is_a_checkpoint_error(tmp_path, suffix):
    deep = b'{"format": "abstractdiff-checkpoint", "version": 1, "leaves": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = _write_crafted(tmp_path, suffix, deep)
    with pytest.raises(ad.CheckpointError, match=f"crafted{suffix}: the checkpoint metadata is corrupt"):
        ad.load_checkpoint(path, like=_like())


@pytest.fixture
def saved_meta(tmp_path):
    """The description of a real checkpoint of ``_like()``."""
    with np.load(_saved(tmp_path), allow_pickle=False) as z:
        return json.loads(z["__abstractdiff__"].tobytes())


ODD = [
    ("path", ["model", "w"]), ("path", {"a": 1}), ("path", 3), ("path", None),
    ("shape", ["3"]), ("shape", [True, 1]), ("shape", [-3]), ("shape", 3),
    ("key", ["leaf0"]), ("key", 0), ("dtype", None), ("sha256", 5), ("kind", ["array"]),
]


@pytest.mark.parametrize("field, value", ODD, ids=[f"{f}={v!r}" for f, v in ODD])
def test_odd_leaf_entries_are_a_checkpoint_error(tmp_path, saved_meta, field, value):
    meta = saved_meta
    target = next(e for e in meta["leaves"] if e["kind"] == "array")
    target[field] = value
    meta["leaves"].append(dict(target))  # one leaf too many: pristine code builds a set of the paths
    path = _write_crafted(tmp_path, ".npz", json.dumps(meta).encode())
    with pytest.raises(ad.CheckpointError, match=r"crafted\.npz: entry \d+ of the checkpoint metadata is malformed"):
        ad.load_checkpoint(path, like=_like())


@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_big_endian_arrays_load_on_every_library(tmp_path, lib):
    pytest.importorskip(lib)
    backend = ad.backend(lib)
    path = _saved(tmp_path)
    with np.load(path, allow_pickle=False) as z:
        members = {k: z[k] for k in z.files}
    meta = json.loads(members["__abstractdiff__"].tobytes())
    for e in meta["leaves"]:
        if e["kind"] == "array":
            members[e["key"]] = members[e["key"]].astype(members[e["key"]].dtype.newbyteorder(">"))
    np.savez(path, **members)  # a foreign writer on a big-endian machine: same values, same checksums
    model = {"w": backend.asarray(np.zeros(3)), "b": backend.asarray(np.zeros(2, np.float32)), "n": 0}
    state, loaded = ad.load_checkpoint(path, like=(optim.setup(optim.Momentum(0.1), model), model))
    assert type(loaded["w"]) is type(model["w"]) and state.step == 7
    np.testing.assert_array_equal(ad.to_numpy(loaded["w"]), _model()["w"])
    np.testing.assert_array_equal(ad.to_numpy(loaded["b"]), _model()["b"])
    assert ad.to_numpy(loaded["b"]).dtype == np.float32


# ------------------------------------------------------------------ paths
def test_bytes_paths_save_and_load(tmp_path):
    model = _model()
    state = optim.setup(optim.Momentum(0.1), model)
    path = os.fsencode(str(tmp_path / "ckpt.npz"))
    ad.save_checkpoint(path, state, model)
    _, loaded = ad.load_checkpoint(path, like=_like())
    np.testing.assert_array_equal(loaded["w"], model["w"])
    with pytest.raises(TypeError, match="checkpoint path must be a str, bytes or os.PathLike"):
        ad.load_checkpoint(3.5, like=_like())
    with pytest.raises(TypeError, match="checkpoint path must be a str, bytes or os.PathLike"):
        ad.save_checkpoint(None, state, model)
    for nul in (str(tmp_path / "a\0b.npz"), b"a\0b.npz"):  # os calls raise a bare "embedded null byte"
        with pytest.raises(ad.InvalidArgumentError, match="contains a NUL character"):
            ad.load_checkpoint(nul, like=_like())
        with pytest.raises(ad.InvalidArgumentError, match="contains a NUL character"):
            ad.save_checkpoint(nul, state, model)


def test_save_errors_name_the_users_path_not_the_temporary_file(tmp_path):
    model = _model()
    state = optim.setup(optim.Momentum(0.1), model)
    missing = tmp_path / "no such dir" / "ckpt.npz"
    with pytest.raises(FileNotFoundError) as err:
        ad.save_checkpoint(missing, state, model)
    assert err.value.filename == str(missing) and ".tmp" not in str(err.value)
    directory = tmp_path / "a dir.npz"
    directory.mkdir()
    with pytest.raises(ad.CheckpointError, match="a dir.npz is a directory; pass the path of a file in it"):
        ad.save_checkpoint(directory, state, model)
    assert os.listdir(tmp_path) == ["a dir.npz"]  # no temporary file left behind
    assert os.listdir(directory) == []


# ------------------------------------------------------------------ special files
def _load_from_fifo(fifo, grace=3.0):
    """load_checkpoint(fifo), with a separate process that opens the FIFO for writing after
    ``grace`` seconds (a few times): code that waits on the FIFO is released and the test
    fails on the time it took, rather than hanging (safetensors holds the GIL while it
    opens, so no thread of this process could release it)."""
    releaser = subprocess.Popen(
        ["sh", "-c", """sleep "$1"; for i in 1 2 3 4; do timeout 2 sh -c ': > "$0"' "$0"; done""",
         str(fifo), str(grace)]
    )
    start = time.monotonic()
    try:
        with pytest.raises(BaseException) as err:
            ad.load_checkpoint(fifo, like=_like())
    finally:
        elapsed = time.monotonic() - start
        releaser.kill()
        releaser.wait()
    assert elapsed < grace, f"load_checkpoint({fifo}) waited on the FIFO for {elapsed:.1f}s"
    return err.value


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_special_files_are_refused_without_hanging(tmp_path, suffix):
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    err = _load_from_fifo(fifo)
    assert isinstance(err, ad.CheckpointError) and f"pipe{suffix}: a FIFO (named pipe), not a checkpoint" in str(err)
    directory = tmp_path / f"dir{suffix}"
    directory.mkdir()
    with pytest.raises(ad.CheckpointError, match=f"dir{suffix}: a directory, not a checkpoint file"):
        ad.load_checkpoint(directory, like=_like())
    if os.path.exists("/dev/null"):
        with pytest.raises(ad.CheckpointError, match="/dev/null: a character device"):
            ad.load_checkpoint("/dev/null", like=_like())

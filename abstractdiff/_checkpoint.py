"""Checkpoints of ``(state, model)``: one ``.npz`` or ``.safetensors`` file, no pickle, written atomically.

Format: a numpy ``.npz`` archive (saved and loaded with ``allow_pickle=False``) holding
one array per array leaf (``leaf0``, ``leaf1``...) and ``__abstractdiff__``, a JSON
description (as bytes) of every leaf: its tree path, kind, dtype and shape, and the
value of Python scalars such as the step counter.  Numpy's own format needs no extra
dependency; with ``allow_pickle=False`` numpy refuses object arrays, so a crafted file
cannot run code when loaded.

A path ending in ``.safetensors`` is written in that format instead: the same tensors
``leaf0``, ``leaf1``... and the same JSON description, as the string
``__metadata__["__abstractdiff__"]`` of the header.  It holds bfloat16 (which ``.npz``
cannot: numpy has no bfloat16, ml_dtypes' is stored as raw bytes without its type) and
other tools read it.  The ``safetensors`` package is imported for such paths only.

Loading validates the whole file against ``like`` before anything is converted or
assigned, so a truncated or mismatched file raises :class:`CheckpointError` and never
half-loads.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any

import numpy as np

from . import _checkpoint_format as fmt
from . import optim
from .core import (
    ArgumentTypeError,
    CheckpointError,
    InvalidArgumentError,
    is_array,
    model_state_variables,
    pytree,
    to_numpy,
)

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT = "abstractdiff-checkpoint"
VERSION = 1
META = fmt.META
SAFETENSORS = fmt.SAFETENSORS


def _is_safetensors(path: str) -> bool:
    return path.lower().endswith(SAFETENSORS)


def _safetensors() -> Any:
    try:
        import safetensors.numpy
    except ImportError as err:
        raise CheckpointError(
            "checkpoints in the .safetensors format need the safetensors package: pip install safetensors "
            "(or save to a .npz path, which needs nothing more)"
        ) from err
    return safetensors


def _ar() -> Any:
    import autoray

    return autoray


class _Leaf:
    """One leaf of ``(state, model)``: its path, current value, and variable (if any)."""

    __slots__ = ("path", "value", "variable", "name")

    def __init__(self, path: str, value: Any, variable: Any = None, name: str = ""):
        self.path, self.value, self.variable, self.name = path, value, variable, name

    @property
    def where(self) -> str:
        """The path, with the torch name of a module's variable (for messages)."""
        return f"{self.path} ({self.name})" if self.name else self.path


def _path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _leaves(state: Any, model: Any) -> tuple[list[_Leaf], Any, bool]:
    """The leaves of ``(state, model)``, the treedef to rebuild them, and whether the
    model holds variables (whose values are then the model's leaves, see ``model_state_variables``)."""
    if not isinstance(state, optim.OptState):
        raise ArgumentTypeError(f"state must be the OptState from optim.setup(rule, model), got {type(state).__name__}")
    implicit = optim.holds_variables(model)
    paths, values, treedef = pytree.tree_flatten_with_path(state)
    leaves = [_Leaf("state/" + _path_str(p), v) for p, v in zip(paths, values)]
    if implicit:
        # "variable{i}" as before, so that checkpoints of models without frozen variables
        # or buffers written by earlier versions still load
        for i, (name, var) in enumerate(model_state_variables(model)):
            leaves.append(_Leaf(f"model/variable{i}", optim.read(var), var, name))
    else:
        paths, values, _ = pytree.tree_flatten_with_path(model)
        leaves += [_Leaf("model/" + _path_str(p), v) for p, v in zip(paths, values)]
    return leaves, treedef, implicit


def _dtype_name(a: Any) -> str:
    return _ar().get_dtype_name(a)


def _describe(leaf: _Leaf, index: int) -> dict[str, Any]:
    v = leaf.value
    if is_array(v):
        return {"path": leaf.path, "kind": "array", "key": f"leaf{index}", "dtype": _dtype_name(v),
                "shape": [int(d) for d in v.shape]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return {"path": leaf.path, "kind": "value", "type": type(v).__name__, "value": v}
    # The rule and other objects are not stored: they come back from ``like``.
    return {"path": leaf.path, "kind": "object", "type": f"{type(v).__module__}.{type(v).__qualname__}",
            "repr": repr(v)}


def save_checkpoint(path: str | bytes | os.PathLike, state: optim.OptState, model: Any) -> None:
    """Write ``(state, model)`` to one file at ``path``, atomically.

    ``save_checkpoint(path, state, model) -> None``.  The file is first written to a
    temporary file in the same directory and then renamed over ``path``
    (``os.replace``), so a crash never leaves a half-written checkpoint behind.  Works
    for explicit models (pytrees of arrays) and models holding variables.  The rule
    itself is not stored: it comes from ``like`` when loading.  A path ending in
    ``.safetensors`` is written in that format (needs the ``safetensors`` package; it
    holds bfloat16, which ``.npz`` cannot); any other path gets ``.npz``.

    Example:
        >>> import abstractdiff as ad, numpy as np, tempfile, os
        >>> from abstractdiff import optim
        >>> model = {"w": np.ones(3)}
        >>> state = optim.setup(optim.Adam(), model)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
        >>> ad.save_checkpoint(path, state, model)
        >>> state2, model2 = ad.load_checkpoint(path, like=(state, model))
        >>> model2["w"], state2.step
        (array([1., 1., 1.]), 0)
    """
    leaves, _, _ = _leaves(state, model)
    path = _fspath(path)
    if os.path.isdir(path):  # os.replace would raise IsADirectoryError after the whole file was written
        raise CheckpointError(f"save_checkpoint: {path} is a directory; pass the path of a file in it, e.g. "
                              f"{os.path.join(path, 'checkpoint.npz')}")
    safetensors = _safetensors() if _is_safetensors(path) else None
    meta = {"format": FORMAT, "version": VERSION, "leaves": [_describe(leaf, i) for i, leaf in enumerate(leaves)]}
    arrays: dict[str, np.ndarray] = {}
    for entry, leaf in zip(meta["leaves"], leaves):
        if entry["kind"] == "array":
            a = np.asarray(to_numpy(leaf.value), order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d
            if a.dtype == object:
                raise CheckpointError(f"{entry['path']}: object arrays cannot be stored in a checkpoint")
            if entry["dtype"] == "bfloat16" and safetensors is None:
                # np.savez would store ml_dtypes' bfloat16 as untyped bytes (void), unloadable
                raise CheckpointError(f"{entry['path']}: bfloat16 cannot be stored in a .npz checkpoint; save to "
                                      f"a path ending in {SAFETENSORS}")
            if entry["dtype"] == "bfloat16" and a.dtype.name != "bfloat16":  # read out as float32: no ml_dtypes
                raise CheckpointError(f"{entry['path']}: {entry['dtype']} arrays need ml_dtypes to be stored "
                                      f"(pip install ml_dtypes)")
            # little-endian whatever the machine or the array: the bytes the checksum covers
            a = fmt.little_endian(a)
            arrays[entry["key"]] = a
            entry["sha256"] = fmt.digest(a)
    description = json.dumps(meta).encode("utf-8")
    description_digest = fmt.text_digest(description)
    directory = os.path.dirname(os.path.abspath(path))
    _remove_stale_temporaries(directory, os.path.basename(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        # "xb": a fresh file, created with the user's umask (unlike mkstemp's 0600).
        with open(tmp, "xb") as f:
            if safetensors is None:
                arrays[META] = np.frombuffer(description, dtype=np.uint8)
                arrays[fmt.META_DIGEST] = np.frombuffer(description_digest.encode("ascii"), dtype=np.uint8)
                np.savez(f, allow_pickle=False, **arrays)
            else:
                f.write(safetensors.numpy.save(
                    arrays, metadata={META: description.decode("utf-8"), fmt.META_DIGEST: description_digest}
                ))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError) and tmp in (err.filename, err.filename2):
            # the temporary file is an implementation detail: the error (its class and errno
            # kept: PermissionError, a full disk) names the path the user gave
            err.filename, err.filename2 = path, None
        raise


def _fspath(path: Any) -> str:
    """``path`` as a str: str, bytes (decoded as the file system does) or os.PathLike."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise ArgumentTypeError(
            f"the checkpoint path must be a str, bytes or os.PathLike (e.g. pathlib.Path), got "
            f"{type(path).__name__}"
        ) from None
    path = os.fsdecode(path)
    if "\0" in path:  # every os call would raise a bare "embedded null byte" ValueError
        raise InvalidArgumentError(f"the checkpoint path {path!r} contains a NUL character, which no file name "
                                   f"can hold")
    return path


#: A temporary file of a save with no process id in its name (written by an older
#: version) counts as abandoned after this many seconds.
STALE_AFTER = 3600.0


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Delete the temporary files that killed saves of ``name`` left behind.

    A save writes ``.{name}.{pid}.{token}.tmp`` and renames it; one killed before the
    rename leaves it.  A temporary whose process no longer runs is abandoned (one of a
    running process, another save in progress, is left alone); where processes cannot be
    probed safely (Windows) or the name has no process id, one older than
    :data:`STALE_AFTER` seconds is.
    """
    prefix, suffix = f".{name}.", ".tmp"
    try:
        candidates = [e for e in os.scandir(directory) if e.name.startswith(prefix) and e.name.endswith(suffix)]
    except OSError:
        return
    now = time.time()
    for entry in candidates:
        middle = entry.name[len(prefix): -len(suffix)].split(".")
        try:
            if len(middle) == 2 and middle[0].isdigit() and os.name == "posix":
                if _process_running(int(middle[0])):
                    continue
            elif now - entry.stat().st_mtime < STALE_AFTER:
                continue
            os.unlink(entry.path)
        except OSError:  # removed by another process meanwhile, or not ours to remove
            pass


def _process_running(pid: int) -> bool:
    """POSIX only: signal 0 tests for a process without touching it (on Windows os.kill would
    terminate it, so there the age of the file decides)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but belongs to someone else
        return True
    return True


def _parse_meta(path: str, raw: bytes, stored_digest: bytes | None) -> dict[str, Any]:
    """The description, checked: its checksum first (a damaged description is refused
    before it is parsed), then its JSON, format, version and every entry's fields, so that
    a damaged or crafted file fails here with a :class:`CheckpointError`, never later with
    a ``TypeError`` or ``RecursionError``."""
    if stored_digest is not None and stored_digest != fmt.text_digest(raw).encode("ascii"):
        raise CheckpointError(f"{path}: the checkpoint metadata is corrupt (its SHA-256 checksum does not "
                              f"match); the file was damaged after it was written")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # RecursionError: deeply nested JSON
        raise CheckpointError(f"{path}: the checkpoint metadata is corrupt ({type(err).__name__}: "
                              f"{str(err)[:200]})") from None
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT and isinstance(meta.get("leaves"), list)):
        raise CheckpointError(f"{path}: the metadata does not describe an abstractdiff checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {meta.get('version')!r}; this abstractdiff reads version {VERSION}"
        )
    if stored_digest is None:
        raise CheckpointError(
            f"{path}: this checkpoint has no checksums (it was written by an earlier abstractdiff), so damage to "
            f"it could not be detected; it is refused. Load it with the version that wrote it and save it again"
        )
    keys: set[str] = set()
    for i, entry in enumerate(meta["leaves"]):
        if not _valid_entry(entry) or (entry["kind"] == "array" and entry["key"] in keys):
            raise CheckpointError(f"{path}: entry {i} of the checkpoint metadata is malformed; the file is "
                                  f"corrupt or was not written by ad.save_checkpoint")
        if entry["kind"] == "array":
            keys.add(entry["key"])
    return meta


def _valid_entry(e: Any) -> bool:
    if not (isinstance(e, dict) and isinstance(e.get("path"), str) and e.get("kind") in ("array", "value", "object")):
        return False
    if e["kind"] != "array":
        return isinstance(e.get("type"), str)
    shape = e.get("shape")
    return (isinstance(e.get("key"), str) and e["key"] not in (fmt.META, fmt.META_DIGEST)
            and isinstance(e.get("dtype"), str) and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(e.get("sha256"), str) and len(e["sha256"]) == 64)


def _open_reader(path: str, f: Any, limit: int, max_members: int) -> Any:
    """The reader of ``path``'s format; every way a damaged file fails to open is a
    :class:`CheckpointError` naming it (zipfile and safetensors raise many kinds)."""
    safetensors = _safetensors() if _is_safetensors(path) else None
    try:
        if safetensors is None:
            return fmt.NpzReader(path, f, limit, max_members)
        return fmt.SafetensorsReader(path, f, limit, max_members, safetensors.safe_open)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001  BadZipFile, SafetensorError, ValueError, NotImplementedError...
        kind = "abstractdiff" if safetensors is None else "safetensors"
        raise CheckpointError(
            f"{path}: not a readable {kind} checkpoint ({type(err).__name__}: {str(err)[:200]}); it may be "
            f"truncated or corrupt (pickled content is refused, by design)"
        ) from err


def _read_checked(path: str, reader: Any, member: Any, entry: dict[str, Any], where: str) -> np.ndarray:
    """One tensor: its declared dtype and shape against the description before it is read
    (so it allocates no more than ``like``'s leaf), its checksum after."""
    if member.dtype != entry["dtype"] or member.shape != tuple(entry["shape"]):
        raise CheckpointError(f"{path}: the array of {where} does not match its metadata; corrupt file")
    try:
        a = reader.read(member)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001  a CRC error, an unknown dtype, a short read...
        raise CheckpointError(f"{path}: the array of {where} cannot be read ({type(err).__name__}: "
                              f"{str(err)[:200]}); the file is truncated or corrupt") from err
    if a.dtype.name != entry["dtype"] or a.shape != tuple(entry["shape"]):
        raise CheckpointError(f"{path}: the array of {where} does not match its metadata; corrupt file")
    if fmt.digest(a) != entry["sha256"]:
        raise CheckpointError(f"{path}: the array of {where} is corrupt (its SHA-256 checksum does not match); "
                              f"the file was damaged after it was written")
    return fmt.little_endian(a).astype(a.dtype.newbyteorder("="), copy=False)  # native order for every library


def _to_like(a: np.ndarray, like: Any) -> Any:
    """``a`` as an array of the same library and device as ``like`` (its adapter's ``asarray_like``)."""
    from .core import backend_for

    owner = backend_for(like)
    if owner is None:
        return a  # numpy (and unknown types) stay numpy
    if a.dtype.name != "bfloat16":
        return owner.asarray_like(a, like)
    try:  # ml_dtypes' bfloat16: jax takes it as it is, torch and others refuse it
        return owner.asarray_like(a, like)
    except (TypeError, ValueError, RuntimeError):
        # float32 holds every bfloat16 value, so the cast back is exact
        return owner.cast(owner.asarray_like(a.astype(np.float32), like), "bfloat16")


def _mismatch(path: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path} does not match like: {what}. Pass like=(state, model) built exactly as for the run "
        f"that saved it (same model structure, shapes, dtypes and optimiser rule)"
    )


def load_checkpoint(
    path: str | bytes | os.PathLike, like: tuple[optim.OptState, Any], *, max_bytes: int | None = None
) -> tuple[optim.OptState, Any]:
    """Read a checkpoint into the structure of ``like = (state, model)``.

    ``load_checkpoint(path, like=(state, model), *, max_bytes=None) -> (state, model)``.
    Arrays come back as the library and device of the corresponding leaf of ``like``
    (numpy, torch, jax, tensorflow); a model holding variables is assigned in place and
    returned, and the returned state belongs to it (``optim.update`` accepts that model's
    variables).  The whole file is checked first, and nothing is assigned unless all of it
    passes: the SHA-256 checksum of its description and of every tensor, and the structure,
    paths, shapes and dtypes, which must match ``like`` exactly.

    Sizes are bounded before anything is read: the sizes the file declares (zip and
    ``.npy`` headers, the safetensors header) must agree with its description and with
    ``like``, and together must not exceed ``max_bytes``.  The default, ``None``, is the
    file's size on disk: ``save_checkpoint`` never compresses, so its files never hold
    more; a compressed ``.npz`` (a decompression bomb, or a trusted file repacked with
    ``np.savez_compressed``) is refused unless ``max_bytes`` is raised.

    Raises:
        CheckpointError: the file is truncated, damaged (a checksum does not match),
            pickled, not a checkpoint, not a regular file (a FIFO, device or directory),
            larger than ``max_bytes``, written without checksums (by an earlier version:
            load it with that version and save it again), or does not match ``like``.
        FileNotFoundError: no file at ``path``.

    Example:
        >>> import abstractdiff as ad, numpy as np, tempfile, os
        >>> from abstractdiff import optim
        >>> state = optim.setup(optim.Momentum(), {"w": np.ones(2)})
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
        >>> ad.save_checkpoint(path, state, {"w": np.array([0.5, 2.0])})
        >>> like = (optim.setup(optim.Momentum(), {"w": np.zeros(2)}), {"w": np.zeros(2)})
        >>> ad.load_checkpoint(path, like=like)[1]
        {'w': array([0.5, 2. ])}
        >>> ad.load_checkpoint(path, like=(state, {"w": np.zeros(3)}))
        Traceback (most recent call last):
        abstractdiff._errors.CheckpointError: ... does not match like: ...
    """
    if not (isinstance(like, tuple) and len(like) == 2):
        raise ArgumentTypeError("load_checkpoint: like must be the pair (state, model) to restore into")
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
        raise ArgumentTypeError(f"load_checkpoint: max_bytes must be a non-negative int or None, got {max_bytes!r}")
    path = _fspath(path)
    leaves, treedef, implicit = _leaves(*like)
    with fmt.open_regular(path) as f:
        limit = os.fstat(f.fileno()).st_size if max_bytes is None else max_bytes
        reader = _open_reader(path, f, limit, max_members=len(leaves) + 2)
        try:
            new_values = _read_all(path, reader, leaves)
        finally:
            reader.close()
    # Everything matched: convert all, then assign, so a failure cannot half-load.
    converted = [_to_like(v, leaf.value) if isinstance(v, np.ndarray) else v for v, leaf in zip(new_values, leaves)]
    n_state = treedef.num_leaves
    state = pytree.tree_unflatten(treedef, converted[:n_state])
    model = like[1]
    if implicit:
        for leaf, value in zip(leaves[n_state:], converted[n_state:]):
            optim.write(leaf.variable, value)
        if state.implicit:  # the loaded state belongs to the model it was loaded into
            state = state._replace(variables=optim.SetUpFor(optim.params_of(model)))
    else:
        model = pytree.tree_unflatten(pytree.tree_structure(model), converted[n_state:])
    return state, model


def _read_all(path: str, reader: Any, leaves: list[_Leaf]) -> list[Any]:
    """Every leaf's new value: the description checked (checksum, then against ``like``)
    before any tensor is read, then each tensor checked (declared size, then checksum)."""
    raw, stored_digest = reader.description()
    if raw is None:
        kind = ".safetensors file" if _is_safetensors(path) else ".npz"
        raise CheckpointError(f"{path}: no abstractdiff metadata; this {kind} was not written by ad.save_checkpoint")
    meta = _parse_meta(path, raw, stored_digest)
    entries = meta["leaves"]
    if len(entries) != len(leaves):
        have = {e["path"] for e in entries}
        want = {leaf.path for leaf in leaves}
        extra, missing = sorted(have - want)[:3], sorted(want - have)[:3]
        raise _mismatch(
            path, f"it holds {len(entries)} leaves, like has {len(leaves)}"
            + (f"; only in the file: {extra}" if extra else "") + (f"; only in like: {missing}" if missing else "")
        )
    for entry, leaf in zip(entries, leaves):  # first the whole description against like, reading nothing
        if entry["path"] != leaf.path:
            raise _mismatch(path, f"the file has {entry['path']!r} where like has {leaf.where!r}")
        expected = _describe(leaf, 0)
        kind = entry["kind"]
        if kind != expected["kind"]:
            raise _mismatch(path, f"{leaf.where} is a {kind} in the file but a {expected['kind']} in like")
        if kind == "array":
            if entry["dtype"] != expected["dtype"] or entry["shape"] != expected["shape"]:
                raise _mismatch(
                    path, f"{leaf.where} is {entry['dtype']}{tuple(entry['shape'])} in the file but "
                    f"{expected['dtype']}{tuple(expected['shape'])} in like"
                )
        elif entry["type"] != expected["type"]:
            raise _mismatch(path, f"{leaf.where} is a {entry['type']} in the file but a {expected['type']} in like")
    tensors = reader.tensors()
    described = {e["key"]: leaf for e, leaf in zip(entries, leaves) if e["kind"] == "array"}
    for entry, leaf in zip(entries, leaves):
        if entry["kind"] == "array" and entry["key"] not in tensors:
            raise CheckpointError(f"{path}: the array of {leaf.where} is missing; the file is corrupt")
    for key in tensors:
        if key not in described:
            raise CheckpointError(f"{path}: it holds a tensor {key!r} that its description does not list; the file "
                                  f"is corrupt or was not written by ad.save_checkpoint")
    new_values: list[Any] = []
    for entry, leaf in zip(entries, leaves):
        if entry["kind"] == "array":
            new_values.append(_read_checked(path, reader, tensors[entry["key"]], entry, leaf.where))
        elif entry["kind"] == "value":
            # Python scalars (the step counter) come from the file; objects (the rule) from like.
            value = entry.get("value")
            if type(value) is not type(leaf.value):  # json: bool is not int, int is not float
                raise CheckpointError(
                    f"{path}: the value of {leaf.where} is {value!r}, not a {entry['type']}; the metadata is corrupt"
                )
            new_values.append(value)
        else:
            new_values.append(leaf.value)
    return new_values

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

from . import _pytree as pytree
from . import optim
from ._convert import to_numpy
from ._errors import ArgumentTypeError, CheckpointError
from ._tree import is_array

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT = "abstractdiff-checkpoint"
VERSION = 1
META = "__abstractdiff__"
SAFETENSORS = ".safetensors"


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


def _model_variables(model: Any) -> list[tuple[str, Any]]:
    """Every variable of a model holding variables, as ``(name, variable)``, once each.

    Models are saved whole: what each library's ``model_state`` hook lists (a torch
    module's parameters, frozen ones included, and its buffers, with their
    ``state_dict`` names; every variable of a tf.Module / Keras model), variables
    themselves and ``ad.Params`` as they are.  The optimiser state covers the trainable
    ones only, in Params order.
    """
    from ._implicit import is_variable_or_model
    from ._registry import backend_for

    if optim._is_params(model):
        return [("", v) for v in model]
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def add(name: str, var: Any) -> None:
        if id(var) not in seen:  # a shared (tied) weight is stored once
            seen.add(id(var))
            found.append((name, var))

    for leaf in pytree.tree_leaves(model, is_leaf=is_variable_or_model):
        owner = backend_for(leaf)
        state = None if owner is None else owner.model_state(leaf)
        if state is not None:
            for name, var in state:
                add(name, var)
        elif optim._is_variable(leaf):
            add("", leaf)
    return found


def _leaves(state: Any, model: Any) -> tuple[list[_Leaf], Any, bool]:
    """The leaves of ``(state, model)``, the treedef to rebuild them, and whether the
    model holds variables (whose values are then the model's leaves, see ``_model_variables``)."""
    if not isinstance(state, optim.OptState):
        raise ArgumentTypeError(f"state must be the OptState from optim.setup(rule, model), got {type(state).__name__}")
    implicit = optim.holds_variables(model)
    paths, values, treedef = pytree.tree_flatten_with_path(state)
    leaves = [_Leaf("state/" + _path_str(p), v) for p, v in zip(paths, values)]
    if implicit:
        # "variable{i}" as before, so that checkpoints of models without frozen variables
        # or buffers written by earlier versions still load
        for i, (name, var) in enumerate(_model_variables(model)):
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


def save_checkpoint(path: str | os.PathLike, state: optim.OptState, model: Any) -> None:
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
    path = os.fspath(path)
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
            arrays[entry["key"]] = a
    description = json.dumps(meta)
    directory = os.path.dirname(os.path.abspath(path))
    _remove_stale_temporaries(directory, os.path.basename(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        # "xb": a fresh file, created with the user's umask (unlike mkstemp's 0600).
        with open(tmp, "xb") as f:
            if safetensors is None:
                arrays[META] = np.frombuffer(description.encode("utf-8"), dtype=np.uint8)
                np.savez(f, allow_pickle=False, **arrays)
            else:
                f.write(safetensors.numpy.save(arrays, metadata={META: description}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_ZIP_MAGIC = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"
_PICKLE_MAGIC = b"\x80"  # protocol 2 and newer


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


def _read_file(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Metadata and every array of the file, read fully (so truncation shows up here).

    Anything wrong with the file is a :class:`CheckpointError` naming the file: numpy and
    zipfile raise many kinds of errors for damaged archives (ValueError, OSError,
    NotImplementedError for an unknown compression method, AttributeError...).
    """
    with open(path, "rb") as f:  # FileNotFoundError and PermissionError reach the caller as they are
        magic = f.read(len(_NPY_MAGIC))
    if magic.startswith(_PICKLE_MAGIC):
        raise CheckpointError(
            f"{path}: a pickled file, not an abstractdiff checkpoint; pickled files are refused, by design "
            f"(loading one can run arbitrary code)"
        )
    if magic.startswith(_NPY_MAGIC):
        raise CheckpointError(f"{path}: a single .npy array, not an abstractdiff checkpoint (.npz written by "
                              f"ad.save_checkpoint)")
    if not magic.startswith(_ZIP_MAGIC):
        # np.load would call anything without a numpy or zip signature "pickled data"
        raise CheckpointError(
            f"{path}: not an abstractdiff checkpoint: it is not a .npz (zip) archive"
            + (" (it is empty)" if not magic else "")
            + "; checkpoints are written by ad.save_checkpoint"
        )
    try:
        loaded = np.load(path, allow_pickle=False)
    except Exception as err:  # noqa: BLE001  every way a damaged archive fails to open
        raise CheckpointError(
            f"{path}: not a readable abstractdiff checkpoint ({type(err).__name__}: {err}); it may be "
            f"truncated or corrupt (pickled content is refused, by design)"
        ) from err
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise CheckpointError(f"{path}: a single .npy array, not an abstractdiff checkpoint (.npz written by "
                              f"ad.save_checkpoint)")
    with loaded:
        try:
            arrays = {name: loaded[name] for name in loaded.files}
        except Exception as err:  # noqa: BLE001  every way a damaged member fails to read
            raise CheckpointError(
                f"{path}: an entry cannot be read ({type(err).__name__}: {err}); the file is truncated or "
                f"corrupt, or holds pickled objects, which are refused"
            ) from err
    if not all(isinstance(a, np.ndarray) for a in arrays.values()):
        raise CheckpointError(f"{path}: an entry is not an array; the file is corrupt")
    raw = arrays.pop(META, None)
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise CheckpointError(f"{path}: no abstractdiff metadata; this .npz was not written by ad.save_checkpoint")
    return _parse_meta(path, raw.tobytes()), arrays


def _read_safetensors(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Metadata and every array of a ``.safetensors`` file, read fully; any damage is a
    :class:`CheckpointError` (safetensors checks the header and every tensor's offsets
    against the file's size, so truncation shows up here)."""
    with open(path, "rb"):  # FileNotFoundError and PermissionError reach the caller as they are
        pass
    safe_open = _safetensors().safe_open
    try:
        with safe_open(path, framework="np") as f:
            header = f.metadata() or {}
            arrays = {name: np.array(f.get_tensor(name)) for name in f.keys()}  # a copy: no mmap kept
    except Exception as err:  # noqa: BLE001  every way a damaged file fails (SafetensorError, an unknown dtype...)
        raise CheckpointError(
            f"{path}: not a readable safetensors checkpoint ({type(err).__name__}: {err}); it may be truncated "
            f"or corrupt"
        ) from err
    raw = header.get(META)
    if not isinstance(raw, str):
        raise CheckpointError(f"{path}: no abstractdiff metadata; this .safetensors file was not written by "
                              f"ad.save_checkpoint")
    return _parse_meta(path, raw.encode("utf-8")), arrays


def _parse_meta(path: str, raw: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: the checkpoint metadata is corrupt ({err})") from err
    if not (isinstance(meta, dict) and meta.get("format") == FORMAT and isinstance(meta.get("leaves"), list)):
        raise CheckpointError(f"{path}: the metadata does not describe an abstractdiff checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {meta.get('version')!r}; this abstractdiff reads version {VERSION}"
        )
    return meta


def _to_like(a: np.ndarray, like: Any) -> Any:
    """``a`` as an array of the same library and device as ``like`` (its adapter's ``asarray_like``)."""
    from ._registry import backend_for

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


def load_checkpoint(path: str | os.PathLike, like: tuple[optim.OptState, Any]) -> tuple[optim.OptState, Any]:
    """Read a checkpoint into the structure of ``like = (state, model)``.

    ``load_checkpoint(path, like=(state, model)) -> (state, model)``.  Arrays come back
    as the library and device of the corresponding leaf of ``like`` (numpy, torch, jax,
    tensorflow); a model holding variables is assigned in place and returned, and the
    returned state belongs to it (``optim.update`` accepts that model's variables).  The
    whole file is checked first: structure, paths, shapes and dtypes must match ``like``
    exactly, otherwise nothing is assigned.

    Raises:
        CheckpointError: the file is truncated, corrupt, pickled, not a checkpoint, or
            does not match ``like``.
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
    path = os.fspath(path)
    leaves, treedef, implicit = _leaves(*like)
    meta, arrays = _read_safetensors(path) if _is_safetensors(path) else _read_file(path)
    entries = meta["leaves"]
    if len(entries) != len(leaves):
        have = {e.get("path") for e in entries if isinstance(e, dict)}
        want = {leaf.path for leaf in leaves}
        extra, missing = sorted(have - want)[:3], sorted(want - have)[:3]
        raise _mismatch(
            path, f"it holds {len(entries)} leaves, like has {len(leaves)}"
            + (f"; only in the file: {extra}" if extra else "") + (f"; only in like: {missing}" if missing else "")
        )
    new_values: list[Any] = []
    for entry, leaf in zip(entries, leaves):
        if not isinstance(entry, dict) or entry.get("path") != leaf.path:
            got = entry.get("path") if isinstance(entry, dict) else entry
            raise _mismatch(path, f"the file has {got!r} where like has {leaf.where!r}")
        expected = _describe(leaf, 0)
        kind = entry.get("kind")
        if kind != expected["kind"]:
            raise _mismatch(path, f"{leaf.where} is a {kind} in the file but a {expected['kind']} in like")
        if kind == "array":
            a = arrays.get(entry.get("key"))
            if a is None:
                raise CheckpointError(f"{path}: the array of {leaf.where} is missing; the file is corrupt")
            if a.dtype.name != entry.get("dtype") or list(a.shape) != entry.get("shape"):
                raise CheckpointError(f"{path}: the array of {leaf.where} does not match its metadata; corrupt file")
            if entry["dtype"] != expected["dtype"] or entry["shape"] != expected["shape"]:
                raise _mismatch(
                    path, f"{leaf.where} is {entry['dtype']}{tuple(entry['shape'])} in the file but "
                    f"{expected['dtype']}{tuple(expected['shape'])} in like"
                )
            new_values.append(a)
        else:
            if entry.get("type") != expected["type"]:
                raise _mismatch(
                    path, f"{leaf.where} is a {entry.get('type')} in the file but a {expected['type']} in like"
                )
            # Python scalars (the step counter) come from the file; objects (the rule) from like.
            if kind == "value":
                value = entry.get("value")
                if type(value) is not type(leaf.value):  # json: bool is not int, int is not float
                    raise CheckpointError(
                        f"{path}: the value of {leaf.where} is {value!r}, not a {expected['type']}; the "
                        f"metadata is corrupt"
                    )
                new_values.append(value)
            else:
                new_values.append(leaf.value)
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

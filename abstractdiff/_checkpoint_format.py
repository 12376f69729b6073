"""Reading checkpoint files safely: special files refused, sizes bounded before anything
is read, checksums of every tensor and of the description.

Both readers work in two phases so that nothing large is read before it is known to be
expected: :meth:`open` lists every member with the size, dtype and shape it *declares*
(zip headers and each ``.npy`` header for ``.npz``; the JSON header for
``.safetensors``) and reads the description only; :meth:`read` then reads one tensor
whose declared dtype, shape and size the caller has checked against the description
and ``like``, so it never allocates more than that, and verifies its SHA-256.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import zipfile
from typing import Any

import numpy as np

from .core import CheckpointError

META = "__abstractdiff__"
#: The SHA-256 (hex) of the description's UTF-8 bytes: an npz member / a safetensors metadata key.
META_DIGEST = "__abstractdiff_sha256__"
SAFETENSORS = ".safetensors"

#: numpy's own default for ``np.load(max_header_size=...)``: a larger ``.npy`` header is refused
#: (parsing it is costly, and no array of ours needs one).
MAX_NPY_HEADER = 10000
#: Tensors are read and checked in chunks of this many bytes (the array itself is allocated
#: once, at the size its header declares, which the caller has checked).
_CHUNK = 1 << 20

_ZIP_MAGIC = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"
_PICKLE_MAGIC = b"\x80"  # protocol 2 and newer


def little_endian(a: np.ndarray) -> np.ndarray:
    """``a`` with little-endian bytes: what checkpoints store and checksum, whatever the
    machine that wrote them (a big-endian array, e.g. from a foreign ``.npz``, is converted:
    torch and jax cannot take one)."""
    le = a.dtype.newbyteorder("<")
    return a if a.dtype == le else a.astype(le)


def digest(a: np.ndarray) -> str:
    """The SHA-256 (hex) of ``a``'s little-endian C-order bytes."""
    flat = np.ascontiguousarray(little_endian(a)).reshape(-1)  # reshape: 0-d arrays cannot be viewed as bytes
    return hashlib.sha256(flat.view(np.uint8)).hexdigest()


def text_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str) -> Any:
    """``path`` opened for binary reading, refused unless it is a regular file.

    The mode is checked before opening (opening a FIFO for reading waits for a writer
    forever; opening some devices has effects), and again on the open descriptor, which is
    opened with ``O_NONBLOCK`` so that a file swapped for a FIFO in between cannot block
    either.  ``FileNotFoundError`` and ``PermissionError`` reach the caller as they are.
    """
    def refuse(mode: int) -> CheckpointError:
        return CheckpointError(f"{path}: {_kind(mode)}, not a checkpoint file; pass the path of a file written "
                               f"by ad.save_checkpoint")

    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise refuse(mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise refuse(mode)
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for reads of a regular file
    except BaseException:
        os.close(fd)
        raise


def _too_big(path: str, what: str, size: int, limit: int) -> CheckpointError:
    return CheckpointError(
        f"{path}: {what} declares {size:,} bytes, more than max_bytes={limit:,}; refused before reading it "
        f"(a damaged file or a decompression bomb). If the file is trusted (e.g. a compressed .npz), pass a "
        f"larger load_checkpoint(..., max_bytes=...)"
    )


class Member:
    """A tensor as its file declares it, before it is read."""

    __slots__ = ("key", "dtype", "shape", "nbytes", "handle")

    def __init__(self, key: str, dtype: str, shape: tuple[int, ...], nbytes: int, handle: Any):
        self.key, self.dtype, self.shape, self.nbytes, self.handle = key, dtype, shape, nbytes, handle


class NpzReader:
    """An ``.npz`` archive read with :mod:`zipfile` and numpy's ``.npy`` header parser
    (never ``np.load``, which reads every member whole, and nothing is ever unpickled)."""

    def __init__(self, path: str, f: Any, limit: int, max_members: int):
        self.path = path
        magic = f.read(len(_NPY_MAGIC))
        f.seek(0)
        if magic.startswith(_PICKLE_MAGIC):
            raise CheckpointError(
                f"{path}: a pickled file, not an abstractdiff checkpoint; pickled files are refused, by design "
                f"(loading one can run arbitrary code)"
            )
        if magic.startswith(_NPY_MAGIC):
            raise CheckpointError(f"{path}: a single .npy array, not an abstractdiff checkpoint (.npz written by "
                                  f"ad.save_checkpoint)")
        if not magic.startswith(_ZIP_MAGIC):
            raise CheckpointError(
                f"{path}: not an abstractdiff checkpoint: it is not a .npz (zip) archive"
                + (" (it is empty)" if not magic else "")
                + "; checkpoints are written by ad.save_checkpoint"
            )
        self.zip = zipfile.ZipFile(f)
        infos = self.zip.infolist()
        if len(infos) > max_members:
            raise CheckpointError(f"{path}: {len(infos)} entries, more than the {max_members} that like can "
                                  f"need; not a checkpoint of this model, or corrupt")
        names = [i.filename for i in infos]
        if len(set(names)) != len(names):
            raise CheckpointError(f"{path}: an entry name occurs twice; the file is corrupt or crafted")
        total = sum(i.file_size for i in infos)
        if total > limit:  # the zip's declared sizes, before anything is decompressed
            raise _too_big(path, "its content", total, limit)
        self.members: dict[str, Member] = {}
        for info in infos:
            if not info.filename.endswith(".npy"):
                raise CheckpointError(f"{path}: the entry {info.filename!r} is not an array; this is not a file "
                                      f"written by ad.save_checkpoint, or it is corrupt")
            member = self._header(info)
            self.members[member.key] = member

    def _header(self, info: zipfile.ZipInfo) -> Member:
        """A member's ``.npy`` header (at most :data:`MAX_NPY_HEADER` bytes), checked against
        the zip's declared size: only the header is decompressed."""
        key = info.filename[: -len(".npy")]
        with self.zip.open(info) as m:
            version = np.lib.format.read_magic(m)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(m, max_header_size=MAX_NPY_HEADER)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(m, max_header_size=MAX_NPY_HEADER)
            else:
                raise CheckpointError(f"{self.path}: the entry {key!r} has .npy format version {version}, which "
                                      f"ad.save_checkpoint never writes")
            start = m.tell()
        if dtype.hasobject:
            raise CheckpointError(f"{self.path}: the entry {key!r} holds pickled objects, which are refused, by "
                                  f"design (loading them can run arbitrary code)")
        if any(d < 0 for d in shape) or dtype.itemsize == 0 or dtype.fields is not None or dtype.subdtype:
            raise CheckpointError(f"{self.path}: the entry {key!r} has a malformed header ({dtype}, {shape})")
        nbytes = math.prod(shape) * dtype.itemsize
        if start + nbytes != info.file_size:
            raise CheckpointError(
                f"{self.path}: the entry {key!r} declares {dtype}{tuple(shape)} ({nbytes:,} bytes) in a member of "
                f"{info.file_size:,} bytes; the file is truncated or corrupt"
            )
        return Member(key, dtype.name, tuple(shape), nbytes, (info, start, dtype, fortran))

    def read(self, member: Member) -> np.ndarray:
        """The member's array, allocated once at its checked size and filled in chunks; zip
        checks the CRC when the last byte is read."""
        info, start, dtype, fortran = member.handle
        flat = np.empty(math.prod(member.shape), dtype=dtype)
        out = flat.view(np.uint8) if flat.size else np.empty(0, np.uint8)
        with self.zip.open(info) as m:
            m.read(start)
            done = 0
            while done < member.nbytes:
                chunk = m.read(min(_CHUNK, member.nbytes - done))
                if not chunk:
                    raise CheckpointError(f"{self.path}: the entry {member.key!r} ends early; the file is "
                                          f"truncated or corrupt")
                out[done: done + len(chunk)] = np.frombuffer(chunk, np.uint8)
                done += len(chunk)
            if m.read(1):
                raise CheckpointError(f"{self.path}: the entry {member.key!r} is longer than it declares; corrupt")
        shape = member.shape
        return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)

    def description(self) -> tuple[bytes | None, bytes | None]:
        """The description's bytes and its stored digest (``None`` where absent)."""
        found = []
        for name in (META, META_DIGEST):
            member = self.members.get(name)
            if member is None:
                found.append(None)
                continue
            if member.dtype != "uint8" or len(member.shape) != 1:
                raise CheckpointError(f"{self.path}: the entry {name} is {member.dtype}{member.shape}, not bytes; "
                                      f"the file is corrupt")
            found.append(self.read(member).tobytes())
        return found[0], found[1]

    def tensors(self) -> dict[str, Member]:
        return {k: m for k, m in self.members.items() if k not in (META, META_DIGEST)}

    def close(self) -> None:
        self.zip.close()


#: safetensors' dtype names, as numpy's (ml_dtypes' for bfloat16 and float8).
_ST_DTYPES = {"BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "U16": ("uint16", 2),
              "I16": ("int16", 2), "U32": ("uint32", 4), "I32": ("int32", 4), "U64": ("uint64", 8),
              "I64": ("int64", 8), "F16": ("float16", 2), "BF16": ("bfloat16", 2), "F32": ("float32", 4),
              "F64": ("float64", 8), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1)}


class SafetensorsReader:
    """A ``.safetensors`` file through the ``safetensors`` package, which checks the header
    and every tensor's offsets against the file's size (so truncation shows up here); the
    tensors are memory-mapped and copied out one at a time, after their checks."""

    def __init__(self, path: str, f: Any, limit: int, max_members: int, safe_open: Any):
        self.path = path
        self._file = f  # held open while safe_open reads the same (regular, checked) file
        self.st = safe_open(path, framework="np").__enter__()
        try:
            self._list(limit, max_members)
        except BaseException:
            self.st.__exit__(None, None, None)
            raise

    def _list(self, limit: int, max_members: int) -> None:
        path = self.path
        keys = list(self.st.keys())
        if len(keys) > max_members:
            raise CheckpointError(f"{path}: {len(keys)} tensors, more than the {max_members} that like can need; "
                                  f"not a checkpoint of this model, or corrupt")
        self.members = {}
        for key in keys:
            sl = self.st.get_slice(key)
            name, size = _ST_DTYPES.get(sl.get_dtype(), (sl.get_dtype().lower(), 1))
            shape = tuple(int(d) for d in sl.get_shape())
            self.members[key] = Member(key, name, shape, math.prod(shape) * size, None)
        self.meta = self.st.metadata() or {}
        total = sum(m.nbytes for m in self.members.values()) + sum(len(v) for v in self.meta.values())
        if total > limit:
            raise _too_big(path, "its content", total, limit)

    def read(self, member: Member) -> np.ndarray:
        return np.array(self.st.get_tensor(member.key))  # a copy: no mmap kept

    def description(self) -> tuple[bytes | None, bytes | None]:
        raw, dig = self.meta.get(META), self.meta.get(META_DIGEST)
        return (None if raw is None else raw.encode("utf-8"), None if dig is None else dig.encode("utf-8"))

    def tensors(self) -> dict[str, Member]:
        return self.members

    def close(self) -> None:
        try:
            self.st.__exit__(None, None, None)
        finally:
            self._file.close()

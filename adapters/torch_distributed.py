"""The communication engine of ``ad.DataParallel``: ``torch.distributed`` (gloo, NCCL).

Every fact about ``torch.distributed`` lives here; the core (``abstractdiff._distributed``)
shards batches, moves arrays of any backend in and out, and calls the collectives below.
Arrays cross into torch by DLPack where their library exports it, through numpy
otherwise; each collective works on one flat buffer per dtype (one call, not one per
parameter), always a fresh copy, so no array of another library is ever written in place.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from abstractdiff._errors import ArgumentTypeError, BackendUnavailableError, DistributedError, InvalidArgumentError

__all__ = ["TorchProcessGroup"]

_BACKENDS = ("auto", "gloo", "nccl")


class TorchProcessGroup:
    """One process of a ``torch.distributed`` process group (created here unless one exists).

    ``TorchProcessGroup(backend="auto", timeout=..., rank=..., world_size=..., init_method=...)``:
    ``"auto"`` is NCCL where this torch sees a CUDA GPU, gloo otherwise.
    """

    def __init__(self, *, backend: str, timeout: float, rank: int, world_size: int, init_method: str):
        if not dist.is_available():
            raise BackendUnavailableError(f"this torch {torch.__version__} was built without torch.distributed")
        if backend not in _BACKENDS:
            raise InvalidArgumentError(f"DataParallel: backend must be one of {_BACKENDS}, got {backend!r}")
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available() and torch.cuda.is_available()}
        if not available[backend]:
            raise BackendUnavailableError(
                f"DataParallel: the {backend!r} communication backend is not available in this torch "
                f"{torch.__version__}" + ("" if backend == "gloo" else " (NCCL needs CUDA GPUs); use backend='gloo'")
            )
        self.backend, self.rank, self.world_size, self.timeout = backend, rank, world_size, timeout
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.owned = not dist.is_initialized()
        if not self.owned:
            have = (dist.get_rank(), dist.get_world_size())
            if have != (rank, world_size):
                raise DistributedError(
                    f"DataParallel: a process group already exists as rank {have[0]} of {have[1]}, but this "
                    f"process was told rank {rank} of world size {world_size}; pass the same values (or none)"
                )
            return
        with self._failing("joining the process group"):
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )

    # ------------------------------------------------------------------ errors
    def _failing(self, what: str) -> Any:
        return _Failing(self, what)

    # ------------------------------------------------------------------ arrays
    def to_tensor(self, a: Any, to_numpy: Callable[[], Any]) -> torch.Tensor:
        """``a`` as a torch tensor: itself, by DLPack (shared memory), or from numpy (a copy)."""
        if isinstance(a, torch.Tensor):
            return a.detach()
        if hasattr(a, "__dlpack__") and not isinstance(a, np.ndarray):
            try:
                return torch.from_dlpack(a)
            except Exception:  # noqa: BLE001  a producer without the stream keyword, an unsupported device...
                pass
        array = np.asarray(to_numpy())
        try:
            if array.flags.writeable and array.flags.c_contiguous:
                return torch.from_numpy(array)  # shared: the collectives work on a copy (see _buckets)
            return torch.tensor(array)  # a copy: read-only and negatively strided arrays are fine
        except (TypeError, RuntimeError) as err:
            raise ArgumentTypeError(
                f"DataParallel: a {type(a).__module__}.{type(a).__name__} of dtype {array.dtype} cannot cross to "
                f"torch for the all-reduce ({err}); use float32 or float64 parameters"
            ) from err

    def to_numpy(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().cpu().numpy()

    def _buckets(self, tensors: list[torch.Tensor]) -> Iterator[tuple[list[int], torch.Tensor]]:
        """``(indices, flat)``: one fresh contiguous buffer on the engine's device per dtype."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for indices in by_dtype.values():
            flat = torch.cat([tensors[i].reshape(-1).to(self.device) for i in indices])
            yield indices, flat

    def _unflatten(self, out: list, indices: list[int], flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        for i, part in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            out[i] = part.view(tensors[i].shape)

    def all_reduce_sum(self, tensors: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
        """``sum over processes of scale * t`` for each tensor, in one collective per dtype."""
        out: list[Any] = [None] * len(tensors)
        for indices, flat in self._buckets(tensors):
            if scale != 1.0:
                flat.mul_(scale)
            with self._failing("the gradient all-reduce"):
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            self._unflatten(out, indices, flat, tensors)
        return out

    def broadcast(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Rank 0's values of the tensors, on every process."""
        out: list[Any] = [None] * len(tensors)
        for indices, flat in self._buckets(tensors):
            with self._failing("broadcasting the parameters from rank 0"):
                dist.broadcast(flat, src=0)
            self._unflatten(out, indices, flat, tensors)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        with self._failing("comparing the processes' models"):
            dist.all_gather_object(gathered, obj)
        return gathered

    def fingerprint(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(digest, per_leaf)``: exact fingerprints of the tensors' bits, on the engine's device.

        Each tensor's bytes are read as integers (mostly ``int64`` words: a view, not a
        copy), laid out in rows of ``_ROW`` words, and summed in ``int64``, wrapping on
        overflow: the plain sum (exact, not a float sum: any one changed element changes
        it, whatever the change), and the row sums and the column sums, each mixed
        (:func:`_mix`) and weighted by its odd position (two elements swapped change one
        of them). Integer sums wrap the same in any order, so equal tensors give equal
        sums on every device and process. Two passes over the data per tensor; the rest
        works on the ``n / _ROW + _ROW`` sums of all tensors at once. ``per_leaf`` is
        ``(len(tensors), 3)``; ``digest`` folds it, mixed and weighted by each tensor's
        odd position, into 3 integers.
        """
        per_leaf = torch.zeros((len(tensors), _DIGEST), dtype=torch.int64, device=self.device)
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        for indices in by_device.values():  # one batch of small ops, one copy per device
            per_leaf[indices] = _bit_sums([tensors[i] for i in indices]).to(self.device)
        # odd weights: a change in one tensor's (mixed) sums cannot vanish modulo 2**64
        weights = torch.arange(len(tensors), dtype=torch.int64, device=self.device) * 2 + 1
        digest = (_mix(per_leaf) * weights[:, None]).sum(0)
        return digest, per_leaf

    def all_gather_ints(self, values: list[int], tail: torch.Tensor | None = None) -> list[list[int]]:
        """Every process's ``values + tail`` as ``int64``, in one small collective: ``[rank 0's,
        rank 1's, ...]``. ``tail`` is a :meth:`fingerprint` digest, or ``None`` for zeros in its
        place: every process sends as many integers, whether it fingerprinted or not."""
        head = torch.tensor(values, dtype=torch.int64, device=self.device)
        if tail is None:
            tail = torch.zeros(_DIGEST, dtype=torch.int64, device=self.device)
        mine = torch.cat([head, tail.reshape(-1).to(self.device, torch.int64)])
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self._failing("checking that the processes are in step"):
            dist.all_gather(gathered, mine)
        return torch.stack(gathered).cpu().tolist()

    def barrier(self) -> None:
        with self._failing("waiting for every process (barrier)"):
            if self.backend == "gloo":  # names the ranks that did not arrive
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.timeout))
            else:
                dist.barrier()

    def close(self) -> None:
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
            self.owned = False


#: 0x9E3779B97F4A7C15 (2**64 / the golden ratio, odd) as a signed int64
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
#: integers in a fingerprint's digest (the sums of :func:`_bit_sums`)
_DIGEST = 3
#: words per row of the fingerprint's 2-d view: row sums and column sums locate every element
_ROW = 64


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as the widest integers that tile them (``int64`` for most arrays): a view,
    no copy, where the memory allows."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.numel() % size == 0:
            try:
                return raw.view(dtype)
            except RuntimeError:  # an offset that is not a multiple of the word: try narrower words
                continue
    return raw


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (a bijection of int64, wrapping): float words end in many zero
    bits (1.0 is 1023 * 2**52), so their sums times even weight differences would vanish
    modulo 2**64; mixed, they do not."""
    x = x ^ _shr(x, 30)
    x = x * (0xBF58476D1CE4E5B9 - 2**64)
    x = x ^ _shr(x, 27)
    x = x * (0x94D049BB133111EB - 2**64)
    return x ^ _shr(x, 31)


def _bit_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``(len(tensors), 3)`` wrapping ``int64`` sums of each tensor's words (:func:`_words`) in
    rows of ``_ROW``: the plain sum, and the sums of the mixed row sums and of the mixed
    column sums, weighted by their odd positions within the tensor (tensors on one device)."""
    rows, columns, counts = [], [], []
    for t in tensors:
        words = _words(t)
        n = words.numel() // _ROW
        body, tail = words[: n * _ROW].view(n, _ROW), words[n * _ROW:]
        rows += [body.sum(1, dtype=torch.int64), tail.sum(dtype=torch.int64).reshape(1)]  # the tail: a last row
        padded = torch.nn.functional.pad(tail.to(torch.int64), (0, _ROW - tail.numel()))
        columns.append(body.sum(0, dtype=torch.int64) + padded)
        counts.append(n + 1)
    device = tensors[0].device
    row_sums, column_sums = torch.cat(rows), torch.stack(columns)
    leaf = torch.repeat_interleave(torch.arange(len(tensors), device=device), torch.tensor(counts, device=device))
    starts = torch.tensor([0, *counts[:-1]], dtype=torch.int64, device=device).cumsum(0)
    row_weights = (torch.arange(row_sums.numel(), dtype=torch.int64, device=device) - starts[leaf]) * 2 + 1
    column_weights = torch.arange(_ROW, dtype=torch.int64, device=device) * 2 + 1
    out = torch.zeros((len(tensors), _DIGEST), dtype=torch.int64, device=device)
    out[:, 0].index_add_(0, leaf, row_sums)
    out[:, 1].index_add_(0, leaf, _mix(row_sums) * row_weights)
    out[:, 2] = (_mix(column_sums) * column_weights).sum(1)
    return out


class _Failing:
    """Turns a failed or timed-out collective into a :class:`DistributedError` naming it."""

    def __init__(self, group: TorchProcessGroup, what: str):
        self.group, self.what = group, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: Any, tb: Any) -> bool:
        if err is None or not isinstance(err, Exception) or isinstance(err, DistributedError):
            return False
        g = self.group
        raise DistributedError(
            f"DataParallel: {self.what} failed on rank {g.rank} of {g.world_size} ({g.backend}): "
            f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}. Another "
            f"process probably exited or hangs (see its own output); a hung process is given up on after "
            f"timeout={g.timeout:g} s"
        ) from err

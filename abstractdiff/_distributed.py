"""Data-parallel training: ``ad.train(..., distributed=ad.DataParallel())``.

Each process (launched by ``torchrun``) gets the same global batch, takes its own
contiguous block of rows, computes the loss and gradient of its block with its own AD
backend, and the gradients are averaged across processes with a collective of an
existing engine (``torch.distributed``: gloo on CPUs, NCCL on GPUs), weighted by each
block's share of the rows, so that every process applies the full-batch mean gradient.

The core knows no AD library (tests/test_layering.py): the engine is an adapter,
``abstractdiff.adapters.torch_distributed``, loaded when a ``DataParallel`` is created;
arrays of any backend cross to it by DLPack or numpy and come back as the backend's own
arrays (dtype and device kept) through the backends' hooks.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Any, Callable

from . import optim
from .core import ArgumentTypeError, DistributedError, InvalidArgumentError, backend_for, is_array, pytree, to_numpy

__all__ = ["DataParallel", "shard_batch", "shard_rows"]

#: The engine, as a "module:attribute" string (like the registry's built-in backends).
ENGINE = "abstractdiff.adapters.torch_distributed:TorchProcessGroup"
_UNEVEN = ("weight", "error")


def _load_engine() -> Callable[..., Any]:
    module, _, attribute = ENGINE.partition(":")
    return getattr(importlib.import_module(module), attribute)


def shard_rows(n: int, rank: int, world_size: int) -> slice:
    """The rows of a batch of ``n`` that process ``rank`` of ``world_size`` takes.

    ``shard_rows(n, rank, world_size) -> slice``: contiguous blocks in rank order, as
    ``numpy.array_split`` cuts them (the first ``n % world_size`` processes take one row
    more).

    Example:
        >>> from abstractdiff._distributed import shard_rows
        >>> [shard_rows(10, r, 3) for r in range(3)]
        [slice(0, 4, None), slice(4, 7, None), slice(7, 10, None)]
    """
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"DataParallel: the environment variable {name}={value!r} is not an integer") from None


def _resolve(rank: int | None, world_size: int | None, init_method: str | None) -> tuple[int, int, str]:
    """Rank, world size and rendezvous, from the arguments or torchrun's environment."""
    env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
    for name, given, env in (("rank", rank, env_rank), ("world_size", world_size, env_world)):
        if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
            raise ArgumentTypeError(f"DataParallel: {name} must be an int, got {type(given).__name__}")
        if given is not None and env is not None and given != env:
            raise DistributedError(
                f"DataParallel: {name}={given} was given, but this process was launched as "
                f"{'RANK' if name == 'rank' else 'WORLD_SIZE'}={env} (torchrun's environment); pass the same "
                f"value or leave it out"
            )
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    if rank is None or world_size is None:
        raise DistributedError(
            "DataParallel: this process was not launched for data-parallel training (RANK and WORLD_SIZE "
            "are not set); launch the script with `torchrun --standalone --nproc_per_node 2 script.py`, or "
            "pass rank=, world_size= and init_method='tcp://host:port' to every process"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"DataParallel: need world_size >= 1 and 0 <= rank < world_size, got "
                                   f"rank={rank}, world_size={world_size}")
    if init_method is None:
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise DistributedError(
                "DataParallel: no rendezvous: set MASTER_ADDR and MASTER_PORT (torchrun does) or pass "
                "init_method='tcp://host:port' (the same on every process)"
            )
        init_method = "env://"
    return rank, world_size, init_method


def _is_float(a: Any) -> bool:
    import autoray

    name = autoray.get_dtype_name(a)
    return name.startswith(("float", "bfloat", "complex"))


def _leading(a: Any) -> int | None:
    shape = getattr(a, "shape", None)
    return None if shape is None or len(shape) == 0 else int(shape[0])


def shard_batch(batch: Any, rank: int, world_size: int, uneven: str = "weight") -> tuple[Any, float, int]:
    """Process ``rank``'s block of rows of every array of ``batch`` with a leading axis.

    ``shard_batch(batch, rank, world_size, uneven="weight") -> (rows, share, n)``: ``share``
    is the block's fraction ``len(block) / n`` of the batch's ``n`` rows, the weight of its
    gradient in the average.  Non-array arguments (and 0-d arrays) are passed whole.

    Example:
        >>> import numpy as np
        >>> from abstractdiff._distributed import shard_batch
        >>> (x, scale), share, n = shard_batch((np.arange(5.0), 2.0), rank=1, world_size=2)
        >>> x, scale, share, n
        (array([3., 4.]), 2.0, 0.4, 5)
    """
    leaves, treedef = pytree.tree_flatten(batch)
    sizes = {n for n in (_leading(a) for a in leaves if is_array(a)) if n is not None}
    if not sizes:
        raise InvalidArgumentError(
            "DataParallel: the batch has no array with a leading (batch) axis to split between the processes"
        )
    if len(sizes) > 1:
        raise InvalidArgumentError(
            f"DataParallel: the batch's arrays have different leading (batch) axes {sorted(sizes)}; every "
            f"array of a batch is split by its rows, so they must have the same number of rows"
        )
    n = sizes.pop()
    if n < world_size:
        raise InvalidArgumentError(
            f"DataParallel: a batch of {n} rows cannot be split between {world_size} processes; "
            f"use batches of at least {world_size} rows"
        )
    if n % world_size and uneven == "error":
        raise InvalidArgumentError(
            f"DataParallel: a batch of {n} rows does not split evenly between {world_size} processes "
            f"(uneven='error'); use a multiple of {world_size}, or uneven='weight'"
        )
    rows = shard_rows(n, rank, world_size)
    mine = [a[rows] if is_array(a) and _leading(a) is not None else a for a in leaves]
    return pytree.tree_unflatten(treedef, mine), (rows.stop - rows.start) / n, n


class DataParallel:
    """Average gradients over processes, each training on its block of every batch.

    ``DataParallel(backend="auto", *, timeout=300.0, rank=None, world_size=None,
    init_method=None, uneven="weight", verify_every=1)``.

    Pass it as ``ad.train(..., distributed=dp)`` or ``ad.train_step(..., distributed=dp)``
    in every process of a ``torchrun`` launch (``torchrun --standalone --nproc_per_node 2
    script.py``); rank and world size come from torchrun's environment, or from
    ``rank=``/``world_size=``/``init_method=`` given to every process.

    What happens on each step, on every process:

    - the batch (the same global batch on every process) is sharded: every array
      argument with a leading axis is cut into ``world_size`` contiguous blocks of rows
      (:func:`shard_rows`), and this process keeps block ``rank``; other arguments are
      passed as they are;
    - the loss and gradient of the block are computed by the step's own backend;
    - loss and gradients cross to torch (DLPack where the library exports it, numpy
      otherwise), are summed over processes, each weighted by its block's share of the
      rows ``n_rank / n``, in one all-reduce per dtype, and come back as the backend's
      arrays (same dtype and device). With a ``loss_fn`` that is a mean over the rows,
      this is exactly the full-batch mean gradient (and loss), also when ``n`` is not a
      multiple of the world size; ``uneven="error"`` refuses such batches instead;
    - every process applies the same update, so the parameters stay identical;
    - in implicit mode, the model's variables the optimiser does not train (buffers such
      as BatchNorm's running mean and variance, which each process's forward pass
      updates from its own rows, and frozen parameters) are then broadcast from rank 0,
      as torch's ``DistributedDataParallel`` broadcasts buffers: every process ends each
      step with an identical model, whose running statistics are rank 0's (not an
      average over the processes; use a synchronised batch norm in the model for that).

    Before the first step (``state.step == 0``) the processes check that they train
    the same model structure on batches of the same size, and rank 0's parameters (and
    buffers) are broadcast to all.

    On every step after that the processes check that they are still in step
    (:meth:`verify_step`, one ``all_gather`` of 7 integers): the same step number, the
    same number of rows in the global batch, the same model structure and, every
    ``verify_every`` steps (default 1: every step), the same model values, by an exact
    fingerprint of every parameter's (and, in implicit mode, buffer's) bytes. A process
    that differs (resumed from another checkpoint or with another state, given other
    batches, or whose model drifted) raises :class:`~abstractdiff.DistributedError` on
    every process, naming the rank and what differs, before the step is taken. The
    fingerprint costs two passes over the parameters' memory (about 20 ms per 10 million
    float32 parameters on one CPU core); ``verify_every=N`` takes it every N steps only
    (the step and batch size are still checked every step, so that the processes' collectives
    stay paired). ``verify_every=0`` turns every check after the first step off.

    Warning:
        With ``verify_every=0``, processes that resume from different checkpoints or
        states, or are given batches of different sizes, train on silently and end with
        different models, each with exit status 0.

    Checkpoints are written by rank 0 only
    (:meth:`save_checkpoint`); every process loads the same file with ``ad.load_checkpoint``.

    ``backend``: ``"gloo"`` (CPU), ``"nccl"`` (CUDA GPUs) or ``"auto"`` (NCCL where
    torch sees a GPU). ``timeout``: seconds a collective waits for a process that hangs
    before raising :class:`~abstractdiff.DistributedError` (a process that exits is
    usually noticed at once). ``close()`` (or a ``with`` block) leaves the process group
    this object created.

    Raises:
        DistributedError: not launched as several processes, arguments disagreeing with
            torchrun's environment, processes at different steps or with different models
            or batch sizes (at any step), or a failed collective (another process died or
            timed out).
        BackendUnavailableError: torch (or its gloo / NCCL support) is not installed.

    Example:
        >>> import abstractdiff as ad
        >>> ad.DataParallel.shard_rows(10, rank=1, world_size=4)
        slice(3, 6, None)
    """

    shard_rows = staticmethod(shard_rows)

    def __init__(
        self,
        backend: str = "auto",
        *,
        timeout: float = 300.0,
        rank: int | None = None,
        world_size: int | None = None,
        init_method: str | None = None,
        uneven: str = "weight",
        verify_every: int = 1,
    ):
        if not isinstance(verify_every, int) or isinstance(verify_every, bool):
            raise ArgumentTypeError(
                f"DataParallel: verify_every must be an int (steps between model checks; 0 turns the "
                f"checks off), got {type(verify_every).__name__}"
            )
        if verify_every < 0:
            raise InvalidArgumentError(
                f"DataParallel: verify_every must be >= 0 (1 checks the model every step, N every N steps, "
                f"0 never), got {verify_every}"
            )
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
                and math.isfinite(timeout)):
            raise InvalidArgumentError(f"DataParallel: timeout must be a number of seconds > 0, got {timeout!r}")
        if uneven not in _UNEVEN:
            raise InvalidArgumentError(f"DataParallel: uneven must be one of {_UNEVEN}, got {uneven!r}")
        rank, world_size, init_method = _resolve(rank, world_size, init_method)
        self.uneven = uneven
        self.verify_every = verify_every
        self._engine = _load_engine()(
            backend=backend, timeout=float(timeout), rank=rank, world_size=world_size, init_method=init_method
        )
        self.rank: int = rank
        self.world_size: int = world_size

    def __repr__(self) -> str:
        return f"DataParallel(rank={self.rank}, world_size={self.world_size}, backend={self._engine.backend!r})"

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the process that logs and writes checkpoints)."""
        return self.rank == 0

    # ------------------------------------------------------------------ batches
    def shard(self, batch: tuple) -> tuple[tuple, float, int]:
        """``(this process's rows of batch, their share of the rows, the batch's rows)``."""
        return shard_batch(batch, self.rank, self.world_size, self.uneven)

    # ------------------------------------------------------------------ crossing
    def _to_engine(self, arrays: list[Any]) -> list[Any]:
        return [self._engine.to_tensor(a, lambda a=a: to_numpy(a)) for a in arrays]

    def _from_engine(self, t: Any, like: Any) -> Any:
        """``t`` as an array of ``like``'s library, dtype and device: DLPack, else numpy."""
        owner = backend_for(like)
        with optim.arithmetic_scope([like]):
            if owner is not None and owner.is_native(t):  # the engine's own library
                return owner.asarray_like(t, like)
            namespace = getattr(like, "__array_namespace__", None)
            if namespace is not None and _same_device(t, like):
                try:
                    out = namespace().from_dlpack(t)
                except Exception:  # noqa: BLE001  alignment, an unsupported device or dtype: numpy below
                    out = None
                if out is not None and _same_dtype(out, like):
                    return out
            a = self._engine.to_numpy(t)
            return a if owner is None else owner.asarray_like(a, like)

    # ------------------------------------------------------------------ collectives
    def average(self, loss: Any, grads: list[Any], share: float) -> tuple[Any, list[Any]]:
        """``sum over processes of share * value`` for the loss and each gradient (``None``
        gradients stay ``None``): the full-batch mean when ``share`` is each block's fraction."""
        present = [g for g in grads if g is not None]
        for i, a in enumerate([loss, *present]):
            if not is_array(a) or not _is_float(a):
                what = "the loss" if i == 0 else f"gradient {i - 1}"
                got = type(a).__name__ if not is_array(a) else _dtype_name(a)
                raise ArgumentTypeError(
                    f"DataParallel: {what} is {got}, not a float array; only float losses and gradients "
                    f"can be averaged across processes"
                )
        summed = self._engine.all_reduce_sum(self._to_engine([loss, *present]), float(share))
        back = iter(self._from_engine(t, like) for t, like in zip(summed, [loss, *present]))
        loss = next(back)
        return loss, [None if g is None else next(back) for g in grads]

    def broadcast(self, arrays: list[Any]) -> list[Any]:
        """Rank 0's values of ``arrays`` (same structure on every process), as the arrays' own kind."""
        if not arrays:
            return []
        out = self._engine.broadcast(self._to_engine(arrays))
        return [self._from_engine(t, like) for t, like in zip(out, arrays)]

    def check_same(self, what: str, description: Any) -> None:
        """Raise :class:`DistributedError` on every process unless all describe the same ``what``."""
        everyone = self._engine.all_gather_object(description)
        for rank, other in enumerate(everyone):
            if other != everyone[0]:
                raise DistributedError(
                    f"DataParallel: the processes disagree about {what}: rank 0 has {everyone[0]}, rank {rank} "
                    f"has {other}; every process must run the same script on the same model and batch sizes"
                )

    def verify_step(self, step: int, n_rows: int, model: Any) -> None:
        """Raise :class:`DistributedError` on every process unless all are about to take the same
        ``step`` on a batch of the same ``n_rows`` rows with the same model.

        ``train_step`` calls it on every step, after sharding the batch: one ``all_gather``
        of 7 integers per process (the step, the rows, a hash of the model's structure and,
        every ``verify_every`` steps, an exact fingerprint of the model's values: see
        :meth:`~abstractdiff.adapters.torch_distributed.TorchProcessGroup.fingerprint`).
        ``model`` is the pytree of arrays (explicit mode) or the model holding variables
        (implicit mode: its parameters, buffers and frozen parameters). On step 1
        (``state.step == 0``) the values are not compared: rank 0's are broadcast then.
        With ``verify_every=0`` it does nothing.
        """
        if not self.verify_every:
            return
        names, values = _model_values(model)
        structure = _hash63(repr(describe(values)))
        # the values on every verify_every-th step; never before the first, which broadcasts rank 0's
        compare = step > 1 and step % self.verify_every == 0
        arrays = [a for a in values if is_array(a)]
        digest = per_leaf = None
        if compare:
            digest, per_leaf = self._engine.fingerprint(self._to_engine(arrays))
        everyone = self._engine.all_gather_ints([int(step), int(n_rows), structure, int(compare)], digest)
        if all(row == everyone[0] for row in everyone):
            return
        # every process has the same rows, so all take this branch and the collectives below pair up
        leaf_names = [n for n, a in zip(names, values) if is_array(a)]
        self._out_of_step(step, everyone, leaf_names, per_leaf)

    def _out_of_step(self, step: int, everyone: list[list[int]], names: list[str], per_leaf: Any) -> None:
        groups: dict[tuple, list[int]] = {}
        for rank, row in enumerate(everyone):
            groups.setdefault(tuple(row), []).append(rank)
        # the majority is taken as right (rank 0's group on a tie), the others are named
        reference = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
        ref = everyone[reference[0]]
        ref_name = f"rank {reference[0]}" if len(reference) == 1 else f"ranks {_ranks(reference)}"
        same_values = [r for r in range(len(everyone)) if everyone[r][2:] == ref[2:]]
        leaves: list[Any] = []
        if ref[3] and len(same_values) < len(everyone) and all(row[:4] == ref[:4] for row in everyone):
            # same step and structure, different values: which leaves (a second, rare collective)
            leaves = self._engine.all_gather_object(self._engine.to_numpy(per_leaf).tolist())
        lines = []
        for rank, row in enumerate(everyone):
            if rank in reference:
                continue
            if row[0] != ref[0]:
                lines.append(f"rank {rank} is at step {row[0]}, {ref_name} at step {ref[0]}")
            if row[1] != ref[1]:
                lines.append(f"rank {rank} was given a batch of {row[1]} rows, {ref_name} one of {ref[1]}")
            if row[0] == ref[0] and row[2] != ref[2]:
                lines.append(f"rank {rank}'s model has another structure (tree, shapes or dtypes) than {ref_name}'s")
            elif row[0] == ref[0] and row[3:] != ref[3:]:
                where = ""
                if leaves:
                    differ = [names[i] for i, (a, b) in enumerate(zip(leaves[rank], leaves[reference[0]])) if a != b]
                    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
                    where = f" ({len(differ)} of {len(names)} arrays differ: {shown})"
                lines.append(f"rank {rank}'s model values differ from {ref_name}'s{where}")
        raise DistributedError(
            f"DataParallel: the processes are out of step before step {step}: " + "; ".join(lines)
            + ". Every process must train the same model from the same point: resume every rank from the "
            "same checkpoint (the file dp.save_checkpoint wrote, loaded with ad.load_checkpoint on every "
            "process, state included), and give every process the same batches in the same order"
        )

    def barrier(self) -> None:
        """Wait until every process gets here (raises :class:`DistributedError` after ``timeout``)."""
        self._engine.barrier()

    def save_checkpoint(self, path: str | os.PathLike, state: optim.OptState, model: Any) -> None:
        """``ad.save_checkpoint`` by rank 0 only, then a barrier: call it on every process.

        When it returns, the file is complete, so any process may load it.
        """
        if self.is_main:
            from ._checkpoint import save_checkpoint

            save_checkpoint(path, state, model)
        self.barrier()

    def close(self) -> None:
        """Leave the process group this object created (a no-op for one that existed before)."""
        self._engine.close()

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _dtype_name(a: Any) -> str:
    import autoray

    return autoray.get_dtype_name(a)


def _same_dtype(a: Any, b: Any) -> bool:
    return _dtype_name(a) == _dtype_name(b)


def _same_device(a: Any, b: Any) -> bool:
    try:
        return tuple(a.__dlpack_device__()) == tuple(b.__dlpack_device__())
    except Exception:  # noqa: BLE001  no DLPack device: go through numpy
        return False


def describe(tree: Any) -> list[Any]:
    """Structure, shapes and dtypes of a model, comparable across processes."""
    leaves, treedef = pytree.tree_flatten(tree)
    return [str(treedef), [(tuple(int(d) for d in a.shape), _dtype_name(a)) if is_array(a) else repr(a)
                           for a in leaves]]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _hash63(text: str) -> int:
    """A hash of ``text`` that is the same in every process (``hash()`` of a str is salted per
    process), as an int64."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def model_variables(model: Any) -> list[tuple[str, Any]]:
    """``(name, variable)`` of every variable of a model holding variables: the trained
    parameters (``optim.params_of(model)``'s order) first, then the ones the optimiser
    does not train, buffers (BatchNorm's running statistics) and frozen parameters, as
    its library's ``model_state`` lists them."""
    from .core import model_state_variables

    params = list(optim.params_of(model))
    found = model_state_variables(model)
    named = {id(v): name for name, v in found}
    trained = {id(p) for p in params}
    return [(named.get(id(p)) or f"parameter {i}", p) for i, p in enumerate(params)] + [
        (name or f"variable {i}", v) for i, (name, v) in enumerate(found) if id(v) not in trained
    ]


def _model_values(model: Any) -> tuple[list[str], list[Any]]:
    """Names and current values of a model's leaves: its variables' values in implicit mode,
    the leaves of the pytree (arrays and others) in explicit mode."""
    if optim.holds_variables(model):
        found = model_variables(model)
        return [name for name, _ in found], [optim.read(v) for _, v in found]
    paths, leaves, _ = pytree.tree_flatten_with_path(model)
    return ["".join(f"[{k!r}]" for k in path) or "the model" for path in paths], leaves

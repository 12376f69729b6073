"""``train_step`` and ``train``: one loop for explicit models and implicit variables.

The for loop a user writes around :func:`train_step` is the first-class API; :func:`train`
is a thin convenience over it (epochs, callbacks, validation, a history, a progress bar),
returning the updated ``(state, model)`` as Optimisers.jl does, with the run's
:class:`History` as an attribute of that pair.

Epochs count from 0 everywhere: ``StepInfo.epoch``, ``EpochInfo.epoch``,
``History.epochs``, the progress bar and line, and a checkpoint's ``{epoch}`` field.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

import numpy as np

from . import optim
from ._atomic import HeldInterrupts, restore, snapshot, untrained_state
from ._compiled_step import compiled_train_step
from .callbacks import Callback, as_callbacks
from .core import (
    ArgumentTypeError,
    Backend,
    CollectedError,
    InvalidArgumentError,
    ModeMismatchError,
    NonFiniteError,
    WeakLRU,
    is_array,
    pytree,
    scope,
    to_numpy,
)
from .core import backend as _get_backend
from .optim._state import _weak as _ref  # weak where the object allows it (see _BoundCache)

if TYPE_CHECKING:
    from ._distributed import DataParallel

__all__ = ["EpochInfo", "History", "StepInfo", "TrainResult", "train", "train_step"]


class StepInfo(NamedTuple):
    """What a :func:`train` callback receives after every step.

    ``epoch`` counts from 0, ``step`` is the global step number counting from 1 (the
    optimiser's ``state.step``), ``loss`` the step's loss as a Python float (computed
    once, before the update), ``model`` and ``state`` the values after the update.
    """

    epoch: int
    step: int
    loss: float
    model: Any
    state: optim.OptState


class EpochInfo(NamedTuple):
    """What a callback's ``on_epoch_end`` receives after every complete epoch.

    ``epoch`` counts from 0 (as :attr:`StepInfo.epoch`), ``step`` is the global step
    number at the end of the epoch, ``loss`` the mean of the epoch's step losses (NaN
    for an epoch without batches), ``metrics`` a dict of everything recorded for the
    epoch: ``"loss"`` and the validation metrics (``"val_loss"``, ``"val_<name>"``);
    ``model`` and ``state`` the values at the end of the epoch.
    """

    epoch: int
    step: int
    loss: float
    metrics: dict
    model: Any
    state: optim.OptState


class History:
    """The losses and metrics of one :func:`train` run (Keras's ``History``).

    Attributes:
        losses: every step's loss, a list of Python floats in step order (the loss
            before that step's update, as :attr:`StepInfo.loss`).
        steps: the global step number of each entry of ``losses`` (``state.step``
            after it: a resumed run starts where the state left off).
        epochs: the epochs completed, counting from 0.
        metrics: per-epoch values, one list per name, aligned with ``epochs``:
            ``"loss"`` (the mean of the epoch's step losses) and, with ``validation=``,
            ``"val_loss"`` or ``"val_<name>"`` (Keras's ``history.history``).

    An epoch cut short by a callback stopping training has its step losses recorded but
    no epoch entry.
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.epochs: list[int] = []
        self.metrics: dict[str, list[float]] = {}

    def __repr__(self) -> str:
        last = ", ".join(f"{k}={v[-1]:.4g}" for k, v in self.metrics.items() if v)
        return (f"History({len(self.losses)} steps, {len(self.epochs)} epochs"
                + (f"; last epoch: {last}" if last else "") + ")")

    def _record_step(self, step: int, loss: float) -> None:
        self.losses.append(loss)
        self.steps.append(step)

    def _record_epoch(self, epoch: int, metrics: dict[str, float]) -> None:
        n = len(self.epochs)
        for name, value in metrics.items():
            # a metric first seen now (a validation callable returning a new name) gets NaN before
            self.metrics.setdefault(name, [math.nan] * n).append(value)
        for values in self.metrics.values():
            if len(values) == n:  # a metric missing this epoch
                values.append(math.nan)
        self.epochs.append(epoch)


class _StateAndModel(NamedTuple):
    state: optim.OptState
    model: Any


class TrainResult(_StateAndModel):
    """What :func:`train` returns: the pair ``(state, model)``, with the run's :class:`History`.

    A named 2-tuple, so ``state, model = ad.train(...)`` works as it always did; the
    history is its attribute: ``run = ad.train(...)``, then ``run.history``,
    ``run.state``, ``run.model``.
    """

    history: History

    def __new__(cls, state: optim.OptState, model: Any, history: History | None = None) -> TrainResult:
        self = super().__new__(cls, state, model)
        self.history = History() if history is None else history
        return self


def _ar() -> Any:
    import autoray

    return autoray


def _inner(b: Backend) -> Backend:
    return getattr(b, "inner", b)


def _convert_tree(b: Backend, tree: Any) -> Any:
    """Numpy (or other foreign) array leaves as ``b``'s native arrays; everything else as is.
    ``tree`` itself where no leaf needs converting."""
    leaves, treedef = pytree.tree_flatten(tree)
    if not any(is_array(a) and not b.is_native(a) for a in leaves):
        return tree
    return treedef.unflatten([b.convert(a) if is_array(a) and not b.is_native(a) else a for a in leaves])


class _Bound:
    """``loss_fn(model, *batch)`` as ``f(*batch)``: the batch goes in as data, not in a closure.

    Holds ``loss_fn`` and ``model`` weakly where they allow it: the caller of
    :func:`train_step` holds them while it runs.
    """

    __slots__ = ("_loss_fn", "_model", "__weakref__")

    def __init__(self, loss_fn: Callable[..., Any], model: Any):
        self._loss_fn, self._model = _ref(loss_fn), _ref(model)

    @property
    def __abstractdiff_wrapped__(self) -> Any:
        """The user's loss: what a tracing backend fingerprints (see abstractdiff._captures)."""
        return self._loss_fn()

    def __call__(self, *batch: Any) -> Any:
        loss_fn, model = self._loss_fn(), self._model()
        if loss_fn is None or model is None:
            raise CollectedError("the loss function or the model being trained was garbage collected")
        return loss_fn(model, *batch)


class _BoundCache:
    """The same ``_Bound`` for the same ``(loss_fn, model)`` on every step of a loop, so that
    compiling inner backends (jax ``jit``, ``tf.function``) keep their trace, also when a
    few models alternate (a GAN's generator and discriminator).

    At most :attr:`size` pairs, least recently used out first; an entry goes when its
    ``loss_fn`` or model is garbage collected.  An object that cannot be weakly
    referenced (a dict of ``ad.Variable``) is held by its entry until it is pushed out.
    """

    size = 8

    def __init__(self) -> None:
        self._entries: WeakLRU[_Bound] = WeakLRU(
            self.size, name="bound losses", keyed_on="loss function and model (held weakly)",
            hold_unreferenceable=True,
        )

    def get(self, loss_fn: Callable[..., Any], model: Any) -> _Bound:
        return self._entries.get_or_put((loss_fn, model), lambda: _Bound(loss_fn, model))

    def __len__(self) -> int:
        return len(self._entries)


_BOUND = _BoundCache()


def _as_batch(batch: Any) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _all_finite(loss: Any, grads: list) -> bool:
    """One synchronisation: ``a * 0`` is 0 where ``a`` is finite and NaN elsewhere, and a
    sum of zeros cannot overflow (unlike a sum of the values themselves)."""
    ar = _ar()
    arrays = [loss, *(g for g in grads if g is not None)]
    # numpy's own overflow/invalid warnings are the point of this check, not news: quiet
    # them here (np.errstate is local to this block)
    with optim.arithmetic_scope(arrays), np.errstate(over="ignore", invalid="ignore"):
        # one total per dtype: tensorflow does not add float32 to float64
        totals: dict[str, Any] = {}
        for a in arrays:
            name = ar.get_dtype_name(a)
            part = ar.do("sum", a * 0)
            totals[name] = part if name not in totals else totals[name] + part
        return all(float(to_numpy(t)) == 0.0 for t in totals.values())


def _finite_check(
    step: int, state: optim.OptState, model: Any, loss: Any, grads: list, holding: str
) -> Callable[[list], None]:
    """The check the update runs on the new parameters, before it returns or assigns them:
    loss, gradients and updated parameters finite, in one synchronisation."""

    def check(new_values: list) -> None:
        if not _all_finite(loss, [*grads, *new_values]):
            raise _non_finite(step, state, model, holding)

    return check


def _non_finite(step: int, state: optim.OptState, model: Any, holding: str) -> NonFiniteError:
    return NonFiniteError(
        f"step {step}: the loss, a gradient or an updated parameter is not finite (NaN or inf); nothing "
        f"was applied, {holding} after step {step - 1}. Lower the learning rate, add optim.ClipNorm, "
        f"or check the data of this batch",
        state=state,
        model=model,
        step=step,
    )


def _broadcast_variables(dp: DataParallel, variables: list[Any]) -> None:
    """Rank 0's values written into ``variables`` on every process (one collective per dtype)."""
    for v, value in zip(variables, dp.broadcast([optim.read(v) for v in variables])):
        optim.write(v, value)


def _distributed_start(dp: DataParallel, model: Any, implicit: bool, n_rows: Any) -> Any:
    """Before the first step: the processes agree on the model and batch, and take rank 0's
    parameters (written into the variables in implicit mode, buffers and frozen ones too)."""
    from ._distributed import describe

    if implicit:
        params = list(optim.params_of(model))
        variables = params + untrained_state(model, params)
        dp.check_same("the model (structure, shapes, dtypes) and the batch size",
                      [describe([optim.read(v) for v in variables]), n_rows])
        _broadcast_variables(dp, variables)
        return model
    dp.check_same("the model (structure, shapes, dtypes) and the batch size", [describe(model), n_rows])
    leaves, treedef = pytree.tree_flatten(model)
    arrays = iter(dp.broadcast([a for a in leaves if is_array(a)]))
    return pytree.tree_unflatten(treedef, [next(arrays) if is_array(a) else a for a in leaves])


def _check_distributed(dp: Any) -> None:
    from ._distributed import DataParallel

    if not isinstance(dp, DataParallel):
        raise ArgumentTypeError(f"distributed must be an ad.DataParallel(...) or None, got {type(dp).__name__}")


def train_step(
    loss_fn: Callable[..., Any],
    model: Any,
    batch: Any,
    state: optim.OptState,
    *,
    backend: Backend | str,
    distributed: DataParallel | None = None,
) -> tuple[optim.OptState, Any, Any]:
    """One optimisation step: ``train_step(loss_fn, model, batch, state, backend=b) -> (state, model, loss)``.

    ``loss_fn(model, *batch)`` returns a scalar.  With an explicit backend, ``model`` is
    a pytree of arrays (numpy leaves are converted to the backend's arrays), the
    gradient is taken with respect to it, and new arrays are returned.  With
    ``ad.Implicit(b)``, ``model`` holds variables (an ``nn.Module``, a Keras model,
    ``ad.variables(...)``), which are updated in place; the same ``model`` is returned.
    ``loss`` is the loss before the update, a native scalar.

    Raises:
        NonFiniteError: the loss or a gradient is NaN or infinite; nothing was applied,
            and the error carries the last good ``state`` and ``model`` and the step number.
        ModeMismatchError: variables passed to an explicit backend, or the reverse.
        DistributedError: see :class:`~abstractdiff.DataParallel`.

    ``distributed=ad.DataParallel()`` (in every process of a ``torchrun`` launch): each
    process takes its block of the batch's rows, the loss and gradients are averaged
    across processes before the update, and before the first step (``state.step == 0``)
    rank 0's parameters are broadcast.  In implicit mode the model's other variables
    (buffers such as BatchNorm's running statistics, frozen parameters) are broadcast from
    rank 0 before the first step and after every step, as torch's DDP broadcasts buffers,
    so every process ends each step with identical models; see :class:`~abstractdiff.DataParallel`.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> from abstractdiff import optim
        >>> loss = lambda m, x: ((m["w"] - x) ** 2).sum()
        >>> model = {"w": np.zeros(2)}
        >>> state = optim.setup(optim.Descent(0.25), model)
        >>> state, model, value = ad.train_step(loss, model, (np.ones(2),), state, backend="finite_differences")
        >>> float(value), np.round(model["w"], 6)
        (2.0, array([0.5, 0.5]))
    """
    return _train_step(loss_fn, model, batch, state, backend, distributed, None)



#: ``commit(state, model)``: the new pair handed over inside the step's assignment block
_Commit = Callable[[optim.OptState, Any], None]


def _train_step(loss_fn: Callable[..., Any], model: Any, batch: Any, state: optim.OptState, backend: Backend | str,
                distributed: DataParallel | None, commit: _Commit | None) -> tuple[optim.OptState, Any, Any]:
    """:func:`train_step`; in implicit mode, ``commit(state, model)`` receives the new pair in
    the block that assigns it, interrupts held off (``ad.train``'s loop: a ``KeyboardInterrupt``
    right after the step then finds the loop holding the pair the model matches)."""
    b = backend if isinstance(backend, Backend) else _get_backend(backend)
    if not isinstance(state, optim.OptState):
        raise ArgumentTypeError(
            f"train_step: state must be the OptState from optim.setup(rule, model), got {type(state).__name__}"
        )
    batch = _as_batch(batch)
    step = state.step + 1
    share = 1.0
    if distributed is not None:
        _check_distributed(distributed)
        batch, share, n_rows = distributed.shard(batch)
        # every rank at the same step, batch size and model, every verify_every steps (issue 46)
        distributed.verify_step(step, n_rows, model)
    if b.implicit:
        if not state.implicit:
            raise ModeMismatchError(
                f"train_step: {b!r} trains variables in place, but the state was set up for a pytree "
                f"of arrays; pass a model holding variables (an nn.Module, a Keras model, "
                f"ad.variables(...)) to optim.setup and train_step, or use the explicit backend {_inner(b)!r}"
            )
        if distributed is not None and state.step == 0:
            model = _distributed_start(distributed, model, True, n_rows)
        holding = "the variables hold the values"
        if distributed is None:  # the whole step as one compiled call, where the library compiles it
            done = compiled_train_step(b, loss_fn, model, batch, state,
                                       lambda: _non_finite(step, state, model, holding), _BOUND.get(loss_fn, model),
                                       commit)
            if done is not None:
                return done
        return _implicit_step(b, loss_fn, model, batch, state, distributed, share, step, holding, commit)
    holding = "the error's .model and .state are the values"
    given = model
    if distributed is None and not state.implicit:  # the whole step as one compiled call, where it compiles
        # (a model with numpy leaves or variables does not: the checks and conversions below)
        done = compiled_train_step(b, loss_fn, model, batch, state, lambda: _non_finite(step, state, model, holding))
        if done is not None:
            return done
    if state.implicit or optim.holds_variables(model):
        raise ModeMismatchError(
            f"train_step: the model holds variables (an nn.Module, a Keras model or ad.variables) "
            f"but {b!r} is explicit; use ad.Implicit({b.name!r}) to train variables in place, or "
            f"pass a pytree of arrays as the model and set the state up for it"
        )
    model, tree = _convert_tree(b, model), _convert_tree(b, state.tree)
    converted = model is not given or tree is not state.tree
    state = state._replace(tree=tree)
    if distributed is not None and state.step == 0:
        model = _distributed_start(distributed, model, False, n_rows)
    if distributed is None and converted:  # the form may compile now that its leaves are native
        done = compiled_train_step(b, loss_fn, model, batch, state, lambda: _non_finite(step, state, model, holding))
        if done is not None:
            return done
    loss, grads = b.value_and_gradient(loss_fn, model, *batch)
    if distributed is not None:
        g_leaves, g_def = pytree.tree_flatten(grads, none_is_leaf=True)
        loss, g_leaves = distributed.average(loss, g_leaves, share)
        grads = pytree.tree_unflatten(g_def, g_leaves)
    check = _finite_check(step, state, model, loss, pytree.tree_leaves(grads), holding)
    state, model = optim._apply(state, model, grads, check)
    return state, model, loss

def _implicit_step(b: Backend, loss_fn: Callable[..., Any], model: Any, batch: tuple, state: optim.OptState,
                   distributed: DataParallel | None, share: float, step: int, holding: str,
                   commit: _Commit | None) -> tuple[optim.OptState, Any, Any]:
    """The op-by-op implicit step, all or nothing.

    The forward pass writes the model's other variables (BatchNorm's running statistics,
    Keras's non-trainable variables) before anything can be checked, so they are copied
    first (small: the parameters are not) and written back if the step raises, whatever
    it raises (``NonFiniteError``, the loss's own exception, ``KeyboardInterrupt``).  The
    parameters are assigned in one block that undoes itself (``optim._apply``'s commit);
    an exception after that block, before the new state is handed over, undoes it too."""
    params = optim.params_of(model)
    others = untrained_state(model, list(params))
    kept = snapshot(others)
    handed: list[bool] = []
    undo: list[Callable[[], None]] = []  # the assignment's undo, until the new pair is handed over

    def on_commit(new_state: optim.OptState, undo_assignment: Callable[[], None]) -> None:
        undo.append(undo_assignment)
        if commit is not None and distributed is None:
            commit(new_state, model)
            handed.append(True)

    try:
        loss, grads = b.value_and_gradient(_BOUND.get(loss_fn, model), params, *batch)
        if distributed is not None:
            from .core import Grads

            loss, values = distributed.average(loss, [grads[p] for p in params], share)
            grads = Grads(params, values)
        check = _finite_check(step, state, model, loss, [grads[p] for p in params], holding)
        new_state, model = optim._apply(state, model, grads, check, on_commit)
        if distributed is not None:
            # each process's forward pass updated its own buffers (BatchNorm's running
            # statistics) from its own rows: rank 0's win, as in torch's DDP
            _broadcast_variables(distributed, others)
            if commit is not None:  # handed over whole: an interrupt between the two would undo a handed pair
                with HeldInterrupts() as held:
                    commit(new_state, model)
                    handed.append(True)
                held.deliver()
    except BaseException:
        if not handed:  # the caller still holds the old pair: the model goes back to it
            with HeldInterrupts() as held:
                for u in undo:
                    u()
                restore(others, kept)
            held.deliver()
        raise
    return new_state, model, loss


class _Progress:
    """A tqdm bar with the running loss if tqdm is installed, else one stderr line per epoch.

    Epochs are numbered from 0, as in :class:`StepInfo` and the history; the line also
    says how many of the run's epochs are done (``epoch 0 (1/3): ...``).
    """

    def __init__(self, enabled: bool, total: int | None, epochs: int):
        self.enabled, self.epochs, self.bar = enabled, epochs, None
        self.running: float | None = None
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, desc="train", unit="step", leave=True)

    def step(self, epoch: int, loss: float) -> None:
        # An exponential moving average: a readable trend rather than one batch's noise.
        self.running = loss if self.running is None else 0.9 * self.running + 0.1 * loss
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(epoch=epoch, loss=f"{self.running:.4g}", refresh=False)

    def end_epoch(self, epoch: int, steps: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        shown = {k: f"{v:.4g}" for k, v in metrics.items() if k != "loss"}
        if self.bar is not None:
            running = "nan" if self.running is None else f"{self.running:.4g}"
            self.bar.set_postfix(epoch=epoch, loss=running, **shown)
            return
        parts = [f"loss {metrics['loss']:.4g}", *(f"{k} {v}" for k, v in shown.items())]
        print(f"epoch {epoch} ({epoch + 1}/{self.epochs}): step {steps}, {', '.join(parts)}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------ validation
def _metric(value: Any, what: str) -> float:
    """A validation value as a Python float; anything but a real number is an error."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, np.generic) or is_array(value):
        a = np.asarray(to_numpy(value))
        if a.size == 1 and a.dtype.kind in "fiu":
            return float(a.reshape(()))
    raise ArgumentTypeError(
        f"train: {what} is {value!r:.80}, not a number; the validation function returns a number (the "
        f"validation loss) or a dict of numbers"
    )


def _widest_float(params: Any) -> str | None:
    """The widest float dtype of the variables: the dtype float data is cast to (as the
    adapters do for training batches, so float64 numpy data meets a float32 model)."""
    names = {_ar().get_dtype_name(optim.read(p)) for p in params}
    floats = [np.dtype(n) for n in names if n in ("float16", "float32", "float64")]
    return np.result_type(*floats).name if floats else None


class _Validation:
    """``train``'s ``validation`` argument, checked before any step, as ``metrics(model)``.

    ``None``: nothing.  A function ``validation(model)``, called in ``ad.scope`` of the
    model's arrays: its number is ``"val_loss"``, each key of its dict ``"val_<key>"``.
    Otherwise batches as ``data`` (a single tuple of arrays is one batch, Keras's
    ``validation_data=(x, y)``): ``"val_loss"`` is the mean of ``loss_fn(model, *batch)``
    over them, computed as training computes the loss but without gradients; a model
    holding variables gets its other variables (BatchNorm's running statistics) back as
    they were, so validating does not change it.
    """

    def __init__(self, validation: Any, loss_fn: Callable[..., Any], b: Backend):
        self.loss_fn, self.backend, self.fn, self.batches = loss_fn, b, None, None
        if validation is None:
            return
        if callable(validation):
            self.fn = validation
            return
        if isinstance(validation, (str, bytes)) or is_array(validation) or not hasattr(validation, "__iter__"):
            raise ArgumentTypeError(
                f"train: validation must be a function validation(model) returning a number or a dict of "
                f"numbers, or validation batches like data (a list of tuples of arrays, or one tuple "
                f"(x, y)), got {type(validation).__name__}"
            )
        validation = _batches(validation, "validation")  # the forms data takes
        if iter(validation) is validation:
            raise ArgumentTypeError(
                "train: validation is a one-shot iterator (e.g. a generator), which would be empty after the "
                "first epoch; pass a list of batches or another re-iterable collection"
            )
        if hasattr(validation, "__len__") and len(validation) == 0:
            raise InvalidArgumentError("train: validation holds no batches; pass None for no validation")
        self.batches = validation

    def __call__(self, model: Any) -> dict[str, float]:
        if self.fn is not None:
            return self._from_function(model)
        if self.batches is None:
            return {}
        if not self.backend.implicit:
            return {"val_loss": self._mean_loss(model, model, _inner(self.backend), None)}
        params = optim.params_of(model)
        others = untrained_state(model, params)
        kept = [np.array(to_numpy(optim.read(v)), copy=True) for v in others]  # a copy: torch shares memory
        try:
            values = [optim.read(p) for p in params]
            return {"val_loss": self._mean_loss(model, values, _inner(self.backend), _widest_float(params))}
        finally:
            from ._checkpoint import _to_like

            restored = [_to_like(a, optim.read(v)) for v, a in zip(others, kept)]
            for v, value in zip(others, restored):
                optim.write(v, value)

    def _mean_loss(self, model: Any, values: Any, b: Backend, dtype: str | None) -> float:
        """The mean loss over the batches; ``values`` are the model's arrays, whose
        precision :func:`~abstractdiff.scope` keeps (jax float64 without x64 mode)."""

        def native(a: Any) -> Any:
            if not is_array(a) or b.is_native(a):
                return a
            floating = dtype is not None and np.asarray(a).dtype.kind == "f"
            return b.convert(a, dtype) if floating else b.convert(a)

        total, n = 0.0, 0
        for batch in self.batches:
            args = pytree.tree_map(native, _as_batch(batch))
            with scope(values, args):
                value = self.loss_fn(model, *args)
            total += _metric(value, "the loss of a validation batch")
            n += 1
        if n == 0:
            raise InvalidArgumentError("train: the validation data yielded no batches")
        return total / n

    def _from_function(self, model: Any) -> dict[str, float]:
        values = [optim.read(p) for p in optim.params_of(model)] if self.backend.implicit else model
        with scope(values):  # jax float64 stays float64 in the user's arithmetic too
            out = self.fn(model)
        if not isinstance(out, dict):
            return {"val_loss": _metric(out, "what the validation function returned")}
        metrics = {}
        for key, value in out.items():
            if not isinstance(key, str):
                raise ArgumentTypeError(f"train: the validation function returned a dict with the key {key!r}; "
                                        f"metric names are strings")
            metrics[f"val_{key}"] = _metric(value, f"the validation metric {key!r}")
        return metrics


# ------------------------------------------------------------------ the loop
def _batches(data: Any, what: str) -> Any:
    """``data`` or ``validation`` as an iterable of batches: the same forms for both.  A
    tuple of arrays is one batch ``(x, y)`` (Keras's ``validation_data=(x, y)``): iterating
    it would hand the loss one array per batch."""
    if data is None or isinstance(data, (str, bytes)) or is_array(data) or not hasattr(data, "__iter__"):
        raise ArgumentTypeError(
            f"train: {what} must be batches: a list of tuples of arrays [(x, y), ...], a re-iterable dataset, "
            f"or one tuple (x, y) for a single batch; got {type(data).__name__}"
        )
    if isinstance(data, tuple) and data and all(is_array(a) for a in data):
        return [data]  # one batch (x, y)
    if isinstance(data, list) and data and all(is_array(a) for a in data):
        # [x, y] is ambiguous (one batch, or batches of one array each): refused, not guessed
        raise ArgumentTypeError(
            f"train: {what} is a list of {len(data)} arrays, which would be {len(data)} batches of one array "
            f"each; pass one batch as a tuple (x, y), or batches as a list of tuples [(x, y), ...]"
        )
    return data


def _check_data(epochs: Any, data: Any) -> Any:
    """``data`` as batches (see :func:`_batches`), checked against ``epochs``."""
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise InvalidArgumentError(f"train: epochs must be an int >= 0, got {epochs!r}")
    data = _batches(data, "data")
    if epochs > 1 and iter(data) is data:
        raise ArgumentTypeError(
            "train: data is a one-shot iterator (e.g. a generator), which would be empty after the "
            "first epoch; pass a list of batches or another re-iterable collection, or call train "
            "once per epoch"
        )
    return data


def _stops(results: list[Any]) -> bool:
    return any(r is False for r in results)


class _Loop:
    """One run of :func:`train`: what stays the same from step to step."""

    def __init__(self, loss_fn: Callable[..., Any], b: Backend, distributed: DataParallel | None,
                 hooks: list[Callback], validation: _Validation, bar: _Progress):
        self.loss_fn, self.backend, self.distributed = loss_fn, b, distributed
        self.hooks, self.validation, self.bar = hooks, validation, bar
        self.history = History()
        # the last consistent pair: what train hands back with any exception it propagates
        self.state: optim.OptState | None = None
        self.model: Any = None

    def _commit(self, state: optim.OptState, model: Any) -> None:
        self.state, self.model = state, model

    def epoch(self, epoch: int, data: Iterable[Any], state: optim.OptState, model: Any) -> tuple:
        """Every step of one epoch: ``(state, model, mean loss, stopped)``."""
        total, n = 0.0, 0
        for batch in data:
            # implicit mode: the pair is also committed inside the step's assignment block
            # (an interrupt right after the step finds self holding the pair the variables match)
            state, model, loss = _train_step(self.loss_fn, model, batch, state, self.backend, self.distributed,
                                             self._commit)
            self.state, self.model = state, model
            value = float(to_numpy(loss))
            total, n = total + value, n + 1
            self.history._record_step(state.step, value)
            self.bar.step(epoch, value)
            info = StepInfo(epoch, state.step, value, model, state)
            if _stops([cb.on_step_end(info) for cb in self.hooks]):
                return state, model, total / n, True
        return state, model, (total / n if n else math.nan), False

    def end_epoch(self, epoch: int, mean: float, state: optim.OptState, model: Any) -> bool:
        """Validation, the history, the progress line and the epoch-end callbacks; whether to stop."""
        metrics = {"loss": mean, **self.validation(model)}
        self.history._record_epoch(epoch, metrics)
        self.bar.end_epoch(epoch, state.step, metrics)
        info = EpochInfo(epoch, state.step, mean, dict(metrics), model, state)
        return _stops([cb.on_epoch_end(info) for cb in self.hooks])

    def end(self, state: optim.OptState, model: Any) -> tuple[optim.OptState, Any]:
        for cb in self.hooks:
            replaced = cb.on_train_end(state, model)
            if replaced is None:
                continue
            if not (isinstance(replaced, tuple) and len(replaced) == 2 and isinstance(replaced[0], optim.OptState)):
                raise ArgumentTypeError(
                    f"train: {cb!r}.on_train_end returned a {type(replaced).__name__}; it returns None or a "
                    f"replacement pair (state, model)"
                )
            state, model = replaced
        return state, model


def train(
    loss_fn: Callable[..., Any],
    model: Any,
    data: Iterable[Any],
    state: optim.OptState,
    *,
    backend: Backend | str,
    epochs: int = 1,
    callbacks: Iterable[Callable[[StepInfo], Any] | Callback] = (),
    validation: Any = None,
    progress: bool = True,
    distributed: DataParallel | None = None,
) -> TrainResult:
    """Train for ``epochs`` passes over ``data``: ``train(loss_fn, model, data, state, backend=b) -> (state, model)``.

    A thin loop over :func:`train_step`.  ``data`` is an iterable of batches, each a
    tuple of arrays passed as ``loss_fn(model, *batch)``; it must be re-iterable (a
    list, a dataset, not a generator) when ``epochs > 1``.

    The result is a :class:`TrainResult`: the pair ``(state, model)`` (so ``state, model
    = train(...)``), whose ``.history`` is the run's :class:`History`: every step's loss,
    and per epoch the mean loss and the validation metrics.

    ``callbacks``: a list of plain functions ``callback(info)``, called after every step
    with a :class:`StepInfo` (epoch, step, loss, model, state), and of
    :class:`~abstractdiff.callbacks.Callback` objects, which also hear of the start and
    end of training and of every epoch's end with an :class:`EpochInfo`
    (:class:`~abstractdiff.callbacks.EarlyStopping`, :class:`~abstractdiff.callbacks.Checkpoint`).
    A callback returning ``False`` (not just a falsy value) stops training after that
    step or epoch, once every callback has seen it.

    ``validation``, evaluated at the end of every epoch, before the epoch-end callbacks:
    batches like ``data`` (or one tuple ``(x, y)``), whose mean ``loss_fn`` value is
    ``"val_loss"``; or a function ``validation(model)`` returning a number
    (``"val_loss"``) or a dict of numbers (each key ``k`` recorded as ``"val_k"``).

    ``progress=True`` shows a tqdm bar with the running loss when tqdm is installed,
    else a line per epoch on stderr (``epoch 0 (1/3): step 4, loss 0.25, val_loss
    0.3``); epochs count from 0, as in :class:`StepInfo`.  ``progress=False`` prints nothing.

    ``distributed=ad.DataParallel()`` trains data-parallel over the processes of a
    ``torchrun`` launch (see :func:`train_step`); every process runs the same loop,
    validation and callbacks (so that a decision to stop is the same everywhere), only
    rank 0 shows progress, and :class:`~abstractdiff.callbacks.Checkpoint` writes on rank 0 only.

    Raises:
        NonFiniteError: see :func:`train_step`; ``err.model``/``err.state`` hold
            everything learned before the failing step, ``err.history`` the history so far.
        ArgumentTypeError: a callback that is neither a function nor a ``Callback``
            instance, a ``validation`` that is neither a function nor batches.
        DistributedError: see :class:`~abstractdiff.DataParallel`.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> from abstractdiff import optim
        >>> loss = lambda m, x: ((m["w"] - x) ** 2).sum()
        >>> data = [(np.array([1.0, -1.0]),)] * 20
        >>> state = optim.setup(optim.Momentum(lr=0.1, rho=0.5), {"w": np.zeros(2)})
        >>> losses = []
        >>> state, model = ad.train(loss, {"w": np.zeros(2)}, data, state, backend="finite_differences",
        ...                         callbacks=[lambda info: losses.append(info.loss)], progress=False)
        >>> state.step, len(losses), np.round(model["w"], 3)
        (20, 20, array([ 1., -1.]))
    """
    data = _check_data(epochs, data)
    hooks = as_callbacks(callbacks)
    b = backend if isinstance(backend, Backend) else _get_backend(backend)
    checked = _Validation(validation, loss_fn, b)
    if distributed is not None:
        _check_distributed(distributed)
        progress = progress and distributed.is_main
    try:
        total = len(data) * epochs  # type: ignore[arg-type]
    except TypeError:
        total = None
    bar = _Progress(progress, total, epochs)
    loop = _Loop(loss_fn, b, distributed, hooks, checked, bar)
    loop.state, loop.model = state, model
    try:
        for cb in hooks:
            cb.on_train_begin(state, model, distributed)
        for epoch in range(epochs):
            state, model, mean, stopped = loop.epoch(epoch, data, state, model)
            if stopped or loop.end_epoch(epoch, mean, state, model):
                break
        state, model = loop.end(state, model)
    except BaseException as err:
        # whatever stops the run (NonFiniteError, the loss's or a callback's exception,
        # KeyboardInterrupt) carries the last consistent pair: every completed step is kept,
        # and the variables of an implicit model match err.state (see _train_step's commit)
        _attach(err, loop)
        raise
    finally:
        bar.close()
    return TrainResult(state, model, loop.history)


def _attach(err: BaseException, loop: _Loop) -> None:
    """``err.state``, ``err.model``, ``err.history``: the run's last consistent pair and its
    history (an exception that takes no attributes is left as it is)."""
    try:
        err.state, err.model, err.history = loop.state, loop.model, loop.history  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        pass

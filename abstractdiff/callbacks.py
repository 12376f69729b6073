"""Callbacks of :func:`abstractdiff.train`: the hooks a Keras or Lightning user expects.

A callback is a plain function ``callback(info)``, called after every step with a
:class:`~abstractdiff.StepInfo`, or an instance of :class:`Callback`, whose methods run at
the start and end of training, after every step and at the end of every epoch (with an
:class:`~abstractdiff.EpochInfo` holding the epoch's mean loss and validation metrics).
Returning ``False`` from ``on_step_end`` or ``on_epoch_end`` stops training.

Two ship here: :class:`EarlyStopping` (stop when a metric stops improving, optionally
going back to the best epoch's weights) and :class:`Checkpoint` (``ad.save_checkpoint``
every ``N`` epochs or steps).

Epochs count from 0 everywhere: in ``StepInfo.epoch``, ``EpochInfo.epoch``, the history,
the progress line and a checkpoint's ``{epoch}`` file-name field.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from .core import ArgumentTypeError, InvalidArgumentError

if TYPE_CHECKING:
    from . import optim
    from ._distributed import DataParallel
    from ._train import EpochInfo, StepInfo

__all__ = ["Callback", "Checkpoint", "EarlyStopping"]


class Callback:
    """Base class of callbacks with more than a per-step hook; override what you need.

    ``train`` calls, in the order the callbacks are listed:

    - ``on_train_begin(state, model, distributed)`` once, before the first step;
    - ``on_step_end(info)`` after every step, with a :class:`~abstractdiff.StepInfo`;
    - ``on_epoch_end(info)`` after every complete epoch, with an
      :class:`~abstractdiff.EpochInfo` (the validation metrics are already in it);
    - ``on_train_end(state, model)`` once when training ends normally (all epochs done,
      or a callback stopped it; not when an error is raised).  It may return a
      replacement ``(state, model)`` pair, which ``train`` then returns (what
      ``EarlyStopping(restore_best=True)`` does).

    ``on_step_end`` or ``on_epoch_end`` returning ``False`` (not just a falsy value) stops
    training once every callback has seen that step or epoch.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> from abstractdiff import optim
        >>> class PrintEpochs(ad.Callback):
        ...     def on_epoch_end(self, info):
        ...         print(info.epoch, info.step, round(info.loss, 3))
        >>> loss = lambda m, x: ((m["w"] - x) ** 2).sum()
        >>> state = optim.setup(optim.Descent(0.25), {"w": np.zeros(1)})
        >>> _ = ad.train(loss, {"w": np.zeros(1)}, [(np.ones(1),)] * 2, state, backend="finite_differences",
        ...              epochs=2, callbacks=[PrintEpochs()], progress=False)
        0 2 0.625
        1 4 0.039
    """

    def on_train_begin(self, state: optim.OptState, model: Any, distributed: DataParallel | None) -> None:
        """Before the first step; ``distributed`` is ``train``'s argument."""

    def on_step_end(self, info: StepInfo) -> bool | None:
        """After every step; ``False`` stops training."""
        return None

    def on_epoch_end(self, info: EpochInfo) -> bool | None:
        """After every complete epoch; ``False`` stops training."""
        return None

    def on_train_end(self, state: optim.OptState, model: Any) -> tuple[optim.OptState, Any] | None:
        """When training ends without an error; may return a replacement ``(state, model)``."""
        return None


class _StepFunction(Callback):
    """A plain function given as a callback: called after every step, as it always was."""

    def __init__(self, fn: Any):
        self.fn = fn

    def on_step_end(self, info: StepInfo) -> bool | None:
        return self.fn(info)

    def __repr__(self) -> str:
        return f"step callback {getattr(self.fn, '__qualname__', self.fn)!r}"


def as_callbacks(callbacks: Any) -> list[Callback]:
    """``train``'s ``callbacks`` argument as :class:`Callback` objects, checked before any step."""
    if isinstance(callbacks, Callback) or callable(callbacks) or isinstance(callbacks, (str, bytes)):
        raise ArgumentTypeError(
            f"train: callbacks must be a list of callbacks, got {type(callbacks).__name__}; "
            f"write callbacks=[{_name(callbacks)}]"
        )
    try:
        given = list(callbacks)
    except TypeError:
        raise ArgumentTypeError(
            f"train: callbacks must be a list of callbacks, got {type(callbacks).__name__}"
        ) from None
    found: list[Callback] = []
    for i, cb in enumerate(given):
        if isinstance(cb, type) and issubclass(cb, Callback):
            raise ArgumentTypeError(
                f"train: callbacks[{i}] is the class {cb.__name__}, not an instance; write {cb.__name__}(...)"
            )
        if isinstance(cb, Callback):
            found.append(cb)
        elif callable(cb):
            found.append(_StepFunction(cb))
        else:
            raise ArgumentTypeError(
                f"train: callbacks[{i}] is a {type(cb).__name__}, not a callback: pass a function "
                f"callback(info) called after every step, or an instance of an ad.Callback subclass"
            )
    return found


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", None) or f"{type(obj).__name__}(...)"


# ------------------------------------------------------------------ EarlyStopping
def _host_copy(value: Any) -> np.ndarray:
    """An independent numpy copy (``to_numpy`` of a CPU torch tensor shares its memory)."""
    from .core import to_numpy

    return np.array(to_numpy(value), copy=True)


class EarlyStopping(Callback):
    """Stop training when ``monitor`` has not improved for ``patience`` epochs.

    ``EarlyStopping(monitor="val_loss", patience=0, min_delta=0.0, mode="min",
    restore_best=False)``, with Keras's meaning: at the end of every epoch the metric
    ``monitor`` (a key of :attr:`EpochInfo.metrics <abstractdiff.EpochInfo>`: ``"loss"``,
    the epoch's mean training loss, or a validation metric such as ``"val_loss"``) is
    compared with the best so far.  It improved if it is lower than the best by more than
    ``min_delta`` (higher, with ``mode="max"``); a NaN never improves.  Training stops at
    the end of the ``patience``-th epoch in a row without improvement (``patience=0``
    stops at the first, as ``patience=1`` does; Keras's convention).

    ``restore_best=True``: when training ends (stopped early or not), the ``(state,
    model)`` of the end of the best epoch is what ``train`` returns.  An explicit model
    (a pytree of arrays) is immutable, so the best one is kept by reference, for free;
    a model holding variables (an ``nn.Module``, a Keras model, ``ad.variables``) is
    updated in place, so the values of all its variables (buffers such as BatchNorm's
    running statistics included) are copied to host memory at each improvement and
    written back into the same variables at the end, exactly.  The returned state is the
    best epoch's (its moments and step counter), so the pair resumes consistently.

    After training, :attr:`best` is the best value, :attr:`best_epoch` its epoch (from 0)
    and :attr:`stopped_epoch` the epoch it stopped at (``None`` if it did not stop).

    Raises:
        InvalidArgumentError: a bad ``patience``, ``min_delta``, ``mode`` or ``monitor``;
            at the end of the first epoch, a ``monitor`` that is not recorded (the message
            lists the recorded names: ``"val_*"`` needs ``validation=`` in ``train``).
    """

    def __init__(
        self, monitor: str = "val_loss", *, patience: int = 0, min_delta: float = 0.0, mode: str = "min",
        restore_best: bool = False,
    ):
        if not isinstance(monitor, str) or not monitor:
            raise InvalidArgumentError(f"EarlyStopping: monitor must be a metric name such as 'val_loss', "
                                       f"got {monitor!r}")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise InvalidArgumentError(f"EarlyStopping: patience must be an int >= 0 (epochs without "
                                       f"improvement to wait), got {patience!r}")
        if not isinstance(min_delta, (int, float)) or isinstance(min_delta, bool) or not (
                math.isfinite(min_delta) and min_delta >= 0):
            raise InvalidArgumentError(f"EarlyStopping: min_delta must be a finite number >= 0, got {min_delta!r}")
        if mode not in ("min", "max"):
            raise InvalidArgumentError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(restore_best, bool):
            raise InvalidArgumentError(f"EarlyStopping: restore_best must be True or False, got {restore_best!r}")
        self.monitor, self.patience, self.min_delta = monitor, patience, float(min_delta)
        self.mode, self.restore_best = mode, restore_best
        self._reset()

    def __repr__(self) -> str:
        return (f"EarlyStopping(monitor={self.monitor!r}, patience={self.patience}, min_delta={self.min_delta}, "
                f"mode={self.mode!r}, restore_best={self.restore_best})")

    def _reset(self) -> None:
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self.wait = 0
        self._best_state: Any = None
        self._best_model: Any = None  # explicit: the model itself; implicit: host copies of its variables
        self._last_epoch: int | None = None

    def on_train_begin(self, state: optim.OptState, model: Any, distributed: DataParallel | None) -> None:
        self._reset()  # one instance may serve several runs

    def _improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, info: EpochInfo) -> bool | None:
        if self.monitor not in info.metrics:
            hint = (" (validation metrics need validation=... in ad.train)"
                    if self.monitor.startswith("val_") else "")
            raise InvalidArgumentError(
                f"EarlyStopping: the metric {self.monitor!r} is not recorded{hint}; the recorded ones are "
                f"{sorted(info.metrics)}"
            )
        value = float(info.metrics[self.monitor])
        self._last_epoch = info.epoch
        if self._improved(value):
            self.best, self.best_epoch, self.wait = value, info.epoch, 0
            if self.restore_best:
                self._keep(info.state, info.model)
            return None
        self.wait += 1
        if self.wait >= max(self.patience, 1):
            self.stopped_epoch = info.epoch
            return False
        return None

    def _keep(self, state: optim.OptState, model: Any) -> None:
        from .core import model_state_variables

        self._best_state = state  # states are immutable: optim.update returns new ones
        if state.implicit:
            self._best_model = [(v, _host_copy(_read(v))) for _, v in model_state_variables(model)]
        else:
            self._best_model = model

    def on_train_end(self, state: optim.OptState, model: Any) -> tuple[optim.OptState, Any] | None:
        if not self.restore_best or self._best_state is None or self.best_epoch == self._last_epoch:
            return None
        if not self._best_state.implicit:
            return self._best_state, self._best_model
        from ._checkpoint import _to_like

        # convert everything first, then write: a failure cannot leave a half-restored model
        values = [(v, _to_like(a, _read(v))) for v, a in self._best_model]
        for v, value in values:
            _write(v, value)
        return self._best_state, model


def _read(v: Any) -> Any:
    from . import optim

    return optim.read(v)


def _write(v: Any, value: Any) -> None:
    from . import optim

    optim.write(v, value)


# ------------------------------------------------------------------ Checkpoint
class Checkpoint(Callback):
    """``ad.save_checkpoint(path, state, model)`` every ``every`` epochs or steps.

    ``Checkpoint(path, every=1, on="epoch")``: after every ``every``-th epoch of the run
    (``on="epoch"``), or after every step whose global number ``state.step`` is a
    multiple of ``every`` (``on="step"``, so a resumed run keeps the same schedule).
    ``path`` may hold the fields ``{epoch}`` (the epoch just completed, or the step's
    epoch, counting from 0 as :class:`~abstractdiff.StepInfo` does) and ``{step}`` (the
    global step), e.g. ``"run-{epoch:03d}.npz"``; without them each save replaces the
    last.  Each file is written atomically (a temporary file renamed over ``path``), and
    loads with ``ad.load_checkpoint(path, like=(state, model))``.  :attr:`saved` lists
    the paths written, in order.  With ``distributed=ad.DataParallel()`` only rank 0
    writes, and every process waits until the file is complete.

    Raises:
        InvalidArgumentError: ``every`` is not an int >= 1, ``on`` is neither
            ``"epoch"`` nor ``"step"``, or ``path`` has a field other than ``{epoch}``
            and ``{step}``.
        ArgumentTypeError: ``path`` is not a string or path.
    """

    def __init__(self, path: str | os.PathLike, *, every: int = 1, on: str = "epoch"):
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"Checkpoint: path must be a str or a path, got {type(path).__name__}")
        path = os.fspath(path)
        if not isinstance(path, str):
            raise ArgumentTypeError("Checkpoint: path must be a str or a path, not bytes")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise InvalidArgumentError(f"Checkpoint: every must be an int >= 1, got {every!r}")
        if on not in ("epoch", "step"):
            raise InvalidArgumentError(f"Checkpoint: on must be 'epoch' or 'step', got {on!r}")
        try:
            path.format(epoch=0, step=0)
        except (KeyError, IndexError, ValueError) as err:
            raise InvalidArgumentError(
                f"Checkpoint: path {path!r} is not a valid file-name pattern ({type(err).__name__}: {err}); "
                f"it may use the fields {{epoch}} and {{step}} only (write {{{{ and }}}} for braces)"
            ) from None
        self.path, self.every, self.on = path, every, on
        self.saved: list[str] = []
        self._distributed: DataParallel | None = None
        self._epochs_done = 0

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, every={self.every}, on={self.on!r})"

    def on_train_begin(self, state: optim.OptState, model: Any, distributed: DataParallel | None) -> None:
        self._distributed, self._epochs_done = distributed, 0

    def _save(self, epoch: int, state: optim.OptState, model: Any) -> None:
        path = self.path.format(epoch=epoch, step=state.step)
        if self._distributed is not None:
            self._distributed.save_checkpoint(path, state, model)  # rank 0 writes, all wait
        else:
            from ._checkpoint import save_checkpoint

            save_checkpoint(path, state, model)
        self.saved.append(path)

    def on_step_end(self, info: StepInfo) -> None:
        if self.on == "step" and info.step % self.every == 0:
            self._save(info.epoch, info.state, info.model)

    def on_epoch_end(self, info: EpochInfo) -> None:
        self._epochs_done += 1
        if self.on == "epoch" and self._epochs_done % self.every == 0:
            self._save(info.epoch, info.state, info.model)

"""``train_step`` and ``train``: one loop for explicit models and implicit variables.

The for loop a user writes around :func:`train_step` is the first-class API; :func:`train`
is a thin convenience over it (epochs, callbacks, a progress bar), returning the updated
``(state, model)`` as Optimisers.jl does.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

import numpy as np
import optree

from . import optim
from ._backend import Backend
from ._cache import WeakLRU
from ._convert import to_numpy
from ._errors import ArgumentTypeError, CollectedError, InvalidArgumentError, ModeMismatchError, NonFiniteError
from ._registry import backend as _get_backend
from ._tree import is_array
from .optim._state import _weak as _ref  # weak where the object allows it (see _BoundCache)

if TYPE_CHECKING:
    from ._distributed import DataParallel

__all__ = ["StepInfo", "train", "train_step"]


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


def _ar() -> Any:
    import autoray

    return autoray


def _inner(b: Backend) -> Backend:
    return getattr(b, "inner", b)


def _convert_tree(b: Backend, tree: Any) -> Any:
    """Numpy (or other foreign) array leaves as ``b``'s native arrays; everything else as is."""
    return optree.tree_map(lambda a: b.convert(a) if is_array(a) and not b.is_native(a) else a, tree)


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
        self._entries: WeakLRU[_Bound] = WeakLRU(self.size, hold_unreferenceable=True)

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


def _untrained_state(model: Any, params: Any) -> list[Any]:
    """The variables of ``model`` that the optimiser does not train: buffers (BatchNorm's
    running statistics) and frozen parameters, as its library's ``model_state`` lists them."""
    from ._checkpoint import _model_variables

    trained = {id(p) for p in params}
    return [v for _, v in _model_variables(model) if id(v) not in trained]


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
        variables = params + _untrained_state(model, params)
        dp.check_same("the model (structure, shapes, dtypes) and the batch size",
                      [describe([optim.read(v) for v in variables]), n_rows])
        _broadcast_variables(dp, variables)
        return model
    dp.check_same("the model (structure, shapes, dtypes) and the batch size", [describe(model), n_rows])
    leaves, treedef = optree.tree_flatten(model)
    arrays = iter(dp.broadcast([a for a in leaves if is_array(a)]))
    return optree.tree_unflatten(treedef, [next(arrays) if is_array(a) else a for a in leaves])


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
    if b.implicit:
        if not state.implicit:
            raise ModeMismatchError(
                f"train_step: {b!r} trains variables in place, but the state was set up for a pytree "
                f"of arrays; pass a model holding variables (an nn.Module, a Keras model, "
                f"ad.variables(...)) to optim.setup and train_step, or use the explicit backend {_inner(b)!r}"
            )
        if distributed is not None and state.step == 0:
            model = _distributed_start(distributed, model, True, n_rows)
        params = optim.params_of(model)
        loss, grads = b.value_and_gradient(_BOUND.get(loss_fn, model), params, *batch)
        if distributed is not None:
            from ._implicit import Grads

            loss, values = distributed.average(loss, [grads[p] for p in params], share)
            grads = Grads(params, values)
        check = _finite_check(step, state, model, loss, [grads[p] for p in params], "the variables hold the values")
        state, model = optim._apply(state, model, grads, check)
        if distributed is not None:
            # each process's forward pass updated its own buffers (BatchNorm's running
            # statistics) from its own rows: rank 0's win, as in torch's DDP
            _broadcast_variables(distributed, _untrained_state(model, params))
        return state, model, loss
    if state.implicit or optim.holds_variables(model):
        raise ModeMismatchError(
            f"train_step: the model holds variables (an nn.Module, a Keras model or ad.variables) "
            f"but {b!r} is explicit; use ad.Implicit({b.name!r}) to train variables in place, or "
            f"pass a pytree of arrays as the model and set the state up for it"
        )
    model = _convert_tree(b, model)
    state = state._replace(tree=_convert_tree(b, state.tree))
    if distributed is not None and state.step == 0:
        model = _distributed_start(distributed, model, False, n_rows)
    loss, grads = b.value_and_gradient(loss_fn, model, *batch)
    if distributed is not None:
        g_leaves, g_def = optree.tree_flatten(grads, none_is_leaf=True)
        loss, g_leaves = distributed.average(loss, g_leaves, share)
        grads = optree.tree_unflatten(g_def, g_leaves)
    holding = "the error's .model and .state are the values"
    check = _finite_check(step, state, model, loss, optree.tree_leaves(grads), holding)
    state, model = optim._apply(state, model, grads, check)
    return state, model, loss


class _Progress:
    """A tqdm bar with the running loss if tqdm is installed, else one stderr line per epoch."""

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
            self.bar.set_postfix(epoch=epoch + 1, loss=f"{self.running:.4g}", refresh=False)

    def end_epoch(self, epoch: int, steps: int) -> None:
        if self.enabled and self.bar is None and self.running is not None:
            print(
                f"epoch {epoch + 1}/{self.epochs}: step {steps}, running loss {self.running:.4g}",
                file=sys.stderr,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(
    loss_fn: Callable[..., Any],
    model: Any,
    data: Iterable[Any],
    state: optim.OptState,
    *,
    backend: Backend | str,
    epochs: int = 1,
    callbacks: Iterable[Callable[[StepInfo], Any]] = (),
    progress: bool = True,
    distributed: DataParallel | None = None,
) -> tuple[optim.OptState, Any]:
    """Train for ``epochs`` passes over ``data``: ``train(loss_fn, model, data, state, backend=b) -> (state, model)``.

    A thin loop over :func:`train_step`.  ``data`` is an iterable of batches, each a
    tuple of arrays passed as ``loss_fn(model, *batch)``; it must be re-iterable (a
    list, a dataset, not a generator) when ``epochs > 1``.  After every step each
    callback is called as ``callback(info)`` with a :class:`StepInfo` (epoch, step,
    loss, model, state); a callback returning ``False`` (not just a falsy value) stops
    training after that step.  ``progress=True`` shows a tqdm bar with the running loss
    when tqdm is installed, else a line per epoch on stderr; ``progress=False`` prints
    nothing.

    ``distributed=ad.DataParallel()`` trains data-parallel over the processes of a
    ``torchrun`` launch (see :func:`train_step`); every process runs the same loop and
    callbacks, and only rank 0 shows progress.

    Raises:
        NonFiniteError: see :func:`train_step`; ``err.model``/``err.state`` hold
            everything learned before the failing step.
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
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 0:
        raise InvalidArgumentError(f"train: epochs must be an int >= 0, got {epochs!r}")
    if epochs > 1 and iter(data) is data:
        raise ArgumentTypeError(
            "train: data is a one-shot iterator (e.g. a generator), which would be empty after the "
            "first epoch; pass a list of batches or another re-iterable collection, or call train "
            "once per epoch"
        )
    callbacks = tuple(callbacks)
    if distributed is not None:
        _check_distributed(distributed)
        progress = progress and distributed.is_main
    try:
        total = len(data) * epochs  # type: ignore[arg-type]
    except TypeError:
        total = None
    bar = _Progress(progress, total, epochs)
    try:
        for epoch in range(epochs):
            for batch in data:
                state, model, loss = train_step(loss_fn, model, batch, state, backend=backend,
                                                distributed=distributed)
                value = float(to_numpy(loss))
                bar.step(epoch, value)
                info = StepInfo(epoch, state.step, value, model, state)
                stop = False
                for callback in callbacks:
                    if callback(info) is False:
                        stop = True
                if stop:
                    return state, model
            bar.end_epoch(epoch, state.step)
    finally:
        bar.close()
    return state, model

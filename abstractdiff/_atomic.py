"""All-or-nothing training steps: snapshots of variables, and interrupts held off while assigning.

A step in implicit mode changes the model in place twice: its forward pass writes the
buffers (BatchNorm's running statistics, Keras's non-trainable variables, a dropout
layer's seed state), and its update assigns the new parameters.  If the step raises
(``NonFiniteError``, an exception in the loss, a ``KeyboardInterrupt``), the caller keeps
the state it passed in, so the model must be as it was too, or resuming from what the
caller holds would differ from a run that was never interrupted.

Two tools, chosen for cost:

* :func:`snapshot` and :func:`restore`: copies of a few variables' values, taken before
  the forward pass, written back if the step raises.  Only what the forward pass may
  write is copied before it (the buffers, small); the parameters are copied just before
  they are assigned, and only where the library assigns in place (the variable hooks'
  ``read_kept``: a copy where a read shares memory with the variable, the value itself
  where reads are immutable values that a later assignment does not change, for free).
* :class:`HeldInterrupts`: SIGINT held off (recorded, not raised) while a block of
  assignments runs, on the main thread, so that a ``KeyboardInterrupt`` cannot land
  between two assignments.  The block then decides: undo what it assigned and deliver
  the interrupt, or, where its result was already handed over (``ad.train``'s loop),
  deliver it after.  Held interrupts are delivered to the handler that was installed
  before (Python's, raising ``KeyboardInterrupt``, or the user's own).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable

from .core import model_state_variables, variable_owner

__all__ = ["HeldInterrupts", "restore", "snapshot", "untrained_state"]


def snapshot(variables: list[Any]) -> list[Any]:
    """The values of ``variables`` as they are now, kept apart from later in-place writes
    (each library's ``read_kept`` hook: a copy where the library assigns in place, the
    immutable value itself elsewhere)."""
    return [variable_owner(v).read_kept(v) for v in variables]


def restore(variables: list[Any], values: list[Any]) -> None:
    """Write back what :func:`snapshot` took, interrupts held off so that it is not split
    (a second Ctrl-C while the first is being cleaned up is delivered once this is done)."""
    with HeldInterrupts() as held:
        for v, value in zip(variables, values):
            variable_owner(v).write(v, value)
    held.deliver()


def untrained_state(model: Any, params: Any) -> list[Any]:
    """The variables of ``model`` that the optimiser does not train: buffers (BatchNorm's
    running statistics) and frozen parameters, as its library's ``model_state`` lists them
    (what a forward pass may write, to be kept for undoing a failed step)."""
    trained = {id(p) for p in params}
    return [v for _, v in model_state_variables(model, written=True) if id(v) not in trained]


class HeldInterrupts:
    """``with HeldInterrupts() as held: ...``: SIGINT during the block is recorded, not raised.

    After the block, ``held.pending`` says whether one arrived and :meth:`deliver` hands it
    to the handler installed before (which raises ``KeyboardInterrupt`` for Python's
    default).  Only on the main thread (the only one Python delivers signals to, and the
    only one allowed to install a handler) and only where a Python handler is installed:
    elsewhere this does nothing.  Blocks nest: an inner block's held interrupt is delivered
    to the outer block, which holds it in turn.  The block itself never raises for a
    held signal, so what it does completes; a signal arriving after it is the caller's.
    """

    __slots__ = ("_previous", "_signal", "installed")

    def __init__(self) -> None:
        self._previous: Any = None
        self._signal: tuple[int, FrameType | None] | None = None
        self.installed = False

    @property
    def pending(self) -> bool:
        return self._signal is not None

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self._signal is None:
            self._signal = (signum, frame)

    def __enter__(self) -> HeldInterrupts:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # not SIG_IGN / SIG_DFL / a handler installed from C
                self._previous = previous
                signal.signal(signal.SIGINT, self._hold)
                self.installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, self._previous)
            self.installed = False

    def deliver(self) -> None:
        """Hand a held SIGINT to the handler installed before the block (once)."""
        if self._signal is not None:
            (signum, frame), self._signal = self._signal, None
            handler: Callable[[int, FrameType | None], Any] = self._previous
            handler(signum, frame)

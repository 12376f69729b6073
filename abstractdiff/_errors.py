"""Every exception abstractdiff raises.

Each class derives from :class:`AbstractDiffError` and from the builtin exception a
caller would naturally catch (``ValueError``, ``TypeError``, ``ImportError``...), so
``except ValueError`` keeps working for code that does not know abstractdiff.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AbstractDiffError",
    "ArgumentTypeError",
    "InvalidArgumentError",
    "UnknownVariableError",
    "CollectedError",
    "BackendUnavailableError",
    "CompositionError",
    "CustomRuleError",
    "CheckpointError",
    "DeviceError",
    "DistributedError",
    "InvalidOutputError",
    "LoopDerivativeError",
    "ModeMismatchError",
    "NonDifferentiableInputError",
    "NonFiniteError",
    "NonFiniteInputError",
    "NonScalarOutputError",
    "ShapeMismatchError",
    "SparsityDetectionError",
    "SparsityPatternError",
    "TracedControlFlowError",
    "UnknownBackendError",
]


class AbstractDiffError(Exception):
    """Base class of every error raised by abstractdiff."""


class InvalidArgumentError(AbstractDiffError, ValueError):
    """An argument or option has a value abstractdiff cannot use (a negative learning rate,
    an unknown operator name, a finite-differences step too small for the dtype...)."""


class FiniteDifferenceAccuracyError(InvalidArgumentError):
    """Finite differences found no step giving an accurate derivative: ``f`` has a kink or
    a jump there, or its values are too noisy (rounding) for any step."""


class ArgumentTypeError(AbstractDiffError, TypeError):
    """An argument has the wrong type (``f`` not callable, a state that is not an ``OptState``...)."""


class UnknownVariableError(AbstractDiffError, KeyError):
    """``ad.Grads`` was asked for a variable that is not one of its parameters, or an
    optimiser state was given variables it was not set up for."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CollectedError(AbstractDiffError, ReferenceError):
    """A function or variable being differentiated was garbage collected while an operator
    or a returned pullback still needed it (keep a reference to it)."""


class UnknownBackendError(AbstractDiffError, ValueError):
    """No backend is registered under the requested name."""


class BackendUnavailableError(AbstractDiffError, ImportError):
    """The backend is registered but its AD library cannot be imported here."""


class NonScalarOutputError(AbstractDiffError, ValueError):
    """``gradient``-style operators need ``f`` to return a scalar (shape ``()``)."""


class NonDifferentiableInputError(AbstractDiffError, TypeError):
    """``x`` has no floating-point leaf to differentiate with respect to."""


class ShapeMismatchError(AbstractDiffError, ValueError):
    """A tangent, cotangent or prepared-call input does not match what was expected."""


class InvalidOutputError(AbstractDiffError, TypeError):
    """``f`` returned something that is not an array (a string, a list...)."""


class ModeMismatchError(AbstractDiffError, TypeError):
    """Implicit ``Params`` reached an explicit backend, or the reverse."""


class DeviceError(AbstractDiffError, ValueError):
    """The requested device does not exist or is not supported by the backend."""


class TracedControlFlowError(AbstractDiffError, TypeError):
    """Python control flow on a traced value inside a compiled function."""


class SparsityDetectionError(AbstractDiffError, NotImplementedError):
    """Sparsity detection met an operation it has no rule for, or control flow (or a
    conversion) on a traced value; pass the pattern with ``ad.Sparse(b, sparsity=...)``."""


class SparsityPatternError(ShapeMismatchError):
    """``ad.Sparse`` computed a derivative with a nonzero where its sparsity pattern (given
    or detected) has none: the pattern is wrong for this point, and the sparse result would be."""


class CheckpointError(AbstractDiffError, ValueError):
    """A checkpoint file is truncated, unsafe, or does not match the expected structure."""


class DistributedError(AbstractDiffError, RuntimeError):
    """Data-parallel training cannot go on: not launched as several processes, processes
    that disagree (world size, model structure), or a collective operation that failed
    or timed out (another process died or hangs)."""


class CompositionError(AbstractDiffError, NotImplementedError):
    """A composition of libraries abstractdiff cannot differentiate: a derivative
    :func:`abstractdiff.differentiate_with`'s boundary does not carry (a third one, a second
    one from jax or tensorflow code), or a pair with no route."""


class LoopDerivativeError(AbstractDiffError, NotImplementedError):
    """A derivative a loop cannot give on its library: reverse mode through
    :func:`abstractdiff.while_loop` where the library cannot reverse a loop of unknown length
    (jax); :func:`abstractdiff.fori_loop` with a bound, or forward mode, can."""


class CustomRuleError(AbstractDiffError, ValueError):
    """A custom derivative cannot be used as written: a rule of ``ad.custom_vjp`` or
    ``ad.custom_jvp`` returned the wrong number, structure, shape or dtype of cotangents or
    tangents; a mode the rule does not give was asked for (forward mode through a
    ``custom_vjp``, reverse mode through a ``custom_jvp`` where the library cannot transpose
    it); ``ad.stop_gradient`` under finite differences; or ``ad.custom_root``'s linear system
    is singular at the solution.

    Attributes:
        mode: ``"reverse"`` or ``"forward"`` where the error is a rule's refusal of that mode
            (a Jacobian then takes the other one), else None.
    """

    mode: str | None = None


class NonFiniteInputError(AbstractDiffError, ValueError):
    """``x`` holds NaN or inf where the backend cannot differentiate (finite differences)."""


class NonFiniteError(AbstractDiffError, FloatingPointError):
    """Training produced a non-finite loss or gradient; nothing was applied.

    Attributes:
        state: the optimiser state before the failing step (the last good one).
        model: the model before the failing step (the last good one).
        step: the global step number (counting from 1) whose loss or gradient was not finite.
    """

    def __init__(self, message: str, *, state: Any = None, model: Any = None, step: int = 0):
        super().__init__(message)
        self.state = state
        self.model = model
        self.step = step

"""Keras 3 variables and models, for the adapters of Keras's backends (tensorflow, torch, jax).

A Keras variable belongs to the AD library Keras runs on (``KERAS_BACKEND``, fixed when Keras
is imported), so each of those adapters owns the Keras variables and models of its own
backend only, through these helpers, and differentiates them its own way: TensorFlow
watches the ``tf.Variable`` a Keras variable wraps, torch differentiates the
``torch.nn.Parameter`` it wraps, and jax, whose Keras variables are immutable, runs ``f``
in a :class:`keras.StatelessScope` (:func:`stateless`, :class:`StatelessVariables`).

Keras is never imported here: its objects exist only if the user imported it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

from abstractdiff._arrays import check_scalar
from abstractdiff._errors import ModeMismatchError
from abstractdiff._hooks import AdapterHooks
from abstractdiff._tree import check_output, split_aux


def _keras() -> Any:
    return sys.modules.get("keras")


def keras_backend() -> str | None:
    """The AD library Keras runs on (``"tensorflow"``, ``"torch"``, ``"jax"``...), or ``None``
    when Keras is not imported."""
    keras = _keras()
    return None if keras is None else keras.config.backend()


def is_keras_variable(v: Any, backend: str | None = None) -> bool:
    """Whether ``v`` is a Keras variable (of the Keras backend ``backend``, when given)."""
    keras = _keras()
    if keras is None or not isinstance(v, keras.Variable):
        return False
    return backend is None or keras.config.backend() == backend


def is_keras_layer(obj: Any, backend: str | None = None) -> bool:
    """Whether ``obj`` is a Keras layer or model (of the Keras backend ``backend``, when given)."""
    keras = _keras()
    if keras is None or not isinstance(obj, keras.Layer):
        return False
    return backend is None or keras.config.backend() == backend


def native_variable(v: Any) -> Any:
    """The library's own variable a Keras variable wraps in ``.value`` (``v`` itself otherwise)."""
    keras = _keras()
    return v.value if keras is not None and isinstance(v, keras.Variable) else v


def check_keras_backend(v: Any, where: str, backend: str) -> None:
    """Refuse a Keras variable of another Keras backend than ``backend``, naming the one to use."""
    if is_keras_variable(v) and not is_keras_variable(v, backend):
        own = keras_backend()
        raise ModeMismatchError(
            f"{where} is a Keras variable of the {own!r} Keras backend (KERAS_BACKEND={own}); "
            f"differentiate it with ad.Implicit({own!r}), not with the {backend!r} backend"
        )


def model_variables(obj: Any, backend: str) -> tuple[list, int] | None:
    """``(trainable variables, number of other ones)`` of a Keras layer or model of ``backend``."""
    if not is_keras_layer(obj, backend):
        return None
    trainable = list(obj.trainable_variables)
    ids = {id(v) for v in trainable}
    return trainable, len([v for v in obj.variables if id(v) not in ids])


def model_state(obj: Any, backend: str) -> list[tuple[str, Any]] | None:
    """Every variable of a Keras layer or model of ``backend`` (non-trainable ones such as
    BatchNormalization's moving statistics too), named by its Keras path."""
    if not is_keras_layer(obj, backend):
        return None
    return [(v.path, v) for v in obj.variables]


@contextlib.contextmanager
def stateless(variables: list, values: list) -> Iterator[list]:
    """Run the body with each variable reading its value from ``values`` (traced values),
    in a :class:`keras.StatelessScope`; yields a list that, on exit, holds ``(variable,
    new value)`` for every *other* variable the body assigned (BatchNormalization's moving
    statistics, a seed generator's state), which the caller writes back after
    differentiating.  No variable changes inside the scope."""
    keras = _keras()
    scope = keras.StatelessScope(state_mapping=list(zip(variables, values)))
    assigned: list = []
    record = scope.add_update

    def add_update(update: tuple) -> None:
        assigned.append(update[0])
        record(update)

    scope.add_update = add_update  # the scope keeps updates by id(variable) only: note the variables
    updates: list = []
    with scope:
        yield updates
    params = {id(v) for v in variables}
    seen: set[int] = set()
    for var in assigned:
        if id(var) not in params and id(var) not in seen:
            seen.add(id(var))
            updates.append((var, scope.get_current_value(var)))


class StatelessVariables:
    """The variable hooks (an adapter's ``variables``) of a Keras backend whose variables are
    immutable (jax): ``f`` runs in a StatelessScope (:func:`stateless`) as an explicit function
    of the variables' values, which the adapter's own reverse-mode primitive differentiates (a
    gradient is its pullback seeded with one), and the other variables ``f`` assigned
    (BatchNormalization's moving statistics, seed state) are written back afterwards."""

    def __init__(self, adapter: Any, backend: str):
        self.adapter = adapter  # its ``backend`` (the holder), set after construction, for core services
        self.keras_backend = backend

    def is_variable(self, v: Any) -> bool:
        return is_keras_variable(v, self.keras_backend)

    def check_variable(self, v: Any, where: str) -> None:
        check_keras_backend(v, where, self.keras_backend)
        AdapterHooks.check_variable(self.adapter.backend, v, where)  # the core's dtype check

    def model_variables(self, obj: Any) -> tuple[list, int] | None:
        return model_variables(obj, self.keras_backend)

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        return model_state(obj, self.keras_backend)

    def read(self, var: Any) -> Any:
        return var.value

    def write(self, var: Any, value: Any) -> None:
        var.assign(value)

    def current_value(self, var: Any) -> Any:
        return var.value  # the traced value inside the stateless scope

    def _pullback(self, f: Callable[..., Any], variables: list, args: tuple, has_aux: bool, scalar: bool) -> tuple:
        """``(y, aux, vjp)`` of ``f`` as a function of the variables' values, by the adapter's primitive."""
        assigned: list = []

        def explicit(values: list, _data: list) -> tuple[Any, tuple]:
            with stateless(variables, values) as updates:
                y, aux = split_aux(f(*args), has_aux)
            y = check_output(y, values)
            if scalar:
                check_scalar(y)
            assigned[:] = [v for v, _ in updates]
            return y, (aux, [value for _, value in updates])

        values = [self.read(v) for v in variables]
        y, (aux, new), vjp = self.adapter.value_and_pullback(explicit, values, [])
        for var, value in zip(assigned, new):
            var.assign(value)  # the state f updated (moving statistics), now concrete
        zeros = self.adapter.zeros_like
        return y, aux, lambda dy: [zeros(v) if g is None else g for g, v in zip(vjp(dy), values)]

    def implicit_value_and_gradient(self, f: Callable[..., Any], variables: list, args: tuple, has_aux: bool) -> tuple:
        y, aux, vjp = self._pullback(f, variables, args, has_aux, scalar=True)
        return y, aux, vjp(self.adapter.ones_like(y))

    def implicit_value_and_pullback(self, f: Callable[..., Any], variables: list, args: tuple) -> tuple:
        y, _, vjp = self._pullback(f, variables, args, False, scalar=False)

        def pullback(dy: Any) -> list:
            with self.adapter.scope([y]):  # a float64 cotangent, in jax's x64 mode
                return vjp(self.adapter.backend.cotangent(dy, y))

        return y, pullback


class WithKerasVariables:
    """An adapter's own variable hooks (``native``) with the Keras 3 variables and models of the
    Keras backend ``backend`` added (torch, tensorflow): a Keras variable is differentiated
    through the native variable it wraps in ``.value`` (an ``nn.Parameter``, a ``tf.Variable``),
    and Keras layers are looked at first (a Keras layer on torch is an ``nn.Module`` too).
    Every other hook is ``native``'s."""

    def __init__(self, native: Any, backend: str):
        self.native, self.keras_backend = native, backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__.get("native"), name)  # only the hooks native has: the core asks with hasattr

    def is_variable(self, v: Any) -> bool:
        return is_keras_variable(v, self.keras_backend) or self.native.is_variable(v)

    def check_variable(self, v: Any, where: str) -> None:
        check_keras_backend(v, where, self.keras_backend)
        self.native.check_variable(native_variable(v), where)

    def model_variables(self, obj: Any) -> tuple[list, int] | None:
        if is_keras_layer(obj) or is_keras_variable(obj):  # one of another Keras backend is not ours
            return model_variables(obj, self.keras_backend)
        return self.native.model_variables(obj)

    def model_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        if is_keras_layer(obj) or is_keras_variable(obj):
            return model_state(obj, self.keras_backend)
        return self.native.model_state(obj)

    def forward_state(self, obj: Any) -> list[tuple[str, Any]] | None:
        if is_keras_layer(obj) or is_keras_variable(obj):
            return None  # a Keras model's model_state holds every variable
        forward_state = getattr(self.native, "forward_state", None)
        return None if forward_state is None else forward_state(obj)

    def read(self, var: Any) -> Any:
        return self.native.read(native_variable(var))

    def read_kept(self, var: Any) -> Any:
        # the native hooks' copy where they have one (torch: reads share memory), else the read
        native = self.native
        return getattr(native, "read_kept", native.read)(native_variable(var))

    def write(self, var: Any, value: Any) -> None:
        self.native.write(native_variable(var), value)

    def current_value(self, var: Any) -> Any:
        return self.native.current_value(native_variable(var))

    def aliases(self, var: Any) -> tuple[Any, ...]:
        return (var.value,) if is_keras_variable(var) else ()  # a Keras variable's native one

    def implicit_value_and_gradient(self, f: Callable[..., Any], variables: list, args: tuple, has_aux: bool) -> tuple:
        return self.native.implicit_value_and_gradient(f, [native_variable(v) for v in variables], args, has_aux)

    def implicit_value_and_pullback(self, f: Callable[..., Any], variables: list, args: tuple) -> tuple:
        return self.native.implicit_value_and_pullback(f, [native_variable(v) for v in variables], args)

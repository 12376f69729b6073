"""What a function reads from globals and closures: the key that keeps traces fresh.

A compiling backend (jax ``jit``, ``tf.function``) traces ``f`` once and reuses the trace;
values ``f`` reads by closure or from a global are frozen into it as constants.  An
unprepared operator must not reuse a trace once such a value changed, so the plan cache
of a tracing backend keys each plan on :func:`captures` of ``f`` too: a changed value
gives a new plan, and so a new trace.

What is compared:

* Python numbers, strings, bytes, booleans and ``None`` by value (floats by their exact
  bits), tuples of them element by element;
* numpy arrays by content, whatever their size (:func:`abstractdiff._cache.array_fingerprint`,
  the one keying policy: no size above which an in-place change goes unseen);
* another library's array by content where it can be written in place behind a compiled
  trace (an MLX array: ``G[...] = 3.0`` keeps the object), through its owning adapter
  (:func:`abstractdiff._cache.native_array_key`); by identity where it cannot (jax and
  TensorFlow tensors are immutable, a library's variables are read when the trace runs);
* any other object (a function of a library, a model) by identity; such an
  object is also returned in ``alive``, held weakly by the plan, so that a new object
  that reuses a dead one's ``id`` cannot find its plan;
* the user's functions that ``f`` calls through a global or a closure are followed, at any
  depth and in any of the user's modules (``f``'s own, a sibling module, a package checked
  out or installed editable: any module whose file is outside the standard library and
  site-packages), so a helper reading a global is covered as well; a library's functions
  (installed packages) are compared by identity only;
* the methods of the user's classes (defined in those same modules), reached as a class
  (``Helpers.scale(x)``), an object of one (``scaled(x)`` runs ``Scaled.__call__``) or a
  bound method (``step = model.step``): each method the class and its user base classes
  define is followed as a helper, and which function each name holds is part of the key;
  the object itself is compared by identity (its attributes: see below);
* **the functions a rule calls**: an object that runs user functions on the user's
  behalf (``ad.custom_vjp``/``ad.custom_jvp`` functions call ``fun``, ``fwd``, ``bwd``,
  ``jvp``; ``ad.custom_root`` solvers their solver and optimality function) names them
  with the ``__abstractdiff_captures__`` protocol: a method
  ``obj.__abstractdiff_captures__() -> iterable of callables``.  Each is followed as the
  user's code, whatever module it is defined in (a rule's ``bwd`` reading a global
  ``SCALE`` is seen), and the object's own key includes which functions it names now (a
  ``defvjp`` that replaces ``bwd`` is a change);
* a function of abstractdiff itself reached through a closure (an internal wrapper, such
  as the implicit solver's residual ``lambda z: optimality_fn(...)``) is transparent: the
  user functions in its closure are followed as above.

Not seen: values reached through attributes of objects (``self.scale``, ``config.lr`` where
``config`` is not a module) or inside mutable containers (a dict's entries); an attribute of
one of the user's modules read as ``module.name`` (``helpers.scale(x)``, ``settings.SCALE``)
is seen.  Pass
such values to ``f`` as arguments: arguments are traced inputs, never frozen (a static
argument that is an object is keyed by its state: :func:`abstractdiff._cache.static_key`).

Computing the key walks the function's code, globals and closures (a few microseconds).
:func:`capture_guard` records, from the same walk, where each value was read and which
object was found there: while every place still holds the same object, the key is the
same, and checking that is a handful of identity tests (plus, for each array keyed by its
content, its content again; for each rule object, the identities of the functions it names).
An unprepared call checks its function's guard, and walks again only when it fails.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable

import numpy as np

from ._cache import LRU, Memo, array_fingerprint, native_array_key

__all__ = ["CaptureGuard", "CaptureWatch", "capture_guard", "captures"]

#: How deep calls and values are followed (each function is walked once): a bound on
#: pathological chains, not a policy (a helper's global read deeper is keyed by identity).
_MAX_DEPTH = 64
_SCALARS = (bool, int, str, bytes, complex, type(None))
#: The protocol of an object that calls user functions on the user's behalf (a custom rule,
#: an implicit solver): ``obj.__abstractdiff_captures__()`` returns them (see the module).
PROTOCOL = "__abstractdiff_captures__"
#: ``module`` of a walk that follows every function it meets (a rule's members, the closure
#: of one of abstractdiff's own wrappers): they are the user's code, whatever their module.
_ANY_MODULE = object()


def _is_ours(module: str | None) -> bool:
    """Whether ``module`` is abstractdiff's own (its wrappers of user functions)."""
    return module is not None and (module == "abstractdiff" or module.startswith("abstractdiff."))


_USER_MODULES: Memo = Memo(name="user modules", keyed_on="a module's name")
_LIBRARY_ROOTS: Memo = Memo(name="library paths", keyed_on="nothing (one entry, the interpreter's paths)")


def _library_roots() -> tuple[str, ...]:
    """Where installed packages and the standard library live (their functions are not the
    user's: compared by identity, not walked)."""
    roots = _LIBRARY_ROOTS.get(None)
    if roots is None:
        import os
        import sysconfig

        paths = sysconfig.get_paths()
        found = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
        roots = _LIBRARY_ROOTS[None] = tuple(sorted(r + os.sep for r in found))
    return roots


def _is_user_module(name: str | None) -> bool:
    """Whether module ``name`` is the user's code: ``__main__``, or a module whose file is not
    under the standard library or site-packages (a script's sibling module, a package of the
    user's checked out or installed editable, a notebook's cells).  abstractdiff's own modules
    are not (see :func:`_is_ours`).  Computed once per module name."""
    if name is None or _is_ours(name):
        return False
    known = _USER_MODULES.get(name)
    if known is None:
        import os
        import sys

        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if name == "__main__" or path is None:  # no file: a module made at run time, not the user's
            known = name == "__main__"
        else:
            known = not os.path.realpath(path).startswith(_library_roots())
        _USER_MODULES[name] = known
    return known


def _follows(helper_module: str | None, module: str | None) -> bool:
    """Whether a function of ``helper_module`` called from one of ``module`` is walked."""
    return helper_module == module or _is_user_module(helper_module)


def _members(value: Any) -> tuple | None:
    """The user functions ``value`` names through the protocol, or None where it has none."""
    method = getattr(type(value), PROTOCOL, None)
    if method is None:
        return None
    return tuple(m for m in value.__abstractdiff_captures__() if m is not None)


def _rule_key(value: Any, members: tuple, alive: list[Any], depth: int, seen: set[int],
              guard: CaptureGuard | None) -> tuple:
    """The key of an object of the protocol: its identity, and each function it names now,
    followed as the user's code."""
    alive.append(value)
    if guard is not None:
        guard._add_rule(value, members)
    parts = []
    for m in members:
        if isinstance(m, (types.FunctionType, functools.partial, types.MethodType)) or _members(m) is not None:
            parts.append(("function", id(m), _function_key(m, alive, depth, seen, guard)))
            if not isinstance(m, types.FunctionType):
                alive.append(m)  # a bound method, a partial, a rule: the key names it by identity
        else:  # another callable object: by identity
            alive.append(m)
            parts.append(("id", id(m)))
    return ("rule", id(value), tuple(parts))



def _value_key(
    value: Any, alive: list[Any], depth: int, seen: set[int], module: str | None = None,
    guard: CaptureGuard | None = None,
) -> Any:
    kind = type(value)
    if kind is types.ModuleType:  # the commonest global (np, jnp, torch): one type test
        return None
    if kind is float:
        return (float, value.hex())
    if isinstance(value, float):
        return (float, value.hex())
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, np.generic):
        return (type(value), value.tobytes())
    if isinstance(value, tuple) and depth < _MAX_DEPTH:
        return (tuple, tuple(_value_key(v, alive, depth + 1, seen, module, guard) for v in value))
    if isinstance(value, np.ndarray) and value.dtype != object:
        key = array_fingerprint(value)
        if guard is not None:
            guard._add_array(value, key)
        return key
    if isinstance(value, types.ModuleType):
        return None  # module attributes are not followed (see the module docstring)
    if (
        isinstance(value, (types.FunctionType, functools.partial))
        and depth < _MAX_DEPTH
        # the user's own helpers, in f's module or any other of the user's; not a library's
        # internals (unless reached through a rule or one of abstractdiff's wrappers: _ANY_MODULE)
        and (module is _ANY_MODULE or _follows(getattr(value, "__module__", None), module))
    ):
        return ("function", id(value), _function_key(value, alive, depth + 1, seen, guard))
    if isinstance(value, types.MethodType) and depth < _MAX_DEPTH and (
        _members(value.__self__) is not None
        # a bound method of one of the user's objects (``step = model.step``): the user's code
        or _follows(getattr(value.__func__, "__module__", None), module)
    ):
        alive.append(value)  # (held weakly by the plan: it names the method object by identity)
        return ("method", id(value), _function_key(value, alive, depth + 1, seen, guard))
    if depth < _MAX_DEPTH and not isinstance(value, type):
        members = _members(value)
        if members is not None:  # a custom rule, an implicit solver: the functions it calls
            return _rule_key(value, members, alive, depth + 1, seen, guard)
    if depth < _MAX_DEPTH:
        # one of the user's classes (``Helpers.scale(x)``, ``Model()``) or an object of one
        # (``scaled(x)`` calling ``Scaled.__call__``): its methods are the user's helpers, and
        # a global they read must be seen as one read by ``f`` (the object's own attributes
        # are not: see the module docstring)
        cls = value if isinstance(value, type) else type(value)
        if _is_user_class(cls, module):
            alive.append(value)
            kind = "class" if cls is value else "object"
            return (kind, id(value), _class_key(cls, alive, depth + 1, seen, guard))
    if hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, type):
        key = native_array_key(value)  # another library's array that can be written in place
        if key is not None:
            alive.append(value)
            if guard is not None:
                guard._add_native(value, key)
            return key
    alive.append(value)
    return ("id", id(value))


def _is_user_class(cls: type, module: Any) -> bool:
    """Whether ``cls`` is a class of the user's code (defined in ``f``'s module or any other of
    the user's: see :func:`_follows`), whose methods are walked as the user's helpers."""
    owner = cls.__dict__.get("__module__")
    return isinstance(owner, str) and _follows(owner, None if module is _ANY_MODULE else module)


def _class_methods(cls: type) -> list[tuple[type, str, Any, Any]]:
    """``(class, name, entry, function)`` for each method the user's classes in ``cls``'s MRO
    define: plain methods, ``staticmethod``/``classmethod`` (their function) and a
    ``property``'s getter; ``entry`` is what the class's ``__dict__`` holds under ``name`` (a
    library base class, such as ``torch.nn.Module``, is not the user's: not walked)."""
    out = []
    for klass in cls.__mro__:
        if not _is_user_module(klass.__dict__.get("__module__")) and klass is not cls:
            continue
        for name, entry in list(vars(klass).items()):
            fn = entry
            if isinstance(entry, (staticmethod, classmethod)):
                fn = entry.__func__
            elif isinstance(entry, property):
                fn = entry.fget
            if isinstance(fn, types.FunctionType):
                out.append((klass, name, entry, fn))
    return out


def _class_key(cls: type, alive: list[Any], depth: int, seen: set[int], guard: CaptureGuard | None) -> tuple:
    """The key of one of the user's classes: each method it defines (and its user base
    classes define), walked as a helper; which function each name holds is part of the key
    (a method replaced on the class is a change)."""
    if id(cls) in seen:
        return ()
    seen.add(id(cls))
    methods = _class_methods(cls)
    if guard is not None:
        guard._add_class(methods)
    # a method's own module: the class's (walked as the user's code, see _is_user_class)
    return tuple(
        (name, id(entry), _function_key(fn, alive, depth, seen, guard)) for _klass, name, entry, fn in methods
    )


# bounded: code objects of functions made at run time
_NAMES: LRU[types.CodeType, tuple[str, ...]] = LRU(4096, name="global names read", keyed_on="a code object")
_ATTRIBUTES: LRU[types.CodeType, tuple[tuple[str, str], ...]] = LRU(
    4096, name="module attributes read", keyed_on="a code object"
)


#: The instructions that read a global name (``co_names`` also holds attribute names:
#: ``anp.sum`` reads the global ``anp`` only).
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})


def _code_attributes(code: types.CodeType) -> tuple[tuple[str, str], ...]:
    """``(global, attribute)`` for each ``name.attribute`` a code object (and the code inside
    it) reads of a global: ``helpers.scale(x)`` or ``config.SCALE`` of a module of the user's
    is followed like a global of its own (computed once per code object)."""
    found = _ATTRIBUTES.get(code)
    if found is None:
        import dis

        pairs, previous = set(), None
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and previous is not None:
                pairs.add((previous, ins.argval))
            previous = ins.argval if ins.opname in _GLOBAL_LOADS else None
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                pairs |= set(_code_attributes(const))
        found = tuple(sorted(pairs))
        _ATTRIBUTES.put(code, found)
    return found


def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names a code object (and the lambdas and comprehensions inside it) may read,
    sorted; computed once per code object."""
    names = _NAMES.get(code)
    if names is None:
        import dis  # imported when a function is first keyed, not with abstractdiff

        found = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_LOADS}
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found |= set(_code_names(const))
        names = tuple(sorted(found))
        _NAMES.put(code, names)
    return names


def _function_key(f: Any, alive: list[Any], depth: int, seen: set[int], guard: CaptureGuard | None = None) -> tuple:
    if id(f) in seen:
        return ()
    seen.add(id(f))
    if type(f) is types.FunctionType:  # the common case first: one type test
        pass
    elif _members(f) is not None:  # a rule object called directly (ad.gradient(b, rule, x))
        return _rule_key(f, _members(f), alive, depth + 1, seen, guard)
    elif isinstance(f, functools.partial):
        if guard is not None:
            guard.refused = True  # its keywords are a mutable dict: no identity tells them unchanged
        module = getattr(f.func, "__module__", None)
        parts = (
            tuple(_value_key(a, alive, depth, seen, module, guard) for a in f.args),
            tuple((k, _value_key(v, alive, depth, seen, module, guard)) for k, v in sorted(f.keywords.items())),
        )
        return (parts, _function_key(f.func, alive, depth, seen, guard))
    else:
        if isinstance(f, types.MethodType):
            owner, f = f.__self__, f.__func__
            members = _members(owner)
            if members is not None:  # a method of a rule object (an implicit solver's residual)
                return (_rule_key(owner, members, alive, depth + 1, seen, guard),
                        _function_key(f, alive, depth + 1, seen, guard))
        if not isinstance(f, types.FunctionType):
            return ()
    globals_ = f.__globals__
    module = f.__module__
    names = _code_names(f.__code__)
    if guard is not None:
        guard._add_function(f, depth == 0, names)
    out = [(name, _value_key(globals_[name], alive, depth, seen, module, guard)) for name in names if name in globals_]
    for name, attribute in _code_attributes(f.__code__):
        owner = globals_.get(name)
        if type(owner) is types.ModuleType and _is_user_module(owner.__name__):
            value = getattr(owner, attribute, _ABSENT)
            if guard is not None:
                guard._add_attribute(owner, attribute, value)
            if value is not _ABSENT:
                out.append(((name, attribute), _value_key(value, alive, depth, seen, owner.__name__, guard)))
    # what a wrapper of abstractdiff's closes over is the user's (a rule's functions)
    cell_module = _ANY_MODULE if _is_ours(module) else module
    for i, cell in enumerate(f.__closure__ or ()):
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
            if guard is not None:
                guard.refused = True  # reading it raises: kept out of the guard's identity tests
            continue
        out.append((i, _value_key(contents, alive, depth, seen, cell_module, guard)))
    return tuple(out)


def captures(f: Callable[..., Any]) -> tuple[tuple, list[Any]]:
    """``(key, alive)``: a hashable key of the values ``f`` reads from globals and closures,
    and the objects compared by identity (to be held weakly while the key is in use).

    A callable object that wraps a user function (the implicit adapter's wrapper, the
    training loop's bound loss) names it in ``__abstractdiff_wrapped__``.

    Example:
        >>> SCALE = 2.0
        >>> f = lambda x: SCALE * x
        >>> before, _ = captures(f)
        >>> SCALE = 5.0
        >>> captures(f)[0] == before
        False
    """
    alive: list[Any] = []
    # wrappers may wrap wrappers (the training loop's bound loss inside the implicit wrapper)
    for _ in range(8):
        wrapped = getattr(f, "__abstractdiff_wrapped__", None)
        if wrapped is None:
            break
        f = wrapped
    return _function_key(f, alive, 0, set()), alive


# ----------------------------------------------------------------------- guards
_ABSENT = object()  # what reading a global name that is not defined gives


class CaptureGuard:
    """A cheap test that :func:`captures` of a function would return the key it returned
    when the guard was built (by :func:`capture_guard`).

    The key is a function of the objects the walk reads (each function's code, what the
    global names and closure cells it reads hold, the same for each helper it follows) and
    of the bytes of the small numpy arrays among them.  The guard keeps, per function, where
    it read and the identities it found; when every place holds the same object again (and
    each small array the same bytes), the walk would read the same objects: the same key.
    The objects are held weakly where possible, so the guard keeps nothing of the user's
    alive; one that dies makes the guard stale (its id may be reused).
    """

    __slots__ = ("_code", "_get", "_reads", "_rest", "_held", "refused", "stale", "__weakref__")

    def __init__(self) -> None:
        # The function itself: its code, its globals' get, and (global name, identity of
        # its value) for each name its code reads.
        self._code: Any = None
        self._get: Callable[[str, Any], Any] | None = None
        self._reads: tuple[tuple[str, int], ...] = ()
        # The rarer reads, in one list so that a function without them pays one test:
        # ("cells", identities of the contents) of the function's closure cells, ("helper",
        # weak reference, code, get, reads, cell contents' identities) of each helper it
        # follows, ("array", weak reference, key) of each small numpy array.  Cells are read
        # through their functions, never held (a cell may hold the function itself).
        self._rest: list[tuple] = []
        self._held: list[Any] = []  # weak references (and objects that have none) that keep ids unique
        self.refused = False  # the walk met something identities cannot vouch for
        self.stale = False

    def _expire(self, _ref: Any) -> None:
        self.stale = True

    def _hold(self, obj: Any) -> Any:
        try:
            ref = weakref.ref(obj, self._expire)
        except TypeError:  # numbers, strings, tuples: immutable, held as they are
            self._held.append(obj)
            return lambda: obj
        self._held.append(ref)
        return ref

    def _add_function(self, f: Any, top: bool, names: tuple[str, ...]) -> None:
        get, cells = f.__globals__.get, f.__closure__ or ()
        values = [get(name, _ABSENT) for name in names]
        try:
            contents = [cell.cell_contents for cell in cells]
        except ValueError:  # an empty cell: the walk skips it, and it may be filled later
            self.refused = True
            return
        for value in (*values, *contents):
            if value is not _ABSENT:
                self._hold(value)
        reads, cell_ids = tuple(zip(names, map(id, values))), list(map(id, contents))
        if top:  # the caller passes the function itself to unchanged()
            self._code, self._get, self._reads = f.__code__, get, reads
            if cells:
                self._rest.append(("cells", cell_ids))
        else:
            self._rest.append(("helper", self._hold(f), f.__code__, get, reads, cell_ids))

    def _add_attribute(self, module: types.ModuleType, attribute: str, value: Any) -> None:
        # a user module's attribute read as ``module.attribute``: the object found there
        if value is not _ABSENT:
            self._hold(value)
        self._rest.append(("attribute", self._hold(module), attribute, id(value)))

    def _add_array(self, value: np.ndarray, key: tuple) -> None:
        self._rest.append(("array", self._hold(value), key))

    def _add_native(self, value: Any, key: tuple) -> None:
        self._rest.append(("native", self._hold(value), key))

    def _add_class(self, methods: list[tuple[type, str, Any, Any]]) -> None:
        # which entry each of the class's method names holds (a method replaced on the class)
        for klass, name, entry, _fn in methods:
            self._hold(entry)
            self._rest.append(("member", self._hold(klass), name, id(entry)))

    def _add_rule(self, value: Any, members: tuple) -> None:
        # the functions it names, by identity (held: a new function may not reuse an id)
        for m in members:
            self._hold(m)
        self._rest.append(("rule", self._hold(value), tuple(map(id, members))))

    def unchanged(self, f: Callable[..., Any]) -> bool:
        """Whether ``captures(f)`` would return the key it returned when this guard was built;
        on the hot path of every unprepared call, so written for the common case: one
        function reading a few globals."""
        if self.stale or f.__code__ is not self._code:
            return False
        get = self._get
        for name, ident in self._reads:
            if id(get(name, _ABSENT)) != ident:  # type: ignore[misc]
                return False
        return not self._rest or self._rest_unchanged(f)

    def _rest_unchanged(self, f: Callable[..., Any]) -> bool:
        try:
            for kind, *what in self._rest:
                if kind == "cells":
                    if _cell_ids(f) != what[0]:
                        return False
                elif kind == "helper":
                    ref, code, get, reads, cell_ids = what
                    helper = ref()
                    if helper.__code__ is not code or _cell_ids(helper) != cell_ids:
                        return False
                    if any(id(get(name, _ABSENT)) != ident for name, ident in reads):
                        return False
                elif kind == "attribute":
                    module, attribute, ident = what
                    if id(getattr(module(), attribute, _ABSENT)) != ident:
                        return False
                elif kind == "member":
                    klass, name, ident = what
                    if id(vars(klass()).get(name, _ABSENT)) != ident:
                        return False
                elif kind == "array":
                    if array_fingerprint(what[0]()) != what[1]:
                        return False
                elif kind == "native":
                    if native_array_key(what[0]()) != what[1]:
                        return False
                elif tuple(map(id, _members(what[0]()) or ())) != what[1]:  # a rule: the functions it names
                    return False
        except ValueError:  # a closure cell emptied since
            return False
        return True


def _cell_ids(f: Any) -> list[int]:
    return [id(cell.cell_contents) for cell in f.__closure__ or ()]


def capture_guard(f: Callable[..., Any]) -> CaptureGuard | None:
    """A :class:`CaptureGuard` of a plain function ``f``, or ``None`` where identities cannot
    vouch for its key (an empty closure cell, which may be filled later; a callable that is
    not a plain function, or one that names the function it wraps).

    Example:
        >>> SCALE = 2.0
        >>> f = lambda x: SCALE * x
        >>> guard = capture_guard(f)
        >>> guard.unchanged(f)
        True
        >>> SCALE = 5.0
        >>> guard.unchanged(f)
        False
    """
    if type(f) is not types.FunctionType or getattr(f, "__abstractdiff_wrapped__", None) is not None:
        return None
    guard = CaptureGuard()
    _function_key(f, [], 0, set(), guard)
    return None if guard.refused or guard._code is None else guard


class CaptureWatch:
    """Whether a function still reads the values from its globals and closures that it read
    when the watch was made: the check a prepared operator makes on each call on a backend
    that reuses traces (a changed value must give a new trace, as it does for an unprepared
    call).  A plain function's :class:`CaptureGuard` where identities can vouch for the key
    (a handful of identity tests), else the full :func:`captures` key compared on each call
    (a few microseconds), with the objects it names held weakly: one that dies makes the
    watch report a change, since its ``id`` may be reused.

    Example:
        >>> SCALE = 2.0
        >>> f = lambda x: SCALE * x
        >>> watch = CaptureWatch(f)
        >>> watch.unchanged(f)
        True
        >>> SCALE = 5.0
        >>> watch.unchanged(f)
        False
    """

    __slots__ = ("_guard", "_key", "_refs", "_dead", "unchanged")

    def __init__(self, f: Callable[..., Any]) -> None:
        self._guard = capture_guard(f)
        self._key: Any = None
        self._refs: list[Any] = []
        self._dead = False
        #: ``unchanged(f) -> bool``: the guard's own test where there is one (bound once: it
        #: runs on every prepared call of a backend that reuses traces), else the full key's
        self.unchanged: Callable[[Callable[..., Any]], bool] = (
            self._guard.unchanged if self._guard is not None else self._key_unchanged
        )
        if self._guard is None:
            self._key, alive = captures(f)
            for obj in alive:
                try:
                    self._refs.append(weakref.ref(obj, self._expire))
                except TypeError:  # held strongly: its id cannot be reused while held
                    self._refs.append(obj)

    def _expire(self, _ref: Any) -> None:
        self._dead = True

    def _key_unchanged(self, f: Callable[..., Any]) -> bool:
        return not self._dead and captures(f)[0] == self._key

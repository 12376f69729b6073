"""The one cache utility, under one policy, and the registry users see it through.

Every cache of abstractdiff (plans per user function, preparations and compiled artefacts
per flat function, the training loop's bound loss functions, the implicit adapter's
wrapper families, the composed kernels) evicts the least recently used entry first when it
is bounded (a cache keyed on user objects may instead be bounded by their lives alone, as
the plan cache's table of functions is); lookups take no lock (one dict read is atomic), and a missing entry is built
once even when several threads ask for it.  :class:`LRU` is that map.  Caches keyed on user
objects use :class:`WeakLRU`, the same map keyed by the objects' identity and holding them
weakly: an entry leaves as soon as one of its objects is garbage collected, so a recycled
``id`` can never find a stale entry.  A table whose keys are pure values and whose size is
bounded by the program (a dtype, a code object) is a :class:`Memo`.  What a cached value
depends on besides those objects is keyed by :func:`value_key`, the one keying policy.  Each
cache hangs off the object that owns it (a flat function's preparations and artefacts are
the flat function's).

Every cache is registered under a name, with what it is keyed on and its bound, when it is
made: :func:`cache_info` reports each name's entries, hits and misses (summed over its
instances: one per flat function, per backend...), and :func:`clear_caches` empties them all
(``ad.cache_info()`` and ``ad.clear_caches()``).  tests/test_caches.py scans the package for
a cache made any other way.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, Iterator, NamedTuple, TypeVar

import numpy as np

from ._errors import ArgumentTypeError, InvalidArgumentError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

__all__ = [
    "LRU", "CacheInfo", "Memo", "WeakLRU", "array_fingerprint", "cache_info", "clear_caches", "native_array_key",
    "static_key", "value_key",
]

_MISSING: Any = object()


# ------------------------------------------------------------------ the registry
class CacheInfo(NamedTuple):
    """One registered cache, as :func:`cache_info` reports it.

    ``name``: what it holds; ``keyed_on``: what its entries are keyed on (everything that
    changes a cached result); ``size``: entries held now, over all its instances;
    ``bound``: at most this many entries per instance, least recently used out first
    (``None``: bounded by the lives of the objects in its keys, or by the program, for a
    :class:`Memo`); ``instances``: live instances (one per flat function, per backend...);
    ``hits`` and ``misses``: lookups since the process started or the last
    :func:`clear_caches` (approximate where threads look up at once: the counters take no
    lock).
    """

    name: str
    keyed_on: str
    size: int
    bound: int | None
    instances: int
    hits: int
    misses: int


class _Registered:
    """A registered cache's description and counters, shared by its instances."""

    __slots__ = ("name", "keyed_on", "bound", "hits", "misses", "instances")

    def __init__(self, name: str, keyed_on: str, bound: int | None):
        self.name, self.keyed_on, self.bound = name, keyed_on, bound
        self.hits = self.misses = 0
        # id -> weak reference (not a WeakSet: a Memo, a dict, cannot be hashed)
        self.instances: dict[int, weakref.ref] = {}

    def add(self, cache: Any) -> None:
        key, table = id(cache), self.instances
        table[key] = weakref.ref(cache, lambda _ref: table.pop(key, None))

    def live(self) -> list[Any]:
        return [c for c in (r() for r in list(self.instances.values())) if c is not None]


#: name -> its registration (the registry: a table of the caches, not a cache itself)
_REGISTRY: dict[str, _Registered] = {}
_REGISTRY_LOCK = threading.Lock()


def _register(cache: Any, name: str | None, keyed_on: str, bound: int | None) -> _Registered:
    """``cache``'s registration under ``name``; ``name=None``: a table made with the cache
    utility whose entries are state rather than cached results (an identity table: each
    parameter's one box), counted but never reported or cleared."""
    if not (isinstance(keyed_on, str) and keyed_on) or not (name is None or isinstance(name, str) and name):
        raise ArgumentTypeError("a cache is made with name= (a non-empty str, or None for a table that is not a "
                                "cache) and keyed_on= (a non-empty str)")
    if name is None:
        return _Registered("(not a cache)", keyed_on, bound)
    with _REGISTRY_LOCK:
        registered = _REGISTRY.get(name)
        if registered is None:
            registered = _REGISTRY[name] = _Registered(name, keyed_on, bound)
        elif (registered.keyed_on, registered.bound) != (keyed_on, bound):
            raise InvalidArgumentError(f"two caches registered as {name!r} with different keys or bounds: "
                             f"{(registered.keyed_on, registered.bound)} and {(keyed_on, bound)}")
        registered.add(cache)
    return registered


def cache_info() -> list[CacheInfo]:
    """Every cache abstractdiff holds: its name, what it is keyed on, its size, bound,
    instances, hits and misses (see :class:`CacheInfo`), in the order first made.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> _ = ad.gradient("finite_differences", lambda x: (x**2).sum(), np.ones(2))
        >>> info = {c.name: c for c in ad.cache_info()}
        >>> info["preparations"].keyed_on
        'flat function; backend and options, operator, input shapes and dtypes'
    """
    with _REGISTRY_LOCK:
        registered = list(_REGISTRY.values())
    return [CacheInfo(r.name, r.keyed_on, sum(len(c) for c in live), r.bound, len(live), r.hits, r.misses)
            for r in registered for live in (r.live(),)]


def clear_caches() -> None:
    """Empty every cache abstractdiff holds (as ``jax.clear_caches()`` does jax's) and reset
    their counters.  Later calls plan, prepare and compile again: slower once, never
    different.  The libraries' own caches (jax's jit cache, torch's compiled graphs) are
    theirs to clear.

    Example:
        >>> import abstractdiff as ad, numpy as np
        >>> _ = ad.gradient("finite_differences", lambda x: (x**2).sum(), np.ones(2))
        >>> ad.clear_caches()
        >>> sum(c.size for c in ad.cache_info())
        0
    """
    with _REGISTRY_LOCK:
        registered = list(_REGISTRY.values())
    for r in registered:
        for cache in r.live():
            cache.clear()
        r.hits = r.misses = 0


class LRU(Generic[K, V]):
    """``{key: value}`` with at most ``maxsize`` entries, the least recently used out first
    (``maxsize=None``: unbounded).  Thread-safe: lookups take no lock, writes do, and
    :meth:`get_or_build` builds a missing value once.

    Example:
        >>> cache = LRU(2, name="doctest: letters", keyed_on="a letter")
        >>> cache.put("a", 1); cache.put("b", 2); cache.get("a")
        1
        >>> cache.put("c", 3); sorted(cache.keys())  # "b" was the least recently used
        ['a', 'c']
    """

    __slots__ = ("maxsize", "_entries", "_lock", "_registered", "__weakref__")

    def __init__(self, maxsize: int | None, *, name: str | None, keyed_on: str):
        self.maxsize = maxsize
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.RLock()
        self._registered = _register(self, name, keyed_on, maxsize)

    def get(self, key: K, default: Any = None) -> Any:
        """The value of ``key`` (marked recently used), or ``default``."""
        entries = self._entries
        value = entries.get(key, _MISSING)
        if value is _MISSING:
            self._registered.misses += 1
            return default
        self._registered.hits += 1
        if self.maxsize is not None and len(entries) > 1:
            try:
                entries.move_to_end(key)
            except KeyError:  # dropped by another thread meanwhile
                pass
        return value

    def put(self, key: K, value: V) -> None:
        entries = self._entries
        with self._lock:
            entries[key] = value
            entries.move_to_end(key)
            if self.maxsize is not None:
                while len(entries) > self.maxsize:
                    entries.popitem(last=False)

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        """The value of ``key``, or ``build()`` stored (built once even with several threads)."""
        value = self.get(key, _MISSING)
        if value is not _MISSING:
            return value
        with self._lock:
            value = self._entries.get(key, _MISSING)  # built by another thread meanwhile
            if value is _MISSING:
                value = build()
                self.put(key, value)
            return value

    def pop(self, key: K, default: Any = None) -> Any:
        return self._entries.pop(key, default)

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._entries)

    def values(self) -> list[V]:
        with self._lock:
            return list(self._entries.values())

    def items(self) -> list[tuple[K, V]]:
        with self._lock:
            return list(self._entries.items())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"LRU({len(self._entries)}/{self.maxsize} entries)"


class _Entry(Generic[V]):
    __slots__ = ("value", "refs", "strong")

    def __init__(self, value: V, refs: list[Any], strong: list[Any]):
        self.value = value
        self.refs = refs  # weak references whose callbacks drop the entry
        self.strong = strong  # key objects that cannot be weakly referenced (held by the entry)


class WeakLRU(Generic[V]):
    """``{(objects..., extra key): value}`` keyed by identity, holding the objects weakly.

    ``maxsize``: entries kept, least recently used out first (``None``: unbounded, entries
    leave only when their objects die).  ``hold_unreferenceable``: what to do with a key
    object that cannot be weakly referenced (a dict, an int): hold it strongly in the entry
    until the entry is pushed out (``True``), or not cache at all (``False``: :meth:`put`
    returns the value without storing it).

    Weak-reference callbacks run wherever the garbage collector runs, possibly while this
    thread holds the lock; they only pop one key, which is atomic, and take no lock.

    Example:
        >>> class Obj: pass
        >>> cache = WeakLRU(maxsize=2, name="doctest: objects", keyed_on="an object")
        >>> a = Obj()
        >>> cache.put((a,), "value of a")
        'value of a'
        >>> cache.get((a,))
        'value of a'
        >>> del a
        >>> len(cache)
        0
    """

    def __init__(self, maxsize: int | None = None, *, name: str | None, keyed_on: str,
                 hold_unreferenceable: bool = False):
        self.maxsize = maxsize
        self.hold_unreferenceable = hold_unreferenceable
        self._entries: LRU[Hashable, _Entry[V]] = LRU(maxsize, name=name, keyed_on=keyed_on)  # (registered)
        self._lock = self._entries._lock

    @staticmethod
    def key(objects: tuple[Any, ...], extra: Hashable = None) -> Hashable:
        return (tuple(map(id, objects)), extra)

    def get(self, objects: tuple[Any, ...], extra: Hashable = None) -> V | None:
        """The value stored for these objects (and ``extra``), or ``None``; marks it recently used."""
        # on the hot path of every unprepared operator: one object (the commonest key)
        # without map's overhead
        key = ((id(objects[0]),) if len(objects) == 1 else tuple(map(id, objects)), extra)
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def put(self, objects: tuple[Any, ...], value: V, extra: Hashable = None) -> V:
        """Store ``value`` for the objects; returns it (stored or not, see the class docstring)."""
        key = self.key(objects, extra)
        entries = self._entries
        drop: Callable[[Any], None] = lambda _ref, key=key: entries.pop(key, None)  # noqa: E731
        refs, strong = [], []
        for obj in objects:
            try:
                refs.append(weakref.ref(obj, drop))
            except TypeError:
                if not self.hold_unreferenceable:
                    return value
                strong.append(obj)
        entries.put(key, _Entry(value, refs, strong))
        return value

    def get_or_put(self, objects: tuple[Any, ...], build: Callable[[], V], extra: Hashable = None) -> V:
        """The stored value, or ``build()`` stored (one build per key even with several threads)."""
        value = self.get(objects, extra)
        if value is not None:
            return value
        with self._lock:
            entry = self._entries._entries.get(self.key(objects, extra))  # built by another thread meanwhile
            value = None if entry is None else entry.value
            if value is None:
                value = self.put(objects, build(), extra)
        return value

    def pop(self, objects: tuple[Any, ...], extra: Hashable = None) -> V | None:
        entry = self._entries.pop(self.key(objects, extra), None)
        return None if entry is None else entry.value

    def discard_value(self, value: V) -> None:
        """Remove every entry holding ``value`` (by identity)."""
        for key, entry in self._entries.items():
            if entry.value is value:
                self._entries.pop(key, None)

    def values(self) -> Iterator[V]:
        return iter([e.value for e in self._entries.values()])

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class Memo(dict):  # type: ignore[type-arg]
    """A registered ``dict`` memoising a pure function of values the program has finitely
    many of (a dtype, a code object, a module's name): unbounded, as the program bounds it,
    and read at ``dict`` speed (its lookups are not counted: :class:`CacheInfo` reports 0).

    Example:
        >>> names = Memo(name="doctest: lengths", keyed_on="a word")
        >>> names.setdefault("abc", 3), len(names)
        (3, 1)
    """

    __slots__ = ("_registered", "__weakref__")

    def __init__(self, *, name: str, keyed_on: str):
        super().__init__()
        self._registered = _register(self, name, keyed_on, None)

    def add(self, key: Hashable) -> None:
        """Record ``key`` as seen (a Memo used as a set of the keys met so far)."""
        self[key] = True

    def discard(self, key: Hashable) -> None:
        self.pop(key, None)

    def __repr__(self) -> str:
        return f"Memo({self._registered.name!r}, {len(self)} entries)"


# ------------------------------------------------------------------ the keying policy
#: Python values compared by value; a float by its exact bits (-0.0 is not 0.0, a NaN
#: equals itself), so that two values that give different results never share a key.
_EXACT = (bool, int, str, bytes, complex, type(None))
_MAX_DEPTH = 6


def array_fingerprint(a: np.ndarray) -> tuple:
    """``(ndarray, dtype, shape, digest)``: a numpy array's content key, of any size.

    The digest is BLAKE2b (128 bits) of the array's bytes in C order, so two arrays share a
    fingerprint only if they hold the same bytes, short of a cryptographic collision: no size
    above which the content is ignored.  Strides do not matter (a transposed view and its
    copy key alike), dtype and shape do.
    """
    data = np.ascontiguousarray(a)
    return (np.ndarray, a.dtype.str, a.shape, hashlib.blake2b(data.view(np.uint8).reshape(-1), digest_size=16).digest())


def value_key(value: Any, alive: list[Any] | None = None, *, native: Callable[[Any], Any] | None = None,
              _depth: int = 0) -> Hashable:
    """The cache key of a value that a cached result depends on: abstractdiff's one keying policy.

    Every cache that holds a plan, a sparsity pattern, a kernel or a compiled artefact keys the
    values it does not differentiate with this function:

    * Python numbers, strings, bytes, booleans and ``None`` exactly, as ``(type, value)``
      (``1``, ``1.0`` and ``True`` differ; floats by their bits: ``-0.0`` is not ``0.0``);
    * numpy scalars and arrays by content (:func:`array_fingerprint`), whatever their size;
    * tuples, lists and dicts element by element (dict keys sorted by their own key);
    * another library's array by content too, when ``native`` is given: ``native(value)``
      returns it as numpy, or ``None`` where it cannot (a traced value inside a compiled
      function), which falls back to identity;
    * any other object (a function, a model, a config object) by identity: it is appended to
      ``alive``, which the caller holds weakly alongside the key, so that a new object that
      reuses a dead one's ``id`` never finds its entry.  Never ``repr``: a ``__repr__`` may
      hide the fields that change the result.

    Example:
        >>> value_key(1.0) == value_key(1)
        False
        >>> value_key(np.arange(5)) == value_key(np.arange(5)), value_key(np.arange(5)) == value_key(np.arange(5)[::-1])
        (True, False)
    """
    kind = type(value)
    if kind is float or isinstance(value, float):
        return (kind, float.hex(float(value)))
    if isinstance(value, _EXACT):
        return (kind, value)
    if isinstance(value, np.ndarray) and value.dtype != object:
        return array_fingerprint(value)
    if isinstance(value, np.generic):
        return (kind, value.dtype.str, value.tobytes())
    if _depth < _MAX_DEPTH:
        if kind in (tuple, list) or (isinstance(value, tuple) and hasattr(value, "_fields")):
            return (kind, tuple(value_key(v, alive, native=native, _depth=_depth + 1) for v in value))
        if kind is dict:
            items = [(value_key(k, alive, native=native, _depth=_depth + 1), v) for k, v in value.items()]
            items.sort(key=lambda kv: repr(kv[0]))  # the keys' own keys (exact), in a stable order
            return (dict, tuple((k, value_key(v, alive, native=native, _depth=_depth + 1)) for k, v in items))
    if native is not None:
        as_numpy = native(value)
        if isinstance(as_numpy, np.ndarray) and as_numpy.dtype != object:
            return ("native", kind, array_fingerprint(as_numpy))
    if alive is not None:
        alive.append(value)
    return ("id", id(value))


# ------------------------------------------------- arrays written in place, static leaves
#: The backend of a library's array, or None: :func:`abstractdiff._registry.backend_for`,
#: handed over by the registry when it is imported (it imports the caches, so this module
#: cannot import it).
_owner_of: Callable[[Any], Any] = lambda value: None  # noqa: E731


def set_owner_lookup(lookup: Callable[[Any], Any]) -> None:
    """Give :func:`native_array_key` the registry's ``backend_for``."""
    global _owner_of
    _owner_of = lookup


def native_array_key(value: Any) -> Hashable | None:
    """The content key of another library's array that a compiled trace would freeze but that
    can be written in place (an MLX array: ``G[...] = 3.0`` keeps the Python object), or
    ``None`` where its identity is the right key.

    Identity is right for an immutable array (jax, a TensorFlow tensor: its owning adapter's
    :meth:`~abstractdiff.protocol.Adapter.snapshot` returns the array itself) and for a
    library's variables (``tf.Variable``, torch and paddle tensors: the adapter's
    ``is_variable``), which the library's compiled functions read when they run.  Anything
    else is keyed by its content, read through the owning adapter's ``to_numpy``, whatever its
    size (the policy of numpy arrays, :func:`array_fingerprint`).  A traced value (no concrete
    content) and an object no backend claims give ``None``.
    """
    b = _owner_of(value)
    if b is None:
        return None
    try:
        if b.is_variable(value) or b.snapshot(value) is value:
            return None
        content = b.to_numpy(value)
    except Exception:  # noqa: BLE001 - a traced value (inside the library's compile): identity
        return None
    if not isinstance(content, np.ndarray) or content.dtype == object:
        return None
    return ("native", type(value), array_fingerprint(content))


class _Same:
    """An object in a key, compared by identity and held strongly (so its ``id`` stays its own
    while the key lives), whatever its own ``__eq__`` (an array's is element-wise)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<the {type(self.obj).__name__} at {id(self.obj):#x}>"


class _Unchecked(Exception):
    """An object's state is too large or too deep to key (see :func:`static_key`)."""


#: Objects keyed by identity alone: they hold no state a trace reads that can change under
#: the same object (a function's globals are the captures' business, not a static leaf's).
_BY_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type,
                functools.partial, enum.Enum, types.CodeType)
#: At most this many values are read from one static object (its attributes, theirs...), and
#: at most this deep; a larger one cannot be checked on each call (see :func:`static_key`).
STATE_BUDGET = 512
_STATE_DEPTH = 4


def _value_equality(kind: type) -> bool:
    """Whether ``kind`` defines its own equality (a frozen dataclass, a namedtuple, a Backend):
    its objects are keyed as themselves, trusting it, as jax's static arguments are."""
    return kind.__eq__ is not object.__eq__ and kind.__hash__ is not None


def static_key(leaf: Any, deep: bool = True) -> Hashable:
    """The key of a static leaf of ``(x, args)`` (a leaf that is neither a float nor an array):
    what a plan, a prepared operator and a compiled trace are specialised on.

    * Python numbers, strings, bytes, booleans and ``None`` exactly, ``(type, value)``
      (floats by their bits: ``-0.0`` is not ``0.0``, a NaN equals itself);
    * an object whose class defines its own equality and hash (a frozen dataclass, an enum,
      a backend) as itself: its equality is trusted, as jax trusts a static argument's;
    * functions, methods, classes, modules and any other callable object (a library's
      ``jax.custom_jvp`` function, a model) by identity, as functions are: their attributes
      are not read (a global they read is :mod:`abstractdiff._captures`' business);
    * with ``deep`` (a backend that reuses traces, which freeze what ``f`` reads of the
      object), any other object (an options object of a plain class, a non-frozen
      dataclass, a ``SimpleNamespace``) by identity **and** by its state: its attributes
      (``__dict__`` and ``__slots__``), each keyed by :func:`value_key`'s rules (numbers
      exactly, numpy arrays by content, :func:`native_array_key` for another library's
      arrays, containers element by element, objects in turn by their state), so that
      ``opts.scale = 3.0`` between two calls is a new key, never the old trace.  An object
      whose state holds more than :data:`STATE_BUDGET` values or nests deeper than
      ``_STATE_DEPTH`` cannot be checked on each call: its key is new on every call (the
      unprepared operator plans it again: slower, never stale), and starts with
      ``"unchecked"`` (a prepared operator refuses it; see :mod:`abstractdiff._prepare`);
    * without ``deep`` (a backend that runs ``f`` on each call, which reads the object's
      state then), other objects by identity.

    Keys hold their objects strongly, as the flat function's template does: an ``id`` in a
    live key is never another object's.

    Example:
        >>> class Opts:
        ...     scale = 2.0
        >>> opts = Opts()
        >>> before = static_key(opts)
        >>> opts.scale = 3.0
        >>> static_key(opts) == before, static_key(opts, deep=False) == static_key(opts, deep=False)
        (False, True)
    """
    kind = type(leaf)
    if kind is float or isinstance(leaf, float):
        return (kind, float.hex(float(leaf)))
    if isinstance(leaf, _EXACT) or isinstance(leaf, _BY_IDENTITY):
        return (kind, leaf)
    hashable = kind.__hash__ is not None
    if hashable and (not deep or _value_equality(kind) or callable(leaf)):
        try:
            hash(leaf)
        except TypeError:  # a tuple-like holding something unhashable
            return (kind, _Same(leaf))
        return (kind, leaf)
    if not deep:
        return (kind, _Same(leaf))
    try:
        state = _state_key(leaf, 0, [STATE_BUDGET], set())
    except _Unchecked:
        return ("unchecked", kind, _Same(leaf), object())  # a new object: equal to no other key
    return ("object", kind, _Same(leaf), state)


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """``obj``'s state: its ``__dict__`` and ``__slots__`` entries, by name."""
    found = getattr(obj, "__dict__", None)
    items = sorted(found.items()) if isinstance(found, dict) else []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                items.append((name, getattr(obj, name)))
            except AttributeError:  # a slot never assigned
                items.append((name, _EMPTY_SLOT))
    return items


_EMPTY_SLOT = ("empty slot",)


def _state_key(obj: Any, depth: int, budget: list[int], seen: set[int]) -> tuple:
    if depth >= _STATE_DEPTH:
        raise _Unchecked
    if id(obj) in seen:  # a cycle (a parent pointer): the object is keyed where first met
        return ("seen", _Same(obj))
    seen.add(id(obj))
    return tuple((name, _member_key(v, depth, budget, seen)) for name, v in _attributes(obj))


def _member_key(value: Any, depth: int, budget: list[int], seen: set[int]) -> Hashable:
    """One value inside a static object's state (:func:`static_key`)."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _Unchecked
    kind = type(value)
    if kind is float or isinstance(value, float):
        return (kind, float.hex(float(value)))
    if isinstance(value, _EXACT):
        return (kind, value)
    if isinstance(value, np.ndarray) and value.dtype != object:
        return array_fingerprint(value)
    if isinstance(value, np.generic):
        return (kind, value.dtype.str, value.tobytes())
    if isinstance(value, _BY_IDENTITY) or callable(value):  # a function, or an object that acts as one
        return (kind, _Same(value))
    if kind in (tuple, list, set, frozenset) or isinstance(value, (tuple, list)):
        if depth + 1 >= _STATE_DEPTH:
            raise _Unchecked
        members = [_member_key(v, depth + 1, budget, seen) for v in value]
        if isinstance(value, (set, frozenset)):
            members.sort(key=repr)  # an order of its own: the members' keys, exact
        return (kind, tuple(members))
    if isinstance(value, dict):
        if depth + 1 >= _STATE_DEPTH:
            raise _Unchecked
        items = [(_member_key(k, depth + 1, budget, seen), _member_key(v, depth + 1, budget, seen))
                 for k, v in value.items()]
        items.sort(key=lambda kv: repr(kv[0]))
        return (kind, tuple(items))
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # another library's array
        native = native_array_key(value)
        return (kind, _Same(value)) if native is None else native
    if _value_equality(kind):
        try:
            hash(value)
        except TypeError:
            pass
        else:
            return (kind, value)
    return ("object", kind, _Same(value), _state_key(value, depth + 1, budget, seen))

"""Backends by name: a lazy table of the built-in adapters, plus third-party ones.

Nothing here imports an AD library.  A built-in adapter's module is imported when its
backend is first created; availability is decided with ``importlib.util.find_spec``,
which locates a package without importing it (einops' rule: never import a framework
to find out whether it is there).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import _cache
from . import _pytree as pytree
from ._hooks import AdapterHooks
from .protocol import Adapter

if TYPE_CHECKING:  # annotations only: the backend module imports this one
    from ._backend import Backend
from ._errors import ArgumentTypeError, BackendUnavailableError, InvalidArgumentError, UnknownBackendError

__all__ = ["available_backends", "backend", "register_backend", "registered_backends"]

ENTRY_POINT_GROUP = "abstractdiff.backends"


@dataclass
class _Entry:
    target: str | Callable[..., Backend]  # "module:attr", or a factory
    requires: tuple[str, ...] = ()  # top-level modules that must be importable
    extra: str | None = None  # pip extra that installs them
    runtime: bool = False  # registered by ad.register_backend in this process
    # top-level modules whose objects the backend handles (default: requires); lets
    # backend_for find it for a leaf before the adapter module is imported
    modules: tuple[str, ...] = ()
    distribution: str | None = None  # the installed distribution of an entry point

    @property
    def handles(self) -> tuple[str, ...]:
        return self.modules or self.requires


# The one place in abstractdiff/ that names AD libraries: which adapter module serves
# which library.  Everything else about a library is a hook of its adapter class.
_BUILTIN: dict[str, _Entry] = {
    "finite_differences": _Entry("abstractdiff.adapters.finite_differences:FiniteDifferencesBackend"),
    "autograd": _Entry("abstractdiff.adapters.autograd:AutogradAdapter", ("autograd",), "autograd"),
    "jax": _Entry("abstractdiff.adapters.jax:JaxAdapter", ("jax", "jaxlib"), "jax", modules=("jax", "jaxlib", "keras")),
    "tensorflow": _Entry(
        "abstractdiff.adapters.tensorflow:TensorFlowAdapter", ("tensorflow",), "tensorflow",
        modules=("tensorflow", "keras", "tf_keras"),
    ),
    "torch": _Entry("abstractdiff.adapters.torch:TorchAdapter", ("torch",), "torch", modules=("torch", "keras")),
    "mlx": _Entry("abstractdiff.adapters.mlx:MLXAdapter", ("mlx",), "mlx"),
    "paddle": _Entry("abstractdiff.adapters.paddle:PaddleAdapter", ("paddle",), "paddle"),
    "pytensor": _Entry("abstractdiff.adapters.pytensor:PyTensorAdapter", ("pytensor",), "pytensor"),
    "implicit": _Entry("abstractdiff._implicit_backend:Implicit"),
}

_registry: dict[str, _Entry] = dict(_BUILTIN)
# (name, options) -> the one backend made of them: not a cache (never cleared), since the
# instance's identity is what ad.backend promises
_instances: dict[Any, Backend] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def register_backend(
    name: str,
    factory: Callable[..., Backend] | str,
    *,
    requires: tuple[str, ...] = (),
    replace: bool = False,
    modules: tuple[str, ...] = (),
) -> None:
    """Register a backend under ``name``.

    ``factory(**options) -> Backend`` is called by :func:`backend`; it may also be a
    ``"module:attribute"`` string, imported on first use.  ``requires`` names modules
    that must be importable for the backend to count as available.  ``modules`` names
    the top-level modules whose arrays and variables the backend handles (default:
    ``requires``, else the class's ``modules`` once created): ``ad.to_numpy``,
    checkpoints, the optimisers and ``ad.Params`` find the backend of an object by it.
    Registering an existing name raises ``ValueError`` unless ``replace=True``.

    Example:
        >>> import abstractdiff as ad
        >>> from abstractdiff.adapters.finite_differences import FiniteDifferencesBackend
        >>> ad.register_backend("coarse_fd", lambda **o: FiniteDifferencesBackend(step=1e-3, **o))
        >>> ad.backend("coarse_fd").name
        'finite_differences'
    """
    if not isinstance(name, str) or not name:
        raise ArgumentTypeError(f"backend name must be a non-empty string, got {name!r}")
    if not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise ArgumentTypeError(
            f"factory must be a callable returning a Backend or a 'module:attribute' string, "
            f"got {factory!r}"
        )
    with _lock:
        if name in _registry and not replace:
            raise InvalidArgumentError(
                f"a backend named {name!r} is already registered; pass replace=True to replace it"
            )
        _registry[name] = _Entry(factory, tuple(requires), runtime=True, modules=tuple(modules))
        for key in [k for k in _instances if k[0] == name]:
            del _instances[key]
        _OWNERS.clear()


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _registry:
            _registry[ep.name] = _Entry(ep.value, distribution=getattr(getattr(ep, "dist", None), "name", None))
    _OWNERS.clear()


_PACKAGE_DISTRIBUTIONS: dict[str, list[str]] | None = None


def _distributions_providing(modules: set[str]) -> set[str]:
    """Installed distributions that ship one of these top-level modules (read once, lazily)."""
    global _PACKAGE_DISTRIBUTIONS
    if _PACKAGE_DISTRIBUTIONS is None:
        from importlib.metadata import packages_distributions

        _PACKAGE_DISTRIBUTIONS = packages_distributions()
    return {d for m in modules for d in _PACKAGE_DISTRIBUTIONS.get(m, ())}


def registered_backends() -> list[str]:
    """Every registered backend name (built-in, registered, entry points), sorted.

    ``registered_backends() -> list[str]``, whether or not each one's library is
    installed; see :func:`available_backends` for those that can be created here.

    Example:
        >>> import abstractdiff as ad
        >>> {"finite_differences", "implicit", "jax", "torch"} <= set(ad.registered_backends())
        True
    """
    _load_entry_points()
    return sorted(_registry)


def _missing_module(entry: _Entry) -> str | None:
    for module in entry.requires:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):
            return module
    return None


def available_backends() -> list[str]:
    """The registered backends whose AD library is installed here, sorted.

    ``available_backends() -> list[str]``.  Decided without importing any AD library
    (``importlib.util.find_spec``).  ``"implicit"`` is always listed: it differentiates
    variables with an inner backend (``ad.Implicit(name)``) rather than arrays.

    Example:
        >>> import abstractdiff as ad
        >>> "finite_differences" in ad.available_backends()   # numpy only: always there
        True
    """
    _load_entry_points()
    return sorted(name for name, entry in _registry.items() if _missing_module(entry) is None)


def installed_backends() -> list[str]:
    """The available backends that are built in or installed through the entry-point group,
    leaving out those registered at run time with :func:`register_backend` (the default
    backends of the conformance suite: what another test registered must not join it)."""
    return [name for name in available_backends() if not _registry[name].runtime]


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot be created here, or ``None`` if it can."""
    entry = _lookup(name)
    missing = _missing_module(entry)
    if missing is None:
        return None
    return _install_hint(name, entry, missing)


def _install_hint(name: str, entry: _Entry, module: str) -> str:
    extra = entry.extra
    how = f"pip install 'abstractdiff[{extra}]'" if extra else f"pip install {module}"
    return f"backend {name!r} needs the {module!r} library, which is not installed here: {how}"


def _lookup(name: str) -> _Entry:
    entry = _registry.get(name)
    if entry is None:
        _load_entry_points()
        entry = _registry.get(name)
    if entry is None:
        raise UnknownBackendError(
            f"no backend named {name!r}; registered backends: {', '.join(sorted(_registry))}. "
            f"Third-party adapters register with ad.register_backend or the "
            f"{ENTRY_POINT_GROUP!r} entry-point group"
        )
    return entry


def _resolve(name: str, entry: _Entry) -> Callable[..., Backend]:
    target = entry.target
    # Checked before a callable factory too: register_backend(requires=...) promises it.
    missing = _missing_module(entry)
    if missing is not None:
        raise BackendUnavailableError(_install_hint(name, entry, missing), name=missing)
    if callable(target):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        failed = err.name or module_name
        raise BackendUnavailableError(
            f"backend {name!r} could not be imported ({err}); "
            + (f"pip install 'abstractdiff[{entry.extra}]'" if entry.extra else f"check that {failed!r} is installed"),
            name=failed,
        ) from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BackendUnavailableError(
            f"backend {name!r} is registered as {target!r}, but module {module_name!r} has no attribute "
            f"{attr!r}; fix the registration (ad.register_backend or the {ENTRY_POINT_GROUP!r} entry point)",
            name=module_name,
        ) from None


def backend(name: str | Backend, **options: Any) -> Backend:
    """The backend registered as ``name``, created with ``options``.

    ``backend(name, **options) -> Backend``.  Options are the adapter's (``device="gpu"``,
    ``compile=False``, ``step=`` ...).  Instances are shared: the same name and options
    return the same object, so its caches of prepared functions are reused.  A
    :class:`Backend` instance passes through unchanged.

    Raises:
        UnknownBackendError: no backend of that name (the message lists them).
        BackendUnavailableError: its library is not installed (the message names the extra).

    Example:
        >>> import abstractdiff as ad
        >>> ad.backend("finite_differences")
        FiniteDifferencesBackend(device='cpu', step=None, compute_dtype=None)
    """
    if isinstance(name, AdapterHooks):  # a backend already made (every backend is an AdapterHooks)
        if options:
            raise ArgumentTypeError("options cannot be given with a Backend instance")
        return name
    if not isinstance(name, str):
        raise ArgumentTypeError(f"backend name must be a string, got {type(name).__name__}")
    entry = _lookup(name)
    try:
        # Option types are part of the key: compile=1 must reach the adapter (and its
        # TypeError) rather than share the instance made with compile=True.
        key: Any = (name, tuple(sorted((k, type(v), v) for k, v in options.items())))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _instances:
        return _instances[key]
    factory = _resolve(name, entry)
    if isinstance(factory, type) and issubclass(factory, Adapter):  # an adapter of the protocol: held
        factory = functools.partial(_holder(), factory)
    chunk_size = options.get("chunk_size")
    core_chunks = "chunk_size" in options and not _takes_option(factory, "chunk_size")
    if core_chunks:  # chunking is the core's: an adapter need not know the option
        options = {k: v for k, v in options.items() if k != "chunk_size"}
    instance = factory(**options)
    if not isinstance(instance, AdapterHooks):
        raise ArgumentTypeError(
            f"the factory registered as {name!r} returned {type(instance).__name__}, not an "
            f"abstractdiff.Backend; subclass abstractdiff.Backend"
        )
    if core_chunks:
        instance._take_chunk_size(chunk_size)
    if key is not None:
        with _lock:
            instance = _instances.setdefault(key, instance)
            _OWNERS.clear()  # a new backend may own types that were unknown so far
    return instance


#: The core's backend class that holds an adapter of the protocol; the backend module, which
#: imports this one, hands it over (:func:`hold_adapters_in`), so the registry imports no backend.
_HOLDER: list[type] = []


def hold_adapters_in(holder: type) -> None:
    """Make ``holder(adapter_class, **options)`` the backend of every adapter of the protocol."""
    _HOLDER[:] = [holder]


def _holder() -> type:
    return _HOLDER[0]  # set as abstractdiff imports (its __init__ imports the backend module first)


def _takes_option(factory: Callable[..., Any], option: str) -> bool:
    """Whether ``factory`` accepts the keyword ``option`` (or any keyword)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): hand it the option
        return True
    return any(p.name == option or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


# ------------------------------------------------------- the backend of an object
# type -> the backend owning objects of that type (None: numpy or unknown); cleared
# whenever a backend is registered or created, so an unknown type is looked up again.
# Weak: classes made at run time may die.
_OWNERS: _cache.WeakLRU[tuple[Backend | None]] = _cache.WeakLRU(
    name="backend of a type", keyed_on="an object's type (held weakly)", hold_unreferenceable=True
)


def owns(b: Backend, obj: Any) -> bool:
    """Whether ``obj`` is one of ``b``'s arrays (traced ones too), variables or models."""
    try:
        return bool(b.is_native(obj) or b.is_variable(obj) or b.model_variables(obj) is not None)
    except Exception:  # a hook that cannot answer for a foreign object does not own it
        return False


def _modules_of(t: type) -> set[str]:
    # abstractdiff's own objects (ad.Variable, Params, Grads) are the core's business
    found = {(getattr(c, "__module__", None) or "").partition(".")[0] for c in t.__mro__}
    return found - {"builtins", "numpy", "abstractdiff", ""}


def _quiet_backend(name: str) -> Backend | None:
    try:
        return backend(name)
    except Exception:  # noqa: BLE001  a backend that cannot be created owns nothing here
        return None


def _find_owner(obj: Any) -> Backend | None:
    t = type(obj)
    if t is np.ndarray or isinstance(obj, np.generic):
        return None
    # 0. a class an adapter module defines for its library (MLX has no variable objects: its
    #    adapter's parameter references stand for arrays of an mlx.nn.Module) is that backend's
    for c in t.__mro__:
        module = getattr(c, "__module__", None) or ""
        if module.startswith("abstractdiff.adapters."):
            for name, entry in list(_registry.items()):
                if isinstance(entry.target, str) and entry.target.partition(":")[0] == module:
                    b = _quiet_backend(name)
                    if b is not None and owns(b, obj):
                        return b
    mods = _modules_of(t)
    if not mods:
        return None
    _load_entry_points()
    # 1. registered backends that declare one of the object's modules (it is imported:
    #    the object exists), so creating that backend imports nothing new
    for name, entry in list(_registry.items()):
        # ... and whose own library is imported too: Keras objects on the jax Keras backend
        # must not import TensorFlow
        if set(entry.handles) & mods and all(m in sys.modules for m in entry.requires):
            b = _quiet_backend(name)
            if b is not None and owns(b, obj):
                return b
    # 2. backends already created whose class declares the module (entry-point adapters)
    for b in list(_instances.values()):
        if set(b.modules) & mods and owns(b, obj):
            return b
    # 3. entry-point adapters of the object's library, not created yet: named after one of
    #    its modules, living in its package, or shipped by the distribution that ships it
    #    (importing the adapter module then imports only a library that is already loaded)
    candidates = [
        (name, entry) for name, entry in list(_registry.items())
        if isinstance(entry.target, str) and entry.distribution is not None
    ]
    if not candidates:
        return None
    providers: set[str] | None = None
    for name, entry in candidates:
        package = entry.target.partition(":")[0].partition(".")[0]
        if name not in mods and package not in mods:
            if providers is None:
                providers = _distributions_providing(mods)
            if entry.distribution not in providers:
                continue
        b = _quiet_backend(name)
        if b is not None and set(b.modules) & mods and owns(b, obj):
            return b
    return None


def foreign_pytree_node(obj: Any) -> tuple[str, Callable, Callable] | None:
    """``(registry, flatten, unflatten)`` when an imported library's own pytree registry knows
    ``obj``'s class as a container (a class registered with ``jax.tree_util``), else ``None``:
    the adapters' :meth:`~abstractdiff.protocol.Adapter.pytree_node` hook.

    Asked of the adapters whose library is already imported (so it imports nothing new),
    when a flatten meets a leaf of a class abstractdiff does not know
    (:mod:`abstractdiff._pytree`): on any backend, such a leaf would otherwise silently get
    no gradient.
    """
    for name, entry in list(_registry.items()):
        if not entry.requires or not all(m in sys.modules for m in entry.requires):
            continue
        b = _quiet_backend(name)
        try:
            node = b.pytree_node(obj) if b is not None else None
        except Exception:  # noqa: BLE001  an adapter that cannot answer for a foreign object does not know it
            continue
        if node is not None:
            return (f"the {name} library's own pytree registry", *node)
    return None


pytree.set_node_finder(foreign_pytree_node)


def backend_for(obj: Any) -> Backend | None:
    """The backend whose library ``obj`` (an array, a traced value, a variable, a model)
    belongs to, or ``None`` for numpy and objects no backend claims.

    ``backend_for(obj) -> Backend | None``.  Found by the object's type, the way einops'
    ``get_backend`` does: only backends declaring one of the type's modules (which is
    therefore already imported) are asked, so this never imports an AD library the user
    has not imported.  Answers are remembered per type.

    Example:
        >>> import numpy as np
        >>> from abstractdiff._registry import backend_for
        >>> backend_for(np.ones(2)) is None     # numpy: the core's own defaults
        True
    """
    t = type(obj)
    found = _OWNERS.get((t,))  # (owner,): the owner may be None
    if found is not None:
        return found[0]
    owner = _find_owner(obj)
    _OWNERS.put((t,), (owner,))
    return owner


_cache.set_owner_lookup(backend_for)  # the caches key another library's arrays through it

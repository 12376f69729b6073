"""One cache mechanism, visible and clearable (issue 47): every cache abstractdiff holds is
made with the cache utility (``abstractdiff._cache``: LRU, WeakLRU, Memo) and registered, so
``ad.cache_info()`` reports it and ``ad.clear_caches()`` empties it; a scan of the source
finds no cache made any other way."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import abstractdiff as ad
from abstractdiff import optim

ROOT = Path(ad.__file__).resolve().parent
SOURCES = sorted(ROOT.rglob("*.py")) + sorted((ROOT.parent / "adapters").rglob("*.py"))


def _sizes() -> dict[str, int]:
    return {c.name: c.size for c in ad.cache_info()}


def test_cache_info_describes_each_cache():
    ad.gradient("finite_differences", lambda x: (x**2).sum(), np.ones(3))
    info = {c.name: c for c in ad.cache_info()}
    prep = info["preparations"]
    assert prep.bound is not None and prep.bound > 0 and "operator" in prep.keyed_on
    assert prep.size >= 1 and prep.instances >= 1 and prep.misses >= 1
    assert all(isinstance(c, ad.CacheInfo) and c.keyed_on for c in info.values())


def _every_feature(torch, jax) -> list:
    """Each feature once: every operator prepared and unprepared, Sparse, SecondOrder,
    Implicit, differentiate_with, custom rules, loops and a compiled train_step.  Returns
    the functions and models, which the caches hold weakly: their entries live with them."""
    from abstractdiff._operator_table import OPERATORS

    b = ad.backend("torch")
    x = torch.linspace(0.5, 1.5, 3, dtype=torch.float64)
    t = torch.ones(3, dtype=torch.float64)
    keep: list = []
    for op in OPERATORS.values():
        if op.family in ("derivative", "second_derivative"):
            f, x0 = (lambda x: x**3), x[0]
        elif op.family in ("pullback", "pushforward", "jacobian"):
            f, x0 = (lambda x: x**2), x
        else:
            f, x0 = (lambda x: (x**3).sum()), x
        extra = (t,) if op.takes_tangent else ()
        keep.append(f)
        for out in (getattr(ad, op.name)(b, f, x0, *extra), getattr(ad, op.prepare_name)(b, f, x0, *extra)(x0, *extra)):
            if op.family in ("pullback", "pushforward"):  # a function of the (co)tangent
                (out[1] if isinstance(out, tuple) else out)(t)
    keep.append(lambda x: (x[1:] * x[:-1]).sum() + (x**3).sum())
    ad.hessian(ad.Sparse(b), keep[-1], x)
    ad.hessian(ad.SecondOrder("finite_differences", b), keep[-1], x)
    m = torch.nn.Linear(3, 1).double()
    keep += [m, lambda: m(x).sum()]
    ad.gradient(ad.Implicit(b), keep[-1], ad.Params(m))

    composed = ad.differentiate_with(lambda x: jax.numpy.sin(x).sum(), "jax")
    keep += [composed, lambda x: composed(x)]
    ad.gradient(b, keep[-1], x)

    @ad.custom_vjp
    def cube(x):
        return x**3

    cube.defvjp(lambda x: (x**3, x), lambda x, g: (3 * x**2 * g,))
    keep += [cube, lambda x: cube(x).sum(), lambda x: ad.fori_loop(0, 3, lambda i, c: c * x, x).sum()]
    ad.gradient(b, keep[-2], x)
    ad.gradient(b, keep[-1], x)
    model = {"w": jax.numpy.ones(3)}
    state = optim.setup(optim.Adam(0.1), model)
    keep.append(lambda m, x: ((m["w"] * x) ** 2).sum())
    ad.train_step(keep[-1], model, (jax.numpy.ones(3),), state, backend="jax")
    return keep


def test_clear_caches_empties_every_registered_cache_and_changes_no_result():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    keep = _every_feature(torch, jax)
    before = _sizes()
    for name in ("preparations", "plans", "compiled artefacts", "Sparse plan tables", "differentiate_with kernels",
                 "compiled training steps", "training step forms", "plans per function"):
        assert before.get(name, 0) > 0, f"{name}: no entry after every feature ran ({before})"
    ad.clear_caches()
    after = _sizes()
    assert {name: n for name, n in after.items() if n} == {}
    assert all(c.hits == 0 and c.misses == 0 for c in ad.cache_info())
    # recomputed after clearing, to the same value
    x = torch.linspace(0.5, 1.5, 3, dtype=torch.float64)
    torch.testing.assert_close(ad.gradient("torch", keep[0], x), 3 * x**2)


# ------------------------------------------------------------------ the source scan
#: Module-level tables that are state, not caches (clearing one would change a result), or
#: registries filled at import: each with the reason it is not a cache.
NOT_CACHES = {
    ("_cache.py", "_REGISTRY"): "the registry of caches itself",
    ("_registry.py", "_instances"): "ad.backend's one instance per name and options: its identity is promised",
    ("_registry.py", "_HOLDER"): "the backend class handed over at import",
    ("portable/__init__.py", "_APPLIED"): "the translations registered with autoray (state of autoray's registry)",
    ("testing/_portable.py", "_FUNCTIONS"): "the portable functions, registered at import",
    ("torch.py", "_SHARES_NUMPY"): "tensors sharing a numpy array's memory: forgetting one would skip its snapshot",
    ("paddle.py", "_OWN"): "tensors the adapter made (nobody else can write them): state, as torch's",
    ("pytensor.py", "_LIVE_OPS"): "the live Ops a pickled reference resolves to",
}
_FORBIDDEN_CALLS = {"lru_cache", "cache", "WeakKeyDictionary", "WeakValueDictionary", "cached_property"}
_UTILITY = {"LRU", "WeakLRU", "Memo"}


def _name(call: ast.expr) -> str:
    return call.attr if isinstance(call, ast.Attribute) else call.id if isinstance(call, ast.Name) else ""


def _where(path: Path) -> str:
    return path.relative_to(ROOT if ROOT in path.parents else ROOT.parent / "adapters").as_posix()


def _scan(source: str, where: str) -> list[str]:
    """What in ``source`` (the module at ``where``) is a cache made outside the utility."""
    found = []
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) in _UTILITY:
            if not any(k.arg == "name" for k in node.keywords):
                found.append(f"{where}:{node.lineno}: {_name(node.func)} made without name=")
        for d in getattr(node, "decorator_list", []):
            if _name(d.func if isinstance(d, ast.Call) else d) in _FORBIDDEN_CALLS:
                found.append(f"{where}:{node.lineno}: a functools cache")
    for node in tree.body:  # module-level mutable tables
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is None:
            continue
        name = ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        empty = (isinstance(value, ast.Dict) and not value.keys) or (
            isinstance(value, (ast.Set, ast.List)) and not value.elts)
        made = isinstance(value, ast.Call) and (_name(value.func) in _FORBIDDEN_CALLS or (
            _name(value.func) in {"dict", "set", "list"} and not value.args))
        if (empty or made) and (where, name) not in NOT_CACHES:
            found.append(f"{where}:{node.lineno}: module-level table {name} = {ast.unparse(value)}")
    return found


def test_no_cache_outside_the_utility():
    found = [line for path in SOURCES if not (path.name == "_cache.py" and path.parent == ROOT)
             for line in _scan(path.read_text(), _where(path))]
    assert found == [], "caches made outside abstractdiff._cache (use LRU, WeakLRU or Memo, registered):\n" + \
        "\n".join(found)


def test_the_scan_finds_planted_caches():
    planted = """
import functools, weakref
from abstractdiff._cache import LRU
_SEEN = {}
_TYPES: set = set()
_OWNERS = weakref.WeakKeyDictionary()
_PLANS = LRU(8)
TABLE = {"a": 1}

@functools.lru_cache(maxsize=8)
def f(x):
    return x
"""
    found = _scan(planted, "planted.py")
    assert sorted(line.split(": ", 1)[1] for line in found) == sorted([
        "LRU made without name=", "a functools cache", "module-level table _SEEN = {}",
        "module-level table _TYPES = set()", "module-level table _OWNERS = weakref.WeakKeyDictionary()",
    ])

"""WeakLRU: the one cache keyed on user objects (plans, bound losses, wrapper families)."""

from __future__ import annotations

import gc
import threading

from abstractdiff._cache import WeakLRU


class Obj:
    pass


def test_entry_dies_with_any_of_its_objects():
    cache: WeakLRU[str] = WeakLRU(name="test: objects", keyed_on="objects")
    a, b = Obj(), Obj()
    cache.put((a, b), "ab")
    cache.put((a,), "a")
    assert cache.get((a, b)) == "ab" and len(cache) == 2
    del b
    gc.collect()
    assert len(cache) == 1 and cache.get((a,)) == "a"


def test_bounded_least_recently_used_out_first():
    cache: WeakLRU[int] = WeakLRU(maxsize=2, name="test: two objects", keyed_on="objects")
    objs = [Obj() for _ in range(3)]
    cache.put((objs[0],), 0)
    cache.put((objs[1],), 1)
    cache.get((objs[0],))  # 0 is now the most recently used
    cache.put((objs[2],), 2)
    assert cache.get((objs[1],)) is None and cache.get((objs[0],)) == 0 and len(cache) == 2


def test_unreferenceable_objects_are_held_or_not_cached():
    held: WeakLRU[str] = WeakLRU(name="test: objects", keyed_on="objects", hold_unreferenceable=True)
    key = {"a dict": "cannot be weakly referenced"}
    held.put((key,), "kept")
    assert held.get((key,)) == "kept"
    skipped: WeakLRU[str] = WeakLRU(name="test: objects", keyed_on="objects")
    assert skipped.put((key,), "value") == "value" and len(skipped) == 0


def test_extra_key_and_discard_value():
    cache: WeakLRU[str] = WeakLRU(name="test: objects", keyed_on="objects")
    a = Obj()
    cache.put((a,), "x", extra=1)
    cache.put((a,), "y", extra=2)
    assert cache.get((a,), 1) == "x" and cache.get((a,), 2) == "y"
    cache.discard_value("x")
    assert cache.get((a,), 1) is None and len(cache) == 1


def test_get_or_put_builds_once_under_threads():
    cache: WeakLRU[object] = WeakLRU(name="test: objects", keyed_on="objects")
    a = Obj()
    builds = []
    barrier = threading.Barrier(8)

    def build() -> object:
        builds.append(1)
        return object()

    results = []

    def worker() -> None:
        barrier.wait()
        results.append(cache.get_or_put((a,), build))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len({id(r) for r in results}) == 1
